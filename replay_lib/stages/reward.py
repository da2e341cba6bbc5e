"""``reward.raw`` and ``reward.post_process`` (group normalization by semantic group, with the knobs of SPEC §4.2:
the baseline, the std constants, the zero-std and singleton rules, KL in the score)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import NamedTuple, Optional

import msgspec
import torch

from ..judge.compare import Comparison, as_float64, list_tensor
from ..judge.fields import PER_SAMPLE, PER_TOKEN
from ..judge.error_model import (C_ADVANTAGE, C_REWARD, C_SEQUENTIAL, C_STORE, STORAGE_HAZARD, U32, batch_std_bound,
                           exact_zero_std, group_stats,
                           kl_storage_error, near_zero_std, reward_bound, singleton_bound, storage_error,
                           storage_unit)
from ..kernels import (GroupRule, batch_std, group_moments, group_rule, kl_of_log_ratio, post_process, segment_sum,
                       sequence_kl_score)
from ..kernels.reward import (OWN_RULE_ESTIMATORS, gdpo_rewards, loss_span, shape_rewards, gpg_alpha, gpg_rewards, maxrl_rewards, opo_rewards,
                              passk_rewards)
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
    own = cfg.advantage_estimator in OWN_RULE_ESTIMATORS
    grouping = rule.center or (own and cfg.advantage_estimator != "remax")  # remax: a baseline of its own
    n = cfg.n_samples_per_prompt if grouping else 0  # a score passed through needs no group
    pre = Comparison()
    gidx = ctx.group_indices
    grouped = None not in gidx
    sizes = Counter(gidx) if grouped else Counter(g for g in gidx if g is not None)
    if not grouped and grouping:
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
    raw = shaped_raw(ctx)
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
    if own:  # the estimator's own rule (SPEC §4.2): its value and bound replace the pass-through's
        rewards, bound = own_rule_rewards(ctx, score, magnitude, score_error, groups, stats)
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
    if rule.center or (grouping and own):
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


def own_rule_text(cfg: RecomputeConfig, rule: GroupRule) -> str:
    """The own rule of an estimator of :data:`OWN_RULE_ESTIMATORS`, in a few words."""
    est = cfg.advantage_estimator
    if est == "opo":
        return "r − the group's length-weighted mean reward"
    if est == "gpg":
        return "α·(r − group mean), α = samples / non-zero scores"
    if est == "grpo_passk":
        return "the group's best gets r_max − r_second" + (f" over std + {rule.eps:g}" if rule.std else "")
    if est == "maxrl":
        return f"(r − group mean)/(group mean + {rule.eps:g})"
    if est == "remax":
        return "r − the recorded greedy reward_baseline"
    return ("each reward component group-normalized, weighted and summed"
            + (", standardized over the samples" if cfg.reward_components_standardize is True else ""))


def _whole_step(ctx: StageContext, what: str) -> list:
    """Every sample of the bundle where the rule needs the whole step (a selection of it: the step's values)."""
    if ctx.config.kl_in_reward == "sequence" and ctx.config.kl_coef != 0 and ctx.partial:
        raise StageInputError(f"{what} with kl_in_reward=sequence needs every sample's score: replay the whole "
                              "bundle (no --sample/--group selection)", field="advantage_estimator")
    return ctx.reader.index.samples


def own_rule_rewards(ctx: StageContext, score: torch.Tensor, magnitude, score_error, groups: torch.Tensor,
                     stats) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards, bound)`` of the estimators whose reward.post_process is a rule of their own (SPEC §4.2:
    opo, gpg, grpo_passk, maxrl, remax, gdpo), in ``ctx.dtype``; the bound (float64) is what a float32
    producer's rounding may move each value by."""
    cfg = ctx.config
    est = cfg.advantage_estimator
    rule = group_rule(msgspec.structs.replace(cfg, advantage_estimator="grpo"))  # the knobs of the group rule (gdpo, eps)
    dtype = ctx.dtype
    x = score if dtype == torch.float64 else score.to(dtype)
    mag = (score.to(torch.float64).abs() if magnitude is None else magnitude.to(torch.float64))
    err = torch.zeros_like(mag) if score_error is None else score_error.to(torch.float64)
    # r − a group mean's rounding: C·u·(|r| + √n·max|r|), plus each score's own error and its group's worst
    centred_bound = reward_bound(score, stats, torch.zeros_like(mag), False, rule.eps, magnitude=magnitude,
                                 score_error=score_error)
    one = stats.size[stats.inverse] == 1
    if est == "opo":
        counts = segment_sum(ctx.loss_mask.to(torch.float64), ctx.seg, ctx.n)
        out = opo_rewards(x, groups, counts if dtype == torch.float64 else counts.to(dtype), dtype=dtype)
        # the length-weighted mean's sums: up to n roundings of max L·|r| over Σ L, i.e. n·u·max|r|
        bound = centred_bound + C_REWARD * U32 * stats.size[stats.inverse] * stats.max_abs[stats.inverse]
    elif est == "gpg":
        if ctx.partial:
            _whole_step(ctx, "gpg")
            whole = shaped_raw(_whole_context(ctx))
            alpha = gpg_alpha(whole)
        else:
            alpha = gpg_alpha(score)
        out = gpg_rewards(x, groups, dtype=dtype, alpha=alpha)
        bound = alpha * centred_bound + C_ADVANTAGE * U32 * out.to(torch.float64).abs()
    elif est == "grpo_passk":
        out = passk_rewards(x, groups, rule.std, rule.eps, dtype=dtype)
        truth = out.to(torch.float64)
        if rule.std:
            full = reward_bound(score, stats, truth, True, rule.eps, magnitude=magnitude, score_error=score_error)
        else:
            full = centred_bound
        # every other sample is 0 exactly (a tie at the top: 0 whichever holds it)
        bound = torch.where(truth != 0, full, torch.zeros_like(full))
    elif est == "maxrl":
        out = maxrl_rewards(x, groups, rule.eps, dtype=dtype)
        mean = group_moments(score.to(torch.float64), groups, torch.float64, with_std=False)
        centred = mean[2]
        den = (score.to(torch.float64) - centred + rule.eps).abs()  # |mean + eps|
        mean_err = C_REWARD * U32 * stats.size[stats.inverse].sqrt() * stats.max_abs[stats.inverse] + err
        truth = out.to(torch.float64)
        bound = (centred_bound + truth.abs() * mean_err) / den + C_ADVANTAGE * U32 * truth.abs()
        bound = torch.where(one, C_ADVANTAGE * U32 * mag + err, bound)
    elif est == "remax":
        base = as_float64([s.reward_baseline for s in ctx.samples])
        out = x - base.to(dtype)
        bound = C_ADVANTAGE * U32 * (mag + base.abs()) + err
    else:  # gdpo
        comps = torch.tensor([list(s.reward_components) for s in ctx.samples], dtype=torch.float64)
        weights = cfg.reward_component_weights
        w = None if not isinstance(weights, list) else torch.tensor(weights, dtype=torch.float64)
        standardize = cfg.reward_components_standardize is True
        s_eps = cfg.reward_components_standardize_eps
        s_eps = s_eps if isinstance(s_eps, float) else None
        comp_rule = replace(rule, clip=None)
        if standardize and ctx.partial:  # the whole step's standardization, read at the selection
            all_samples = _whole_step(ctx, "gdpo")
            everything = torch.tensor([list(s.reward_components) for s in all_samples], dtype=torch.float64)
            all_groups = list_tensor([s.group_index for s in all_samples], torch.int64)
            whole = gdpo_rewards(everything if dtype == torch.float64 else everything.to(dtype), all_groups,
                                 comp_rule, w, True, dtype=dtype, standardize_eps=s_eps)
            out = whole[torch.tensor(ctx.indices, dtype=torch.int64)]
        else:
            out = gdpo_rewards(comps if dtype == torch.float64 else comps.to(dtype), groups, comp_rule, w,
                               standardize, dtype=dtype, standardize_eps=s_eps)
        bound = _gdpo_bound(comps, groups, comp_rule, w, out.to(torch.float64), standardize, s_eps)
    if dtype != torch.float64:
        return out, bound
    return out, bound


