"""The numerical kernels: plain eager PyTorch, float32, vectorized over the concatenated token axis.

These are the single source of truth: the replay stages call them and the capture side (and the
example trainer) import them, so "expected" and "actual" are produced by the same code.

Token layout: per-token tensors are 1-D, every sample's response tokens concatenated in index order.
``segment_ids(lengths)`` maps each token to its sample; segment sums are ``index_add_`` over that map.
"""

from __future__ import annotations

from typing import Mapping

import torch

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
STD_EPS = 1e-6


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
    raw_rewards: torch.Tensor, group_index: torch.Tensor, std_normalization: bool, eps: float = STD_EPS
) -> torch.Tensor:
    """GRPO reward post-processing by *semantic group* (``group_index``), never by physical batch.

    ``g = r − mean(r_group)``; with std normalization ``g / (std_unbiased(r_group) + eps)``.
    The mean is taken of ``r − min(r_group)`` and shifted back, which is the same value mathematically
    but exact for a group of equal rewards (0, not a rounding residue). A singleton group under std
    normalization has an undefined unbiased std: the result is NaN, which the comparison reports.
    """
    r = raw_rewards.to(torch.float32)
    if r.numel() == 0:
        return r.clone()
    _, inverse, counts = torch.unique(group_index.to(torch.int64), return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    group_min = torch.full((n_groups,), float("inf"), dtype=torch.float32).scatter_reduce(
        0, inverse, r, reduce="amin", include_self=True
    )
    shifted = r - group_min[inverse]
    mean = segment_sum(shifted, inverse, n_groups) / counts.to(torch.float32)
    centered = shifted - mean[inverse]
    if std_normalization:
        var = segment_sum(centered * centered, inverse, n_groups) / (counts - 1).to(torch.float32)
        std = torch.sqrt(var)
        centered = centered / (std[inverse] + eps)
    return centered


def batch_normalize(raw_rewards: torch.Tensor, batch_size: int, std_normalization: bool, eps: float = STD_EPS) -> torch.Tensor:
    """The PR #65 bug, kept for fixtures and the example trainer's ``--pr65-bug`` flag: rewards are
    normalized against consecutive *physical* batches of ``batch_size`` samples instead of their group."""
    batch = torch.arange(raw_rewards.numel(), dtype=torch.int64) // max(int(batch_size), 1)
    return group_normalize(raw_rewards, batch, std_normalization, eps)


def compute_approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, kl_loss_type: str) -> torch.Tensor:
    """Per-token KL estimate with ``r = log_probs − log_probs_base``.

    k1 = r; k2 = r²/2; k3 = exp(−r) − 1 + r; low_var_kl = k3 clamped to [−10, 10].
    """
    if kl_loss_type not in KL_TYPES:
        raise ValueError(f"unknown kl_loss_type {kl_loss_type!r} (expected one of {', '.join(KL_TYPES)})")
    log_ratio = log_probs.to(torch.float32) - log_probs_base.to(torch.float32)
    if kl_loss_type == "k1":
        return log_ratio
    if kl_loss_type == "k2":
        return log_ratio * log_ratio / 2.0
    neg = -log_ratio
    kl = neg.exp() - 1 - neg
    if kl_loss_type == "low_var_kl":
        kl = torch.clamp(kl, min=-10.0, max=10.0)
    return kl


def rollout_kl(
    old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor | None, kl_coef: float, kl_loss_type: str
) -> torch.Tensor:
    """advantage.kl: rollout vs reference; all zeros when ``kl_coef == 0`` (no reference needed)."""
    if kl_coef == 0:
        return torch.zeros(old_log_probs.shape[0], dtype=torch.float32)
    if ref_log_probs is None:
        raise ValueError("ref_log_probs is required when kl_coef != 0")
    return compute_approx_kl(old_log_probs, ref_log_probs, kl_loss_type)


def get_grpo_returns(rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """GRPO advantages: each sample's normalized reward broadcast over its response tokens.
    KL does not enter GRPO advantages."""
    return torch.repeat_interleave(rewards.to(torch.float32), lengths.to(torch.int64))


def compute_policy_loss(
    ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate: ``(pg_losses, clipfrac)`` with ``ppo_kl = old − logp``."""
    ratio = (-ppo_kl).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).to(torch.float32)
    return pg_losses, clipfrac


def sum_of_sample_mean(values: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor, n_samples: int) -> torch.Tensor:
    """``Σ_samples Σ_t x·mask / max(Σ_t mask, 1)``: the sum of per-sample masked means."""
    mask = mask.to(torch.float32)
    per_sample = segment_sum(values.to(torch.float32) * mask, seg, n_samples)
    denom = torch.clamp_min(segment_sum(mask, seg, n_samples), 1.0)
    return (per_sample / denom).sum()


LOSS_FIELDS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl")


# Tokens per pass of :func:`policy_loss_fields`: a million-token step then needs a few small temporaries
# instead of a dozen full-length ones. Below torch's parallel grain size (32768), so ops stay on one thread.
LOSS_CHUNK = 1 << 14


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
) -> Mapping[str, torch.Tensor]:
    """The reported loss.policy fields: ``loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl`` (0-d float32).

    Each field is :func:`sum_of_sample_mean` of its per-token value. The masked per-sample sums are
    accumulated chunk by chunk; ``index_add_`` adds in token order either way, so the result is the same
    as one pass over all tokens.
    """
    lengths = lengths.to(torch.int64)
    n = lengths.numel()
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    total = int(ends[-1]) if n else 0
    mask = loss_mask.to(torch.float32)
    pg_sum, clip_sum, kl_sum, ent_sum, mask_sum = (torch.zeros(n, dtype=torch.float32) for _ in range(5))
    for start in range(0, total, LOSS_CHUNK):
        stop = min(start + LOSS_CHUNK, total)
        # the sample of each token of the chunk: the chunk's first sample plus the number of later samples
        # starting at or before the token (an empty sample starts where the next one does, so it is skipped);
        # a serial scan, where repeat_interleave would fan out to every thread for each chunk
        first = int(torch.searchsorted(ends, start, right=True))
        last = int(torch.searchsorted(ends, stop - 1, right=True))
        marks = torch.zeros(stop - start, dtype=torch.int64)
        marks.index_add_(0, starts[first + 1:last + 1] - start, torch.ones(last - first, dtype=torch.int64))
        seg = marks.cumsum_(0).add_(first)
        m = mask[start:stop]
        ppo_kl = old_log_probs[start:stop].to(torch.float32) - log_probs[start:stop].to(torch.float32)
        pg_losses, clipfrac = compute_policy_loss(ppo_kl, advantages[start:stop].to(torch.float32), eps_clip,
                                                  eps_clip_high)
        pg_sum.index_add_(0, seg, pg_losses * m)
        clip_sum.index_add_(0, seg, clipfrac * m)
        kl_sum.index_add_(0, seg, ppo_kl * m)
        if entropy is not None:
            ent_sum.index_add_(0, seg, entropy[start:stop].to(torch.float32) * m)
        mask_sum.index_add_(0, seg, m)
    denom = torch.clamp_min(mask_sum, 1.0)
    pg_loss = (pg_sum / denom).sum()
    entropy_loss = (ent_sum / denom).sum() if entropy is not None else torch.zeros((), dtype=torch.float32)
    return {
        "loss": pg_loss - entropy_coef * entropy_loss,
        "pg_loss": pg_loss,
        "entropy_loss": entropy_loss,
        "pg_clipfrac": (clip_sum / denom).sum(),
        "ppo_kl": (kl_sum / denom).sum(),
    }
