"""``reward.raw`` and ``reward.post_process`` (GRPO group normalization by semantic group)."""

from __future__ import annotations

from collections import Counter

import torch

from ..compare import Comparison, as_float64, list_tensor
from ..fields import PER_SAMPLE
from ..error_model import group_stats, near_zero_std, reward_bound
from ..kernels import STD_EPS, group_normalize
from ..report import Divergence, StageReport
from ..bundle import BundleReader
from ..schema import RecomputeConfig, StageId
from .base import StageContext, StageDef, not_recomputed_yet


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
    # the float64 raw rewards of the JSON, never rounded to float32 first (a float32 producer's rounding of
    # them is what the bound admits); under --exact the producer's float32 kernel
    raw = as_float64([s.raw_reward for s in ctx.samples])
    groups = list_tensor(gidx if grouped else [-1 - i if g is None else g for i, g in enumerate(gidx)],
                         torch.int64)
    std = ctx.config.grpo_std_normalization
    rewards = group_normalize(raw if ctx.dtype == torch.float64 else raw.to(ctx.dtype), groups, std, STD_EPS,
                              dtype=ctx.dtype)
    stats = group_stats(raw, groups)
    bound = reward_bound(raw, stats, rewards.to(torch.float64), std, STD_EPS)
    if pre.mismatches:  # a sample without a group has no defined normalized reward
        no_group = torch.tensor([s.group_index is None for s in ctx.samples])
        rewards = torch.where(no_group, torch.full_like(rewards, float("nan")), rewards)
    ctx.outputs["rewards"] = rewards
    ctx.outputs["reward_bound"] = bound
    expected = ctx.expected_list("reward.post_process", "rewards")
    field = ctx.field("reward.post_process", "reward", PER_SAMPLE, expected, rewards, bound=bound)
    _group_hazards(ctx, stats, rewards, bound, std, grouped)

    def fail_reason(total: Comparison, per: dict[str, Comparison]) -> str:
        if pre.mismatches:
            return pre.divergences[0].message
        return f"normalized reward mismatch in {per['reward'].bad_samples} sample(s)"

    pre.divergences = pre.divergences[: ctx.keep]
    return ctx.report(StageId.REWARD_POST_PROCESS, [field], structural=pre, fail_reason=fail_reason,
                      pass_reason=f"{ctx.n} sample(s) in {len(sizes)} group(s) compared")


def _group_hazards(ctx: StageContext, stats, rewards: torch.Tensor, bound: torch.Tensor, std: bool,
                   grouped: bool) -> None:
    """Groups a legitimate producer cannot normalize meaningfully (SPEC §5.1 hazards): a single sample, a
    std at the rounding level of the mean under std normalization, every normalized reward 0."""
    if not grouped:
        return
    stage = StageId.REWARD_POST_PROCESS.value
    first = torch.full((stats.size.numel(),), len(ctx.samples), dtype=torch.int64).scatter_reduce(
        0, stats.inverse, torch.arange(len(ctx.samples)), reduce="amin", include_self=True).tolist()
    zero = torch.zeros(stats.size.numel(), dtype=torch.int64).index_add_(
        0, stats.inverse, (rewards != 0).to(torch.int64)) == 0
    tiny = near_zero_std(stats) if std else torch.zeros_like(zero)
    worst = torch.zeros(stats.size.numel(), dtype=torch.float64).scatter_reduce(
        0, stats.inverse, bound, reduce="amax", include_self=True)
    for k in torch.nonzero((stats.size == 1) | tiny | zero).reshape(-1).tolist():
        g = ctx.group_indices[first[k]]
        n = int(stats.size[k])
        if n == 1:
            what = "its unbiased std is undefined (NaN)" if std else "its normalized reward is 0"
            ctx.hazard(stage, "singleton_group", group_index=g, message=f"group g-{g} has a single sample: {what}")
            continue
        if bool(tiny[k]) and float(worst[k]) > 0:  # (equal rewards whose every sum is exact normalize to 0)
            ctx.hazard(stage, "near_zero_std", group_index=g, message=(
                f"group g-{g}: std {float(stats.std[k]):.3g} of its {n} rewards is at the rounding level of their "
                f"mean (max |r| {float(stats.max_abs[k]):g}): a float32 producer's normalized values there are "
                f"rounding noise, admitted up to ±{float(worst[k]):.3g}"))
        if bool(zero[k]):
            ctx.hazard(stage, "zero_advantage_group", group_index=g, message=(
                f"group g-{g}: every normalized reward is 0 (its {n} raw rewards are equal): the group adds no "
                f"policy gradient"))


def _refuse_post_process(cfg: RecomputeConfig) -> list[tuple[str, str]]:
    if not cfg.rewards_normalization:
        return [("rewards_normalization", "False: V1 recomputes GRPO group normalization only")]
    return not_recomputed_yet(cfg, ("grpo_std_eps", "grpo_std_unbiased", "group_baseline", "std_zero",
                                    "singleton_group", "kl_in_reward", "kl_penalty_type"))


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
