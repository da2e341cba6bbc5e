"""GPG (the loss): ``pg = −logp·A`` (verl ``compute_policy_loss_gpg``, core_algos.py:1707-1740 in 0.9.1). No ratio:
verl reports no metric (``ppo_kl`` is kept as ``old − logp`` for the views, never compared)."""

from __future__ import annotations

import torch

from . import PolicyFamily, register
from ._common import log_ratio, zeros


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg=None, sample_terms=None,
                rollout_log_probs=None, ref_log_probs=None, dtype=torch.float32) -> dict:
    logp, lr = log_ratio(log_probs, old_log_probs, None, dtype)
    pg = -logp * advantages.to(dtype)
    return {"pg": pg, "clip": zeros(pg), "ppo_kl": -lr, "ratio": lr.exp(), "log_ratio": lr,
            "pg_err": pg.abs()}


register(PolicyFamily(name="gpg", defaults={}, token_terms=token_terms, metrics=(),
                      formula="pg = −logp·A"))
