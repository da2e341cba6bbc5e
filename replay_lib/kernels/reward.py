"""reward.post_process kernels: group normalization by semantic group with the knobs of SPEC §4.2 (baseline,
std constants, the zero-std and singleton rules), KL folded into the score, and the PR #65 batch bug for
fixtures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .segments import segment_ids, segment_sum


STD_EPS = 1e-6

GROUP_BASELINES = ("mean", "leave_one_out")
STD_ZERO_RULES = ("eps", "skip")
STD_SCOPES = ("group", "batch")
SINGLETON_RULES = ("nan", "zero", "raw")
# The estimators whose reward.post_process centres each group (the others pass the score through) and the ones
# of those that may divide by the group std.
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae",
                        "opo", "gpg", "grpo_passk", "maxrl", "remax", "gdpo")
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
# Estimators whose reward.post_process is a rule of its own (estimator_rewards), not the GroupRule's.
OWN_RULE_ESTIMATORS = ("opo", "gpg", "grpo_passk", "maxrl", "remax", "gdpo")


@dataclass(frozen=True)
class GroupRule:
    """How reward.post_process turns a score into the value advantage.estimate consumes.

    ``center``: subtract a group baseline (else the score passes through unchanged); ``baseline``: ``mean`` or
    ``leave_one_out`` (``b_i = (Σ_j r_j − r_i)/(n − 1)``); ``std``: divide by the group std + ``eps``, the std
    ``unbiased`` (Bessel) or not; ``std_zero``: ``eps`` (always divide) or ``skip`` (leave the centred value
    where the std is 0, NeMo-RL); ``singleton``: what a one-sample group gets — ``None`` the arithmetic (NaN
    under an unbiased std), ``nan``, ``zero`` or ``raw`` (verl's mean 0 and std 1: ``r/(1 + eps)`` under std,
    ``r`` without); ``clip``: ``(low, high)`` the value is clamped to last (OpenRLHF's ``reward.clip_range``,
    ``compute_reward``), or None; ``std_scope``: ``group`` (each group's std) or ``batch`` (the std of every sample
    given, TRL's ``scale_rewards="batch"``; the centring stays per group)."""

    center: bool = True
    baseline: str = "mean"
    std: bool = False
    unbiased: bool = True
    eps: float = STD_EPS
    std_zero: str = "eps"
    singleton: Optional[str] = None
    clip: Optional[tuple[float, float]] = None
    std_scope: str = "group"


def grpo_std_scope(cfg) -> str:
    """``grpo_std_scope`` of a ``RecomputeConfig``, unset read as ``group``."""
    return cfg.grpo_std_scope if isinstance(cfg.grpo_std_scope, str) else "group"


def group_rule(cfg) -> GroupRule:
    """The :class:`GroupRule` of a ``RecomputeConfig`` (SPEC §4.2): ``grpo`` as configured; ``dr_grpo`` without
    the std; ``rloo`` the leave-one-out baseline without the std; ``reinforce_plus_plus_baseline`` the baseline
    without the std (whitened later, in advantage.estimate); ``reinforce_plus_plus`` and ``gae`` the score
    itself (no group). ``rewards_normalization=False`` passes the score through for every estimator. Either way the
    value is clamped to ``[reward_clip_low, reward_clip_high]`` when the config sets them."""
    est = cfg.advantage_estimator
    center = bool(cfg.rewards_normalization) and est in GROUP_ESTIMATORS
    return GroupRule(
        center=center,
        baseline="leave_one_out" if est == "rloo" else cfg.group_baseline,
        std=center and est == "grpo" and bool(cfg.grpo_std_normalization),
        unbiased=bool(cfg.grpo_std_unbiased),
        eps=float(cfg.grpo_std_eps),
        std_zero=cfg.std_zero,
        singleton=cfg.singleton_group,
        clip=None if cfg.reward_clip_low is None else (float(cfg.reward_clip_low), float(cfg.reward_clip_high)),
        std_scope=grpo_std_scope(cfg),
    )


def group_normalize(
    raw_rewards: torch.Tensor, group_index: torch.Tensor, std_normalization: bool, eps: float = STD_EPS,
    dtype: torch.dtype = torch.float32, *, unbiased: bool = True, baseline: str = "mean", std_zero: str = "eps",
    singleton: Optional[str] = None, std_scope: str = "group", scope_std: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """GRPO reward post-processing by *semantic group* (``group_index``), never by physical batch, in ``dtype``.

    ``g = r − b``, ``b`` the group mean or (``leave_one_out``) the mean of the *other* samples; with std
    normalization ``g / (std + eps)`` — over the group, or under ``leave_one_out`` over the other samples too
    (NeMo-RL's ``calculate_baseline_and_std_per_prompt``; fewer than two others: std 0). ``std_zero="skip"``
    leaves ``g`` where the std is 0. The sums are taken of ``r − min(r_group)`` and shifted back, which is the
    same value mathematically but exact for a group of equal rewards (0, not a rounding residue). A one-sample
    group follows ``singleton`` (see :class:`GroupRule`); by default the arithmetic, NaN under an unbiased std,
    which the comparison reports.
    """
    r = raw_rewards.to(dtype)
    if r.numel() == 0:
        return r.clone()
    inverse, counts, centered, std = group_moments(r, group_index, dtype, unbiased=unbiased, baseline=baseline,
                                                   with_std=std_normalization, std_scope=std_scope,
                                                   scope_std=scope_std)
    if std_normalization:
        divided = centered / (std + eps)
        centered = torch.where(std > 0, divided, centered) if std_zero == "skip" else divided
    if singleton is not None:
        one = counts[inverse] == 1
        if bool(one.any()):
            if singleton == "nan":
                value = torch.full_like(r, float("nan"))
            elif singleton == "zero":
                value = torch.zeros_like(r)
            else:  # raw: verl's mean 0, std 1
                value = r / (1.0 + eps) if std_normalization else r
            centered = torch.where(one, value, centered)
    return centered


def group_moments(r: torch.Tensor, group_index: torch.Tensor, dtype: torch.dtype, *, unbiased: bool = True,
                  baseline: str = "mean", with_std: bool = True, std_scope: str = "group",
                  scope_std: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(group of each sample, group sizes, centred value r − b, std per sample or None)`` in ``dtype`` (see
    :func:`group_normalize`; the error model reads the float64 std of each sample from here)."""
    r = r.to(dtype)
    _, inverse, counts = torch.unique(group_index.to(torch.int64), return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    group_min = torch.full((n_groups,), float("inf"), dtype=dtype).scatter_reduce(
        0, inverse, r, reduce="amin", include_self=True
    )
    shifted = r - group_min[inverse]
    n = counts.to(dtype)[inverse]
    total = segment_sum(shifted, inverse, n_groups)[inverse]
    if baseline == "leave_one_out":
        # r_i − (Σ_j r_j − r_i)/(n − 1); a singleton divides 0 by 0 (NaN) unless its rule says otherwise
        centered = shifted - (total - shifted) / (n - 1)
    else:
        centered = shifted - total / n
    if not with_std:
        return inverse, counts, centered, None
    if std_scope == "batch":  # scope_std: the whole batch's, where r is a selection of it
        std = batch_std(r, unbiased=unbiased) if scope_std is None else scope_std.to(dtype)
        return inverse, counts, centered, std.expand_as(r)
    dev = shifted - total / n
    ss = segment_sum(dev * dev, inverse, n_groups)[inverse]
    if baseline == "leave_one_out":
        # Σ_{j≠i} (r_j − b_i)² = Σ_j (r_j − mean)² − n/(n − 1)·(r_i − mean)², over m = n − 1 samples
        others = n - 1
        ss_others = torch.clamp_min(ss - dev * dev * n / others, 0.0)
        denom = others - 1 if unbiased else others
        var = torch.where(denom > 0, ss_others / denom, torch.zeros_like(ss_others))
        # others that are all equal have std 0 exactly, whatever the cancellation above leaves
        var = torch.where(_others_equal(shifted, inverse, n_groups), torch.zeros_like(var), var)
    else:
        var = ss / (n - 1 if unbiased else n)
    return inverse, counts, centered, torch.sqrt(var)


def batch_std(r: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """The std of every sample of ``r`` (a 0-d tensor in its dtype), as TRL's ``nanstd(rewards)`` takes it for
    ``scale_rewards="batch"`` (``grpo_trainer.py:2774-2778``, ``trl/trainer/utils.py:1037-1044``): the mean of
    the squared deviations from the mean, times ``n/(n − 1)`` when ``unbiased``; one sample or none: 0."""
    n = r.numel()
    if n <= 1:
        return torch.zeros((), dtype=r.dtype)
    mean = r.mean()
    var = ((r - mean) ** 2).mean()
    if unbiased:
        var = var * (n / (n - 1))
    return torch.sqrt(var)


def _others_equal(shifted: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    """bool per sample: every *other* sample of its group has the same value (the group has at most two
    values, and this sample is the only one of the other)."""
    low = torch.zeros(n_groups, dtype=shifted.dtype)  # shifted values: each group's minimum is 0
    high = torch.full((n_groups,), -float("inf"), dtype=shifted.dtype).scatter_reduce(
        0, inverse, shifted, reduce="amax", include_self=True)
    at_low = shifted == low[inverse]
    at_high = shifted == high[inverse]
    ones = torch.ones_like(shifted, dtype=torch.int64)
    n_low = torch.zeros(n_groups, dtype=torch.int64).index_add_(0, inverse, ones * at_low)[inverse]
    n_high = torch.zeros(n_groups, dtype=torch.int64).index_add_(0, inverse, ones * at_high)[inverse]
    size = torch.zeros(n_groups, dtype=torch.int64).index_add_(0, inverse, ones)[inverse]
    two_values = n_low + n_high == size
    return (high[inverse] == 0) | (two_values & ((at_low & (n_low == 1)) | (at_high & (n_high == 1))))


def post_process(raw_rewards: torch.Tensor, group_index: torch.Tensor, rule: GroupRule,
                 dtype: torch.dtype = torch.float32, scope_std: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reward.post_process under ``rule``: the group-normalized score, or the score itself (``dtype``), clamped
    to ``rule.clip`` when set; ``scope_std``: under ``std_scope="batch"`` the whole batch's std where
    ``raw_rewards`` are a selection of it (else taken of them)."""
    if not rule.center:
        out = raw_rewards.to(dtype).clone()
    else:
        out = group_normalize(raw_rewards, group_index, rule.std, rule.eps, dtype=dtype, unbiased=rule.unbiased,
                              baseline=rule.baseline, std_zero=rule.std_zero, singleton=rule.singleton,
                              std_scope=rule.std_scope, scope_std=scope_std)
    return out if rule.clip is None else torch.clamp(out, min=rule.clip[0], max=rule.clip[1])


def sequence_kl_score(raw_rewards: torch.Tensor, kl: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
                      kl_coef: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``kl_in_reward="sequence"`` (verl ``use_kl_in_reward``): each sample's score minus
    ``kl_coef·Σ_t kl_t·mask_t``, summed in token order; what the group then normalizes."""
    seg = segment_ids(lengths)
    penalty = segment_sum(kl.to(dtype) * loss_mask.to(dtype), seg, int(lengths.numel()))
    return raw_rewards.to(dtype) - kl_coef * penalty


def batch_normalize(raw_rewards: torch.Tensor, batch_size: int, std_normalization: bool, eps: float = STD_EPS) -> torch.Tensor:
    """The PR #65 bug, kept for fixtures and the example trainer's ``--pr65-bug`` flag: rewards are
    normalized against consecutive *physical* batches of ``batch_size`` samples instead of their group."""
    batch = torch.arange(raw_rewards.numel(), dtype=torch.int64) // max(int(batch_size), 1)
    return group_normalize(raw_rewards, batch, std_normalization, eps)


def _group_index(r: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(group of each sample 0 … k − 1, size of each sample's group, k)``."""
    _, inverse, counts = torch.unique(group_index.to(torch.int64), return_inverse=True, return_counts=True)
    return inverse, counts[inverse], counts.numel()


def group_centred(r: torch.Tensor, group_index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``r − mean(group)``, and ``r`` itself for a one-sample group (verl's and SkyRL's mean 0 there)."""
    r = r.to(dtype)
    if r.numel() == 0:
        return r.clone()
    inverse, size, _ = _group_index(r, group_index)
    _, _, centred, _ = group_moments(r, group_index, dtype, with_std=False)
    return torch.where(size == 1, r, centred)


def opo_rewards(r: torch.Tensor, group_index: torch.Tensor, token_counts: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """OPO (verl ``compute_opo_outcome_advantage``): ``r − Σ_j L_j·r_j / Σ_j L_j`` over the group, ``L`` each
    sample's loss-token count; a one-sample group keeps ``r`` (baseline 0). A group whose every sample has no
    loss token divides 0 by 0 (NaN), as verl does."""
    r = r.to(dtype)
    if r.numel() == 0:
        return r.clone()
    inverse, size, k = _group_index(r, group_index)
    length = token_counts.to(dtype)
    num = segment_sum(length * r, inverse, k)
    den = segment_sum(length, inverse, k)
    baseline = (num / den)[inverse]
    return torch.where(size == 1, r, r - baseline)


def gpg_alpha(r: torch.Tensor) -> float:
    """GPG's ``α = B / max(#{r ≠ 0}, 1)`` over the ``B`` scores of the whole step (verl ``compute_gpg_outcome_advantage``)."""
    return r.numel() / max(int(torch.count_nonzero(r)), 1)


def gpg_rewards(r: torch.Tensor, group_index: torch.Tensor, dtype: torch.dtype = torch.float32,
                alpha: Optional[float] = None) -> torch.Tensor:
    """GPG: ``α·(r − mean(group))`` (``f_norm`` 1), a one-sample group ``α·r``; ``alpha``: the whole step's when
    ``r`` is a selection of it (else :func:`gpg_alpha` of ``r``)."""
    a = gpg_alpha(r) if alpha is None else alpha
    return torch.tensor(a, dtype=dtype) * group_centred(r, group_index, dtype)


def passk_rewards(r: torch.Tensor, group_index: torch.Tensor, std_normalization: bool, eps: float = STD_EPS,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pass@k GRPO (verl ``compute_grpo_passk_outcome_advantage``): the group's best sample gets
    ``r_max − r_second`` (over the group's unbiased std + ``eps`` when ``std_normalization``), every other 0; a
    tie at the top gives 0 to all (whichever sample holds it). A one-sample group (verl raises): NaN."""
    r = r.to(dtype)
    out = torch.zeros_like(r)
    if r.numel() == 0:
        return out
    inverse, size, k = _group_index(r, group_index)
    order = torch.argsort(r, descending=True, stable=True)
    by_group = order[torch.argsort(inverse[order], stable=True)]  # each group's samples, best first
    starts = torch.cumsum(torch.bincount(inverse, minlength=k), 0) - torch.bincount(inverse, minlength=k)
    best = by_group[starts]
    counts = torch.bincount(inverse, minlength=k)
    second = by_group[torch.clamp(starts + 1, max=r.numel() - 1)]
    gap = r[best] - r[second]
    if std_normalization:
        _, _, _, std = group_moments(r, group_index, dtype, unbiased=True, with_std=True)
        std_g = torch.zeros(k, dtype=dtype).index_copy_(0, inverse, std)
        gap = gap / (std_g + eps)
    gap = torch.where(counts > 1, gap, torch.full_like(gap, float("nan")))
    out[best] = gap
    return torch.where(size == 1, torch.full_like(out, float("nan")), out)


def maxrl_rewards(r: torch.Tensor, group_index: torch.Tensor, eps: float = STD_EPS,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MaxRL (SkyRL ``compute_maxrl_advantage``): ``(r − mean)/(mean + eps)`` over the group; a one-sample group
    keeps ``r``."""
    r = r.to(dtype)
    if r.numel() == 0:
        return r.clone()
    inverse, size, k = _group_index(r, group_index)
    mean = (segment_sum(r, inverse, k) / torch.bincount(inverse, minlength=k).to(dtype))[inverse]
    return torch.where(size == 1, r, (r - mean) / (mean + eps))


def gdpo_rewards(components: torch.Tensor, group_index: torch.Tensor, rule: GroupRule,
                 weights: Optional[torch.Tensor] = None, standardize: bool = False,
                 dtype: torch.dtype = torch.float32, standardize_eps: Optional[float] = None) -> torch.Tensor:
    """GDPO: each reward component (``components[:, k]``) normalized by the group rule alone, ``Σ_k w_k·A_k``
    (verl ``compute_gdpo_outcome_advantage``, NeMo-RL ``GDPOAdvantageEstimator``); ``standardize``: that sum
    then standardized over the samples given (NeMo-RL: ``(A − mean)/std``, the unbiased std, centred only where
    it is 0; ``standardize_eps``: over ``std + standardize_eps`` always, TRL's ``normalize_then_sum``). verl
    whitens over the tokens instead, in advantage.estimate (``normalize_advantages``)."""
    c = components.to(dtype)
    n, k = c.shape if c.dim() == 2 else (c.numel(), 0)
    w = torch.ones(k, dtype=dtype) if weights is None else weights.to(dtype)
    total = torch.zeros(n, dtype=dtype)
    for j in range(k):
        total = total + w[j] * post_process(c[:, j], group_index, rule, dtype=dtype)
    if standardize and n:
        std = batch_std(total, unbiased=True)
        centred = total - total.mean()
        if standardize_eps is not None:
            total = centred / (std + standardize_eps)
        else:
            total = centred / std if float(std) > 0 else centred
    return total


def loss_span(loss_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """float64 ``[n]``: the span from each sample's first to its last loss token, both included (0 without one):
    OpenRLHF's ``response_length`` (samples_generator.py:272-273, ``ones[-1] − ones[0] + 1`` of the action mask)."""
    lengths = lengths.to(torch.int64)
    n = lengths.numel()
    if not n:
        return torch.zeros(0, dtype=torch.float64)
    seg = torch.repeat_interleave(torch.arange(n), lengths)
    pos = torch.arange(seg.numel(), dtype=torch.int64)
    on = loss_mask.reshape(-1) != 0
    big = torch.iinfo(torch.int64).max
    first = torch.full((n,), big, dtype=torch.int64).scatter_reduce(
        0, seg, torch.where(on, pos, torch.full_like(pos, big)), reduce="amin", include_self=True)
    last = torch.full((n,), -1, dtype=torch.int64).scatter_reduce(
        0, seg, torch.where(on, pos, torch.full_like(pos, -1)), reduce="amax", include_self=True)
    return torch.where(last >= 0, (last - first + 1).to(torch.float64), torch.zeros(n, dtype=torch.float64))


def shape_rewards(raw: torch.Tensor, span: torch.Tensor, truncated: Optional[torch.Tensor], *,
                  buffer: Optional[float] = None, factor: float = 1.0, max_tokens: Optional[int] = None,
                  coef: Optional[float] = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The raw reward after the length penalties (OpenRLHF ``apply_length_penalties``, length_penalty.py:16-145):
    the overlong penalty ``− min(L − (max_tokens − buffer), buffer)/buffer · factor`` where positive, ``L`` the
    sample's loss span (:func:`loss_span`); then each ``truncated`` sample's reward times ``coef`` (``coef ≥ 0``)
    or replaced by it (``coef < 0``)."""
    r = raw.to(dtype).clone()
    if buffer is not None:
        exceed = torch.clamp(span.to(torch.float64) - (max_tokens - buffer), max=buffer)
        penalty = torch.where(exceed > 0, -exceed / buffer * factor, torch.zeros_like(exceed))
        r = torch.where(exceed > 0, r + penalty.to(dtype), r)
    if coef is not None and truncated is not None:
        hit = truncated.to(torch.bool)
        r = torch.where(hit, torch.full_like(r, coef) if coef < 0 else r * coef, r)
    return r
