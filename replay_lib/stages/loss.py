"""``loss.policy``: the clipped surrogate with the loss-side knobs of SPEC §4.2 (aggregation modes and their
recorded counts, dual-clip, log-ratio clamp, GSPO, KL in the loss, train/rollout importance correction),
recomputed in float64 (``kernels.loss``) and judged with the error model (``error_model.loss_scalar_bounds``).
``loss.value`` is :mod:`replay_lib.stages.value`."""

from __future__ import annotations

import bisect
import math
from typing import Optional

import torch

from ..bundle import BundleReader
from ..judge.error_model import (C_NEAR_CLIP, PG_KL_COND, SEQ32_SUMS, STORAGE_HAZARD, kl_condition, kl_slope, loss_aggregate_bound,
                           loss_clip_hits, loss_scalar_bounds, near_value,
                           sample_exponent_condition)
from ..judge.fields import PER_SCALAR, PER_TOKEN
from ..kernels import LOSS_CHUNK, GrpoReturns
from ..kernels.segments import ChunkSums, grid
from ..kernels.loss import (AGG_COUNTS, POLICY_FIELDS, LossKnobs, agg_weights, field_aggregation, has_clip_lower,
                            policy_fields_for, policy_fields_from_sums, policy_loss_fields, policy_token_terms,
                            sample_log_terms, wants_sample_pass)
from ..judge.error_model import C_STORE
from ..kernels.families import family_refusals, slice_tokens
from ..judge.report import StageReport
from ..bundle.loss_knobs import micro_batch_partition, uses_micro_batches
from ..bundle.schema import RecomputeConfig, StageCapability, StageId
from ..safe_text import safe
from .base import StageContext, StageDef, StageInputError
from .loss_inputs import LossInputs, family_payloads, is_keep_hazards, loss_inputs
from .loss_clip_cov import DRAW_OUTPUT, DrawCounts, clip_cov_draw_field
from .loss_terms import TOKEN_TERMS_PAYLOAD, loss_term_fields, recorded_terms
from .split import PASS_BLOCKS, sample_blocks, shared_zeros, split_pass


def recorded_loss(ctx: StageContext) -> dict[str, float]:
    recorded = ctx.reader.expected.get("loss.policy", {})
    expected = {f: recorded[f] for f in POLICY_FIELDS if f in recorded}
    if not expected:
        raise StageInputError("expected.json $.loss.policy has none of " + ", ".join(POLICY_FIELDS), field="loss")
    knobs = LossKnobs.of(ctx.config)
    for name, why in (("pg_clipfrac_lower", "eps_clip_c is not set"), ("kl_loss", "no KL term is in the loss"),
                      ("opd_loss", "opd_placement is not 'loss'")):
        if name in expected and name not in policy_fields_for(knobs):
            if knobs.policy_loss != "ppo" and name != "kl_loss":
                why = f"policy_loss {knobs.policy_loss!r} reports no {name}"
            raise StageInputError(f"expected.json $.loss.policy.{name} is recorded but {why}", field=name)
    for name in ("pg_clipfrac", "ppo_kl"):
        if name in expected and name not in policy_fields_for(knobs):
            raise StageInputError(f"expected.json $.loss.policy.{name} is recorded but policy_loss "
                                  f"{knobs.policy_loss!r} reports no {name}", field=name)
    return expected


def recompute_policy_loss(ctx: StageContext, li: Optional[LossInputs] = None) -> tuple[dict, dict, Optional[dict]]:
    """``(expected, actual, bound)`` of the loss fields the bundle records: ``actual`` recomputed in float64
    from the inputs this stage consumes (:func:`loss_inputs`), ``bound`` the rounding bound of each
    (``error_model.loss_scalar_bounds``); under ``--exact`` the producer's float32 kernel and no bound."""
    expected = recorded_loss(ctx)
    li = li or loss_inputs(ctx)
    knobs = li.knobs
    if ctx.dtype != torch.float64:
        advantages = li.advantages.materialize() if isinstance(li.advantages, GrpoReturns) else li.advantages
        actual = policy_loss_fields(li.log_probs, li.old_log_probs, advantages, li.entropy, li.mask, ctx.lengths,
                                    eps_clip=knobs.eps_clip, eps_clip_high=knobs.eps_clip_high,
                                    entropy_coef=knobs.entropy_coef, dtype=ctx.dtype, knobs=knobs,
                                    rollout_log_probs=li.rollout_log_probs, ref_log_probs=li.ref_log_probs,
                                    teacher_log_probs=li.teacher_log_probs, family_tokens=li.family_tokens)
        return expected, {f: actual[f] for f in expected}, None
    sums = _loss_sums(ctx, li)
    ctx.outputs[SUMS_OUTPUT] = sums  # the explanations re-aggregate them (explain.loss.micro_batch_hypotheses)
    actual = policy_fields_from_sums(sums, li.entropy is not None, knobs.entropy_coef, knobs)
    bound = loss_scalar_bounds(sums, actual, list(expected), entropy_coef=knobs.entropy_coef,
                               precision=ctx.precision, advantage_bound_per_sample=li.advantage_bound,
                               advantage_per_sample=li.advantage_per_sample, knobs=knobs)
    # the step-wide hazard first: it says how much every loss field admits
    if "store_pg" in sums:
        _storage_hazard(ctx, li, bound, actual)
    _loss_hazards(ctx, sums)
    is_keep_hazards(ctx, li, StageId.LOSS_POLICY.value)
    if li.rs_alternative is not None:
        actual = _rejection_boundary(ctx, li, expected, actual, bound)
    return expected, {f: actual[f] for f in expected}, bound


