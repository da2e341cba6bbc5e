"""CISPO: ``pg = −sg(clip(r))·A·logp``, the clipped ratio a constant weight on the log-prob.

* ``cap="relative"`` (verl ``compute_policy_loss_cispo``, core_algos.py:2047-2106 in 0.9.1; SkyRL; NeMo-RL
  ``use_cispo``): ``clip(r) = clamp(r, 1 − ε_low, 1 + ε_high)``; ``clip = 1[r ≠ clip(r)]`` (verl's pg_clipfrac),
  ``pg_clipfrac_lower`` reported 0;
* ``cap="absolute"`` (TRL ``loss_type="cispo"``, grpo_trainer.py:3109-3111 in 1.16): ``clip(r) = min(r, ε_high)``
  — ``epsilon_high`` is the cap itself, not 1 + it; ``clip = 1[r > ε_high ∧ A > 0]`` (TRL's cispo_clip_ratio,
  grpo_trainer.py:3285);
* ``anchor``: ``old`` (r = π/π_old) or ``rollout`` (SkyRL ``cispo_anchor: rollout``: r = π/π_rollout).
"""

from __future__ import annotations

import torch

from . import CHOICES, PolicyFamily, register
from ._common import log_ratio, relative_gap, zeros

CAPS = ("relative", "absolute")
ANCHORS = ("old", "rollout")


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg=None, sample_terms=None,
                rollout_log_probs=None, ref_log_probs=None, dtype=torch.float32) -> dict:
    cap, anchor = knobs.param("cap"), knobs.param("anchor")
    if anchor == "rollout":
        if rollout_log_probs is None:
            raise ValueError("rollout_log_probs is required for CISPO anchored on the rollout (anchor='rollout')")
        base = rollout_log_probs
    else:
        base = old_log_probs
    logp, lr = log_ratio(log_probs, base, knobs.log_ratio_clamp, dtype)
    adv = advantages.to(dtype)
    ratio = lr.exp()
    if cap == "absolute":
        w = ratio.clamp(max=knobs.eps_clip_high)
        clip = (ratio > knobs.eps_clip_high) & (adv > 0)
        gap = relative_gap(ratio, knobs.eps_clip_high)
    else:
        low, high = 1.0 - knobs.eps_clip, 1.0 + knobs.eps_clip_high
        w = ratio.clamp(low, high)
        clip = ratio != w
        gap = relative_gap(ratio, low, high)
    w = w.detach()  # sg(clip(r)): a constant weight of the gradient (verl core_algos.py:2095, TRL :3110)
    pg = -w * adv * logp
    return {"pg": pg, "clip": clip.to(dtype), "clip_lower": zeros(pg), "ppo_kl": -lr, "ratio": ratio,
            "log_ratio": lr, "cispo_weight": w, "edge_gap": gap}


CHOICES.update({("cispo", "cap"): CAPS, ("cispo", "anchor"): ANCHORS})
register(PolicyFamily(
    name="cispo", defaults={"cap": "relative", "anchor": "old"}, token_terms=token_terms,
    metrics=("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"),
    formula="pg = −sg(clip(r))·A·logp; clip(r) = clamp(r, 1−ε_low, 1+ε_high) (relative: verl, SkyRL, NeMo-RL) "
            "or min(r, ε_high) (absolute: TRL)"))
