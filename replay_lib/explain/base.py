"""What every hypothesis family shares: a :class:`Hypothesis` (alternative values of a stage's fields), the
rows it is judged on (:func:`rows`) and the one judging rule (:func:`score`, :func:`reported`).

A hypothesis gives, for some of a failing stage's fields, the values a known bug would have produced from the
same recorded inputs the stage consumed (teacher forcing). An element *matches* when the recorded value lies
within the element's tolerance of the hypothesis: the stage's own tolerance there (the bundle's ``atol +
rtol·|e|`` plus the error model's rounding bound of the correct formula), or — where the family computes one —
the bundle's part plus the rounding bound of the hypothesized formula, whichever is larger. A field the
hypothesis leaves out keeps the stage's recompute (the bug does not change it): there an element matches when
it passed.

A hypothesis is reported (:func:`reported`) when it explains **most of the divergent elements** and **most of
all compared elements** (``MOST`` = 90 %): a bug that reproduces the recorded values of a PR #65 step on every
sample is reported, one that happens to reproduce one divergent sample of many is not, and so is not one that
fits the divergent elements but breaks the ones that passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from ..judge.error_model import bundle_tolerance
from ..judge.fields import PER_TOKEN, FieldResult
from ..stages import StageContext

# Column of a hypothesis: a tensor over all of a field's rows, or a function of ``(lo, hi)``.
Values = Union[torch.Tensor, Callable[[int, int], torch.Tensor]]

# A hypothesis is reported when it matches at least this share of the divergent and of all compared elements.
MOST = 0.9
# A per-token field longer than this is judged on blocks of rows: around the stage's reported divergences and
# spread evenly over the rest (ROW_BLOCK rows each), this many rows in all — bounded work on million-token
# bundles; per-sample and scalar fields are judged whole.
ROW_BUDGET = 1 << 16
ROW_BLOCK = 1 << 11


@dataclass
class Hypothesis:
    """One known bug: ``values[field name]`` its values of that field, ``bounds[field name]`` (optional) the
    rounding bound of the hypothesized formula per element; ``detail`` the sentence the report prints."""

    stage: str
    id: str
    detail: str
    values: dict[str, Values]
    bounds: dict[str, Values] = field(default_factory=dict)
    # the id of the simpler hypothesis this one extends: reported only when it matches more than that one
    extends: Optional[str] = None
    # a non-finite value of the hypothesis reproduces a recorded non-finite one (NaN for NaN, an infinity of the
    # same sign): a bug whose signature is the NaN itself (loss.grad's 0·NaN), opt-in
    nonfinite_matches: bool = False


@dataclass
class Score:
    matched: int = 0
    of: int = 0
    bad: int = 0
    bad_matched: int = 0
    sampled: bool = False  # judged on blocks of a per-token field's rows, not all of them
    misfit: float = 0.0  # Σ |h − e| / tolerance over the matched elements: between equal counts, lower fits better

    def add(self, other: "Score") -> None:
        self.matched += other.matched
        self.of += other.of
        self.bad += other.bad
        self.bad_matched += other.bad_matched
        self.sampled = self.sampled or other.sampled
        self.misfit += other.misfit


def _read(values: Values, lo: int, hi: int) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values[lo:hi].to(torch.float64)
    return values(lo, hi).to(torch.float64)


def rows(f: FieldResult, positions: Sequence[int] = ()) -> list[tuple[int, int]]:
    """The row ranges ``f`` is judged on: all of it, or for a per-token field over :data:`ROW_BUDGET` rows,
    blocks around ``positions`` (the reported divergences) and blocks spread evenly over the rest."""
    n = f.size
    if f.per != PER_TOKEN or n <= ROW_BUDGET:
        return [(0, n)] if n else []
    starts = {max(0, min(p - ROW_BLOCK // 2, n - ROW_BLOCK)) for p in positions}
    spread = ROW_BUDGET // ROW_BLOCK - len(starts)
    if spread > 0:
        step = (n - ROW_BLOCK) / max(spread - 1, 1)
        starts |= {int(k * step) for k in range(spread)}
    out: list[tuple[int, int]] = []
    for lo in sorted(starts):
        hi = min(lo + ROW_BLOCK, n)
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def divergence_positions(ctx: StageContext, f: FieldResult, divergences) -> list[int]:
    """The rows of ``f`` the stage reported as divergent (their sample and token offset)."""
    if f.per != PER_TOKEN:
        return []
    mine = [d for d in divergences if d.field == f.name and d.token_offset is not None and d.rank == ctx.rank]
    if not mine:
        return []
    index: dict[str, int] = {}
    for sid in {d.sample_id for d in mine}:  # a few reported samples: a C-level search each, not a dict of all
        try:
            index[sid] = f.sample_ids.index(sid)
        except ValueError:
            pass
    return [int(f.offsets[index[d.sample_id]]) + d.token_offset for d in mine if d.sample_id in index]


def _matches(h: Hypothesis, f: FieldResult, w, lo: int, hi: int, atol: float, rtol: float, compared: torch.Tensor):
    """``(ok, diff, tol)`` of hypothesis ``h`` on rows ``[lo, hi)`` of ``f`` (window ``w``): which compared
    elements its values reproduce within their tolerance."""
    value = _read(h.values[f.name], lo, hi)
    tol = w.tolerance
    if f.name in h.bounds:
        own = _read(h.bounds[f.name], lo, hi) + w.expected.abs() * rtol + atol
        tol = torch.maximum(tol, own)
    diff = (value - w.expected).abs()
    ok = compared & (diff <= tol)
    # a side that is not finite makes |h − e| NaN (never within) or ∞ (within an infinite tolerance only): only
    # then are the sides themselves tested
    if bool((ok & (diff == math.inf)).any()):
        ok &= torch.isfinite(value) & torch.isfinite(w.expected)
    if h.nonfinite_matches:
        same = (torch.isnan(value) & torch.isnan(w.expected)) | (torch.isinf(value) & (value == w.expected))
        ok |= compared & same
    return ok, diff, tol


# A divergent element's run is merged with the next one across a gap of fewer rows than this; above this many
# runs (or divergent rows) the pre-pass is skipped: it would cost what the full pass does.
_RUN_GAP = 64
_MAX_RUNS = 512


def _bad_runs(f: FieldResult, blocks: list[tuple[int, int]]) -> Optional[list[tuple[int, int]]]:
    """The row ranges, within ``blocks``, that hold ``f``'s divergent elements (merged across small gaps), or
    ``None`` when there are too many for a pre-pass to be cheap."""
    runs: list[tuple[int, int]] = []
    if not blocks:
        return runs
    idx = torch.nonzero(f.bad).reshape(-1)  # every divergent row, then those inside the (sorted) blocks
    if idx.numel() and (len(blocks) > 1 or blocks[0] != (0, f.size)):
        starts = torch.tensor([lo for lo, _ in blocks], dtype=torch.int64)
        ends = torch.tensor([hi for _, hi in blocks], dtype=torch.int64)
        block = torch.searchsorted(starts, idx, right=True) - 1
        idx = idx[(block >= 0) & (idx < ends[block.clamp(min=0)])]
    if idx.numel() > ROW_BUDGET // 4:
        return None
    for i in idx.tolist():
        if runs and i - runs[-1][1] < _RUN_GAP:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
        if len(runs) > _MAX_RUNS:
            return None
    return runs


def score(ctx: StageContext, fields: Sequence[FieldResult], hypotheses: Sequence[Hypothesis],
          divergences=()) -> list[Score]:
    """Each hypothesis's :class:`Score` over ``fields``, every field read once per row block.

    A pre-pass judges every hypothesis on the divergent elements only (a few rows, usually): one that cannot
    reproduce most of them is never :func:`reported`, whatever the other rows say, so the full pass skips it
    (its score keeps the divergent counts and no matches). The pre-pass reads the same elements the full pass
    would (the divergent ones of the same row blocks) and judges them the same way: the result is unchanged."""
    scores = [Score() for _ in hypotheses]
    policy = ctx.reader.manifest.comparison_policy
    plan = []
    for f in fields:
        if f.length_mismatch is not None:
            continue
        atol, rtol = bundle_tolerance(policy, f.stage, f.name, ctx.rules.tolerance_policy)
        blocks = rows(f, divergence_positions(ctx, f, divergences))
        plan.append((f, atol, rtol, blocks))
    alive = _pre_pass(plan, hypotheses)
    for f, atol, rtol, blocks in plan:
        if sum(hi - lo for lo, hi in blocks) < f.size:
            for s in scores:
                s.sampled = True
        if not any(alive):  # nothing left to judge: only the counts of the rows judged
            n_compared, n_bad = _counts(f, blocks)
            for s in scores:
                s.of += n_compared
                s.bad += n_bad
            continue
        for lo, hi in blocks:
            w = f.window(lo, hi)
            compared = w.compared if w.compared is not None else torch.ones_like(w.bad)
            bad = w.bad
            passed = compared & ~bad
            n_compared, n_bad = int(compared.sum()), int(bad.sum())
            for s, h, live in zip(scores, hypotheses, alive):
                s.of += n_compared
                s.bad += n_bad
                if not live:
                    continue
                if f.name not in h.values:
                    s.matched += int(passed.sum())
                    continue
                ok, diff, tol = _matches(h, f, w, lo, hi, atol, rtol, compared)
                s.matched += int(ok.sum())
                s.misfit += float((diff[ok] / tol[ok].clamp(min=1e-300)).sum())
                s.bad_matched += int((ok & bad).sum())
    return scores


def _counts(f: FieldResult, blocks: list[tuple[int, int]]) -> tuple[int, int]:
    """``(compared, divergent)`` elements of ``f`` in its row ``blocks`` (sorted, disjoint): the rows of each
    kind found by bisecting the blocks' bounds, a few torch calls whatever the number of blocks."""
    if not blocks:
        return 0, 0
    los = torch.tensor([lo for lo, _ in blocks], dtype=torch.int64)
    his = torch.tensor([hi for _, hi in blocks], dtype=torch.int64)

    def inside(mask: torch.Tensor) -> int:
        rows = torch.nonzero(mask).reshape(-1)
        return int((torch.searchsorted(rows, his) - torch.searchsorted(rows, los)).sum())

    compared = sum(hi - lo for lo, hi in blocks) if f.compared is None else inside(f.compared)
    return compared, inside(f.bad)


