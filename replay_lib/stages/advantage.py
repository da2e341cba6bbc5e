"""``advantage.kl`` (rollout vs reference) and ``advantage.estimate`` (SPEC §4.2: GRPO returns and the other
estimators — dr_grpo, rloo, REINFORCE++ (-baseline), GAE —, KL in the per-token rewards, whitening)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Optional

import torch

from ..bundle import BundleReader
from ..judge.compare import as_float64, list_tensor
from ..judge.error_model import (C_REWARD, C_STORE, U32, advantage_bound, kl_bound, recursion_bound, storage_error, storage_unit,
                           unit_roundoff, whiten_bound)
from ..judge.fields import KEEP_COLUMNS, PER_TOKEN
from ..kernels import (ADVANTAGE_ESTIMATORS, GROUP_BASELINES, KL_CLAMP, KL_TYPES, SINGLETON_RULES, STD_SCOPES, STD_ZERO_RULES,
                       grpo_std_scope,
                       GrpoReturns, discounted_returns, gae_advantages, get_grpo_returns, kl_of_log_ratio, rollout_kl,
                       segment_sum,
                       WHITEN_EPS, token_rewards, whiten, whiten_stats)
from ..kernels.advantage import GAE_MASKED_TOKENS, WHITEN_EPS_MODES, WHITEN_VARIANCES
from ..judge.report import StageReport
from ..bundle.schema import RecomputeConfig, StageCapability, StageId
from .base import Chunked, StageContext, StageDef, StageInputError
from .reward import _reward_kl, kl_reach, reward_kl_type
from ..bundle.loss_knobs import LossKnobs
from ..judge.error_model import kl_condition
from ..kernels.loss import opd_advantages


def run_advantage_kl(ctx: StageContext) -> StageReport:
    cfg = ctx.config
    expected = ctx.payload("kl")
    bound = None
    if cfg.kl_coef == 0:  # zeros in the payload's dtype: a bundle of zeros matches at once (compare_field)
        # one zero seen on every token (read-only): no token-long buffer
        kl = torch.zeros(1, dtype=expected.dtype).expand(int(ctx.lengths.sum()))
    else:
        if not ctx.has("ref_log_probs"):
            raise StageInputError("payload 'ref_log_probs' is required when kl_coef != 0", field="ref_log_probs")
        old, ref = ctx.payload("old_log_probs"), ctx.payload("ref_log_probs")
        if ctx.dtype != torch.float64:  # --exact: the producer's float32 kernel, compared bitwise
            kl = rollout_kl(old, ref, cfg.kl_coef, reward_kl_type(cfg), dtype=ctx.dtype,
                            clamp=cfg.kl_penalty_clamp)
            if kl_zeroed(cfg):
                kl = kl * ctx.loss_mask.to(kl.dtype)
        else:
            cols = _kl_columns(ctx, old, ref, expected)
            kl, bound = cols.column("actual"), cols.column("bound")
            if kl_zeroed(cfg):
                kl, bound = _masked(ctx, kl), _masked(ctx, bound)
            ctx.coarse_payload_hazard("advantage.kl", {"old_log_probs": old, "ref_log_probs": ref}, (
                "each kl admits their rounding, 2·|dKL/dr|·u·(2^⌊log2|old|⌋ + 2^⌊log2|ref|⌋): the producer's r may be that far "
                "from the recorded one"))
            if reward_kl_type(cfg) == "low_var_kl":
                _kl_clamp_hazards(ctx, old, ref)
    field = ctx.field("advantage.kl", "kl", PER_TOKEN, expected, kl, bound=bound)
    return ctx.report(
        StageId.ADVANTAGE_KL, [field],
        fail_reason=lambda total, per: f"kl mismatch in {total.mismatches} token(s) of {total.bad_samples} sample(s)",
        pass_reason=lambda total, per: f"{total.compared} token(s) compared ({reward_kl_type(cfg)}, kl_coef={cfg.kl_coef})")


def _kl_columns(ctx: StageContext, old: torch.Tensor, ref: torch.Tensor, stored: torch.Tensor) -> Chunked:
    """The float64 KL of rows ``[lo, hi)`` and its rounding bound, from the recorded log-probs upcast (``stored``:
    the recorded kl payload, whose storage rounding the bound adds)."""
    kl_type = reward_kl_type(ctx.config)
    u_token, u_store = ctx.precision.token, unit_roundoff(stored)
    # log-probs stored coarser than the declared compute: the producer's r was that far from the recorded one
    u_input = storage_unit(ctx.precision.compute, old, ref)

    def chunk(lo: int, hi: int) -> dict[str, torch.Tensor]:
        # ref promoted to float64 inside the difference: the same bits as converting it first, one copy fewer
        log_ratio = torch.sub(old[lo:hi].to(torch.float64), ref[lo:hi])
        # the estimate and its bound share r and exp(−r) (k3, low_var_kl)
        truth, exp_neg = kl_of_log_ratio(log_ratio, kl_type, ctx.config.kl_penalty_clamp)
        e_r = storage_error(u_input, old[lo:hi], ref[lo:hi]) if u_input else None
        return {"actual": truth, "bound": kl_bound(log_ratio, truth, kl_type, u_token, u_store, exp_neg, e_r)}

    return Chunked(chunk)


# The float32 log-ratios r outside KL_CANDIDATE_CENTER ± KL_CANDIDATE_HALF = [−2.51, 10.89] may have k3 beyond the
# ±10 clamp (exactly: r < −2.6109 or r > 10.99998); those are evaluated in float64 (_kl_clamp_hazards).
KL_CANDIDATE_CENTER = 4.19
KL_CANDIDATE_HALF = 6.7


def _kl_clamp_hazards(ctx: StageContext, old: torch.Tensor, ref: torch.Tensor) -> None:
    """Samples with tokens whose k3 lies beyond low_var_kl's ±10 clamp."""
    hits = torch.zeros(ctx.n, dtype=torch.int64)
    for lo, hi, seg in ctx.token_chunks():
        # k3(r) = exp(−r) − 1 + r exceeds 10 only for r = old − ref below −2.6109 or above 10.99998 (it is convex,
        # 0 at r = 0): the float32 difference (within 2⁻²⁴·|r| of the exact one) outside [−2.51, 10.89] marks the
        # candidates, and only those are evaluated exactly in float64
        diff = torch.sub(old[lo:hi].float(), ref[lo:hi].float())
        # fl32(r − center) grows with r: when the smallest and the largest r are inside, every r is, and the chunk
        # needs no per-token test (a NaN makes both NaN, which are not inside: its tokens are tested one by one)
        ends = torch.stack(torch.aminmax(diff))
        if bool((ends.sub_(KL_CANDIDATE_CENTER).abs_() <= KL_CANDIDATE_HALF).all()):
            continue
        near = diff.sub_(KL_CANDIDATE_CENTER).abs_() > KL_CANDIDATE_HALF
        if not bool(near.any()):
            continue
        at = torch.nonzero(near).reshape(-1)
        neg = ref[lo:hi][at].to(torch.float64) - old[lo:hi][at].to(torch.float64)
        over = (neg.exp() - 1 - neg).abs() > KL_CLAMP
        if bool(over.any()):
            hits.index_add_(0, seg[at[over]], torch.ones(int(over.sum()), dtype=torch.int64))
    for i in torch.nonzero(hits).reshape(-1).tolist():
        ctx.hazard("advantage.kl", "kl_clamp", sample=i, message=(
            f"{ctx.sample_ids[i]}: {int(hits[i])} token(s) with k3 beyond the ±{KL_CLAMP:g} clamp of low_var_kl "
            f"(the recorded value is the clamp, not the estimate)"))