def _gdpo_bound(comps: torch.Tensor, groups: torch.Tensor, rule: GroupRule, w: Optional[torch.Tensor],
                out: torch.Tensor, standardize: bool, standardize_eps: Optional[float] = None) -> torch.Tensor:
    """Σ_k |w_k|·(each component's group-rule bound), the sum's K roundings, and under ``standardize`` the
    standardization's: the sum's error over its std, plus ``C·u·√N·|value|``."""
    n, k = comps.shape
    bound = torch.zeros(n, dtype=torch.float64)
    parts = torch.zeros(n, dtype=torch.float64)
    for j in range(k):
        c = comps[:, j]
        stats = group_stats(c, groups)
        a = post_process(c, groups, rule, dtype=torch.float64)
        sample_std = group_moments(c, groups, torch.float64, unbiased=rule.unbiased, baseline=rule.baseline
                                   )[3] if rule.std else None
        b = reward_bound(c, stats, a, rule.std, rule.eps, leave_one_out=rule.baseline == "leave_one_out",
                         sample_std=sample_std, std_zero=rule.std_zero)
        wj = 1.0 if w is None else abs(float(w[j]))
        bound = bound + wj * torch.nan_to_num(b, nan=0.0)
        parts = parts + wj * a.abs()
    bound = bound + C_ADVANTAGE * U32 * k * parts
    if standardize and n > 1:
        total = torch.zeros(n, dtype=torch.float64)
        for j in range(k):
            wj = 1.0 if w is None else float(w[j])
            total = total + wj * post_process(comps[:, j], groups, rule, dtype=torch.float64)
        std = float(batch_std(total, unbiased=True)) + (standardize_eps or 0.0)
        worst = float(bound.max())
        spread = C_REWARD * U32 * math.sqrt(n) * float(total.abs().max())
        if std > 0:
            bound = (bound + worst + spread) / std + C_REWARD * U32 * math.sqrt(n) * out.abs() \
                + out.abs() * (worst + spread) / std
        else:
            bound = bound + worst + spread
    return bound


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
                      "grpo_std_scope", "overlong_buffer_len", "truncated_reward_coef")


