"""``advantage.kl`` (rollout vs reference) and ``advantage.estimate`` (GRPO returns)."""

from __future__ import annotations

from typing import Optional

import torch

from ..bundle import BundleReader
from ..compare import as_float64, list_tensor
from ..error_model import advantage_bound, kl_bound, unit_roundoff
from ..fields import PER_TOKEN
from ..kernels import KL_CLAMP, KL_TYPES, GrpoReturns, compute_approx_kl, get_grpo_returns, rollout_kl, token_chunks
from ..report import StageReport
from ..schema import RecomputeConfig, StageCapability, StageId
from .base import Chunked, StageContext, StageDef, StageInputError, not_recomputed_yet


def run_advantage_kl(ctx: StageContext) -> StageReport:
    cfg = ctx.config
    expected = ctx.payload("kl")
    bound = None
    if cfg.kl_coef == 0:  # zeros in the payload's dtype: a bundle of zeros matches at once (compare_field)
        kl = torch.zeros(int(ctx.lengths.sum()), dtype=expected.dtype)
    else:
        if not ctx.has("ref_log_probs"):
            raise StageInputError("payload 'ref_log_probs' is required when kl_coef != 0", field="ref_log_probs")
        old, ref = ctx.payload("old_log_probs"), ctx.payload("ref_log_probs")
        if ctx.dtype != torch.float64:  # --exact: the producer's float32 kernel, compared bitwise
            kl = rollout_kl(old, ref, cfg.kl_coef, cfg.kl_loss_type, dtype=ctx.dtype)
        else:
            cols = _kl_columns(ctx, old, ref, expected.dtype)
            kl, bound = cols.column("actual"), cols.column("bound")
            if cfg.kl_loss_type == "low_var_kl":
                _kl_clamp_hazards(ctx, old, ref)
    field = ctx.field("advantage.kl", "kl", PER_TOKEN, expected, kl, bound=bound)
    return ctx.report(
        StageId.ADVANTAGE_KL, [field],
        fail_reason=lambda total, per: f"kl mismatch in {total.mismatches} token(s) of {total.bad_samples} sample(s)",
        pass_reason=lambda total, per: f"{total.compared} token(s) compared ({cfg.kl_loss_type}, kl_coef={cfg.kl_coef})")


def _kl_columns(ctx: StageContext, old: torch.Tensor, ref: torch.Tensor, stored: torch.dtype) -> Chunked:
    """The float64 KL of rows ``[lo, hi)`` and its rounding bound, from the recorded log-probs upcast."""
    kl_type = ctx.config.kl_loss_type
    u_token, u_store = ctx.precision.token, unit_roundoff(stored)

    def chunk(lo: int, hi: int) -> dict[str, torch.Tensor]:
        o, r = old[lo:hi].to(torch.float64), ref[lo:hi].to(torch.float64)
        truth = compute_approx_kl(o, r, kl_type, dtype=torch.float64)
        return {"actual": truth, "bound": kl_bound(o - r, truth, kl_type, u_token, u_store)}

    return Chunked(chunk)


def _kl_clamp_hazards(ctx: StageContext, old: torch.Tensor, ref: torch.Tensor) -> None:
    """Samples with tokens whose k3 lies beyond low_var_kl's ±10 clamp."""
    hits = torch.zeros(ctx.n, dtype=torch.int64)
    for lo, hi, seg in token_chunks(ctx.lengths):
        neg = ref[lo:hi].to(torch.float64) - old[lo:hi].to(torch.float64)
        over = (neg.exp() - 1 - neg).abs() > KL_CLAMP
        if bool(over.any()):
            hits.index_add_(0, seg[over], torch.ones(int(over.sum()), dtype=torch.int64))
    for i in torch.nonzero(hits).reshape(-1).tolist():
        ctx.hazard("advantage.kl", "kl_clamp", sample=i, message=(
            f"{ctx.sample_ids[i]}: {int(hits[i])} token(s) with k3 beyond the ±{KL_CLAMP:g} clamp of low_var_kl "
            f"(the recorded value is the clamp, not the estimate)"))


def _kl_requirements(reader: BundleReader) -> list[str]:
    missing = [f"payloads/{n}.pt" for n in ("kl",) if not reader.has_payload(n)]
    if reader.index.config.kl_coef != 0:
        missing += [f"payloads/{n}.pt" for n in ("old_log_probs", "ref_log_probs") if not reader.has_payload(n)]
    return missing


