"""VESPO (TRL 1.16 ``loss_type="vespo"``): ``pg = −φ(w)·A·logp`` with the sequence weight ``w = exp(log w)``,
``log w = clamp(Σ_t clamp(logp − old, ±20)·m, ln 1e-8, 20)`` (a sum, not GSPO's mean) and the gamma weighting
``φ(w) = exp(λ + k·log w − λ·w)`` (φ(1) = 1), ``(k, λ) = (k_pos, λ_pos)`` when ``A ≥ 0`` else ``(k_neg, λ_neg)``,
λ clamped ≥ 1e-4, a non-finite φ taken as 0; φ is detached (a constant of the gradient).

Read from TRL 1.16.0 ``trl/trainer/grpo_trainer.py``: ``get_gamma_weights`` (:2969-3018) and ``_compute_loss``
(:3125-3136). TRL folds vLLM's importance ratio into ``log w`` itself and skips its multiply (:3146); the replay
refuses VESPO with an importance correction (``is_level``). The clip fraction is 0 (TRL reports none for it).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..segments import masked_sample_sums
from . import PolicyFamily, register

LOG_W_LOW = math.log(1e-8)  # get_gamma_weights' lower clamp of the sequence log-weight (:2988)
TOKEN_CLAMP = 20.0


def sample_terms(log_probs, old_log_probs, rollout_log_probs, loss_mask, lengths, knobs,
                 dtype=torch.float32, *, advantages=None) -> dict[str, torch.Tensor]:
    """``vespo_log_w`` (clamped) and ``vespo_abs_lr`` (Σ_t |clamped log-ratio|·m: the condition of log w) per
    sample."""
    mask = loss_mask.to(dtype)

    def columns(start: int, stop: int, seg: torch.Tensor) -> dict[str, torch.Tensor]:
        m = mask[start:stop]
        lr = (log_probs[start:stop].to(dtype) - old_log_probs[start:stop].to(dtype)).clamp(-TOKEN_CLAMP, TOKEN_CLAMP)
        return {"lr": lr * m, "abs": lr.abs() * m}

    sums = masked_sample_sums(lengths, loss_mask, columns, {"lr": dtype, "abs": dtype})
    return {"vespo_log_w": sums["lr"].clamp(LOG_W_LOW, TOKEN_CLAMP), "vespo_abs_lr": sums["abs"]}


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg, sample_terms,
                rollout_log_probs: Optional[torch.Tensor] = None, ref_log_probs: Optional[torch.Tensor] = None,
                dtype=torch.float32) -> dict[str, torch.Tensor]:
    logp = log_probs.to(dtype)
    adv = advantages.to(dtype)
    lr = logp - old_log_probs.to(dtype)
    log_w = sample_terms["vespo_log_w"][seg]
    w = log_w.exp()
    nonneg = adv >= 0
    k = torch.where(nonneg, float(knobs.param("k_pos")), float(knobs.param("k_neg"))).to(dtype)
    lam = torch.where(nonneg, float(knobs.param("lambda_pos")), float(knobs.param("lambda_neg"))).to(dtype)
    lam = lam.clamp(min=1e-4)
    # φ is computed under no_grad (get_gamma_weights, :2970): a constant of the gradient
    phi = (lam + k * log_w - lam * w).exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()
    pg = -phi * adv * logp
    # ∂ log φ / ∂ log w = k − λ·w; log w sums the sample's log-ratios: its rounding scales with Σ|lr|, and pg's
    # rounding scale (pg_err, in units of the unit roundoff) is |pg| times that condition
    cond = (k.abs() + lam * w) * sample_terms["vespo_abs_lr"][seg]
    return {"pg": pg, "clip": torch.zeros_like(pg), "ppo_kl": -lr, "ratio": lr.exp(), "log_ratio": lr,
            "phi": phi, "log_w": log_w, "pg_err": pg.abs() * cond}


register(PolicyFamily(
    name="vespo", defaults={"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0},
    token_terms=token_terms, sample_terms=sample_terms, metrics=("ppo_kl",),
    formula="pg = −φ(w)·A·logp, φ(w) = e^(λ + k·log w − λ·w), log w = clamp(Σ clamp(logp − old, ±20)·m, ln 1e-8, 20), "
            "(k, λ) by sign(A)",
    source="TRL 1.16.0 grpo_trainer.py:2969-3018, 3125-3136"))
