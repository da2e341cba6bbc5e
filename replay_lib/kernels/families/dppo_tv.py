"""DPPO-Binary-TV: ``valid = (p − p_old ≤ ε_high)`` where ``A > 0``, ``(p − p_old ≥ −ε_low)`` elsewhere, with
``p = exp(logp)`` (verl ``compute_policy_loss_dppo_tv``, core_algos.py:1379-1457 in 0.9.1: ``clip_ratio_low/high``
are the TV thresholds there; ``trunc`` is ``clip_ratio_c``)."""

from __future__ import annotations

import torch

from . import PolicyFamily, register
from ._dppo import dppo_terms


def _valid(logp, old, adv, knobs):
    p, po = logp.exp(), old.exp()
    d = p - po
    valid = torch.where(adv > 0, d <= knobs.eps_clip_high, d >= -knobs.eps_clip)
    edge = torch.where(adv > 0, torch.full_like(d, knobs.eps_clip_high), torch.full_like(d, -knobs.eps_clip))
    # p − p_old rounds with |p| + |p_old| (each exp's relative rounding, then the difference)
    return valid, (d - edge).abs() / (p + po)


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg=None, sample_terms=None,
                rollout_log_probs=None, ref_log_probs=None, dtype=torch.float32) -> dict:
    return dppo_terms(log_probs, old_log_probs, advantages, knobs, dtype, _valid)


register(PolicyFamily(
    name="dppo_tv", defaults={"trunc": 20.0}, token_terms=token_terms,
    metrics=("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"),
    formula="pg = −A·sg(min(r, c))·logp·valid; valid = p−p_old ≤ ε_high (A > 0) | p−p_old ≥ −ε_low (A ≤ 0)"))
