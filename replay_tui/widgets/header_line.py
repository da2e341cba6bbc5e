"""A one-line column header drawn by the list it labels (so the columns always line up)."""

from __future__ import annotations

from typing import Callable

from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget


class HeaderLine(Widget):
    DEFAULT_CSS = """
    HeaderLine {
        height: 1;
        color: $text-muted;
        text-style: bold;
    }
    """

    def __init__(self, draw: Callable[[int, Style], Strip], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._draw = draw

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if y != 0:
            return Strip.blank(width, self.rich_style)
        return self._draw(width, self.rich_style)
