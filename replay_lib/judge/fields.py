"""One shape for what a stage compared: a :class:`FieldResult` per field, and the stage's report built from them.

Every stage leaves its compared fields on the context (``ctx.fields[stage] = [FieldResult, …]``) and builds its
:class:`~replay_lib.judge.report.StageReport` from them with :func:`stage_report`; the text report, ``--format json``
and the debugger's panes all read the same objects, so no view re-derives a stage's expected or actual values
(and none needs to know what a stage computes).

A field is three equal-length float64 columns — ``expected`` (what the bundle recorded), ``actual`` (what the
replay recomputed) and ``tolerance`` (the effective per-element bound: the bundle's ``atol + rtol·|e|`` plus
the producer's rounding bound, see ``replay_lib.judge.error_model``) — and the map from elements to samples:

* ``per="token"``: element ``t`` is a response token; ``offsets``/``lengths`` place it in its sample;
* ``per="sample"``: element ``i`` is sample ``sample_ids[i]``;
* ``per="scalar"``: cohort scalars, named by ``labels`` (the loss fields), no sample.

A column may be held as a tensor of any floating dtype (a memory-mapped float32 payload is not copied) or as a
function ``(lo, hi) → float64 tensor`` evaluated a chunk at a time: a million-token field is judged without
materializing full-length float64 temporaries. The derived columns — ``abs_error``, ``bad``, ``noise_ratio``
— are computed on first use. The rule, in one place (:func:`judge`): an element is bad when either side is
NaN or ±Inf, or ``|a − e| > tolerance`` (under ``--exact``: when ``a`` and ``e`` differ bitwise).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from .compare import CHUNK, Comparison
from .report import STATUS_FAIL, STATUS_PASS, Divergence, StageReport

PER_TOKEN = "token"
PER_SAMPLE = "sample"
PER_SCALAR = "scalar"
PERS = (PER_TOKEN, PER_SAMPLE, PER_SCALAR)

Column = Union[torch.Tensor, Callable[[int, int], torch.Tensor]]


def judge(expected: torch.Tensor, actual: torch.Tensor, tolerance: torch.Tensor, exact: bool = False):
    """The one divergence rule, on float64 tensors: ``(abs_error, finite, bad)``. ``abs_error`` is
    ``|a − e|`` (NaN/Inf where a side is not finite); ``bad``: a side is NaN or ±Inf, or ``|a − e| > tolerance``
    (a NaN tolerance admits nothing), or, ``exact``, the two differ bitwise."""
    diff, finite, bad, _ = _judge(expected, actual, tolerance, exact)
    return diff, finite, bad


def _judge(expected: torch.Tensor, actual: torch.Tensor, tolerance: torch.Tensor, exact: bool):
    """:func:`judge`, and the largest ``|a − e|`` when every element is finite (``None`` otherwise)."""
    diff = (actual - expected).abs()
    # the largest |a − e| (a max propagates NaN) is finite exactly when both sides are finite everywhere, but for
    # two finite values more than the largest double apart: the usual all-finite window takes that one reduction
    # (its value is the window's largest error), any other the tests per element
    top = float(diff.max()) if diff.numel() else 0.0
    all_finite = top < math.inf
    if all_finite:
        finite = torch.ones(diff.shape, dtype=torch.bool)
    else:
        finite = torch.isfinite(actual) & torch.isfinite(expected)
    if exact:
        differ = actual.view(torch.int64) != expected.view(torch.int64)
    else:
        differ = ~(diff <= tolerance)
    return diff, finite, differ if all_finite else ~finite | differ, top if all_finite else None


def noise_ratio(abs_error: torch.Tensor, tolerance: torch.Tensor) -> torch.Tensor:
    """``|a − e| / tolerance``: 0 where the two are equal, ∞ for a difference against a zero tolerance."""
    ratio = abs_error / tolerance
    return ratio.masked_fill_(abs_error == 0, 0.0)


def _max_noise_ratio(abs_error: torch.Tensor, tolerance: torch.Tensor) -> float:
    """The largest :func:`noise_ratio`. Where ``|a − e| = 0`` the quotient is already 0 unless the tolerance is 0
    (or NaN) too: the plain quotient's max is the answer unless it is NaN (a max propagates NaN), and only then
    are the equal elements masked."""
    top = float((abs_error / tolerance).max())
    return top if top == top else float(noise_ratio(abs_error, tolerance).max())


@dataclass(frozen=True)
class FieldValues:
    """Rows ``[lo, hi)`` of a field: float64 columns and the derived ones."""

    lo: int
    expected: torch.Tensor
    actual: torch.Tensor
    tolerance: torch.Tensor
    abs_error: torch.Tensor
    finite: torch.Tensor
    bad: torch.Tensor
    compared: Optional[torch.Tensor]  # bool: elements the stage compares (None: all of them)
    # the largest |a − e| of the rows when every one is finite (None otherwise, or not known)
    max_error: Optional[float] = None

    @property
    def noise_ratio(self) -> torch.Tensor:
        return noise_ratio(self.abs_error, self.tolerance)

    @property
    def shown_error(self) -> torch.Tensor:
        """``|a − e|`` with NaN where a side is not finite (:attr:`FieldResult.abs_error` of these rows)."""
        return nan_where_not_finite(self.abs_error, self.finite)


def nan_where_not_finite(values: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``values``, NaN where ``finite`` is False (the values themselves when every element is finite)."""
    if bool(finite.all()):
        return values
    return torch.where(finite, values, torch.full_like(values, float("nan")))


