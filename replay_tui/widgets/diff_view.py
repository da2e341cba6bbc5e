"""The diff viewer: offset | expected | actual | abs err | ×noise | tol | loss mask for one sample's per-token
field (or the per-sample / cohort table of a scalar field), mismatches in red, and a one-line |error| strip
along the row axis. ``tol`` is the element's effective bound (the bundle's atol + rtol·|e| plus the producer's
rounding bound) and ``×noise`` = |a − e| / tol: below 1 the difference is floating-point noise. Line API with an
LRU cache: a 32k-token sample renders only the visible rows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

from rich.style import Style
from rich.text import Text
from textual.binding import BindingType
from textual.containers import Vertical
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

from replay_lib.safe_text import safe

from ..cells import DIM, FAIL, FAIL_SOFT, PASS, SPARK, WARN, fit, fit_number, fit_ratio, fmt_tolerance, strip_of
from ..model import KIND_SAMPLE, KIND_TOKEN, FieldDiff, ReplayModel
from .cursor_lines import CursorLines
from .header_line import HeaderLine
from .support_strip import SupportStrip


# Cells of the optional columns (without the space before each); the numbers must keep NUM_READABLE cells
# ("-0.25078", eight digits and a sign) for an optional column to be shown.
RATIO_W, TOL_W, MASK_W = 7, 7, 4
NUM_READABLE = 9
NEAR = 0.5  # a ratio above this is within the tolerance, but no longer deep inside it


@dataclass(frozen=True)
class Columns:
    """Cells per column of a diff row: the key, each number; 0 for an optional column left out."""

    key: int
    num: int
    noise: int
    tol: int
    mask: int


def _ratio_style(ratio: Optional[float], bad: bool) -> Optional[Style]:
    """Red beyond the tolerance, yellow past half of it, dim deep inside it."""
    if bad:
        return FAIL
    if ratio is not None and ratio > NEAR:  # a NaN compares False
        return WARN
    return DIM


class DiffView(CursorLines):
    DEFAULT_CSS = """
    DiffView { overflow-y: scroll; }
    """
    PANE = "diff"
    BINDINGS: ClassVar[list[BindingType]] = CursorLines.navigation_bindings(
        "diff", "row", "Open the sample's per-token diff (from a per-sample table)")

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.diff: Optional[FieldDiff] = None
        self._label_width = 6

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Enter opens a sample's per-token diff from a per-sample table; elsewhere it has nothing to open
        if action == "activate":
            return self.diff is not None and self.diff.kind == KIND_SAMPLE
        return True

    def watch_cursor(self, old: int, new: int) -> None:
        super().watch_cursor(old, new)
        if isinstance(self.parent, DiffPanel):
            self.parent.cursor_moved()

    def set_diff(self, diff: Optional[FieldDiff], cursor: int = 0) -> None:
        was_table = self.diff is not None and self.diff.kind == KIND_SAMPLE
        self.diff = diff
        if was_table != (diff is not None and diff.kind == KIND_SAMPLE):
            self.refresh_bindings()  # the key bar shows or drops "⏎ Open"
        # the widest row label, once per diff (not per rendered row: a table may list 4,096 samples)
        self._label_width = max((len(safe(x)) for x in diff.labels), default=6) if diff is not None else 6
        self.set_rows(len(diff) if diff is not None else 0, cursor=cursor)
        self.center_cursor()

    # -- layout -----------------------------------------------------------------------------------
    def _columns(self, width: int) -> "Columns":
        """The row's columns at ``width``: the key (offset, sample, field) and the three numbers always; then,
        while the numbers keep :data:`NUM_READABLE` cells, ×noise, tol and the loss mask, in that order of
        value (a narrow terminal drops the mask first, ×noise last)."""
        diff = self.diff
        if diff is None or diff.kind == KIND_TOKEN:
            key = max(6, len(str(max(len(diff) - 1, 0))) if diff is not None else 6)
        elif diff.kind == KIND_SAMPLE:
            key = max(6, min(24, self._label_width)) + 7
        else:
            key = max(6, min(28, self._label_width))
        room = width - 2 - key  # after the ✗ marker and the key
        optional = []
        if diff is not None and diff.tolerance_tensor is not None:
            optional += [("noise", RATIO_W), ("tol", TOL_W)]
        if diff is not None and diff.kind == KIND_TOKEN:
            optional.append(("mask", MASK_W))
        shown: dict[str, int] = {}
        for name, w in optional:  # by value: a column is shown only when every one before it is
            if room - sum(c + 1 for c in shown.values()) - (w + 1) < 3 * (NUM_READABLE + 1):
                break
            shown[name] = w
        num = max(7, min(15, (room - sum(c + 1 for c in shown.values())) // 3 - 1))
        return Columns(key, num, shown.get("noise", 0), shown.get("tol", 0), shown.get("mask", 0))

    def render_header(self, width: int, base: Style) -> Strip:
        diff = self.diff
        cols = self._columns(width)
        if diff is None:
            return strip_of([("", None)], width, base)
        key, num = cols.key, cols.num
        if diff.kind == KIND_TOKEN:
            head = fit("offset", key, ">")
        elif diff.kind == KIND_SAMPLE:
            head = fit("sample", key - 7) + " " + fit("group", 6)
        else:
            head = fit("field", key)
        parts = [("  " + head, None), (" " + fit("expected", num, ">"), None), (" " + fit("actual", num, ">"), None),
                 (" " + fit("abs err", num, ">"), None)]
        if cols.noise:
            parts.append((" " + fit("×noise", cols.noise, ">"), None))
        if cols.tol:
            parts.append((" " + fit("tol", cols.tol, ">"), None))
        if cols.mask:
            parts.append((" " + fit("mask", cols.mask, ">"), None))
        return strip_of(parts, width, base)

    def render_row(self, row: int, width: int, base: Style) -> Strip:
        diff = self.diff
        cols = self._columns(width)
        key, num = cols.key, cols.num
        expected, actual, err, bad = diff.row(row)
        marker = ("✗ ", FAIL) if bad else ("  ", None)
        if diff.kind == KIND_TOKEN:
            head = (fit(str(row), key, ">"), FAIL_SOFT if bad else DIM)
        elif diff.kind == KIND_SAMPLE:  # sample ids from the bundle: escaped before they are cut
            head = (fit(safe(diff.labels[row]), key - 7) + " " + fit(safe(diff.groups[row]), 6),
                    FAIL_SOFT if bad else None)
        else:
            head = (fit(safe(diff.labels[row]), key), FAIL_SOFT if bad else None)
        value_style = FAIL_SOFT if bad else None
        parts = [
            marker, head,
            (" " + fit_number(expected, num), value_style),
            (" " + fit_number(actual, num), FAIL if bad else value_style),
            (" " + fit_number(err, num), FAIL if bad else DIM),
        ]
        if cols.noise or cols.tol:
            tol, ratio = diff.error_model_row(row)
            if cols.noise:
                parts.append((" " + fit_ratio(ratio, cols.noise), _ratio_style(ratio, bad)))
            if cols.tol:
                parts.append((" " + fit(fmt_tolerance(tol), cols.tol, ">"), DIM))
        if cols.mask:
            m = diff.mask[row]
            parts.append((" " + fit(str(m), cols.mask, ">"), None if m else DIM))
        return strip_of(parts, width, base)

    # -- divergence navigation --------------------------------------------------------------------
    def jump(self, direction: int) -> bool:
        """Cursor to the next/previous divergent row of this diff; False when there is none."""
        if self.diff is None:
            return False
        row = self.diff.next_divergence(self.cursor, direction)
        if row is None:
            return False
        self.cursor = row
        return True


CURSOR_MARK = Style(color="bright_yellow", bold=True)


class ErrorStrip(Widget):
    """|error| along the rows in one line: bar height = max |err| of the bin, red where a bin holds a
    divergence, green where |err| > 0 within tolerance; the cursor's bins are yellow. Click a bin to
    jump there."""

    DEFAULT_CSS = """
    ErrorStrip { height: 1; }
    """

    def __init__(self, view: DiffView, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view = view
        self._cache_key: tuple = ()
        self._profile: list[tuple[float, bool]] = []

    LABEL = "|err| "

    def _bins(self) -> int:
        return max(1, self.size.width - len(self.LABEL))

    def profile(self) -> list[tuple[float, bool]]:
        diff = self.view.diff
        if diff is None:
            return []
        key = (id(diff), self._bins())
        if key != self._cache_key:
            self._cache_key = key
            self._profile = diff.error_profile(self._bins())
        return self._profile

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.rich_style
        diff = self.view.diff
        if y != 0 or diff is None or len(diff) == 0:
            return Strip.blank(width, base)
        prof = self.profile()
        cursor_bins = diff.bins_of_row(self.view.cursor, len(prof))
        parts: list[tuple[str, Optional[Style]]] = [(self.LABEL, DIM)]
        for b, (level, flagged) in enumerate(prof):
            if level <= 0 and not flagged:
                ch, style = "▁", DIM
            else:
                ch = SPARK[min(len(SPARK) - 1, max(0, math.ceil(level * len(SPARK)) - 1))]
                style = FAIL_SOFT if flagged else PASS
            if b in cursor_bins:
                style = CURSOR_MARK
            parts.append((ch, style))
        return strip_of(parts, width, base)

    def on_click(self, event) -> None:
        diff = self.view.diff
        offset = event.get_content_offset(self)
        if diff is None or offset is None or offset.x < len(self.LABEL):
            return
        b = offset.x - len(self.LABEL)
        bins = len(self.profile())
        if 0 <= b < bins:
            self.view.cursor = diff.row_of_bin(b, bins)
            self.view.focus()


class DiffPanel(Vertical):
    """Title line, |error| strip, column header, the rows and (for a bundle with support rows) the support
    strip of the token under the cursor."""

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

    def on_mount(self) -> None:
        self.border_title = "Diff"

    @property
    def view(self) -> DiffView:
        return self.query_one(DiffView)

    @property
    def support_strip(self) -> SupportStrip:
        return self.query_one(SupportStrip)

    def set_model(self, model: Optional[ReplayModel]) -> None:
        """The model the support strip reads its rows from."""
        self.support_strip.model = model

    def show(self, diff: Optional[FieldDiff], cursor: int = 0, message: str = "") -> None:
        view = self.view
        view.set_diff(diff, cursor)
        self.query_one("#diff-header", HeaderLine).refresh()
        self.query_one(ErrorStrip).refresh()
        support = self.support_strip
        if support.display != support.wanted:  # a relayout only when the strip appears or goes
            support.display = support.wanted
        support.refresh()
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
            if diff.note:
                info.append(f", {safe(diff.note)}")
            if diff.mismatches:
                info.append(f" · {diff.mismatches} divergent", style="bold red")
            else:
                info.append(" · no divergence", style="green")
            info.append(f" · {diff.stage} atol={diff.atol:g} rtol={diff.rtol:g}", style="dim")
        self.query_one("#diff-info", Static).update(info)

    def cursor_moved(self) -> None:
        """The |err| strip's cursor mark and the support row follow the cursor in the same frame as the
        rows (through the ``Highlighted`` message they would be one more frame, one more write)."""
        self.query_one(ErrorStrip).refresh()
        self.support_strip.refresh()
