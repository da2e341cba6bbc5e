"""SAPO: the soft gate ``f(r) = σ(τ·(r − 1))·4/τ`` with ``τ = τ_pos`` where ``A > 0`` and ``τ_neg`` elsewhere,
``pg = −f(r)·A`` (verl ``compute_policy_loss_sapo``, core_algos.py:1622-1704 in 0.9.1; TRL ``loss_type="sapo"``,
grpo_trainer.py:3121-3124 in 1.16). No clip: ``pg_clipfrac`` and ``pg_clipfrac_lower`` are reported 0.
verl aggregates the policy term ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (the mapping sets it)."""

from __future__ import annotations

import torch

from . import PolicyFamily, register
from ._common import log_ratio, zeros


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg=None, sample_terms=None,
                rollout_log_probs=None, ref_log_probs=None, dtype=torch.float32) -> dict:
    _, lr = log_ratio(log_probs, old_log_probs, knobs.log_ratio_clamp, dtype)
    adv = advantages.to(dtype)
    ratio = lr.exp()
    pos = torch.as_tensor(float(knobs.param("tau_pos")), dtype=dtype)
    neg = torch.as_tensor(float(knobs.param("tau_neg")), dtype=dtype)
    tau = torch.where(adv > 0, pos, neg)
    sig = torch.sigmoid(tau * (ratio - 1.0))
    gate = sig * (4.0 / tau)
    pg = -gate * adv
    # d log f / d log r = τ·r·(1 − σ): the gate's condition in the log-ratio's rounding
    err = pg.abs() * (tau * ratio * (1.0 - sig)).clamp_min(1.0) * (lr.abs() + 1.0)
    return {"pg": pg, "clip": zeros(pg), "clip_lower": zeros(pg), "ppo_kl": -lr, "ratio": ratio, "log_ratio": lr,
            "sapo_tau": tau, "sapo_gate": gate, "pg_err": err}


register(PolicyFamily(
    name="sapo", defaults={"tau_pos": 1.0, "tau_neg": 1.05}, token_terms=token_terms,
    metrics=("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"),
    formula="pg = −σ(τ·(r−1))·(4/τ)·A; τ = τ_pos if A > 0 else τ_neg"))