def _kl_requirements(reader: BundleReader) -> list[str]:
    missing = [reader.payload_label(n) for n in ("kl",) if not reader.has_payload(n)]
    if reader.index.config.kl_coef != 0:
        missing += [reader.payload_label(n) for n in ("old_log_probs", "ref_log_probs") if not reader.has_payload(n)]
    return missing


def _kl_refuse(cfg: RecomputeConfig) -> list[tuple[str, str]]:
    if cfg.kl_coef != 0 and reward_kl_type(cfg) not in KL_TYPES:
        knob = "kl_penalty_type" if cfg.kl_penalty_type is not None else "kl_loss_type"
        return [(knob, f"{reward_kl_type(cfg)!r} is not one of {', '.join(KL_TYPES)}")]
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
    if any(type(s.reward) is list for s in ctx.samples):
        raise StageInputError("per-token rewards: each sample's rewards are read per token (recorded_token_rewards)",
                              field="reward")
    return list_tensor([s.reward for s in ctx.samples], torch.float64), None


def recorded_token_rewards(ctx: StageContext) -> Optional[torch.Tensor]:
    """float64 ``[tokens]`` of the selected samples' recorded rewards when advantage.estimate consumes them and one
    of them is per-token (format 1.2 / 2.0: a list of ``response_length`` values; a scalar is broadcast over its
    sample's tokens), else ``None`` (per-sample rewards: :func:`grpo_rewards`)."""
    if "rewards" in ctx.outputs and (ctx.chain or not _rewards_recorded(ctx)):
        return None
    if isinstance(ctx.reader.expected.get("reward.post_process", {}).get("rewards"), list):
        return None
    if not any(type(s.reward) is list for s in ctx.samples):
        return None
    parts = [torch.tensor(s.reward, dtype=torch.float64) if type(s.reward) is list
             else torch.full((s.response_length,), float(s.reward), dtype=torch.float64) for s in ctx.samples]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def per_token_reward_refusal(reader: BundleReader) -> Optional[str]:
    """Why advantage.estimate cannot replay this bundle's per-token rewards (exit 4), else ``None``: they are
    the advantages themselves under a broadcast estimator without whitening (the original's GRPO), and nothing
    else defines how a per-token reward enters a group baseline, a discounted return or GAE."""
    cfg = reader.index.config
    if estimate_kind(cfg) == "broadcast" and not whitens(cfg):
        return None
    for i, s in enumerate(reader.index.samples):
        if type(s.reward) is list:
            if estimate_kind(cfg) == "broadcast" and cfg.normalize_advantages:
                how = "normalize_advantages=true"
            elif cfg.kl_in_reward == "token_returns" and cfg.advantage_estimator not in ("gae", "reinforce_plus_plus"):
                how = "kl_in_reward='token_returns'"
            else:
                how = f"advantage_estimator={cfg.advantage_estimator!r}"
            return (f"$.samples[{i}].reward: a per-token reward is replayed under a broadcast estimator without "
                    f"whitening only (grpo, as the original's format 2.0), not {how}")
    return None


