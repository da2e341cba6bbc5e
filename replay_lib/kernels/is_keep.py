"""The 0/1 keep masks of an off-policy correction (``bundle.is_keep``: SkyRL's outlier, token and sequence masks,
``off_policy_correction_utils.py`` @ a9564572 below ``opc.py``): per token and per sample, in ``dtype``."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..bundle.is_keep import LOG_CLAMP, Spec
from .segments import masked_sample_sums


def _in_bounds(x: torch.Tensor, low: Optional[float], high: Optional[float]) -> torch.Tensor:
    """``low ≤ x ≤ high`` (a null bound passes): opc.py:108-118 (``>`` high, ``<`` low drop), 176, 227-229."""
    keep = torch.ones_like(x, dtype=torch.bool)
    if low is not None:
        keep &= ~(x < low)
    if high is not None:
        keep &= ~(x > high)
    return keep


def token_ratio(old: torch.Tensor, rollout: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exp(clamp(old − rollout, ±20))`` (opc.py: safe_exp_delta)."""
    return (old.to(dtype) - rollout.to(dtype)).clamp(-LOG_CLAMP, LOG_CLAMP).exp()


def token_keep(old: torch.Tensor, rollout: torch.Tensor, spec: Spec, dtype: torch.dtype) -> torch.Tensor:
    """The token mask's 0/1 per token (1 without one): opc.py:170-178."""
    for kind, low, high in spec:
        if kind == "token":
            return _in_bounds(token_ratio(old, rollout, dtype), low, high).to(dtype)
    return torch.ones(old.shape, dtype=dtype)


def sample_keep(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, loss_mask: torch.Tensor,
                lengths: torch.Tensor, spec: Spec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per sample (``[n]`` each): ``is_keep_sample`` (the outlier and sequence masks' 0/1), ``is_keep_stat`` (the
    sequence mask's log statistic: the summed or mean log-ratio over the loss tokens the outlier and token masks
    kept, opc.py:222-224, 240-241; 0 without one) and ``is_keep_count`` (those tokens). The outlier mask drops
    a sample with any loss token out of its bounds (opc.py:108-121); the sequence mask is taken over the mask
    the first two left (opc.py:319, 327, then 337-345)."""
    outlier = next(((lo, hi) for k, lo, hi in spec if k == "outlier"), None)
    sequence = next(((k, lo, hi) for k, lo, hi in spec if k in ("geometric", "product")), None)
    mask = loss_mask.to(dtype)

    def columns(start: int, stop: int, seg: torch.Tensor) -> dict[str, torch.Tensor]:
        m = mask[start:stop]
        old, roll = old_log_probs[start:stop], rollout_log_probs[start:stop]
        out = {"mask": m}
        if outlier is not None:
            out["out"] = m * (~_in_bounds(token_ratio(old, roll, dtype), *outlier)).to(dtype)
        kept = m * token_keep(old, roll, spec, dtype)
        out["kept"] = kept
        out["lr"] = (old.to(dtype) - roll.to(dtype)) * kept
        return out

    names = ["mask", "kept", "lr"] + (["out"] if outlier is not None else [])
    sums = masked_sample_sums(lengths, loss_mask, columns, {k: dtype for k in names})
    keep = torch.ones_like(sums["mask"])
    count, lr = sums["kept"], sums["lr"]
    if outlier is not None:
        ok = sums["out"] == 0
        keep = keep * ok.to(dtype)
        count, lr = count * ok.to(dtype), lr * ok.to(dtype)
    stat = torch.zeros_like(lr)
    if sequence is not None:
        kind, low, high = sequence
        stat = lr / count.clamp_min(1.0) if kind == "geometric" else lr
        keep = keep * _in_bounds(stat.clamp(-LOG_CLAMP, LOG_CLAMP).exp(), low, high).to(dtype)
    return {"is_keep_sample": keep, "is_keep_stat": stat, "is_keep_count": count}


def keep_weight(old: torch.Tensor, rollout: Optional[torch.Tensor], spec: Spec, seg: Optional[torch.Tensor],
                sample_terms, dtype: torch.dtype) -> torch.Tensor:
    """Each token's 0/1: its token mask × its sample's outlier and sequence masks."""
    if rollout is None:
        raise ValueError("rollout_log_probs is required for is_keep")
    keep = token_keep(old, rollout, spec, dtype)
    if sample_terms is not None and "is_keep_sample" in sample_terms:
        keep = keep * sample_terms["is_keep_sample"][seg].to(dtype)
    return keep


def edge_samples(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, loss_mask: torch.Tensor,
                 lengths: torch.Tensor, spec: Spec, u: float, seg: torch.Tensor) -> list[tuple[int, str]]:
    """The samples a keep decision of which lies within rounding of its edge (``u``: the producer's unit
    roundoff): a token whose log-ratio is within ``8u·(1 + |old| + |rollout|)`` of a bound's log, a sequence
    statistic within ``8u·Σ(1 + |old − rollout| + |old| + |rollout|)`` (over its count for the mean) of a
    bound's log. ``[(sample, what)]``, the first hit of each sample."""
    f64 = torch.float64
    old, roll = old_log_probs.to(f64), rollout_log_probs.to(f64)
    on = loss_mask > 0
    lr = old - roll
    scale = 8.0 * u * (1.0 + old.abs() + roll.abs())
    hits: dict[int, str] = {}
    for kind, low, high in spec:
        if kind in ("outlier", "token"):
            near = torch.zeros_like(on)
            for b in (low, high):
                if b is not None:
                    near |= (lr - math.log(b)).abs() <= scale
            for i in torch.unique(seg[near & on]).tolist():
                hits.setdefault(int(i), f"a token's {kind} mask decision")
    sequence = next(((k, lo, hi) for k, lo, hi in spec if k in ("geometric", "product")), None)
    if sequence is not None:
        kind, low, high = sequence
        terms = sample_keep(old_log_probs, rollout_log_probs, loss_mask, lengths, spec, f64)
        per_token = torch.where(on, lr.abs() + 1.0 + old.abs() + roll.abs(), 0.0)
        err = 8.0 * u * torch.zeros(int(lengths.numel()), dtype=f64).index_add_(0, seg, per_token)
        if kind == "geometric":
            err = err / terms["is_keep_count"].clamp_min(1.0)
        stat = terms["is_keep_stat"]
        for b in (low, high):
            near = (stat - math.log(b)).abs() <= err
            for i in torch.nonzero(near).flatten().tolist():
                hits.setdefault(int(i), f"its {kind} sequence mask decision")
    return sorted(hits.items())


__all__ = ["edge_samples", "keep_weight", "sample_keep", "token_keep", "token_ratio"]
