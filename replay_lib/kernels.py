"""The numerical kernels: plain eager PyTorch, vectorized over the concatenated token axis.

These are the single source of truth: the replay stages call them and the capture side (and the
example trainer) import them, so "expected" and "actual" are produced by the same formulas.

Precision: every kernel takes ``dtype`` (default float32, what the capture side and the example trainer
compute in, unchanged). The replay calls them with float64 on the recorded values (SPEC §5.1): the
float64 result is the truth a legitimate producer approximates, and ``replay_lib.error_model`` bounds how
far its rounding may take it.

Token layout: per-token tensors are 1-D, every sample's response tokens concatenated in index order.
``segment_ids(lengths)`` maps each token to its sample; segment sums are ``index_add_`` over that map.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Optional

import torch

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
STD_EPS = 1e-6
# low_var_kl's clamp of the k3 value
KL_CLAMP = 10.0


def segment_ids(lengths: torch.Tensor) -> torch.Tensor:
    """``[Σ lengths]`` int64: the sample index of every token."""
    lengths = lengths.to(torch.int64)
    return torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int64), lengths)


def segment_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64: where each sample's tokens start in the concatenated axis."""
    lengths = lengths.to(torch.int64)
    return torch.cumsum(lengths, 0) - lengths


def segment_sum(values: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=values.dtype)
    return out.index_add_(0, seg, values)


