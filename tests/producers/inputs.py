"""The recorded inputs every producer family starts from: random but shaped like a real GRPO step.

One seed gives the same inputs to every family, so two families differ only in their numerics. Everything is
drawn with NumPy's PCG64 straight into float32 (or float64 for the rewards) and kept flat over the
concatenated token axis: 512 × 16,384 tokens are a few 32 MiB arrays and well under a second to draw.

* log-probs: ``old_log_probs`` log-uniform in −1 … −0.01; ``log_probs`` and ``ref_log_probs`` move away from
  it by a log-uniform 1e-3 … 0.3 of either sign, so some ratios leave the clip range (ln 0.8 ≈ −0.22,
  ln 1.28 ≈ 0.25) and clipping happens on both sides;
* loss masks: ones, with a few runs of zeros per sample (tool output, truncated turns), never at a sample's
  first token (so a mask shifted by one token changes every sample);
* raw rewards: ``binary`` {0, 1}; ``partial`` partial credit {0, 0.3, 0.5, 0.7, 1} with a quarter of the
  groups all-equal (0.3 mostly: the zero-std hazard); ``rm`` reward-model scores ≈ 3 ± 0.05 kept as float64,
  each group with its own spread (10⁻⁴ … 0.05), the ill-conditioned case for normalization.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

REWARD_KINDS = ("binary", "partial", "rm")
PARTIAL_CREDIT = np.array([0.0, 0.3, 0.5, 0.7, 1.0])


@dataclass(frozen=True)
class Size:
    """``samples`` responses of at most ``tokens`` tokens each, in groups of ``group_size``."""

    samples: int
    tokens: int
    group_size: int = 8

    def __str__(self) -> str:
        return f"{self.samples}x{self.tokens}"


@dataclass
class Inputs:
    """Flat recorded inputs of one step (token arrays are ``[Σ lengths]``, sample arrays ``[samples]``)."""

    lengths: np.ndarray  # int64
    mask: np.ndarray  # uint8
    old_log_probs: np.ndarray  # float32
    log_probs: np.ndarray  # float32
    ref_log_probs: np.ndarray  # float32
    entropy: np.ndarray  # float32
    raw_rewards: np.ndarray  # float64
    groups: np.ndarray  # int64, group of each sample (consecutive samples share one)

    @property
    def offsets(self) -> np.ndarray:
        return np.cumsum(self.lengths) - self.lengths

    @property
    def group_bounds(self) -> list[tuple[int, int]]:
        """``[(start, stop)]`` sample ranges of the semantic groups (they are contiguous here)."""
        starts = np.flatnonzero(np.r_[True, self.groups[1:] != self.groups[:-1]])
        stops = np.r_[starts[1:], self.groups.size]
        return [(int(a), int(b)) for a, b in zip(starts, stops)]


def _log_uniform(rng: np.random.Generator, low: float, high: float, n: int) -> np.ndarray:
    """float32 values whose log10 is uniform in [log10 low, log10 high]."""
    u = rng.random(n, dtype=np.float32)
    return np.power(np.float32(10.0), np.float32(np.log10(low)) + u * np.float32(np.log10(high / low)))


def _moved(rng: np.random.Generator, base: np.ndarray) -> np.ndarray:
    """``base`` moved by a log-uniform 1e-3 … 0.3 of either sign, kept a log-probability (< 0)."""
    step = _log_uniform(rng, 1e-3, 0.3, base.size)
    sign = np.where(rng.random(base.size, dtype=np.float32) < 0.5, np.float32(-1.0), np.float32(1.0))
    return np.minimum(base + sign * step, np.float32(-1e-5))


def _lengths(rng: np.random.Generator, size: Size) -> np.ndarray:
    """Response lengths between 3/4 of ``tokens`` and ``tokens`` (short sizes keep at least one token)."""
    low = max(1, (3 * size.tokens) // 4)
    return rng.integers(low, size.tokens + 1, size.samples).astype(np.int64)


def _mask(rng: np.random.Generator, lengths: np.ndarray) -> np.ndarray:
    """Ones with a few runs of zeros per sample (about 2 runs, geometric lengths of mean 8), never at a
    sample's first token."""
    total = int(lengths.sum())
    mask = np.ones(total, dtype=np.uint8)
    offsets = np.cumsum(lengths) - lengths
    runs = rng.poisson(2.0, lengths.size)
    for start, n, k in zip(offsets.tolist(), lengths.tolist(), runs.tolist()):
        if n < 3:
            continue
        at = rng.integers(1, n, k)
        span = rng.geometric(1 / 8, k)
        for a, s in zip(at.tolist(), span.tolist()):
            mask[start + a: start + min(n, a + s)] = 0
    return mask


def _raw_rewards(rng: np.random.Generator, kind: str, samples: int, group_size: int) -> np.ndarray:
    n_groups = samples // group_size
    if kind == "binary":
        return rng.integers(0, 2, samples).astype(np.float64)
    if kind == "partial":
        raw = rng.choice(PARTIAL_CREDIT, samples)
        for g in np.flatnonzero(rng.random(n_groups) < 0.25).tolist():
            value = 0.3 if rng.random() < 0.75 else float(rng.choice(PARTIAL_CREDIT))
            raw[g * group_size:(g + 1) * group_size] = value
        return raw
    if kind == "rm":
        base = 3.0 + 0.05 * rng.standard_normal(n_groups)
        spread = 10.0 ** rng.uniform(-4.0, np.log10(0.05), n_groups)
        noise = rng.standard_normal((n_groups, group_size))
        return (base[:, None] + spread[:, None] * noise).reshape(-1)
    raise ValueError(f"unknown reward kind {kind!r} (expected one of {', '.join(REWARD_KINDS)})")


def make_inputs(seed: int, size: Size, rewards: str = "binary") -> Inputs:
    """The inputs of one step: the same for every family given the same ``seed``, ``size`` and ``rewards``."""
    if size.samples % size.group_size:
        raise ValueError(f"samples ({size.samples}) must be a multiple of group_size ({size.group_size})")
    rng = np.random.Generator(np.random.PCG64(seed))
    lengths = _lengths(rng, size)
    total = int(lengths.sum())
    mask = _mask(rng, lengths)
    old = -_log_uniform(rng, 1e-2, 1.0, total)
    logp = _moved(rng, old)
    ref = _moved(rng, old)
    entropy = rng.exponential(0.8, total).astype(np.float32)
    raw = _raw_rewards(rng, rewards, size.samples, size.group_size)
    groups = np.arange(size.samples, dtype=np.int64) // size.group_size
    return Inputs(lengths=lengths, mask=mask, old_log_probs=old, log_probs=logp, ref_log_probs=ref,
                  entropy=entropy, raw_rewards=raw, groups=groups)
