"""Why ``rollout_log_probs`` differs from ``old_log_probs`` when the oracle fails (stage ``logprob.mismatch``,
``--bitwise`` / ``config.true_on_policy``). Each hypothesis is judged on the loss tokens that differ, ``Δ =
rollout − old`` in float64 of the stored values, and reported when it holds on most of them (``base.MOST``):

* ``flat_offset`` — one constant offset on every differing token (a quantized rollout's typical signature:
  miles#1678, 0.271 flat), within the rounding of the stored values (``2·u·(|old| + |rollout|)``);
* ``quantization_lattice`` — the differences sit on a constant grid ``q`` (FP8 rollouts: miles#2722, 0.125
  steps): ``Δ/q`` a whole number within the same rounding, at least two distinct multiples;
* ``first_token`` — the differences concentrate on each sample's first generated token (a prefill/decode
  kernel difference, a stale KV cache or a chunked-prefill boundary);
* ``bf16_rollout`` — the rollout is the trainer's value rounded to bfloat16 (round to nearest even): a dtype
  mismatch, the engine returning bf16 log-probs.

And when the recorded ``rollout_corr/rollout_is_batch_norm_factor`` diverges: ``batch_norm_partial`` — it is the
mean over one micro-batch alone (the samples' ``micro_batch_id``), where verl divides by the whole batch's mean,
all-reduced across DP (``rollout_corr_helper.py:627-655``): a normalizer taken per micro-batch or per rank.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..judge.error_model import UNIT_ROUNDOFF
from ..judge.report import Explanation
from ..stages import StageContext
from ..stages.mismatch import STAGE
from ..bundle.loss_knobs import LossKnobs, micro_batch_partition
from ..kernels.mismatch import IS_NORM_METRIC, differing, is_batch_norm_factor
from ..safe_text import safe
from .base import MOST

U32 = UNIT_ROUNDOFF["float32"]


def _differences(ctx: StageContext) -> Optional[dict]:
    fields = ctx.fields.get(STAGE) or []
    if not any(f.name == "rollout_log_probs" for f in fields):
        return None
    rollout, old = ctx.payload("rollout_log_probs"), ctx.payload("old_log_probs")
    diff = differing(rollout, old, ctx.loss_mask > 0)
    idx = diff.nonzero().reshape(-1)
    r, o = rollout[idx], old[idx]
    r64, o64 = r.to(torch.float64), o.to(torch.float64)
    return dict(idx=idx, r=r, o=o, d=r64 - o64, tol=2 * U32 * (r64.abs() + o64.abs()), ctx=ctx)


def _grid(d: torch.Tensor, tol: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The grid step (the smallest |Δ| above rounding) and, per token, whether Δ is a multiple of it."""
    big = d.abs() > tol
    if not bool(big.any()):
        return 0.0, torch.zeros_like(d, dtype=torch.bool)
    q0 = float(d.abs()[big].min())
    k = torch.round(d / q0)
    q = float(d[big].abs().sum() / k[big].abs().sum())  # the step fitted over every multiple, not one token's
    k = torch.round(d / q)
    slack = float(tol.max())  # the step itself is known to the rounding of the token it came from
    if q <= 16 * slack:  # a "grid" as fine as the stored values' own rounding is no quantization
        return 0.0, torch.zeros_like(d, dtype=torch.bool)
    return q, ((d - k * q).abs() <= tol + slack * k.abs()) & (k != 0)


def _partial_norm_factor(ctx: StageContext) -> Optional[Explanation]:
    """``batch_norm_partial`` (module doc): the recorded factor, when it diverges, against each micro-batch's own."""
    f = next((f for f in ctx.fields.get(STAGE) or [] if f.name == "metrics"), None)
    if f is None or not f.labels or IS_NORM_METRIC not in f.labels:
        return None
    k = f.labels.index(IS_NORM_METRIC)
    partition = micro_batch_partition(ctx.samples)
    if not bool(f.bad[k]) or partition is None:
        return None
    recorded, tol = float(f.expected[k]), float(f.tolerance[k])
    knobs = LossKnobs.of(ctx.config)
    rollout, old, mask = ctx.payload("rollout_log_probs"), ctx.payload("old_log_probs"), ctx.loss_mask
    token_group = torch.tensor(partition, dtype=torch.int64)[ctx.seg]
    groups = len(set(partition))
    for g in range(groups):
        own = is_batch_norm_factor(rollout, old, mask * (token_group == g).to(mask.dtype), ctx.seg, ctx.n, knobs)
        if abs(own - recorded) <= tol:
            name = ctx.samples[partition.index(g)].micro_batch_id
            return Explanation(stage=STAGE, hypothesis="batch_norm_partial", matched=1, of=groups, unit="micro-batches",
                               detail=(f"the recorded {IS_NORM_METRIC} {recorded:.6g} is the mean over micro-batch "
                                       f"{safe(str(name))} alone ({own:.6g}): verl divides by the whole batch's mean, "
                                       "all-reduced across DP (a normalizer taken per micro-batch or per rank)"))
    return None


def explain(contexts: Sequence[StageContext]) -> list[Explanation]:
    norm = [e for e in (_partial_norm_factor(c) for c in contexts) if e is not None]
    parts = [p for p in (_differences(c) for c in contexts) if p is not None and p["idx"].numel()]
    if not parts:
        return norm[:1]
    d = torch.cat([p["d"] for p in parts])
    tol = torch.cat([p["tol"] for p in parts])
    total = int(d.numel())
    out: list[Explanation] = []

    def add(hypothesis: str, matched: int, detail: str) -> None:
        if matched >= MOST * total:
            out.append(Explanation(stage=STAGE, hypothesis=hypothesis, matched=matched, of=total, detail=detail,
                                   unit="differing tokens"))

    offset = float(d.median())
    flat = int(((d - offset).abs() <= tol).sum())
    add("flat_offset", flat, f"a flat offset: rollout = old {offset:+.6g} on the differing loss tokens (a quantized "
        "rollout shifts every log-prob by one constant)")
    q, on_grid = _grid(d, tol)
    multiples = torch.unique(torch.round(d[on_grid] / q)).numel() if q else 0
    if multiples >= 2:
        add("quantization_lattice", int(on_grid.sum()), f"the differences sit on a constant {q:.6g} grid "
            f"({multiples} distinct multiples): a quantized (FP8-like) rollout")
    firsts = 0
    samples = 0
    for p in parts:
        ctx = p["ctx"]
        starts = ctx.offsets[ctx.lengths > 0]
        firsts += int(torch.isin(p["idx"], starts).sum())
        samples += int((ctx.lengths > 0).sum())
    if samples > 1:
        add("first_token", firsts, "the differences sit on each sample's first generated token (prefill vs decode "
            "kernels, a stale KV cache, a chunked-prefill boundary)")
    o = torch.cat([p["o"] for p in parts]).to(torch.float32)
    r = torch.cat([p["r"] for p in parts]).to(torch.float32)
    bf16 = int((o.to(torch.bfloat16).to(torch.float32) == r).sum())
    add("bf16_rollout", bf16, "the rollout log-probs are the trainer's rounded to bfloat16: a dtype mismatch (the "
        "engine returns bf16 log-probs)")
    out.sort(key=lambda e: -e.matched)
    return (norm[:1] + out)[:3]


__all__ = ["explain"]
