"""loss.grad kernels: the analytic gradient of the loss the step backpropagated with respect to each response
token's log-prob, ``g_t = ∂L/∂logp_t`` (SPEC §4.3), in the dtype of the call (float64 for the replay).

``L = grad_scale · loss_scale · Σ_i [W^pg_i · S^pg_i + kl_loss_coef · W^kl_i · S^kl_i]`` with ``S_i = Σ_t x_t·m_t``
the sample's masked sum of a term and ``W_i`` the weight of its aggregation mode (``kernels.loss.agg_weights``:
``1/(inner_i·outer)``, micro_batch_token_mean's included). The entropy term is not here: its gradient flows
through the logits, never through the sampled token's log-prob. So

    g_u = grad_scale · loss_scale · m_u · [W^pg_i · ∂S^pg_i/∂logp_u + kl_loss_coef · W^kl_i · ∂S^kl_i/∂logp_u]

**The policy term of the clipped family** (:func:`ppo_clip_grad`, ``kernels.loss.policy_token_terms``): with
``r = exp(lr)``, ``lr = clamp(logp − old, ±log_ratio_clamp)`` (``∂lr/∂logp = 1`` inside the clamp, 0 outside),
``pg = w·max(−r·A, −clip(r)·A)`` then dual-clip:

* ``∂pg/∂r = −A·w`` on the unclipped branch, 0 where the clip is active (``clip``: the clipped branch is the
  larger) and 0 where dual-clip's bound ``−c·A`` is taken (``clip_lower``); the two equal branches inside the
  clip range give ``−A·w`` either way (torch splits a tie of ``maximum`` half and half);
* ``w``, the train/rollout importance weight (TIS truncate or IcePop mask), is detached: a constant, never a
  gradient of its own (it depends on ``old`` and ``rollout`` only);
* per token (``importance_level="token"``): ``∂S^pg_i/∂logp_u = m_u·∂pg_u/∂r·r_u·∂lr_u/∂logp_u``;
* GSPO (``"sequence"``): one ratio per sample ``s_i = exp(clamp(Σ_t (logp − old)·m_t / n_i))``, so every token of
  the sample shares ``∂S^pg_i/∂logp_u = m_u·(s_i/n_i)·[|mean| ≤ clamp]·Σ_t m_t·∂pg_t/∂s``.

**The KL term** (:func:`kl_grad`): ``k(clamp(logp − ref, ±in))`` clamped to ``±out``: ``∂k/∂x`` = 1 (k1), ``x``
(k2), ``1 − exp(−x)`` (k3, low_var_kl, 0 where low_var_kl's ±10 clamp holds), ``sign(x)`` (abs), 0 wherever a
clamp holds; ratio-weighted (``kl·ratio``): ``∂k·r + k·∂r`` (the sample's ratio under GSPO: the ``k·∂s`` part
spreads over the sample's tokens like the policy term's).

**A loss family's gradient, one function** (:data:`GRAD_FAMILIES`): a family registers
``fn(inputs: GradInputs, knobs) -> GradTerms`` with :func:`register_grad`; ``GradTerms.pg`` is
``∂S^pg_i/∂logp_u`` per token (masked; the sample's sum of its policy term, before the aggregation weight), and
``GradTerms.branch`` (optional) a small int per token naming the branch it took (:data:`BRANCHES`) for the why
strip. The KL term, the aggregation weights and the scales are the family-independent part
(:func:`grad_log_probs`); :func:`grad_family` picks a family by the knobs' ``policy_loss`` (the clipped
surrogate when there is none). Every policy-loss family of ``kernels.families`` is registered to
:func:`family_grad`: its slope (``kernels.families.grad.SLOPES``, the family's stop-gradients) on the decisions
``kernels.loss.policy_token_terms`` takes, × the detached importance weight. OPSM, the entropy mask and is_keep
multiply any family's term (the clipped surrogate's too) by their 0/1 (:func:`shared_keep`: no gradient of their
own); on-policy distillation's loss term adds ``opd_coef·W^pg_i·∂k/∂x`` at ``x = logp − teacher``
(:func:`opd_grad`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..bundle.loss_knobs import LossKnobs
from .kl import KL_CLAMP
from .families.grad import SAMPLE_SLOPES, SLOPES
from .loss import agg_weights, importance_weight, policy_token_terms, sample_log_terms, wants_sample_pass
from .segments import segment_ids, segment_sum

# The branch each token's policy term took (GradTerms.branch): its coefficient in words (the why strip).
UNCLIPPED, CLIPPED, DUAL_CLIPPED, RATIO_CLAMPED, MASKED = 0, 1, 2, 3, 4
FAMILY_SLOPE, FAMILY_DECIDED, KEEP_DROPPED = 5, 6, 7
BRANCHES = {UNCLIPPED: "unclipped (∂pg/∂r = −A)", CLIPPED: "clipped (∂pg/∂r = 0)",
            DUAL_CLIPPED: "dual-clip bound −c·A (∂pg/∂r = 0)", RATIO_CLAMPED: "log-ratio clamped (∂r/∂logp = 0)",
            MASKED: "not a loss token",
            FAMILY_SLOPE: "the family's slope (kernels/families/grad.py, its stop-gradients)",
            FAMILY_DECIDED: "the family's clip or mask decision taken (its slope there)",
            KEEP_DROPPED: "dropped by OPSM, the entropy mask, is_keep or a MIS rejection (∂ = 0)"}


@dataclass(frozen=True)
class GradInputs:
    """What a family's gradient reads, float64 ``[tokens]`` each (``rollout``/``ref`` as the knobs need)."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    rollout_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None  # the entropy mask's input (top_entropy_quantile < 1)
    teacher_log_probs: Optional[torch.Tensor] = None  # on-policy distillation's loss term
    # per-sample terms (``kernels.loss.sample_log_terms``) of these samples taken over the whole step (a family's
    # micro-batch statistics, the entropy mask's thresholds); ``None``: taken of these tokens alone
    sample_terms: Optional[dict] = None
    # the policy-loss family's own per-token payloads by name (``kernels.families.token_payloads``: clip_cov_mask)
    family_tokens: Optional[dict] = None
    # slime's MIS rejection (mis_rs, mis_veto): 0/1 per token multiplying every term's numerator, while the
    # aggregation weights and a sample's own statistics (GSPO's mean log-ratio) keep ``mask``; ``None``: all kept
    keep: Optional[torch.Tensor] = None
    # ``keep`` with its decisions within rounding of a bound taken the other way (stages.grad's bound reads it)
    keep_alternative: Optional[torch.Tensor] = None

    @property
    def seg(self) -> torch.Tensor:
        return segment_ids(self.lengths)

    @property
    def numerator(self) -> torch.Tensor:
        """The mask of every term's numerator: ``mask × keep`` (slime's MIS rejection), else ``mask``."""
        return self.mask if self.keep is None else self.mask * self.keep