def _kl_refuse(cfg: RecomputeConfig) -> list[tuple[str, str]]:
    if cfg.kl_coef != 0 and cfg.kl_loss_type not in KL_TYPES:
        return [("kl_loss_type", f"{cfg.kl_loss_type!r} is not one of {', '.join(KL_TYPES)}")]
    return []


def grpo_rewards(ctx: StageContext) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(rewards, their rounding bound)``: the normalized rewards advantage.estimate consumes — the recorded
    ones (teacher forcing: expected.json ``reward.post_process.rewards``, else the samples' ``reward``; bound
    ``None``), or under ``--chain`` (or when none are recorded) what reward.post_process recomputed, with
    the bound a legitimate producer's rewards may be off by."""
    if "rewards" in ctx.outputs and (ctx.chain or not _rewards_recorded(ctx)):
        return ctx.outputs["rewards"], ctx.outputs.get("reward_bound")
    recorded = ctx.reader.expected.get("reward.post_process", {}).get("rewards")
    if isinstance(recorded, list):
        return as_float64(ctx.expected_list("reward.post_process", "rewards")), None
    if any(s.reward is None for s in ctx.samples):
        raise StageInputError("no normalized rewards: reward.post_process did not run and samples lack 'reward'",
                              field="reward")
    return list_tensor([s.reward for s in ctx.samples], torch.float64), None


def _rewards_recorded(ctx: StageContext) -> bool:
    recorded = ctx.reader.expected.get("reward.post_process", {}).get("rewards")
    return isinstance(recorded, list) or all(s.reward is not None for s in ctx.samples)


def run_advantage_estimate(ctx: StageContext) -> StageReport:
    expected = ctx.payload("advantages")
    rewards, inherited = grpo_rewards(ctx)
    bound = None
    if ctx.dtype != torch.float64:  # --exact: the producer's float32 broadcast, compared bitwise
        advantages = get_grpo_returns(rewards, ctx.lengths, dtype=ctx.dtype)
        actual = advantages
    else:
        advantages = GrpoReturns(rewards, ctx.lengths, dtype=torch.float64)
        per_sample = advantage_bound(advantages.rewards, unit_roundoff(expected.dtype))
        if inherited is not None:
            per_sample = per_sample + inherited.to(torch.float64)
        ctx.outputs["advantage_bound"] = per_sample

        def chunk(lo: int, hi: int) -> dict[str, torch.Tensor]:
            sample = advantages.sample_of(lo, hi)
            return {"actual": advantages.rewards[sample], "bound": per_sample[sample]}

        cols = Chunked(chunk)
        actual, bound = cols.column("actual"), cols.column("bound")
    ctx.outputs["advantages"] = advantages
    field = ctx.field("advantage.estimate", "advantage", PER_TOKEN, expected, actual, bound=bound)
    return ctx.report(
        StageId.ADVANTAGE_ESTIMATE, [field],
        fail_reason=lambda total, per: f"advantage mismatch in {total.mismatches} token(s) of {total.bad_samples} sample(s)",
        pass_reason=lambda total, per: f"{total.compared} token(s) compared")


def _estimate_requirements(reader: BundleReader) -> list[str]:
    missing = [] if reader.has_payload("advantages") else ["payloads/advantages.pt"]
    post = reader.manifest.stage_contracts.get(StageId.REWARD_POST_PROCESS)
    has_rewards = (post is not None and post.capability == StageCapability.RECOMPUTE) or isinstance(
        reader.expected.get("reward.post_process", {}).get("rewards"), list
    ) or all(s.reward is not None for s in reader.index.samples)
    if not has_rewards:
        missing.append("normalized rewards (reward.post_process, expected rewards or samples[].reward)")
    return missing


def _estimate_refuse(cfg: RecomputeConfig) -> list[tuple[str, str]]:
    if cfg.normalize_advantages:
        return [("normalize_advantages", "True: advantage whitening is not implemented in V1")]
    return not_recomputed_yet(cfg, ("gamma", "lam", "advantage_whiten_stats"))


ADVANTAGE_KL = StageDef(
    id=StageId.ADVANTAGE_KL, run=run_advantage_kl, needs=(StageId.SAMPLE,), refuse=_kl_refuse,
    requirements=_kl_requirements, description="rollout-vs-reference KL per token",
)
ADVANTAGE_ESTIMATE = StageDef(
    id=StageId.ADVANTAGE_ESTIMATE, run=run_advantage_estimate, needs=(StageId.REWARD_POST_PROCESS,),
    refuse=_estimate_refuse, requirements=_estimate_requirements,
    description="GRPO returns: reward broadcast over response tokens",
)
