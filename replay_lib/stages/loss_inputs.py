"""What loss.policy consumes (:class:`LossInputs`): the recorded log-probs, old log-probs, entropy and mask, the
advantages (recorded, or ``--chain``'s recomputed ones with their bound), and the tensors the knobs need; by
payload name too, which is what their storage units (``error_model.StorageUnits``) and the ``coarse_payload``
hazard are taken of."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..bundle.is_keep import DIVERGENCES
from ..judge.error_model import StorageUnits
from ..kernels import GrpoReturns
from ..kernels.loss import LossKnobs
from ..kernels.families import token_payloads
from .base import StageContext, StageInputError


@dataclass(frozen=True)
class LossInputs:
    """What loss.policy consumes: the recorded log-probs, old log-probs, entropy and mask, and the
    advantages — the recorded payload (teacher forcing), or under ``--chain`` (or without the payload)
    advantage.estimate's recomputed ones, with their per-sample rounding bound (``advantage_bound``); and
    what the knobs need: ``rollout_log_probs`` (importance correction), ``ref_log_probs`` (KL in the loss)."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: "torch.Tensor | GrpoReturns"
    entropy: Optional[torch.Tensor]
    mask: torch.Tensor
    advantage_bound: Optional[torch.Tensor] = None
    advantage_per_sample: Optional[torch.Tensor] = None
    rollout_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    knobs: LossKnobs = LossKnobs()
    # rejection sampling (rollout_rs): the loss tokens whose decision lies within the producer's rounding of a
    # bound, and the mask with those decisions taken the other way (None when there is none)
    rs_near: Optional[torch.Tensor] = None
    rs_alternative: Optional[torch.Tensor] = None
    teacher_log_probs: Optional[torch.Tensor] = None  # on-policy distillation as a loss term (opd_placement)
    # slime's MIS rejection (mis_rs, mis_veto): 0/1 per token multiplying every term's numerator, the normalizers
    # kept (rs_near / rs_alternative then describe this keep instead of the mask)
    keep: Optional[torch.Tensor] = None
    # the policy-loss family's own per-token payloads by name (kernels.families.token_payloads: clip_cov_mask)
    family_tokens: Optional[dict] = None

    def payloads(self) -> dict[str, Optional[torch.Tensor]]:
        """The recorded tensors by payload name; ``advantages`` only when recorded (a tensor), not the lazy
        GRPO returns of ``--chain``."""
        return {"log_probs": self.log_probs, "old_log_probs": self.old_log_probs,
                "rollout_log_probs": self.rollout_log_probs, "ref_log_probs": self.ref_log_probs,
                "entropy": self.entropy,
                "advantages": self.advantages if isinstance(self.advantages, torch.Tensor) else None,
                "teacher_log_probs": self.teacher_log_probs}

    def storage(self, compute: str) -> StorageUnits:
        """The storage units of the loss terms' inputs under the declared ``compute``."""
        return StorageUnits.of(compute, **self.payloads())


def family_payloads(knobs: LossKnobs) -> tuple[str, ...]:
    """The payloads the knobs' policy-loss family reads beyond the PPO ones (``()`` for an unknown family: it is
    refused by name before a stage runs)."""
    if not knobs.family:
        return ()
    from ..kernels.families import FAMILIES
    f = FAMILIES.get(knobs.policy_loss)
    return f.payloads if f is not None else ()


