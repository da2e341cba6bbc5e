"""GMPO (verl ``loss_mode="geo_mean"``, ``compute_policy_loss_geo_mean``, core_algos.py:1928-2011 in 0.9.1).

Per token the log-ratio ``Δ = logp − old`` (unclamped) is clipped by the sign of A in log space:
``Δ' = sgn(A)·min(sgn(A)·Δ, sgn(A)·clamp(Δ, −ε_low, ε_high))`` (``A > 0``: ``min(Δ, ε_high)``; ``A < 0``:
``max(Δ, −ε_low)``; ``A = 0``: 0). Per sample ``n = Σ mask``, ``R = exp(Σ Δ'·mask / (n + 1e-8))`` (the geometric
mean of the clipped ratios), ``Ā = Σ A·mask / (n + 1e-8)``, the sample's loss ``−Ā·R``; verl's pg_loss is the plain
mean of it over the micro-batch's sequences (``loss_agg_mode`` unused: the mapping sets ``seq_mean_token_sum`` over
the micro-batch size). Here each loss token carries ``−Ā·R/n`` so that its sample's sum is ``−Ā·R``.
``clip = 1[Δ ≠ clamp(Δ)]·1[A > 0]``, ``clip_lower = 1[Δ ≠ clamp(Δ)]·1[A < 0]`` (core_algos.py:2003-2005)."""

from __future__ import annotations

import torch

from . import LIMITS, PolicyFamily, register
from ..segments import masked_sample_sums


def _clipped(lr, adv, knobs):
    sgn = torch.sign(adv)
    clamped = lr.clamp(-knobs.eps_clip, knobs.eps_clip_high)
    return sgn * torch.minimum(sgn * lr, sgn * clamped), clamped


def sample_terms(log_probs, old_log_probs, rollout_log_probs, loss_mask, lengths, knobs, dtype=torch.float32, *,
                 advantages=None) -> dict:
    if advantages is None:
        raise ValueError("geo_mean needs the advantages for its per-sample ratio")
    mask = loss_mask.to(dtype)

    def columns(start, stop, seg):
        m = mask[start:stop]
        lr = log_probs[start:stop].to(dtype) - old_log_probs[start:stop].to(dtype)
        adv = advantages[start:stop].to(dtype)
        clipped, _ = _clipped(lr, adv, knobs)
        return {"mask": m, "lr": clipped * m, "adv": adv * m, "abs_lr": lr.abs() * m}

    sums = masked_sample_sums(lengths, loss_mask, columns, {k: dtype for k in ("mask", "lr", "adv", "abs_lr")})
    n = sums["mask"]
    denom = n + 1e-8
    return {"gm_log_ratio": sums["lr"] / denom, "gm_advantage": sums["adv"] / denom, "gm_count": n,
            "gm_abs_log_ratio": sums["abs_lr"] / torch.clamp_min(n, 1.0)}


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg=None, sample_terms=None,
                rollout_log_probs=None, ref_log_probs=None, dtype=torch.float32) -> dict:
    lr = log_probs.to(dtype) - old_log_probs.to(dtype)
    adv = advantages.to(dtype)
    _, clamped = _clipped(lr, adv, knobs)
    seq_lr = sample_terms["gm_log_ratio"][seg]
    ratio = seq_lr.exp()
    sample_loss = -sample_terms["gm_advantage"][seg] * ratio
    pg = sample_loss / torch.clamp_min(sample_terms["gm_count"][seg], 1.0)
    clipped = lr != clamped
    gap = torch.where(adv > 0, (lr - knobs.eps_clip_high).abs(),
                      torch.where(adv < 0, (lr + knobs.eps_clip).abs(), torch.full_like(lr, float("inf"))))
    err = pg.abs() * (seq_lr.abs() + sample_terms["gm_abs_log_ratio"][seg] + 1.0)
    return {"pg": pg, "clip": (clipped & (adv > 0)).to(dtype), "clip_lower": (clipped & (adv < 0)).to(dtype),
            "ppo_kl": -lr, "ratio": ratio, "log_ratio": seq_lr, "gm_sample_loss": sample_loss, "edge_gap": gap,
            "pg_err": err}


LIMITS["geo_mean"] = (
    ("is_level", "GMPO weighs a sample by the geometric mean of its rollout weights (core_algos.py:1989-1996), not "
                 "recomputed: record the loss without the rollout correction"),
    ("log_ratio_clamp", "GMPO does not clamp its log-ratio (core_algos.py:1973)"),
)
register(PolicyFamily(
    name="geo_mean", defaults={}, token_terms=token_terms, sample_terms=sample_terms,
    metrics=("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"),
    formula="loss_i = −Ā_i·exp(mean_t sgn(A)·min(sgn(A)·Δ, sgn(A)·clip(Δ, −ε_low, ε_high))); pg_loss = mean_i"))
