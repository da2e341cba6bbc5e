"""One-line headers: a column header drawn by the list it labels (so the columns always line up), and the
forensic mode's label."""

from __future__ import annotations

from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static


class HeaderLine(Widget):
    DEFAULT_CSS = """
    HeaderLine {
        height: 1;
        color: $text-muted;
        text-style: bold;
    }
    """

    def __init__(self, view, *, id: str | None = None) -> None:
        """``view``: the list below, with ``render_header(width, style)`` and ``row_width``."""
        super().__init__(id=id)
        self.view = view

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.rich_style
        if y != 0:
            return Strip.blank(width, base)
        # the rows' width (the list may show a scrollbar), so the columns line up
        row_width = min(width, self.view.row_width) if self.view.is_mounted else width
        return self.view.render_header(row_width, base).crop_extend(0, width, base)


class ForensicLabel(Static):
    """The top line of a ``--forensic`` debugger: what is on screen is an incomplete cohort, untrusted."""

    DEFAULT_CSS = """
    ForensicLabel { height: 1; background: $warning; color: $text; text-style: bold; padding: 0 1;
                    text-wrap: nowrap; text-overflow: ellipsis; }
    """
    TEXT = ("FORENSIC — an incomplete cohort opened read-only with the ranks that published: untrusted, "
            "never exits 0")

    # --forensic on a bundle set that verified whole: nothing is untrusted, but the mode's exit code holds
    COMPLETE_TEXT = "FORENSIC — --forensic on a complete, verified bundle (not needed): still never exits 0"

    def __init__(self) -> None:
        super().__init__(self.TEXT, markup=False, id="forensic")

    def show_complete(self, complete: bool) -> None:
        self.update(self.COMPLETE_TEXT if complete else self.TEXT)
