"""Train–inference mismatch over a run: each step's rollout-vs-old log-prob mismatch, the series, its class.

Per bundle that records ``rollout_log_probs`` (the engine's log-probs of the sampled tokens) beside
``old_log_probs`` (the trainer's), over its loss tokens, with d = old − rollout in float64:

* ``max_abs`` = max |d|; ``k3`` = mean(exp(d) − 1 − d), the estimator of KL(π_old ‖ π_rollout) the frameworks
  log; ``count`` = how many loss tokens have d ≠ 0; ``tokens`` = how many loss tokens there are.

Over a run, the step bundles in (rollout_id, step_id) order give a series of ``max_abs``; :func:`classify`
names its shape (SPEC §9), by this rule, on the values m_1 … m_n (n ≥ 3; fewer: ``too few steps``):

1. ``zero`` — every m_i = 0 (bitwise on-policy);
2. ``constant offset`` — max(m) − min(m) ≤ 10% of median(m): the same mismatch every step, as a quantized
   (e.g. FP8) rollout engine gives;
3. ``jump at step k`` — the largest change between consecutive steps, |m_k − m_{k−1}| (the first if tied), is
   at least half the range max(m) − min(m) and at least 5× the median of the other consecutive changes (or the
   others are all 0): one step where it changed at once (stale weights, a KV-cache bug) — a spike or a level
   shift;
4. ``drift`` — Kendall's τ of (i, m_i) is ≥ 0.6 in absolute value (τ = (concordant − discordant) pairs / all
   pairs, ties counting neither): it grows (or shrinks) steadily over the run;
5. ``no pattern`` otherwise.

Nothing here imports torch at module import (the scan's CLI lists and prints without it).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

CONSTANT_RELATIVE_RANGE = 0.10
JUMP_SHARE_OF_RANGE = 0.5
JUMP_OVER_OTHER_CHANGES = 5.0
DRIFT_TAU = 0.6
MIN_STEPS = 3

ZERO, CONSTANT, JUMP, DRIFT, NO_PATTERN, TOO_FEW = (
    "zero", "constant offset", "jump", "drift", "no pattern", "too few steps")


@dataclass(frozen=True)
class StepMismatch:
    max_abs: float
    k3: float
    count: int
    tokens: int

    def to_json(self) -> dict:
        return {"max_abs": self.max_abs, "k3": self.k3, "count": self.count, "tokens": self.tokens}


def mismatch_of(old, rollout, mask) -> StepMismatch:
    """The mismatch of one bundle's tokens (tensors of one token axis; ``mask`` non-zero on loss tokens)."""
    import torch

    keep = torch.as_tensor(mask).reshape(-1) != 0
    d = (torch.as_tensor(old).reshape(-1).to(torch.float64)[keep]
         - torch.as_tensor(rollout).reshape(-1).to(torch.float64)[keep])
    if d.numel() == 0:
        return StepMismatch(0.0, 0.0, 0, 0)
    return StepMismatch(float(d.abs().max()), float((torch.expm1(d) - d).mean()), int((d != 0).sum()),
                        int(d.numel()))


def stage_mismatch(report) -> Optional[StepMismatch]:
    """The mismatch the replay's own ``logprob.mismatch`` stage measured (``report``: a
    :class:`~replay_lib.judge.report.ReplayReport`), ``None`` where it did not run on the whole bundle (not
    planned or not selected, an error, a cohort of several ranks — whose merged summary keeps no batch metric —,
    or a partial selection). Its ``rollout_vs_old`` gives ``max_abs``, ``count`` and ``tokens``, and verl's
    ``rollout_corr/k3_kl`` (Σ k3 over the loss tokens / their count) is :func:`mismatch_of`'s ``k3``."""
    stage = report.stage("logprob.mismatch") if report is not None else None
    summary = getattr(stage, "mismatch", None)
    if not isinstance(summary, dict) or getattr(report, "partial", False):
        return None
    ro, metrics = summary.get("rollout_vs_old"), summary.get("metrics")
    if not isinstance(ro, dict) or not isinstance(metrics, dict) or "rollout_corr/k3_kl" not in metrics:
        return None
    tokens = int(ro["compared"])
    return StepMismatch(float(ro["max_abs_diff"]) if tokens else 0.0,
                        float(metrics["rollout_corr/k3_kl"]) if tokens else 0.0, int(ro["count"]), tokens)


def bundle_mismatch(bundles) -> Optional[StepMismatch]:
    """The mismatch of an opened bundle (a :class:`~replay_lib.bundle.BundleSet`, every rank shard; or one
    reader), ``None`` when it does not record both ``rollout_log_probs`` and ``old_log_probs``."""
    import torch

    shards = bundles.shards if hasattr(bundles, "shards") else [bundles]
    olds, rollouts, masks = [], [], []
    for shard in shards:
        if not {"rollout_log_probs", "old_log_probs"} <= set(shard.payload_names):
            return None
        olds.append(shard.payload("old_log_probs").reshape(-1))
        rollouts.append(shard.payload("rollout_log_probs").reshape(-1))
        packed = shard.packed_mask
        if packed is not None:  # format 1.3: the payload as it is (uint8), no lists; int64 values as 0/1, as below
            masks.append(packed if packed.dtype == torch.uint8 else (packed != 0).to(torch.uint8))
        else:
            try:
                flat = bytearray().join(map(bytearray, (s.loss_mask for s in shard.index.samples)))
            except (ValueError, TypeError):  # a mask value outside 0..255
                flat = bytearray(1 if m else 0 for s in shard.index.samples for m in s.loss_mask)
            masks.append(torch.frombuffer(flat, dtype=torch.uint8) if flat else torch.zeros(0, dtype=torch.uint8))
        if not olds[-1].numel() == rollouts[-1].numel() == masks[-1].numel():
            return None  # the stages say what is wrong with such a bundle
    return mismatch_of(torch.cat(olds), torch.cat(rollouts), torch.cat(masks))