def _pre_pass(plan, hypotheses: Sequence[Hypothesis]) -> list[bool]:
    """Per hypothesis: whether it reproduces at least :data:`MOST` of the divergent elements of ``plan``'s row
    blocks (all ``True`` when the divergent rows are too many for a cheap pre-pass). The runs holding the most
    divergent rows are judged first, and a hypothesis is given up as soon as it has missed more than
    ``MOST`` allows: on a fault no known bug explains, each is judged on one run, not on every run."""
    windows = []
    for f, atol, rtol, blocks in plan:
        runs = _bad_runs(f, blocks)
        if runs is None:
            return [True] * len(hypotheses)
        for lo, hi in runs:
            w = f.window(lo, hi)
            windows.append((int(w.bad.sum()), f, atol, rtol, lo, hi, w))
    bad_total = sum(n for n, *_ in windows)
    allowed = bad_total - math.ceil(MOST * bad_total)  # the misses a hypothesis may have and still pass
    missed = [0] * len(hypotheses)
    for n_bad, f, atol, rtol, lo, hi, w in sorted(windows, key=lambda x: -x[0]):
        compared = w.compared if w.compared is not None else torch.ones_like(w.bad)
        for k, h in enumerate(hypotheses):
            if missed[k] > allowed:
                continue
            if f.name in h.values:
                ok, _, _ = _matches(h, f, w, lo, hi, atol, rtol, compared)
                missed[k] += n_bad - int((ok & w.bad).sum())
            else:
                missed[k] += n_bad  # the stage's own value, which diverges there
    return [m <= allowed for m in missed]


def reported(s: Score) -> bool:
    """Whether a hypothesis explains most of the divergent elements and most of all compared elements."""
    return s.bad > 0 and s.bad_matched >= math.ceil(MOST * s.bad) and s.matched >= math.ceil(MOST * s.of)


def micro_batches(samples: Sequence) -> Optional[tuple[list[str], torch.Tensor]]:
    """``(micro-batch ids in order of first appearance, the position of each sample's)`` of ``samples`` (records
    with a ``micro_batch_id``), ``None`` when there are none or one records no micro-batch."""
    ids = [s.micro_batch_id for s in samples]
    if not ids or None in ids:
        return None
    where = {mb: k for k, mb in enumerate(dict.fromkeys(ids))}
    return list(where), torch.tensor([where[i] for i in ids], dtype=torch.int64)


def listing(names: Sequence[object], limit: int = 4) -> str:
    """``cb-0, cb-1`` — at most ``limit`` names, then how many more."""
    names = [str(n) for n in names]
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit - 1]) + f", … ({len(names) - limit + 1} more)"


def fmt_number(x: Optional[float]) -> str:
    """A knob's value as a person writes it: ``0.2``, ``1e-06``, ``3``."""
    if x is None:
        return "off"
    return f"{x:g}"
