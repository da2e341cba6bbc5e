"""``z``: the report's hazards (SPEC §5.1), one line each, as the text report lists them.

A hazard is reported, never failed: a place where a legitimate producer's result is dominated by rounding or
is mathematically undefined (a zero-std group under std normalization, a singleton group, clamps hit, …).
Enter shows the hazard's sample (a group's: its first) in the sample tree; a line too long for the list is
shown whole, wrapped, under it while highlighted. Every line comes from the bundle
(ids, messages): escaped by :func:`replay_lib.judge.report.hazard_line`, drawn as plain segments, never markup."""

from __future__ import annotations

from typing import ClassVar, Optional, Sequence

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.strip import Strip
from textual.widgets import Static

from ..cells import WARN, fit, strip_of
from ..hazards import HAZARD_MARK, HazardRow
from ..widgets.cursor_lines import CursorLines
from ..widgets.key_bar import KeyBar

INTRO = ("Reported, never failed: values a legitimate producer's rounding dominates, or that are mathematically "
         "undefined. ⏎ shows the sample in the tree.")


class HazardList(CursorLines):
    PANE = "hazards"
    BINDINGS: ClassVar[list[BindingType]] = CursorLines.navigation_bindings(
        "hazards", "hazard", "Show the hazard's sample (a group's first) in the sample tree")

    def __init__(self, rows: Sequence[HazardRow], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows = rows

    def on_mount(self) -> None:
        self.set_rows(len(self.rows), cursor=0)

    def render_row(self, row: int, width: int, base: Style) -> Strip:
        # the line is escaped already; strip_of escapes it again and no part of it is read as markup
        return strip_of([(HAZARD_MARK + " ", WARN), (fit(self.rows[row].line, max(width - 2, 1)), None)], width, base)


class HazardsScreen(ModalScreen[Optional[int]]):
    """Dismissed with the sample row to show (``None``: close only)."""

    DEFAULT_CSS = """
    HazardsScreen { align: center middle; }
    HazardsScreen #hazards-box {
        width: 96%; height: auto; max-height: 90%; border: round $warning; background: $surface;
        padding: 0 1;
    }
    HazardsScreen #hazards-intro { color: $text-muted; height: auto; }
    HazardsScreen HazardList { height: auto; max-height: 20; }
    HazardsScreen #hazards-detail { height: auto; max-height: 8; color: $text-muted; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close", id="hazards.close", tooltip="Close the hazard list"),
        Binding("z", "close", "Close", show=False, id="hazards.close-z", tooltip="Close the hazard list"),
        Binding("q", "close", "Close", show=False, id="hazards.close-q", tooltip="Close the hazard list"),
    ]

    def __init__(self, rows: Sequence[HazardRow]) -> None:
        super().__init__()
        self.rows = rows

    def compose(self):
        with Vertical(id="hazards-box"):
            yield Static(Text(INTRO), id="hazards-intro")
            yield HazardList(self.rows, id="hazard-list")
            yield Static(id="hazards-detail")
        yield KeyBar()  # this screen's keys, not the pane's beneath it

    def on_mount(self) -> None:
        box = self.query_one("#hazards-box")
        n = len(self.rows)
        box.border_title = f"Hazards · {n}"
        box.border_subtitle = "esc / z closes"
        self.query_one(HazardList).focus()
        self._show_detail(0)

    def _show_detail(self, row: int) -> None:
        """The highlighted hazard's whole line, wrapped, when the list had to cut it (else nothing)."""
        listed = self.query_one(HazardList)
        width = listed.row_width
        if width <= 0:  # not laid out yet: once it is
            self.call_after_refresh(self._show_detail, row)
            return
        line = self.rows[row].line if 0 <= row < len(self.rows) else ""
        cut = cell_len(line) > width - len(HAZARD_MARK) - 1
        detail = self.query_one("#hazards-detail", Static)
        # labelled, or it reads as the list's next hazard
        detail.update(Text.assemble(("↳ in full: ", "dim"), line) if cut else Text(""))
        if detail.display != cut:
            detail.display = cut

    def on_cursor_lines_highlighted(self, event: CursorLines.Highlighted) -> None:
        self._show_detail(event.row)

    def on_cursor_lines_activated(self, event: CursorLines.Activated) -> None:
        row = self.rows[event.row] if 0 <= event.row < len(self.rows) else None
        if row is None or row.sample is None:
            self.notify("this hazard names no sample of the tree", severity="warning", timeout=3, markup=False)
            return
        self.dismiss(row.sample)

    def action_close(self) -> None:
        self.dismiss(None)
