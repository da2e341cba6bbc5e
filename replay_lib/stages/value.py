"""``loss.value`` (PPO, SPEC §4.2): the clipped value loss recomputed in float64 from the recorded payloads
``values`` (the value head's predictions in the step), ``old_values`` (the rollout's) and ``returns``:

    vf_t = 0.5·max((v − R)², (clamp(v, v_old − ε_v, v_old + ε_v) − R)²),   vf_clip_t = (clipped > unclipped)

(verl ``compute_value_loss``; unclipped when ``value_clip`` is None), aggregated like the policy loss:
``vf_loss`` with ``loss_agg_mode`` (× ``loss_scale``), ``vf_clipfrac`` with ``metric_agg_mode``
(``kernels.loss.value_fields_from_sums``). Expected: ``expected.json $.loss.value.{vf_loss, vf_clipfrac}``.
Teacher forcing: the returns are the recorded payload (GAE, which makes them, is advantage.estimate's).

Rounding bound (``error_model.aggregated_condition`` / ``scalar_bound``): per token the condition of ``vf`` is
``c_t = |d|·(|v| + |R| + |v_old| + ε_v) + vf`` (``d`` the chosen difference: each of ``v − R`` and the clamp
rounds once relative to its operands, and squaring doubles a relative error); the clip fraction admits the
tokens where the two squares lie within ``8·u_t·c_t`` of each other (a rounding may pick either). Payloads
stored coarser than the declared compute (``error_model.storage_unit``: bf16 copies of float32 values) add their
rounding, ``e = u_s·(|v| + |v_old| + |R|)`` per difference: ``2·(|d| + e)·e`` per token (``vf = d²/2``), and the
clip decisions within ``4·|d|·e`` of a tie are open.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..bundle import BundleReader
from ..judge.error_model import C_NEAR_CLIP, C_STORE, aggregated_condition, scalar_bound, storage_error, storage_unit
from ..judge.fields import PER_SCALAR
from ..kernels.loss import VALUE_FIELDS, LossKnobs, agg_divisors, value_fields_from_sums, value_loss_fields, \
    value_token_terms
from ..judge.report import StageReport
from ..bundle.schema import StageId
from .base import StageContext, StageDef, StageInputError
from .loss import count_requirements, partition_requirements

STAGE = StageId.LOSS_VALUE.value
VALUE_PAYLOADS = ("values", "old_values", "returns")


def _recorded(ctx: StageContext) -> dict[str, float]:
    recorded = ctx.reader.expected.get(STAGE, {})
    expected = {f: recorded[f] for f in VALUE_FIELDS if f in recorded}
    if not expected:
        raise StageInputError(f"expected.json $.{STAGE} has none of " + ", ".join(VALUE_FIELDS), field="vf_loss")
    return expected


def _sums(ctx: StageContext, values, old_values, returns, mask, knobs: LossKnobs) -> dict[str, torch.Tensor]:
    """One pass: per sample, Σ_t x·mask of vf and the clip indicator, Σ_t mask, Σ_t |vf|·c_t·mask, the tokens
    at the clip decision's rounding, and the float32 sequential sum of vf."""
    u = ctx.precision.token
    u_s = storage_unit(ctx.precision.compute, values, old_values, returns)
    if u_s:
        ctx.coarse_payload_hazard(STAGE, dict(zip(VALUE_PAYLOADS, (values, old_values, returns))), (
            "vf_loss admits their rounding, 2·(|d| + e)·e per token with e = u·(|v| + |v_old| + |R|)"))
    eps = float(knobs.value_clip) if knobs.value_clip is not None else 0.0
    names = ("vf", "clip", "mask", "vf_tok", "near") + (("store",) if u_s else ())
    out = torch.zeros((len(names), ctx.n), dtype=torch.float64)
    vf32 = torch.zeros(ctx.n, dtype=torch.float32)
    for lo, hi, seg in ctx.token_chunks():
        m = mask[lo:hi].to(torch.float64)
        v, old, r = (t[lo:hi].to(torch.float64) for t in (values, old_values, returns))
        t = value_token_terms(v, old, r, knobs.value_clip, dtype=torch.float64)
        d = torch.maximum(t["d1"].abs(), t["d2"].abs())
        cond = d * (v.abs() + r.abs() + old.abs() + eps) + t["vf"]
        slack = C_NEAR_CLIP * u * cond
        if u_s:  # the differences' inputs stored coarser than the compute: each is e off the producer's
            e = storage_error(u_s, v, old, r)
            slack = slack + (2 * C_STORE) * d * e
        near = ((t["d1"] * t["d1"] - t["d2"] * t["d2"]).abs() <= slack) & (t["d1"] != t["d2"])
        rows = [t["vf"] * m, t["clip"] * m, m, cond * m, near.to(torch.float64) * m]
        if u_s:
            rows.append((d + e) * e * m)
        rows = torch.stack(rows)
        out.index_add_(1, seg, rows)  # every row at once, each sample's sum in token order
        vf32.index_add_(0, seg, (t["vf"] * m).to(torch.float32))
    sums = dict(zip(names, out))
    sums["vf32"] = vf32
    return sums


