"""DPPO's shared body (verl ``compute_policy_loss_dppo_tv`` / ``_dppo_kl``, core_algos.py:1379-1542 in 0.9.1):
``pg = −A·sg(min(r, c))·logp·valid`` with ``valid`` the trust-region test of the family, chosen by the sign of A
(``A > 0``: the upper test; else the lower); ``clip = 1 − valid``; ``clip_lower = 1[r > c]·valid``."""

from __future__ import annotations

import torch

from ._common import log_ratio, relative_gap


def dppo_terms(log_probs, old_log_probs, advantages, knobs, dtype, valid_fn) -> dict:
    logp, lr = log_ratio(log_probs, old_log_probs, knobs.log_ratio_clamp, dtype)
    old = old_log_probs.to(dtype)
    adv = advantages.to(dtype)
    ratio = lr.exp()
    c = float(knobs.param("trunc"))
    truncated = ratio.clamp(max=c).detach()  # sg(min(r, c)): a constant of the gradient
    valid, gap = valid_fn(logp, old, adv, knobs)
    full = -adv * truncated * logp
    pg = full * valid.to(dtype)
    clip = (~valid).to(dtype)
    clip_lower = ((ratio > c) & valid).to(dtype)
    gap = torch.minimum(gap, relative_gap(ratio, c))
    return {"pg": pg, "clip": clip, "clip_lower": clip_lower, "ppo_kl": -lr, "ratio": ratio, "log_ratio": lr,
            "dppo_valid": valid.to(dtype), "edge_gap": gap, "edge_open": full.abs()}
