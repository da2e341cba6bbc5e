"""The diff viewer: offset | expected | actual | abs err | ×noise | tol | loss mask for one sample's per-token
field (or the per-sample / cohort table of a scalar field), mismatches in red, the error plot over the rows
(``error_plot``) and the why strip under them (``why_strip``). ``tol`` is the element's effective bound (the bundle's atol + rtol·|e| plus the producer's
rounding bound) and ``×noise`` = |a − e| / tol: below 1 the difference is floating-point noise. Line API with an
LRU cache: a 32k-token sample renders only the visible rows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import ClassVar, Optional

import torch

from rich.style import Style
from rich.text import Text
from textual.binding import BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

from replay_lib.judge.report import fmt_value
from replay_lib.safe_text import safe

from ..cells import DIM, FAIL, FAIL_SOFT, PASS, SPARK, WARN, fit, fit_number, fit_ratio, fmt_tolerance, strip_of
from ..model import KIND_SAMPLE, KIND_TOKEN, SUPPORT_STAGE, FieldDiff, ReplayModel
from .cursor_lines import CursorLines
from .error_plot import ErrorStrip
from .header_line import HeaderLine
from .support_strip import SupportStrip
from .why_strip import WhyStrip
from ..keys import DIFF_BINDINGS

__all__ = ["DiffPanel", "DiffView", "ErrorStrip", "WhyStrip"]


# Cells of the optional columns (without the space before each); the numbers must keep NUM_READABLE cells
# ("-0.25078", eight digits and a sign) for an optional column to be shown.
RATIO_W, TOL_W, MASK_W, GROUP_W = 7, 7, 4, 6
GRAD_W = 10  # a loss token's recorded ∂L/∂logp (loss.grad)
NUM_READABLE = 9
NUM_MIN = 7  # a number column narrower than this is not drawn (dropped, not cut)
NUM_SCROLLED = 8  # the numbers' cells once → has scrolled the columns (a narrow pane: fewer digits)
NEAR = 0.5  # a ratio above this is within the tolerance, but no longer deep inside it
NUMBERS = ("expected", "actual", "err")
# What a narrow pane keeps, most valuable first: the recomputed value and its error, then the recorded value
# (the bundle's, beside them), the group, the error model, the mask.
PRIORITY = ("actual", "err", "expected", "group", "noise", "tol", "mask", "grad")
HEADERS = {"grad": "∂L/∂logp", "group": "group", "expected": "expected", "actual": "actual", "err": "abs err", "noise": "×noise",
           "tol": "tol", "mask": "mask"}
SORT_NONE, SORT_ERR = "", "err"


@dataclass(frozen=True)
class Columns:
    """A diff row's layout at one width: the key's cells, then ``(column, cells)`` in display order;
    ``hidden``: columns left out (narrow pane or scrolled past with →)."""

    key: int
    shown: tuple[tuple[str, int], ...]
    hidden: tuple[str, ...] = ()
    at_end: bool = True  # the last column is shown (→ has nothing more to show)
    scrolled: bool = False  # → scrolled past the first columns

    def width_of(self, name: str) -> int:
        return next((w for n, w in self.shown if n == name), 0)

    @property
    def num(self) -> int:
        return self.width_of("actual")

    @property
    def noise(self) -> int:
        return self.width_of("noise")

    @property
    def tol(self) -> int:
        return self.width_of("tol")

    @property
    def mask(self) -> int:
        return self.width_of("mask")


def _ratio_style(ratio: Optional[float], bad: bool) -> Optional[Style]:
    """Red beyond the tolerance, yellow past half of it, dim deep inside it."""
    if bad:
        return FAIL
    if ratio is not None and ratio > NEAR:  # a NaN compares False
        return WARN
    return DIM


def digits_window(text: str) -> Optional[tuple[float, float]]:
    """``(value, half)`` for a typed number: a value matches it "to the digits typed" within ``half``, half a
    unit of the last digit (``0.25`` → ±0.005, ``-5.5`` → ±0.05, ``1e-3`` → ±0.5e-3); None for no number."""
    try:
        d = Decimal(text)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    return float(d), float(Decimal(5).scaleb(d.as_tuple().exponent - 1)) * (1 + 1e-12)


def worst_row(diff: Optional[FieldDiff]) -> Optional[int]:
    """The row with the largest |err| (a non-finite divergent one first; the first of equals)."""
    if diff is None or len(diff) == 0:
        return None
    err = diff.error_tensor
    key = torch.where(torch.isnan(err) & diff.bad_tensor, torch.full_like(err, math.inf), err)
    return int(torch.argmax(torch.nan_to_num(key, nan=-1.0, posinf=math.inf)))


class DiffView(CursorLines):
    """The rows of one :class:`FieldDiff`. The cursor counts *shown* rows: sorted by |err| (``s``) or
    filtered to the divergent ones (``D``), shown row ``i`` is data row ``order[i]`` (a token offset, or a
    row of the table); :attr:`data_row` is the cursor's. Messages carry shown rows; :meth:`row_at` maps
    them back."""

    DEFAULT_CSS = """
    DiffView { overflow-y: scroll; }
    """
    PANE = "diff"
    BINDINGS: ClassVar[list[BindingType]] = DIFF_BINDINGS

    class Export(Message):
        def __init__(self, whole_stage: bool) -> None:
            super().__init__()
            self.whole_stage = whole_stage

    class Copy(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.diff: Optional[FieldDiff] = None
        self._label_width = 6
        self._columns_memo: Optional[tuple] = None  # (diff, (width, col_offset, label width), Columns)
        self.sort: str = SORT_NONE
        self.divergent_only = False
        self.col_offset = 0
        self.log_scale = False
        self.order: Optional[list[int]] = None  # shown row → data row (None: the identity)
        self._shown_of: Optional[dict[int, int]] = None  # data row → shown row

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Enter opens a sample's per-token diff from a per-sample table (or the loss table's per-sample terms);
        # elsewhere it has nothing to open
        if action == "activate":
            return self.diff is not None and self.diff.kind != KIND_TOKEN
        return True

    def watch_cursor(self, old: int, new: int) -> None:
        super().watch_cursor(old, new)
        if isinstance(self.parent, DiffPanel):
            self.parent.cursor_moved()

    def set_diff(self, diff: Optional[FieldDiff], cursor: int = 0, sort: Optional[str] = None) -> None:
        """Show ``diff`` with the cursor on data row ``cursor``; ``sort``: the field's default order (kept
        across fields when None)."""
        was_table = self.diff is not None and self.diff.kind != KIND_TOKEN
        self.diff = diff
        if sort is not None:
            self.sort = sort
        if was_table != (diff is not None and diff.kind != KIND_TOKEN):
            self.refresh_bindings()  # the key bar shows or drops "⏎ Open"
        # the widest row label, once per diff (not per rendered row: a table may list 4,096 samples)
        self._label_width = max((len(safe(x)) for x in diff.labels), default=6) if diff is not None else 6
        self._reorder()
        self.set_rows(self._shown_count(), cursor=self.shown_row(cursor))
        self.center_cursor()

    # -- row order --------------------------------------------------------------------------------
    def _reorder(self) -> None:
        """The shown rows for the sort and filter (a 32k-token sample: one argsort)."""
        diff = self.diff
        self._shown_of = None
        if diff is None or (not self.sort and not self.divergent_only):
            self.order = None
            return
        if self.divergent_only:
            rows = torch.tensor(diff.divergent, dtype=torch.int64)
        else:
            rows = torch.arange(len(diff), dtype=torch.int64)
        if self.sort == SORT_ERR and rows.numel():
            err = diff.error_tensor[rows]
            # a non-finite side (NaN error) is the worst row; stable: equal errors keep offset order
            key = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
            rows = rows[torch.sort(key, descending=True, stable=True).indices]
        self.order = rows.tolist()

    def _shown_count(self) -> int:
        if self.diff is None:
            return 0
        return len(self.order) if self.order is not None else len(self.diff)

    def row_at(self, shown: int) -> int:
        """The data row drawn at shown row ``shown``."""
        if self.order is None:
            return shown
        return self.order[shown] if 0 <= shown < len(self.order) else 0

    @property
    def data_row(self) -> int:
        """The data row under the cursor (a token offset, or a table row)."""
        return self.row_at(self.cursor)

    def shown_row(self, data_row: int) -> Optional[int]:
        """Where data row ``data_row`` is shown; None when the filter hides it."""
        if self.order is None:
            return data_row
        if self._shown_of is None:
            self._shown_of = {r: i for i, r in enumerate(self.order)}
        return self._shown_of.get(data_row)

    def show_row(self, data_row: int) -> None:
        """Cursor to data row ``data_row``, lifting the divergent-only filter when it hides the row."""
        shown = self.shown_row(data_row)
        if shown is None:
            self.divergent_only = False
            self._relayout(data_row)
            return
        self.cursor = shown

    def _relayout(self, keep: int) -> None:
        self._reorder()
        self.set_rows(self._shown_count(), cursor=self.shown_row(keep) or 0)
        self.center_cursor()
        if isinstance(self.parent, DiffPanel):
            self.parent.order_changed()

    # -- layout -----------------------------------------------------------------------------------
    def _columns(self, width: int) -> "Columns":
        """:meth:`_layout` at ``width``, worked out once per width, field and scroll (every row drawn asks)."""
        key = (width, self.col_offset, self._label_width)
        cached = self._columns_memo
        if cached is None or cached[0] is not self.diff or cached[1] != key:
            cached = self._columns_memo = (self.diff, key, self._layout(width))
        return cached[2]

    def key_width(self) -> int:
        """The cells of the row's key (offset, sample or field name), whatever the width."""
        return self._columns(max(self.row_width, 1)).key

    def _layout(self, width: int) -> "Columns":
        """The row's columns at ``width``: the key (offset, sample, field) always, then by value
        (:data:`PRIORITY`) while they fit — the three numbers while each keeps :data:`NUM_MIN` cells, ×noise,
        tol and the loss mask while the numbers keep :data:`NUM_READABLE` (a narrow terminal drops the mask
        first, then tol, ×noise, the group, the recorded value; the recomputed value and its error stay).
        After ``→`` (:attr:`col_offset`), a window over the display order, one column further per press, from
        the first column left out between shown ones (else one column in)."""
        diff = self.diff
        if diff is None or diff.kind == KIND_TOKEN:
            key = max(6, len(str(max(len(diff) - 1, 0))) if diff is not None else 6)
        elif diff.kind == KIND_SAMPLE:
            key = max(6, min(24, self._label_width))
        else:
            key = max(6, min(28, self._label_width))
        room = width - 2 - key  # after the ✗ marker and the key
        order = []  # display order
        if diff is not None and diff.kind == KIND_SAMPLE:
            order.append("group")
        order += list(NUMBERS)
        if diff is not None and diff.tolerance_tensor is not None:
            order += ["noise", "tol"]
        if diff is not None and diff.kind == KIND_TOKEN:
            order.append("mask")
        if diff is not None and diff.grad is not None:  # a loss token's recorded gradient (loss.grad), beside it
            order.append("grad")
        fixed = {"group": GROUP_W, "noise": RATIO_W, "tol": TOL_W, "mask": MASK_W, "grad": GRAD_W}
        base = self._fitted(key, room, order, fixed)
        if self.col_offset and base.hidden:  # (wide enough: nothing to scroll)
            # a window over the display order, one column further per →. It starts at the first column the
            # unscrolled layout left out between shown ones (the recorded value of a narrow table: always reached),
            # else one column in (only columns at the right end were left out: the first → shows them)
            last = max((order.index(n) for n, _ in base.shown), default=-1)
            holes = [i for i, n in enumerate(order) if n in base.hidden and i < last]
            start = holes[0] + self.col_offset - 1 if holes else self.col_offset
            skip = order[:min(start, len(order) - 1)]
            shown: list[tuple[str, int]] = []
            used = 0
            for name in order[len(skip):]:
                w = fixed.get(name, NUM_SCROLLED)
                if used + w + 1 > room:
                    break
                shown.append((name, w))
                used += w + 1
            hidden = tuple(n for n in order if n not in dict(shown))
            return Columns(key, tuple(shown), hidden, at_end=order[-1] not in hidden, scrolled=True)
        return base

    @staticmethod
    def _fitted(key: int, room: int, order: list[str], fixed: dict[str, int]) -> "Columns":
        """The unscrolled layout: the columns by :data:`PRIORITY` while they fit in ``room``, in display order."""
        picked: dict[str, int] = {}

        def numbers_fit(extra: dict[str, int], need: int) -> bool:
            nums = sum(1 for n in NUMBERS if n in extra)
            others = sum(w + 1 for n, w in extra.items() if n not in NUMBERS)
            return nums == 0 or (room - others) // nums - 1 >= need

        for name in PRIORITY:
            if name not in order:
                continue
            trial = dict(picked, **{name: fixed.get(name, 0)})
            if name in NUMBERS or name == "group":
                ok = numbers_fit(trial, NUM_MIN)
            else:  # the error model's columns and the mask: only beside three readable numbers
                ok = all(n in trial for n in NUMBERS) and numbers_fit(trial, NUM_READABLE)
            if ok:
                picked = trial
            elif name != "group":
                break  # a number (or ×noise, tol) that does not fit: none after it is shown either
        nums = [n for n in NUMBERS if n in picked]
        if nums:
            others = sum(w + 1 for n, w in picked.items() if n not in NUMBERS)
            num = max(NUM_MIN, min(15, (room - others) // len(nums) - 1))
            for n in nums:
                picked[n] = num
        shown = tuple((n, picked[n]) for n in order if n in picked)
        return Columns(key, shown, tuple(n for n in order if n not in picked), at_end=order[-1] in picked)

    def render_header(self, width: int, base: Style) -> Strip:
        diff = self.diff
        cols = self._columns(width)
        if diff is None:
            return strip_of([("", None)], width, base)
        if diff.kind == KIND_TOKEN:
            head = fit("offset", cols.key, ">")
        elif diff.kind == KIND_SAMPLE:
            head = fit("sample", cols.key)
        else:
            head = fit("field", cols.key)
        parts = [("  " + head, None)]
        for name, w in cols.shown:
            parts.append((" " + fit(HEADERS[name], w, "<" if name == "group" else ">"), None))
        if cols.scrolled:
            parts[0] = ("←" + parts[0][0][1:], DIM)  # columns scrolled past on the left
        return strip_of(parts, width, base)

    def render_row(self, row: int, width: int, base: Style) -> Strip:
        diff = self.diff
        row = self.row_at(row)
        cols = self._columns(width)
        key = cols.key
        expected, actual, err, bad = diff.row(row)
        marker = ("✗ ", FAIL) if bad else ("  ", None)
        if diff.kind == KIND_TOKEN:
            head = (fit(str(row), key, ">"), FAIL_SOFT if bad else DIM)
        else:  # sample ids and field names from the bundle: escaped before they are cut
            head = (fit(safe(diff.labels[row]), key), FAIL_SOFT if bad else None)
        value_style = FAIL_SOFT if bad else None
        parts = [marker, head]
        tol = ratio = None
        if cols.noise or cols.tol:
            tol, ratio = diff.error_model_row(row)
        for name, w in cols.shown:
            if name == "group":
                parts.append((" " + fit(safe(diff.groups[row]), w), FAIL_SOFT if bad else None))
            elif name == "expected":
                parts.append((" " + fit_number(expected, w), value_style))
            elif name == "actual":
                parts.append((" " + fit_number(actual, w), FAIL if bad else value_style))
            elif name == "err":
                parts.append((" " + fit_number(err, w), FAIL if bad else DIM))
            elif name == "noise":
                parts.append((" " + fit_ratio(ratio, w), _ratio_style(ratio, bad)))
            elif name == "tol":
                parts.append((" " + fit(fmt_tolerance(tol), w, ">"), DIM))
            elif name == "mask":
                m = diff.mask[row]
                parts.append((" " + fit(str(m), w, ">"), None if m else DIM))
            elif name == "grad":
                parts.append((" " + fit_number(float(diff.grad[row]), w), DIM))
        return strip_of(parts, width, base)

    # -- navigation -------------------------------------------------------------------------------
    def jump(self, direction: int) -> bool:
        """Cursor to the next/previous divergent row of this diff (in data order, whatever the sort); False
        when there is none."""
        if self.diff is None:
            return False
        row = self.diff.next_divergence(self.data_row, direction)
        if row is None:
            return False
        self.show_row(row)
        return True

    def find_value(self, text: str) -> Optional[int]:
        """The next data row after the cursor (wrapping) whose expected or actual value matches ``text`` to
        the digits typed (:func:`digits_window`); None when none does."""
        diff = self.diff
        window = digits_window(text)
        if diff is None or len(diff) == 0 or window is None:
            return None
        v, half = window
        hit = ((diff.expected_tensor - v).abs() <= half) | ((diff.actual_tensor - v).abs() <= half)
        rows = torch.nonzero(hit).reshape(-1).tolist()
        if not rows:
            return None
        here = self.data_row
        return next((r for r in rows if r > here), rows[0])

    def row_text(self, row: Optional[int] = None) -> str:
        """One row as text for the clipboard: ``kl s-5@3 expected=… actual=… abs_err=… tol=…``."""
        diff = self.diff
        row = self.data_row if row is None else row
        expected, actual, err, bad = diff.row(row)
        tol, _ = diff.error_model_row(row)
        where = f"{diff.sample_id}@{row}" if diff.kind == KIND_TOKEN else diff.labels[row]
        text = f"{diff.field} {where}: expected={fmt_value(expected)} actual={fmt_value(actual)} " \
               f"abs_err={fmt_value(err)}"
        if tol is not None:
            text += f" tol={fmt_value(tol)}"
        return text + (" divergent" if bad else "")

    # -- actions ----------------------------------------------------------------------------------
    def on_resize(self) -> None:
        super().on_resize()
        if isinstance(self.parent, DiffPanel):
            self.parent.show_state()  # how many columns the new width leaves out

    def action_toggle_sort(self) -> None:
        keep = self.data_row
        self.sort = SORT_NONE if self.sort else SORT_ERR
        self._relayout(keep)

    def action_toggle_divergent(self) -> None:
        if self.diff is None:
            return
        if not self.divergent_only and not self.diff.divergent:
            self.app.bell()
            self.notify("no divergent row in this diff", timeout=2)
            return
        keep = self.data_row
        self.divergent_only = not self.divergent_only
        if self.divergent_only and self.diff.divergent and keep not in self.diff.divergent:
            nxt = self.diff.next_divergence(keep, 1)
            keep = nxt if nxt is not None else self.diff.divergent[-1]
        self._relayout(keep)

    def action_worst(self) -> None:
        row = worst_row(self.diff)
        if row is not None:
            self.show_row(row)

    def action_scroll_columns(self, step: int) -> None:
        if self.diff is None:
            return
        cols = self._columns(self.row_width)
        if step > 0 and cols.at_end:
            return  # the last column is shown already
        n = len(cols.shown) + len(cols.hidden)
        self.col_offset = max(0, min(n - 1, self.col_offset + step))
        self.invalidate()
        if isinstance(self.parent, DiffPanel):
            self.parent.order_changed()

    def action_toggle_log(self) -> None:
        self.log_scale = not self.log_scale
        if isinstance(self.parent, DiffPanel):
            self.parent.order_changed()

    def action_export(self, whole_stage: bool) -> None:
        if self.diff is not None:
            self.post_message(self.Export(whole_stage))

    def action_copy(self, row: bool) -> None:
        if self.diff is None or not self.row_count:
            return
        if row:
            self.post_message(self.Copy(self.row_text()))
        else:
            # the recomputed value in full (Python's shortest repr of its float64, as the export writes it)
            self.post_message(self.Copy(repr(float(self.diff.row(self.data_row)[1]))))

class DiffPanel(Vertical):
    """Title line, error plot, column header, the rows, (for a bundle with support rows) the support strip of
    the token under the cursor, and the why strip: the inputs of the element under the cursor."""

    DEFAULT_CSS = """
    DiffPanel {
        border: round $panel-lighten-2;
        height: 1fr;
        &:focus-within { border: round $accent; }
        #diff-info { height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    }
    """

    def compose(self):
        view = DiffView(id="diff-view")
        yield Static(id="diff-info")
        yield ErrorStrip(view, id="error-strip")
        yield HeaderLine(view, id="diff-header")
        yield view
        yield SupportStrip(view, id="support-strip")
        yield WhyStrip(view, id="why-strip")

    def on_mount(self) -> None:
        self.border_title = "Diff"
        self._message = ""

    @property
    def view(self) -> DiffView:
        return self.query_one(DiffView)

    @property
    def support_strip(self) -> SupportStrip:
        return self.query_one(SupportStrip)

    @property
    def why_strip(self) -> WhyStrip:
        return self.query_one(WhyStrip)

    def set_model(self, model: Optional[ReplayModel]) -> None:
        """The model the support and why strips read their rows from."""
        self.support_strip.model = model
        self.why_strip.model = model

    def show(self, diff: Optional[FieldDiff], cursor: int = 0, message: str = "", sort: Optional[str] = None) -> None:
        view = self.view
        view.set_diff(diff, cursor, sort=sort)
        self._message = message
        self.query_one("#diff-header", HeaderLine).refresh()
        self.query_one(ErrorStrip).refresh()
        self.why_strip.refresh()
        support = self.support_strip
        if support.display != support.wanted:  # a relayout only when the strip appears or goes
            support.display = support.wanted
        support.refresh()
        why = self.why_strip
        # a support field's inputs are its support row, in the strip above: no why strip
        wanted = diff is None or diff.stage != SUPPORT_STAGE
        if why.display != wanted:
            why.display = wanted
        self._info(diff, message)

    def _info(self, diff: Optional[FieldDiff], message: str) -> None:
        """The border title and the line above the plot: what is shown, how many diverge, the view's order."""
        view = self.view
        info = Text(no_wrap=True, overflow="ellipsis")
        if diff is None:
            self.border_title = "Diff"
            info.append(safe(message or "nothing to show"), style="dim")  # it may quote a sample id
        else:
            if diff.kind == KIND_TOKEN:
                # a Text: a str border title is parsed as markup ("[red]…" in a sample id would style it)
                self.border_title = Text(f"Diff · {diff.field} · {safe(diff.sample_id)}")
                info.append(f"{len(diff)} token(s)")
            elif diff.kind == KIND_SAMPLE:
                self.border_title = f"Diff · {diff.field} · all samples"
                info.append(f"{len(diff)} sample(s)")
            else:
                self.border_title = f"Diff · {diff.field} · cohort"
                info.append(f"{len(diff)} field(s)")
            if diff.mismatches:
                info.append(f" · {diff.mismatches} divergent", style="bold red")
            else:
                info.append(" · no divergence", style="green")
            # before the first layout the width is unknown: the resize that follows fills the count in
            cols = view._columns(view.row_width) if view.row_width > 0 else None
            hidden = cols.hidden if cols is not None and not cols.scrolled else ()
            view_state = [w for w, on in (("by |err|", view.sort), ("divergent only", view.divergent_only),
                                          ("log |err|", view.log_scale),
                                          (f"→ {len(hidden)} more column(s)", hidden),
                                          ("← scrolled", cols is not None and cols.scrolled)) if on]
            if view_state:
                info.append(" · " + ", ".join(view_state), style="bold yellow")
            if diff.note:  # after the counts and the view's state, which a narrow pane must not lose
                info.append(f" · {safe(diff.note)}")
            info.append(f" · {diff.stage} atol={diff.atol:g} rtol={diff.rtol:g}", style="dim")
        self.query_one("#diff-info", Static).update(info, layout=False)

    def order_changed(self) -> None:
        """The sort, the filter, the columns or the plot's scale changed: header, plot and title line."""
        self.show_state()
        self.query_one("#diff-header", HeaderLine).refresh()
        self.query_one(ErrorStrip).refresh()
        self.why_strip.refresh()

    def show_state(self) -> None:
        self._info(self.view.diff, self._message)

    def cursor_moved(self) -> None:
        """The |err| strip's cursor mark and the support row follow the cursor in the same frame as the
        rows (through the ``Highlighted`` message they would be one more frame, one more write)."""
        self.query_one(ErrorStrip).cursor_moved()
        self.support_strip.refresh()
        self.why_strip.refresh()
