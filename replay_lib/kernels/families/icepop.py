"""prime-rl's IcePop loss (``trainer.loss.type = "icepop"``, PrimeIntellect-ai/prime-rl#3526, merged 2026-09-10;
the Ring-1T report, arXiv 2510.18855): the ratio is trainer vs inference (no old policy), ``log r = logp −
rollout``; a token is kept when ``r`` lies in the **inclusive** band ``[ratio_low, ratio_high]`` (0.2, 5.0), the
test taken in log space (``log ratio_low ≤ log r ≤ log ratio_high``); per token ``−keep·adv_tau·A·r``. IcePop has
no KL term (the ``(log r)²`` term is IPO's, ``kernels/families/ipo.py``).

The 0·inf guard: a dropped token's log-ratio is replaced (by 0) **before** the exponential, so a rejected extreme
ratio contributes an exact 0 — ``keep·exp(log r)`` would give ``0·inf = NaN`` once ``exp`` overflows (float32
past log r ≈ 88.7). ``pg_clipfrac`` is the dropped fraction (prime-rl's ``is_masked``).

The snapshot of §0 (559b44772e47) predates the PR and its code is not in the reference store: this is the PR's
stated contract (its description, 2026-09-10), with no prime-rl config mapping (``RecomputeConfig.policy_loss =
"icepop"`` with ``policy_loss_params``)."""

from __future__ import annotations

import math

import torch

from . import PolicyFamily, register


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg=None, sample_terms=None, rollout_log_probs=None,
                ref_log_probs=None, dtype=torch.float32) -> dict[str, torch.Tensor]:
    if rollout_log_probs is None:
        raise ValueError("rollout_log_probs is required for policy_loss='icepop'")
    logp = log_probs.to(dtype)
    rollout = rollout_log_probs.to(dtype)
    lr = logp - rollout
    low, high = math.log(float(knobs.param("ratio_low"))), math.log(float(knobs.param("ratio_high")))
    keep = (lr >= low) & (lr <= high)
    guarded = torch.where(keep, lr, torch.zeros_like(lr))  # the dropped ratios replaced before exp
    ratio = guarded.exp()
    adv = float(knobs.param("adv_tau")) * advantages.to(dtype)
    pg = -(adv * ratio) * keep.to(dtype)
    # the band's edges in log space: log r rounds with |logp| + |rollout| (a difference of two stored values)
    scale = (logp.abs() + rollout.abs() + lr.abs()).clamp_min(1e-30)
    gap = torch.minimum((lr - low).abs(), (lr - high).abs()) / scale
    # at an edge the term taken or dropped is |adv·r| with r at that edge
    at_edge = lr.clamp(low, high).exp()
    return {"pg": pg, "clip": (~keep).to(dtype), "ppo_kl": -(logp - old_log_probs.to(dtype)), "ratio": ratio,
            "log_ratio": guarded, "icepop_keep": keep.to(dtype), "icepop_log_ratio": lr, "edge_gap": gap,
            "edge_open": (adv * at_edge).abs()}


register(PolicyFamily(name="icepop", defaults={"ratio_low": 0.2, "ratio_high": 5.0, "adv_tau": 1.0},
                      token_terms=token_terms, payloads=("rollout_log_probs",), metrics=("pg_clipfrac",),
                      formula="pg = −1[ratio_low ≤ r ≤ ratio_high]·adv_tau·A·r, r = exp(logp − rollout) (the band "
                              "tested in log space, a dropped ratio never exponentiated)",
                      source="prime-rl #3526 (trainer.loss.type='icepop')"))