def _token_reward_estimate(ctx: StageContext, expected: torch.Tensor, tokens: torch.Tensor) -> StageReport:
    """advantage.estimate of per-token rewards: each token's advantage is its recorded reward (the broadcast
    estimators' rule, token by token), compared on every token."""
    if ctx.dtype != torch.float64:  # --exact: the producer's float32 values, compared bitwise
        actual, bound = tokens.to(ctx.dtype), None
    else:
        actual = tokens
        bound = advantage_bound(tokens, unit_roundoff(expected))
    if zeroed(ctx.config):
        actual = _masked(ctx, actual)
        bound = None if bound is None else _masked(ctx, bound)
    ctx.outputs["advantages"] = actual
    if bound is not None:
        per_sample = torch.zeros(ctx.n, dtype=torch.float64)
        if bound.numel():
            per_sample.scatter_reduce_(0, ctx.seg, bound, reduce="amax", include_self=True)
        ctx.outputs["advantage_bound"] = per_sample
    field = ctx.field("advantage.estimate", "advantage", PER_TOKEN, expected, actual, bound=bound,
                      compared=_rule_nan(ctx, None, expected))
    return ctx.report(
        StageId.ADVANTAGE_ESTIMATE, [field],
        fail_reason=lambda total, per: f"advantage mismatch in {total.mismatches} token(s) of {total.bad_samples} sample(s)",
        pass_reason=lambda total, per: f"{total.compared} token(s) compared (per-token rewards)")


def _rewards_recorded(ctx: StageContext) -> bool:
    recorded = ctx.reader.expected.get("reward.post_process", {}).get("rewards")
    return isinstance(recorded, list) or all(s.reward is not None for s in ctx.samples)


def run_advantage_estimate(ctx: StageContext) -> StageReport:
    cfg = ctx.config
    expected = ctx.payload("advantages")
    if opd_in_advantages(cfg):
        return _opd_estimate(ctx, expected)
    if estimate_kind(cfg) == "broadcast" and not whitens(cfg):
        return _broadcast_estimate(ctx, expected)
    est = _token_estimate(ctx)
    if not ctx.partial or est.whiten_stats is not None or not whitens(cfg):
        stats = est.whiten_stats
    else:  # whitened over the shard's loss tokens, not the selection's: the shard's statistics
        full = StageContext(reader=ctx.reader, indices=list(range(len(ctx.reader.index.samples))), partial=False,
                            rules=ctx.rules)
        stats = _token_estimate(full).stats_of()
    actual, bound = est.finish(stats, unit_roundoff(expected))
    if whitens(cfg) and not est.exact:
        _whiten_hazard(ctx, est, stats if stats is not None else est.stats_of())
    compared = est.mask != 0
    fields = [ctx.field("advantage.estimate", "advantage", PER_TOKEN, expected, actual, bound=bound,
                        compared=_rule_nan(ctx, compared, expected))]
    if est.returns is not None and ctx.has("returns"):
        recorded = ctx.payload("returns")
        ret_bound = None if est.returns_bound is None else \
            est.returns_bound + advantage_bound(est.returns.to(torch.float64), unit_roundoff(recorded))
        fields.append(ctx.field("advantage.estimate", "returns", PER_TOKEN, recorded, est.returns, bound=ret_bound,
                                compared=compared))
    ctx.outputs["advantages"] = actual
    if bound is not None:
        per_sample = torch.zeros(ctx.n, dtype=torch.float64)
        if bound.numel():
            per_sample.scatter_reduce_(0, ctx.seg, bound, reduce="amax", include_self=True)
        ctx.outputs["advantage_bound"] = per_sample
    what = _estimate_text(cfg)

    def fail_reason(total, per) -> str:  # the advantages and the returns counted apart: tokens, not both
        parts = [f"{name} mismatch in {c.mismatches} token(s) of {c.bad_samples} sample(s)"
                 for name, c in per.items() if c.mismatches]
        return "; ".join(parts) or f"advantage mismatch in {total.mismatches} token(s)"

    def pass_reason(total, per) -> str:
        returns = " and their returns" if "returns" in per else ""
        return f"{per['advantage'].compared} loss token(s) compared{returns} ({what})"

    return ctx.report(StageId.ADVANTAGE_ESTIMATE, fields, fail_reason=fail_reason, pass_reason=pass_reason)


def _whiten_hazard(ctx: StageContext, est: "_TokenEstimate", stats: tuple[float, float]) -> None:
    """A whitening whose variance is at the rounding level of its mean (every loss token's advantage equal, up
    to rounding): the whitened values a float32 producer writes are its rounding over ``sqrt(1e-8)``."""
    m = est.mask.to(torch.float64)
    n = float(m.sum())
    variance, eps_mode = whiten_modes(est.cfg)
    if n < 2 or est.whiten_stats is not None or variance == "none":
        return
    mean_abs = float((est.pre.to(torch.float64).abs() * m).sum()) / n
    # the divisor is sqrt(var + eps) (add) or sqrt(max(var, eps)) (clamp: at the floor, var is below it)
    var = max(stats[1] ** 2 - (WHITEN_EPS if eps_mode == "add" else 0.0), 0.0)
    level = C_REWARD * U32 * math.sqrt(n) * mean_abs
    if math.sqrt(var) <= level:
        ctx.hazard("advantage.estimate", "whiten_zero_std", message=(
            f"whitening over {int(n)} loss token(s) whose advantages are equal up to rounding (std "
            f"{math.sqrt(var):.3g}, mean |A| {mean_abs:.3g}): the whitened values are rounding noise over "
            + ("sqrt(var + 1e-8)" if eps_mode == "add" else "sqrt(max(var, 1e-8))")))


MASKED_TOKEN_VALUES = ("computed", "zero")


def zeroed(cfg: RecomputeConfig) -> bool:
    """Whether the producer writes 0 at loss-mask-0 tokens of the broadcast advantages and the in-reward KL
    (``masked_token_value="zero"``: verl's ``scores.unsqueeze(-1) * response_mask``, core_algos.py:330, and
    ``kld * response_mask``, ray_trainer.py ``apply_kl_penalty``)."""
    return cfg.masked_token_value == "zero"


