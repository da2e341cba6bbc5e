"""Bundle identity: id, kind, anchor, logical and physical identity, producer, format, redaction policy,
rank layout, and the validation warnings.

Two columns (label, value), values wrapped to the pane's width. Drawn with the line API from rows
wrapped once per width: a rich ``Table`` in a ``Static`` was re-measured (rendered) on every layout
pass and was the costliest widget of the first frame."""

from __future__ import annotations

import textwrap
from typing import Optional

from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from replay_lib.safe_text import safe

from ..cells import DIM, WARN, fit, strip_of

WARN_KEY = Style(color="yellow", bold=True)
PLACEHOLDER = [("", "waiting for the replay…")]


FOLD_AFTER = ":=/,."  # where a word wider than the column is cut ("response:" / "truncate:8")


def _fold(line: str, width: int) -> list[str]:
    """A line no wider than ``width``, or a long word cut after its last separator that fits (else hard)."""
    out = []
    while len(line) > width:
        cut = max(line.rfind(c, 0, width) for c in FOLD_AFTER) + 1
        cut = cut if cut > 0 else width
        out.append(line[:cut])
        line = line[cut:]
    return out + [line]


def wrap_rows(rows: list[tuple[str, str]], width: int) -> list[tuple[str, Style, str, Optional[Style]]]:
    """Display lines ``(label, label style, value part, value style)``: the label column is as wide
    as the widest label (at most half the pane), values wrap at spaces; a word wider than the column
    starts its own line and is cut after a separator (``:``, ``=``, ``/``, ``,``, ``.``). Values come from
    the bundle: they are escaped before they are measured and wrapped."""
    rows = rows if rows is PLACEHOLDER else [(safe(key), safe(value)) for key, value in rows]
    key_w = min(max((len(k) for k, _ in rows), default=0), max(width // 2, 1))
    value_w = max(width - key_w - 1, 1)
    lines = []
    for key, value in rows:
        warn = key == "warning"
        parts = [piece for line in textwrap.wrap(value, value_w, break_on_hyphens=False, break_long_words=False)
                 for piece in _fold(line, value_w)] or [""]
        for i, part in enumerate(parts):
            lines.append((fit(key if i == 0 else "", key_w), WARN_KEY if warn else DIM, part,
                          WARN if warn else (DIM if rows is PLACEHOLDER else None)))
    return lines


class IdentityPane(ScrollView, can_focus=True):
    DEFAULT_CSS = """
    IdentityPane {
        border: round $panel-lighten-2;
        height: auto;
        max-height: 55%;
        overflow-x: hidden;
        overflow-y: scroll;
        scrollbar-size-vertical: 1;
        &:focus { border: round $accent; }
        border-subtitle-color: $warning;
        /* zoomed (m): the whole screen, as every other pane — not its rows centred on a hatched screen */
        &.-maximized { height: 1fr; max-height: 100%; }
    }
    """

    def __init__(self, *, id: Optional[str] = None) -> None:
        super().__init__(id=id)
        self.rows: list[tuple[str, str]] = PLACEHOLDER
        self._wrapped: tuple[int, list] = (-1, [])

    def on_mount(self) -> None:
        self.border_title = "Identity"

    def set_rows(self, rows: list[tuple[str, str]]) -> None:
        self.rows = rows
        self._wrapped = (-1, [])
        warnings = sum(1 for key, _ in rows if key == "warning")
        self.border_subtitle = f"⚠ {warnings} warning{'s' if warnings != 1 else ''}" if warnings else ""
        width = self.scrollable_content_region.width
        if width > 0:
            self.virtual_size = Size(width, len(self.lines(width)))
        self.refresh(layout=True)

    def lines(self, width: int) -> list:
        if self._wrapped[0] != width:
            self._wrapped = (width, wrap_rows(self.rows, width))
        return self._wrapped[1]

    # -- layout -----------------------------------------------------------------------------------
    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        # ``width`` is the content width, which (scrollbar-gutter: stable) already leaves the scrollbar out
        return len(self.lines(width))

    def _size_updated(self, size: Size, virtual_size: Size, container_size: Size, layout: bool = True) -> bool:
        width = max(size.width - self.styles.gutter.width - self.styles.scrollbar_size_vertical, 0)
        lines = Size(width, len(self.lines(width)))
        if lines != self.virtual_size:
            self.set_reactive(IdentityPane.virtual_size, lines)  # this pass lays it out; no second one
        return super()._size_updated(size, virtual_size, container_size, layout)

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        base = self.rich_style
        lines = self.lines(width)
        row = self.scroll_offset.y + y
        if not 0 <= row < len(lines):
            return Strip.blank(width, base)
        label, label_style, value, value_style = lines[row]
        return strip_of([(label, label_style), (" ", None), (value, value_style)], width, base)