def _rejection_boundary(ctx: StageContext, li: LossInputs, expected: dict, actual: dict, bound: dict) -> dict:
    """Rejection sampling decided within rounding of a bound (``kernels.mismatch.rejection_decisions``): a
    ``rs_boundary`` hazard per sample, and the loss fields recomputed with those decisions taken the other way;
    the recorded loss is judged against whichever of the two is nearer (the largest error over the fields, in
    units of each field's bound): a legitimate producer may keep or drop those tokens, while a decision far from
    its bound taken the other way still diverges. (All the near decisions flip together: two or more of them
    taken different ways are not tried.)"""
    import dataclasses

    knobs = li.knobs
    alt_sums = _loss_sums(ctx, dataclasses.replace(li, keep=li.rs_alternative) if li.keep is not None else
                          dataclasses.replace(li, mask=li.rs_alternative))
    other = policy_fields_from_sums(alt_sums, li.entropy is not None, knobs.entropy_coef, knobs)

    def error(values: dict) -> float:
        worst = 0.0
        for name, want in expected.items():
            gap = abs(float(want) - float(values[name])) / (bound.get(name, 0.0) + 1e-300)
            worst = max(worst, gap if math.isfinite(gap) else math.inf)
        return worst

    chosen = actual
    if error(other) < error(actual):
        chosen = other
        ctx.outputs[SUMS_OUTPUT] = alt_sums
    per_sample = torch.zeros(ctx.n, dtype=torch.int64).index_add_(0, ctx.seg, li.rs_near.to(torch.int64))
    for i in torch.nonzero(per_sample).reshape(-1).tolist():
        ctx.hazard(StageId.LOSS_POLICY.value, "rs_boundary", sample=i, message=(
            f"{safe(ctx.sample_ids[i])}: {int(per_sample[i])} loss token(s) whose rejection-sampling decision "
            f"(rollout_rs) lies within rounding of its threshold: a legitimate producer may keep or drop them "
            f"(the loss admits either: {'the other decision' if chosen is other else 'this decision'} fits the "
            f"recorded loss)"))
    return chosen


def _storage_hazard(ctx: StageContext, li: LossInputs, bound: dict[str, float], actual: dict) -> None:
    """One ``coarse_payload`` hazard when the loss's inputs are stored coarser than the declared compute: their
    rounding is admitted in every field (``error_model.loss_storage_bounds``, and the clip decisions it opens);
    the fields whose bound then reaches a tenth of the value are named with it (a change smaller than that goes
    unseen there), those whose bound exceeds the value apart: such a scalar cannot tell the value from 0, and the
    per-sample terms (or ``pg_losses``) are what locate a change there."""
    wide, over = [], []
    for f, b in bound.items():
        value = abs(float(actual[f]))
        if b > 0 and b >= STORAGE_HAZARD * value:
            (over if b >= value else wide).append(f"{f} ±{b:.2g} (value {float(actual[f]):.2g})")
    parts = ["every loss field admits their rounding"]
    if over:
        located = recorded_terms(ctx) is not None or ctx.has(TOKEN_TERMS_PAYLOAD)
        parts.append(f"it exceeds the value in {', '.join(over)}, where a change that size goes unseen: "
                     + ("the per-sample terms locate it" if located else
                        "record the per-sample loss terms (loss_terms=, pg_losses=) to locate it"))
    if wide:
        parts.append(f"it reaches a tenth of the value in {', '.join(wide)}")
    ctx.coarse_payload_hazard(StageId.LOSS_POLICY.value, li.payloads(), "; ".join(parts))


# ctx.outputs key of the float64 per-sample sums of the recompute (:func:`_loss_sums`), every loss knob included.
SUMS_OUTPUT = "loss_sums"

# Tokens per step of :func:`_loss_sums`' pass on a step of LARGE_PASS tokens or more: twice ``LOSS_CHUNK`` (the
# replay runs on one intra-op thread, ``run.threads``), half the steps' fixed costs (per-op dispatch, the chunk's
# sample ids, the hit tests) at two dozen float64 rows of 256 KiB each, which still stay in cache; measured at
# 1,024 × 16,384 on one thread: 0.55 → 0.45 s for the pass (4 × LOSS_CHUNK: 0.48 s). Those rows hold ≈ 6 MiB more
# of the allocator's memory: below LARGE_PASS tokens (≈ 80 MiB of payloads) that is more than 5% of the payloads,
# so a smaller step keeps LOSS_CHUNK (at 256 × 8,192 the peak above torch stays 1.4× the 42 MiB of payloads). Every
# per-token term is elementwise and every sum is taken over the same runs in the same order at either step, so
# the sums are the same bits.
PASS_CHUNK = 2 * LOSS_CHUNK
LARGE_PASS = 1 << 22


def _sample_pass(ctx: StageContext, li: LossInputs) -> tuple[dict, Optional[torch.Tensor]]:
    """The per-sample quantities a per-sample knob needs before the token pass (GSPO's ratio, a sequence or
    geometric IS weight: ``kernels.sample_log_terms`` in float64) and their condition for the error model
    (``error_model.sample_exponent_condition``; ``None`` when no knob has one)."""
    knobs = li.knobs
    if not wants_sample_pass(knobs):
        return {}, None
    terms = sample_log_terms(li.log_probs, li.old_log_probs, li.rollout_log_probs, li.mask, ctx.lengths, knobs,
                             dtype=torch.float64, entropy=li.entropy, advantages=li.advantages,
                             family_tokens=li.family_tokens)
    if knobs.opsm:  # the edge test's reach: √n_i · the sample's mean |anchor| + |logp| (a mean's rounding)
        terms["opsm_reach"] = _opsm_reach(ctx, li)
    if not knobs.needs_sample_pass:  # the family's own terms carry their condition (pg_err)
        return terms, None
    return terms, sample_exponent_condition(li.log_probs, li.old_log_probs, li.rollout_log_probs, li.mask,
                                            ctx.lengths, knobs)


