"""``loss.policy``: clipped surrogate, sum of per-sample masked means. (``loss.value`` has no adapter: it is
listed in ``stages.UNSUPPORTED``.)"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..bundle import BundleReader
from ..error_model import SEQ32_SUMS, loss_clip_boundary, loss_scalar_bounds
from ..fields import PER_SCALAR, PER_TOKEN
from ..kernels import (LOSS_FIELDS, GrpoReturns, policy_fields_from_sums, policy_loss_fields,
                       policy_loss_terms, sorted_segment_sums, token_chunks)
from ..report import StageReport
from ..schema import RecomputeConfig, StageCapability, StageId
from .base import StageContext, StageDef, StageInputError, not_recomputed_yet
from .loss_terms import loss_term_fields


@dataclass(frozen=True)
class LossInputs:
    """What loss.policy consumes: the recorded log-probs, old log-probs, entropy and mask, and the
    advantages — the recorded payload (teacher forcing), or under ``--chain`` (or without the payload)
    advantage.estimate's recomputed ones, with their per-sample rounding bound (``advantage_bound``)."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: "torch.Tensor | GrpoReturns"
    entropy: Optional[torch.Tensor]
    mask: torch.Tensor
    advantage_bound: Optional[torch.Tensor] = None
    advantage_per_sample: Optional[torch.Tensor] = None


def recorded_loss(ctx: StageContext) -> dict[str, float]:
    recorded = ctx.reader.expected.get("loss.policy", {})
    expected = {f: recorded[f] for f in LOSS_FIELDS if f in recorded}
    if not expected:
        raise StageInputError("expected.json $.loss.policy has none of " + ", ".join(LOSS_FIELDS), field="loss")
    return expected


def loss_inputs(ctx: StageContext) -> LossInputs:
    cfg = ctx.config
    recomputed = ctx.outputs.get("advantages") if ctx.chain or not ctx.has("advantages") else None
    bound = per_sample = None
    if recomputed is None:
        advantages = ctx.payload("advantages")
    else:
        advantages = recomputed
        bound = ctx.outputs.get("advantage_bound")
        per_sample = recomputed.rewards if isinstance(recomputed, GrpoReturns) else None
    entropy = ctx.payload("entropy") if ctx.has("entropy") else None
    if entropy is None and cfg.entropy_coef != 0:
        raise StageInputError("payload 'entropy' is required when entropy_coef != 0", field="entropy")
    return LossInputs(log_probs=ctx.payload("log_probs"), old_log_probs=ctx.payload("old_log_probs"),
                      advantages=advantages, entropy=entropy, mask=ctx.loss_mask, advantage_bound=bound,
                      advantage_per_sample=per_sample)


def recompute_policy_loss(ctx: StageContext) -> tuple[dict, dict, Optional[dict]]:
    """``(expected, actual, bound)`` of the loss fields the bundle records: ``actual`` recomputed in float64
    from the inputs this stage consumes (:func:`loss_inputs`), ``bound`` the rounding bound of each
    (``error_model.loss_scalar_bounds``); under ``--exact`` the producer's float32 kernel and no bound."""
    cfg = ctx.config
    expected = recorded_loss(ctx)
    li = loss_inputs(ctx)
    if ctx.dtype != torch.float64:
        advantages = li.advantages.materialize() if isinstance(li.advantages, GrpoReturns) else li.advantages
        actual = policy_loss_fields(li.log_probs, li.old_log_probs, advantages, li.entropy, li.mask, ctx.lengths,
                                    eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high,
                                    entropy_coef=cfg.entropy_coef, dtype=ctx.dtype)
        return expected, {f: actual[f] for f in expected}, None
    sums = _loss_sums(ctx, li)
    actual = policy_fields_from_sums(sums, li.entropy is not None, cfg.entropy_coef)
    bound = loss_scalar_bounds(sums, actual, list(expected), entropy_coef=cfg.entropy_coef,
                               precision=ctx.precision, advantage_bound_per_sample=li.advantage_bound,
                               advantage_per_sample=li.advantage_per_sample)
    _loss_hazards(ctx, sums)
    return expected, {f: actual[f] for f in expected}, bound


