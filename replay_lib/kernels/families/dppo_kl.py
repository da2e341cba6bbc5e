"""DPPO-Binary-KL: the binary KL ``D = p_old·(logp_old − logp) + (1 − p_old)·log((1 − p_old + 1e-8)/(1 − p + 1e-8))``;
``valid = (D ≤ ε_high) ∨ (p ≤ p_old)`` where ``A > 0``, ``(D ≤ ε_low) ∨ (p ≥ p_old)`` elsewhere (verl
``compute_policy_loss_dppo_kl``, core_algos.py:1460-1542 in 0.9.1)."""

from __future__ import annotations

import torch

from . import PolicyFamily, register
from ._common import INF
from ._dppo import dppo_terms


def _valid(logp, old, adv, knobs):
    p, po = logp.exp(), old.exp()
    t1 = po * (old - logp)
    q, qo = 1.0 - p + 1e-8, 1.0 - po + 1e-8
    t2 = (1.0 - po) * torch.log(qo / q)
    d = t1 + t2
    pos = adv > 0
    eps = torch.where(pos, torch.full_like(d, knobs.eps_clip_high), torch.full_like(d, knobs.eps_clip))
    side = torch.where(pos, p <= po, p >= po)
    valid = (d <= eps) | side
    # D's rounding: each term's, and 1 − p's cancellation where p → 1 (relative p/(1 − p))
    scale = t1.abs() + t2.abs() + (1.0 - po) * (p / q + po / qo) + po * (logp.abs() + old.abs())
    gap = torch.where(side, torch.full_like(d, INF), (d - eps).abs() / scale)
    # p against p_old decides the side: within rounding of each other the test may go either way
    gap = torch.where(d <= eps, gap, torch.minimum(gap, (logp - old).abs()))
    return valid, gap


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg=None, sample_terms=None,
                rollout_log_probs=None, ref_log_probs=None, dtype=torch.float32) -> dict:
    return dppo_terms(log_probs, old_log_probs, advantages, knobs, dtype, _valid)


register(PolicyFamily(
    name="dppo_kl", defaults={"trunc": 20.0}, token_terms=token_terms,
    metrics=("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"),
    formula="pg = −A·sg(min(r, c))·logp·valid; valid = D_bin ≤ ε_high ∨ p ≤ p_old (A > 0) | "
            "D_bin ≤ ε_low ∨ p ≥ p_old (A ≤ 0)"))