def _loss_sums(ctx: StageContext, li: LossInputs) -> dict[str, torch.Tensor]:
    """One pass over the tokens, a chunk at a time, each per-token term evaluated once in float64: the float64
    per-sample sums of the loss fields (``kernels.policy_sums``) and the error model's (``error_model.ABS_SUMS``)
    — the rows of a chunk written into one buffer, added to their samples by ``kernels.segments.ChunkSums`` —,
    the counts of tokens near a clip bound, with an extreme ratio or at a clamp (added only where a chunk has
    any), and the surrogate, ppo_kl, entropy and KL term summed sequentially in float32
    (``error_model.SEQ32_SUMS``)."""
    knobs = li.knobs
    u_token = ctx.precision.token
    entropy = li.entropy
    # a non-negative entropy is its own magnitude; Σ ratio only matters for recomputed advantages (--chain)
    # (its min: one pass, and a NaN makes it signed as a comparison would)
    signed_entropy = entropy is not None and _signed(ctx, entropy)
    with_ratio = li.advantage_bound is not None
    kl_loss = knobs.kl_loss
    opd = knobs.opd_loss
    # a mask decided per token or sample by a comparison (OPSM, the entropy mask): its edges are hazards (a
    # family's own decisions are its edge_gap / edge_open columns: edge_flip below)
    masks = knobs.opsm or knobs.entropy_mask
    masked_is = knobs.is_level is not None and knobs.is_mode == "mask"
    clamps = (knobs.log_ratio_clamp is not None or (kl_loss and (knobs.kl_loss_input_clamp is not None
                                                                 or knobs.kl_loss_output_clamp is not None)))
    signed_names = ["pg", "kl", "ent"] + (["kl_loss"] if kl_loss else [])
    # summed rows, in buffer order: the signed terms, then the magnitudes beside them
    names = signed_names + ["abs_pg", "abs_kl"] + (["abs_kl_loss", "kl_loss_tok"] if kl_loss else [])
    names += ["clip", "mask"] + (["clip_lower"] if has_clip_lower(knobs) else []) + ["kl_pg"]
    names += (["abs_ent"] if signed_entropy else []) + (["ratio"] if with_ratio else [])
    names += ["is_flip"] if masked_is else []
    names += ["mask_flip"] if masks else []
    names += ["opd_loss", "abs_opd_loss", "opd_loss_tok"] if opd else []
    # a policy-loss family's decision edges (kernels.families: edge_gap, edge_open)
    families = knobs.policy_loss != "ppo"
    names += ["edge_flip"] if families else []
    clip_lower = has_clip_lower(knobs)
    # payloads stored coarser than the declared compute (error_model.storage_unit): what their rounding moves
    store = li.storage(ctx.precision.compute)
    if store.any:
        names += ["store_pg", "store_kl", "store_ent"] + (["store_kl_loss"] if kl_loss else []) + (
            ["store_opd_loss"] if opd else [])
    # counted rows: whole numbers of masked tokens, rare (hazards), added by sample where a chunk has any
    counted = ["near_clip", "extreme"] + (["near_lower"] if knobs.dual_clip else []) + (["clamped"] if clamps else [])
    row = {name: k for k, name in enumerate(names)}
    n_signed = len(signed_names)
    sample_terms, sample_cond = _sample_pass(ctx, li)
    n = ctx.n
    if store.any:
        store_sample = store.sample_errors(li.log_probs, li.old_log_probs, li.rollout_log_probs, li.mask, ctx.lengths,
                                           knobs)
    draw = DrawCounts.of(knobs)  # Clip-Cov: its draw's size per micro-batch, from this pass (loss_clip_cov.py)
    total = int(li.mask.numel())
    # a large step's pass split between this thread and a second worker (split.py), a forked one writing its
    # samples' columns of these totals into memory shared with this process
    blocks = sample_blocks(ctx.offsets, ctx.lengths, total, PASS_BLOCKS) \
        if draw is None and total >= LARGE_PASS and ctx.threads > 1 else []
    zeros_of = shared_zeros if len(blocks) > 1 else torch.zeros
    out = zeros_of((len(names), n), dtype=torch.float64)
    counts = zeros_of((len(counted), n), dtype=torch.float64)
    step = PASS_CHUNK if total >= LARGE_PASS else LOSS_CHUNK
    # every sum of the signed rows taken in token order in float32, a chunk's runs at a time (SequentialSums32)
    seq32 = SequentialSums32(ctx.lengths, ctx.offsets, n_signed, step)
    zeros = torch.zeros(0, dtype=torch.float64)
    low, high = 1.0 - knobs.eps_clip, 1.0 + knobs.eps_clip_high
    # a chunk at a time even on a short token axis: two dozen chunk-long float64 temporaries stay in cache and
    # in the allocator's free lists, where full-length ones would be fresh pages on every replay; the summed rows
    # of every chunk are a view of one buffer (the mask's row is the float64 mask the chunk's terms take)
    chunk_rows = torch.empty((len(names), min(step, max(total, 1))), dtype=torch.float64)
    sums = ChunkSums(ctx.lengths, ctx.offsets)
    # the sample of each token: for a plain PPO surrogate only where a chunk has a hit to count (ctx.token_spans),
    # for every chunk where a knob reads per-sample values
    by_sample = (families or knobs.sequence_ratio or knobs.is_level is not None or bool(knobs.is_keep) or knobs.opsm
                 or knobs.entropy_mask or draw is not None or sample_cond is not None or store.any or masks
                 or masked_is)
    # the advantages as stored where every product promotes them to float64 in the kernel (exact, as converting
    # them first: one token-long conversion fewer per chunk); a family's kernel or the dual clip's scalar product
    # takes them converted
    promote = not (families or knobs.dual_clip) and torch.promote_types(li.advantages.dtype, torch.float64) == \
        torch.float64

    def token_pass(start: int, stop: int, chunk_rows: torch.Tensor, seq32: SequentialSums32) -> None:
        """Tokens ``[start, stop)`` (whole samples), into ``out``, ``counts`` and ``seq32``."""
        for lo, hi, chunk_seg in ctx.token_spans(step, start, stop):
            seg = chunk_seg() if by_sample else None
            buf = chunk_rows[:, :hi - lo]
            m = buf[row["mask"]].copy_(li.mask[lo:hi])
            if li.keep is not None:  # slime's MIS rejection: the terms' numerators only (the mask row counts)
                m = m * li.keep[lo:hi]
            adv = li.advantages[lo:hi] if promote else li.advantages[lo:hi].to(torch.float64)
            t = policy_token_terms(
                li.log_probs[lo:hi], li.old_log_probs[lo:hi], adv, knobs, seg=seg, sample_terms=sample_terms,
                rollout_log_probs=li.rollout_log_probs[lo:hi] if li.rollout_log_probs is not None else None,
                ref_log_probs=li.ref_log_probs[lo:hi] if li.ref_log_probs is not None else None, dtype=torch.float64,
                entropy=entropy[lo:hi] if entropy is not None else None,
                teacher_log_probs=li.teacher_log_probs[lo:hi] if opd else None,
                family_tokens=slice_tokens(li.family_tokens, slice(lo, hi)))
            pg, ratio, lr = t["pg"], t["ratio"], t["log_ratio"]
            if draw is not None:
                draw.add(t, seg, li.mask[lo:hi], u_token)
            signed = buf[:n_signed]
            torch.mul(pg, m, out=buf[0])
            torch.mul(t["ppo_kl"], m, out=buf[1])
            if entropy is not None:
                torch.mul(entropy[lo:hi], m, out=buf[2])  # promoted to float64 in the product: the same bits
            else:
                buf[2].zero_()
            if kl_loss:
                torch.mul(t["kl_loss"], m, out=buf[3])
            magnitude = torch.abs(buf[:2], out=buf[row["abs_pg"]:row["abs_kl"] + 1])
            # the exponent's condition: the log-ratio (and the sample's, for GSPO), the importance weight's log
            abs_lr = lr.abs()
            cond = abs_lr
            if sample_cond is not None:
                cond = cond + sample_cond[seg]
            if "is_log_weight" in t:
                cond = cond + t["is_log_weight"].abs()
            torch.mul(t["clip"], m, out=buf[row["clip"]])
            if clip_lower:
                torch.mul(t["clip_lower"], m, out=buf[row["clip_lower"]])
            if kl_loss:
                torch.abs(buf[3], out=buf[row["abs_kl_loss"]])
                kl_r = t["kl_r"] if knobs.kl_loss_input_clamp is None else \
                    t["kl_r"].clamp(-knobs.kl_loss_input_clamp, knobs.kl_loss_input_clamp)
                torch.mul(kl_condition(kl_r, knobs.kl_loss_type), m, out=buf[row["kl_loss_tok"]])
                if knobs.kl_loss_ratio_weighted:  # kl·w: w·cond_kl + |kl·w|·(the ratio's exponent condition + 2)
                    buf[row["kl_loss_tok"]].mul_(ratio).add_(buf[row["abs_kl_loss"]] * (PG_KL_COND * cond + 2.0))
                if knobs.kl_loss_rollout_weighted:  # kl·w, w = exp(logp − rollout): the same with w's exponent
                    buf[row["kl_loss_tok"]].mul_(t["kl_weight"]).add_(
                        buf[row["abs_kl_loss"]] * (PG_KL_COND * t["kl_weight_log"].abs() + 2.0))
            if "pg_err" in t:  # the family's own rounding scale of its surrogate (× the importance weight)
                w = t.get("is_weight")
                torch.mul(t["pg_err"] if w is None else t["pg_err"] * w + magnitude[0] * t["is_log_weight"].abs(), m,
                          out=buf[row["kl_pg"]])
            else:
                torch.mul(magnitude[0], cond, out=buf[row["kl_pg"]])
            e_ratio = e_weight = None
            if store.any:  # each term's storage error: |∂x|·e per token (error_model.loss_storage_bounds)
                e = store.token_errors(knobs, seg, store_sample, li.log_probs[lo:hi], li.old_log_probs[lo:hi],
                                       li.rollout_log_probs[lo:hi] if li.rollout_log_probs is not None else None,
                                       li.ref_log_probs[lo:hi] if kl_loss else None,
                                       li.teacher_log_probs[lo:hi] if opd else None)
                e_ratio, e_weight = e["ratio"], e["weight"]
                torch.mul(e["log_ratio"], m, out=buf[row["store_kl"]])
                torch.mul(magnitude[0], e_ratio + e_weight + store.advantage, out=buf[row["store_pg"]])
                torch.abs(buf[2], out=buf[row["store_ent"]]).mul_(store.entropy)
                if kl_loss:  # kl_r: the KL term's (clamped) log-ratio, above
                    torch.mul(kl_slope(kl_r, knobs.kl_loss_type, e["kl"]).mul_(e["kl"]), m, out=buf[row["store_kl_loss"]])
                    if knobs.kl_loss_ratio_weighted:  # w·e_kl + |kl·w|·e_ratio/w
                        buf[row["store_kl_loss"]].mul_(ratio).add_(buf[row["abs_kl_loss"]] * e_ratio)
                    if knobs.kl_loss_rollout_weighted:  # w·e_kl + |kl·w|·(the storage error of logp − rollout)
                        buf[row["store_kl_loss"]].mul_(t["kl_weight"]).add_(buf[row["abs_kl_loss"]] * e["kl_weight"])
                if opd:  # the distillation term's r = logp − teacher, as the KL term's
                    torch.mul(kl_slope(t["opd_r"], knobs.opd_kl_type, e["opd"]).mul_(e["opd"]), m,
                              out=buf[row["store_opd_loss"]])
            if masks:
                _mask_flips(knobs, t, seg, sample_terms, u_token, m, buf[row["mask_flip"]])
            if opd:
                torch.mul(t["opd_loss"], m, out=buf[row["opd_loss"]])
                torch.abs(buf[row["opd_loss"]], out=buf[row["abs_opd_loss"]])
                opd_r = t["opd_r"]
                torch.mul(kl_condition(opd_r, knobs.opd_kl_type), m, out=buf[row["opd_loss_tok"]])
            if signed_entropy:
                torch.abs(buf[2], out=buf[row["abs_ent"]])
            if with_ratio:
                w = t.get("is_weight")
                torch.mul(ratio if w is None else ratio * w, m, out=buf[row["ratio"]])
            if masked_is:
                log_w = t["is_log_weight"]
                w = (log_w if knobs.is_log_clamp is None else log_w.clamp(-knobs.is_log_clamp, knobs.is_log_clamp)).exp()
                w_cond = log_w.abs() + (sample_cond[seg] if sample_cond is not None else 0.0)
                flip = torch.zeros_like(w, dtype=torch.bool)
                for edge in (knobs.is_low, knobs.is_high):
                    if edge is not None:
                        flip |= near_value(w, float(edge), u_token, w_cond, e_weight)
                # a token the mask may keep or drop: its whole weighted term w·|pg| is open
                torch.mul(flip.to(torch.float64) * m * t["pg_unweighted"].abs(), w, out=buf[row["is_flip"]])
            if families:
                near = _family_edge_hits(t, u_token, cond, e_ratio)
                open_ = t.get("edge_open")
                if open_ is None or not bool(near.any()):
                    buf[row["edge_flip"]].zero_()
                else:  # a decision that drops the term: the whole (weighted) term is open at its edge
                    w = t.get("is_weight")
                    torch.mul(near.to(torch.float64) * m * open_, 1.0 if w is None else w, out=buf[row["edge_flip"]])
            else:
                near = loss_clip_hits(ratio, adv, u_token, knobs.eps_clip, knobs.eps_clip_high, e_ratio)
            hits = [near, abs_lr > EXTREME_LOG_RATIO]
            if knobs.dual_clip:
                chosen = torch.maximum(ratio, ratio.clamp(low, high))
                hits.append(near_value(chosen, float(knobs.eps_clip_c), u_token, cond, e_ratio) & (adv < 0))
            if clamps:
                hit = torch.zeros_like(m, dtype=torch.bool)
                if knobs.log_ratio_clamp is not None:
                    hit |= (t["log_ratio"].abs() >= knobs.log_ratio_clamp)
                if kl_loss and knobs.kl_loss_input_clamp is not None:
                    hit |= t["kl_r"].abs() >= knobs.kl_loss_input_clamp
                if kl_loss and knobs.kl_loss_output_clamp is not None:
                    hit |= t.get("kl_loss_unweighted", t["kl_loss"]).abs() >= knobs.kl_loss_output_clamp
                hits.append(hit)
            for k, hit in enumerate(hits):
                if hit.numpy().any():  # Σ hit·m of each sample (numpy's any: a tenth of torch's fixed cost)
                    at = torch.nonzero(hit).reshape(-1)
                    counts[k].index_add_(0, chunk_seg()[at], m[at])
            # every row at once: the float64 rows' per-sample sums, a LOSS_CHUNK of tokens at a time (the same runs, so
            # the same pairwise sums, at any PASS_CHUNK), and seq32's in token order in float32
            # (on the LOSS_CHUNK grid of the token axis, wherever the chunk starts: the same runs in any split)
            for a, b in grid(lo, hi, LOSS_CHUNK):
                sums.add(out, a, b, buf[:, a - lo:b - lo])
            seq32.add(lo, hi, signed)

    if len(blocks) < 2:
        token_pass(0, total, chunk_rows, seq32)
    else:  # blocks of whole samples taken by two workers (split.py): their columns of the sums are disjoint
        other = SequentialSums32(ctx.lengths, ctx.offsets, n_signed, step, shared=True)

        def columns(lo: int, hi: int) -> slice:  # the samples of the block of tokens [lo, hi)
            a, b = (int(i) for i in torch.searchsorted(ctx.offsets, torch.tensor([lo, hi])))
            return slice(a, b)

        def redo(lo: int, hi: int) -> None:  # a block a forked worker left unfinished: its columns cleared first
            out[:, columns(lo, hi)] = 0.0
            counts[:, columns(lo, hi)] = 0.0
            token_pass(lo, hi, chunk_rows, seq32)

        taken = split_pass(blocks, lambda lo, hi: token_pass(lo, hi, chunk_rows, seq32),
                           lambda lo, hi: token_pass(lo, hi, torch.empty_like(chunk_rows), other),
                           ctx.reader.wait_hashed, redo)
        for lo, hi in taken:  # the float32 sums of the samples the other worker summed
            seq32.totals[:, columns(lo, hi)] = other.totals[:, columns(lo, hi)]
    if draw is not None:
        ctx.outputs[DRAW_OUTPUT] = draw
    totals = {**dict(zip(names, out)), **dict(zip(counted, counts))}
    totals["abs_ent"] = totals.get("abs_ent", totals["ent"])
    totals["ratio"] = totals.get("ratio", zeros)
    return {**totals, **dict(zip(SEQ32_SUMS, seq32.totals))}