def kl_masked_value(cfg: RecomputeConfig) -> str:
    """The rule of the in-reward ``kl`` at loss-mask-0 tokens: ``kl_masked_token_value``, unset read as
    ``masked_token_value`` (SkyRL zeroes its KL there, ``compute_approx_kl`` ppo_utils.py:122-125, while its
    advantages keep their value)."""
    rule = cfg.kl_masked_token_value
    return rule if isinstance(rule, str) else cfg.masked_token_value


def kl_zeroed(cfg: RecomputeConfig) -> bool:
    """Whether the producer writes 0 at loss-mask-0 tokens of the in-reward KL (advantage.kl)."""
    return kl_masked_value(cfg) == "zero"


def _masked(ctx: StageContext, column):
    """A per-token column (a tensor or a chunk reader ``(lo, hi) → tensor``) times the loss mask."""
    mask = ctx.loss_mask
    if isinstance(column, torch.Tensor):
        return column * mask.to(column.dtype)
    return lambda lo, hi: (lambda v: v * mask[lo:hi].to(v.dtype))(column(lo, hi))


def _broadcast_estimate(ctx: StageContext, expected: torch.Tensor) -> StageReport:
    """GRPO returns (and dr_grpo, rloo, REINFORCE++-baseline's before their whitening): each sample's reward
    broadcast over its tokens, compared on every token, as V1."""
    tokens = recorded_token_rewards(ctx)
    if tokens is not None:
        return _token_reward_estimate(ctx, expected, tokens)
    rewards, inherited = grpo_rewards(ctx)
    bound = None
    if ctx.dtype != torch.float64:  # --exact: the producer's float32 broadcast, compared bitwise
        advantages = get_grpo_returns(rewards, ctx.lengths, dtype=ctx.dtype)
        actual = _masked(ctx, advantages) if zeroed(ctx.config) else advantages
    else:
        advantages = GrpoReturns(rewards, ctx.lengths, dtype=torch.float64)
        per_sample = advantage_bound(advantages.rewards, unit_roundoff(expected))
        if inherited is not None:
            per_sample = per_sample + inherited.to(torch.float64)
        ctx.outputs["advantage_bound"] = per_sample

        if advantages.numel() <= KEEP_COLUMNS:
            # a field this small is kept whole anyway: one gather over the token axis (the context's sample
            # of every token) instead of a search per chunk; the columns are read as slices of it
            # (gathered on first read: a field judged a sample at a time reads no token column unless it fails)
            whole: dict[str, torch.Tensor] = {}

            def column(name: str, values: torch.Tensor):
                def read(lo: int, hi: int) -> torch.Tensor:
                    if name not in whole:
                        whole[name] = values[ctx.seg]
                    return whole[name][lo:hi]
                return read

            actual, bound = column("actual", advantages.rewards), column("bound", per_sample)
        else:
            def chunk(lo: int, hi: int) -> dict[str, torch.Tensor]:
                sample = advantages.sample_of(lo, hi)
                return {"actual": advantages.rewards[sample], "bound": per_sample[sample]}

            cols = Chunked(chunk)
            actual, bound = cols.column("actual"), cols.column("bound")
        if zeroed(ctx.config):  # 0 at the response's mask-0 tokens, compared there too (bound 0)
            actual, bound = _masked(ctx, actual), _masked(ctx, bound)
    ctx.outputs["advantages"] = advantages
    field = ctx.field("advantage.estimate", "advantage", PER_TOKEN, expected, actual, bound=bound,
                      compared=_rule_nan(ctx, None, expected),
                      per_sample=(advantages.rewards, per_sample) if bound is not None and not zeroed(ctx.config)
                      else None)
    return ctx.report(
        StageId.ADVANTAGE_ESTIMATE, [field],
        fail_reason=lambda total, per: f"advantage mismatch in {total.mismatches} token(s) of {total.bad_samples} sample(s)",
        pass_reason=lambda total, per: f"{total.compared} token(s) compared")


def opd_in_advantages(cfg: RecomputeConfig) -> bool:
    """On-policy distillation placed in the advantages (``opd_placement="advantage"``)."""
    return LossKnobs.of(cfg).opd_placement == "advantage"