@dataclass(frozen=True)
class Shape:
    """The class of a series: ``kind`` (one of the names above), ``step`` (the index of a jump), ``why`` (one
    line with the numbers the rule compared)."""

    kind: str
    why: str
    step: Optional[int] = None

    def label(self, anchors: Optional[Sequence[str]] = None) -> str:
        if self.kind == JUMP and self.step is not None:
            return f"jump at step {anchors[self.step] if anchors else self.step}"
        return self.kind


def _tau(values: Sequence[float]) -> float:
    n = len(values)
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            s += (values[j] > values[i]) - (values[j] < values[i])
    return s / (n * (n - 1) / 2)


def classify(values: Sequence[float], names: Optional[Sequence[str]] = None) -> Shape:
    """Name the shape of a per-step series by the rule of the module docstring. ``names``: what ``why`` calls
    each step (default: its index)."""
    m = [float(v) for v in values]
    name = (lambda i: names[i]) if names is not None else (lambda i: str(i))
    n = len(m)
    if n < MIN_STEPS:
        return Shape(TOO_FEW, f"{n} step(s) with rollout log-probs; {MIN_STEPS} are needed")
    if any(not math.isfinite(v) for v in m):
        bad = next(i for i, v in enumerate(m) if not math.isfinite(v))
        return Shape(JUMP, f"step {name(bad)} is not finite ({m[bad]})", bad)
    lo, hi, med = min(m), max(m), statistics.median(m)
    span = hi - lo
    if hi == 0:
        return Shape(ZERO, "every step: rollout = old on every loss token")
    if span <= CONSTANT_RELATIVE_RANGE * med:
        return Shape(CONSTANT, f"range {span:.3g} ≤ {CONSTANT_RELATIVE_RANGE:g} × median {med:.3g}")
    changes = [abs(m[i] - m[i - 1]) for i in range(1, n)]
    k = max(range(len(changes)), key=lambda i: (changes[i], -i))
    others = changes[:k] + changes[k + 1:]
    rest = statistics.median(others) if others else 0.0
    if changes[k] >= JUMP_SHARE_OF_RANGE * span and (rest == 0 or changes[k] >= JUMP_OVER_OTHER_CHANGES * rest):
        return Shape(JUMP, f"change {changes[k]:.3g} at step {name(k + 1)} ≥ {JUMP_SHARE_OF_RANGE:g} × range {span:.3g} "
                           f"and ≥ {JUMP_OVER_OTHER_CHANGES:g} × the other changes' median {rest:.3g}", k + 1)
    tau = _tau(m)
    if abs(tau) >= DRIFT_TAU:
        return Shape(DRIFT, f"Kendall τ {tau:+.2f} (|τ| ≥ {DRIFT_TAU:g}): {'growing' if tau > 0 else 'shrinking'}")
    return Shape(NO_PATTERN, f"range {span:.3g}, largest change {changes[k]:.3g} at step {name(k + 1)}, Kendall τ {tau:+.2f}")


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float]) -> str:
    """One character per value, scaled from 0 to the largest (a non-finite value is ``!``)."""
    finite = [v for v in values if math.isfinite(v)]
    top = max(finite) if finite else 0.0
    out = []
    for v in values:
        if not math.isfinite(v):
            out.append("!")
        elif top <= 0:
            out.append(SPARK[0])
        else:
            out.append(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))])
    return "".join(out)


def run_series(rows) -> Optional[dict]:
    """The series over a scan's step rows that carry a mismatch (in the rows' order; ``rows``: ScanRow-like
    objects with ``target`` and ``mismatch``), with its class; ``None`` when no step row carries one."""
    steps = [r for r in rows if getattr(r, "mismatch", None) is not None and r.target.step_id is not None]
    if not steps:
        return None
    anchors = [r.target.anchor for r in steps]
    max_abs = [r.mismatch["max_abs"] for r in steps]
    shape = classify(max_abs, anchors)
    return {"steps": anchors, "max_abs": max_abs, "k3": [r.mismatch["k3"] for r in steps],
            "count": [r.mismatch["count"] for r in steps], "tokens": [r.mismatch["tokens"] for r in steps],
            "class": shape.kind, "class_step": anchors[shape.step] if shape.step is not None else None,
            "label": shape.label(anchors), "why": shape.why}


def series_line(series: dict) -> str:
    """The scan's text line for the series: the sparkline of max |Δ| and the class."""
    return (f"rollout/old log-prob mismatch over {len(series['steps'])} step(s), max |Δ| "
            f"{sparkline(series['max_abs'])} (peak {max(series['max_abs']):.3g}): {series['label']} — {series['why']}")