def _loss_sums(ctx: StageContext, li: LossInputs) -> dict[str, torch.Tensor]:
    """One pass over the tokens, a chunk at a time, each per-token term evaluated once in float64: the float64
    per-sample sums of the loss fields (``kernels.POLICY_SUMS``), the error model's (``error_model.ABS_SUMS``)
    and the tokens with an extreme ratio — all columns of a chunk summed in one cumulative sum — and the
    surrogate, ppo_kl and entropy summed sequentially in float32 (``error_model.SEQ32_SUMS``: ``seq32``)."""
    cfg = ctx.config
    u_token = ctx.precision.token
    entropy = li.entropy
    # a non-negative entropy is its own magnitude; Σ ratio only matters for recomputed advantages (--chain)
    signed_entropy = entropy is not None and not bool((entropy >= 0).all())
    with_ratio = li.advantage_bound is not None
    names = ["pg", "kl", "ent", "clip", "mask", "abs_pg", "abs_kl", "kl_pg", "near_clip", "extreme"]
    names += ["abs_ent"] if signed_entropy else []
    names += ["ratio"] if with_ratio else []
    n = ctx.n
    out = torch.zeros((len(names), n), dtype=torch.float64)
    seq32 = torch.zeros((len(SEQ32_SUMS), n), dtype=torch.float32)
    zeros = torch.zeros(0, dtype=torch.float64)
    for lo, hi, seg in token_chunks(ctx.lengths):
        m = li.mask[lo:hi].to(torch.float64)
        ppo_kl = li.old_log_probs[lo:hi].to(torch.float64) - li.log_probs[lo:hi].to(torch.float64)
        adv = li.advantages[lo:hi].to(torch.float64)
        pg, clip, ratio = policy_loss_terms(ppo_kl, adv, cfg.eps_clip, cfg.eps_clip_high)
        ent = entropy[lo:hi].to(torch.float64) if entropy is not None else torch.zeros_like(m)
        signed = torch.stack([pg, ppo_kl, ent]).mul_(m)  # pg·m, ppo_kl·m, entropy·m
        magnitude = signed[:2].abs()
        rows = [signed, clip.mul_(m)[None], m[None], magnitude, (magnitude[0] * ppo_kl.abs())[None],
                loss_clip_boundary(ratio, adv, u_token, cfg.eps_clip, cfg.eps_clip_high).mul_(m)[None],
                (ppo_kl.abs() > EXTREME_LOG_RATIO).to(torch.float64).mul_(m)[None]]
        if signed_entropy:
            rows.append(signed[2:].abs())
        if with_ratio:
            rows.append((ratio * m)[None])
        samples, sums = sorted_segment_sums(torch.cat(rows), seg)
        out.index_add_(1, samples, sums)
        for k in range(len(SEQ32_SUMS)):
            seq32[k].index_add_(0, seg, signed[k].to(torch.float32))
    sums = dict(zip(names, out))
    sums["abs_ent"] = sums.get("abs_ent", sums["ent"])
    sums["ratio"] = sums.get("ratio", zeros)
    return {**sums, **dict(zip(SEQ32_SUMS, seq32))}


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


