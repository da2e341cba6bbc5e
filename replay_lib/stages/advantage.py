"""``advantage.kl`` (rollout vs reference) and ``advantage.estimate`` (GRPO returns)."""

from __future__ import annotations

import torch

from ..bundle import BundleReader
from ..compare import as_float64, list_tensor
from ..fields import PER_TOKEN
from ..kernels import KL_TYPES, get_grpo_returns, rollout_kl
from ..report import StageReport
from ..schema import RecomputeConfig, StageCapability, StageId
from .base import StageContext, StageDef, StageInputError


def run_advantage_kl(ctx: StageContext) -> StageReport:
    cfg = ctx.config
    expected = ctx.payload("kl")
    if cfg.kl_coef == 0:
        kl = torch.zeros(int(ctx.lengths.sum()), dtype=torch.float32)
    else:
        if not ctx.has("ref_log_probs"):
            raise StageInputError("payload 'ref_log_probs' is required when kl_coef != 0", field="ref_log_probs")
        kl = rollout_kl(ctx.payload("old_log_probs"), ctx.payload("ref_log_probs"), cfg.kl_coef, cfg.kl_loss_type)
    field = ctx.field("advantage.kl", "kl", PER_TOKEN, expected, kl)
    return ctx.report(
        StageId.ADVANTAGE_KL, [field],
        fail_reason=lambda total, per: f"kl mismatch in {total.mismatches} token(s) of {total.bad_samples} sample(s)",
        pass_reason=lambda total, per: f"{total.compared} token(s) compared ({cfg.kl_loss_type}, kl_coef={cfg.kl_coef})")


def _kl_requirements(reader: BundleReader) -> list[str]:
    missing = [f"payloads/{n}.pt" for n in ("kl",) if not reader.has_payload(n)]
    if reader.index.config.kl_coef != 0:
        missing += [f"payloads/{n}.pt" for n in ("old_log_probs", "ref_log_probs") if not reader.has_payload(n)]
    return missing


def _kl_refuse(cfg: RecomputeConfig) -> list[tuple[str, str]]:
    if cfg.kl_coef != 0 and cfg.kl_loss_type not in KL_TYPES:
        return [("kl_loss_type", f"{cfg.kl_loss_type!r} is not one of {', '.join(KL_TYPES)}")]
    return []


def grpo_rewards(ctx: StageContext) -> torch.Tensor:
    """The normalized rewards advantage.estimate consumes: the recorded ones (teacher forcing: expected.json
    ``reward.post_process.rewards``, else the samples' ``reward``); under ``--chain``, or when none are
    recorded, what reward.post_process recomputed."""
    if "rewards" in ctx.outputs and (ctx.chain or not _rewards_recorded(ctx)):
        return ctx.outputs["rewards"]
    recorded = ctx.reader.expected.get("reward.post_process", {}).get("rewards")
    if isinstance(recorded, list):
        return as_float64(ctx.expected_list("reward.post_process", "rewards"))
    if any(s.reward is None for s in ctx.samples):
        raise StageInputError("no normalized rewards: reward.post_process did not run and samples lack 'reward'",
                              field="reward")
    return list_tensor([s.reward for s in ctx.samples], torch.float64)


def _rewards_recorded(ctx: StageContext) -> bool:
    recorded = ctx.reader.expected.get("reward.post_process", {}).get("rewards")
    return isinstance(recorded, list) or all(s.reward is not None for s in ctx.samples)


def run_advantage_estimate(ctx: StageContext) -> StageReport:
    expected = ctx.payload("advantages")
    advantages = get_grpo_returns(grpo_rewards(ctx), ctx.lengths, dtype=ctx.dtype)
    ctx.outputs["advantages"] = advantages
    field = ctx.field("advantage.estimate", "advantage", PER_TOKEN, expected, advantages)
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
    return []


ADVANTAGE_KL = StageDef(
    id=StageId.ADVANTAGE_KL, run=run_advantage_kl, needs=(StageId.SAMPLE,), refuse=_kl_refuse,
    requirements=_kl_requirements, description="rollout-vs-reference KL per token",
)
ADVANTAGE_ESTIMATE = StageDef(
    id=StageId.ADVANTAGE_ESTIMATE, run=run_advantage_estimate, needs=(StageId.REWARD_POST_PROCESS,),
    refuse=_estimate_refuse, requirements=_estimate_requirements,
    description="GRPO returns: reward broadcast over response tokens",
)
