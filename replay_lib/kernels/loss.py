"""loss.policy and loss.value kernels: the clipped surrogate with the loss-side knobs of SPEC §4.2, and the
aggregation of per-sample sums into the reported fields.

One formula per token, in the dtype of its inputs (float32 for a producer, float64 for the replay):

* ``Δ = logp − old`` (clamped to ``±log_ratio_clamp`` when set, as verl does), ``ppo_kl = −Δ``;
* the ratio ``exp(Δ)`` (``importance_level="token"``), or per sample ``s_i = exp(Σ_t Δ·mask / n_i)`` (GSPO,
  ``"sequence"``: the log-ratio clamp then applies to that mean, and ``ppo_kl`` is the token log-ratio as
  verl's ``compute_policy_loss_gspo`` reports it);
* ``l1 = −ratio·A``, ``l2 = −clamp(ratio, 1 − eps_clip, 1 + eps_clip_high)·A``, ``pg = max(l1, l2)``,
  ``clip = l2 > l1``; dual-clip (``eps_clip_c = c``): ``pg = where(A < 0, min(pg, −c·A), pg)`` and
  ``clip_lower = (pg > −c·A) ∧ (A < 0)`` before the min (verl's ``pg_clipfrac_lower``);
* train/rollout importance correction ``w`` (a constant): the log weight ``old − rollout`` per token (``token``),
  summed (``sequence``) or averaged (``geometric``) over the sample's loss tokens, clamped to
  ``±is_log_clamp`` when set; ``w = exp(·)``; ``truncate``: ``clamp(w, is_low, is_high)``; ``mask``
  (IcePop): ``w·1[is_low ≤ w ≤ is_high]`` (a missing bound is no bound); ``pg ← w·pg``;
* the KL term of the loss on the current log-probs: ``r = logp − ref`` (clamped to ``±kl_loss_input_clamp``),
  the estimator ``kl_loss_type`` (``kl.compute_approx_kl``), clamped to ``±kl_loss_output_clamp``, and with
  ``kl_loss_ratio_weighted`` multiplied by the unclipped ratio (the token's, or the sample's under GSPO); with
  ``kl_loss_rollout_weighted`` the estimate (input-clamped) × ``exp(logp − rollout)`` (a non-finite weight 0),
  then clamped to ``±kl_loss_output_clamp`` (NeMo-RL ``calculate_kl`` with ``importance_sampling_weights``);
* ``force_on_policy_ratio``: the old log-probs are the current ones (the stage passes ``log_probs`` as ``old``).

Aggregation (:func:`aggregate`): a field is ``loss_scale · Σ_i w_i Σ_t x·mask`` with ``w_i`` from the mode,
``n_i = Σ_t mask``: ``1/max(n_i,1)`` (sum_of_sample_means) · ``1/(N·max(n_i,1))`` (seq_mean_token_mean) ·
``1/T`` (token_mean) · ``1/N`` (seq_mean_token_sum) · ``1/(N·L)`` (seq_mean_token_sum_norm) · ``1`` (token_sum) ·
``1/(K·T_b)`` (micro_batch_token_mean: ``T_b`` the loss tokens of the sample's micro-batch, ``K`` the micro-batches
— the mean of per-micro-batch token means, ``LossKnobs.micro_batch``), evaluated as
``(Σ_i S_i / inner_i) / outer`` — the per-sample division of slime, the global division of verl. ``T``, ``N``,
``L`` are the producer's recorded counts. The loss terms (pg_loss, entropy_loss, kl_loss, vf_loss) use
``loss_agg_mode`` (the KL and entropy terms ``kl_loss_agg_mode`` / ``entropy_agg_mode`` when set) and carry
``loss_scale``; the metrics (pg_clipfrac, pg_clipfrac_lower, ppo_kl, vf_clipfrac)
use ``metric_agg_mode`` and are not scaled (verl multiplies its loss by the dp size, never its metrics).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Mapping, Optional

import torch

from ..bundle.loss_knobs import (AGG_COUNTS, AGG_MODES, IMPORTANCE_LEVELS, IS_LEVELS, IS_MODES, MICRO_BATCH_TOKEN_MEAN,
                          PROMPT_MEAN, SUM_OF_SAMPLE_MEANS, LossKnobs, check_knobs)  # noqa: F401  (re-exported)
from .families import family as policy_family, slice_tokens, token_payloads
from .kl import compute_approx_kl
from .segments import masked_sample_sums, segment_sum
# (the knobs and their allowed values live in replay_lib.bundle.loss_knobs, torch-free: the schema checks them)

def _clamp(x: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    return x if bound is None else x.clamp(-bound, bound)


def compute_policy_loss(
    ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate: ``(pg_losses, clipfrac)`` with ``ppo_kl = old − logp``, in the dtype of
    ``ppo_kl``."""
    pg_losses, clipfrac, _ = policy_loss_terms(ppo_kl, advantages, eps_clip, eps_clip_high)
    return pg_losses, clipfrac


def policy_loss_terms(
    ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`compute_policy_loss` and the ratio ``exp(−ppo_kl)`` it took: ``(pg_losses, clipfrac, ratio)``."""
    return surrogate_terms((-ppo_kl).exp(), advantages, eps_clip, eps_clip_high)


def surrogate_terms(ratio: torch.Tensor, advantages: torch.Tensor, eps_clip: float,
                    eps_clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`policy_loss_terms` of the ratio itself: ``max(−r·A, −clip(r)·A)``. ``−r·A`` is computed as
    ``r·(−A)``, one negation for both products: IEEE products are sign-symmetric, so every bit is the same."""
    neg_adv = -advantages
    pg_losses1 = ratio * neg_adv
    pg_losses2 = ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * neg_adv
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).to(ratio.dtype)
    return pg_losses, clipfrac, ratio


