"""``loss.grad`` (SPEC §4.3): the recorded per-token gradient ``grad_log_probs`` (∂L/∂log_probs, as a hook on the
log-prob tensor saw it in the step's backward) against the analytic gradient recomputed in float64 from the inputs
loss.policy consumes (``kernels.grad``): the loss's value may be right while its gradient is not (a KL term under
``no_grad``, importance weights that are not detached, a detached ratio, 0·NaN from a zero-weight term, a scale
applied twice), and only this stage sees it. The optional ``grad_values`` (∂L/∂values) is judged the same way
against the value loss's analytic gradient.

Rounding bound per token (the loss's, per element — ``error_model``'s rules): the producer's token precision
``u`` times the gradient's condition: ``|g_pg|·(C_TOKEN + |lr| + |log w|)`` for the policy part (the exponent's
condition, the weight's, a few roundings of the products and of the aggregation weight; a per-sample exponent's
``error_model.sample_exponent_condition`` under GSPO or a sequence weight), under GSPO the sample's float32 sum
of the slopes adds ``n_i·u`` of its magnitude; for the KL part the slope's own rounding
``|W^kl|·C_TOKEN·u·(|k'| + |k''|·(1 + |x|))`` (``k''`` the estimator's curvature: 0, 1, ``exp(−x)``) and,
ratio-weighted, the product's. Decisions at an edge are hazards, not failures: a token whose ratio lies within
rounding of a clip bound (``error_model.loss_clip_hits``), of dual-clip's ``c`` or of an IcePop bound
(``near_value``), or whose log-ratio or KL input lies at its clamp, may take either branch in a legitimate
producer: its tolerance admits the unclipped gradient's magnitude (under GSPO the sample's), and each such sample
is named in a hazard. Payloads stored coarser than the declared compute add their rounding (``storage_unit``) to
the exponent's condition. The rollout-weighted KL term (and ``kl_loss_score_function``, its weight 1) adds its
weight exponent's condition ``|logp − rollout|`` to the estimator's (``_rollout_kl_bound``); a MIS rejection
(slime's ``mis_rs`` / ``mis_veto``) decided within rounding of its bound admits the gradient with that decision
taken the other way (``rs_boundary``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..bundle import BundleReader
from ..bundle.schema import StageId
from ..judge.error_model import (C_NEAR_CLIP, C_STORE, C_TOKEN, loss_clip_hits, near_value,
                                 sample_exponent_condition, storage_error, storage_unit)
from ..judge.fields import PER_TOKEN
from ..judge.report import StageReport
from ..kernels import GrpoReturns
from ..kernels.grad import (GRAD_FAMILIES, GradInputs, Gradient, GradTerms, grad_family, grad_log_probs,
                            grad_scale_of, kl_value_and_slope, sample_chunks, sample_weights)
from ..kernels.loss import LossKnobs, agg_weights
from ..kernels.segments import segment_sum
from .base import StageContext, StageDef
from .loss import _loss_refuse, _loss_requirements
from .loss_inputs import loss_inputs

STAGE = StageId.LOSS_GRAD.value
GRAD_PAYLOAD = "grad_log_probs"
GRAD_VALUES_PAYLOAD = "grad_values"
# ctx.outputs / ctx.records keys: the recompute (kernels.grad.Gradient) the explanations and the why strip read
GRADIENT_RECORD = "loss_grad"
BOUND_RECORD = "loss_grad_bound"
HITS_RECORD = "loss_grad_edges"


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def gradient_inputs(ctx: StageContext) -> tuple[GradInputs, LossKnobs]:
    """The float64 inputs of the analytic gradient: loss.policy's (``stages.loss_inputs``)."""
    li = loss_inputs(ctx)
    from ..kernels.families.grad import SAMPLE_SLOPES

    if li.keep is not None and li.knobs.family and li.knobs.policy_loss in SAMPLE_SLOPES:
        # a sample-level slope (the sample's own sums) under a per-token numerator mask: not derived here
        from .base import StageInputError

        raise StageInputError(f"mis_rs / mis_veto (slime's MIS rejection) with policy_loss "
                              f"{li.knobs.policy_loss!r} is not recomputed by loss.grad", field="mis_rs")
    keep = alternative = None
    if li.keep is not None:  # slime's MIS rejection: every term's numerator, the normalizers kept
        keep = li.keep.to(torch.float64)
        if li.rs_alternative is not None:
            alternative = li.rs_alternative.to(torch.float64)
    adv = li.advantages.materialize() if isinstance(li.advantages, GrpoReturns) else li.advantages
    opt = {name: _f64(value) if value is not None else None
           for name, value in (("rollout_log_probs", li.rollout_log_probs), ("ref_log_probs", li.ref_log_probs),
                               ("entropy", li.entropy if li.knobs.entropy_mask else None),
                               ("teacher_log_probs", li.teacher_log_probs if li.knobs.opd_loss else None))}
    gi = GradInputs(log_probs=_f64(li.log_probs), old_log_probs=_f64(li.old_log_probs), advantages=_f64(adv),
                    mask=li.mask.to(torch.float64), lengths=ctx.lengths, family_tokens=li.family_tokens,
                    keep=keep, keep_alternative=alternative, **opt)
    knobs = li.knobs
    if knobs.family or knobs.opsm or knobs.entropy_mask or knobs.is_keep:
        # the per-sample terms of the whole step once (a family's micro-batch statistics, the entropy mask's
        # thresholds): each run of samples reads its rows
        from dataclasses import replace

        from ..kernels.grad import _sample_terms

        terms = _sample_terms(gi, replace(knobs, kl_loss_coef=0.0, opd_placement=None))
        if terms is not None and knobs.opsm:
            from .loss import _opsm_reach

            terms = {**terms, "opsm_reach": _opsm_reach(ctx, li)}
        gi = replace(gi, sample_terms=terms)
    return gi, knobs


