"""Explaining a divergence (SPEC §10): which known bug reproduces a failing stage's recorded values.

For each failing stage, the hypotheses of its family (one module each: :mod:`.reward`, :mod:`.kl`,
:mod:`.advantage`, :mod:`.loss`, :mod:`.grad`) are evaluated in float64 from the recorded inputs the stage
consumed and judged against its recorded values with the error model's tolerance (:mod:`.base`: an element matches within its
tolerance; a hypothesis is reported when it matches most — 90 % — of the divergent elements and of all
compared ones; in a cohort, over the rank shards where the stage fails). The report carries them as ``explanations: [{stage, hypothesis, matched, of, detail, unit,
rank}]``, best first, at most :data:`MAX_PER_STAGE` per stage; none is a valid answer ("no known cause
matches").

Cost: only failing stages are evaluated; a per-token field of more than ``base.ROW_BUDGET`` rows is judged on
blocks of that many rows (``unit`` then says ``sampled tokens``); the loss variants share one pass over the
tokens.

Under ``--chain`` a failing stage that passes on its recorded inputs is marked downstream instead
(:mod:`.downstream`) and not explained; the others are explained on their recorded inputs too.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import msgspec

from ..judge.error_model import Rules
from ..judge.fields import PER_SAMPLE, PER_SCALAR, PER_TOKEN, FieldResult
from ..judge.report import STATUS_FAIL, Explanation, ReplayReport
from ..stages import STAGE_ORDER, StageContext
from . import advantage, grad, kl, loss, mismatch, reward
from .base import Hypothesis, Score, reported, score
from .downstream import mark_downstream

MAX_PER_STAGE = 3

FAMILIES: dict[str, Callable[[StageContext, list[FieldResult]], list[Hypothesis]]] = {
    reward.STAGE: reward.hypotheses,
    kl.STAGE: kl.hypotheses,
    advantage.STAGE: advantage.hypotheses,
    loss.STAGE: loss.hypotheses,
    grad.STAGE: grad.hypotheses,
}


def _unit(fields: Sequence[FieldResult], sampled: bool) -> str:
    pers = {f.per for f in fields}
    if pers == {PER_SAMPLE}:
        return "samples"
    if pers == {PER_TOKEN}:
        return "sampled tokens" if sampled else "tokens"
    if pers == {PER_SCALAR}:
        return "loss fields"
    return "sampled values" if sampled else "values"


def explain_stage(stage: str, contexts: Sequence[StageContext], divergences=()) -> list[Explanation]:
    """The reported hypotheses of one failing stage over its shards' contexts (whose ``fields[stage]`` hold what
    it compared, judged on its recorded inputs), best first."""
    if stage == mismatch.STAGE:  # the oracle's differences: judged on themselves (tolerance 0), not as hypotheses
        return mismatch.explain(contexts)
    family = FAMILIES.get(stage)
    if family is None:
        return []
    totals: dict[str, Score] = {}
    first: dict[str, Hypothesis] = {}
    order: list[str] = []
    fields_seen: list[FieldResult] = []
    ranks: dict[str, set] = {}
    for ctx in contexts:
        fields = ctx.fields.get(stage) or []
        if not fields:
            continue
        hyps = family(ctx, fields)
        scores = score(ctx, fields, hyps, divergences)
        if not any(s.bad for s in scores):
            continue  # a shard where the stage passed: its bug is elsewhere (a cohort's other ranks)
        fields_seen += fields
        for h, s in zip(hyps, scores):
            if h.id not in totals:
                totals[h.id], first[h.id] = Score(), h
                order.append(h.id)
                ranks[h.id] = set()
            totals[h.id].add(s)
            ranks[h.id].add(ctx.rank)
    found = [i for i in order if reported(totals[i])]
    # a hypothesis that extends a simpler one is kept only when it explains more (never two alike, the longer first)
    found = [i for i in found if (base := first[i].extends) is None or base not in found
             or totals[i].matched > totals[base].matched]
    found.sort(key=lambda i: (-totals[i].matched / max(totals[i].of, 1), -totals[i].bad_matched, totals[i].misfit,
                              order.index(i)))
    out = []
    for i in found[:MAX_PER_STAGE]:
        s = totals[i]
        rank = next(iter(ranks[i])) if len(ranks[i]) == 1 and len(contexts) > 1 else None  # one failing rank
        out.append(Explanation(stage=stage, hypothesis=i, matched=s.matched, of=s.of, detail=first[i].detail,
                               unit=_unit(fields_seen, s.sampled), rank=rank))
    return out


def annotate(report: ReplayReport, contexts: Sequence[Optional[StageContext]], rules: Rules,
             explain: bool = True) -> ReplayReport:
    """``report`` with its failing stages explained and, under ``--chain``, the downstream ones marked."""
    live = [c for c in contexts if c is not None]
    if report.passed or not live:
        return report
    stages = report.stages
    if rules.chain:
        stages, judged = mark_downstream(stages, live)
    else:
        judged = {s.stage: live for s in stages if s.status == STATUS_FAIL}
    explanations: list[Explanation] = []
    if explain:
        order = {s.value: k for k, s in enumerate(STAGE_ORDER)}
        for s in sorted(stages, key=lambda s: order.get(s.stage, len(order))):
            if s.status == STATUS_FAIL and s.downstream_of is None and s.stage in judged:
                explanations += explain_stage(s.stage, judged[s.stage], s.divergences)
    return msgspec.structs.replace(report, stages=list(stages), explanations=explanations)


__all__ = ["MAX_PER_STAGE", "annotate", "explain_stage"]
