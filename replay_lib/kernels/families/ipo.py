"""prime-rl's IPO loss (``loss.type="ipo"``): the ratio is trainer vs inference (no old policy),
``log r = logp − rollout``; a token is masked when ``|exp(logp) − exp(rollout)| > ipo_threshold``; per token
``−keep·adv_tau·A·r + kl_tau·(log r)²`` (the squared term on every loss token), summed (the mapping's
``token_sum``). A masked token with an infinite ratio gives ``0·inf = NaN`` as prime-rl's ``keep_mask *
advantages * importance_ratio`` does (no guard at this snapshot).

Read from PrimeIntellect-ai/prime-rl @ 559b44772e47 ``src/prime_rl/trainer/rl/loss.py:100-106``
(``compute_importance_ratio_and_mismatch_kl``), ``:164-196`` (``ipo_loss_fn``) and
``packages/prime-rl-configs/src/prime_rl/configs/trainer.py:510-520`` (``IPOLossConfig``: ipo_threshold 0.1,
adv_tau 1.0, kl_tau 1e-3)."""

from __future__ import annotations

import torch

from . import PolicyFamily, register
from ._common import relative_gap


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg, sample_terms, rollout_log_probs=None,
                ref_log_probs=None, dtype=torch.float32) -> dict[str, torch.Tensor]:
    if rollout_log_probs is None:
        raise ValueError("rollout_log_probs is required for policy_loss='ipo'")
    logp = log_probs.to(dtype)
    lr = logp - rollout_log_probs.to(dtype)
    ratio = lr.exp()
    diff = (logp.exp() - rollout_log_probs.to(dtype).exp()).abs()
    threshold = float(knobs.param("ipo_threshold"))
    keep = (~(diff > threshold)).to(dtype)
    adv = float(knobs.param("adv_tau")) * advantages.to(dtype)
    kl_tau = float(knobs.param("kl_tau"))
    surrogate = keep * adv * ratio
    pg = -surrogate + kl_tau * (lr * lr)
    return {"pg": pg, "clip": 1.0 - keep, "ppo_kl": -(logp - old_log_probs.to(dtype)), "ratio": ratio,
            "log_ratio": lr, "ipo_keep": keep, "prob_diff": diff,
            # the mask's decision: |p − p_inf| a difference of two exponentials, its rounding one unit of the
            # log-ratio's condition wider than the ratio's (the gap scaled to the stage's 1 + |log r|)
            "edge_gap": relative_gap(diff, threshold) * (1.0 + lr.abs()) / (2.0 + lr.abs()),
            "edge_open": (adv * ratio).abs()}


register(PolicyFamily(name="ipo", defaults={"ipo_threshold": 0.1, "adv_tau": 1.0, "kl_tau": 1e-3},
                      token_terms=token_terms, payloads=("rollout_log_probs",),
                      formula="pg = −1[|p − p_inf| ≤ thr]·adv_tau·A·r + kl_tau·(log r)², r = exp(logp − rollout)",
                      source="prime-rl loss.py:164-196, configs/trainer.py:510-520"))