class SequentialSums32:
    """Per-sample sums of float32 rows in token order — ``((0 + v0) + v1) + …`` rounded to float32 at every step,
    the producer's sequential sums (``error_model.SEQ32_SUMS``) — fed the token axis a chunk at a time. Each chunk's
    runs of tokens are summed by ``torch.segment_reduce`` (a float32 loop per segment, in order, from 0: the bits
    of ``index_add_`` in token order, at twice its speed), the sum so far of the sample a chunk continues written
    ahead of that sample's run. ``totals``: ``[rows, samples]``; an empty sample's stay 0."""

    def __init__(self, lengths: torch.Tensor, offsets: torch.Tensor, rows: int, step: int,
                 shared: bool = False) -> None:
        present = lengths > 0
        self._starts = offsets[present].tolist()  # where each non-empty sample starts, ascending
        self._samples = torch.nonzero(present).reshape(-1)
        self._all = bool(present.all())  # no empty sample: a chunk's samples are a slice of the totals' columns
        self.totals = (shared_zeros if shared else torch.zeros)((rows, int(lengths.numel())), dtype=torch.float32)
        self._buf = torch.empty((rows, step + 1), dtype=torch.float32)

    def add(self, lo: int, hi: int, rows: torch.Tensor) -> None:
        """Tokens ``[lo, hi)`` of every row (``rows``: ``[rows, hi − lo]``, rounded to float32 here)."""
        first = bisect.bisect_right(self._starts, lo) - 1
        stop = bisect.bisect_left(self._starts, hi)
        bounds = [lo, *self._starts[first + 1:stop], hi]
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        lengths[0] += 1  # the first run starts with its sample's sum so far (0 for a sample starting here)
        samples = slice(first, stop) if self._all else self._samples[first:stop]
        buf = self._buf[:, :hi - lo + 1]
        buf[:, 0] = self.totals[:, first if self._all else int(samples[0])]
        buf[:, 1:].copy_(rows)
        runs = torch.tensor(lengths, dtype=torch.int64).expand(buf.shape[0], -1).contiguous()
        self.totals[:, samples] = torch.segment_reduce(buf, "sum", lengths=runs, axis=1)


