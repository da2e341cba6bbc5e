"""``loss.policy`` hypotheses for the loss families and masks of SPEC §4.2 beyond the clipped surrogate (issue 34):
each typical bug is the declared configuration with one thing changed, recomputed in float64 from the stage's own
inputs (``kernels.loss.policy_loss_fields``), its loss fields judged as the stage judges them.

* VESPO: the gamma weighting's ``(k, λ)`` taken by the wrong sign of the advantage;
* OPSM: the anchor swapped (slime's old log-probs where TRL's sampling log-probs are declared, or the reverse);
* TRL's entropy mask: the quantile of the kept share (``q``) where TRL takes ``1 − q``;
* rollout_is / IPO: the ratio taken to the old log-probs where the family's anchor is the rollout (inference)
  log-probs;
* on-policy distillation's loss term: the estimator on ``teacher − student`` (the direction swapped: the forward
  direction of a reverse-KL estimator; verl#5041 shows what mass-covering vs mode-seeking does to a run).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..judge.fields import PER_SCALAR, FieldResult
from ..kernels.loss import LossKnobs, aggregate, field_aggregation, opd_estimate, policy_loss_fields
from ..kernels.segments import masked_sample_sums
from ..stages import StageContext, StageInputError
from ..stages.loss import AGGREGATE_SUFFIX, LossInputs, loss_inputs
from .base import Hypothesis

STAGE = "loss.policy"


def _variants(knobs: LossKnobs) -> list[tuple[str, str, LossKnobs, dict]]:
    """``(id, detail, knobs, payload overrides)`` of each typical bug of the declared knobs."""
    out = []
    if knobs.policy_loss == "vespo":
        swapped = (("k_pos", knobs.param("k_neg")), ("k_neg", knobs.param("k_pos")),
                   ("lambda_pos", knobs.param("lambda_neg")), ("lambda_neg", knobs.param("lambda_pos")))
        out.append(("loss.vespo_sign_swapped", "VESPO's (k, λ) taken by the wrong sign of the advantage "
                    "((k_neg, λ_neg) for A ≥ 0)", dataclasses.replace(knobs, policy_loss_params=tuple(sorted(swapped))),
                    {}))
    if knobs.opsm:
        other = "old" if knobs.opsm_anchor == "rollout" else "rollout"
        out.append((f"loss.opsm_anchor_{other}", f"OPSM's sequence KL taken against the {other} log-probs (config: "
                    f"{knobs.opsm_anchor}; slime compares old vs current, TRL sampling vs current)",
                    dataclasses.replace(knobs, opsm_anchor=other), {}))
    if knobs.entropy_mask and knobs.top_entropy_quantile != 0.5:
        q = knobs.top_entropy_quantile
        out.append(("loss.entropy_quantile_flipped", f"the entropy mask's threshold at the {q:g} quantile (the kept "
                    f"share) where TRL takes 1 − q = {1 - q:g}", dataclasses.replace(knobs, top_entropy_quantile=1 - q),
                    {}))
    if knobs.policy_loss in ("rollout_is", "ipo", "icepop"):
        out.append((f"loss.{knobs.policy_loss}_old_anchor", f"{knobs.policy_loss}'s ratio taken to the old log-probs "
                    "where its anchor is the rollout (inference) log-probs", knobs, {"rollout_log_probs": "old"}))
    return out


def _values(fields: list[FieldResult], computed: dict[str, float]) -> dict:
    values: dict = {}
    for f in fields:
        if f.name != "loss" or f.per != PER_SCALAR or not f.labels:
            continue
        keys = [label.removesuffix(AGGREGATE_SUFFIX) for label in f.labels]
        values[f.name] = torch.tensor([computed.get(key, float(f.actual[i])) for i, key in enumerate(keys)],
                                      dtype=torch.float64)
    return values


def _recompute(ctx: StageContext, li: LossInputs, knobs: LossKnobs, overrides: dict) -> dict[str, float]:
    advantages = li.advantages if isinstance(li.advantages, torch.Tensor) else li.advantages.materialize()
    rollout = li.old_log_probs if overrides.get("rollout_log_probs") == "old" else li.rollout_log_probs
    out = policy_loss_fields(li.log_probs, li.old_log_probs, advantages, li.entropy, li.mask, ctx.lengths,
                             eps_clip=knobs.eps_clip, eps_clip_high=knobs.eps_clip_high,
                             entropy_coef=knobs.entropy_coef, dtype=torch.float64, knobs=knobs,
                             rollout_log_probs=rollout, ref_log_probs=li.ref_log_probs,
                             teacher_log_probs=li.teacher_log_probs, family_tokens=li.family_tokens)
    return {k: float(v) for k, v in out.items()}


def _opd_swapped(ctx: StageContext, li: LossInputs, knobs: LossKnobs) -> Optional[dict[str, float]]:
    """The distillation term on ``teacher − student``: ``opd_loss`` and ``loss`` moved by the difference."""
    base = _recompute(ctx, li, knobs, {})
    mask = li.mask.to(torch.float64)

    def columns(lo: int, hi: int, seg: torch.Tensor) -> dict[str, torch.Tensor]:
        m = mask[lo:hi]
        return {"x": opd_estimate(li.teacher_log_probs[lo:hi], li.log_probs[lo:hi], knobs, torch.float64) * m,
                "mask": m}

    sums = masked_sample_sums(ctx.lengths, li.mask, columns, {"x": torch.float64, "mask": torch.float64})
    mode, scale = field_aggregation("opd_loss", knobs)
    swapped = float(aggregate(sums["x"], sums["mask"], mode, knobs, scale))
    return dict(base, opd_loss=swapped, loss=base["loss"] + knobs.opd_coef * (swapped - base["opd_loss"]))


def hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    knobs = LossKnobs.of(ctx.config, ctx.samples)
    if not (knobs.family or knobs.opsm or knobs.entropy_mask or knobs.opd_loss):
        return []
    try:
        li = loss_inputs(ctx)
    except StageInputError:
        return []
    out = []
    for hid, detail, variant, overrides in _variants(knobs):
        if overrides.get("rollout_log_probs") == "old" and li.rollout_log_probs is None:
            continue
        try:
            values = _values(fields, _recompute(ctx, li, variant, overrides))
        except (ValueError, KeyError):
            continue
        out.append(Hypothesis(stage=STAGE, id=hid, detail=detail, values=values))
    if knobs.opd_loss and li.teacher_log_probs is not None:
        out.append(Hypothesis(stage=STAGE, id="loss.opd_direction_swapped", detail=(
            f"the distillation term's {knobs.opd_kl_type} estimate on teacher − student (the direction swapped)"),
            values=_values(fields, _opd_swapped(ctx, li, knobs))))
    return out