# Whole samples of about this many tokens at a time: a dozen float64 temporaries per token stay small.
GRAD_CHUNK = 1 << 16


def recompute_gradient(ctx: StageContext) -> tuple[GradInputs, LossKnobs, Gradient]:
    """The analytic gradient of this context and its rounding bound (``ctx.records[BOUND_RECORD]``, with the edge
    hits per sample), computed once, a run of whole samples at a time (the explanations and the why strip reuse
    it)."""
    cached = ctx.records.get(GRADIENT_RECORD)
    if cached is not None:
        return cached
    gi, knobs = gradient_inputs(ctx)
    scale = grad_scale_of(ctx.config)
    n = gi.lengths.numel()
    weights = sample_weights(segment_sum(gi.mask, ctx.seg, n), knobs, scale)
    total = gi.mask.numel()
    f64 = dict(dtype=torch.float64)
    grad, pg, kl, pg_w, kl_w, ratio, bound = (torch.zeros(total, **f64) for _ in range(7))
    opd = torch.zeros(total, **f64) if knobs.opd_loss else None
    weight = torch.zeros(total, **f64) if knobs.is_level is not None else None
    seq = torch.zeros(total, **f64) if knobs.sequence_ratio else None
    branch = torch.zeros(total, dtype=torch.int8)
    u = ctx.precision.token
    u_s = storage_unit(ctx.precision.compute, ctx.reader.payload("log_probs"), ctx.reader.payload("old_log_probs"))
    u_out = storage_unit(ctx.precision.compute, ctx.reader.payload(GRAD_PAYLOAD)) if ctx.has(GRAD_PAYLOAD) else 0.0
    hits: dict[str, torch.Tensor] = {}
    for s0, s1, t0, t1 in sample_chunks(gi.lengths, GRAD_CHUNK):
        part = GradInputs(**{k: _rows(k, v, s0, s1, t0, t1) for k, v in vars(gi).items()})
        g = grad_log_probs(part, knobs, scale, weights=(weights[0][s0:s1], weights[1][s0:s1]))
        for out, value in ((grad, g.grad), (pg, g.pg), (kl, g.kl), (pg_w, g.pg_weight), (kl_w, g.kl_weight),
                           (ratio, g.terms.ratio), (weight, g.terms.weight), (seq, g.terms.seq),
                           (branch, g.terms.branch), (opd, g.opd)):
            if out is not None and value is not None:
                out[t0:t1] = value
        b, chunk_hits = gradient_bound(u, u_s, u_out, part, knobs, g)
        if part.keep_alternative is not None:
            # a MIS decision within rounding of its bound: the gradient had it gone the other way (the flipped
            # token's term, under GSPO its share in the sample's other tokens too)
            from dataclasses import replace

            alt = grad_log_probs(replace(part, keep=part.keep_alternative), knobs, scale,
                                 weights=(weights[0][s0:s1], weights[1][s0:s1]))
            b = b + (alt.grad - g.grad).abs()
            chunk_hits["rs_boundary"] = part.keep_alternative != part.keep
        bound[t0:t1] = b
        part_seg = part.seg
        for kind, hit in chunk_hits.items():
            hit = hit & (part.mask > 0)
            if bool(hit.any()):
                counts = hits.setdefault(kind, torch.zeros(n, **f64))
                counts[s0:s1] += segment_sum(hit.to(torch.float64), part_seg, s1 - s0)
    terms = GradTerms(pg=pg / torch.where(pg_w != 0, pg_w, torch.ones_like(pg_w)), branch=branch, ratio=ratio,
                      seq=seq, weight=weight)
    cached = (gi, knobs, Gradient(grad=grad, pg=pg, kl=kl, pg_weight=pg_w, kl_weight=kl_w, terms=terms, opd=opd))
    ctx.records[GRADIENT_RECORD] = cached
    ctx.records[BOUND_RECORD] = bound
    ctx.records[HITS_RECORD] = hits
    return cached


