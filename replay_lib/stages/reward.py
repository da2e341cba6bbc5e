"""``reward.raw`` and ``reward.post_process`` (GRPO group normalization by semantic group)."""

from __future__ import annotations

from collections import Counter

import torch

from ..compare import Comparison, as_float64, list_tensor
from ..fields import PER_SAMPLE
from ..kernels import group_normalize
from ..report import Divergence, StageReport
from ..bundle import BundleReader
from ..schema import RecomputeConfig, StageId
from .base import StageContext, StageDef


def _expected_list_present(reader: BundleReader, stage: str, key: str) -> list[str]:
    value = reader.expected.get(stage, {}).get(key)
    return [] if isinstance(value, list) else [f"expected.json $.{stage}.{key}"]


def run_reward_raw(ctx: StageContext) -> StageReport:
    expected = ctx.expected_list("reward.raw", "raw_rewards")
    actual = as_float64([s.raw_reward for s in ctx.samples])
    field = ctx.field("reward.raw", "raw_reward", PER_SAMPLE, expected, actual)
    return ctx.report(StageId.REWARD_RAW, [field], pass_reason=f"{ctx.n} sample(s) compared",
                      fail_reason=lambda total, per: f"raw reward mismatch in {total.bad_samples} sample(s)")


def run_reward_post_process(ctx: StageContext) -> StageReport:
    n = ctx.config.n_samples_per_prompt
    pre = Comparison()
    gidx = ctx.group_indices
    grouped = None not in gidx
    sizes = Counter(gidx) if grouped else Counter(g for g in gidx if g is not None)
    if not grouped:
        for s in ctx.samples:
            if s.group_index is None:
                pre.mismatches += 1
                pre.bad_samples += 1
                pre.divergences.append(Divergence(
                    stage="reward.post_process", rank=ctx.rank, sample_id=s.sample_id, field="group_index",
                    message="sample has no group_index; its semantic group is unknown (never inferred from a batch)",
                ))
    first_of_group: dict[int, int] = {}
    if any(size != n for size in sizes.values()):
        for i, g in enumerate(gidx):
            if g is not None:
                first_of_group.setdefault(g, i)
    for gi, size in sizes.items():
        if size != n:
            s = ctx.samples[first_of_group[gi]]
            pre.mismatches += 1
            pre.divergences.append(Divergence(
                stage="reward.post_process", rank=ctx.rank, sample_id=s.sample_id, group_index=gi, field="group_size",
                expected=float(n), actual=float(size), abs_error=float(abs(size - n)),
                message=f"group g-{gi} has {size} sample(s), n_samples_per_prompt={n}",
            ))
    raw = as_float64([s.raw_reward for s in ctx.samples]).to(torch.float32)
    groups = list_tensor(gidx if grouped else [-1 - i if g is None else g for i, g in enumerate(gidx)],
                         torch.int64)
    rewards = group_normalize(raw, groups, ctx.config.grpo_std_normalization)
    if pre.mismatches:  # a sample without a group has no defined normalized reward
        no_group = torch.tensor([s.group_index is None for s in ctx.samples])
        rewards = torch.where(no_group, torch.full_like(rewards, float("nan")), rewards)
    ctx.outputs["rewards"] = rewards
    expected = ctx.expected_list("reward.post_process", "rewards")
    field = ctx.field("reward.post_process", "reward", PER_SAMPLE, expected, rewards)

    def fail_reason(total: Comparison, per: dict[str, Comparison]) -> str:
        if pre.mismatches:
            return pre.divergences[0].message
        return f"normalized reward mismatch in {per['reward'].bad_samples} sample(s)"

    pre.divergences = pre.divergences[: ctx.keep]
    return ctx.report(StageId.REWARD_POST_PROCESS, [field], structural=pre, fail_reason=fail_reason,
                      pass_reason=f"{ctx.n} sample(s) in {len(sizes)} group(s) compared")


def _refuse_post_process(cfg: RecomputeConfig) -> list[tuple[str, str]]:
    if not cfg.rewards_normalization:
        return [("rewards_normalization", "False: V1 recomputes GRPO group normalization only")]
    return []


REWARD_RAW = StageDef(
    id=StageId.REWARD_RAW, run=run_reward_raw, needs=(StageId.SAMPLE,),
    requirements=lambda r: _expected_list_present(r, "reward.raw", "raw_rewards"),
    description="recorded raw rewards",
)
REWARD_POST_PROCESS = StageDef(
    id=StageId.REWARD_POST_PROCESS, run=run_reward_post_process, needs=(StageId.REWARD_RAW,),
    refuse=_refuse_post_process,
    requirements=lambda r: _expected_list_present(r, "reward.post_process", "rewards"),
    description="GRPO normalization by semantic group",
)