def loss_inputs(ctx: StageContext) -> LossInputs:
    cfg = ctx.config
    knobs = LossKnobs.of(cfg, ctx.samples)
    if any(kind in DIVERGENCES for kind, _, _ in knobs.is_keep):  # a gate the producer decided in its format
        knobs = replace(knobs, is_keep_format=ctx.precision.compute)
    recomputed = ctx.outputs.get("advantages") if ctx.chain or not ctx.has("advantages") else None
    bound = per_sample = None
    if recomputed is None:
        advantages = ctx.payload("advantages")
    else:
        advantages = recomputed
        bound = ctx.outputs.get("advantage_bound")
        per_sample = recomputed.rewards if isinstance(recomputed, GrpoReturns) else None
    entropy = ctx.payload("entropy") if ctx.has("entropy") else None
    if entropy is None and cfg.entropy_coef != 0:
        raise StageInputError("payload 'entropy' is required when entropy_coef != 0", field="entropy")
    if entropy is None and knobs.entropy_mask:
        raise StageInputError("payload 'entropy' is required for top_entropy_quantile < 1", field="entropy")
    teacher = None
    if knobs.opd_loss:
        if not ctx.has("teacher_log_probs"):
            raise StageInputError("payload 'teacher_log_probs' is required for opd_placement='loss'",
                                  field="teacher_log_probs")
        teacher = ctx.payload("teacher_log_probs")
    rollout = ref = None
    rollout_family = "rollout_log_probs" in family_payloads(knobs) or (
        knobs.policy_loss == "dppo_mu" and knobs.param("anchor") == "rollout")
    if knobs.is_level is not None or knobs.is_keep or (knobs.opsm and knobs.opsm_anchor == "rollout") or \
            rollout_family or (knobs.kl_loss and knobs.kl_loss_rollout_weighted):
        if not ctx.has("rollout_log_probs"):
            why = (f"is_level={knobs.is_level!r}" if knobs.is_level is not None else "is_keep" if knobs.is_keep else
                   "policy_loss 'dppo_mu' anchored on the rollout" if knobs.policy_loss == "dppo_mu" else
                   f"policy_loss={knobs.policy_loss!r}" if knobs.family else
                   "opsm_anchor='rollout'" if knobs.opsm else "kl_loss_rollout_weighted")
            raise StageInputError(f"payload 'rollout_log_probs' is required for {why}", field="rollout_log_probs")
        rollout = ctx.payload("rollout_log_probs")
    if knobs.kl_loss:
        if not ctx.has("ref_log_probs"):
            raise StageInputError("payload 'ref_log_probs' is required for use_kl_loss with kl_loss_coef != 0",
                                  field="ref_log_probs")
        ref = ctx.payload("ref_log_probs")
    family_tokens = None
    own = token_payloads(knobs.policy_loss) if knobs.family else ()
    for name in own:
        if not ctx.has(name):
            raise StageInputError(f"payload {name!r} is required for policy_loss={knobs.policy_loss!r} "
                                  f"({FAMILY_PAYLOAD_WHY.get(name, 'the family reads it')})", field=name)
        family_tokens = {**(family_tokens or {}), name: ctx.payload(name)}  # 0/1 (bundle.reader checks)
    mask = ctx.loss_mask
    # force_on_policy_ratio: the ratio 1 — the current log-probs stand for the old ones (NeMo-RL loss.py:399-402)
    old = ctx.payload("log_probs") if knobs.force_on_policy_ratio else ctx.payload("old_log_probs")
    # the log-probs the correction compares with the rollout ones: the trainer's old ones, or (verl bypass_mode)
    # the current ones, which then stand for the old policy of the IS weight (GPG's term reads no other old)
    current_anchor = cfg.rollout_correction_anchor == "current"
    anchor = ctx.payload("log_probs") if current_anchor else old
    rs_near = rs_alternative = None
    if isinstance(cfg.rollout_rs, str):  # rejection sampling (SPEC §4.4): the rejected tokens leave the mask
        if not ctx.has("rollout_log_probs"):
            raise StageInputError("payload 'rollout_log_probs' is required for rollout_rs", field="rollout_log_probs")
        from ..bundle.rollout_rs import parse_rollout_rs
        from ..kernels.mismatch import rejection_decisions

        chain = parse_rollout_rs(cfg.rollout_rs, cfg.rollout_rs_threshold)
        keep, near = rejection_decisions(anchor.to(torch.float64) - ctx.payload("rollout_log_probs").to(torch.float64),
                                         mask, ctx.seg, ctx.n, chain, unit=ctx.precision.token)
        if bool(near.any()):
            rs_near, rs_alternative = near, mask * (keep ^ near).to(mask.dtype)
        mask = mask * keep.to(mask.dtype)
    keep = None
    mis_rs = cfg.mis_rs if isinstance(cfg.mis_rs, list) else None
    veto = cfg.mis_veto if isinstance(cfg.mis_veto, float) else None
    if mis_rs or veto is not None:  # slime's MIS rejection (SPEC §4.4): the numerators only
        if not ctx.has("rollout_log_probs"):
            raise StageInputError("payload 'rollout_log_probs' is required for mis_rs / mis_veto",
                                  field="rollout_log_probs")
        from ..kernels.mismatch import mis_chain, rejection_decisions

        kept, near = rejection_decisions(old.to(torch.float64) - ctx.payload("rollout_log_probs").to(torch.float64),
                                         mask, ctx.seg, ctx.n, mis_chain(mis_rs, veto), unit=ctx.precision.token)
        keep = kept.to(mask.dtype)
        if bool(near.any()):
            rs_near, rs_alternative = near, (kept ^ near).to(mask.dtype)
    if current_anchor and knobs.is_level is not None:
        old = anchor
    return LossInputs(log_probs=ctx.payload("log_probs"), old_log_probs=old,
                      advantages=advantages, entropy=entropy, mask=mask, advantage_bound=bound,
                      advantage_per_sample=per_sample, rollout_log_probs=rollout, ref_log_probs=ref, knobs=knobs,
                      rs_near=rs_near, rs_alternative=rs_alternative,
                      teacher_log_probs=teacher, keep=keep, family_tokens=family_tokens)


# Why a family's own payload is needed, for the refusal that names it
FAMILY_PAYLOAD_WHY = {
    "clip_cov_mask": "Clip-Cov zeroes a random sample (torch.randperm) of the tokens whose covariance lies in "
                     "(clip_cov_lb, clip_cov_ub): record the selected tokens, 1 where the producer zeroed the term",
}


def is_keep_hazards(ctx: StageContext, li: LossInputs, stage: str) -> None:
    """One ``is_keep_boundary`` hazard per sample whose keep decision (``kernels.is_keep``) lies within the
    producer's rounding of its edge: its whole policy-loss term may be kept or dropped by the producer."""
    if not li.knobs.is_keep or li.rollout_log_probs is None:
        return
    from ..kernels.is_keep import edge_samples

    for i, what in edge_samples(li.old_log_probs, li.rollout_log_probs, li.mask, ctx.lengths, li.knobs.is_keep,
                                ctx.precision.token, ctx.seg):
        ctx.hazard(stage, "is_keep_boundary", sample=i, message=(
            f"{ctx.sample_ids[i]}: {what} lies within rounding of its edge: the producer may keep or drop the "
            "sample's terms there"))