def _rows(name: str, value, s0: int, s1: int, t0: int, t1: int):
    """``GradInputs`` field ``name`` of the run of samples ``s0:s1`` (tokens ``t0:t1``)."""
    if value is None:
        return None
    if name == "lengths":
        return value[s0:s1]
    if name == "sample_terms":
        return {k: v[s0:s1] for k, v in value.items()}
    if name == "family_tokens":
        return {k: v[t0:t1] for k, v in value.items()}
    return value[t0:t1]


def gradient_bound(u: float, u_s: float, u_out: float, gi: GradInputs, knobs: LossKnobs, g: Gradient
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(bound [tokens], edge hits by kind [tokens] bool)``: the producer's rounding bound per token (module doc;
    ``u`` its token unit roundoff, ``u_s`` the log-probs' storage unit when coarser, ``u_out`` the gradient
    payload's) and the tokens at a decision's edge, whose tolerance admits either branch."""
    m = gi.mask
    t = g.terms
    d = gi.log_probs - gi.old_log_probs
    e_store = u_s * (gi.log_probs.abs() + gi.old_log_probs.abs()) if u_s else None
    lr_cond = d.abs()
    log_w = None
    if t.weight is not None:
        log_w = (gi.old_log_probs - gi.rollout_log_probs).abs() if knobs.is_level == "token" else None
    cond = C_TOKEN + lr_cond + (log_w if log_w is not None else 0.0)
    if knobs.needs_sample_pass:  # GSPO's sample ratio, a sequence or geometric weight: the sample's exponent
        cond = cond + sample_exponent_condition(gi.log_probs, gi.old_log_probs, gi.rollout_log_probs, gi.mask,
                                                gi.lengths, knobs)[gi.seg]
    if e_store is not None:
        cond = cond + C_STORE * e_store / u
    seg = gi.seg
    n_samples = gi.lengths.numel()
    ratio = t.ratio
    hits: dict[str, torch.Tensor] = {}
    if t.err is not None:  # a policy-loss family: its own rounding scale and decision edges
        bound = _family_bound(u, e_store, gi, t, g, hits)
    else:
        bound = u * g.pg.abs() * cond
        w = t.weight if t.weight is not None else torch.ones_like(m)
        unclipped = (gi.advantages * w).abs() * gi.numerator  # |∂pg/∂r| on the unclipped branch
        near = loss_clip_hits(ratio, gi.advantages, u, knobs.eps_clip, knobs.eps_clip_high, e_store)
        hits["clip_boundary"] = near
        if knobs.dual_clip:
            chosen = torch.maximum(ratio, ratio.clamp(1 - knobs.eps_clip, 1 + knobs.eps_clip_high))
            hits["dual_clip_boundary"] = near_value(chosen, float(knobs.eps_clip_c), u, lr_cond, e_store) & \
                (gi.advantages < 0)
        if knobs.log_ratio_clamp is not None:
            x = segment_sum(d * m, seg, n_samples)[seg] / torch.clamp_min(segment_sum(m, seg, n_samples), 1.0)[seg] \
                if knobs.sequence_ratio else d
            hits["clamp_hit"] = (x.abs() - knobs.log_ratio_clamp).abs() <= C_NEAR_CLIP * u * (1 + x.abs() + lr_cond)
        if t.weight is not None and knobs.is_mode == "mask":
            raw = importance_weight_unmasked(gi, knobs)
            flip = torch.zeros_like(m, dtype=torch.bool)
            for edge in (knobs.is_low, knobs.is_high):
                if edge is not None:
                    flip |= near_value(raw, float(edge), u, lr_cond + (log_w if log_w is not None else 0.0), e_store)
            hits["is_mask_boundary"] = flip
            unclipped = torch.maximum(unclipped, (gi.advantages * raw).abs() * gi.numerator)
        edge = torch.zeros_like(m, dtype=torch.bool)
        for hit in hits.values():
            edge |= hit
        edge &= m > 0
        if knobs.sequence_ratio:
            # the sample's float32 sum of slopes (n_i·u of its magnitude), and an edge token's slope in every token's
            n = segment_sum(m, seg, n_samples)
            mag = segment_sum(unclipped, seg, n_samples)
            at_edge = segment_sum(unclipped * edge, seg, n_samples)
            spread = (ratio * t.seq * g.pg_weight).abs() if t.seq is not None else torch.zeros_like(m)
            bound = bound + spread * (u * (n * mag)[seg] + at_edge[seg])
        else:
            bound = bound + torch.where(edge, (unclipped * ratio * g.pg_weight).abs(), torch.zeros_like(bound))
    bound = bound + _mask_bound(u, gi, knobs, t, g, hits)
    if knobs.kl_loss and (knobs.kl_loss_rollout_weighted or knobs.kl_loss_score_function):
        bound = bound + _rollout_kl_bound(u, u_s, gi, knobs, g, hits)
    elif knobs.kl_loss:
        x = gi.log_probs - gi.ref_log_probs
        k, dk = kl_value_and_slope(x, knobs)
        curvature = {"k1": 0.0, "abs": 0.0, "k2": 1.0}.get(knobs.kl_loss_type)
        curv = torch.full_like(x, curvature) if curvature is not None else (-x).exp()
        slope_err = C_TOKEN * u * (dk.abs() + curv * (1 + x.abs()))
        if e_store is not None:
            slope_err = slope_err + C_STORE * curv * u_s * (gi.log_probs.abs() + gi.ref_log_probs.abs())
        if knobs.kl_loss_ratio_weighted:
            slope_err = slope_err * ratio + u * cond * (k.abs() + dk.abs()) * ratio
        bound = bound + slope_err * g.kl_weight.abs() * gi.numerator + u * C_TOKEN * g.kl.abs()
        kl_edge = torch.zeros_like(m, dtype=torch.bool)
        for clamp, value in ((knobs.kl_loss_input_clamp, x), (knobs.kl_loss_output_clamp, k)):
            if clamp is not None:
                kl_edge |= (value.abs() - clamp).abs() <= C_NEAR_CLIP * u * (1 + value.abs())
        kl_edge &= m > 0
        if bool(kl_edge.any()):
            hits["kl_clamp_hit"] = kl_edge
            reach = dk.abs().clamp_min(1.0) * (ratio if knobs.kl_loss_ratio_weighted else 1.0)
            bound = bound + torch.where(kl_edge, reach * g.kl_weight.abs(), torch.zeros_like(bound))
    if g.opd is not None:  # the distillation term: its estimate's slope rounding, a value clamp at its edge
        bound = bound + _opd_bound(u, u_s, gi, knobs, g, hits)
    if u_out:
        bound = bound + u_out * g.grad.abs()
    return bound, hits


def _rollout_kl_bound(u: float, u_s: float, gi: GradInputs, knobs: LossKnobs, g: Gradient, hits: dict
                      ) -> torch.Tensor:
    """The rollout-weighted KL term's rounding (``kernels.grad.rollout_weighted_kl``: ``w·(k' + k)``): the
    estimator's slope and value (``C_TOKEN·u·(|k'| + |k| + k''·(1 + |x|))``, ``k''`` its curvature) and the
    weight's exponent (``u·(C_TOKEN + |logp − rollout|)·(|k'| + |k|)``), × ``w·|W^kl|``; payloads stored coarser
    add their rounding through both exponents; a token whose input or value (``w·k``) lies within rounding of
    its clamp admits the unclamped slope (a ``kl_clamp_hit`` hazard)."""
    from ..kernels.grad import rollout_weighted_kl

    m = gi.numerator
    x = gi.log_probs - gi.ref_log_probs
    r = rollout_weighted_kl(gi, knobs)
    k, dk, w = r["k"], r["dk"], r["w"]
    curvature = {"k1": 0.0, "abs": 0.0, "k2": 1.0}.get(knobs.kl_loss_type)
    curv = torch.full_like(x, curvature) if curvature is not None else (-x).exp()
    mag = dk.abs() + k.abs()
    err = C_TOKEN * u * (mag + curv * (1 + x.abs())) + u * (C_TOKEN + r["log_w"].abs()) * mag
    if u_s:
        err = err + C_STORE * u_s * ((curv + mag) * (gi.log_probs.abs() + gi.ref_log_probs.abs())
                                     + mag * (gi.log_probs.abs() + gi.rollout_log_probs.abs()))
    weight = g.kl_weight.abs()
    out = err * w * weight * m + u * C_TOKEN * g.kl.abs()
    edge = torch.zeros_like(m, dtype=torch.bool)
    for clamp, value in ((knobs.kl_loss_input_clamp, x), (knobs.kl_loss_output_clamp, r["value"])):
        if clamp is not None:
            edge |= (value.abs() - clamp).abs() <= C_NEAR_CLIP * u * (1 + value.abs() + r["log_w"].abs())
    edge &= m > 0
    if bool(edge.any()):
        hits["kl_clamp_hit"] = edge
        reach = (dk.abs().clamp_min(1.0) + k.abs()) * w
        out = out + torch.where(edge, reach * weight, torch.zeros_like(out))
    return out


def _family_bound(u: float, e_store, gi: GradInputs, t: GradTerms, g: Gradient, hits: dict) -> torch.Tensor:
    """A policy-loss family's part: ``u·err·|W|`` (``err`` its slope's rounding scale, kernels.families.grad),
    the log-probs' storage rounding through the slope's condition, and at a token whose 0/1 decision lies within
    rounding of its edge (``edge_gap`` within ``8u·(1 + |Δ|)``, as loss.policy decides it) the slope the other
    branch gives (``open``), named in a ``mask_boundary`` hazard."""
    m = gi.mask
    weight = g.pg_weight.abs()
    lr = t.columns["log_ratio"].abs()
    bound = u * t.err * weight
    if e_store is not None:
        bound = bound + C_STORE * e_store * (1.0 + lr) * g.pg.abs()
    if t.edge_gap is not None and t.open is not None:
        slack = C_NEAR_CLIP * u * (1.0 + lr)
        if e_store is not None:
            slack = slack + C_STORE * e_store
        near = (t.edge_gap <= slack) & (m > 0)
        if bool(near.any()):
            hits["mask_boundary"] = near
            # the other branch's slope with its own rounding (a product or two off an exponent)
            bound = bound + torch.where(near, t.open * weight * (1.0 + C_TOKEN * u * (1.0 + lr)),
                                        torch.zeros_like(bound))
    return bound


def _mask_bound(u: float, gi: GradInputs, knobs: LossKnobs, t: GradTerms, g: Gradient, hits: dict) -> torch.Tensor:
    """At a token whose OPSM or entropy-mask decision, or whose sample's is_keep decision, lies within rounding
    of its edge (as loss.policy decides it), the policy term's slope before the masks (a ``mask_boundary`` /
    ``is_keep_boundary`` hazard)."""
    out = torch.zeros_like(gi.mask)
    if t.keep is None or t.unmasked is None:
        return out
    c = t.columns
    m = gi.mask
    seg = gi.seg
    flip = torch.zeros_like(m, dtype=torch.bool)
    if knobs.opsm:
        st = gi.sample_terms or {}
        reach = st["opsm_reach"][seg] if "opsm_reach" in st else torch.zeros_like(m)
        flip |= ((c["opsm_seq_kl"] - knobs.opsm_delta).abs() <= C_NEAR_CLIP * u * (1.0 + reach)) & \
            c["opsm_negative"]
    if knobs.entropy_mask:
        flip |= near_value(c["entropy"], c["entropy_threshold"], u, 1.0)
    flip &= m > 0
    if bool(flip.any()):
        hits["mask_boundary"] = hits.get("mask_boundary", torch.zeros_like(flip)) | flip
    if knobs.is_keep and gi.rollout_log_probs is not None:
        near = keep_edges(gi, knobs, u)
        if bool(near.any()):
            hits["is_keep_boundary"] = near
            flip = flip | near
    if bool(flip.any()):
        lr = (gi.log_probs - gi.old_log_probs).abs()  # the other branch's slope with its own rounding
        out = torch.where(flip, t.unmasked * g.pg_weight.abs() * (1.0 + C_TOKEN * u * (1.0 + lr)), out)
    return out


def keep_edges(gi: GradInputs, knobs: LossKnobs, u: float) -> torch.Tensor:
    """bool per loss token: an is_keep decision that reaches it lies within rounding of its edge (the reach of
    ``kernels.is_keep.edge_samples``): the token mask's at that token; the outlier mask's or the sequence mask's
    at every token of the sample."""
    import math

    from ..kernels.is_keep import sample_keep

    f64 = torch.float64
    m = gi.mask
    on = m > 0
    seg = gi.seg
    n = gi.lengths.numel()
    old, roll = gi.old_log_probs, gi.rollout_log_probs
    lr = old - roll
    scale = C_NEAR_CLIP * u * (1.0 + old.abs() + roll.abs())
    token = torch.zeros_like(on)
    sample = torch.zeros(n, dtype=torch.bool)
    for kind, low, high in knobs.is_keep:
        if kind in ("outlier", "token"):
            near = torch.zeros_like(on)
            for b in (low, high):
                if b is not None:
                    near |= (lr - math.log(b)).abs() <= scale
            near &= on
            if kind == "token":
                token |= near
            elif bool(near.any()):
                sample[seg[near]] = True
        else:
            terms = sample_keep(old, roll, m, gi.lengths, knobs.is_keep, f64)
            per_token = torch.where(on, lr.abs() + 1.0 + old.abs() + roll.abs(), torch.zeros_like(lr))
            err = C_NEAR_CLIP * u * segment_sum(per_token, seg, n)
            if kind == "geometric":
                err = err / terms["is_keep_count"].clamp_min(1.0)
            for b in (low, high):
                sample |= (terms["is_keep_stat"] - math.log(b)).abs() <= err
    return (token | sample[seg]) & on


def _opd_bound(u: float, u_s: float, gi: GradInputs, knobs: LossKnobs, g: Gradient, hits: dict) -> torch.Tensor:
    """The distillation term's rounding: ``|opd_coef·W|·C_TOKEN·u·(|k'| + |k''|·(1 + |x|))`` at ``x = logp −
    teacher`` (``k''`` the estimator's curvature), and its slope at a value clamp within rounding of its edge."""
    from ..kernels.grad import opd_knobs

    m = gi.mask
    x = gi.log_probs - gi.teacher_log_probs
    okn = opd_knobs(knobs)
    k, dk = kl_value_and_slope(x, okn)
    curvature = {"k1": 0.0, "abs": 0.0, "k2": 1.0}.get(okn.kl_loss_type)
    curv = torch.full_like(x, curvature) if curvature is not None else (-x).exp()
    err = C_TOKEN * u * (dk.abs() + curv * (1 + x.abs()))
    if u_s:
        err = err + C_STORE * curv * u_s * (gi.log_probs.abs() + gi.teacher_log_probs.abs())
    weight = (g.pg_weight * knobs.opd_coef).abs()
    out = err * weight * m + u * C_TOKEN * g.opd.abs()
    edge = torch.zeros_like(m, dtype=torch.bool)
    if knobs.opd_clamp is not None:
        raw, slope = kl_value_and_slope(x, replace_clamp(okn))
        edge = ((raw.abs() - knobs.opd_clamp).abs() <= C_NEAR_CLIP * u * (1 + raw.abs())) & (m > 0)
        if bool(edge.any()):
            hits["kl_clamp_hit"] = hits.get("kl_clamp_hit", torch.zeros_like(edge)) | edge
            out = out + torch.where(edge, slope.abs().clamp_min(1.0) * weight, torch.zeros_like(out))
    return out


def replace_clamp(knobs: LossKnobs) -> LossKnobs:
    from dataclasses import replace

    return replace(knobs, kl_loss_output_clamp=None)


def importance_weight_unmasked(gi: GradInputs, knobs: LossKnobs) -> torch.Tensor:
    """The importance weight before IcePop's mask (``exp`` of its clamped log): what the bounds compare."""
    from dataclasses import replace

    from ..kernels.grad import importance_weights
    return importance_weights(gi, replace(knobs, is_mode="truncate", is_low=None, is_high=None, is_norm=None))


HAZARD_TEXT = {
    "clip_boundary": "a ratio within rounding of a clip bound",
    "dual_clip_boundary": "a ratio within rounding of dual-clip's bound c",
    "clamp_hit": "a log-ratio at log_ratio_clamp",
    "is_mask_boundary": "an importance weight within rounding of an IcePop bound",
    "kl_clamp_hit": "a KL input or value at its clamp",
    "mask_boundary": "a policy-loss mask decision (the family's, OPSM's, the entropy mask's) within rounding of its "
                     "edge",
    "is_keep_boundary": "an is_keep decision of its sample within rounding of its edge",
    "rs_boundary": "a MIS rejection decision (mis_rs, mis_veto) within rounding of its bound",
}


def _edge_hazards(ctx: StageContext, hits: dict[str, torch.Tensor]) -> None:
    """One hazard per sample and kind of edge (``hits``: the loss tokens at it, per sample)."""
    for kind, counts in hits.items():
        for i in torch.nonzero(counts).reshape(-1).tolist():
            ctx.hazard(STAGE, kind, sample=i, message=(
                f"{ctx.sample_ids[i]}: {int(counts[i])} loss token(s) with {HAZARD_TEXT[kind]}: a legitimate "
                f"producer's gradient may take either branch there (grad_log_probs admits both)"))


def value_gradient(v: torch.Tensor, old: torch.Tensor, r: torch.Tensor, m: torch.Tensor, weight: torch.Tensor,
                   value_clip: Optional[float], u: float, e_store: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(∂L/∂values, bound, edge)`` float64 per token of ``weight·½·max(d1², d2²)`` (``weight`` the token's
    ``grad_scale·vf_coef·loss_scale·W_i``): ``d1 = v − R``, ``d2 = clamp(v, v_old ± ε) − R``; the slope is ``d1``
    on the unclipped branch and ``d2·[v_old − ε ≤ v ≤ v_old + ε]`` on the clipped one (the clamp passes no
    gradient outside its range; inside it d1 = d2).

    Bound, derived like loss.value's: each difference rounds once relative to its operands, so the slope is
    within ``C_TOKEN·u·(|v| + |R| + |v_old| + ε + |s|)`` of the exact one, × ``|weight|`` (``e_store``: a
    payload stored coarser adds ``C_STORE·e``). ``edge`` marks the two decisions a legitimate producer's rounding
    may take either way, whose tolerance admits the other branch's slope: the branch (the squares within
    loss.value's ``8·u·c`` of each other, ``c = |d|·(|v| + |R| + |v_old| + ε) + vf``: ``|d1 − d2·inside|``) and
    the clamp's edge (``v`` within ``8·u·(|v| + |v_old| + ε)`` of ``v_old ± ε`` on the clipped branch, where the
    clamp's gradient is 1, 0 or torch's ½ at a tie: ``|d2|``)."""
    d1 = v - r
    if value_clip is None:
        slope = d1
        eps = 0.0
        edge = torch.zeros_like(m, dtype=torch.bool)
        other = torch.zeros_like(d1)
        d2 = d1
    else:
        eps = float(value_clip)
        vc = torch.minimum(torch.maximum(v, old - eps), old + eps)
        d2 = vc - r
        inside = ((v >= old - eps) & (v <= old + eps)).to(torch.float64)
        clip = d2 * d2 > d1 * d1
        slope = torch.where(clip, d2 * inside, d1)
        mag = v.abs() + r.abs() + old.abs() + eps
        d = torch.maximum(d1.abs(), d2.abs())
        slack = C_NEAR_CLIP * u * (d * mag + 0.5 * torch.maximum(d1 * d1, d2 * d2))
        if e_store is not None:
            slack = slack + (2 * C_STORE) * d * e_store
        branch = ((d1 * d1 - d2 * d2).abs() <= slack) & (d1 != d2)
        reach = C_NEAR_CLIP * u * (v.abs() + old.abs() + eps) + (C_STORE * e_store if e_store is not None else 0.0)
        at_clamp = (((v - (old + eps)).abs() <= reach) | ((v - (old - eps)).abs() <= reach)) & (d2 * d2 >= d1 * d1)
        edge = (branch | at_clamp) & (m > 0)
        other = torch.where(branch, (d1 - d2 * inside).abs(), torch.zeros_like(d1))
        other = torch.maximum(other, torch.where(at_clamp, d2.abs(), torch.zeros_like(d2)))
    grad = slope * m * weight
    err = C_TOKEN * u * (v.abs() + r.abs() + (old.abs() + eps if value_clip is not None else 0.0) + slope.abs())
    if e_store is not None:
        err = err + C_STORE * e_store
    bound = (err + torch.where(edge, other, torch.zeros_like(other))) * m * weight.abs()
    return grad, bound, edge


def _value_gradient(ctx: StageContext, knobs: LossKnobs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(∂L/∂values, bound)`` float64 per token (:func:`value_gradient`), a ``value_clip_boundary`` hazard per
    sample with a token at one of the value clip's edges."""
    payloads = [ctx.payload(p) for p in ("values", "old_values", "returns")]
    v, old, r = (_f64(t) for t in payloads)
    m = ctx.loss_mask.to(torch.float64)
    seg = ctx.seg
    counts = segment_sum(m, seg, ctx.n)
    vf_coef = getattr(ctx.config, "vf_coef", 1.0)
    vf_coef = float(vf_coef) if isinstance(vf_coef, (int, float)) and not isinstance(vf_coef, bool) else 1.0
    weight = (agg_weights(knobs.loss_agg_mode, counts, knobs)
              * (knobs.loss_scale * grad_scale_of(ctx.config) * vf_coef))[seg]
    u_s = storage_unit(ctx.precision.compute, *payloads)
    e_store = storage_error(u_s, v, old, r) if u_s else None
    grad, bound, edge = value_gradient(v, old, r, m, weight, knobs.value_clip, ctx.precision.token, e_store)
    u_out = storage_unit(ctx.precision.compute, ctx.reader.payload(GRAD_VALUES_PAYLOAD))
    if u_out:
        bound = bound + u_out * grad.abs()
    hits = segment_sum(edge.to(torch.float64), seg, ctx.n)
    for i in torch.nonzero(hits).reshape(-1).tolist():
        ctx.hazard(STAGE, "value_clip_boundary", sample=i, message=(
            f"{ctx.sample_ids[i]}: {int(hits[i])} loss token(s) with a value at an edge of the value clip (its "
            f"branch or its range): a legitimate producer's gradient may take either there (grad_values admits "
            f"both)"))
    return grad, bound


def run_loss_grad(ctx: StageContext) -> StageReport:
    gi, knobs, g = recompute_gradient(ctx)
    recorded = ctx.payload(GRAD_PAYLOAD)
    fields = []
    # judged with its rounding bound under --exact too: no float32 kernel reproduces a backward pass bit for bit
    bound = ctx.records[BOUND_RECORD]
    _edge_hazards(ctx, ctx.records[HITS_RECORD])
    fields.append(ctx.field(STAGE, GRAD_PAYLOAD, PER_TOKEN, recorded, g.grad, bound=bound, exact=False,
                            note=f"∂L/∂log_probs of the {grad_family(knobs)} loss (policy term {knobs.loss_agg_mode}"
                                 + (f", KL term {knobs.kl_mode} × {knobs.kl_loss_coef:g}" if knobs.kl_loss else "")
                                 + f"; × loss_scale {knobs.loss_scale:g} × grad_scale {grad_scale_of(ctx.config):g})"))
    if ctx.has(GRAD_VALUES_PAYLOAD):
        grad_v, bound_v = _value_gradient(ctx, knobs)
        fields.append(ctx.field(STAGE, GRAD_VALUES_PAYLOAD, PER_TOKEN, ctx.payload(GRAD_VALUES_PAYLOAD), grad_v,
                                bound=bound_v, exact=False,
                                note=f"∂L/∂values of the value loss ({knobs.loss_agg_mode}, value_clip "
                                     f"{knobs.value_clip})"))

    def fail_reason(total, per) -> str:
        return "gradient mismatch: " + ", ".join(
            f"{f.name} in {per[f.name].mismatches} token(s) of {per[f.name].bad_samples} sample(s)"
            for f in fields if per[f.name].mismatches)

    return ctx.report(StageId.LOSS_GRAD, fields, fail_reason=fail_reason,
                      pass_reason=f"{len(fields)} gradient payload(s) over {ctx.n} sample(s) compared")


def _grad_requirements(reader: BundleReader) -> list[str]:
    missing = [m for m in _loss_requirements(reader) if not m.startswith("expected.json")]
    if not reader.has_payload(GRAD_PAYLOAD):
        missing.append(reader.payload_label(GRAD_PAYLOAD))
    if reader.has_payload(GRAD_VALUES_PAYLOAD):
        missing += [f"{reader.payload_label(p)} (for {GRAD_VALUES_PAYLOAD})" for p in ("values", "old_values", "returns")
                    if not reader.has_payload(p)]
    return missing


def _grad_refuse(cfg) -> list[tuple[str, str]]:
    out = list(_loss_refuse(cfg))
    family = grad_family(LossKnobs.of(cfg))
    if family not in GRAD_FAMILIES:
        out.append(("policy_loss", f"{family!r}: no analytic gradient is registered for this loss family"))
    elif family != "ppo_clip" and getattr(cfg, "kl_loss_ratio_weighted", False):
        out.append(("kl_loss_ratio_weighted", f"True: the ratio-weighted KL term's gradient is derived for "
                                              f"policy_loss 'ppo' only, not {family!r}"))
    return out


LOSS_GRAD = StageDef(
    id=StageId.LOSS_GRAD, run=run_loss_grad, needs=(StageId.SAMPLE, StageId.ADVANTAGE_ESTIMATE), cohort_level=True,
    refuse=_grad_refuse, requirements=_grad_requirements, optional=True,
    description="per-token gradient of the loss w.r.t. the log-probs (grad_log_probs), analytic in float64",
)

__all__ = ["GRAD_PAYLOAD", "GRAD_VALUES_PAYLOAD", "LOSS_GRAD", "STAGE", "gradient_bound", "recompute_gradient"]

