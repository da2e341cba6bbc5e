"""reward.post_process kernels: group normalization by semantic group (and the PR #65 batch bug for fixtures)."""

from __future__ import annotations

import torch

from .segments import segment_sum


STD_EPS = 1e-6


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