def _rule_text(cfg: RecomputeConfig, rule: GroupRule) -> str:
    """The post-processing the stage recomputed, in a few words (the pass reason's tail): empty for V1's."""
    defaults = RecomputeConfig()
    if all(getattr(cfg, k) == getattr(defaults, k) for k in POST_PROCESS_KNOBS):
        return ""
    parts = [cfg.advantage_estimator]
    if cfg.kl_in_reward == "sequence" and cfg.kl_coef != 0:
        parts.append(f"score − {cfg.kl_coef:g}·Σkl")
    if cfg.advantage_estimator in OWN_RULE_ESTIMATORS:
        parts.append(own_rule_text(cfg, group_rule(msgspec.structs.replace(cfg, advantage_estimator="grpo"))))
    elif rule.center:
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
    if shaping_active(cfg):
        parts.append("length-shaped raw reward")
    return f" ({', '.join(parts)})"


def _whole_batch_std(ctx: StageContext, rule: GroupRule) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Under ``grpo_std_scope="batch"`` and a partial selection: the std of every sample's raw reward of the
    bundle, ``(float64, float32)`` (the selection is divided by the batch's std, not its own); else None."""
    if not (rule.center and rule.std and rule.std_scope == "batch" and ctx.partial):
        return None
    if ctx.config.kl_in_reward == "sequence" and ctx.config.kl_coef != 0:
        raise StageInputError("grpo_std_scope=batch with kl_in_reward=sequence needs every sample's score: "
                              "replay the whole bundle (no --sample/--group selection)", field="grpo_std_scope")
    full = shaped_raw(_whole_context(ctx))
    return batch_std(full, unbiased=rule.unbiased), batch_std(full.to(torch.float32), unbiased=rule.unbiased)


def shaping_active(cfg: RecomputeConfig) -> bool:
    """Whether the config shapes the raw reward by length before reward.post_process (SPEC §4.2)."""
    return isinstance(cfg.overlong_buffer_len, float) or isinstance(cfg.truncated_reward_coef, float)


def shaped_raw(ctx: StageContext) -> torch.Tensor:
    """float64 per selected sample: the recorded raw reward after the length penalties the config names
    (:func:`replay_lib.kernels.reward.shape_rewards`), or the raw reward itself."""
    cfg = ctx.config
    raw = ctx.raw_rewards
    if not shaping_active(cfg):
        return raw
    buffer = cfg.overlong_buffer_len if isinstance(cfg.overlong_buffer_len, float) else None
    coef = cfg.truncated_reward_coef if isinstance(cfg.truncated_reward_coef, float) else None
    factor = cfg.overlong_penalty_factor if isinstance(cfg.overlong_penalty_factor, float) else 1.0
    span = loss_span(ctx.loss_mask, ctx.lengths) if buffer is not None else torch.zeros(ctx.n, dtype=torch.float64)
    truncated = torch.tensor([s.truncated is True for s in ctx.samples]) if coef is not None else None
    return shape_rewards(raw, span, truncated, buffer=buffer, factor=factor,
                         max_tokens=cfg.overlong_max_tokens if buffer is not None else None, coef=coef)


def _whole_context(ctx: StageContext) -> StageContext:
    """The context of every sample of the bundle (a rule over the whole step, read at a selection)."""
    if not ctx.partial:
        return ctx
    return StageContext(reader=ctx.reader, indices=list(range(len(ctx.reader.index.samples))), partial=False,
                        rules=ctx.rules)


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
                        "2·|dKL/dr|·u·(2^⌊log2|old|⌋ + 2^⌊log2|ref|⌋) (the KL recomputed from them, --chain)")
    if not ctx.has("kl"):
        raise StageInputError("payload 'kl' is required when kl_in_reward is set and kl_coef != 0", field="kl")
    kl = ctx.payload("kl")[span]
    u = storage_unit(compute, kl)
    return RewardKL(kl, C_STORE * storage_error(u, kl) if u else None, {"kl": kl}, "2·u·2^⌊log2|kl|⌋")


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
        missing.append(f"{reader.payload_label('kl')} (kl_in_reward=sequence)")
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