def _signed(ctx: StageContext, values: torch.Tensor) -> bool:
    """Whether ``values`` holds a negative number or a NaN (``not values.min() >= 0``), a chunk at a time: each
    chunk's rows of the mapped payloads let go behind it (the loss pass reads them again a chunk at a time)."""
    step = LOSS_CHUNK * 16
    for lo in range(0, values.shape[0], step):
        signed = not bool(values[lo:lo + step].min() >= 0)
        ctx.release(lo, lo + step)
        if signed:
            return True
    return False


def _opsm_reach(ctx: StageContext, li: LossInputs) -> torch.Tensor:
    """Per sample: how far a legitimate producer's rounding may move OPSM's sequence KL — ``√n_i`` times the mean
    ``|anchor| + |logp|`` over the sample's loss tokens (the edge test's condition, as GSPO's mean)."""
    anchor = li.rollout_log_probs if li.knobs.opsm_anchor == "rollout" else li.old_log_probs
    m = li.mask.to(torch.float64)
    mag = (anchor.to(torch.float64).nan_to_num(nan=0.0).abs() + li.log_probs.to(torch.float64).abs()) * m
    total = torch.zeros(ctx.n, dtype=torch.float64).index_add_(0, ctx.seg, mag)
    count = torch.zeros(ctx.n, dtype=torch.float64).index_add_(0, ctx.seg, m).clamp_min(1.0)
    return total / count * count.sqrt()


