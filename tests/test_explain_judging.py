"""The explanations' judging machinery on hand-built fields (``replay_lib.explain.base``): the pre-pass that
gives a hypothesis up early, and the counts of a field's rows inside its judged blocks. Each is checked against
the plain definition, written out here: a hypothesis survives the pre-pass when it reproduces at least 90 % of
the divergent elements (``ceil(0.9 · n)``), and the counts are those of a mask of the blocks' rows."""

from __future__ import annotations

import math

import pytest
import torch

from replay_lib.explain.base import Hypothesis, _counts, _pre_pass
from replay_lib.judge.fields import PER_TOKEN, FieldResult

N = 400
# three runs of divergent rows, of 10, 6 and 4 rows (20 in all: 18 must be reproduced), far apart
RUNS = [(100, 110), (250, 256), (380, 384)]
BAD = [i for lo, hi in RUNS for i in range(lo, hi)]


def _field(compared=None) -> FieldResult:
    """A per-token field of N rows, two samples, expected 0 everywhere, actual 1 on the rows of ``RUNS``
    (tolerance 0.5: those are the divergent ones)."""
    actual = torch.zeros(N, dtype=torch.float64)
    actual[BAD] = 1.0
    return FieldResult(stage="advantage.kl", name="kl", per=PER_TOKEN, expected=torch.zeros(N, dtype=torch.float64),
                       actual=actual, tolerance=torch.full((N,), 0.5, dtype=torch.float64),
                       sample_ids=["s-0", "s-1"], group_indices=[0, 0], offsets=torch.tensor([0, 200]),
                       lengths=torch.tensor([200, 200]), compared=compared)


def _reproducing(rows: list[int]) -> Hypothesis:
    """Values equal to the recorded (expected) ones on ``rows``, off by 1 elsewhere among the divergent rows."""
    values = torch.zeros(N, dtype=torch.float64)
    values[[i for i in BAD if i not in set(rows)]] = 1.0
    return Hypothesis(stage="advantage.kl", id=f"h{len(rows)}", detail="", values={"kl": values})


def _plain(hyps: list[Hypothesis], f: FieldResult) -> list[bool]:
    """The definition: each hypothesis judged on every divergent row."""
    need = math.ceil(0.9 * len(BAD))
    out = []
    for h in hyps:
        if "kl" not in h.values:
            out.append(False)
            continue
        v = h.values["kl"]
        matched = sum(1 for i in BAD if abs(float(v[i]) - float(f.expected[i])) <= float(f.tolerance[i]))
        out.append(matched >= need)
    return out


@pytest.mark.parametrize("kept", [
    BAD,  # all 20
    BAD[:-2],  # 18 = ceil(0.9 · 20): passes
    BAD[:-3],  # 17: fails
    BAD[2:],  # misses 2 in the largest run, which is judged first: 18, passes
    BAD[3:],  # misses 3 there: given up after the first run
    BAD[:10],  # only the largest run: 10
    [],
])
def test_pre_pass_keeps_exactly_the_hypotheses_that_reproduce_90_percent(kept):
    f = _field()
    hyps = [_reproducing(kept), Hypothesis(stage="advantage.kl", id="other", detail="", values={"x": torch.zeros(N)})]
    plan = [(f, 0.0, 0.0, [(0, N)])]
    assert _pre_pass(plan, hyps) == _plain(hyps, f)
    assert _pre_pass(plan, hyps)[1] is False  # a hypothesis that leaves the field alone keeps its divergences


def test_pre_pass_with_no_divergent_row_keeps_every_hypothesis():
    f = FieldResult(stage="advantage.kl", name="kl", per=PER_TOKEN, expected=torch.zeros(N, dtype=torch.float64),
                    actual=torch.zeros(N, dtype=torch.float64), tolerance=torch.full((N,), 0.5, dtype=torch.float64),
                    sample_ids=["s-0", "s-1"], group_indices=[0, 0], offsets=torch.tensor([0, 200]),
                    lengths=torch.tensor([200, 200]))
    assert _pre_pass([(f, 0.0, 0.0, [(0, N)])], [_reproducing([])]) == [True]


def _mask_counts(f: FieldResult, blocks) -> tuple[int, int]:
    inside = torch.zeros(f.size, dtype=torch.bool)
    for lo, hi in blocks:
        inside[lo:hi] = True
    compared = inside if f.compared is None else inside & f.compared
    return int(compared.sum()), int((f.bad & inside).sum())


@pytest.mark.parametrize("blocks", [
    [(0, N)],
    [(0, 50), (95, 105), (250, 251), (383, 400)],  # cuts through the runs
    [(110, 250)],  # none divergent
    [],
])
@pytest.mark.parametrize("with_compared", [False, True])
def test_counts_inside_blocks_equal_a_mask_of_their_rows(blocks, with_compared):
    compared = None
    if with_compared:
        compared = torch.ones(N, dtype=torch.bool)
        compared[::3] = False  # every third row not compared (its divergence does not count)
    f = _field(compared)
    assert _counts(f, blocks) == _mask_counts(f, blocks)
    if blocks == [(0, 50), (95, 105), (250, 251), (383, 400)] and not with_compared:
        assert _counts(f, blocks) == (50 + 10 + 1 + 17, 5 + 1 + 1)  # rows 100-104, 250, 383
