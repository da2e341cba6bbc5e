"""Under ``--chain``: which failing stages fail only because an upstream stage failed.

Definition. Under ``--chain`` each stage consumes what the stages before it recomputed. A failing stage is
**downstream** of an upstream one when (1) a stage before it failed and (2) it passes when re-judged on its
*recorded* inputs (teacher forcing: exactly how the default mode judges it) on every rank shard: the recorded
values it was given are consistent with its own recorded outputs, so its only disagreement with the recorded
step is the upstream stage's wrong output flowing in. It is marked ``downstream_of`` the nearest failing stage
before it that is itself a root cause (the first failing stage always is). A stage that fails on its recorded
inputs too, or cannot be judged on them (its recorded input is absent, so both modes consume the same
recomputed value), stays a root cause. Its status stays ``fail``: under ``--chain`` it does diverge.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import msgspec

from ..judge.report import STATUS_FAIL, StageReport
from ..bundle.schema import StageId
from ..stages import REGISTRY, StageContext, StageInputError


def teacher_forced(ctx: StageContext) -> StageContext:
    """A context of the same shard and selection that judges on recorded inputs, holding the chained run's
    recomputed outputs (a stage reads them only where the bundle records no input, as the default mode does)."""
    tf = StageContext(reader=ctx.reader, indices=ctx.indices, partial=ctx.partial, keep=ctx.keep,
                      rules=dataclasses.replace(ctx.rules, chain=False))
    tf.outputs = dict(ctx.outputs)
    tf.completed = set(ctx.completed)
    return tf


def rejudged(stage: str, contexts: Sequence[StageContext]) -> tuple[list[StageContext], bool]:
    """``(teacher-forced contexts with stage judged, whether it passed on all of them)``."""
    judged: list[StageContext] = []
    passed = True
    for ctx in contexts:
        tf = teacher_forced(ctx)
        try:
            result = REGISTRY[StageId(stage)].run(tf)
        except StageInputError:
            passed = False
            continue
        judged.append(tf)
        passed = passed and result.status != STATUS_FAIL
    return judged, passed


def mark_downstream(stages: Sequence[StageReport], contexts: Sequence[StageContext]
                    ) -> tuple[list[StageReport], dict[str, list[StageContext]]]:
    """``(stage reports with downstream_of set, for each root-cause stage the teacher-forced contexts its
    fields were judged on)``."""
    out: list[StageReport] = []
    judged: dict[str, list[StageContext]] = {}
    root: Optional[str] = None
    for s in stages:
        if s.status != STATUS_FAIL:
            out.append(s)
            continue
        tf, passed = rejudged(s.stage, contexts)
        if root is not None and passed:
            out.append(msgspec.structs.replace(s, downstream_of=root))
            continue
        root = s.stage
        judged[s.stage] = tf
        out.append(s)
    return out, judged