def _opd_estimate(ctx: StageContext, expected: torch.Tensor) -> StageReport:
    """The broadcast GRPO returns minus on-policy distillation's term per token: ``A_t = R_i − opd_coef·
    estimate(old_t, teacher_t)`` (``kernels.loss.opd_advantages``; slime ``apply_opd_kl_to_advantages``,
    ``backends/megatron_utils/loss.py:663-701``, applied after the estimator and before any normalization,
    ``:809-816``). Bound: the returns' and, per token, the estimate's rounding (its condition × ``|coef|``)
    and the stored log-probs' units."""
    knobs = LossKnobs.of(ctx.config)
    zero_base = knobs.opd_base == "zero"  # NeMo-RL's opd estimator: −coef·estimate alone, no rewards read
    rewards, inherited = (torch.zeros(ctx.n, dtype=torch.float64), None) if zero_base else grpo_rewards(ctx)
    old, teacher = ctx.payload("old_log_probs"), ctx.payload("teacher_log_probs")
    if ctx.dtype != torch.float64:  # --exact: the producer's float32 arithmetic, compared bitwise
        base = get_grpo_returns(rewards, ctx.lengths, dtype=ctx.dtype)
        actual = opd_advantages(base, old, teacher, knobs, dtype=ctx.dtype)
        bound = None
    else:
        base = GrpoReturns(rewards, ctx.lengths, dtype=torch.float64).materialize()
        actual = opd_advantages(base, old, teacher, knobs, dtype=torch.float64)
        per_sample = (torch.zeros(ctx.n, dtype=torch.float64) if zero_base
                      else advantage_bound(rewards.to(torch.float64), unit_roundoff(expected)))
        if inherited is not None:
            per_sample = per_sample + inherited.to(torch.float64)
        r = old.to(torch.float64) - teacher.to(torch.float64)
        term = abs(knobs.opd_coef) * (kl_condition(r, knobs.opd_kl_type) + r.abs())
        u = max(unit_roundoff(old), unit_roundoff(teacher), U32)
        bound = per_sample[ctx.seg] + C_STORE * u * (term + actual.abs())
        ctx.outputs["advantage_bound"] = per_sample + float(bound.max()) if bound.numel() else per_sample
    if zeroed(ctx.config):
        actual = _masked(ctx, actual)
        bound = _masked(ctx, bound) if bound is not None else None
    ctx.outputs["advantages"] = actual
    field = ctx.field("advantage.estimate", "advantage", PER_TOKEN, expected, actual, bound=bound,
                      compared=_rule_nan(ctx, None, expected))
    what = ("" if zero_base else "GRPO returns ") + f"− {knobs.opd_coef:g}·{knobs.opd_kl_type}(old − teacher)"
    return ctx.report(
        StageId.ADVANTAGE_ESTIMATE, [field],
        fail_reason=lambda total, per: f"advantage mismatch in {total.mismatches} token(s) of {total.bad_samples} "
                                       f"sample(s) ({what})",
        pass_reason=lambda total, per: f"{total.compared} token(s) compared ({what})")


def _rule_nan(ctx: StageContext, compared: Optional[torch.Tensor], expected: torch.Tensor) -> Optional[torch.Tensor]:
    """``compared`` without the tokens of one-sample groups whose recorded advantage is NaN because the
    bundle's ``singleton_group="nan"`` rule made their reward NaN (slime): the rule, not a divergence."""
    if ctx.config.singleton_group != "nan" or None in ctx.group_indices:
        return compared
    sizes = Counter(ctx.group_indices)
    one = torch.tensor([sizes[g] == 1 for g in ctx.group_indices], dtype=torch.bool)
    if not bool(one.any()):
        return compared
    skip = one[ctx.seg] & torch.isnan(expected.reshape(-1))
    base = compared if compared is not None else torch.ones_like(skip)
    return base & ~skip


def estimate_kind(cfg: RecomputeConfig) -> str:
    """``broadcast`` (each sample's reward on all its tokens), ``returns`` (per-token rewards and their discounted
    sums: REINFORCE++, or any estimator with ``kl_in_reward="token_returns"``) or ``gae``."""
    if cfg.advantage_estimator == "gae":
        return "gae"
    if cfg.advantage_estimator in ("reinforce_plus_plus", "remax") or cfg.kl_in_reward == "token_returns":
        return "returns"
    return "broadcast"


def whitens(cfg: RecomputeConfig) -> bool:
    """REINFORCE++ and REINFORCE++-baseline whiten by definition (verl ``masked_whiten``); any estimator with
    ``normalize_advantages``."""
    return bool(cfg.normalize_advantages) or cfg.advantage_estimator in ("reinforce_plus_plus",
                                                                          "reinforce_plus_plus_baseline")


def whiten_modes(cfg: RecomputeConfig) -> tuple[str, str]:
    """``(whiten_variance, whiten_eps_mode)`` of a config, unset read as verl's ``masked_whiten``
    (``unbiased``, ``add``)."""
    variance = cfg.whiten_variance if isinstance(cfg.whiten_variance, str) else "unbiased"
    eps_mode = cfg.whiten_eps_mode if isinstance(cfg.whiten_eps_mode, str) else "add"
    return variance, eps_mode


def gae_masked(cfg: RecomputeConfig) -> str:
    """``gae_masked_tokens`` of a config, unset read as ``skip`` (verl)."""
    return cfg.gae_masked_tokens if isinstance(cfg.gae_masked_tokens, str) else "skip"


def _estimate_text(cfg: RecomputeConfig) -> str:
    kind = estimate_kind(cfg)
    parts = [cfg.advantage_estimator]
    if kind == "returns":
        parts.append(f"discounted returns, γ={cfg.gamma:g}")
    elif kind == "gae":
        parts.append(f"GAE, γ={cfg.gamma:g}, λ={cfg.lam:g}"
                     + (", masked tokens zeroed" if gae_masked(cfg) == "zeroed" else ""))
    if cfg.kl_in_reward == "token_returns" and cfg.kl_coef != 0:
        parts.append(f"− {cfg.kl_coef:g}·kl per token")
    if whitens(cfg):
        variance, eps_mode = whiten_modes(cfg)
        how = {"unbiased": "", "biased": " (biased variance)", "none": " (centred only)"}[variance]
        if variance != "none" and eps_mode == "clamp":
            how = how[:-1] + ", floored at 1e-8)" if how else " (variance floored at 1e-8)"
        parts.append("whitened" + how
                     + (" with the recorded stats" if cfg.advantage_whiten_stats is not None else ""))
    return ", ".join(parts)