def group_normalize(
    raw_rewards: torch.Tensor, group_index: torch.Tensor, std_normalization: bool, eps: float = STD_EPS,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """GRPO reward post-processing by *semantic group* (``group_index``), never by physical batch.

    ``g = r − mean(r_group)``; with std normalization ``g / (std_unbiased(r_group) + eps)``, in ``dtype``.
    The mean is taken of ``r − min(r_group)`` and shifted back, which is the same value mathematically
    but exact for a group of equal rewards (0, not a rounding residue). A singleton group under std
    normalization has an undefined unbiased std: the result is NaN, which the comparison reports.
    """
    r = raw_rewards.to(dtype)
    if r.numel() == 0:
        return r.clone()
    _, inverse, counts = torch.unique(group_index.to(torch.int64), return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    group_min = torch.full((n_groups,), float("inf"), dtype=dtype).scatter_reduce(
        0, inverse, r, reduce="amin", include_self=True
    )
    shifted = r - group_min[inverse]
    mean = segment_sum(shifted, inverse, n_groups) / counts.to(dtype)
    centered = shifted - mean[inverse]
    if std_normalization:
        var = segment_sum(centered * centered, inverse, n_groups) / (counts - 1).to(dtype)
        std = torch.sqrt(var)
        centered = centered / (std[inverse] + eps)
    return centered


def batch_normalize(raw_rewards: torch.Tensor, batch_size: int, std_normalization: bool, eps: float = STD_EPS) -> torch.Tensor:
    """The PR #65 bug, kept for fixtures and the example trainer's ``--pr65-bug`` flag: rewards are
    normalized against consecutive *physical* batches of ``batch_size`` samples instead of their group."""
    batch = torch.arange(raw_rewards.numel(), dtype=torch.int64) // max(int(batch_size), 1)
    return group_normalize(raw_rewards, batch, std_normalization, eps)


def compute_approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, kl_loss_type: str,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token KL estimate with ``r = log_probs − log_probs_base``, in ``dtype``.

    k1 = r; k2 = r²/2; k3 = exp(−r) − 1 + r; low_var_kl = k3 clamped to [−10, 10].
    """
    if kl_loss_type not in KL_TYPES:
        raise ValueError(f"unknown kl_loss_type {kl_loss_type!r} (expected one of {', '.join(KL_TYPES)})")
    log_ratio = log_probs.to(dtype) - log_probs_base.to(dtype)
    if kl_loss_type == "k1":
        return log_ratio
    if kl_loss_type == "k2":
        return log_ratio * log_ratio / 2.0
    neg = -log_ratio
    kl = neg.exp() - 1 - neg
    if kl_loss_type == "low_var_kl":
        kl = torch.clamp(kl, min=-KL_CLAMP, max=KL_CLAMP)
    return kl


def rollout_kl(
    old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor | None, kl_coef: float, kl_loss_type: str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """advantage.kl: rollout vs reference; all zeros when ``kl_coef == 0`` (no reference needed)."""
    if kl_coef == 0:
        return torch.zeros(old_log_probs.shape[0], dtype=dtype)
    if ref_log_probs is None:
        raise ValueError("ref_log_probs is required when kl_coef != 0")
    return compute_approx_kl(old_log_probs, ref_log_probs, kl_loss_type, dtype=dtype)


def get_grpo_returns(rewards: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GRPO advantages: each sample's normalized reward broadcast over its response tokens.
    KL does not enter GRPO advantages."""
    return torch.repeat_interleave(rewards.to(dtype), lengths.to(torch.int64))


def compute_policy_loss(
    ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate: ``(pg_losses, clipfrac)`` with ``ppo_kl = old − logp``, in the dtype of
    ``ppo_kl``."""
    pg_losses, clipfrac, _ = policy_loss_terms(ppo_kl, advantages, eps_clip, eps_clip_high)
    return pg_losses, clipfrac


def policy_loss_terms(
    ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`compute_policy_loss` and the ratio ``exp(−ppo_kl)`` it took: ``(pg_losses, clipfrac, ratio)``."""
    ratio = (-ppo_kl).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).to(ppo_kl.dtype)
    return pg_losses, clipfrac, ratio


def sorted_segment_sums(values: torch.Tensor, seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(samples, sums)``: the sums of the rows ``values[k, :]`` over each run of equal ``seg`` (sorted, as a
    chunk of the token axis is), ``sums[k, j]`` for sample ``samples[j]``: one cumulative sum per chunk for
    every column at once instead of an ``index_add_`` per column. For float64 accumulation (the cumulative
    sum's rounding is ~1e-16 of the chunk's partial sums; float32 sums keep their order with ``index_add_``)."""
    change = torch.ones(seg.numel(), dtype=torch.bool)
    change[1:] = seg[1:] != seg[:-1]
    starts = torch.nonzero(change).reshape(-1)
    ends = torch.cat([starts[1:], torch.tensor([seg.numel()])]) - 1
    prefix = values.cumsum(1)
    sums = prefix[:, ends]
    sums[:, 1:] -= prefix[:, ends[:-1]]
    return seg[starts], sums


def sum_of_sample_mean(values: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor, n_samples: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Σ_samples Σ_t x·mask / max(Σ_t mask, 1)``: the sum of per-sample masked means."""
    mask = mask.to(dtype)
    per_sample = segment_sum(values.to(dtype) * mask, seg, n_samples)
    denom = torch.clamp_min(segment_sum(mask, seg, n_samples), 1.0)
    return (per_sample / denom).sum()


LOSS_FIELDS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl")


# Tokens per pass of :func:`policy_loss_fields`: a million-token step then needs a few small temporaries
# instead of a dozen full-length ones. Below torch's parallel grain size (32768), so ops stay on one thread.
LOSS_CHUNK = 1 << 14


def token_chunks(lengths: torch.Tensor, chunk: int = LOSS_CHUNK) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, stop, seg)`` for consecutive chunks of the token axis; ``seg`` is the sample of each token of
    the chunk: the chunk's first sample plus the number of later samples starting at or before the token (an
    empty sample starts where the next one does, so it is skipped). A serial scan, where repeat_interleave
    would fan out to every thread for each chunk."""
    lengths = lengths.to(torch.int64)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    total = int(ends[-1]) if lengths.numel() else 0
    for start in range(0, total, chunk):
        stop = min(start + chunk, total)
        first = int(torch.searchsorted(ends, start, right=True))
        last = int(torch.searchsorted(ends, stop - 1, right=True))
        marks = torch.zeros(stop - start, dtype=torch.int64)
        marks.index_add_(0, starts[first + 1:last + 1] - start, torch.ones(last - first, dtype=torch.int64))
        yield start, stop, marks.cumsum_(0).add_(first)


def masked_sample_sums(
    lengths: torch.Tensor, loss_mask: torch.Tensor, columns: Callable[[int, int, torch.Tensor], Mapping[str, torch.Tensor]],
    dtypes: Mapping[str, torch.dtype],
) -> dict[str, torch.Tensor]:
    """Per-sample masked sums ``Σ_t x_t·mask_t`` of the per-token columns ``columns(start, stop, mask chunk)``
    returns for each chunk (:func:`token_chunks`), each accumulated in its ``dtypes[name]`` by ``index_add_``
    in token order (the same additions in the same order as one pass over all tokens)."""
    n = lengths.numel()
    sums = {name: torch.zeros(n, dtype=dt) for name, dt in dtypes.items()}
    for start, stop, seg in token_chunks(lengths):
        for name, x in columns(start, stop, seg).items():
            sums[name].index_add_(0, seg, x)
    return sums


def policy_loss_fields(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    entropy: torch.Tensor | None,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    entropy_coef: float,
    dtype: torch.dtype = torch.float32,
) -> Mapping[str, torch.Tensor]:
    """The reported loss.policy fields: ``loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl`` (0-d ``dtype``).

    Each field is :func:`sum_of_sample_mean` of its per-token value. The masked per-sample sums are
    accumulated chunk by chunk; ``index_add_`` adds in token order either way, so the result is the same
    as one pass over all tokens.
    """
    sums = masked_sample_sums(lengths, loss_mask, policy_loss_columns(
        log_probs, old_log_probs, advantages, entropy, loss_mask, eps_clip=eps_clip, eps_clip_high=eps_clip_high,
        dtype=dtype), {name: dtype for name in POLICY_SUMS})
    return policy_fields_from_sums(sums, entropy is not None, entropy_coef)


# The per-sample sums :func:`policy_loss_fields` reduces: Σ_t x·mask of the surrogate, the clip indicator,
# ppo_kl and entropy, and Σ_t mask.
POLICY_SUMS = ("pg", "clip", "kl", "ent", "mask")


def policy_loss_columns(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, entropy: Optional[torch.Tensor],
    loss_mask: torch.Tensor, *, eps_clip: float, eps_clip_high: float, dtype: torch.dtype,
) -> Callable[[int, int, torch.Tensor], dict[str, torch.Tensor]]:
    """The masked per-token terms of :data:`POLICY_SUMS` for one chunk, in ``dtype``."""
    mask = loss_mask.to(dtype)

    def columns(start: int, stop: int, seg: torch.Tensor) -> dict[str, torch.Tensor]:
        m = mask[start:stop]
        ppo_kl = old_log_probs[start:stop].to(dtype) - log_probs[start:stop].to(dtype)
        pg_losses, clipfrac = compute_policy_loss(ppo_kl, advantages[start:stop].to(dtype), eps_clip, eps_clip_high)
        out = {"pg": pg_losses * m, "clip": clipfrac * m, "kl": ppo_kl * m}
        if entropy is not None:
            out["ent"] = entropy[start:stop].to(dtype) * m
        out["mask"] = m
        return out

    return columns


def policy_fields_from_sums(sums: Mapping[str, torch.Tensor], has_entropy: bool,
                            entropy_coef: float) -> dict[str, torch.Tensor]:
    """The five loss.policy fields from the per-sample sums of :data:`POLICY_SUMS`: each a sum over samples of
    the masked means (``Σ_t x·mask / max(Σ_t mask, 1)``)."""
    denom = torch.clamp_min(sums["mask"], 1.0)
    pg_loss = (sums["pg"] / denom).sum()
    entropy_loss = (sums["ent"] / denom).sum() if has_entropy else torch.zeros((), dtype=pg_loss.dtype)
    return {
        "loss": pg_loss - entropy_coef * entropy_loss,
        "pg_loss": pg_loss,
        "entropy_loss": entropy_loss,
        "pg_clipfrac": (sums["clip"] / denom).sum(),
        "ppo_kl": (sums["kl"] / denom).sum(),
    }


class GrpoReturns:
    """:func:`get_grpo_returns` evaluated a slice at a time: ``view[lo:hi]`` is the ``dtype`` advantages of
    tokens ``lo … hi − 1`` (each its sample's reward), without a full-length tensor."""

    def __init__(self, rewards: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        self.rewards = rewards.to(dtype)
        self.ends = torch.cumsum(lengths.to(torch.int64), 0)
        self.dtype = dtype
        self.shape = torch.Size([int(self.ends[-1]) if self.ends.numel() else 0])

    def numel(self) -> int:
        return self.shape[0]

    def __len__(self) -> int:
        return self.shape[0]

    def sample_of(self, lo: int, hi: int) -> torch.Tensor:
        """The sample of each token ``lo … hi − 1`` (an empty sample ends where it starts: skipped)."""
        return torch.searchsorted(self.ends, torch.arange(lo, hi, dtype=torch.int64), right=True)

    def __getitem__(self, index: slice) -> torch.Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("GrpoReturns takes a contiguous slice")
        lo, hi, _ = index.indices(self.shape[0])
        return self.rewards[self.sample_of(lo, max(lo, hi))]

    def materialize(self) -> torch.Tensor:
        return self[0:self.shape[0]]