def dual_clip(pg_losses: torch.Tensor, advantages: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO: ``(where(A < 0, min(pg, −c·A), pg), clip_lower)``, ``clip_lower = (pg > −c·A) ∧ (A < 0)``
    (1/0 in the dtype of ``pg_losses``)."""
    l3 = -c * advantages
    negative = advantages < 0
    lower = torch.gt(pg_losses, l3) & negative
    return torch.where(negative, torch.minimum(pg_losses, l3), pg_losses), lower.to(pg_losses.dtype)


def importance_weight(log_weight: torch.Tensor, knobs: LossKnobs) -> torch.Tensor:
    """``w`` from its log (per token, already summed or averaged for a sequence or geometric level):
    ``exp`` of the log clamped to ``±is_log_clamp``, then truncated or masked to ``[is_low, is_high]``, then
    divided by the recorded batch mean when the knobs normalize (``is_norm``)."""
    w = _clamp(log_weight, knobs.is_log_clamp).exp()
    if knobs.is_mode == "truncate":
        if knobs.is_low is not None or knobs.is_high is not None:
            w = w.clamp(min=knobs.is_low, max=knobs.is_high)
        return _normalized(w, knobs)
    keep = torch.ones_like(w, dtype=torch.bool)
    if knobs.is_low is not None:
        keep &= w >= knobs.is_low
    if knobs.is_high is not None:
        keep &= w <= knobs.is_high
    return _normalized(w * keep.to(w.dtype), knobs)


def _normalized(w: torch.Tensor, knobs: LossKnobs) -> torch.Tensor:
    """``w`` divided by the recorded batch mean of the corrected weights (verl ``rollout_is_batch_normalize``,
    ``rollout_corr_helper.py:627-655``, after the truncation or mask), when the knobs normalize."""
    return w if knobs.is_norm is None else w / knobs.is_norm


def kl_loss_values(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, knobs: LossKnobs,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The KL term of the loss per token: ``kl(logp, ref)`` with the input and output clamps."""
    if knobs.kl_loss_input_clamp is None:
        kl = compute_approx_kl(log_probs, ref_log_probs, knobs.kl_loss_type, dtype=dtype)
    else:
        r = _clamp(log_probs.to(dtype) - ref_log_probs.to(dtype), knobs.kl_loss_input_clamp)
        kl = compute_approx_kl(r, torch.zeros_like(r), knobs.kl_loss_type, dtype=dtype)
    return _clamp(kl, knobs.kl_loss_output_clamp)


def family_sample_pass(knobs: LossKnobs) -> bool:
    """The configured policy-loss family needs per-sample quantities before its token terms."""
    return knobs.policy_loss != "ppo" and policy_family(knobs.policy_loss).sample_terms is not None


def wants_sample_pass(knobs: LossKnobs) -> bool:
    """A per-sample quantity is needed before the per-token terms: the knobs' own (GSPO, a sequence IS weight),
    a family's ``sample_terms``, OPSM's sequence KL or the entropy mask's threshold."""
    return knobs.needs_sample_pass or knobs.opsm or knobs.entropy_mask or family_sample_pass(knobs)


def sample_log_terms(log_probs: torch.Tensor, old_log_probs: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
                     loss_mask: torch.Tensor, lengths: torch.Tensor, knobs: LossKnobs,
                     dtype: torch.dtype = torch.float32, entropy: Optional[torch.Tensor] = None, *,
                     advantages: Optional[torch.Tensor] = None,
                     family_tokens: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """The per-sample quantities the per-token terms need first (``[n]`` each, ``{}`` when none is):
    ``seq_log_ratio`` (GSPO, ``Σ_t (logp − old)·mask / max(n_i, 1)``, clamped) and ``is_log_weight``
    (``Σ_t (old − rollout)·mask``, divided by ``max(n_i, 1)`` for ``geometric``); the policy-loss family's own
    (``families.PolicyFamily.sample_terms``, given the ``advantages``); ``opsm_kl`` (OPSM: ``Σ_t (anchor −
    logp)·mask / max(n_i, 1)``); ``entropy_threshold`` (the entropy mask: the quantile of the sample's
    micro-batch, ``entropy`` needed). ``family_tokens``: the family's own per-token payloads by name
    (``families.token_payloads``, e.g. ``clip_cov_mask``)."""
    out = {}
    if family_sample_pass(knobs):
        out.update(policy_family(knobs.policy_loss).sample_terms(log_probs, old_log_probs, rollout_log_probs,
                                                                 loss_mask, lengths, knobs, dtype,
                                                                 advantages=advantages,
                                                                 **_family_extras(knobs, family_tokens, loss_mask,
                                                                                  lengths)))
    if knobs.is_keep_sample:  # the off-policy correction's per-sample keep masks (kernels.is_keep)
        if rollout_log_probs is None:
            raise ValueError("rollout_log_probs is required for is_keep")
        from .is_keep import sample_keep

        out.update(sample_keep(old_log_probs, rollout_log_probs, loss_mask, lengths, knobs.is_keep, dtype,
                               _stat_dtype(knobs)))
    if knobs.opsm:
        out["opsm_kl"] = opsm_sequence_kl(log_probs, old_log_probs, rollout_log_probs, loss_mask, lengths, knobs,
                                          dtype)
    if knobs.entropy_mask:
        if entropy is None:
            raise ValueError("entropy is required for top_entropy_quantile < 1")
        out["entropy_threshold"] = entropy_thresholds(entropy, loss_mask, lengths, knobs, dtype)
    if not (knobs.sequence_ratio or knobs.is_level in ("sequence", "geometric")):
        return out
    mask = loss_mask.to(dtype)
    want_is = knobs.is_level in ("sequence", "geometric")
    if want_is and rollout_log_probs is None:
        raise ValueError(f"rollout_log_probs is required for is_level={knobs.is_level!r}")

    def columns(start: int, stop: int, seg: torch.Tensor) -> dict[str, torch.Tensor]:
        m = mask[start:stop]
        out = {"mask": m}
        if knobs.sequence_ratio:
            out["lr"] = (log_probs[start:stop].to(dtype) - old_log_probs[start:stop].to(dtype)) * m
        if want_is:
            out["is"] = (old_log_probs[start:stop].to(dtype) - rollout_log_probs[start:stop].to(dtype)) * m
        return out

    names = ["mask"] + (["lr"] if knobs.sequence_ratio else []) + (["is"] if want_is else [])
    sums = masked_sample_sums(lengths, loss_mask, columns, {k: dtype for k in names})
    n = torch.clamp_min(sums["mask"], 1.0)
    if knobs.sequence_ratio:
        out["seq_log_ratio"] = _clamp(sums["lr"] / n, knobs.log_ratio_clamp)
    if want_is:
        out["is_log_weight"] = sums["is"] / n if knobs.is_level == "geometric" else sums["is"]
    return out


def policy_token_terms(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                       knobs: LossKnobs, *, seg: Optional[torch.Tensor] = None,
                       sample_terms: Optional[Mapping[str, torch.Tensor]] = None,
                       rollout_log_probs: Optional[torch.Tensor] = None,
                       ref_log_probs: Optional[torch.Tensor] = None,
                       dtype: torch.dtype = torch.float32, entropy: Optional[torch.Tensor] = None,
                       teacher_log_probs: Optional[torch.Tensor] = None,
                       family_tokens: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """The per-token terms of one run of tokens, in ``dtype`` (module docstring): ``pg`` (after dual-clip and
    the importance weight), ``clip``, ``ppo_kl``, ``ratio`` (the one clipped), ``log_ratio`` (its log), and as
    the knobs ask ``clip_lower``, ``is_weight``, ``kl_loss``. ``seg``: the sample of each token (an index into
    ``sample_terms``' per-sample values, :func:`sample_log_terms`), needed by the per-sample knobs.

    Another family (``knobs.policy_loss``) computes ``pg`` and its columns (``kernels.families``); then OPSM
    (``opsm_keep``) and the entropy mask (``entropy_keep``, ``entropy`` needed) multiply ``pg``, before the
    importance weight and the KL term; ``opd_loss`` (``teacher_log_probs`` needed) is the supervised
    distillation term when ``opd_placement="loss"``. ``family_tokens``: the run's values of the family's own
    per-token payloads (``families.token_payloads``)."""
    if knobs.family:
        own = {"tokens": _own_tokens(knobs, family_tokens)} if token_payloads(knobs.policy_loss) else {}
        out = policy_family(knobs.policy_loss).token_terms(
            log_probs, old_log_probs, advantages, knobs, seg=seg, sample_terms=sample_terms,
            rollout_log_probs=rollout_log_probs, ref_log_probs=ref_log_probs, dtype=dtype, **own)
        return _shared_terms(out, log_probs, old_log_probs, advantages, knobs, seg=seg, sample_terms=sample_terms,
                             rollout_log_probs=rollout_log_probs, ref_log_probs=ref_log_probs, dtype=dtype,
                             entropy=entropy, teacher_log_probs=teacher_log_probs)
    old = old_log_probs.to(dtype)
    # the advantages promoted to ``dtype`` inside the surrogate's products (its negation is exact in any dtype), not
    # converted first: the same bits; the dual clip's scalar product −c·A takes them converted
    adv = advantages if not knobs.dual_clip and torch.promote_types(advantages.dtype, dtype) == dtype else \
        advantages.to(dtype)
    # the log-probs promoted to ``dtype`` inside the difference when that is where it lands (the same bits as
    # converting them first, one conversion fewer)
    promoted = torch.promote_types(log_probs.dtype, dtype) == dtype
    token_lr = torch.sub(log_probs, old) if promoted else log_probs.to(dtype) - old
    if knobs.sequence_ratio:
        lr = sample_terms["seq_log_ratio"][seg]
        ppo_kl = -token_lr
    else:
        lr = _clamp(token_lr, knobs.log_ratio_clamp)
        ppo_kl = -lr
    # exp(lr) is V1's exp(−ppo_kl) bit for bit: ppo_kl = −lr, and a negation is exact
    pg, clip, ratio = surrogate_terms(lr.exp(), adv, knobs.eps_clip, knobs.eps_clip_high)
    out = {"ppo_kl": ppo_kl, "ratio": ratio, "log_ratio": lr, "clip": clip}
    if knobs.dual_clip:
        pg, out["clip_lower"] = dual_clip(pg, adv, float(knobs.eps_clip_c))
    out["pg"] = pg
    return _shared_terms(out, log_probs, old_log_probs, advantages, knobs, seg=seg, sample_terms=sample_terms,
                         rollout_log_probs=rollout_log_probs, ref_log_probs=ref_log_probs, dtype=dtype,
                         entropy=entropy, teacher_log_probs=teacher_log_probs)


def _own_tokens(knobs: LossKnobs, family_tokens) -> Mapping[str, torch.Tensor]:
    """The family's own per-token payloads of ``family_tokens``; ``ValueError`` naming the one missing."""
    tokens = dict(family_tokens or {})
    for name in token_payloads(knobs.policy_loss):
        if tokens.get(name) is None:
            raise ValueError(f"payload {name!r} is required for policy_loss={knobs.policy_loss!r}")
    return tokens


def _family_extras(knobs: LossKnobs, family_tokens, loss_mask: torch.Tensor, lengths: torch.Tensor) -> dict:
    """The keywords a family's ``sample_terms`` asks for beyond the shared ones: its own per-token payloads
    (``tokens``) and each sample's aggregation weight under ``loss_agg_mode`` (``weights``, float64)."""
    f = policy_family(knobs.policy_loss)
    out = {}
    if token_payloads(knobs.policy_loss):
        out["tokens"] = _own_tokens(knobs, family_tokens)
    if f.weights is True or (callable(f.weights) and f.weights(knobs)):
        seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.to(torch.int64))
        counts = torch.zeros(lengths.numel(), dtype=torch.float64).index_add_(0, seg, loss_mask.to(torch.float64))
        out["weights"] = agg_weights(knobs.loss_agg_mode, counts, knobs)
    return out


def _shared_terms(out: dict, log_probs, old_log_probs, advantages, knobs: LossKnobs, *, seg, sample_terms,
                  rollout_log_probs, ref_log_probs, dtype, entropy, teacher_log_probs) -> dict[str, torch.Tensor]:
    """What follows any family's ``pg``: OPSM and the entropy mask, the importance weight, the KL term, the
    supervised distillation term."""
    pg, ratio = out["pg"], out["ratio"]
    # converted only where a term below reads it (a token-long conversion per chunk otherwise)
    old = old_log_probs.to(dtype) if knobs.is_level == "token" or knobs.is_keep else None
    if knobs.opsm or knobs.entropy_mask:
        out["pg_unmasked"] = pg
    if knobs.opsm:
        kl = sample_terms["opsm_kl"][seg]
        out["opsm_seq_kl"] = kl
        out["opsm_negative"] = advantages.to(dtype) < 0
        out["opsm_keep"] = (~out["opsm_negative"] | (kl <= knobs.opsm_delta)).to(dtype)
        pg = pg * out["opsm_keep"]
    if knobs.entropy_mask:
        if entropy is None:
            raise ValueError("entropy is required for top_entropy_quantile < 1")
        out["entropy"] = entropy.to(dtype)
        out["entropy_threshold"] = sample_terms["entropy_threshold"][seg]
        out["entropy_keep"] = (out["entropy"] >= out["entropy_threshold"]).to(dtype)
        pg = pg * out["entropy_keep"]
    if knobs.is_level is not None:
        if knobs.is_level == "token":
            if rollout_log_probs is None:
                raise ValueError("rollout_log_probs is required for is_level='token'")
            log_w = old - rollout_log_probs.to(dtype)
        else:
            log_w = sample_terms["is_log_weight"][seg]
        out["is_log_weight"] = log_w
        out["is_weight"] = importance_weight(log_w, knobs)
        out["pg_unweighted"] = pg
        pg = pg * out["is_weight"]
    if knobs.is_keep:  # the off-policy correction's 0/1 keep masks (kernels.is_keep): the term only
        from .is_keep import keep_weight

        out["is_keep"] = keep_weight(old, rollout_log_probs, knobs.is_keep, seg, sample_terms, dtype,
                                     _stat_dtype(knobs))
        pg = pg * out["is_keep"]
    out["pg"] = pg
    if knobs.kl_loss:
        if ref_log_probs is None:
            raise ValueError("ref_log_probs is required for a KL term in the loss (use_kl_loss, kl_loss_coef != 0)")
        logp = log_probs.to(dtype)
        out["kl_r"] = logp - ref_log_probs.to(dtype)
        out["kl_loss"] = kl_loss_values(logp, ref_log_probs, knobs, dtype=dtype)
        if knobs.kl_loss_ratio_weighted:  # × the unclipped ratio (TRL use_bias_correction_kl)
            out["kl_loss_unweighted"] = out["kl_loss"]
            out["kl_loss"] = out["kl_loss"] * ratio
        if knobs.kl_loss_rollout_weighted:  # × exp(logp − rollout) before the output clamp (NeMo-RL)
            if rollout_log_probs is None:
                raise ValueError("rollout_log_probs is required for kl_loss_rollout_weighted")
            out["kl_weight_log"] = logp - rollout_log_probs.to(dtype)
            out["kl_weight"] = torch.nan_to_num(out["kl_weight_log"].exp(), nan=0.0, posinf=0.0, neginf=0.0)
            inner = kl_loss_values(logp, ref_log_probs, replace(knobs, kl_loss_output_clamp=None), dtype=dtype)
            out["kl_loss_unweighted"] = inner
            out["kl_loss"] = _clamp(inner * out["kl_weight"], knobs.kl_loss_output_clamp)
    if knobs.opd_loss:
        if teacher_log_probs is None:
            raise ValueError("teacher_log_probs is required for opd_placement='loss'")
        out["opd_r"] = log_probs.to(dtype) - teacher_log_probs.to(dtype)
        out["opd_loss"] = opd_estimate(log_probs, teacher_log_probs, knobs, dtype)
    return out


def _stat_dtype(knobs: LossKnobs) -> Optional[torch.dtype]:
    """The format a divergence gate of ``is_keep`` is evaluated in (``LossKnobs.is_keep_format``: the producer's
    declared compute), None: the replay's dtype."""
    return getattr(torch, knobs.is_keep_format) if knobs.is_keep_format else None


def opd_estimate(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, knobs: LossKnobs,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """On-policy distillation's per-token reverse-KL estimate: ``opd_kl_type`` of ``r = student − teacher``
    (``kl.compute_approx_kl``: k1 = r, k2 = r²/2, k3 = e^−r − 1 + r, low_var_kl = k3 clamped ±10, abs = |r|),
    clamped to ``±opd_clamp`` when set (verl ``loss_max_clamp``, ``distillation/losses.py:256-258``)."""
    return compute_approx_kl(student_log_probs, teacher_log_probs, knobs.opd_kl_type, dtype=dtype,
                             clamp=knobs.opd_clamp)


def opd_advantages(advantages: torch.Tensor, old_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                   knobs: LossKnobs, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``A − opd_coef·estimate(old, teacher)``: the advantage placement of on-policy distillation (slime
    ``apply_opd_kl_to_advantages``, ``backends/megatron_utils/loss.py:663-701``, student = the trainer's old
    log-probs, k1; NeMo-RL's ``opd`` estimator is ``teacher − prev`` on a zero base, ``advantage_estimator.py:551-600``)."""
    base = torch.zeros_like(old_log_probs, dtype=dtype) if knobs.opd_base == "zero" else advantages.to(dtype)
    return base - knobs.opd_coef * opd_estimate(old_log_probs, teacher_log_probs, knobs, dtype)


def opsm_sequence_kl(log_probs: torch.Tensor, old_log_probs: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
                     loss_mask: torch.Tensor, lengths: torch.Tensor, knobs: LossKnobs,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """OPSM's per-sample ``Σ_t (anchor − logp)·m / max(Σ_t m, 1)``; the anchor is old_log_probs (slime
    ``compute_opsm_mask``, ``utils/ppo_utils.py:54-92``) or rollout_log_probs (TRL ``get_off_policy_mask``,
    ``grpo_trainer.py:2945-2967``: the sampling log-probs, a NaN difference taken as 0)."""
    if knobs.opsm_anchor == "rollout":
        if rollout_log_probs is None:
            raise ValueError("rollout_log_probs is required for opsm_anchor='rollout'")
        anchor = rollout_log_probs
    else:
        anchor = old_log_probs
    mask = loss_mask.to(dtype)

    def columns(start: int, stop: int, seg: torch.Tensor) -> dict[str, torch.Tensor]:
        m = mask[start:stop]
        d = anchor[start:stop].to(dtype) - log_probs[start:stop].to(dtype)
        if knobs.opsm_anchor == "rollout":
            d = d.nan_to_num(nan=0.0)
        return {"kl": d * m, "mask": m}

    sums = masked_sample_sums(lengths, loss_mask, columns, {"kl": dtype, "mask": dtype})
    return sums["kl"] / torch.clamp_min(sums["mask"], 1.0)


def entropy_thresholds(entropy: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, knobs: LossKnobs,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The entropy mask's threshold per sample: ``quantile(H over the loss tokens of the sample's micro-batch,
    1 − top_entropy_quantile)`` (linear interpolation, TRL ``get_high_entropy_mask``, ``grpo_trainer.py:1380-1415``;
    the micro-batch from ``knobs.micro_batch``, the whole step without one). A micro-batch without loss tokens
    keeps none (+inf)."""
    n = int(lengths.numel())
    seg = torch.repeat_interleave(torch.arange(n), lengths.to(torch.int64))
    group = torch.tensor(knobs.micro_batch, dtype=torch.int64) if knobs.micro_batch is not None and         len(knobs.micro_batch) == n else torch.zeros(n, dtype=torch.int64)
    keep = loss_mask.to(torch.bool)
    token_group = group[seg]
    out = torch.full((n,), math.inf, dtype=dtype)
    q = 1.0 - knobs.top_entropy_quantile
    for b in torch.unique(group).tolist():
        values = entropy[keep & (token_group == b)].to(dtype)
        if values.numel():  # torch.quantile's linear rule from two order statistics (a selection, not a sort)
            pos = q * (values.numel() - 1)
            lo = math.floor(pos)
            low = torch.kthvalue(values, lo + 1).values
            high = torch.kthvalue(values, min(lo + 2, values.numel())).values if pos > lo else low
            out[group == b] = torch.lerp(low, high, pos - lo)
    return out


def value_token_terms(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                      value_clip: Optional[float], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """loss.value per token (verl ``compute_value_loss``): ``vf = 0.5·max((v − R)², (clamp(v, v_old − ε,
    v_old + ε) − R)²)`` and ``clip = (clipped > unclipped)``; unclipped when ``value_clip`` is None."""
    v, r = values.to(dtype), returns.to(dtype)
    d1 = v - r
    vf1 = d1 * d1
    if value_clip is None:
        return {"vf": 0.5 * vf1, "clip": torch.zeros_like(vf1), "d1": d1, "d2": d1}
    old = old_values.to(dtype)
    d2 = torch.minimum(torch.maximum(v, old - value_clip), old + value_clip) - r
    vf2 = d2 * d2
    return {"vf": 0.5 * torch.maximum(vf1, vf2), "clip": torch.gt(vf2, vf1).to(dtype), "d1": d1, "d2": d2}


# ------------------------------------------------------------------------------------ aggregation


def agg_divisors(mode: str, mask_counts: torch.Tensor, knobs: LossKnobs) -> tuple[torch.Tensor, float]:
    """``(inner [n], outer)``: a field is ``(Σ_i S_i / inner_i) / outer`` under ``mode`` (module doc)."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r} (expected one of {', '.join(AGG_MODES)})")
    for count in AGG_COUNTS[mode]:
        if getattr(knobs, count) is None:
            raise ValueError(f"loss_agg_mode {mode!r} needs the recorded {count}")
    if mode == MICRO_BATCH_TOKEN_MEAN:  # (1/K)·Σ_b Σ_{i∈b} S_i / max(T_b, 1), T_b the micro-batch's loss tokens
        if knobs.micro_batch is None or len(knobs.micro_batch) != mask_counts.numel():
            raise ValueError(f"loss aggregation {mode!r} needs each sample's micro_batch_id")
        mb = torch.tensor(knobs.micro_batch, dtype=torch.int64)
        k = int(mb.max()) + 1 if mb.numel() else 1
        tokens = torch.zeros(k, dtype=mask_counts.dtype).index_add_(0, mb, mask_counts)
        return torch.clamp_min(tokens, 1.0)[mb], float(k)
    if mode == PROMPT_MEAN:  # (1/P)·Σ_p Σ_{i∈p} S_i / max(T_p, 1), T_p the prompt's loss tokens
        if knobs.prompt is None or len(knobs.prompt) != mask_counts.numel():
            raise ValueError(f"loss aggregation {mode!r} needs each sample's group_index")
        pr = torch.tensor(knobs.prompt, dtype=torch.int64)
        k = int(pr.max()) + 1 if pr.numel() else 1
        tokens = torch.zeros(k, dtype=mask_counts.dtype).index_add_(0, pr, mask_counts)
        return torch.clamp_min(tokens, 1.0)[pr], float(k)
    per_sample = mode in (SUM_OF_SAMPLE_MEANS, "seq_mean_token_mean")
    inner = torch.clamp_min(mask_counts, 1.0) if per_sample else torch.ones_like(mask_counts)
    if mode in (SUM_OF_SAMPLE_MEANS, "token_sum"):
        outer = 1.0
    elif mode == "token_mean":
        outer = float(max(knobs.loss_token_count, 1))
    elif mode == "seq_mean_token_sum_norm":
        outer = float(max(knobs.loss_seq_count, 1) * max(knobs.loss_horizon, 1))
    else:
        outer = float(max(knobs.loss_seq_count, 1))
    return inner, outer


def agg_weights(mode: str, mask_counts: torch.Tensor, knobs: LossKnobs) -> torch.Tensor:
    """``w_i`` (float64 ``[n]``): each sample's ``Σ_t x·mask`` enters a field as ``w_i·S_i``."""
    inner, outer = agg_divisors(mode, mask_counts.to(torch.float64), knobs)
    return 1.0 / (inner * outer)


def sample_term(mode: str, mask_count: float, knobs: LossKnobs) -> tuple[str, float]:
    """``(divisor, value)``: a sample's ``S = Σ_t x·mask`` enters a field under ``mode`` as ``S / value`` (before
    ``loss_scale``), and that divisor in words, for a view that spells it out — ``max(Σmask, 1)``,
    ``loss_token_count``, ``max(Σmask, 1)·loss_seq_count``, …"""
    inner, outer = agg_divisors(mode, torch.tensor([float(mask_count)], dtype=torch.float64), knobs)
    names = (["max(Σmask, 1)"] if mode in (SUM_OF_SAMPLE_MEANS, "seq_mean_token_mean") else []) + \
        list(AGG_COUNTS[mode]) + (["micro-batch tokens·micro-batches"] if mode == MICRO_BATCH_TOKEN_MEAN else []) + \
        (["prompt tokens·prompts"] if mode == PROMPT_MEAN else [])
    return "·".join(names) or "1", float(inner[0]) * outer


def aggregate(per_sample: torch.Tensor, mask_counts: torch.Tensor, mode: str, knobs: LossKnobs,
              scale: float = 1.0) -> torch.Tensor:
    """``scale · (Σ_i S_i / inner_i) / outer`` in the dtype of ``per_sample``."""
    inner, outer = agg_divisors(mode, mask_counts.to(per_sample.dtype), knobs)
    total = (per_sample / inner).sum()
    if outer != 1.0:
        total = total / outer
    return total * scale if scale != 1.0 else total


def sum_of_sample_mean(values: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor, n_samples: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Σ_samples Σ_t x·mask / max(Σ_t mask, 1)``: the sum of per-sample masked means."""
    mask = mask.to(dtype)
    per_sample = segment_sum(values.to(dtype) * mask, seg, n_samples)
    denom = torch.clamp_min(segment_sum(mask, seg, n_samples), 1.0)
    return (per_sample / denom).sum()


LOSS_FIELDS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl")
# What the knobs add (SPEC §4.2): the dual-clip fraction and the KL term of the loss.
POLICY_EXTRA_FIELDS = ("pg_clipfrac_lower", "kl_loss", "opd_loss")
POLICY_FIELDS = LOSS_FIELDS + POLICY_EXTRA_FIELDS
VALUE_FIELDS = ("vf_loss", "vf_clipfrac")
# Which fields are loss terms (loss_agg_mode, × loss_scale); the others are metrics (metric_agg_mode).
METRIC_FIELDS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "vf_clipfrac")


def field_aggregation(name: str, knobs: LossKnobs) -> tuple[str, float]:
    """``(mode, scale)`` the loss field ``name`` aggregates its per-sample sums with: a metric by
    ``metric_agg_mode``, unscaled; ``entropy_loss`` and ``kl_loss`` by their own modes, the other loss terms by
    ``loss_agg_mode``, each × ``loss_scale``."""
    if name in METRIC_FIELDS:
        return knobs.metric_agg_mode, 1.0
    return {"entropy_loss": knobs.entropy_mode, "kl_loss": knobs.kl_mode}.get(name, knobs.loss_agg_mode), \
        knobs.loss_scale


def loss_total(pg_loss, entropy_loss, kl_loss, entropy_coef: float, knobs: LossKnobs, opd_loss=None):
    """``loss = pg_loss − entropy_coef·entropy_loss (+ kl_loss_coef·kl_loss with a KL term) (+ opd_coef·opd_loss
    with a supervised distillation term)``, of floats or tensors alike."""
    loss = pg_loss - entropy_coef * entropy_loss
    loss = loss + knobs.kl_loss_coef * kl_loss if knobs.kl_loss else loss
    return loss + knobs.opd_coef * opd_loss if knobs.opd_loss and opd_loss is not None else loss


def has_clip_lower(knobs: LossKnobs) -> bool:
    """A ``pg_clipfrac_lower`` is computed: dual-clip, or a policy-loss family that reports one."""
    return knobs.dual_clip or (knobs.policy_loss != "ppo"
                               and "pg_clipfrac_lower" in policy_family(knobs.policy_loss).metrics)


def family_metrics(knobs: LossKnobs) -> tuple[str, ...]:
    """The metrics (of pg_clipfrac, ppo_kl, pg_clipfrac_lower) the configured policy loss reports."""
    if knobs.policy_loss == "ppo":
        return ("pg_clipfrac", "ppo_kl") + (("pg_clipfrac_lower",) if knobs.dual_clip else ())
    return policy_family(knobs.policy_loss).metrics


def policy_fields_for(knobs: LossKnobs) -> tuple[str, ...]:
    """The loss.policy fields a producer with these knobs reports."""
    if knobs.policy_loss != "ppo":
        metrics = family_metrics(knobs)
        return tuple(f for f in LOSS_FIELDS if f not in METRIC_FIELDS or f in metrics) + \
            (("pg_clipfrac_lower",) if "pg_clipfrac_lower" in metrics else ()) + \
            (("kl_loss",) if knobs.kl_loss else ()) + (("opd_loss",) if knobs.opd_loss else ())
    return LOSS_FIELDS + (("pg_clipfrac_lower",) if knobs.dual_clip else ()) + (("kl_loss",) if knobs.kl_loss else ()) \
        + (("opd_loss",) if knobs.opd_loss else ())


def policy_loss_fields(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    entropy: torch.Tensor | None,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    entropy_coef: float,
    dtype: torch.dtype = torch.float32,
    knobs: Optional[LossKnobs] = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    teacher_log_probs: Optional[torch.Tensor] = None,
    family_tokens: Optional[Mapping[str, torch.Tensor]] = None,
) -> Mapping[str, torch.Tensor]:
    """The reported loss.policy fields (0-d ``dtype``): ``loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl``
    and, as ``knobs`` ask, ``pg_clipfrac_lower`` and ``kl_loss``.

    Each field aggregates its per-token value (:func:`aggregate`). The masked per-sample sums are accumulated
    chunk by chunk; ``index_add_`` adds in token order either way, so the result is the same as one pass over
    all tokens. ``knobs`` default to V1's (the sum of per-sample means, no dual-clip, no KL, no IS)."""
    knobs = (knobs or LossKnobs()).with_clips(eps_clip, eps_clip_high)
    knobs = replace(knobs, entropy_coef=entropy_coef)
    sample_terms = sample_log_terms(log_probs, old_log_probs, rollout_log_probs, loss_mask, lengths, knobs, dtype,
                                    entropy=entropy, advantages=advantages, family_tokens=family_tokens)
    columns = policy_loss_columns(log_probs, old_log_probs, advantages, entropy, loss_mask, eps_clip=eps_clip,
                                  eps_clip_high=eps_clip_high, dtype=dtype, knobs=knobs, sample_terms=sample_terms,
                                  rollout_log_probs=rollout_log_probs, ref_log_probs=ref_log_probs,
                                  teacher_log_probs=teacher_log_probs, family_tokens=family_tokens)
    sums = masked_sample_sums(lengths, loss_mask, columns, {name: dtype for name in policy_sums(knobs)})
    return policy_fields_from_sums(sums, entropy is not None, entropy_coef, knobs)


# The per-sample sums :func:`policy_loss_fields` reduces: Σ_t x·mask of the surrogate, the clip indicator,
# ppo_kl and entropy, and Σ_t mask (V1); the dual-clip indicator and the KL term as the knobs ask.
POLICY_SUMS = ("pg", "clip", "kl", "ent", "mask")


def policy_sums(knobs: LossKnobs) -> tuple[str, ...]:
    return POLICY_SUMS + (("clip_lower",) if has_clip_lower(knobs) else ()) + (("kl_loss",) if knobs.kl_loss else ()) \
        + (("opd_loss",) if knobs.opd_loss else ())


def policy_loss_columns(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, entropy: Optional[torch.Tensor],
    loss_mask: torch.Tensor, *, eps_clip: float, eps_clip_high: float, dtype: torch.dtype,
    knobs: Optional[LossKnobs] = None, sample_terms: Optional[Mapping[str, torch.Tensor]] = None,
    rollout_log_probs: Optional[torch.Tensor] = None, ref_log_probs: Optional[torch.Tensor] = None,
    teacher_log_probs: Optional[torch.Tensor] = None,
    family_tokens: Optional[Mapping[str, torch.Tensor]] = None,
) -> Callable[[int, int, torch.Tensor], dict[str, torch.Tensor]]:
    """The masked per-token terms of :func:`policy_sums` for one chunk, in ``dtype``."""
    mask = loss_mask.to(dtype)
    knobs = (knobs or LossKnobs()).with_clips(eps_clip, eps_clip_high)

    def columns(start: int, stop: int, seg: torch.Tensor) -> dict[str, torch.Tensor]:
        m = mask[start:stop]
        t = policy_token_terms(
            log_probs[start:stop], old_log_probs[start:stop], advantages[start:stop], knobs, seg=seg,
            sample_terms=sample_terms, dtype=dtype,
            rollout_log_probs=rollout_log_probs[start:stop] if rollout_log_probs is not None else None,
            ref_log_probs=ref_log_probs[start:stop] if ref_log_probs is not None else None,
            entropy=entropy[start:stop] if entropy is not None else None,
            teacher_log_probs=teacher_log_probs[start:stop] if teacher_log_probs is not None else None,
            family_tokens=slice_tokens(family_tokens, slice(start, stop)))
        out = {"pg": t["pg"] * m, "clip": t["clip"] * m, "kl": t["ppo_kl"] * m}
        if entropy is not None:
            out["ent"] = entropy[start:stop].to(dtype) * m
        out["mask"] = m
        if has_clip_lower(knobs):
            out["clip_lower"] = t["clip_lower"] * m
        if knobs.kl_loss:
            out["kl_loss"] = t["kl_loss"] * m
        if knobs.opd_loss:
            out["opd_loss"] = t["opd_loss"] * m
        return out

    return columns


def policy_fields_from_sums(sums: Mapping[str, torch.Tensor], has_entropy: bool,
                            entropy_coef: float, knobs: Optional[LossKnobs] = None) -> dict[str, torch.Tensor]:
    """The loss.policy fields from the per-sample sums of :func:`policy_sums`, aggregated as the knobs say
    (default: V1's sum over samples of the masked means ``Σ_t x·mask / max(Σ_t mask, 1)``)."""
    knobs = knobs or LossKnobs()
    n = sums["mask"]

    def loss_term(name: str, mode: Optional[str] = None) -> torch.Tensor:
        return aggregate(sums[name], n, mode or knobs.loss_agg_mode, knobs, knobs.loss_scale)

    def metric(name: str) -> torch.Tensor:
        return aggregate(sums[name], n, knobs.metric_agg_mode, knobs)

    pg_loss = loss_term("pg")
    entropy_loss = loss_term("ent", knobs.entropy_mode) if has_entropy else torch.zeros((), dtype=pg_loss.dtype)
    kl_loss = loss_term("kl_loss", knobs.kl_mode) if knobs.kl_loss else None
    opd_loss = loss_term("opd_loss") if knobs.opd_loss else None
    out = {"loss": loss_total(pg_loss, entropy_loss, kl_loss, entropy_coef, knobs, opd_loss), "pg_loss": pg_loss,
           "entropy_loss": entropy_loss, "pg_clipfrac": metric("clip"), "ppo_kl": metric("kl")}
    if has_clip_lower(knobs):
        out["pg_clipfrac_lower"] = metric("clip_lower")
    if kl_loss is not None:
        out["kl_loss"] = kl_loss
    if opd_loss is not None:
        out["opd_loss"] = opd_loss
    return out


def value_loss_fields(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                      loss_mask: torch.Tensor, lengths: torch.Tensor, knobs: LossKnobs,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """loss.value's fields ``vf_loss`` (the loss mode, × loss_scale) and ``vf_clipfrac`` (the metric mode)."""
    mask = loss_mask.to(dtype)

    def columns(start: int, stop: int, seg: torch.Tensor) -> dict[str, torch.Tensor]:
        t = value_token_terms(values[start:stop], old_values[start:stop], returns[start:stop], knobs.value_clip,
                              dtype)
        m = mask[start:stop]
        return {"vf": t["vf"] * m, "clip": t["clip"] * m, "mask": m}

    sums = masked_sample_sums(lengths, loss_mask, columns, {k: dtype for k in ("vf", "clip", "mask")})
    return value_fields_from_sums(sums, knobs)


def value_fields_from_sums(sums: Mapping[str, torch.Tensor], knobs: LossKnobs) -> dict[str, torch.Tensor]:
    return {"vf_loss": aggregate(sums["vf"], sums["mask"], knobs.loss_agg_mode, knobs, knobs.loss_scale),
            "vf_clipfrac": aggregate(sums["clip"], sums["mask"], knobs.metric_agg_mode, knobs)}