class _TokenEstimate:
    """The per-token advantages of one context before whitening (float64 with their bound, or the float32
    kernels under ``--exact``), and :meth:`finish`, which whitens them when the estimator does."""

    def __init__(self, ctx: StageContext) -> None:
        cfg = ctx.config
        self.cfg = cfg
        self.exact = ctx.dtype != torch.float64
        dtype = ctx.dtype
        rewards, inherited = grpo_rewards(ctx)
        self.mask = ctx.loss_mask
        lengths = ctx.lengths
        kl = kl_error = None
        kl_stored, kl_rounding = {}, ""
        if cfg.kl_in_reward == "token_returns" and cfg.kl_coef != 0:
            kl, kl_error, kl_stored, kl_rounding = _reward_kl(ctx)
        kind = estimate_kind(cfg)
        self.returns = self.returns_bound = None
        if kind == "broadcast":
            pre = get_grpo_returns(rewards, lengths, dtype=dtype)
            pre32 = None
        elif kind == "returns":
            pre = discounted_returns(token_rewards(rewards, self.mask, lengths, kl, cfg.kl_coef, dtype=dtype),
                                     lengths, cfg.gamma, dtype=dtype)
            pre32 = None if self.exact else discounted_returns(
                token_rewards(rewards.to(torch.float32), self.mask, lengths, kl, cfg.kl_coef), lengths, cfg.gamma)
        else:
            if not ctx.has("values"):
                raise StageInputError("payload 'values' is required for advantage_estimator='gae'", field="values")
            values = ctx.payload("values")
            per_token = token_rewards(rewards, self.mask, lengths, kl, cfg.kl_coef, dtype=dtype)
            masked = gae_masked(cfg)
            pre, self.returns = gae_advantages(per_token, values, self.mask, lengths, cfg.gamma, cfg.lam, dtype=dtype,
                                               masked=masked)
            pre32 = None
            if not self.exact:
                per_token32 = token_rewards(rewards.to(torch.float32), self.mask, lengths, kl, cfg.kl_coef)
                pre32, _ = gae_advantages(per_token32, values, self.mask, lengths, cfg.gamma, cfg.lam, masked=masked)
        self.pre = pre
        self.bound = None
        if not self.exact:
            m = self.mask.to(torch.float64)
            g = rewards.to(torch.float64)
            if kind == "broadcast":
                bound = torch.zeros_like(pre)
            else:
                terms = token_rewards(g.abs(), self.mask, lengths, None if kl is None else kl.to(torch.float64).abs(),
                                      -abs(cfg.kl_coef), dtype=torch.float64)
                if kind == "gae":
                    v = values.to(torch.float64).abs()
                    v_max = torch.zeros(ctx.n, dtype=torch.float64)
                    if v.numel():
                        v_max.scatter_reduce_(0, ctx.seg, v, reduce="amax", include_self=True)
                    # skip: the values enter at loss tokens only; zeroed: a mask-0 token's δ is γ·V_next
                    v_terms = (m * v + cfg.gamma * v_max[ctx.seg] if gae_masked(cfg) == "zeroed"
                               else m * (v + cfg.gamma * v_max[ctx.seg]))
                    cond = discounted_returns(terms + v_terms, lengths, cfg.gamma * cfg.lam, dtype=torch.float64)
                else:
                    cond = discounted_returns(terms, lengths, cfg.gamma, dtype=torch.float64)
                bound = recursion_bound(pre, pre32, cond, U32)
                # values / kl (or under --chain the log-probs it is recomputed from) stored coarser than the
                # declared compute: the recursion carries their rounding — the values' within the recursion over
                # the magnitudes of its terms, each KL's own storage error discounted like its reward
                u_v = storage_unit(ctx.precision.compute, values) if kind == "gae" else 0.0
                if u_v:
                    bound = bound + (C_STORE * u_v) * cond
                if kl_error is not None:
                    kl_error = kl_error * m  # on loss tokens, as the token rewards
                    bound = bound + discounted_returns(abs(cfg.kl_coef) * kl_error, lengths,
                                                       cfg.gamma * (cfg.lam if kind == "gae" else 1.0),
                                                       dtype=torch.float64)
                if u_v or kl_error is not None:
                    carried = (["the values' 2·u times the recursion over the magnitudes of its terms"] if u_v
                               else []) + ([f"each kl's {kl_rounding} discounted like its reward"]
                                           if kl_error is not None else [])
                    ctx.coarse_payload_hazard("advantage.estimate", {
                        "values": values if u_v else None, **(kl_stored if kl_error is not None else {})},
                        f"each advantage admits their rounding, carried by the recursion ({'; '.join(carried)})"
                        + (kl_reach(ctx, segment_sum(kl.to(torch.float64).abs() * m, ctx.seg, ctx.n),
                                    segment_sum(kl_error, ctx.seg, ctx.n)) if kl_error is not None else ""))
            if inherited is not None:  # --chain: the recomputed rewards' own bound, carried like the reward
                carried = token_rewards(inherited.to(torch.float64), self.mask, lengths, dtype=torch.float64)
                decay = cfg.gamma * (cfg.lam if kind == "gae" else 1.0)
                bound = bound + (inherited.to(torch.float64)[ctx.seg] if kind == "broadcast"
                                 else discounted_returns(carried, lengths, decay, dtype=torch.float64))
            self.bound = bound
            if kind == "gae":  # returns = A + V: the advantage's error (and the sum's rounding, added by the caller)
                self.returns_bound = bound
                u_v = storage_unit(ctx.precision.compute, values)
                if u_v:  # and the stored V's own rounding, which the sum carries as it is
                    self.returns_bound = bound + C_STORE * storage_error(u_v, values)
        recorded = cfg.advantage_whiten_stats
        self.whiten_stats = None if recorded is None else (float(recorded.mean), float(recorded.std))

    def stats_of(self) -> tuple[float, float]:
        """``(mean, divisor)`` of these advantages over their loss tokens (verl ``masked_whiten``)."""
        if self.whiten_stats is not None:
            return self.whiten_stats
        variance, eps_mode = whiten_modes(self.cfg)
        mean, divisor = whiten_stats(self.pre, self.mask, dtype=self.pre.dtype, variance=variance, eps_mode=eps_mode)
        return float(mean), float(divisor)

    def finish(self, stats: Optional[tuple[float, float]], u_store: float):
        """``(advantages, bound)``: whitened with ``stats`` (None: over these tokens) when the estimator
        whitens; the bound adds the payload's own rounding."""
        if not whitens(self.cfg):
            if self.bound is None:
                return self.pre, None
            return self.pre, self.bound + advantage_bound(self.pre.to(torch.float64), u_store)
        if stats is None:
            stats = self.stats_of()
        out = whiten(self.pre, self.mask, dtype=self.pre.dtype, stats=stats)
        if self.bound is None:
            return out, None
        bound = whiten_bound(self.pre, self.bound, self.mask, out, stats[0], stats[1],
                             recorded=self.whiten_stats is not None, divides=whiten_modes(self.cfg)[0] != "none")
        return out, bound + advantage_bound(out.to(torch.float64), u_store)