def value_bounds(sums: dict[str, torch.Tensor], fields: dict[str, torch.Tensor], names, knobs: LossKnobs,
                 precision) -> dict[str, float]:
    n = sums["mask"]
    out = {}
    for name in names:
        metric = name == "vf_clipfrac"
        inner, outer = agg_divisors(knobs.metric_agg_mode if metric else knobs.loss_agg_mode, n, knobs)
        if metric:
            cond = aggregated_condition(sums["clip"], None, None, None, inner, outer)
        else:
            cond = aggregated_condition(sums["vf"], sums["vf"], 2.0 * sums["vf_tok"], sums["vf32"], inner, outer,
                                        knobs.loss_scale)
        bound = scalar_bound(float(fields[name]), cond, precision)
        if metric:
            bound += float((sums["near"] / (inner * outer)).sum())
        elif "store" in sums:
            bound += C_STORE * abs(float(knobs.loss_scale)) * float((sums["store"] / (inner * outer)).sum())
        out[name] = bound
    return out


def run_loss_value(ctx: StageContext) -> StageReport:
    knobs = LossKnobs.of(ctx.config, ctx.samples)
    expected = _recorded(ctx)
    values, old_values, returns = (ctx.payload(p) for p in VALUE_PAYLOADS)
    mask = ctx.loss_mask
    bound: Optional[dict] = None
    if ctx.dtype != torch.float64:  # --exact: the producer's float32 kernel, compared bitwise
        actual = value_loss_fields(values, old_values, returns, mask, ctx.lengths, knobs, dtype=ctx.dtype)
    else:
        sums = _sums(ctx, values, old_values, returns, mask, knobs)
        actual = value_fields_from_sums(sums, knobs)
        bound = value_bounds(sums, actual, list(expected), knobs, ctx.precision)
    names = list(expected)
    field = ctx.field(STAGE, "value", PER_SCALAR, [expected[f] for f in names],
                      torch.tensor([float(actual[f]) for f in names], dtype=torch.float64), labels=names,
                      bound=torch.tensor([bound[f] for f in names], dtype=torch.float64) if bound else None,
                      note=f"vf aggregated {knobs.loss_agg_mode} (× {knobs.loss_scale:g}), clip fraction "
                           f"{knobs.metric_agg_mode}; value_clip {knobs.value_clip}")

    def fail_reason(total, per) -> str:
        return "value loss field mismatch: " + ", ".join(f for f, b in zip(names, field.bad.tolist()) if b)

    return ctx.report(StageId.LOSS_VALUE, [field], fail_reason=fail_reason,
                      pass_reason=f"{len(names)} field(s) over {ctx.n} sample(s) compared")


def _value_requirements(reader: BundleReader) -> list[str]:
    missing = [reader.payload_label(p) for p in VALUE_PAYLOADS if not reader.has_payload(p)]
    missing += count_requirements(reader.index.config) + partition_requirements(reader)
    if not any(f in reader.expected.get(STAGE, {}) for f in VALUE_FIELDS):
        missing.append(f"expected.json $.{STAGE}.vf_loss")
    return missing


LOSS_VALUE = StageDef(
    id=StageId.LOSS_VALUE, run=run_loss_value, needs=(StageId.SAMPLE,), cohort_level=True,
    requirements=_value_requirements, description="clipped value loss (PPO), aggregated like the policy loss",
)