def _mask_flips(knobs: LossKnobs, t: dict, seg: torch.Tensor, sample_terms: dict, u_token: float, m: torch.Tensor,
                out: torch.Tensor) -> None:
    """``|pg before the mask|·m`` (× the importance weight) at each token a mask may keep or drop within rounding:
    OPSM's sequence KL within its reach of ``opsm_delta`` (A < 0), an entropy within rounding of its micro-batch's
    threshold."""
    out.zero_()
    flip = torch.zeros_like(m, dtype=torch.bool)
    if knobs.opsm:  # only a token with A < 0 is ever dropped
        reach = (C_NEAR_CLIP * u_token) * (1.0 + sample_terms["opsm_reach"][seg])
        flip |= ((t["opsm_seq_kl"] - knobs.opsm_delta).abs() <= reach) & t["opsm_negative"]
    if knobs.entropy_mask:
        flip |= near_value(t["entropy"], t["entropy_threshold"], u_token, 1.0)
    weight = t.get("is_weight")
    if knobs.opsm or knobs.entropy_mask:
        mag = t["pg_unmasked"].abs() * m * flip.to(torch.float64)
        out.add_(mag * weight if weight is not None else mag)


def _family_edge_hits(t: dict, u_token: float, cond: torch.Tensor, stored: Optional[torch.Tensor]) -> torch.Tensor:
    """bool per token: a policy-loss family's decision within rounding of its edge (``edge_gap``, relative to the
    compared quantity's rounding scale, within ``8·u_t·(1 + cond)``, plus ``2·e`` for log-probs stored coarser)."""
    gap = t.get("edge_gap")
    if gap is None:
        return torch.zeros_like(cond, dtype=torch.bool)
    slack = (C_NEAR_CLIP * u_token) * (1.0 + cond)
    if stored is not None:
        slack = slack + stored * C_STORE
    return gap <= slack


# ln(1e3): a ratio exp(−ppo_kl) beyond 1e3 (or below 1e-3) is a hazard.
EXTREME_LOG_RATIO = math.log(1e3)


def _loss_hazards(ctx: StageContext, sums: dict[str, torch.Tensor]) -> None:
    stage = StageId.LOSS_POLICY.value
    for i in torch.nonzero(sums["near_clip"]).reshape(-1).tolist():
        ctx.hazard(stage, "clip_boundary", sample=i, message=(
            f"{ctx.sample_ids[i]}: {int(sums['near_clip'][i])} loss token(s) with a ratio within rounding of a clip "
            f"bound: a legitimate producer may clip them either way (pg_clipfrac admits it)"))
    for i in torch.nonzero(sums["extreme"]).reshape(-1).tolist():
        ctx.hazard(stage, "extreme_ratio", sample=i, message=(
            f"{ctx.sample_ids[i]}: {int(sums['extreme'][i])} loss token(s) with a ratio beyond 1e3 or below 1e-3 "
            f"(|log ratio| > {EXTREME_LOG_RATIO:.2f})"))
    if "clamped" in sums:
        for i in torch.nonzero(sums["clamped"]).reshape(-1).tolist():
            ctx.hazard(stage, "clamp_hit", sample=i, message=(
                f"{ctx.sample_ids[i]}: {int(sums['clamped'][i])} loss token(s) at a log-ratio or KL clamp "
                f"(log_ratio_clamp / kl_loss_input_clamp / kl_loss_output_clamp): the clamped value is compared"))
    if "mask_flip" in sums:
        for i in torch.nonzero(sums["mask_flip"]).reshape(-1).tolist():
            ctx.hazard(stage, "mask_boundary", sample=i, message=(
                f"{ctx.sample_ids[i]}: loss token(s) whose OPSM sequence KL (opsm_delta) or entropy (the "
                f"top_entropy_quantile threshold) lies within rounding of its edge: a legitimate producer may keep "
                f"or drop them (pg_loss admits either)"))
    if "edge_flip" in sums:
        for i in torch.nonzero(sums["edge_flip"]).reshape(-1).tolist():
            ctx.hazard(stage, "mask_boundary", sample=i, message=(
                f"{ctx.sample_ids[i]}: a token whose policy-loss mask decision lies within rounding of its edge: a "
                f"legitimate producer may keep or drop its term (pg_loss admits either)"))
    if "is_flip" in sums:
        for i in torch.nonzero(sums["is_flip"]).reshape(-1).tolist():
            ctx.hazard(stage, "is_mask_boundary", sample=i, message=(
                f"{ctx.sample_ids[i]}: an importance weight within rounding of an IcePop bound (is_low/is_high): a "
                f"legitimate producer may keep or drop its tokens (pg_loss admits either)"))


# Loss field → the recorded per-sample term it aggregates (SPEC §4: the scalars are checked against them).
TERM_OF_FIELD = {"pg_loss": "pg_sum", "entropy_loss": "entropy_sum", "pg_clipfrac": "clip_count",
                  "ppo_kl": "kl_sum", "kl_loss": "kl_loss_sum"}

# Loss field → the row of the recompute's per-sample sums it aggregates (:func:`_loss_sums`' names; its mode and
# scale are ``kernels.loss.field_aggregation``'s).
ROW_OF_FIELD = {"pg_loss": "pg", "entropy_loss": "ent", "kl_loss": "kl_loss", "pg_clipfrac": "clip", "ppo_kl": "kl",
                "pg_clipfrac_lower": "clip_lower"}


# The aggregate check's rows are named after the field they check: ``pg_loss_from_terms``.
AGGREGATE_SUFFIX = "_from_terms"


