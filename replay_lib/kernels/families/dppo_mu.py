"""DPPO anchored on the behaviour policy (SkyRL ``dppo_policy_loss``, ``skyrl/backends/skyrl_train/utils/ppo_utils.py``
@ a9564572, lines 866-935): ``pg = −A·r·keep`` with ``r = exp(clamp(logp − μ, ±20))`` and μ the rollout's
log-probs (``anchor=rollout``; the old ones with ``anchor=old``, as SkyRL does without them, :889) — no ``logp``
factor, no truncation; ``keep`` drops a token by the divergence of p = e^logp from p_μ = e^μ, by the sign of A
(A = 0 keeps it):

* ``divergence=tv`` (:899-902): A > 0 and p − p_μ > δ_high, or A < 0 and p_μ − p > δ_low;
* ``divergence=kl`` (:904-912): ``D = p_μ·(μ − logp) + (1 − p_μ)·log((1 − p_μ + 1e-8)/(1 − p + 1e-8))``;
  A > 0, p > p_μ and D > δ_high, or A < 0, p < p_μ and D > δ_low.

δ_low / δ_high are ``eps_clip`` / ``eps_clip_high``; ``clip`` = 1 − keep (SkyRL's ``clip_ratio``, :918)."""

from __future__ import annotations

import torch

from . import CHOICES, PolicyFamily, register
from ._common import INF, log_ratio

DIVERGENCES = ("tv", "kl")
ANCHORS = ("rollout", "old")
LOG_CLAMP = 20.0  # safe_exp_delta(…, clip=20.0), :891


def _anchor(old_log_probs, rollout_log_probs, knobs):
    if knobs.param("anchor") == "rollout":
        if rollout_log_probs is None:
            raise ValueError("rollout_log_probs is required for dppo_mu anchored on the rollout (anchor='rollout')")
        return rollout_log_probs
    return old_log_probs


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg=None, sample_terms=None,
                rollout_log_probs=None, ref_log_probs=None, dtype=torch.float32) -> dict:
    mu_lp = _anchor(old_log_probs, rollout_log_probs, knobs).to(dtype)
    logp, lr = log_ratio(log_probs, mu_lp, LOG_CLAMP, dtype)
    adv = advantages.to(dtype)
    ratio = lr.exp()
    p, pm = logp.exp(), mu_lp.exp()
    d = p - pm
    pos, neg = adv > 0, adv < 0
    hi, lo = knobs.eps_clip_high, knobs.eps_clip
    if knobs.param("divergence") == "tv":
        drop = (pos & (d > hi)) | (neg & (-d > lo))
        gap = torch.where(pos, (d - hi).abs(), torch.where(neg, (d + lo).abs(), torch.full_like(d, INF))) / (p + pm)
    else:
        q, qm = 1.0 - p + 1e-8, 1.0 - pm + 1e-8
        t1, t2 = pm * (mu_lp - logp), (1.0 - pm) * torch.log(qm / q)
        kl = t1 + t2
        drop = (pos & (d > 0) & (kl > hi)) | (neg & (d < 0) & (kl > lo))
        scale = t1.abs() + t2.abs() + (1.0 - pm) * (p / q + pm / qm) + pm * (logp.abs() + mu_lp.abs())
        edge = torch.where(pos, torch.full_like(kl, hi), torch.full_like(kl, lo))
        gap = torch.where(pos | neg, (kl - edge).abs() / scale, torch.full_like(kl, INF))
        # p against p_μ decides the side: within rounding of each other the test may go either way
        gap = torch.where(kl > edge, torch.minimum(gap, lr.abs()), gap)
    keep = (~drop).to(dtype)
    full = -adv * ratio
    return {"pg": full * keep, "clip": (~keep.bool()).to(dtype), "ppo_kl": -lr, "ratio": ratio, "log_ratio": lr,
            "edge_gap": gap, "edge_open": full.abs()}


CHOICES.update({("dppo_mu", "divergence"): DIVERGENCES, ("dppo_mu", "anchor"): ANCHORS})
register(PolicyFamily(
    name="dppo_mu", defaults={"divergence": "tv", "anchor": "rollout"}, token_terms=token_terms,
    metrics=("pg_clipfrac",),
    formula="pg = −A·r·keep, r = exp(logp − μ); keep drops A > 0 with p − p_μ > δ_high (tv) or p > p_μ and "
            "D_bin > δ_high (kl), A < 0 the mirror with δ_low"))