class _Columns:
    """All rows of a field, judged once (:meth:`FieldResult._materialize`): the chunk windows as they were judged,
    each whole column concatenated the first time it is read. A window of rows is sliced from the chunks it
    overlaps (a copy only across a chunk boundary), so a view that reads one sample's rows never copies the
    field's million-row columns."""

    _ATTR = {"expected": "expected", "actual": "actual", "tolerance": "tolerance", "diff": "abs_error",
             "finite": "finite", "bad": "bad"}

    def __init__(self, parts: Sequence[FieldValues]) -> None:
        self.parts = list(parts)
        self.starts = [p.lo for p in self.parts]
        self._whole: dict[str, torch.Tensor] = {}

    def column(self, name: str) -> torch.Tensor:
        """Every row of column ``name`` (``diff``: ``|a − e|`` as judged, NaN/Inf where a side is not finite)."""
        whole = self._whole.get(name)
        if whole is None:
            attr = self._ATTR[name]
            if not self.parts:
                whole = torch.empty(0, dtype=torch.bool if name in ("finite", "bad") else torch.float64)
            elif len(self.parts) == 1:
                whole = getattr(self.parts[0], attr)
            else:
                whole = torch.cat([getattr(p, attr) for p in self.parts])
            self._whole[name] = whole
        return whole

    expected = property(lambda self: self.column("expected"))
    actual = property(lambda self: self.column("actual"))
    tolerance = property(lambda self: self.column("tolerance"))
    diff = property(lambda self: self.column("diff"))
    finite = property(lambda self: self.column("finite"))
    bad = property(lambda self: self.column("bad"))

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of column ``name``."""
        whole = self._whole.get(name)
        if whole is not None or not self.parts:
            return self.column(name)[lo:hi]
        attr = self._ATTR[name]
        k = max(0, bisect.bisect_right(self.starts, lo) - 1)
        pieces = []
        while k < len(self.parts) and self.starts[k] < hi:
            part = self.parts[k]
            values = getattr(part, attr)
            a, b = max(lo, part.lo) - part.lo, min(hi, part.lo + values.numel()) - part.lo
            if b > a:
                pieces.append(values[a:b])
            k += 1
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else getattr(self.parts[0], attr)[:0]


@dataclass(frozen=True)
class SampleRuns:
    """A per-token field constant within each sample on every side: float64 ``[samples]`` columns, each token of
    sample ``s`` holding exactly ``expected[s]``, ``actual[s]`` and ``tolerance[s]`` (a reward broadcast over its
    tokens, recorded as such). :func:`compare_field` judges it a sample at a time: the same verdict, counts and
    divergences as a pass over the tokens (the stage checked the recorded side; see ``StageContext.field``)."""

    expected: torch.Tensor
    actual: torch.Tensor
    tolerance: torch.Tensor


def _read(column: Column, lo: int, hi: int) -> torch.Tensor:
    if isinstance(column, torch.Tensor):
        return column[lo:hi].to(torch.float64)
    return column(lo, hi)


def _size(column: Column) -> Optional[int]:
    return int(column.numel()) if isinstance(column, torch.Tensor) else None


def _flat(values) -> Column:
    """A tensor flattened to 1-D, a function as it is, a list as a float64 tensor (``None`` is NaN)."""
    if callable(values) and not isinstance(values, torch.Tensor):
        return values
    from .compare import as_float64

    if isinstance(values, torch.Tensor):
        return values.detach().reshape(-1)
    return as_float64(values)


class FieldResult:
    """One compared field of one stage on one rank shard (see the module docstring).

    ``compared``: bool per element, the elements the stage compares (the others show their values and are
    never bad); ``flagged``: bool per element, elements the stage found broken otherwise (a support-row
    invariant) — counted by the stage's own divergences, shown as divergent by :attr:`divergent`.
    ``exact``: bitwise comparison (``--exact``). ``note``: what the values are, when a table's columns do not
    say it."""

    def __init__(self, *, stage: str, name: str, per: str, expected, actual, tolerance,
                 sample_ids: Sequence[str] = (), group_indices: Sequence[Optional[int]] = (),
                 offsets: Optional[torch.Tensor] = None, lengths: Optional[torch.Tensor] = None,
                 labels: Optional[Sequence[str]] = None, note: str = "", exact: bool = False,
                 rank: Optional[int] = None, compared: Optional[torch.Tensor] = None,
                 flagged: Optional[torch.Tensor] = None, size: Optional[int] = None,
                 runs: Optional[SampleRuns] = None) -> None:
        if per not in PERS:
            raise ValueError(f"per must be one of {', '.join(PERS)}, got {per!r}")
        self.stage, self.name, self.per = stage, name, per
        self._expected, self._actual, self._tolerance = _flat(expected), _flat(actual), _flat(tolerance)
        sizes = [s for s in (_size(self._expected), _size(self._actual)) if s is not None]
        if size is None:
            if not sizes:
                raise ValueError("a FieldResult of functions needs its size")
            size = sizes[0]
        self.size = int(size)
        # expected and recomputed element counts, when they differ (a shape mismatch: nothing is compared)
        counts = (_size(self._expected), _size(self._actual))
        self.length_mismatch: Optional[tuple[int, int]] = counts if None not in counts and counts[0] != counts[1] \
            else None
        self.sample_ids = sample_ids
        self.group_indices = group_indices
        self.offsets = offsets
        self.lengths = lengths
        self.labels = list(labels) if labels is not None else None
        self.note = note
        self.exact = exact
        self.rank = rank
        self.compared = compared
        self.flagged = flagged
        self.runs = runs if per == PER_TOKEN and compared is None and not exact else None
        # ``(lo, hi) → None``: rows [lo, hi) of the memory-mapped payloads behind a per-token field are done with
        # (``StageContext.release``), called behind a pass over a whole step (compare_field, :attr:`bad`) — set by
        # the stage's context (``StageContext.field``) and by the debugger's model, which keeps the field past its
        # stage; otherwise the pages a pass read stay resident until the runner lets them go after the stage.
        self.release: Optional[Callable[[int, int], None]] = None

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"FieldResult({self.stage}.{self.name}, per={self.per}, size={self.size})"

    # -- rows -------------------------------------------------------------------------------------
    def window(self, lo: int = 0, hi: Optional[int] = None) -> FieldValues:
        """Rows ``[lo, hi)`` as float64 columns with their abs error and bad mask."""
        if self.length_mismatch is not None:
            raise ValueError(f"{self.stage}.{self.name}: expected {self.length_mismatch[0]} value(s), "
                             f"recomputed {self.length_mismatch[1]}")
        hi = self.size if hi is None else min(hi, self.size)
        lo = max(0, min(lo, hi))
        compared = self.compared[lo:hi] if self.compared is not None else None
        full = self._full
        if full is not None:  # sliced from the columns already judged: no stage kernel runs again
            return FieldValues(lo=lo, expected=full.rows("expected", lo, hi), actual=full.rows("actual", lo, hi),
                               tolerance=full.rows("tolerance", lo, hi), abs_error=full.rows("diff", lo, hi),
                               finite=full.rows("finite", lo, hi), bad=full.rows("bad", lo, hi), compared=compared)
        e, a = _read(self._expected, lo, hi), _read(self._actual, lo, hi)
        tol = _read(self._tolerance, lo, hi) if not self.exact else torch.zeros_like(e)
        diff, finite, bad, top = _judge(e, a, tol, self.exact)
        if compared is not None:
            bad = bad & compared
        return FieldValues(lo=lo, expected=e, actual=a, tolerance=tol, abs_error=diff, finite=finite, bad=bad,
                           compared=compared, max_error=top)

    def chunks(self, chunk: int = CHUNK) -> Iterator[FieldValues]:
        for lo in range(0, self.size, chunk):
            yield self.window(lo, lo + chunk)

    @property
    def _full(self) -> Optional["_Columns"]:
        return self.__dict__.get("_columns")

    def _materialize(self) -> "_Columns":
        """Every column over all rows, in one pass over the chunks: a function column (a stage kernel) is
        evaluated once for all of them, where reading each column on its own would re-run it per column."""
        full = self._full
        if full is not None:
            return full
        return self._keep(list(self.chunks()))

    def _keep(self, parts: Sequence[FieldValues]) -> "_Columns":
        """The judged windows ``parts`` (every row, in order) kept as the field's own columns."""
        full = _Columns(parts)
        self.__dict__["_columns"] = full
        return full

    @functools.cached_property
    def expected(self) -> torch.Tensor:
        """float64 ``[size]``: what the bundle recorded."""
        return self._materialize().expected

    @functools.cached_property
    def actual(self) -> torch.Tensor:
        """float64 ``[size]``: what the replay recomputed."""
        return self._materialize().actual

    @functools.cached_property
    def tolerance(self) -> torch.Tensor:
        """float64 ``[size]``: the effective bound of each element (0 under ``--exact``)."""
        return self._materialize().tolerance

    @functools.cached_property
    def abs_error(self) -> torch.Tensor:
        """float64 ``[size]``: ``|a − e|`` (NaN where either side is not finite)."""
        full = self._materialize()
        return nan_where_not_finite(full.diff, full.finite)

    @functools.cached_property
    def bad(self) -> torch.Tensor:
        """bool ``[size]``: the compared elements that diverge. A field longer than a chunk keeps only this
        column (1 byte an element), not every float64 column of :meth:`_materialize` (≈ 34 bytes an element):
        a view counts divergences per sample over a whole step and reads the values of one sample's window."""
        full = self._full
        if full is not None or self.size <= CHUNK:
            return self._materialize().bad
        # written in place: a list of per-chunk masks then their concatenation held the column twice at its peak,
        # and thousands of chunk-sized blocks freed on a worker thread stay in its malloc arena
        out, done = torch.empty(self.size, dtype=torch.bool), 0
        for w in self.chunks():
            out[w.lo:w.lo + w.bad.numel()] = w.bad
            done = self._let_go(done, w.lo + w.bad.numel())
        return out

    def _let_go(self, done: int, hi: int) -> int:
        """A pass over the rows has read up to ``hi``: rows ``[done, hi)`` let go (:attr:`release`) once they are
        RELEASE_ROWS or the pass is at its end; returns the rows let go so far."""
        if self.release is not None and hi > done and (hi - done >= RELEASE_ROWS or hi >= self.size):
            self.release(done, hi)  # this pass read these rows of the payloads: let their pages go
            return hi
        return done

    @functools.cached_property
    def noise_ratio(self) -> torch.Tensor:
        """float64 ``[size]``: ``|a − e| / tolerance`` (NaN where either side is not finite)."""
        full = self._materialize()
        return torch.where(full.finite, noise_ratio(full.diff, full.tolerance), torch.full_like(full.diff, float("nan")))

    @functools.cached_property
    def divergent(self) -> torch.Tensor:
        """bool ``[size]``: what a view marks — the bad elements and the ones the stage flagged."""
        return self.bad | self.flagged if self.flagged is not None else self.bad

    # -- the sample map ---------------------------------------------------------------------------
    def sample_of(self, index: torch.Tensor) -> Optional[torch.Tensor]:
        """The sample (index into ``sample_ids``) of each element in ``index``; ``None`` for scalars."""
        if self.per == PER_TOKEN:
            # the last sample starting at or before the token (empty samples share the next one's start)
            return torch.searchsorted(self.offsets, index, right=True) - 1
        if self.per == PER_SAMPLE:
            return index
        return None

    def per_sample_counts(self, which: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """int64 ``[samples]``: how many elements of each sample ``which`` (default :attr:`divergent`) marks;
        ``None`` for scalars."""
        which = self.divergent if which is None else which
        if self.per == PER_SCALAR:
            return None
        if self.per == PER_SAMPLE:
            return which.to(torch.int64)
        n = len(self.sample_ids)
        idx = torch.nonzero(which).reshape(-1)
        return torch.zeros(n, dtype=torch.int64).index_add_(0, self.sample_of(idx), torch.ones_like(idx))

    def element_name(self, i: int) -> str:
        """The divergence field of element ``i``: the label of a scalar row, else the field's name."""
        return self.labels[i] if self.per == PER_SCALAR and self.labels else self.name


# ------------------------------------------------------------------------------------- judging


def _same(a: Column, b: Column) -> bool:
    """Bit for bit the same tensor values, all finite (the usual result of a float32 recompute that is right)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and torch.equal(a, b) and _all_finite(a))


# numpy's isfinite is one pass of a byte per element, torch's an absolute value, a comparison and a reduction (8×
# its time on a 16M-element float32 payload: 36 → 4.8 ms); bfloat16 has no numpy dtype.
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def _all_finite(a: torch.Tensor, chunk: int = 1 << 16) -> bool:
    """``torch.isfinite(a).all()`` a chunk at a time: isfinite of a whole token axis allocates ≈ 6 bytes an element
    (an absolute value and two masks), more than a float32 payload holds."""
    flat = a.reshape(-1) if a.is_contiguous() else None
    if flat is None:
        return bool(torch.isfinite(a).all())
    if flat.dtype in _NUMPY_FLOATS and not flat.requires_grad:
        values = flat.numpy()
        return all(bool(np.isfinite(values[lo:lo + chunk]).all()) for lo in range(0, values.size, chunk))
    return all(bool(torch.isfinite(flat[lo:lo + chunk]).all()) for lo in range(0, flat.numel(), chunk))


# Fields of up to this many elements keep their float64 columns once judged (≈ 34 bytes an element): the
# debugger's model reads a failing field's columns, and a function column (a stage kernel) is not run twice.
# Larger fields are judged a chunk at a time and keep nothing.
KEEP_COLUMNS = 1 << 18
# Rows a pass over a whole field or a step's token axis reads before it lets their payload pages go
# (FieldResult.release, StageContext.token_chunks): a few MiB of each mapped payload, one madvise call per payload
# for 64 chunks.
RELEASE_ROWS = 1 << 20


def compare_field(f: FieldResult, keep: int) -> Comparison:
    """Judge every element of ``f`` a chunk at a time: counts, the largest error and noise ratio, and the
    first ``keep`` divergences with their tolerance and noise ratio."""
    out = Comparison(compared=f.size if f.compared is None else int(f.compared.sum()))
    if f.length_mismatch is not None:
        ne, na = f.length_mismatch
        out.compared = na
        out.mismatches = out.bad_samples = 1
        out.divergences.append(Divergence(
            stage=f.stage, rank=f.rank, field=f.name, expected=float(ne), actual=float(na),
            abs_error=float(abs(ne - na)), message=f"length mismatch: expected {ne} element(s), recomputed {na}",
        ))
        return out
    if f.size == 0:
        return out
    if f.compared is None and _same(f._expected, f._actual):
        out.max_abs_error = out.max_noise_ratio = 0.0
        return out
    if f.runs is not None and f._full is None:
        return _compare_runs(f, f.runs, keep)
    # Judged a chunk at a time. A field of up to KEEP_COLUMNS rows that diverges keeps its columns (the debugger
    # reads a failing field's rows; its kernel is not run again); one that passes keeps nothing, as its full-length
    # columns would be fresh memory on every replay for a field a view may never open (it recomputes on first view).
    small = f.size <= KEEP_COLUMNS and f._full is None
    seen: list[FieldValues] = []
    bad_parts: list[torch.Tensor] = []
    any_nonfinite = False
    done = 0
    for w in (f.chunks() if f._full is None else [f.window()]):
        done = f._let_go(done, w.lo + w.bad.numel())
        if small:
            seen.append(w)
        known = w.compared is None and w.max_error is not None  # every row compared, all finite, its max known
        ok = w.finite if w.compared is None else w.finite & w.compared
        all_ok = known or bool(ok.all())
        if w.compared is None:
            any_nonfinite = any_nonfinite or not all_ok
        else:
            any_nonfinite = any_nonfinite or bool((w.compared & ~w.finite).any())
        err = w.abs_error if all_ok else w.abs_error[ok]
        if err.numel():
            m = w.max_error if known else float(err.max())
            if out.max_abs_error is None or m > out.max_abs_error:
                out.max_abs_error = m
            r = _max_noise_ratio(err, w.tolerance if all_ok else w.tolerance[ok])
            if out.max_noise_ratio is None or r > out.max_noise_ratio:
                out.max_noise_ratio = r
        if bool(w.bad.any()):
            bad_parts.append(torch.nonzero(w.bad).reshape(-1) + w.lo)
    if any_nonfinite:
        out.max_abs_error = out.max_noise_ratio = float("inf")
    if not bad_parts:
        return out
    if small:
        f._keep(seen)
    bad_idx = torch.cat(bad_parts)
    out.mismatches = int(bad_idx.numel())
    samples = f.sample_of(bad_idx)
    out.bad_samples = int(torch.unique(samples).numel()) if samples is not None else out.mismatches
    for k, t in enumerate(bad_idx[:keep].tolist()):
        s = int(samples[k]) if samples is not None else None
        out.divergences.append(_divergence(f, t, s, t - int(f.offsets[s]) if s is not None and f.per == PER_TOKEN
                                           else None))
    return out


def _divergence(f: FieldResult, t: int, sample: Optional[int], offset: Optional[int]) -> Divergence:
    """The report's divergence of element ``t`` of ``f`` (of sample ``sample``, at token ``offset``)."""
    w = f.window(t, t + 1)
    ev, av, tol = float(w.expected[0]), float(w.actual[0]), float(w.tolerance[0])
    finite = math.isfinite(ev) and math.isfinite(av)
    err = abs(av - ev) if finite else None
    return Divergence(
        stage=f.stage, rank=f.rank, sample_id=f.sample_ids[sample] if sample is not None else None,
        group_index=f.group_indices[sample] if sample is not None else None, field=f.element_name(t),
        token_offset=offset, expected=ev, actual=av, abs_error=err, tolerance=tol,
        noise_ratio=(0.0 if err == 0 else err / tol if tol > 0 else math.inf) if finite else None,
    )


def _compare_runs(f: FieldResult, runs: SampleRuns, keep: int) -> Comparison:
    """:func:`compare_field` of a field constant within each sample (:class:`SampleRuns`): each sample judged once
    (:func:`judge`, the same rule on the same values as each of its tokens), counted by its tokens."""
    out = Comparison(compared=f.size)
    lengths = f.lengths
    present = lengths > 0  # a sample without tokens has no element
    diff, finite, bad = judge(runs.expected, runs.actual, runs.tolerance)
    bad = bad & present
    ok = finite & present
    err = diff[ok]
    if err.numel():
        out.max_abs_error = float(err.max())
        out.max_noise_ratio = float(noise_ratio(err, runs.tolerance[ok]).max())
    if bool((present & ~finite).any()):
        out.max_abs_error = out.max_noise_ratio = float("inf")
    if not bool(bad.any()):
        return out
    if f.size <= KEEP_COLUMNS:
        f._materialize()  # a failing field keeps its columns, as the pass over the tokens does
    out.mismatches = int(lengths[bad].sum())
    out.bad_samples = int(bad.sum())
    shown = 0
    for s in torch.nonzero(bad).reshape(-1).tolist():  # the first ``keep`` divergent tokens, in token order
        start, n = int(f.offsets[s]), int(lengths[s])
        out.divergences += [_divergence(f, start + off, s, off) for off in range(min(n, keep - shown))]
        shown += min(n, keep - shown)
        if shown >= keep:
            break
    return out


def compare_fields(fields: Sequence[FieldResult], keep: int) -> tuple[Comparison, dict[str, Comparison]]:
    """``(all fields together, each field's own)``, divergences in field order, ``keep`` in all."""
    total = Comparison()
    per: dict[str, Comparison] = {}
    for f in fields:
        cmp = compare_field(f, keep)
        per[f.name] = cmp
        total.merge(cmp)
    total.divergences = total.divergences[:keep]
    return total, per


ReasonFn = Callable[[Comparison, dict[str, Comparison]], str]


def stage_report(stage: str, fields: Sequence[FieldResult], keep: int, *, fail_reason: Union[str, ReasonFn],
                 pass_reason: Union[str, ReasonFn], structural: Optional[Comparison] = None) -> StageReport:
    """The one way a stage's report is made: its fields judged (:func:`compare_fields`), plus ``structural``
    divergences found without comparing values (a group of the wrong size, a broken support row), listed
    first. ``fail_reason`` / ``pass_reason``: text, or a function of ``(total, per-field comparisons)``."""
    values, per = compare_fields(fields, keep)
    total = Comparison()
    if structural is not None:
        total.merge(structural)
    total.merge(values)
    total.divergences = total.divergences[:keep]
    if structural is not None and structural.compared == 0:
        total.compared = values.compared
    failed = total.mismatches > 0
    reason = fail_reason if failed else pass_reason
    if callable(reason):
        reason = reason(total, per)
    return StageReport(
        stage=stage,
        status=STATUS_FAIL if failed else STATUS_PASS,
        reason=reason,
        mismatches=total.mismatches,
        max_abs_error=total.max_abs_error,
        divergences=total.divergences,
        compared=total.compared,
        max_noise_ratio=total.max_noise_ratio,
    )
