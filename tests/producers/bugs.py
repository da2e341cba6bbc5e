"""The bug classes the replay must catch, each a :class:`~producers.base.Plan` that departs from the
declared config in exactly one place, run through a clean family's own numerics.

``BUGS[name]`` is ``(first divergent stage, what the bug is)``; :func:`plan_for` builds the Plan and says
which configs a bug needs (k1-for-k3 needs a declared k3 with kl_coef ≠ 0, biased std needs std normalization).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from .base import TOKEN_MEAN, Config, Family, Plan

BUGS: dict[str, tuple[str, str]] = {
    "sign_flip": ("advantage.estimate", "advantages are the negated normalized rewards"),
    "k1_for_k3": ("advantage.kl", "the KL payload is k1 where the config declares k3"),
    "biased_std": ("reward.post_process", "group std with ddof=0 under std normalization"),
    "clip_high_both": ("loss.policy", "eps_clip_high used for the lower clip bound too"),
    "mask_shift": ("loss.policy", "the loss mask shifted one token later in every sample"),
    "token_mean": ("loss.policy", "a global token mean where the bundle declares a sum of per-sample means"),
    "pr65": ("reward.post_process", "rewards normalized over consumer batches of 1.5 groups (PR #65)"),
}


# The smallest step (tokens) at which eps_clip_high-for-both stays above the storage rounding of bf16 copies.
CLIP_VISIBLE_STORED = 4096


def visible(bug: str, family: Family, per_sample: bool = False, tokens: int = CLIP_VISIBLE_STORED) -> bool:
    """Whether the bug stays above the noise the family declares, on a step of ``tokens``. A family that
    declares ``compute: bfloat16`` licenses ~2⁻⁸ relative noise per token, more than the loss bugs move the
    scalars by on small steps (a few 1e-2 at 16 × 256): those are asserted on the float32 and float64 families.
    A family whose payloads are stored coarser than its declared compute (bf16 copies of float32 values) leaves
    each scalar ``2·2⁻⁸·Σ|∂x|·|x|`` of their rounding (≈ 2 % of pg_loss): more than a one-token mask shift moves
    the scalars (with the per-sample terms, ``per_sample``, the exact ``mask_count`` still catches it), and more
    than eps_clip_high for both bounds does on fewer than 4,096 tokens (0.54 of it at 8 × 16, 3.0 at 32 × 512)."""
    declared = (family.precision or {}).get("compute", "float32")
    if BUGS[bug][0] != "loss.policy":
        return True
    if declared == "bfloat16":
        return False
    stored = family.payload(np.zeros(1, dtype=np.float32)).dtype
    if not (stored in (torch.bfloat16, torch.float16) and declared in ("float32", "float64")):
        return True
    if bug == "mask_shift":
        return per_sample
    return bug != "clip_high_both" or tokens >= CLIP_VISIBLE_STORED


def bug_config(bug: str, config: Config) -> Config:
    """``config`` adjusted so that ``bug`` is expressible: k1-for-k3 declares k3 with a KL coefficient,
    biased std turns std normalization on; the others take any config."""
    if bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (expected one of {', '.join(BUGS)})")
    if bug == "k1_for_k3":
        return dataclasses.replace(config, kl_type="k3", kl_coef=config.kl_coef or 0.05)
    if bug == "biased_std":
        return dataclasses.replace(config, std_normalization=True)
    return config


def plan_for(config: Config, bug: Optional[str], group_size: int) -> Plan:
    """What the producer's code does for ``config`` with ``bug`` injected (``None``: a clean producer)."""
    plan = Plan.clean(config)
    if bug is None:
        return plan
    if bug_config(bug, config) != config:
        raise ValueError(f"bug {bug!r} needs another config than {config} (see bug_config)")
    if bug == "sign_flip":
        return dataclasses.replace(plan, advantage_sign=-1.0)
    if bug == "k1_for_k3":
        return dataclasses.replace(plan, kl_type="k1")
    if bug == "biased_std":
        return dataclasses.replace(plan, ddof=0)
    if bug == "clip_high_both":
        return dataclasses.replace(plan, eps_clip=config.eps_clip_high)
    if bug == "mask_shift":
        return dataclasses.replace(plan, mask_shift=1)
    if bug == "token_mean":
        return dataclasses.replace(plan, loss_agg=TOKEN_MEAN)
    return dataclasses.replace(plan, normalize_batch=group_size + group_size // 2)  # pr65
