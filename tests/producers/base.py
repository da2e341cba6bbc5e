"""What a producer family is: the four computations whose numerics differ between real trainers.

A family turns the recorded inputs into the bundle's expected values with its own code, in its own precision
and reduction order — never with ``replay_lib.kernels`` (shared code would hide exactly the fidelity bugs the
replay exists to find). The driver (:func:`producers.produce_parts`) owns everything else: the inputs, the
bundle layout and the bug being injected, so that a family is four small functions:

* :meth:`Family.normalize` — GRPO group normalization (``reward.post_process``), mean and unbiased std + 1e-6;
* :meth:`Family.kl` — the per-token rollout-vs-reference KL (``advantage.kl``): k1, k2, k3, low_var_kl;
* :meth:`Family.advantages` — the normalized rewards broadcast over each sample's tokens (``advantage.estimate``);
* :meth:`Family.loss` — SPEC §4 ``loss.policy``: the clipped surrogate, reduced as a sum of per-sample masked
  means (or, for the token-mean bug, one global token mean), in the family's reduction order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from .inputs import Inputs

STD_EPS = 1e-6
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_FIELDS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl")
# SPEC §4 per-sample loss terms (``expected.json $.loss.policy.per_sample``) by the token term they sum.
PER_SAMPLE_NAMES = {"pg": "pg_sum", "ent": "entropy_sum", "kl": "kl_sum", "clip": "clip_count", "mask": "mask_count"}
SUM_OF_SAMPLE_MEANS = "sum_of_sample_means"
TOKEN_MEAN = "token_mean"


@dataclass(frozen=True)
class Config:
    """What the bundle declares (its RecomputeConfig) and which rewards the step had."""

    kl_type: str = "k3"
    kl_coef: float = 0.05
    std_normalization: bool = True
    rewards: str = "binary"
    entropy_coef: float = 0.0
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28

    def __str__(self) -> str:
        kl = f"{self.kl_type}@{self.kl_coef:g}" if self.kl_coef else "kl-off"
        return f"{self.rewards},{'std' if self.std_normalization else 'nostd'},{kl},ent{self.entropy_coef:g}"


@dataclass(frozen=True)
class Plan:
    """What the producer's code actually does. A clean producer does what its Config declares; a bug is a
    Plan that departs from it in one place (:mod:`producers.bugs`)."""

    kl_type: str
    eps_clip: float
    eps_clip_high: float
    ddof: int = 1
    advantage_sign: float = 1.0
    mask_shift: int = 0
    loss_agg: str = SUM_OF_SAMPLE_MEANS
    # PR #65: rewards normalized over consecutive physical batches of this many samples, not the groups.
    normalize_batch: Optional[int] = None

    @classmethod
    def clean(cls, config: Config) -> "Plan":
        return cls(kl_type=config.kl_type, eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high)


@dataclass
class LossInputs:
    """What the loss consumed: recorded log-probs, entropy and mask, and the advantages the family holds
    (float32 for a float32 producer, its float64 values for the float64 one)."""

    log_probs: np.ndarray
    old_log_probs: np.ndarray
    advantages: np.ndarray
    entropy: np.ndarray
    mask: np.ndarray  # uint8
    lengths: np.ndarray


@dataclass
class Family:
    """One legitimate producer. ``precision`` is what it declares as ``comparison_policy.producer_precision``
    (``None``: it declares nothing, the default float32/float32)."""

    name: str
    precision: Optional[dict] = None
    # Options a family's constructor takes (block size, ranks, payload dtype …), shown in bench tables.
    options: dict = field(default_factory=dict)

    def prepare(self, inputs: Inputs) -> Inputs:
        """The inputs as this producer records them (the bf16 family rounds its log-probs)."""
        return inputs

    def payload(self, values: np.ndarray) -> torch.Tensor:
        """A recorded per-token payload tensor (float32 unless the family stores another dtype)."""
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def micro_batches(self, samples: int) -> list[int]:
        """The micro-batch of every sample (provenance in index.json); 8 samples each by default."""
        return [i // 8 for i in range(samples)]

    def normalize(self, raw: np.ndarray, bounds: list[tuple[int, int]], std: bool, ddof: int) -> np.ndarray:
        """float64 raw rewards → normalized rewards, in this family's precision (as a float64 array)."""
        raise NotImplementedError

    def recorded(self, rewards: np.ndarray) -> np.ndarray:
        """Normalized rewards as expected.json records them: rounded to float32 (a no-op for a float32
        producer, the one final rounding for the float64 one)."""
        return rewards.astype(np.float32).astype(np.float64)

    def kl(self, old: np.ndarray, ref: np.ndarray, kl_type: str) -> np.ndarray:
        """Per-token KL with ``r = old − ref`` (float32 holding this family's values)."""
        raise NotImplementedError

    def advantages(self, rewards: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(recorded float32 advantages, the advantages the loss consumes)``: the rewards broadcast."""
        adv = np.repeat(rewards.astype(np.float32), lengths)
        return adv, adv

    def loss(self, li: LossInputs, *, eps_clip: float, eps_clip_high: float, entropy_coef: float,
             agg: str) -> dict[str, float]:
        """The five loss.policy scalars (Python floats holding this family's float32 results)."""
        raise NotImplementedError

    def sample_sums(self, li: LossInputs, *, eps_clip: float, eps_clip_high: float) -> dict[str, np.ndarray]:
        """Per sample, ``Σ_t x·mask`` of the surrogate (``pg``), entropy (``ent``), log-ratio (``kl``) and clip
        indicator (``clip``), and ``Σ_t mask`` (``mask``), as this family's loss reduces each sample (float64
        arrays holding its values): the optional per-sample loss terms of SPEC §4."""
        raise NotImplementedError


def per_sample_terms(sums: dict[str, np.ndarray]) -> dict[str, list[float]]:
    """:meth:`Family.sample_sums` as ``expected.json $.loss.policy.per_sample`` records it."""
    return {PER_SAMPLE_NAMES[k]: np.asarray(v, dtype=np.float64).tolist() for k, v in sums.items()}


def check_kl_type(kl_type: str) -> None:
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown kl_type {kl_type!r} (expected one of {', '.join(KL_TYPES)})")


def shifted_mask(mask: np.ndarray, lengths: np.ndarray, shift: int) -> np.ndarray:
    """The loss mask moved ``shift`` tokens later inside every sample (an off-by-one in the loss: the
    first ``shift`` tokens of each sample read as masked, the last ``shift`` mask values are dropped)."""
    if shift == 0:
        return mask
    out = np.zeros_like(mask)
    start = 0
    for n in lengths.tolist():
        if n > shift:
            out[start + shift:start + n] = mask[start:start + n - shift]
        start += n
    return out
