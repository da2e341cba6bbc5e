"""The run view's table: one row per bundle or cohort of a scan, in the scan's (rollout_id, step_id, path)
order, filled in as rows finish. :class:`RunRows` is the data (plain Python, testable without an App);
:class:`RunTable` draws only the visible rows through the line API (a 1,000-bundle run costs what a
screenful costs).

Columns: the status mark, anchor, bundle (its path under the directory), kind, status, first divergent
stage, ×noise (the first divergence's |err| / tolerance) and the row's likely cause (its first divergent
stage's best explanation, or the link's), else its first divergence — or, for a row nothing was compared for,
its one-line message. Identical failures (the same first stage, field and likely cause) are one row, the first
in scan order, marked ``×N`` (``c`` lists every bundle again). Narrow terminals drop ×noise, then kind, then shorten the
bundle column (dropped only below 6 cells; the line under the table names the bundle under the cursor)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterable, Optional

from rich.style import Style
from textual.binding import BindingType
from textual.strip import Strip

from replay_lib.safe_text import safe

from ..cells import DIM, FAIL, PASS, WARN, fit, fit_ratio, strip_of
from .cursor_lines import CursorLines

PENDING = "pending"
# status → (mark, style); a row not finished yet is "pending" (·)
MARKS: dict[str, tuple[str, Optional[Style]]] = {
    "pass": ("✓", PASS),
    "diverged": ("✗", FAIL),
    "invalid": ("!", WARN),
    "unsupported": ("?", WARN),
    "vanished": ("~", WARN),
    "error": ("E", FAIL),
    PENDING: ("·", DIM),
}
STATUS_ORDER = ("pass", "diverged", "invalid", "unsupported", "vanished", "error")
NOISE_W = 6
STAGE_W = 20
STATUS_W = 11  # "unsupported"
KIND_W = 7  # "rollout"


@dataclass(frozen=True)
class RunColumns:
    anchor: int
    bundle: int
    kind: bool
    noise: bool
    detail: int


class RunRows:
    """The scan's targets and the rows finished so far, and which of them the table shows (``bad_only``:
    the rows that finished with anything but ``pass``). Rows are keyed by target path: a row may finish
    in any order, and the cursor follows its bundle when rows appear or the filter changes."""

    def __init__(self) -> None:
        self.targets: list = []
        self.rows: dict[Path, object] = {}
        self.bad_only = False
        # identical failures (failure_key) shown as one row, the first in scan order; ``group_size[path]`` of that
        # row: how many bundles it stands for
        self.grouped = True
        self.group_size: dict[Path, int] = {}
        self.visible: list[int] = []
        self._position: dict[Path, int] = {}
        # the longest anchor and path (the table's column widths: measured once per target, not per row drawn)
        self.anchor_width = 0
        self.relpath_width = 0

    def set_targets(self, targets: Iterable) -> None:
        self.targets = list(targets)
        self._position = {t.path: i for i, t in enumerate(self.targets)}
        self.anchor_width = max((len(t.anchor) for t in self.targets), default=0)
        self.relpath_width = max((len(t.relpath) for t in self.targets), default=0)
        self._refilter()

    def add(self, rows: Iterable) -> None:
        for row in rows:
            target = row.target
            if target.path not in self._position:  # a row for a target discover did not list
                self._position[target.path] = len(self.targets)
                self.targets.append(target)
                self.anchor_width = max(self.anchor_width, len(target.anchor))
                self.relpath_width = max(self.relpath_width, len(target.relpath))
            self.rows[target.path] = row
        self._refilter()

    def set_bad_only(self, bad_only: bool) -> None:
        self.bad_only = bad_only
        self._refilter()

    def set_grouped(self, grouped: bool) -> None:
        self.grouped = grouped
        self._refilter()

    def _refilter(self) -> None:
        if self.bad_only:
            shown = [i for i, t in enumerate(self.targets) if self.status(t) not in ("pass", PENDING)]
        else:
            shown = list(range(len(self.targets)))
        self.group_size = {}
        if self.grouped:
            leaders: dict[tuple, Path] = {}
            kept = []
            for i in shown:
                target = self.targets[i]
                key = failure_key(self.rows.get(target.path))
                if key is not None and key in leaders:
                    self.group_size[leaders[key]] += 1
                    continue
                if key is not None:
                    leaders[key] = target.path
                    self.group_size[target.path] = 1
                kept.append(i)
            shown = kept
        self.visible = shown

    def status(self, target) -> str:
        row = self.rows.get(target.path)
        return row.status if row is not None else PENDING

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATUS_ORDER}
        for row in self.rows.values():
            out[row.status] = out.get(row.status, 0) + 1
        return out

    def target_at(self, visible_row: int):
        if 0 <= visible_row < len(self.visible):
            return self.targets[self.visible[visible_row]]
        return None

    def row_at(self, visible_row: int):
        target = self.target_at(visible_row)
        return self.rows.get(target.path) if target is not None else None

    def visible_index(self, path: Optional[Path]) -> Optional[int]:
        """Where the bundle at ``path`` is among the shown rows; ``None`` if filtered out or unknown."""
        position = self._position.get(path) if path is not None else None
        if position is None:
            return None
        try:
            return self.visible.index(position)
        except ValueError:
            return None

    def grouped_with(self, path: Optional[Path]) -> int:
        """How many bundles the shown row of ``path`` stands for (1: itself alone)."""
        return self.group_size.get(path, 1) if path is not None else 1

    def nearest_visible(self, path: Optional[Path]) -> int:
        """The shown row of ``path``, else the first shown row after it in scan order (else the last)."""
        index = self.visible_index(path)
        if index is not None:
            return index
        position = self._position.get(path, 0) if path is not None else 0
        for i, p in enumerate(self.visible):
            if p >= position:
                return i
        return max(len(self.visible) - 1, 0)


class RunTable(CursorLines):
    PANE = "runs"
    ROW_NOUN = "bundle"
    BINDINGS: ClassVar[list[BindingType]] = CursorLines.navigation_bindings(
        "runs", "bundle", "Open the bundle in the debugger (esc comes back here)")

    def __init__(self, rows: RunRows, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.data = rows

    def refresh_rows(self, cursor: Optional[int] = None) -> None:
        self.set_rows(len(self.data.visible), cursor=cursor)

    def rows_finished(self, rows: Iterable[Optional[int]]) -> None:
        """Rows that got their result, where they were: only those on screen are drawn again (a scan's
        rows finish a few at a time, mostly off screen)."""
        self._line_cache.clear()
        for row in rows:
            if row is not None:
                self._refresh_row(row)

    @property
    def target(self):
        return self.data.target_at(self.cursor)

    def _columns(self, width: int) -> RunColumns:
        anchor_w = min(max(self.data.anchor_width, 6), 14)
        bundle_w = min(max(self.data.relpath_width, 6), 24)
        rest = width - 2 - (anchor_w + 1) - (STATUS_W + 1) - (STAGE_W + 1)
        noise = rest >= NOISE_W + 1 + 30
        rest -= NOISE_W + 1 if noise else 0
        kind = rest >= KIND_W + 1 + 30
        rest -= KIND_W + 1 if kind else 0
        if rest < bundle_w + 1 + 24:  # narrow: the path shrinks before it goes (same anchors need it)
            bundle_w = min(bundle_w, rest - 1 - 16)
            bundle_w = bundle_w if bundle_w >= 6 else 0
        rest -= bundle_w + 1 if bundle_w else 0
        return RunColumns(anchor_w, bundle_w, kind, noise, max(rest, 0))

    def render_header(self, width: int, base: Style) -> Strip:
        cols = self._columns(width)
        parts = [("  ", None), (fit("anchor", cols.anchor) + " ", None)]
        if cols.bundle:
            parts.append((fit("bundle", cols.bundle) + " ", None))
        if cols.kind:
            parts.append((fit("kind", KIND_W) + " ", None))
        parts += [(fit("status", STATUS_W) + " ", None), (fit("first stage", STAGE_W) + " ", None)]
        if cols.noise:
            parts.append((fit("×noise", NOISE_W, ">") + " ", None))
        parts.append((fit("likely cause / first divergence / message", cols.detail), None))
        return strip_of(parts, width, base)

    def render_row(self, row: int, width: int, base: Style) -> Strip:
        target = self.data.target_at(row)
        result = self.data.rows.get(target.path)
        status = result.status if result is not None else PENDING
        mark, style = MARKS.get(status, ("?", WARN))
        cols = self._columns(width)
        parts: list[tuple[str, Optional[Style]]] = [(mark + " ", style), (fit(target.anchor, cols.anchor) + " ", None)]
        if cols.bundle:  # names come from the capture directory: escaped before they are cut
            parts.append((fit(safe(target.relpath), cols.bundle) + " ", DIM))
        if cols.kind:
            parts.append((fit(target.kind, KIND_W) + " ", DIM))
        parts.append((fit(status if result is not None else "…", STATUS_W) + " ", style))
        stage = result.first_stage if result is not None and result.first_stage else ""
        parts.append((fit(safe(stage) or ("—" if result is not None else ""), STAGE_W) + " ",
                      FAIL if stage else DIM))
        if cols.noise:
            ratio = result.noise_ratio if result is not None else None
            parts.append((fit_ratio(ratio, NOISE_W) + " " if result is not None else " " * (NOISE_W + 1),
                          FAIL if ratio is not None and ratio > 1 else DIM))
        if result is not None:
            count = self.data.grouped_with(target.path)
            if count > 1:  # identical failures: this row stands for all of them
                parts.append((f"×{count} ", FAIL))
            cause = getattr(result, "cause", None)
            detail = (cause or result.first_divergence) if result.status == "diverged" and (
                cause or result.first_divergence) else ("" if result.status == "pass"
                                                        else relative_message(result.message, target))
            used = len(f"×{count} ") if count > 1 else 0
            parts.append((fit(safe(detail or ""), max(cols.detail - used, 0)),
                          None if result.status == "diverged" else DIM))
        return strip_of(parts, width, base)


def failure_key(row) -> Optional[tuple]:
    """What makes two diverged rows the same failure: ``(first stage, field, likely cause)`` (the field of the
    first divergence); ``None`` for a row that did not diverge (or has not finished)."""
    if row is None or row.status != "diverged":
        return None
    first = (row.report or {}).get("first_divergence") if isinstance(row.report, dict) else None
    field = first.get("field") if isinstance(first, dict) else None
    if field is None and row.first_divergence:
        field = row.first_divergence.split(" ", 1)[0]
    return (row.first_stage, field, getattr(row, "cause", None))


def relative_message(message: str, target) -> str:
    """A row's message with the capture directory's path left out (``d-broken/COMPLETE: missing …``): the
    files it names are under the directory the title names, and the whole path would fill the column."""
    path = str(target.path)
    if target.relpath and path.endswith(target.relpath) and len(path) > len(target.relpath):
        return message.replace(path[: -len(target.relpath)], "")
    return message