@dataclass
class GradTerms:
    """A family's part: ``pg`` = ∂S^pg_i/∂logp_u per token (masked), ``branch`` its branch per token, and what the
    shared part reuses: ``ratio`` (the ratio a ratio-weighted KL term takes, per token), ``seq`` (GSPO's
    ``∂s_i/∂logp_u / s_i`` per token, when the ratio is a sample's), ``weight`` the detached importance weight."""

    pg: torch.Tensor
    branch: Optional[torch.Tensor] = None
    ratio: Optional[torch.Tensor] = None
    seq: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    # a family's own rounding scale of ``pg`` per token in units of the unit roundoff (``None``: the clipped
    # surrogate's, derived in stages.grad), its decisions' ``edge_gap`` (kernels.families) and ``open`` (|∂S/∂logp|
    # had that decision gone the other way)
    err: Optional[torch.Tensor] = None
    edge_gap: Optional[torch.Tensor] = None
    open: Optional[torch.Tensor] = None
    # the 0/1 masks the knobs multiply the policy term by (OPSM, the entropy mask, is_keep), their product, and
    # ``pg`` before them (× the weight): what a mask decision at its edge leaves open
    keep: Optional[torch.Tensor] = None
    unmasked: Optional[torch.Tensor] = None
    columns: Optional[dict] = None  # the float64 token terms the masks were taken of (opsm_seq_kl, entropy, …)


