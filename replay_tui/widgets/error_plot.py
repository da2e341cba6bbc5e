"""The error plot over the diff rows: |err| along the tokens (or table rows), a few lines tall, with its scale.

Each column is a bin of rows; its bar is the bin's largest |err| in eighths of a cell over the plot's
height, red where the bin holds a divergence, green where |err| > 0 within the tolerance, a dim ``▁`` for
exact rows, and the cursor's bins yellow. The label column gives the scale: the top line the largest
|err| (``max``), the bottom line the axis' floor — 0 on the linear scale; on the log scale (``L``) the
smallest non-zero |err| of the bins, each bar then ``log(err / min) / log(max / min)`` of the height. A
non-finite element (NaN/Inf on either side) is drawn full height. Click a bin to go to its first row."""

from __future__ import annotations

import math
from typing import Optional

from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from ..cells import DIM, FAIL_SOFT, PASS, SPARK, fit, fmt_tolerance, strip_of
from .followed import FollowedView


CURSOR_MARK = Style(color="bright_yellow", bold=True)
LABEL_W = 9  # "  4.5e-3 ┤": a 7-cell value, a space and the axis


def bar_levels(peaks: list[float], top: float, log: bool) -> tuple[list[float], float]:
    """``(each bin's height in [0, 1], the axis floor)``: linear from 0, or log from the smallest positive
    peak (a single positive value fills the height). ``inf`` (a non-finite element) is 1."""
    if top <= 0:
        return [1.0 if math.isinf(p) else 0.0 for p in peaks], 0.0
    if not log:
        return [1.0 if math.isinf(p) else p / top for p in peaks], 0.0
    positive = [p for p in peaks if 0 < p < math.inf]
    low = min(positive) if positive else top
    if low >= top:
        return [1.0 if p > 0 else 0.0 for p in peaks], low
    span = math.log(top / low)
    # the smallest positive bin keeps one eighth of a cell: it is not an exact row
    return [1.0 if math.isinf(p) else (0.0 if p <= 0 else max(1e-9, math.log(p / low) / span)) for p in peaks], low


class ErrorStrip(Widget):
    """The error plot (it was one line, the ``|err|`` strip: the name stays)."""

    DEFAULT_CSS = """
    ErrorStrip { height: 3; }
    """

    def __init__(self, view: FollowedView, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view = view
        self._cache_key: tuple = ()
        self._levels: list[float] = []
        self._flagged: list[bool] = []
        self._scale: tuple[float, float] = (0.0, 0.0)
        # drawn lines by (line, the cursor's bins): a move within a bin (≈300 tokens of a 32k sample) redraws none
        self._lines: dict[tuple, Strip] = {}
        self._profile: list[tuple[float, bool]] = []
        self._drawn_bins: Optional[range] = None

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._lines = {}

    def cursor_moved(self) -> None:
        """Repaint when the cursor's bins changed (a move within a bin leaves the plot as it is)."""
        diff = self.view.diff
        if self.size.width <= LABEL_W:  # not laid out yet: its first render computes the profile at its width
            self.refresh()
            return
        bins = diff.bins_of_row(self.view.data_row, len(self.profile())) if diff is not None else None
        if bins != self._drawn_bins:
            self.refresh()

    def _bins(self) -> int:
        return max(1, self.size.width - LABEL_W)

    def profile(self) -> list[tuple[float, bool]]:
        """``(height in [0, 1], divergent)`` per bin at the current width and scale."""
        diff = self.view.diff
        if diff is None:
            return []
        key = (id(diff), self._bins(), self.view.log_scale)
        if key != self._cache_key:
            self._cache_key = key
            self._lines = {}
            peaks, self._flagged, top = diff.error_peaks(self._bins())
            self._levels, low = bar_levels(peaks, top, self.view.log_scale)
            self._scale = (low, top)
            self._profile = list(zip(self._levels, self._flagged))
        return self._profile

    @property
    def scale(self) -> tuple[float, float]:
        """``(floor, top)`` of the axis as drawn."""
        self.profile()
        return self._scale

    def _label(self, y: int, height: int) -> str:
        low, top = self._scale
        if y == 0:
            return fit(fmt_tolerance(top), LABEL_W - 2, ">") + " ┤"
        if y == height - 1:
            return fit(fmt_tolerance(low), LABEL_W - 2, ">") + " ┤"
        if y == 1:
            return fit("log" if self.view.log_scale else "|err|", LABEL_W - 2, ">") + " │"
        return " " * (LABEL_W - 1) + "│"

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        height = max(1, self.size.height)
        base = self.rich_style
        diff = self.view.diff
        if diff is None or len(diff) == 0 or y >= height:
            return Strip.blank(width, base)
        prof = self.profile()
        cursor_bins = self._drawn_bins = diff.bins_of_row(self.view.data_row, len(prof))
        key = (y, height, width, cursor_bins.start, cursor_bins.stop)
        strip = self._lines.get(key)
        if strip is None:
            if len(self._lines) > 256:
                self._lines = {}
            strip = self._lines[key] = self._draw(y, height, width, prof, cursor_bins)
        return strip

    def _draw(self, y: int, height: int, width: int, prof: list[tuple[float, bool]], cursor_bins: range) -> Strip:
        base = self.rich_style
        parts: list[tuple[str, Optional[Style]]] = [(self._label(y, height), DIM)]
        below = height - 1 - y  # lines under this one
        for b, (level, flagged) in enumerate(prof):
            eighths = level * height * 8
            if level > 0:
                eighths = max(1.0, eighths)
            fill = min(8, max(0, math.ceil(eighths - below * 8 - 1e-9)))
            style = FAIL_SOFT if flagged else PASS
            if fill == 0:
                ch = "▁" if below == 0 else " "
                style = DIM
            else:
                ch = SPARK[fill - 1]
            if b in cursor_bins:
                style = CURSOR_MARK
                if ch == " " and y == 0:
                    ch = "▾"  # the cursor's column, over an empty bar
            parts.append((ch, style))
        return strip_of(parts, width, base)

    def on_click(self, event) -> None:
        diff = self.view.diff
        offset = event.get_content_offset(self)
        if diff is None or offset is None or offset.x < LABEL_W:
            return
        b = offset.x - LABEL_W
        bins = len(self.profile())
        if 0 <= b < bins:
            self.view.show_row(diff.row_of_bin(b, bins))
            self.view.focus()
