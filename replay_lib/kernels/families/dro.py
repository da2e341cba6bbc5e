"""DRO: ``pg = −(logp·A − ½·β·(log r)²)``, ``log r = logp − old`` unclamped (verl ``compute_policy_loss_dro``,
core_algos.py:2014-2044 in 0.9.1; ``policy_loss.dro_beta`` > 0). Only ``ppo_kl`` is reported."""

from __future__ import annotations

import torch

from . import PolicyFamily, register
from ._common import log_ratio, zeros


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg=None, sample_terms=None,
                rollout_log_probs=None, ref_log_probs=None, dtype=torch.float32) -> dict:
    beta = knobs.param("beta")
    logp, lr = log_ratio(log_probs, old_log_probs, None, dtype)
    pg = -(logp * advantages.to(dtype) - 0.5 * float(beta) * lr.square())
    return {"pg": pg, "clip": zeros(pg), "ppo_kl": -lr, "ratio": lr.exp(), "log_ratio": lr,
            "pg_err": (logp * advantages.to(dtype)).abs() + 2.0 * abs(float(beta)) * lr.square() + pg.abs()}


register(PolicyFamily(name="dro", defaults={"beta": None}, token_terms=token_terms, metrics=("ppo_kl",),
                      formula="pg = −(logp·A − ½·β·(log r)²)"))
