"""The 0/1 keep masks of an off-policy correction (``bundle.is_keep``: SkyRL's outlier, token and sequence masks,
``off_policy_correction_utils.py`` @ a9564572 below ``opc.py``; OpenRLHF's binary-KL and TV gates): per token and per
sample, in ``dtype``."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..bundle.is_keep import DIVERGENCES, LOG_CLAMP, PROB_CLAMP, Spec
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


def divergence(old: torch.Tensor, rollout: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """The sampled-token divergence between the rollout (``p``) and the old policy (``q``), each probability
    clamped to ``[1e-6, 1 − 1e-6]``: ``binary_kl`` ``p·log(p/q) + (1 − p)·log((1 − p)/(1 − q))``, ``tv``
    ``|p − q|`` (OpenRLHF 0.11.2 ``PolicyLoss.forward``, models/loss.py:226-232)."""
    p = rollout.to(dtype).exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    q = old.to(dtype).exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    if kind == "tv":
        return (p - q).abs()
    return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()


def token_keep(old: torch.Tensor, rollout: torch.Tensor, spec: Spec, dtype: torch.dtype,
               stat_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The token-level masks' 0/1 per token (1 without one): the ratio's (opc.py:170-178) and the divergence
    gates' (OpenRLHF loss.py:235-239: ``low ≤ stat ≤ high`` keeps; a NaN statistic drops). A divergence is a
    decision the producer takes in its own format (OpenRLHF evaluates it in the log-probs' dtype, where
    ``1 − 1e-6`` is 1 in bfloat16 and a probability rounded to 1 makes the statistic NaN): ``stat_dtype``, the
    declared compute format, evaluates it as the producer did (``dtype`` when None)."""
    keep = torch.ones(old.shape, dtype=torch.bool)
    for kind, low, high in spec:
        if kind == "token":
            keep &= _in_bounds(token_ratio(old, rollout, dtype), low, high)
        elif kind in DIVERGENCES:
            stat = divergence(old, rollout, kind, stat_dtype or dtype)
            keep &= _in_bounds(stat, low, high) & ~stat.isnan()
    return keep.to(dtype)


def divergence_error(old: torch.Tensor, rollout: torch.Tensor, kind: str, u: float) -> torch.Tensor:
    """A bound on a producer's rounding of :func:`divergence` evaluated in a format of unit roundoff ``u``
    (float64), from exact stored inputs: ``tv`` ``4u·(p + q)``; ``binary_kl`` ``4u·(3p + q·(1 − p)/(1 − q)
    + p·|L| + 2|t₁| + 2|t₂|)`` with ``t₁ = p·log(p/q)``, ``L = log((1 − p)/(1 − q))``, ``t₂ = (1 − p)·L`` — each
    probability's relative error ``u`` carried through the quotients and logs (``1 − p`` inherits ``u·p``, large
    against ``1 − q`` near 1), the terms' own roundings, 2× slack."""
    f64 = torch.float64
    p = rollout.to(f64).exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    q = old.to(f64).exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    if kind == "tv":
        return 4.0 * u * (p + q)
    t1 = p * (p / q).log()
    big_l = ((1 - p) / (1 - q)).log()
    t2 = (1 - p) * big_l
    return 4.0 * u * (3.0 * p + q * (1 - p) / (1 - q) + p * big_l.abs() + 2.0 * t1.abs() + 2.0 * t2.abs())


def sample_keep(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, loss_mask: torch.Tensor,
                lengths: torch.Tensor, spec: Spec, dtype: torch.dtype,
                stat_dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
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
        kept = m * token_keep(old, roll, spec, dtype, stat_dtype)
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
                sample_terms, dtype: torch.dtype, stat_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Each token's 0/1: its token masks × its sample's outlier and sequence masks."""
    if rollout is None:
        raise ValueError("rollout_log_probs is required for is_keep")
    keep = token_keep(old, rollout, spec, dtype, stat_dtype)
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
        elif kind in DIVERGENCES:
            stat = divergence(old, roll, kind, f64)
            err = divergence_error(old, roll, kind, u)
            near = torch.zeros_like(on)
            for b in (low, high):
                if b is not None:
                    near |= (stat - b).abs() <= err
            for i in torch.unique(seg[near & on]).tolist():
                hits.setdefault(int(i), f"a token's {kind} gate decision")
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
            if b is None:
                continue
            near = (stat - math.log(b)).abs() <= err
            for i in torch.nonzero(near).flatten().tolist():
                hits.setdefault(int(i), f"its {kind} sequence mask decision")
    return sorted(hits.items())


__all__ = ["divergence", "divergence_error", "edge_samples", "keep_weight", "sample_keep", "token_keep",
           "token_ratio"]