def aggregate_field(ctx: StageContext, expected: dict[str, float], knobs: LossKnobs):
    """The recorded scalars against the aggregation of the recorded per-sample terms (SPEC §4), with the
    weights of the configured mode (``kernels.agg_weights``; ``n_i`` the recorded ``mask_count``, else the
    loss mask): a producer whose per-sample sums are right but whose aggregation is not (a per-micro-batch
    token-mean denominator) fails here. ``None`` when the bundle records no per-sample terms. Judged with its
    rounding bound under ``--exact`` too: the producer's summation order of the terms is unknown, so no kernel
    reproduces the recorded scalars from them bit for bit (3e-17 is no aggregation bug)."""
    terms = recorded_terms(ctx)
    if terms is None:
        return None
    recorded = terms.recorded()
    names = [f for f in expected if TERM_OF_FIELD.get(f) in recorded]
    # (the per-sample terms hold no distillation term: with one, loss is not their aggregation)
    if "loss" in expected and "pg_sum" in recorded and (not knobs.kl_loss or "kl_loss_sum" in recorded) and (
            knobs.entropy_coef == 0 or "entropy_sum" in recorded) and not knobs.opd_loss:
        names.insert(0, "loss")
    if not names:
        return None
    if "mask_count" in recorded:
        n = torch.tensor([float(v) for v in recorded["mask_count"]], dtype=torch.float64)
        if ctx.partial:
            n = n[ctx.indices]
    else:
        n = torch.zeros(ctx.n, dtype=torch.float64).index_add_(0, ctx.seg, ctx.loss_mask.to(torch.float64))

    def column(term: str) -> torch.Tensor:
        values = torch.tensor([math.nan if v is None else float(v) for v in recorded[term]], dtype=torch.float64)
        return values[ctx.indices] if ctx.partial else values

    actual, bound = [], []
    for name in names:
        if name == "loss":
            parts = [(column("pg_sum"), knobs.loss_agg_mode, knobs.loss_scale)]
            if knobs.entropy_coef != 0:
                parts.append((column("entropy_sum"), knobs.entropy_mode, -knobs.entropy_coef * knobs.loss_scale))
            if knobs.kl_loss:
                parts.append((column("kl_loss_sum"), knobs.kl_mode, knobs.kl_loss_coef * knobs.loss_scale))
        else:
            parts = [(column(TERM_OF_FIELD[name]), *field_aggregation(name, knobs))]
        weighted = [values * agg_weights(mode, n, knobs) * scale for values, mode, scale in parts]
        value = sum(float(w.sum()) for w in weighted)
        actual.append(value)
        bound.append(loss_aggregate_bound(weighted, value, ctx.precision))
    return ctx.field("loss.policy", "aggregate", PER_SCALAR, [expected[f] for f in names],
                     torch.tensor(actual, dtype=torch.float64), labels=[f + AGGREGATE_SUFFIX for f in names],
                     bound=torch.tensor(bound, dtype=torch.float64), exact=False,
                     note=f"the recorded scalars against the recorded per-sample terms aggregated "
                          f"({knobs.loss_modes}; metrics {knobs.metric_agg_mode})")


def run_loss_policy(ctx: StageContext) -> StageReport:
    """The per-sample and per-token loss terms first, when the bundle records them (SPEC §4: a loss divergence
    is then located to its sample and token), then the recorded scalars against the recorded terms'
    aggregation, then the recorded scalars against the recompute."""
    li = loss_inputs(ctx)
    knobs = li.knobs
    terms = loss_term_fields(ctx, li)
    expected, actual, bound = recompute_policy_loss(ctx, li)
    names = list(expected)
    n = ctx.n
    aggregate = aggregate_field(ctx, expected, knobs)
    how = "each a sum over {n} sample{s} of per-sample means" if knobs.loss_modes == "sum_of_sample_means" \
        and knobs.metric_agg_mode == "sum_of_sample_means" else \
        f"loss terms aggregated {knobs.loss_modes} (× {knobs.loss_scale:g}), metrics {knobs.metric_agg_mode}, " \
        "over {n} sample{s}"
    scalars = ctx.field("loss.policy", "loss", PER_SCALAR, [expected[f] for f in names],
                        torch.tensor([float(actual[f]) for f in names], dtype=torch.float64), labels=names,
                        bound=torch.tensor([bound[f] for f in names], dtype=torch.float64) if bound else None,
                        note=how.format(n=n, s="s" if n != 1 else ""))
    extra = [aggregate] if aggregate is not None else []
    draw = clip_cov_draw_field(ctx, li)  # Clip-Cov: the recorded draw's size per micro-batch
    if draw is not None:
        extra.append(draw)

    def fail_reason(total, per) -> str:
        parts = []
        bad_terms = [f"{f.name} in {per[f.name].mismatches} token(s) of {per[f.name].bad_samples} sample(s)"
                     if f.per == PER_TOKEN else f"{f.name} in {per[f.name].bad_samples} sample(s)"
                     for f in terms if per[f.name].mismatches]
        if bad_terms:
            parts.append("loss term mismatch: " + ", ".join(bad_terms))
        if aggregate is not None and per["aggregate"].mismatches:
            bad = [f.removesuffix(AGGREGATE_SUFFIX) for f, b in zip(aggregate.labels, aggregate.bad.tolist()) if b]
            parts.append("loss aggregation mismatch (the recorded per-sample terms do not aggregate to the "
                         f"recorded {', '.join(bad)} under {knobs.loss_modes})")
        bad_fields = [f for f, bad in zip(names, scalars.bad.tolist()) if bad]
        if bad_fields:
            parts.append("loss field mismatch: " + ", ".join(bad_fields))
        return "; ".join(parts)

    checked = f"{len(names)} field(s)" + (f" and {len(terms)} loss term(s)" if terms else "")
    return ctx.report(StageId.LOSS_POLICY, [*terms, *extra, scalars], fail_reason=fail_reason,
                      pass_reason=f"{checked} over {n} sample(s) compared")


# The per-token payloads of the loss-side knobs (SPEC §4.2): validate checks their rows like the V1 ones.
KNOB_TOKEN_PAYLOADS = ("rollout_log_probs", "pg_losses", "values", "old_values", "returns", "teacher_log_probs",
                       "clip_cov_mask")


def knob_payloads(cfg: RecomputeConfig) -> list[tuple[str, str]]:
    """``(knob, payload)`` for each payload the configured loss-side knobs need (effective values)."""
    knobs = LossKnobs.of(cfg)
    out = []
    if knobs.is_level is not None:
        out.append(("is_level" if cfg.is_level is not None else "use_tis", "rollout_log_probs"))
    if knobs.kl_loss:
        out.append(("use_kl_loss", "ref_log_probs"))
    if knobs.opsm and knobs.opsm_anchor == "rollout" and knobs.is_level is None:
        out.append(("opsm_anchor", "rollout_log_probs"))
    if knobs.entropy_mask:
        out.append(("top_entropy_quantile", "entropy"))
    if knobs.opd_loss:
        out.append(("opd_placement", "teacher_log_probs"))
    out += [("policy_loss", name) for name in family_payloads(knobs)
            if not (name == "rollout_log_probs" and (knobs.is_level is not None or knobs.opsm_anchor == "rollout"
                                                      and knobs.opsm))]
    if knobs.policy_loss in ("cispo", "dppo_mu") and \
            dict(knobs.policy_loss_params).get("anchor", "rollout" if knobs.policy_loss == "dppo_mu" else "old") \
            == "rollout":
        out.append(("policy_loss_params.anchor", "rollout_log_probs"))
    if knobs.is_keep and knobs.is_level is None:
        out.append(("is_keep", "rollout_log_probs"))
    return out


