"""IcePop's policy-term gradient (``loss.grad``, ``kernels/families/icepop.py``): ``pg = −keep·adv_tau·A·r`` with
``r = exp(logp − rollout)`` and ``keep`` the band test (a constant), so ``∂pg/∂logp = −keep·adv_tau·A·r`` — the
term's own value; a dropped token has none (its ratio never exponentiated, no ``0·inf``). The detached
train/rollout importance weight and the shared KL term apply as for every family (``kernels.grad``)."""

from __future__ import annotations

import math

import torch

from ..bundle.loss_knobs import LossKnobs
from .grad import CLIPPED, MASKED, UNCLIPPED, GradInputs, GradTerms, importance_weights, register_grad


@register_grad("icepop")
def icepop_grad(gi: GradInputs, knobs: LossKnobs) -> GradTerms:
    if gi.rollout_log_probs is None:
        raise ValueError("rollout_log_probs is required for policy_loss='icepop'")
    m = gi.mask
    lr = gi.log_probs - gi.rollout_log_probs
    low, high = math.log(float(knobs.param("ratio_low"))), math.log(float(knobs.param("ratio_high")))
    keep = (lr >= low) & (lr <= high)
    ratio = torch.where(keep, lr, torch.zeros_like(lr)).exp()
    pg = -float(knobs.param("adv_tau")) * gi.advantages * ratio * keep.to(lr.dtype)
    w = importance_weights(gi, knobs)
    if w is not None:
        pg = pg * w
    branch = torch.where(keep, torch.full_like(lr, UNCLIPPED, dtype=torch.int8),
                         torch.full_like(lr, CLIPPED, dtype=torch.int8))
    branch = torch.where(m == 0, torch.full_like(branch, MASKED), branch)
    return GradTerms(pg=pg * m, branch=branch, ratio=ratio, weight=w)
