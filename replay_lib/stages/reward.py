"""``reward.raw`` and ``reward.post_process`` (group normalization by semantic group, with the knobs of SPEC §4.2:
the baseline, the std constants, the zero-std and singleton rules, KL in the score)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from ..judge.compare import Comparison, as_float64, list_tensor
from ..judge.fields import PER_SAMPLE, PER_TOKEN
from ..judge.error_model import (C_ADVANTAGE, C_REWARD, C_SEQUENTIAL, C_STORE, STORAGE_HAZARD, U32, batch_std_bound,
                           exact_zero_std, group_stats,
                           kl_storage_error, near_zero_std, reward_bound, singleton_bound, storage_error,
                           storage_unit)
from ..kernels import (GroupRule, batch_std, group_moments, group_rule, kl_of_log_ratio, post_process, segment_sum,
                       sequence_kl_score)
from ..judge.report import Divergence, StageReport
from ..bundle import BundleReader
from ..bundle.schema import RecomputeConfig, StageId
from ..bundle.selection import group_label
from .base import StageContext, StageDef, StageInputError


def _expected_list_present(reader: BundleReader, stage: str, key: str) -> list[str]:
    value = reader.expected.get(stage, {}).get(key)
    return [] if isinstance(value, list) else [f"expected.json $.{stage}.{key}"]


def run_reward_raw(ctx: StageContext) -> StageReport:
    expected = ctx.expected_list("reward.raw", "raw_rewards")
    actual = ctx.raw_rewards
    field = ctx.field("reward.raw", "raw_reward", PER_SAMPLE, expected, actual)
    return ctx.report(StageId.REWARD_RAW, [field], pass_reason=f"{ctx.n} sample(s) compared",
                      fail_reason=lambda total, per: f"raw reward mismatch in {total.bad_samples} sample(s)")


def run_reward_post_process(ctx: StageContext) -> StageReport:
    cfg = ctx.config
    rule = group_rule(cfg)
    n = cfg.n_samples_per_prompt if rule.center else 0  # a score passed through needs no group
    pre = Comparison()
    gidx = ctx.group_indices
    grouped = None not in gidx
    sizes = Counter(gidx) if grouped else Counter(g for g in gidx if g is not None)
    if not grouped and rule.center:
        for s in ctx.samples:
            if s.group_index is None:
                pre.mismatches += 1
                pre.bad_samples += 1
                pre.divergences.append(Divergence(
                    stage="reward.post_process", rank=ctx.rank, sample_id=s.sample_id, field="group_index",
                    message="sample has no group_index; its semantic group is unknown (never inferred from a batch)",
                ))
    first_of_group: dict[int, int] = {}
    uneven = n > 0 and any(size != n for size in sizes.values())  # n = 0: groups of any size (SPEC §4.2)
    if uneven:
        for i, g in enumerate(gidx):
            if g is not None:
                first_of_group.setdefault(g, i)
    for gi, size in sizes.items():
        if uneven and size != n:
            s = ctx.samples[first_of_group[gi]]
            pre.mismatches += 1
            pre.divergences.append(Divergence(
                stage="reward.post_process", rank=ctx.rank, sample_id=s.sample_id, group_index=gi, field="group_size",
                expected=float(n), actual=float(size), abs_error=float(abs(size - n)),
                message=f"group {group_label(gi)} has {size} sample(s), n_samples_per_prompt={n}",
            ))
    # the float64 raw rewards of the JSON, never rounded to float32 first (a float32 producer's rounding of
    # them is what the bound admits); under --exact the producer's float32 kernel
    raw = ctx.raw_rewards
    groups = score_groups(ctx)
    score, magnitude, score_error = _scores(ctx, raw)
    # the bound is taken of the value before the clip: a clamp is 1-Lipschitz, so a producer's value within the
    # bound of a clamp edge, clamped or not, stays within it of the recomputed one
    whole = _whole_batch_std(ctx, rule)
    rewards = post_process(score if ctx.dtype == torch.float64 else score.to(ctx.dtype), groups,
                           replace(rule, clip=None), dtype=ctx.dtype,
                           scope_std=None if whole is None else whole[ctx.dtype != torch.float64])
    stats = group_stats(score, groups)
    truth = rewards.to(torch.float64)
    one = stats.size[stats.inverse] == 1
    if rule.center:
        sample_std = group_moments(score, groups, torch.float64, unbiased=rule.unbiased, baseline=rule.baseline,
                                   std_scope=rule.std_scope, scope_std=None if whole is None else whole[0]
                                   )[3] if rule.std else None
        loo = rule.baseline == "leave_one_out"
        bound = reward_bound(score, stats, truth, rule.std, rule.eps, leave_one_out=loo, sample_std=sample_std,
                             magnitude=magnitude, score_error=score_error, std_zero=rule.std_zero)
        if rule.std and rule.std_scope == "batch":
            # the batch std's rounding as the group std's (reward_bound), over the whole batch's N samples
            bound = bound + batch_std_bound(truth, len(ctx.reader.index.samples))
        if loo and rule.std and magnitude is None:
            # a std over equal others whose every float32 sum is exact: any producer computes exactly 0, and the
            # value is the centred one (skip) or the centred one over eps: the bound without the std's
            exact = exact_zero_std(score, stats, sample_std)
            if bool(exact.any()):
                flat = reward_bound(score, stats, truth, rule.std_zero != "skip", rule.eps, leave_one_out=True,
                                    sample_std=torch.zeros_like(sample_std), cancellation=False)
                bound = torch.where(exact, flat, bound)
        rule_bound = singleton_bound(truth, rule.singleton)
        if rule_bound is not None:
            bound = torch.where(one, rule_bound, bound)
    else:  # the score itself: its one rounding to float32 (and its KL sum's)
        sample_std = None
        bound = C_ADVANTAGE * U32 * (raw.abs() if magnitude is None else magnitude)
        if score_error is not None:
            bound = bound + score_error
    if rule.clip is not None:  # OpenRLHF's reward.clip_range (compute_reward)
        rewards = torch.clamp(rewards, min=rule.clip[0], max=rule.clip[1])
    if pre.mismatches:  # a sample without a group has no defined normalized reward
        no_group = torch.tensor([s.group_index is None for s in ctx.samples])
        rewards = torch.where(no_group, torch.full_like(rewards, float("nan")), rewards)
    ctx.outputs["rewards"] = rewards
    ctx.outputs["reward_bound"] = bound
    expected = ctx.expected_list("reward.post_process", "rewards")
    compared = None
    if rule.center and rule.singleton == "nan" and bool(one.any()):
        # the bundle's rule writes NaN for a one-sample group: a recorded NaN there is the rule, not a divergence
        recorded_nan = torch.tensor([e is None or e != e for e in expected], dtype=torch.bool)
        compared = ~(one & recorded_nan)
    field = ctx.field("reward.post_process", "reward", PER_SAMPLE, expected, rewards, bound=bound, compared=compared)
    fields = [field] + _token_reward_fields(ctx, rewards, bound)
    if rule.center:
        _group_hazards(ctx, stats, rewards, bound, rule, grouped, sample_std, score)

    def fail_reason(total: Comparison, per: dict[str, Comparison]) -> str:
        if pre.mismatches:
            return pre.divergences[0].message
        if not per["reward"].mismatches and "token_reward" in per:
            tokens = per["token_reward"]
            return f"per-token reward mismatch in {tokens.mismatches} token(s) of {tokens.bad_samples} sample(s)"
        return f"normalized reward mismatch in {per['reward'].bad_samples} sample(s)"

    pre.divergences = pre.divergences[: ctx.keep]
    return ctx.report(StageId.REWARD_POST_PROCESS, fields, structural=pre, fail_reason=fail_reason,
                      pass_reason=f"{ctx.n} sample(s) in {len(sizes)} group(s) compared{_rule_text(cfg, rule)}")


def _token_reward_fields(ctx: StageContext, rewards: torch.Tensor, bound: torch.Tensor) -> list:
    """``token_reward`` (format 1.2): each per-token ``reward`` a sample records against its recomputed normalized
    reward on every token of the sample (what a broadcast estimator consumes token by token), within the same
    bound; the tokens of samples whose reward is one number are not compared here. Empty without such a sample."""
    listed = [type(s.reward) is list for s in ctx.samples]
    if not any(listed):
        return []
    recorded = torch.cat([torch.tensor(s.reward, dtype=torch.float64) if type(s.reward) is list
                          else torch.zeros(s.response_length, dtype=torch.float64) for s in ctx.samples])
    seg = ctx.seg
    compared = torch.tensor(listed, dtype=torch.bool)[seg]
    return [ctx.field("reward.post_process", "token_reward", PER_TOKEN, recorded, rewards.to(torch.float64)[seg],
                      bound=bound.to(torch.float64)[seg], compared=compared)]


# The knobs of SPEC §4.2 that change what reward.post_process computes (V1's pass reason when all are default).
POST_PROCESS_KNOBS = ("advantage_estimator", "rewards_normalization", "grpo_std_eps", "grpo_std_unbiased",
                      "group_baseline", "std_zero", "singleton_group", "kl_in_reward", "reward_clip_low",
                      "grpo_std_scope")


def _rule_text(cfg: RecomputeConfig, rule: GroupRule) -> str:
    """The post-processing the stage recomputed, in a few words (the pass reason's tail): empty for V1's."""
    defaults = RecomputeConfig()
    if all(getattr(cfg, k) == getattr(defaults, k) for k in POST_PROCESS_KNOBS):
        return ""
    parts = [cfg.advantage_estimator]
    if cfg.kl_in_reward == "sequence" and cfg.kl_coef != 0:
        parts.append(f"score − {cfg.kl_coef:g}·Σkl")
    if rule.center:
        parts.append(f"{rule.baseline} baseline")
        if rule.std:
            parts.append(f"{'unbiased' if rule.unbiased else 'biased'}{' batch' if rule.std_scope == 'batch' else ''}"
                         f" std + {rule.eps:g}"
                         + (", skipped where 0" if rule.std_zero == "skip" else ""))
        if rule.singleton is not None:
            parts.append(f"singleton → {rule.singleton}")
    else:
        parts.append("score passed through")
    if rule.clip is not None:
        parts.append(f"clipped to [{rule.clip[0]:g}, {rule.clip[1]:g}]")
    return f" ({', '.join(parts)})"


def _whole_batch_std(ctx: StageContext, rule: GroupRule) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Under ``grpo_std_scope="batch"`` and a partial selection: the std of every sample's raw reward of the
    bundle, ``(float64, float32)`` (the selection is divided by the batch's std, not its own); else None."""
    if not (rule.center and rule.std and rule.std_scope == "batch" and ctx.partial):
        return None
    if ctx.config.kl_in_reward == "sequence" and ctx.config.kl_coef != 0:
        raise StageInputError("grpo_std_scope=batch with kl_in_reward=sequence needs every sample's score: "
                              "replay the whole bundle (no --sample/--group selection)", field="grpo_std_scope")
    full = as_float64([s.raw_reward for s in ctx.reader.index.samples])
    return batch_std(full, unbiased=rule.unbiased), batch_std(full.to(torch.float32), unbiased=rule.unbiased)


def score_groups(ctx: StageContext) -> torch.Tensor:
    """int64 per selected sample: its ``group_index``, or for a sample without one a group of its own (what
    a rule that passes the score through needs; a rule that centers refuses such a sample first)."""
    gidx = ctx.group_indices
    return list_tensor(gidx if None not in gidx else [-1 - i if g is None else g for i, g in enumerate(gidx)],
                       torch.int64)


def _scores(ctx: StageContext, raw: torch.Tensor):
    """``(score, magnitude, score_error)``: what the group normalizes. The raw reward (``None, None``), or under
    ``kl_in_reward="sequence"`` (verl ``use_kl_in_reward``) the raw reward minus ``kl_coef·Σ_t kl_t·mask_t`` —
    the recorded ``kl`` payload (teacher forcing; under ``--chain`` the KL recomputed from the log-probs), with
    each score's condition ``|r| + |kl_coef|·Σ|kl|·mask`` and the error of a float32 sum of its KL in token
    order (three times ``|seq32 − T|``, as the loss bound)."""
    cfg = ctx.config
    if cfg.kl_in_reward != "sequence" or cfg.kl_coef == 0:
        return raw, None, None
    kl, kl_error, stored, rounding = _reward_kl(ctx)
    mask = ctx.loss_mask
    if ctx.dtype != torch.float64:  # --exact: the producer's float32 sum
        return sequence_kl_score(raw.to(ctx.dtype), kl, mask, ctx.lengths, cfg.kl_coef, dtype=ctx.dtype), None, None
    score = sequence_kl_score(raw, kl, mask, ctx.lengths, cfg.kl_coef, dtype=torch.float64)
    m = mask.to(torch.float64)
    abs_kl = segment_sum(kl.to(torch.float64).abs() * m, ctx.seg, ctx.n)
    magnitude = raw.abs() + abs(cfg.kl_coef) * abs_kl
    seq32 = sequence_kl_score(raw.to(torch.float32), kl.to(torch.float32), mask, ctx.lengths, cfg.kl_coef)
    score_error = C_SEQUENTIAL * (seq32.to(torch.float64) - score).abs() + C_REWARD * U32 * abs(cfg.kl_coef) * abs_kl
    if kl_error is not None:  # the KL one storage rounding (or its log-probs') off the producer's, summed
        allowed = segment_sum(kl_error * m, ctx.seg, ctx.n)
        score_error = score_error + abs(cfg.kl_coef) * allowed
        ctx.coarse_payload_hazard("reward.post_process", stored, (
            f"each score r − kl_coef·Σ kl admits their rounding, |kl_coef|·Σ {rounding}"
            + kl_reach(ctx, abs_kl, allowed)))
    return score, magnitude, score_error


class RewardKL(NamedTuple):
    """The per-token KL the score is penalized by, ``error`` (float64 per token, or None) how far it can be from
    the producer's where it, or the log-probs it is recomputed from, is stored coarser than the compute, and
    ``stored``: the payloads it came from and ``rounding`` the error's formula (what a ``coarse_payload`` hazard
    names)."""
    kl: torch.Tensor
    error: Optional[torch.Tensor]
    stored: dict
    rounding: str


def _reward_kl(ctx: StageContext, span: slice = slice(None)) -> RewardKL:
    """The recorded ``kl`` payload, or under ``--chain`` advantage.kl's formula on the recorded log-probs
    (float64), each with its storage error (:class:`RewardKL`); ``span``: of those tokens only (one token's
    inputs, ``replay_lib.explain.inputs``)."""
    cfg = ctx.config
    compute = ctx.precision.compute
    if ctx.chain and ctx.has("old_log_probs") and ctx.has("ref_log_probs"):
        old, ref = ctx.payload("old_log_probs")[span], ctx.payload("ref_log_probs")[span]
        kl_type = reward_kl_type(cfg)
        log_ratio = old.to(torch.float64) - ref.to(torch.float64)
        kl, exp_neg = kl_of_log_ratio(log_ratio, kl_type, cfg.kl_penalty_clamp)  # sharing r with the bound
        u = storage_unit(compute, old, ref)
        error = kl_storage_error(log_ratio, kl_type, storage_error(u, old, ref), exp_neg) if u else None
        return RewardKL(kl, error, {"old_log_probs": old, "ref_log_probs": ref},
                        "2·|dKL/dr|·u·(|old| + |ref|) (the KL recomputed from them, --chain)")
    if not ctx.has("kl"):
        raise StageInputError("payload 'kl' is required when kl_in_reward is set and kl_coef != 0", field="kl")
    kl = ctx.payload("kl")[span]
    u = storage_unit(compute, kl)
    return RewardKL(kl, (C_STORE * u) * kl.to(torch.float64).abs() if u else None, {"kl": kl}, "2·u·|kl|")


def kl_reach(ctx: StageContext, total: torch.Tensor, allowed: torch.Tensor) -> str:
    """The hazard's tail where the KL's storage error reaches a tenth of the KL it bounds (per selected sample,
    ``allowed`` = Σ error and ``total`` = Σ |kl| over its loss tokens; the largest sample's ratio): a KL
    penalty this small is not resolved; under ``--chain`` the replay without it compares against the recorded
    ``kl`` (``""`` below a tenth)."""
    ratio = torch.where(total > 0, allowed / total.clamp(min=torch.finfo(torch.float64).tiny),
                        torch.where(allowed > 0, float("inf"), 0.0))
    if not ratio.numel() or float(ratio.max()) < STORAGE_HAZARD:
        return ""
    hint = "; the replay without --chain compares against the recorded kl" if ctx.chain and ctx.has("kl") else ""
    finite = ratio[torch.isfinite(ratio)]
    parts = []
    if finite.numel() and float(finite.max()) >= STORAGE_HAZARD:
        parts.append(f"it reaches {float(finite.max()):.2g}× the KL it bounds (a sample's Σ)")
    if bool(torch.isinf(ratio).any()):  # old = ref: a KL of 0, which the rounding of each still moves
        parts.append(f"it admits {float(allowed[torch.isinf(ratio)].max()):.2g} where the KL is 0 (a sample's Σ)")
    return f"; {', '.join(parts)}: a KL penalty this small is not resolved{hint}"


def reward_kl_type(cfg: RecomputeConfig) -> str:
    """The estimator of the rollout KL (advantage.kl, and the KL in the reward): ``kl_penalty_type`` when set
    (verl's ``algorithm.kl_penalty``), else ``kl_loss_type``."""
    return cfg.kl_penalty_type if cfg.kl_penalty_type is not None else cfg.kl_loss_type


def _group_hazards(ctx: StageContext, stats, rewards: torch.Tensor, bound: torch.Tensor, rule: GroupRule,
                   grouped: bool, sample_std, score: torch.Tensor) -> None:
    """Groups a legitimate producer cannot normalize meaningfully (SPEC §5.1 hazards): a single sample, a
    std at the rounding level of the mean under std normalization (under ``leave_one_out``, a sample's std
    over the others at the rounding level of NeMo-RL's ``E[r²] − b²``), every normalized reward 0. Reported
    whatever rule the bundle chose for them (a singleton rule, ``std_zero="skip"``): the rule decides the
    value, the hazard says it carries no gradient signal or only rounding."""
    if not grouped:
        return
    std = rule.std
    stage = StageId.REWARD_POST_PROCESS.value
    first = torch.full((stats.size.numel(),), len(ctx.samples), dtype=torch.int64).scatter_reduce(
        0, stats.inverse, torch.arange(len(ctx.samples)), reduce="amin", include_self=True).tolist()
    zero = torch.zeros(stats.size.numel(), dtype=torch.int64).index_add_(
        0, stats.inverse, (rewards != 0).to(torch.int64)) == 0
    if std and rule.std_scope == "batch":  # one std for the whole batch: tiny there, tiny for every group
        r = score.to(torch.float64)
        level = C_REWARD * U32 * r.numel() ** 0.5 * float(r.abs().max()) if r.numel() else 0.0
        tiny = torch.full_like(zero, bool(sample_std is not None and r.numel() > 1 and float(sample_std[0]) <= level))
    else:
        tiny = near_zero_std(stats) if std else torch.zeros_like(zero)
    loo_first = torch.full((stats.size.numel(),), -1, dtype=torch.int64)  # a sample whose others' std is tiny
    if std and rule.baseline == "leave_one_out" and sample_std is not None:
        level = C_REWARD * U32 * 2 * stats.max_abs[stats.inverse] ** 2
        loo_tiny = (sample_std * sample_std <= level) & (stats.size[stats.inverse] > 2) & (bound > 0) \
            & ~exact_zero_std(score, stats, sample_std)
        loo_first.scatter_reduce_(0, stats.inverse, torch.where(loo_tiny, torch.arange(len(ctx.samples)), -1),
                                  reduce="amax", include_self=True)
    worst = torch.zeros(stats.size.numel(), dtype=torch.float64).scatter_reduce(
        0, stats.inverse, bound, reduce="amax", include_self=True)
    skip = " (std_zero=skip: a producer that rounds it to 0 leaves the centred value)" if rule.std_zero == "skip" else ""
    flagged = torch.nonzero((stats.size == 1) | tiny | zero | (loo_first >= 0)).reshape(-1).tolist()
    if not flagged:
        return
    # the groups' columns as lists: a step with hundreds of flagged groups (all-equal rewards are common in GRPO)
    # reads them as Python values, not as a tensor element (two torch calls) each
    size, std_of, max_abs = stats.size.tolist(), stats.std.tolist(), stats.max_abs.tolist()
    tiny, zero, loo_first, worst = tiny.tolist(), zero.tolist(), loo_first.tolist(), worst.tolist()
    for k in flagged:
        g = ctx.group_indices[first[k]]
        n = int(size[k])
        if n == 1:
            if rule.singleton is not None:
                value = {"nan": "NaN", "zero": "0", "raw": "its raw reward (mean 0, std 1)"}[rule.singleton]
                what = f"singleton_group={rule.singleton} gives it {value}"
            elif std and (rule.unbiased or rule.baseline == "leave_one_out"):
                what = "its unbiased std is undefined (NaN)"
            else:
                what = "its normalized reward is 0" if rule.baseline == "mean" else "its leave-one-out baseline is undefined (NaN)"
            ctx.hazard(stage, "singleton_group", group_index=g, message=f"group {group_label(g)} has a single sample: {what}")
            continue
        if tiny[k] and worst[k] > 0:  # (equal rewards whose every sum is exact normalize to 0)
            ctx.hazard(stage, "near_zero_std", group_index=g, message=(
                f"group {group_label(g)}: std {std_of[k]:.3g} of its {n} rewards is at the rounding level of their "
                f"mean (max |r| {max_abs[k]:g}): a float32 producer's normalized values there are "
                f"rounding noise, admitted up to ±{worst[k]:.3g}{skip}"))
        elif loo_first[k] >= 0:
            i = loo_first[k]
            ctx.hazard(stage, "near_zero_std", group_index=g, sample=i, message=(
                f"group {group_label(g)}: {ctx.sample_ids[i]}'s leave-one-out std over the other {n - 1} rewards is "
                f"{float(sample_std[i]):.3g}, at the rounding level of E[r²] − b² (max |r| "
                f"{max_abs[k]:g}): a float32 producer may divide by rounding noise there, admitted up "
                f"to ±{float(bound[i]):.3g}{skip}"))
        if zero[k]:
            ctx.hazard(stage, "zero_advantage_group", group_index=g, message=(
                f"group {group_label(g)}: every normalized reward is 0 (its {n} raw rewards are equal): the group adds no "
                f"policy gradient"))


def _post_process_requirements(reader: BundleReader) -> list[str]:
    missing = _expected_list_present(reader, "reward.post_process", "rewards")
    cfg = reader.index.config
    if cfg.kl_in_reward == "sequence" and cfg.kl_coef != 0 and not reader.has_payload("kl"):
        missing.append("payloads/kl.pt (kl_in_reward=sequence)")
    return missing


REWARD_RAW = StageDef(
    id=StageId.REWARD_RAW, run=run_reward_raw, needs=(StageId.SAMPLE,),
    any_cp=True,  # whole trajectories (SPEC §4.2): rank.cp is provenance
    requirements=lambda r: _expected_list_present(r, "reward.raw", "raw_rewards"),
    description="recorded raw rewards",
)
REWARD_POST_PROCESS = StageDef(
    id=StageId.REWARD_POST_PROCESS, run=run_reward_post_process, needs=(StageId.REWARD_RAW,),
    any_cp=True,  # whole trajectories (SPEC §4.2): rank.cp is provenance
    requirements=_post_process_requirements,
    description="group normalization by semantic group (SPEC §4.2 knobs)",
)
