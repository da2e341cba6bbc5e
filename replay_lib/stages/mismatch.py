"""``logprob.mismatch`` (SPEC §4.4): the engine's log-probs of the sampled tokens (``rollout_log_probs``) against the
trainer's (``old_log_probs``; the first minibatch's ``log_probs`` when recorded), on the loss tokens.

It runs whenever a bundle holds ``rollout_log_probs`` and ``old_log_probs`` (declared or not), and always
reports, in its reason and in the report's JSON (``stages[].mismatch``): per pair, the count of loss tokens
whose values differ bit for bit, the max |Δ|, the max distance in ulps and the first differing (sample, token);
and the frameworks' mismatch metrics recomputed in float64 (``kernels.mismatch.METRICS``).

* Recorded metrics (``expected.json $.logprob.mismatch.<metric key>``, the frameworks' own keys) are compared
  like any field: the bundle's ``atol + rtol·|e|`` plus the float32 rounding bound of the metric
  (:func:`metric_bound`). A key this engine does not know is listed in the JSON, not compared. Without recorded
  metrics the stage reports and passes. Under a partial selection (``--sample/--group/--batch``) the batch
  metrics are not compared (they are the whole batch's).
* The oracle: ``config.true_on_policy: true`` or ``--bitwise`` makes every loss token where
  ``rollout_log_probs`` and ``old_log_probs`` differ a divergence (tolerance 0), the first sample and token
  named, the count and the max ulp in the reason.
* Async lints (hazards, never failures), where ``policy_versions`` is recorded: ``policy_lag`` — a token sampled
  more than ``config.max_policy_lag`` versions behind ``config.policy_version``; ``stale_anchor`` — stale tokens
  while the ratio is anchored on the trainer's recompute alone (no importance correction, no rollout log-probs
  as the old policy: miles#1829).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import msgspec
import torch

from ..bundle import BundleReader
from ..bundle.schema import StageId
from ..judge.fields import PER_SAMPLE, PER_SCALAR, PER_TOKEN
from ..bundle.loss_knobs import LossKnobs
from ..kernels.loss import importance_weight
from ..judge.report import StageReport
from ..kernels import token_chunks
from ..kernels.mismatch import (IS_NORM_METRIC, METRICS, MISMATCH_CHUNK, VERL_ROLLOUT_CORR, DifferenceSummary, MaskedBits, MismatchScan,
                               chunk_samples, is_batch_norm_factor, segment_add)
from ..safe_text import safe
from .base import StageContext, StageDef, StageInputError

STAGE = StageId.LOGPROB_MISMATCH.value
INPUTS = ("rollout_log_probs", "old_log_probs")


def applies(reader: BundleReader) -> bool:
    """The stage runs on this bundle: it holds both log-prob payloads it compares."""
    return all(reader.has_payload(p) for p in INPUTS)


def bitwise_requested(ctx: StageContext) -> bool:
    return bool(getattr(ctx.rules, "bitwise", False)) or ctx.config.true_on_policy is True


def _locate(ctx: StageContext):
    ends = ctx.offsets + ctx.lengths

    def sample_of(token: int) -> tuple[str, int]:  # (the token axis's sample ids are not built for this)
        s = int(torch.searchsorted(ends, token, right=True))
        return ctx.sample_ids[s], int(token - int(ctx.offsets[s]))
    return sample_of


def metric_bound(value: float, cond: float, tokens: int, longest: int, precision) -> float:
    """The float32 producer's rounding bound of one metric: each term rounds a few times relative to ``cond``
    (:func:`kernels.mismatch.metric_condition`), a sum over ``tokens`` accumulates ``⌈log2 tokens⌉`` roundings
    (pairwise), and a sequence sum (chi2_seq) over up to ``longest`` tokens feeds an exp."""
    u_t, u_a = precision.token, precision.reduce
    depth = math.ceil(math.log2(tokens + 1)) + 1
    size = cond + (abs(value) if math.isfinite(value) else 0.0)
    return 8.0 * (u_t + depth * u_a) * size * (1.0 + 2.0 * u_t * longest * cond)


def _lints(ctx: StageContext) -> None:
    cfg = ctx.config
    if not ctx.has("policy_versions") or cfg.policy_version is msgspec.UNSET:
        return
    versions = ctx.payload("policy_versions").to(torch.int64)
    on = ctx.loss_mask > 0
    lag = (int(cfg.policy_version) - versions).masked_fill(~on, 0)
    stale = lag > 0
    bound = cfg.max_policy_lag
    if bound is not msgspec.UNSET and bool((lag > int(bound)).any()):
        over = lag > int(bound)
        first = int(over.nonzero()[0])
        sample, token = _locate(ctx)(first)
        ctx.hazard(STAGE, "policy_lag", sample=ctx.sample_ids.index(sample), message=(
            f"{int(over.sum())} loss token(s) sampled more than max_policy_lag={int(bound)} version(s) behind the "
            f"trainer's policy_version={int(cfg.policy_version)} (max lag {int(lag.max())}); first at sample "
            f"{safe(sample)} token {token}"))
    anchored = LossKnobs.of(cfg).is_level is None and not cfg.use_rollout_logprobs
    if anchored and bool(stale.any()):
        ctx.hazard(STAGE, "stale_anchor", message=(
            f"{int(stale.sum())} loss token(s) sampled by an older policy (max lag {int(lag.max())}) while the ratio "
            "is anchored on the trainer's recompute alone: no importance correction (is_level, use_tis) and no "
            "rollout log-probs as the old policy (use_rollout_logprobs)"))


def _corrected(w: torch.Tensor, k: LossKnobs) -> torch.Tensor:
    """The weight after the correction (``kernels.loss.importance_weight`` past its ``exp``): truncate = clamp to
    ``[is_low, is_high]``, mask = ``w·1[is_low ≤ w ≤ is_high]``."""
    if k.is_mode == "truncate":
        return w.clamp(min=k.is_low, max=k.is_high) if k.is_low is not None or k.is_high is not None else w
    keep = torch.ones_like(w, dtype=torch.bool)
    if k.is_low is not None:
        keep &= w >= k.is_low
    if k.is_high is not None:
        keep &= w <= k.is_high
    return w * keep.to(w.dtype)


class _Weights:
    """Per sample, the train/rollout importance weight before and after the correction's clamp or mask, and the
    share of its loss tokens the correction changed — for the views (two per-sample fields that compare nothing:
    the loss stage judges the corrected loss). Token level: the mean over the sample's loss tokens of the raw
    ``exp(old − rollout)`` and of the applied weight; sequence / geometric: the sample's one weight
    (``exp`` of the sum, or of the mean, of ``old − rollout``)."""

    def __init__(self, n: int, knobs: LossKnobs) -> None:
        self.knobs = knobs
        self.sums = torch.zeros((4, n), dtype=torch.float64)  # Σ raw·m, Σ applied·m, Σ changed·m, Σ m; or Σ d·m

    def add(self, d: torch.Tensor, e: torch.Tensor, on: torch.Tensor, seg: torch.Tensor) -> None:
        """``d`` = old − rollout and ``e`` = exp(d) of a chunk (0 and 1 off the loss tokens)."""
        m = on.to(torch.float64)
        if self.knobs.is_level == "token":
            k = self.knobs
            clamped = e
            if k.is_log_clamp is not None and bool((d.abs() > k.is_log_clamp).any()):
                clamped = torch.exp(d.clamp(-k.is_log_clamp, k.is_log_clamp))
            corrected = _corrected(clamped, k)
            applied = corrected if k.is_norm is None else corrected / k.is_norm  # the recorded batch mean
            rows = (e * m, applied * m, (corrected != clamped).to(torch.float64) * m, m)
        else:
            rows = (d * m, m, m, m)
        segment_add(self.sums, rows, seg)

    def fields(self, ctx: StageContext) -> list:
        k = self.knobs
        count = self.sums[3]
        if k.is_level == "token":
            n = count.clamp(min=1)
            raw, applied, changed = self.sums[0] / n, self.sums[1] / n, self.sums[2] / n
            what = "mean over the sample's loss tokens of the raw exp(old − rollout) (expected) and of the weight applied"
        else:
            log_w = self.sums[0] / count.clamp(min=1) if k.is_level == "geometric" else self.sums[0]
            raw = torch.exp(log_w)
            clamped = torch.exp(log_w.clamp(-k.is_log_clamp, k.is_log_clamp)) if k.is_log_clamp is not None else raw
            applied = importance_weight(log_w, k)
            changed = (_corrected(clamped, k) != clamped).to(torch.float64)
            what = f"the sample's {k.is_level} weight, raw (expected) and applied"
        bounds = f"[{k.is_low}, {k.is_high}]"
        none = torch.zeros(ctx.n, dtype=torch.bool)  # shown, never compared: the loss stage judges the correction
        return [
            ctx.field(STAGE, "is_weight", PER_SAMPLE, raw, applied, compared=none, exact=False,
                      note=f"importance weight, {k.is_level} level, {k.is_mode} to {bounds}: {what}"),
            ctx.field(STAGE, "is_changed_fraction", PER_SAMPLE, changed, changed, compared=none, exact=False,
                      note=f"share of the sample's loss tokens whose weight the {k.is_mode} to {bounds} changed"),
        ]


# ``ctx.records`` key of a function of the context returning the stage's view-only FieldResults (``is_weight``,
# ``is_changed_fraction``): they compare nothing, so a replay does not pay for them; a view that shows them
# calls it once (replay_tui/model/recompute.py).
VIEW_FIELDS = f"{STAGE}.view_fields"


def _weight_fields(ctx: StageContext, knobs: LossKnobs) -> list:
    rollout, old = ctx.payload("rollout_log_probs"), ctx.payload("old_log_probs")
    on = ctx.loss_mask > 0
    weights = _Weights(ctx.n, knobs)
    for lo, hi, seg in token_chunks(ctx.lengths, MISMATCH_CHUNK):
        c_on = on[lo:hi]
        d = torch.where(c_on, old[lo:hi], 0.0).to(torch.float64) - torch.where(c_on, rollout[lo:hi], 0.0).to(
            torch.float64)
        weights.add(d, torch.exp(d), c_on, seg)
    return weights.fields(ctx)


def _compare(summary: DifferenceSummary, a: torch.Tensor, b: torch.Tensor, folded, diff: Optional[torch.Tensor],
             on, lo: int, hi: int, big: float, bits=None) -> None:
    """Fold one chunk's ``a`` vs ``b`` into ``summary``: from the finite float64 difference ``diff`` (max
    magnitude ``big``) when there is one (:meth:`DifferenceSummary.add_masked`; ``bits``: the two chunks'
    ``MaskedBits`` when both are float32), else bit for bit on the loss tokens (NaN, infinities)."""
    if diff is not None:
        x, y = bits if bits is not None else (a, b)
        summary.add_masked(x, y, diff, folded.m, folded.count, lo, big)
    else:
        summary.add(a, b, on()[lo:hi], lo)


def run_mismatch(ctx: StageContext) -> StageReport:
    rollout, old = ctx.payload("rollout_log_probs"), ctx.payload("old_log_probs")
    current = ctx.payload("log_probs") if ctx.has("log_probs") else None
    mask = ctx.loss_mask
    on = functools.lru_cache(maxsize=1)(lambda: mask > 0)  # the bool mask, made when a comparison needs it
    locate = _locate(ctx)
    cfg = ctx.config
    knobs = LossKnobs.of(cfg)  # the effective correction (slime's use_tis is token TIS)
    recorded = ctx.reader.expected.get(STAGE, {})
    # verl's batch-normalization factor, recomputed when the config normalizes token or sequence weights
    norm = cfg.is_batch_normalize is True and knobs.is_level in ("token", "sequence")
    known = METRICS + ((IS_NORM_METRIC,) if norm else ())
    names = [k for k in known if k in recorded]
    # verl bypass_mode logs its rollout_corr/* metrics from inside the loss: the current log-probs against the
    # rollout ones, per micro-batch (core_algos.py:2489-2502): not this stage's old-vs-rollout batch formulas
    bypass_metrics = [k for k in names if k in VERL_ROLLOUT_CORR] if cfg.rollout_correction_anchor == "current" else []
    names = [k for k in names if k not in bypass_metrics]
    for k in names:  # a metric is one number (null: NaN, as msgspec writes it)
        if not (recorded[k] is None or isinstance(recorded[k], (int, float))) or isinstance(recorded[k], bool):
            raise StageInputError(f"expected.json $.{STAGE}.{k}: expected a number or null, got "
                                  f"{type(recorded[k]).__name__}", field="metrics")
    # one pass over the tokens, a cache-sized chunk at a time: the differences and every metric's sums
    # the loss mask holds whole numbers (index.json's integers, or the uint8 payload): within [0, 1] it is 0/1
    low, high = (float(v) for v in torch.aminmax(mask)) if mask.numel() else (0.0, 0.0)
    scan = MismatchScan(ctx.n, kl_type=cfg.kl_loss_type, is_level=knobs.is_level, is_mode=knobs.is_mode,
                        is_low=knobs.is_low, is_high=knobs.is_high, condition=bool(names) and not ctx.partial,
                        binary=low >= 0.0 and high <= 1.0)
    ro = DifferenceSummary()
    oc = DifferenceSummary() if current is not None else None
    f32 = rollout.dtype == old.dtype == torch.float32
    for lo, hi, seg in chunk_samples(ctx.lengths, MISMATCH_CHUNK):
        r, o = rollout[lo:hi], old[lo:hi]
        folded = scan.add(r, o, mask[lo:hi], seg)
        o_bits = MaskedBits(o, folded.mi) if f32 and folded.diff is not None else None
        _compare(ro, r, o, folded, folded.diff, on, lo, hi, folded.big,
                 (MaskedBits(r, folded.mi), o_bits) if o_bits is not None else None)
        if oc is not None:
            c = current[lo:hi]
            diff, big = None, math.nan
            if folded.diff is not None:  # the old log-probs' float64 copy of the scan, the current ones beside it
                diff = c * folded.m if c.dtype == torch.float64 else c.to(torch.float64).mul_(folded.m)  # 0 off
                torch.sub(folded.old, diff, out=diff)
                low, high = (float(v) for v in torch.aminmax(diff)) if diff.numel() else (0.0, 0.0)
                big = max(high, -low)
                if not (math.isfinite(low) and math.isfinite(high)):  # a NaN or an infinity: bit for bit
                    diff = None
            bits = (o_bits, MaskedBits(c, folded.mi)) if o_bits is not None and c.dtype == torch.float32 else None
            _compare(oc, o, c, folded, diff, on, lo, hi, big, bits)
    if knobs.is_level is not None:  # the views' per-sample weights: computed when a view asks (VIEW_FIELDS)
        ctx.records[VIEW_FIELDS] = functools.partial(_weight_fields, knobs=knobs)  # of ctx: no reference cycle
    summary: dict = {"rollout_vs_old": ro.as_dict(locate)}
    if oc is not None:
        summary["old_vs_current"] = oc.as_dict(locate)
    bitwise = bitwise_requested(ctx)
    summary["bitwise"] = bitwise
    metrics = scan.metrics()
    if norm:
        metrics[IS_NORM_METRIC] = is_batch_norm_factor(rollout, old, mask, ctx.seg, ctx.n, knobs)
    summary["metrics"] = metrics
    _lints(ctx)

    fields = []
    if bitwise:
        fields.append(ctx.field(STAGE, "rollout_log_probs", PER_TOKEN, old, rollout, compared=on(), exact=True,
                                note="rollout_log_probs (actual) against old_log_probs (expected), bit for bit"))
    unknown = sorted(k for k in recorded if k not in known)
    if unknown:
        summary["unknown_metrics"] = unknown
    if bypass_metrics:
        summary["metrics_not_compared"] = bypass_metrics
    if names and ctx.partial:
        summary["metrics_compared"] = False
        names = []
    if names:
        cond = scan.condition_value()
        tokens = ro.compared
        longest = int(ctx.lengths.max()) if ctx.n else 0
        bound = torch.tensor([metric_bound(metrics[k], cond, tokens, longest, ctx.precision) for k in names],
                             dtype=torch.float64)
        fields.append(ctx.field(STAGE, "metrics", PER_SCALAR, [recorded[k] for k in names],
                                torch.tensor([metrics[k] for k in names], dtype=torch.float64), labels=names,
                                bound=bound, exact=False,
                                note="the frameworks' mismatch metrics, recomputed in float64"))

    def described(d, a: str, b: str) -> str:
        if not d.count:
            return f"{a} = {b} on all {d.compared} loss token(s)"
        first = summary_of(d)
        return (f"{a} ≠ {b} on {d.count} of {d.compared} loss token(s), max |Δ| {d.max_abs:.6g}, max "
                f"{d.max_ulp:g} ulp, first at sample {safe(first[0])} token {first[1]}")

    def summary_of(d):
        return locate(d.first)

    text = described(ro, "rollout_log_probs", "old_log_probs")
    if oc is not None:
        text += "; " + described(oc, "old_log_probs", "log_probs")

    def fail_reason(total, per) -> str:
        parts = []
        for f in fields:
            if not per[f.name].mismatches:
                continue
            if f.name == "rollout_log_probs":
                first = locate(ro.first)
                parts.append(f"true on-policy: {ro.count} loss token(s) where rollout_log_probs ≠ old_log_probs "
                             f"(tolerance 0), max {ro.max_ulp:g} ulp, max |Δ| {ro.max_abs:.6g}; first at sample "
                             f"{safe(first[0])} token {first[1]}")
            else:
                bad = [k for k, b in zip(names, f.bad.tolist()) if b]
                parts.append("mismatch metric(s) differ: " + ", ".join(bad))
        if oc is not None:
            parts.append(described(oc, "old_log_probs", "log_probs"))
        return "; ".join(parts)

    n_metrics = f"; {len(names)} recorded metric(s) compared" if names else ""
    report = ctx.report(StageId.LOGPROB_MISMATCH, fields, fail_reason=fail_reason, pass_reason=text + n_metrics)
    return msgspec.structs.replace(report, mismatch=summary)


def merge_summaries(per_rank: list[StageReport]) -> Optional[dict]:
    """One ``mismatch`` object for a cohort: counts summed, maxima over the ranks, the first rank's first."""
    found = [(r, r.mismatch) for r in per_rank if isinstance(r.mismatch, dict)]
    if not found:
        return None
    if len(found) == 1:
        return found[0][1]
    out = dict(found[0][1])
    for key in ("rollout_vs_old", "old_vs_current"):
        parts = [s[key] for _, s in found if key in s]
        if not parts:
            continue
        merged = {"compared": sum(p["compared"] for p in parts), "count": sum(p["count"] for p in parts),
                  "max_abs_diff": max(p["max_abs_diff"] for p in parts), "max_ulp": max(p["max_ulp"] for p in parts)}
        first = next((p for p in parts if "first_sample" in p), None)
        if first is not None:
            merged.update(first_sample=first["first_sample"], first_token=first["first_token"])
        out[key] = merged
    out.pop("metrics", None)  # a shard's own batch metrics: per rank only
    return out


def _requirements(reader: BundleReader) -> list[str]:
    return [reader.payload_label(p) for p in INPUTS if not reader.has_payload(p)]


LOGPROB_MISMATCH = StageDef(
    id=StageId.LOGPROB_MISMATCH, run=run_mismatch, needs=(StageId.SAMPLE,), requirements=_requirements,
    description="rollout vs trainer log-probs: counts, max |Δ| and ulp, the frameworks' mismatch metrics",
    any_cp=True, optional=True,
)