def _token_estimate(ctx: StageContext) -> _TokenEstimate:
    return _TokenEstimate(ctx)


def _estimate_requirements(reader: BundleReader) -> list[str]:
    missing = [] if reader.has_payload("advantages") else [reader.payload_label('advantages')]
    post = reader.manifest.stage_contracts.get(StageId.REWARD_POST_PROCESS)
    has_rewards = (post is not None and post.capability == StageCapability.RECOMPUTE) or isinstance(
        reader.expected.get("reward.post_process", {}).get("rewards"), list
    ) or all(s.reward is not None for s in reader.index.samples)
    cfg = reader.index.config
    if not has_rewards and not (opd_in_advantages(cfg) and LossKnobs.of(cfg).opd_base == "zero"):
        missing.append("normalized rewards (reward.post_process, expected rewards or samples[].reward)")
    if cfg.kl_in_reward == "token_returns" and cfg.kl_coef != 0 and not reader.has_payload("kl"):
        missing.append(f"{reader.payload_label('kl')} (kl_in_reward=token_returns)")
    if opd_in_advantages(cfg):
        missing += [f"{reader.payload_label(n)} (opd_placement='advantage')" for n in ("old_log_probs", "teacher_log_probs")
                    if not reader.has_payload(n)]
    return missing


def _estimate_refuse(cfg: RecomputeConfig) -> list[tuple[str, str]]:
    if opd_in_advantages(cfg) and (estimate_kind(cfg) != "broadcast" or whitens(cfg)):
        return [("opd_placement", "'advantage' is recomputed on GRPO-style returns broadcast over the tokens, without "
                                  "whitening (slime's --use-opd with grpo); with this estimator or whitening it is not")]
    return []


# Estimators of the frameworks this engine knows by name but does not recompute (exit 4, named), and why.
UNSUPPORTED_ESTIMATORS = {
    "ppo": "slime's name for GAE: write advantage_estimator='gae' (with the values payload) to recompute it",
    "dppo": "prime-rl's DPPO is a loss family outside the clipped surrogate",
    "decoupled_ppo": "AReaL's decoupled loss (a proximal policy between behaviour and current) is not recomputed",
    "optimal_token_baseline": "verl's optimal token baseline is not recomputed: it weights each token by "
                              "1 − 2·π(token) + Σ π² over the vocabulary, which a bundle does not record",
}
KL_IN_REWARD_FORMS = ("sequence", "token_returns")


def advantage_config_error(reader: BundleReader, stages) -> Optional[str]:
    """The first advantage-side knob of SPEC §4.2 whose value is not one the format defines (``validate`` and
    ``replay`` exit 3 on it, naming ``$.config.<knob>``), or a GAE bundle without its ``values`` payload."""
    cfg = reader.index.config
    known = ADVANTAGE_ESTIMATORS + tuple(UNSUPPORTED_ESTIMATORS)
    checks = (
        ("advantage_estimator", cfg.advantage_estimator in known, "one of " + ", ".join(ADVANTAGE_ESTIMATORS)),
        ("group_baseline", cfg.group_baseline in GROUP_BASELINES, "one of " + ", ".join(GROUP_BASELINES)),
        ("std_zero", cfg.std_zero in STD_ZERO_RULES, "one of " + ", ".join(STD_ZERO_RULES)),
        ("singleton_group", cfg.singleton_group is None or cfg.singleton_group in SINGLETON_RULES,
         "null or one of " + ", ".join(SINGLETON_RULES)),
        ("kl_in_reward", cfg.kl_in_reward is None or cfg.kl_in_reward in KL_IN_REWARD_FORMS,
         "null or one of " + ", ".join(KL_IN_REWARD_FORMS)),
        ("kl_penalty_type", cfg.kl_penalty_type is None or cfg.kl_penalty_type in KL_TYPES,
         "null or one of " + ", ".join(KL_TYPES)),
        ("masked_token_value", cfg.masked_token_value in MASKED_TOKEN_VALUES,
         "one of " + ", ".join(MASKED_TOKEN_VALUES)),
        ("kl_masked_token_value", kl_masked_value(cfg) in MASKED_TOKEN_VALUES,
         "one of " + ", ".join(MASKED_TOKEN_VALUES)),
        ("whiten_variance", whiten_modes(cfg)[0] in WHITEN_VARIANCES, "one of " + ", ".join(WHITEN_VARIANCES)),
        ("whiten_eps_mode", whiten_modes(cfg)[1] in WHITEN_EPS_MODES, "one of " + ", ".join(WHITEN_EPS_MODES)),
        ("gae_masked_tokens", gae_masked(cfg) in GAE_MASKED_TOKENS, "one of " + ", ".join(GAE_MASKED_TOKENS)),
        ("grpo_std_scope", grpo_std_scope(cfg) in STD_SCOPES, "one of " + ", ".join(STD_SCOPES)),
        ("gamma", math.isfinite(cfg.gamma) and 0.0 <= cfg.gamma <= 1.0, "a number in [0, 1]"),
        ("lam", math.isfinite(cfg.lam) and 0.0 <= cfg.lam <= 1.0, "a number in [0, 1]"),
        ("grpo_std_eps", math.isfinite(cfg.grpo_std_eps) and cfg.grpo_std_eps >= 0, "a finite number >= 0"),
    )
    for knob, ok, what in checks:
        if not ok:
            return f"$.config.{knob}={getattr(cfg, knob)!r}: expected {what}"
    stats = cfg.advantage_whiten_stats
    if stats is not None and not (math.isfinite(stats.mean) and math.isfinite(stats.std) and stats.std > 0):
        return (f"$.config.advantage_whiten_stats={{mean: {stats.mean!r}, std: {stats.std!r}}}: expected a finite "
                "mean and a finite std > 0 (the divisor the producer whitened by)")
    est_inputs = estimator_input_error(reader)
    if est_inputs is not None:
        return est_inputs
    if cfg.advantage_estimator == "gae" and StageId.ADVANTAGE_ESTIMATE in stages and not reader.has_payload("values"):
        return ("$.config.advantage_estimator='gae' needs the per-token critic values: "
                f"{reader.payload_label('values')} is missing")
    return None