GradFn = Callable[[GradInputs, LossKnobs], GradTerms]
GRAD_FAMILIES: dict[str, GradFn] = {}


def register_grad(family: str) -> Callable[[GradFn], GradFn]:
    """Register ``fn`` as the analytic policy-term gradient of loss family ``family`` (module doc)."""
    def deco(fn: GradFn) -> GradFn:
        GRAD_FAMILIES[family] = fn
        return fn
    return deco


PPO_CLIP = "ppo_clip"


def grad_family(knobs: LossKnobs) -> str:
    """The loss family whose gradient the knobs ask for: ``knobs.policy_loss`` when a family registry sets one,
    else the clipped surrogate (every knob of SPEC §4.2)."""
    family = getattr(knobs, "policy_loss", None)
    return PPO_CLIP if family in (None, "", "ppo") else family


def _inside(x: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    """``∂clamp(x, ±bound)/∂x``: 1 inside the closed interval (torch's clamp passes the gradient at the edge)."""
    if bound is None:
        return torch.ones_like(x)
    return (x.abs() <= bound).to(x.dtype)


def importance_weights(gi: GradInputs, knobs: LossKnobs, dtype=torch.float64) -> Optional[torch.Tensor]:
    """The detached train/rollout weight per token (``kernels.loss.importance_weight``), ``None`` without one."""
    if knobs.is_level is None:
        return None
    if knobs.is_level == "token":
        log_w = gi.old_log_probs - gi.rollout_log_probs
    else:
        terms = sample_log_terms(gi.log_probs, gi.old_log_probs, gi.rollout_log_probs, gi.mask, gi.lengths, knobs,
                                 dtype=dtype)
        log_w = terms["is_log_weight"][gi.seg]
    return importance_weight(log_w, knobs)


def _surrogate_slope(ratio: torch.Tensor, adv: torch.Tensor, knobs: LossKnobs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(∂pg/∂r before the weight, branch)`` of ``max(−r·A, −clip(r)·A)`` and dual-clip."""
    neg = -adv
    l1 = ratio * neg
    l2 = ratio.clamp(1 - knobs.eps_clip, 1 + knobs.eps_clip_high) * neg
    clip = l2 > l1
    slope = torch.where(clip, torch.zeros_like(neg), neg)
    branch = clip.to(torch.int8)
    if knobs.dual_clip:
        lower = (torch.maximum(l1, l2) > -float(knobs.eps_clip_c) * adv) & (adv < 0)
        slope = torch.where(lower, torch.zeros_like(slope), slope)
        branch = torch.where(lower, torch.full_like(branch, DUAL_CLIPPED), branch)
    return slope, branch


@register_grad(PPO_CLIP)
def ppo_clip_grad(gi: GradInputs, knobs: LossKnobs) -> GradTerms:
    """The clipped surrogate's ``∂S^pg_i/∂logp_u`` (module doc): token or sequence (GSPO) ratio, dual-clip, the
    log-ratio clamp, the detached importance weight."""
    m = gi.mask
    d = gi.log_probs - gi.old_log_probs
    w = importance_weights(gi, knobs)
    keep, columns = shared_keep(gi, knobs)
    if keep is not None:  # OPSM, the entropy mask, is_keep: 0/1 constants on the (weighted) term
        w = keep if w is None else w * keep
    if knobs.sequence_ratio:
        seg = gi.seg
        n = torch.clamp_min(segment_sum(m, seg, gi.lengths.numel()), 1.0)
        mean = segment_sum(d * m, seg, gi.lengths.numel()) / n
        lr = mean.clamp(-knobs.log_ratio_clamp, knobs.log_ratio_clamp) if knobs.log_ratio_clamp is not None else mean
        s = lr.exp()
        inside = _inside(mean, knobs.log_ratio_clamp)
        ratio = s[seg]
        slope, branch = _surrogate_slope(ratio, gi.advantages, knobs)
        if w is not None:
            slope = slope * w
        total = segment_sum(slope * gi.numerator, seg, gi.lengths.numel())  # Σ_t m_t·∂pg_t/∂s
        seq = (inside / n)[seg] * m  # ∂s_i/∂logp_u / s_i
        pg = total[seg] * ratio * seq
        branch = torch.where(inside[seg] == 0, torch.full_like(branch, RATIO_CLAMPED), branch)
    else:
        seq = None
        inside = _inside(d, knobs.log_ratio_clamp)
        lr = d if knobs.log_ratio_clamp is None else d.clamp(-knobs.log_ratio_clamp, knobs.log_ratio_clamp)
        ratio = lr.exp()
        slope, branch = _surrogate_slope(ratio, gi.advantages, knobs)
        if w is not None:
            slope = slope * w
        pg = slope * ratio * inside * gi.numerator
        branch = torch.where((inside == 0) & (branch == UNCLIPPED), torch.full_like(branch, RATIO_CLAMPED), branch)
        if gi.keep is not None:  # a token slime's MIS rejection dropped: no term of its own
            branch = torch.where(gi.keep == 0, torch.full_like(branch, KEEP_DROPPED), branch)
    if keep is not None:
        branch = torch.where(keep == 0, torch.full_like(branch, KEEP_DROPPED), branch)
    branch = torch.where(m == 0, torch.full_like(branch, MASKED), branch)
    weight = importance_weights(gi, knobs) if keep is not None else w
    unmasked = None
    if keep is not None:  # the term had no mask dropped it: |∂S/∂logp| before the masks
        if knobs.sequence_ratio:  # the sample's slopes summed without the masks
            from dataclasses import replace

            plain = replace(knobs, opsm_delta=None, top_entropy_quantile=1.0, is_keep=())
            unmasked = ppo_clip_grad(replace(gi, sample_terms=None), plain).pg.abs()
        else:
            unmasked = (_surrogate_slope(ratio, gi.advantages, knobs)[0] * ratio * inside * gi.numerator
                        * (weight if weight is not None else 1.0)).abs()
    return GradTerms(pg=pg, branch=branch, ratio=ratio, seq=seq, weight=weight, keep=keep, unmasked=unmasked,
                     columns=columns)


def _sample_terms(gi: GradInputs, knobs: LossKnobs) -> Optional[dict]:
    """The per-sample terms the knobs need (``gi.sample_terms``, else of ``gi``'s own samples), ``None`` for none."""
    if gi.sample_terms is not None:
        return gi.sample_terms
    if not wants_sample_pass(knobs):
        return None
    return sample_log_terms(gi.log_probs, gi.old_log_probs, gi.rollout_log_probs, gi.mask, gi.lengths, knobs,
                            dtype=gi.log_probs.dtype, entropy=gi.entropy, advantages=gi.advantages,
                            family_tokens=gi.family_tokens)


def _token_terms(gi: GradInputs, knobs: LossKnobs, sample_terms) -> dict:
    """``kernels.loss.policy_token_terms`` of ``gi`` in its dtype: the decisions loss.policy takes."""
    return policy_token_terms(gi.log_probs, gi.old_log_probs, gi.advantages, knobs, seg=gi.seg,
                              sample_terms=sample_terms, rollout_log_probs=gi.rollout_log_probs,
                              ref_log_probs=None, dtype=gi.log_probs.dtype, entropy=gi.entropy,
                              teacher_log_probs=gi.teacher_log_probs, family_tokens=gi.family_tokens)


def _keep_of(t: dict) -> Optional[torch.Tensor]:
    keep = None
    for name in ("opsm_keep", "entropy_keep", "is_keep"):
        if name in t:
            keep = t[name] if keep is None else keep * t[name]
    return keep


def shared_keep(gi: GradInputs, knobs: LossKnobs) -> tuple[Optional[torch.Tensor], Optional[dict]]:
    """``(keep, columns)``: the product of the 0/1 masks OPSM, the entropy mask and is_keep multiply the policy
    term by (each a decision, never a gradient of its own), ``None`` without one; ``columns`` the token terms."""
    if not (knobs.opsm or knobs.entropy_mask or knobs.is_keep):
        return None, None
    from dataclasses import replace

    # the masks only: the clipped surrogate's own columns are not needed (no KL term, no distillation term)
    plain = replace(knobs, kl_loss_coef=0.0, opd_placement=None)
    t = _token_terms(gi, plain, _sample_terms(gi, plain))
    return _keep_of(t), t


def family_grad(gi: GradInputs, knobs: LossKnobs) -> GradTerms:
    """A policy-loss family's ``∂S^pg_i/∂logp_u`` (``kernels.families.grad``: the family's slope with its
    stop-gradients, × OPSM's, the entropy mask's and is_keep's 0/1 and the detached importance weight)."""
    from dataclasses import replace

    plain = replace(knobs, kl_loss_coef=0.0, opd_placement=None)
    st = _sample_terms(gi, plain)
    t = _token_terms(gi, plain, st)
    name = knobs.policy_loss
    extra = dict(sample_terms=st, seg=gi.seg, mask=gi.mask) if name in SAMPLE_SLOPES else {}
    slope, err, open_ = SLOPES[name](t, gi.log_probs, gi.old_log_probs, gi.advantages, gi.rollout_log_probs,
                                     knobs, **extra)
    m = gi.mask
    w = t.get("is_weight")
    keep = _keep_of(t)
    num = gi.numerator
    factor = num if w is None else num * w
    unmasked = slope * factor
    pg = unmasked if keep is None else unmasked * keep
    err = err * factor.abs()
    if keep is not None:
        err = err * keep
    if open_ is not None:
        open_ = open_ * factor.abs() * (keep if keep is not None else 1.0)
    branch = torch.full_like(m, FAMILY_SLOPE, dtype=torch.int8)
    if "clipcov_ppo_clip" in t:  # Clip-Cov: PPO's clipped branch (∂pg/∂r = 0)
        branch = torch.where(t["clipcov_ppo_clip"] > 0, torch.full_like(branch, CLIPPED), branch)
    if "clip" in t:
        branch = torch.where(t["clip"] > 0, torch.full_like(branch, FAMILY_DECIDED), branch)
    if keep is not None:
        branch = torch.where(keep == 0, torch.full_like(branch, KEEP_DROPPED), branch)
    if gi.keep is not None:
        branch = torch.where(gi.keep == 0, torch.full_like(branch, KEEP_DROPPED), branch)
    branch = torch.where(m == 0, torch.full_like(branch, MASKED), branch)
    ratio = t["ratio"]
    # a family whose gradient has decisions its loss value does not (Clip-Cov: PPO's clip) names their edges apart
    gap = t.get("grad_edge_gap", t.get("edge_gap"))
    return GradTerms(pg=pg, branch=branch, ratio=ratio, weight=w, err=err, edge_gap=gap, open=open_,
                     keep=keep, unmasked=unmasked.abs() if keep is not None else None, columns=t)


for _name in SLOPES:
    register_grad(_name)(family_grad)


def kl_value_and_slope(x: torch.Tensor, knobs: LossKnobs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, ∂k/∂x)`` of the KL term at ``x = logp − ref`` with its clamps (module doc)."""
    xc = x if knobs.kl_loss_input_clamp is None else x.clamp(-knobs.kl_loss_input_clamp, knobs.kl_loss_input_clamp)
    kind = knobs.kl_loss_type
    if kind == "k1":
        k, dk = xc, torch.ones_like(xc)
    elif kind == "k2":
        k, dk = xc * xc / 2.0, xc.clone()
    elif kind == "abs":
        k, dk = xc.abs(), torch.sign(xc)
    else:
        e = (-xc).exp()
        k, dk = e - 1 + xc, 1 - e
        if kind == "low_var_kl":
            dk = dk * _inside(k, KL_CLAMP)
            k = k.clamp(-KL_CLAMP, KL_CLAMP)
    dk = dk * _inside(x, knobs.kl_loss_input_clamp)
    if knobs.kl_loss_output_clamp is not None:
        dk = dk * _inside(k, knobs.kl_loss_output_clamp)
        k = k.clamp(-knobs.kl_loss_output_clamp, knobs.kl_loss_output_clamp)
    return k, dk


def rollout_weighted_kl(gi: GradInputs, knobs: LossKnobs) -> dict[str, torch.Tensor]:
    """``kl_loss_rollout_weighted`` (NeMo-RL's ``use_on_policy_kl_approximation``): ``clamp(w·k(x), ±out)`` with
    ``x = logp − ref`` input-clamped, ``w = exp(logp − rollout)`` (a non-finite weight 0). The weight is not
    detached: NVIDIA-NeMo/RL @ 7ea279ab ``nemo_rl/algorithms/loss/loss_functions.py:477-493`` takes it from
    ``curr_logprobs_unfiltered`` without a detach (the score-function gradient of the sampling probability), and
    ``nemo_rl/algorithms/utils.py:72-81`` detaches it only where the input clamp holds (× then clamp, :95-99); ``nan_to_num`` passes no
    gradient at a non-finite weight. So ``∂/∂logp = [|w·k| ≤ out]·w·(∂k/∂x + k·[|x| ≤ in])``.

    Returns ``k`` (input-clamped, before the weight), ``dk`` (its slope, 0 where the input clamp holds), ``w``,
    ``log_w`` (``logp − rollout``), ``value`` (``w·k`` before the output clamp) and ``slope`` (the term's).

    ``kl_loss_score_function`` (NeMo-RL's KL term without the approximation, ``loss_functions.py:487-490``:
    ``exp(curr − curr.detach())``) is the same with ``w = 1``: ``∂/∂logp = [|k| ≤ out]·(∂k/∂x + k·[|x| ≤ in])``."""
    from dataclasses import replace

    x = gi.log_probs - gi.ref_log_probs
    k, dk = kl_value_and_slope(x, replace(knobs, kl_loss_output_clamp=None))
    if not knobs.kl_loss_rollout_weighted:  # kl_loss_score_function: exp(logp − sg(logp)), 1 with gradient 1
        log_w = torch.zeros_like(x)
    elif gi.rollout_log_probs is None:
        raise ValueError("rollout_log_probs is required for kl_loss_rollout_weighted")
    else:
        log_w = gi.log_probs - gi.rollout_log_probs
    raw = log_w.exp()
    w = torch.where(torch.isfinite(raw), raw, torch.zeros_like(raw))
    value = w * k
    slope = w * (dk + k * _inside(x, knobs.kl_loss_input_clamp)) * _inside(value, knobs.kl_loss_output_clamp)
    return dict(k=k, dk=dk, w=w, log_w=log_w, value=value, slope=slope)


def kl_grad(gi: GradInputs, knobs: LossKnobs, terms: GradTerms) -> torch.Tensor:
    """``∂S^kl_i/∂logp_u`` per token (masked): the KL term's slope, with ``kl_loss_ratio_weighted`` the product
    rule over the ratio (the sample's under GSPO), with ``kl_loss_rollout_weighted`` over its weight
    (:func:`rollout_weighted_kl`)."""
    m = gi.numerator
    if knobs.kl_loss_rollout_weighted or knobs.kl_loss_score_function:
        return rollout_weighted_kl(gi, knobs)["slope"] * m
    k, dk = kl_value_and_slope(gi.log_probs - gi.ref_log_probs, knobs)
    if not knobs.kl_loss_ratio_weighted:
        return dk * m
    ratio = terms.ratio
    own = dk * ratio * m
    if terms.seq is not None:  # k_t·s_i: Σ_t m_t·k_t·∂s_i/∂logp_u
        seg = gi.seg
        total = segment_sum(k * m, seg, gi.lengths.numel())
        return own + total[seg] * ratio * terms.seq
    d = gi.log_probs - gi.old_log_probs
    return own + k * ratio * _inside(d, knobs.log_ratio_clamp) * m


@dataclass
class Gradient:
    """:func:`grad_log_probs`' result, float64 ``[tokens]`` each: ``grad`` (g_u), its ``pg`` and ``kl`` parts (each
    with its weight and scales), the ``pg_weight``/``kl_weight`` per token (``grad_scale·loss_scale·W_i``, the
    KL's × kl_loss_coef) and the family's :class:`GradTerms`."""

    grad: torch.Tensor
    pg: torch.Tensor
    kl: torch.Tensor
    pg_weight: torch.Tensor
    kl_weight: torch.Tensor
    terms: GradTerms
    opd: Optional[torch.Tensor] = None  # on-policy distillation's loss term (opd_placement="loss"), weighted


def grad_scale_of(cfg) -> float:
    """The recorded ``grad_scale`` (1.0 when unset)."""
    value = getattr(cfg, "grad_scale", 1.0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0


def sample_weights(mask_counts: torch.Tensor, knobs: LossKnobs, grad_scale: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W^pg, W^kl)`` float64 per sample: ``grad_scale·loss_scale·w_i`` of the policy term's mode and
    ``× kl_loss_coef`` of the KL term's (``kernels.loss.agg_weights``; ``mask_counts`` every sample's Σ_t mask,
    the whole step's: micro_batch_token_mean's partition counts a micro-batch's tokens)."""
    scale = grad_scale * knobs.loss_scale
    pg = agg_weights(knobs.loss_agg_mode, mask_counts, knobs) * scale
    kl = agg_weights(knobs.kl_mode, mask_counts, knobs) * (scale * knobs.kl_loss_coef) if knobs.kl_loss \
        else torch.zeros_like(pg)
    return pg, kl


def sample_chunks(lengths: torch.Tensor, tokens: int) -> list[tuple[int, int, int, int]]:
    """``[(first sample, end sample, first token, end token)]``: runs of whole samples of about ``tokens`` tokens
    (a longer sample alone) — the gradient of a sample (GSPO's) needs all of its tokens at once."""
    out = []
    ends = torch.cumsum(lengths, 0).tolist()
    s0 = t0 = 0
    n = len(ends)
    while s0 < n:
        s1 = s0 + 1
        while s1 < n and ends[s1] - t0 <= tokens:
            s1 += 1
        out.append((s0, s1, t0, ends[s1 - 1]))
        s0, t0 = s1, ends[s1 - 1]
    return out


def grad_log_probs(gi: GradInputs, knobs: LossKnobs, grad_scale: float = 1.0,
                   weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Gradient:
    """``g_u = ∂L/∂logp_u`` (module doc), in the dtype of ``gi``'s tensors. ``weights``: :func:`sample_weights` of
    ``gi``'s samples when ``gi`` is a run of the step's samples (the aggregation weights are the whole step's);
    else they are taken of ``gi``'s own counts."""
    family = grad_family(knobs)
    fn = GRAD_FAMILIES.get(family)
    if fn is None:
        raise ValueError(f"no analytic gradient is registered for loss family {family!r}")
    terms = fn(gi, knobs)
    seg = gi.seg
    if weights is None:
        weights = sample_weights(segment_sum(gi.mask, seg, gi.lengths.numel()), knobs, grad_scale)
    pg_weight = weights[0].to(gi.mask.dtype)[seg]
    pg = terms.pg * pg_weight
    if knobs.kl_loss:
        kl_weight = weights[1].to(gi.mask.dtype)[seg]
        kl = kl_grad(gi, knobs, terms) * kl_weight
    else:
        kl_weight = torch.zeros_like(pg)
        kl = torch.zeros_like(pg)
    grad = pg + kl
    opd = None
    if knobs.opd_loss:
        opd = opd_grad(gi, knobs) * pg_weight * knobs.opd_coef
        grad = grad + opd
    return Gradient(grad=grad, pg=pg, kl=kl, pg_weight=pg_weight, kl_weight=kl_weight, terms=terms, opd=opd)


def opd_knobs(knobs: LossKnobs) -> LossKnobs:
    """The distillation term as a KL term: ``opd_kl_type`` of ``logp − teacher``, its value clamped ±opd_clamp."""
    from dataclasses import replace

    return replace(knobs, kl_loss_type=knobs.opd_kl_type, kl_loss_input_clamp=None,
                   kl_loss_output_clamp=knobs.opd_clamp)


def opd_grad(gi: GradInputs, knobs: LossKnobs) -> torch.Tensor:
    """``∂S^opd_i/∂logp_u`` per token (masked): the estimate's slope at ``logp − teacher`` (aggregated as the
    policy term, ``kernels.loss.field_aggregation``)."""
    if gi.teacher_log_probs is None:
        raise ValueError("teacher_log_probs is required for opd_placement='loss'")
    return kl_value_and_slope(gi.log_probs - gi.teacher_log_probs, opd_knobs(knobs))[1] * gi.numerator