def run_loss_policy(ctx: StageContext) -> StageReport:
    """The per-sample and per-token loss terms first, when the bundle records them (SPEC §4: a loss divergence
    is then located to its sample and token), then the reported scalars."""
    li = loss_inputs(ctx)
    terms = loss_term_fields(ctx, log_probs=li.log_probs, old_log_probs=li.old_log_probs, advantages=li.advantages,
                             entropy=li.entropy, mask=li.mask, config=ctx.config,
                             advantage_bound=li.advantage_bound)
    expected, actual, bound = recompute_policy_loss(ctx)
    names = list(expected)
    n = ctx.n
    scalars = ctx.field("loss.policy", "loss", PER_SCALAR, [expected[f] for f in names],
                        torch.tensor([float(actual[f]) for f in names], dtype=torch.float64), labels=names,
                        bound=torch.tensor([bound[f] for f in names], dtype=torch.float64) if bound else None,
                        note=f"each a sum over {n} sample{'s' if n != 1 else ''} of per-sample means")

    def fail_reason(total, per) -> str:
        parts = []
        bad_terms = [f"{f.name} in {per[f.name].mismatches} token(s) of {per[f.name].bad_samples} sample(s)"
                     if f.per == PER_TOKEN else f"{f.name} in {per[f.name].bad_samples} sample(s)"
                     for f in terms if per[f.name].mismatches]
        if bad_terms:
            parts.append("loss term mismatch: " + ", ".join(bad_terms))
        bad_fields = [f for f, bad in zip(names, scalars.bad.tolist()) if bad]
        if bad_fields:
            parts.append("loss field mismatch: " + ", ".join(bad_fields))
        return "; ".join(parts)

    checked = f"{len(names)} field(s)" + (f" and {len(terms)} loss term(s)" if terms else "")
    return ctx.report(StageId.LOSS_POLICY, [*terms, scalars], fail_reason=fail_reason,
                      pass_reason=f"{checked} over {n} sample(s) compared")


def _loss_requirements(reader: BundleReader) -> list[str]:
    cfg = reader.index.config
    missing = [f"payloads/{n}.pt" for n in ("log_probs", "old_log_probs") if not reader.has_payload(n)]
    if cfg.entropy_coef != 0 and not reader.has_payload("entropy"):
        missing.append("payloads/entropy.pt")
    est = reader.manifest.stage_contracts.get(StageId.ADVANTAGE_ESTIMATE)
    if not reader.has_payload("advantages") and not (est is not None and est.capability == StageCapability.RECOMPUTE):
        missing.append("payloads/advantages.pt")
    if not any(f in reader.expected.get("loss.policy", {}) for f in LOSS_FIELDS):
        missing.append("expected.json $.loss.policy.loss")
    return missing


def _loss_refuse(cfg: RecomputeConfig) -> list[tuple[str, str]]:
    out = []
    for knob, why in (
        ("use_kl_loss", "True: a KL term in the actor loss is not implemented in V1"),
        ("use_tis", "True: truncated importance sampling is not implemented in V1"),
        ("calculate_per_token_loss", "True: per-token loss aggregation is not implemented in V1"),
        ("normalize_advantages", "True: advantage whitening is not implemented in V1"),
        ("use_rollout_logprobs", "True: rollout log-probs as the PPO anchor are not implemented in V1"),
    ):
        if getattr(cfg, knob):
            out.append((knob, why))
    if cfg.eps_clip_c is not None:
        out.append(("eps_clip_c", f"{cfg.eps_clip_c}: dual-clip PPO is not implemented in V1"))
    return out + not_recomputed_yet(cfg, LOSS_KNOBS)


# SPEC §4.2's loss-side knobs (besides the V1 flags above).
LOSS_KNOBS = ("loss_agg_mode", "metric_agg_mode", "loss_token_count", "loss_seq_count", "loss_horizon",
              "loss_scale", "log_ratio_clamp", "importance_level", "kl_loss_input_clamp", "kl_loss_output_clamp",
              "is_level", "is_mode", "is_low", "is_high", "is_log_clamp", "value_clip")


LOSS_POLICY = StageDef(
    id=StageId.LOSS_POLICY, run=run_loss_policy, needs=(StageId.SAMPLE, StageId.ADVANTAGE_ESTIMATE),
    cohort_level=True, refuse=_loss_refuse, requirements=_loss_requirements,
    description="clipped policy loss, sum of per-sample masked means",
)
