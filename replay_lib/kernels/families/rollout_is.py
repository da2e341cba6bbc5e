"""SkyRL ``policy_loss_type="rollout_is"``: the ratio to the rollout policy ``r = exp(clamp(logp − rollout, ±20))``
(``safe_exp_delta``), kept only strictly inside ``(1 − eps_clip, 1 + eps_clip_high)`` (a hard zero outside, not
CISPO's clamp), detached: ``pg = −(r·1[in range])·A·logp``; the clip fraction is the share out of range.

Read from NovaSky-AI/SkyRL @ a9564572eb8e ``skyrl/backends/skyrl_train/utils/ppo_utils.py:825-863``
(``rollout_is_policy_loss``) and ``utils/torch_utils.py:187-192`` (``safe_exp_delta``). Its off-policy correction
(``apply_off_policy_correction``) is refused by the SkyRL mapping when configured."""

from __future__ import annotations

import torch

from . import PolicyFamily, register
from ._common import relative_gap


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg, sample_terms, rollout_log_probs=None,
                ref_log_probs=None, dtype=torch.float32) -> dict[str, torch.Tensor]:
    if rollout_log_probs is None:
        raise ValueError("rollout_log_probs is required for policy_loss='rollout_is'")
    logp = log_probs.to(dtype)
    d = (logp - rollout_log_probs.to(dtype)).clamp(-20.0, 20.0)
    ratio = d.exp()
    low, high = 1.0 - knobs.eps_clip, 1.0 + knobs.eps_clip_high
    in_range = (ratio > low) & (ratio < high)
    kept = torch.where(in_range, ratio, torch.zeros_like(ratio)).detach()  # sg(r·1[in range])
    adv = advantages.to(dtype)
    pg = -(kept * adv * logp)
    lr = logp - old_log_probs.to(dtype)
    return {"pg": pg, "clip": (~in_range).to(dtype), "ppo_kl": -lr, "ratio": ratio, "log_ratio": d,
            "rollout_ratio": kept,
            # the range test's decision (the gap scaled to the stage's 1 + |log r|: the ratio's own 2 + |log r|)
            "edge_gap": relative_gap(ratio, low, high) * (1.0 + d.abs()) / (2.0 + d.abs()),
            "edge_open": (ratio * adv * logp).abs()}


register(PolicyFamily(name="rollout_is", defaults={}, token_terms=token_terms, payloads=("rollout_log_probs",),
                      formula="pg = −r·1[1−ε_l < r < 1+ε_h]·A·logp, r = exp(clamp(logp − rollout, ±20))",
                      source="SkyRL ppo_utils.py:825-863"))