def estimator_input_error(reader: BundleReader) -> Optional[str]:
    """The per-sample inputs an estimator or the length shaping needs beyond the score (SPEC §4.2), checked before
    any stage runs: the shaping's knobs and each sample's ``truncated`` flag; remax each sample's finite ``reward_baseline``; gdpo each sample's ``reward_components``, one count K ≥ 1 for
    every sample, finite, and ``reward_component_weights`` (when set) K finite numbers."""
    cfg = reader.index.config
    samples = reader.index.samples
    buffer, coef = cfg.overlong_buffer_len, cfg.truncated_reward_coef
    if isinstance(buffer, float):
        top = cfg.overlong_max_tokens
        if not (math.isfinite(buffer) and buffer > 0) or not isinstance(top, int) or top < buffer:
            return (f"$.config.overlong_buffer_len={buffer!r}: expected a finite number > 0 with overlong_max_tokens an "
                    f"integer >= it (got {top!r})")
        factor = cfg.overlong_penalty_factor
        if isinstance(factor, float) and not math.isfinite(factor):
            return f"$.config.overlong_penalty_factor={factor!r}: expected a finite number"
    if isinstance(coef, float):
        if not math.isfinite(coef) or coef > 1:
            return f"$.config.truncated_reward_coef={coef!r}: expected a number <= 1 (in [0, 1] a factor, < 0 a value)"
        for i, s in enumerate(samples):
            if not isinstance(s.truncated, bool):
                return (f"$.samples[{i}].truncated: expected true or false (whether the generation stopped at the "
                        "token limit; truncated_reward_coef is set)")
    if cfg.advantage_estimator == "remax":
        for i, s in enumerate(samples):
            b = s.reward_baseline
            if not isinstance(b, (int, float)) or not math.isfinite(b):
                shown = "missing" if not isinstance(b, (int, float)) else repr(float(b))
                return (f"$.samples[{i}].reward_baseline ({shown}): expected a finite number (the greedy "
                        "rollout's reward that advantage_estimator='remax' subtracts)")
    if cfg.advantage_estimator == "gdpo":
        k = None
        for i, s in enumerate(samples):
            c = s.reward_components
            if not isinstance(c, list) or not c:
                return (f"$.samples[{i}].reward_components: expected a non-empty list of numbers (each reward "
                        "component advantage_estimator='gdpo' normalizes apart)")
            if k is None:
                k = len(c)
            if len(c) != k:
                return f"$.samples[{i}].reward_components: expected {k} components (as samples[0]), got {len(c)}"
            if not all(math.isfinite(v) for v in c):
                return f"$.samples[{i}].reward_components: expected finite numbers"
        w = cfg.reward_component_weights
        if isinstance(w, list) and k is not None and (len(w) != k or not all(math.isfinite(v) for v in w)):
            return (f"$.config.reward_component_weights: expected {k} finite numbers (one per reward component), "
                    f"got {len(w)}")
    return None


def estimator_refusal(cfg: RecomputeConfig) -> Optional[str]:
    """``$.config.advantage_estimator=…: why`` for an estimator known by name but not recomputed (exit 4)."""
    why = UNSUPPORTED_ESTIMATORS.get(cfg.advantage_estimator)
    return None if why is None else f"$.config.advantage_estimator={cfg.advantage_estimator!r}: {why}"


ADVANTAGE_KL = StageDef(
    id=StageId.ADVANTAGE_KL, run=run_advantage_kl, needs=(StageId.SAMPLE,), refuse=_kl_refuse,
    any_cp=True,  # whole trajectories (SPEC §4.2): rank.cp is provenance
    requirements=_kl_requirements, description="rollout-vs-reference KL per token",
)
ADVANTAGE_ESTIMATE = StageDef(
    id=StageId.ADVANTAGE_ESTIMATE, run=run_advantage_estimate, needs=(StageId.REWARD_POST_PROCESS,),
    any_cp=True,  # whole trajectories (SPEC §4.2): rank.cp is provenance
    requirements=_estimate_requirements, refuse=_estimate_refuse,
    description="advantages: GRPO returns, discounted returns, GAE, whitening (SPEC §4.2)",
)
