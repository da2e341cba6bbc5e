"""``loss.grad`` hypotheses: the bugs whose loss value is right and whose gradient is not, each matched on the
recorded ``grad_log_probs`` against what it would have produced from the stage's own recompute
(``stages.grad.recompute_gradient``: the policy part ``g_pg`` and the KL part ``g_kl`` of ``g = g_pg + g_kl``):

* ``grad.kl_no_gradient`` — the KL term contributes no gradient (computed under ``no_grad`` or detached,
  SkyRL#1353): ``g_pg``;
* ``grad.is_weight_not_detached`` — the importance weights are not detached (``w = exp(logp − rollout)`` from the
  current log-probs, verl#4105: on-policy its value is right): ``g + W·m·pg·∂w/∂logp`` with ``∂w/∂logp = w`` per
  token (where neither the truncation nor the log clamp holds), the sample's ``w_i·Σ_t m_t·pg_t`` (``/n_i``
  geometric) on each of its tokens for a sequence weight;
* ``grad.ratio_detached`` — the ratio is detached, so the policy term has no gradient (a ratio frozen at 1 by
  ``logp − logp.detach()`` taken the wrong way, torchforge#571): ``g_kl``;
* ``grad.nonfinite_zero_coefficient`` — a non-finite gradient from a term whose coefficient is 0 (a KL term of
  ``kl_loss_coef = 0`` still in the graph, slime#2258; an IcePop-masked token, prime-rl#3526; a loss-mask-0
  token): the recorded NaN/Inf exactly where such a term is, ``g`` elsewhere;
* ``grad.kl_weight_detached`` — the KL term's weight ``exp(logp − rollout)`` (``kl_loss_rollout_weighted``) or
  ``exp(logp − sg(logp))`` (``kl_loss_score_function``) detached: the score-function part of NeMo-RL's KL
  gradient lost, the term's value unchanged: ``g − W^kl·m·w·k·[inside the clamps]``;
* ``grad.scaled`` — the gradient is scaled by ``k`` relative to the loss (a loss scale or accumulation divisor
  applied twice, or not at all): ``k·g`` with ``k`` the median recorded/expected ratio.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..judge.fields import FieldResult
from ..judge.error_model import C_TOKEN
from ..kernels.grad import grad_scale_of, kl_value_and_slope
from ..kernels.loss import policy_token_terms, sample_log_terms
from ..kernels.segments import segment_sum
from ..stages import StageContext, StageInputError
from ..stages.grad import BOUND_RECORD, GRAD_PAYLOAD, STAGE, recompute_gradient
from .base import Hypothesis

# a scale this close to 1 is no scale bug (the stage's own tolerance judges it)
MIN_SCALE_DEVIATION = 1e-3


def _weight_gradient(ctx: StageContext) -> torch.Tensor:
    """``W·m·pg·∂w/∂logp`` per token: what an importance weight left in the graph adds to ``g``."""
    gi, knobs, g = recompute_gradient(ctx)
    seg = gi.seg
    n_samples = gi.lengths.numel()
    st = sample_log_terms(gi.log_probs, gi.old_log_probs, gi.rollout_log_probs, gi.mask, gi.lengths, knobs,
                          dtype=torch.float64, advantages=gi.advantages, family_tokens=gi.family_tokens)
    # the policy term alone (its KL term is not weighted)
    t = policy_token_terms(gi.log_probs, gi.old_log_probs, gi.advantages, replace(knobs, kl_loss_coef=0.0), seg=seg,
                           sample_terms=st,
                           rollout_log_probs=gi.rollout_log_probs, dtype=torch.float64,
                           family_tokens=gi.family_tokens)
    log_w = t["is_log_weight"]
    w = t["is_weight"]
    live = torch.ones_like(w)
    if knobs.is_log_clamp is not None:
        live = live * (log_w.abs() <= knobs.is_log_clamp).to(w.dtype)
    if knobs.is_mode == "truncate":
        raw = log_w.clamp(-knobs.is_log_clamp, knobs.is_log_clamp).exp() if knobs.is_log_clamp is not None \
            else log_w.exp()
        if knobs.is_low is not None:
            live = live * (raw >= knobs.is_low).to(w.dtype)
        if knobs.is_high is not None:
            live = live * (raw <= knobs.is_high).to(w.dtype)
    slope = w * live  # ∂w/∂(log w)
    pg = t["pg_unweighted"] * gi.mask
    if knobs.is_level == "token":
        return g.pg_weight * pg * slope
    total = segment_sum(pg, seg, n_samples)[seg]
    if knobs.is_level == "geometric":
        total = total / torch.clamp_min(segment_sum(gi.mask, seg, n_samples), 1.0)[seg]
    return g.pg_weight * gi.mask * slope * total


def _zero_coefficient_terms(ctx: StageContext) -> tuple[torch.Tensor, list[str]]:
    """bool per token: a term of coefficient 0 is there; and the terms' names."""
    gi, knobs, g = recompute_gradient(ctx)
    where = gi.mask == 0
    names = ["the loss mask (0 at the token)"]
    cfg = ctx.config
    if cfg.use_kl_loss and float(cfg.kl_loss_coef) == 0.0:
        where = torch.ones_like(where)
        names.append("the KL term (use_kl_loss with kl_loss_coef=0)")
    if g.terms.weight is not None and knobs.is_mode == "mask":
        dropped = g.terms.weight == 0
        if bool(dropped.any()):
            where = where | dropped
            names.append("the IcePop mask (weight 0)")
    return where, names


def hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    field = next((f for f in fields if f.name == GRAD_PAYLOAD), None)
    if field is None:
        return []
    try:
        gi, knobs, g = recompute_gradient(ctx)
    except (StageInputError, ValueError):
        return []
    bound = ctx.records.get(BOUND_RECORD)
    out: list[Hypothesis] = []

    def add(hid: str, detail: str, values: torch.Tensor, own_bound=None, nonfinite: bool = False) -> None:
        bounds = {GRAD_PAYLOAD: own_bound} if own_bound is not None else {}
        out.append(Hypothesis(stage=STAGE, id=hid, detail=detail, values={GRAD_PAYLOAD: values}, bounds=bounds,
                              nonfinite_matches=nonfinite))

    if knobs.kl_loss:
        # the KL estimator's own slope (W_kl·m·∂k/∂x, × the ratio when ratio-weighted): what a KL term computed under
        # no_grad loses; a detached ratio leaves it alone (the ratio-weighted term's k·∂r goes with the ratio)
        _, dk = kl_value_and_slope(gi.log_probs - gi.ref_log_probs, knobs)
        own = g.kl_weight * gi.numerator * dk * (g.terms.ratio if knobs.kl_loss_ratio_weighted else 1.0)
        weighted = knobs.kl_loss_rollout_weighted or knobs.kl_loss_score_function
        if weighted:  # w·k under no_grad: the whole term (the weight's part too)
            own = g.kl
        add("grad.kl_no_gradient", "the KL term contributes no gradient (computed under no_grad or detached): the "
            "recorded gradient is " + ("the policy term's and the ratio's in k·r" if knobs.kl_loss_ratio_weighted
                                       else "the policy term's alone"), g.grad - own)
        add("grad.ratio_detached", "the ratio is detached (policy term has no gradient): the recorded gradient is "
            "the KL estimator's alone", own)
        if weighted:
            from ..kernels.grad import rollout_weighted_kl

            r = rollout_weighted_kl(gi, knobs)
            x = gi.log_probs - gi.ref_log_probs
            inside = (x.abs() <= knobs.kl_loss_input_clamp) if knobs.kl_loss_input_clamp is not None else True
            if knobs.kl_loss_output_clamp is not None:
                inside = inside & (r["value"].abs() <= knobs.kl_loss_output_clamp)
            score = g.kl_weight * gi.numerator * r["w"] * r["k"] * inside
            what = "exp(logp − rollout)" if knobs.kl_loss_rollout_weighted else "exp(logp − sg(logp))"
            add("grad.kl_weight_detached", f"the KL term's weight {what} is detached (the score-function part "
                "w·k of its gradient is lost)", g.grad - score)
    else:
        add("grad.ratio_detached", "the ratio is detached (policy term has no gradient): the recorded gradient is "
            "0", torch.zeros_like(g.grad))
    if g.terms.weight is not None:
        extra = _weight_gradient(ctx)
        # its own rounding: the weight's gradient is a product of the same factors, summed over the sample's tokens
        # for a sequence or geometric weight (n_i·u of it)
        n = segment_sum(gi.mask, gi.seg, gi.lengths.numel())[gi.seg] if knobs.is_level != "token" else 0.0
        own_bound = None if bound is None else \
            bound + ctx.precision.token * (C_TOKEN + n + (gi.log_probs - gi.old_log_probs).abs()) * extra.abs()
        add("grad.is_weight_not_detached", f"the importance weights are not detached ({knobs.is_level}-level "
            "w taken from the current log-probs keeps a gradient of its own: + W·pg·∂w/∂logp)",
            g.grad + extra, own_bound)
    recorded = field.expected.to(torch.float64)
    nonfinite = ~torch.isfinite(recorded)
    if bool(nonfinite.any()):
        where, names = _zero_coefficient_terms(ctx)
        hit = nonfinite & where & torch.isfinite(g.grad)
        if bool(hit.any()):
            values = torch.where(hit, recorded, g.grad)
            add("grad.nonfinite_zero_coefficient", f"a non-finite gradient from a term whose coefficient is 0 "
                f"({int(hit.sum())} token(s); 0·NaN or 0·Inf in backward where {' or '.join(names)} multiplies "
                "it): its value is 0 in the loss, its gradient NaN", values, nonfinite=True)
    ok = torch.isfinite(recorded) & torch.isfinite(g.grad) & (g.grad.abs() > 0)
    if bool(ok.any()):
        k = float((recorded[ok] / g.grad[ok]).median())
        if k == k and k != 0 and abs(k - 1.0) > MIN_SCALE_DEVIATION:
            scaled_bound = bound * abs(k) if bound is not None else None
            add("grad.scaled", f"the gradient is scaled by k={k:.6g} relative to the loss (a loss scale or "
                f"gradient-accumulation divisor applied {'twice' if abs(k) < 1 else 'not at all'}; recorded "
                f"grad_scale {_grad_scale(ctx):g})", g.grad * k, scaled_bound)
    return out


def _grad_scale(ctx: StageContext) -> float:
    return grad_scale_of(ctx.config)


__all__ = ["hypotheses"]