def count_requirements(cfg: RecomputeConfig) -> list[str]:
    """Dependency-closure errors for the aggregation modes: a mode whose recorded count is missing."""
    users: dict[str, list[str]] = {}  # a missing count → the modes that aggregate over it, one line each count
    for knob in ("loss_agg_mode", "metric_agg_mode", "kl_loss_agg_mode", "entropy_agg_mode"):
        if knob != "loss_agg_mode" and getattr(cfg, knob) is None:
            continue  # None: loss_agg_mode's mode and counts, checked above
        mode = getattr(cfg, knob) or cfg.loss_agg_mode
        for count in AGG_COUNTS.get(mode, ()):
            if getattr(cfg, count) is None:
                users.setdefault(count, []).append(f"{knob}={mode!r}")
    return [f"index.json $.config.{count} ({' and '.join(modes)} "
            f"{'aggregates' if len(modes) == 1 else 'aggregate'} over the producer's recorded {count})"
            for count, modes in users.items()]


def partition_requirements(reader: BundleReader) -> list[str]:
    """A ``micro_batch_token_mean`` aggregation needs every sample's ``micro_batch_id`` (the partition)."""
    knob = uses_micro_batches(reader.index.config)
    if getattr(reader.index.config, "policy_loss", "ppo") == "kl_cov" and \
            micro_batch_partition(reader.index.samples) is None:
        return ["index.json $.samples[*].micro_batch_id (policy_loss='kl_cov' takes its top-k tokens within each of "
                "the producer's micro-batches)"]
    if getattr(reader.index.config, "policy_loss", "ppo") == "clip_cov" and \
            micro_batch_partition(reader.index.samples) is None:
        return ["index.json $.samples[*].micro_batch_id (policy_loss='clip_cov' takes its covariance's means within "
                "each of the producer's micro-batches)"]
    if knob is None or micro_batch_partition(reader.index.samples) is not None:
        return []
    return [f"index.json $.samples[*].micro_batch_id ({knob}='micro_batch_token_mean' averages the token means of "
            "the producer's micro-batches)"]


def _loss_requirements(reader: BundleReader) -> list[str]:
    cfg = reader.index.config
    missing = [reader.payload_label(n) for n in ("log_probs", "old_log_probs") if not reader.has_payload(n)]
    if cfg.entropy_coef != 0 and not reader.has_payload("entropy"):
        missing.append(reader.payload_label('entropy'))
    est = reader.manifest.stage_contracts.get(StageId.ADVANTAGE_ESTIMATE)
    if not reader.has_payload("advantages") and not (est is not None and est.capability == StageCapability.RECOMPUTE):
        missing.append(reader.payload_label('advantages'))
    for knob, payload in knob_payloads(cfg):
        if not reader.has_payload(payload):
            missing.append(f"{reader.payload_label(payload)} (for {knob})")
    missing += count_requirements(cfg)
    missing += partition_requirements(reader)
    if getattr(cfg, "is_batch_normalize", False) is True and cfg.is_level is not None and \
            LossKnobs.of(cfg).is_norm is None:
        missing.append("index.json $.config.is_batch_norm_factor (is_batch_normalize divides the importance weights "
                       "by the step's recorded batch mean: verl's rollout_corr/rollout_is_batch_norm_factor)")
    if not any(f in reader.expected.get("loss.policy", {}) for f in POLICY_FIELDS):
        missing.append("expected.json $.loss.policy.loss")
    return missing


def _loss_refuse(cfg: RecomputeConfig) -> list[tuple[str, str]]:
    out = family_refusals(cfg)
    for knob, why in (
        ("calculate_per_token_loss", "True: per-token loss aggregation under slime's name is not mapped: record "
                                     "loss_agg_mode='token_mean' with loss_token_count instead"),
        ("use_rollout_logprobs", "True: rollout log-probs as the PPO anchor are not implemented in V1"),
    ):
        if getattr(cfg, knob):
            out.append((knob, why))
    from ..kernels.families import check_params

    knobs = LossKnobs.of(cfg)
    wrong = check_params(knobs.policy_loss, knobs.policy_loss_params)
    if wrong is not None:
        out.append(wrong)
    elif knobs.policy_loss == "vespo" and knobs.is_level is not None:
        out.append(("is_level", f"{knobs.is_level!r} with policy_loss='vespo': TRL folds the importance ratio into "
                                "VESPO's sequence weight (grpo_trainer.py:2993-2997) instead of multiplying the loss; "
                                "not recomputed"))
    if getattr(cfg, "rollout_correction_anchor", None) == "current" and knobs.is_level is not None and \
            knobs.policy_loss != "gpg":
        out.append(("rollout_correction_anchor", f"'current' with is_level={knobs.is_level!r} and policy_loss="
                                                 f"{knobs.policy_loss!r}: weights of the current log-probs are "
                                                 "recomputed for verl's bypass REINFORCE (policy_loss 'gpg') only"))
    if knobs.entropy_mask and knobs.entropy_coef != 0:
        out.append(("top_entropy_quantile", f"{knobs.top_entropy_quantile!r} with entropy_coef != 0: TRL's entropy "
                                            "bonus then averages over the masked tokens only (grpo_trainer.py:3193), "
                                            "which the entropy term's aggregation does not recompute"))
    # Every loss-side knob of SPEC §4.2 is recomputed. (normalize_advantages is advantage.estimate's: this stage
    # consumes the advantages as recorded, or under --chain as advantage.estimate recomputed them.)
    return out


LOSS_POLICY = StageDef(
    id=StageId.LOSS_POLICY, run=run_loss_policy, needs=(StageId.SAMPLE, StageId.ADVANTAGE_ESTIMATE),
    cohort_level=True, refuse=_loss_refuse, requirements=_loss_requirements,
    description="clipped policy loss (SPEC §4.2 aggregation modes, dual-clip, GSPO, KL loss, IS correction)",
)
