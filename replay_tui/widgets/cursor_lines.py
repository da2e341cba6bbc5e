"""A line-API list with a row cursor: ``render_line(y) -> Strip`` draws only the visible rows, from an
LRU cache keyed by (row, width, cursor, focus). Subclasses implement ``row_count`` and ``render_row``;
one widget serves any number of rows (a 32k-token diff is as cheap as a 4-row table)."""

from __future__ import annotations

from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.cache import LRUCache
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ..keys import navigation_bindings


class CursorLines(ScrollView, can_focus=True, inherit_bindings=False):
    """Rows with a cursor. Posts :class:`Highlighted` when the cursor moves and :class:`Activated` on
    enter or click."""

    DEFAULT_CSS = """
    CursorLines {
        overflow-x: hidden;
        overflow-y: auto;
        scrollbar-size-vertical: 1;
        height: 1fr;
        & > .cursor-lines--cursor {
            background: $block-cursor-blurred-background;
            text-style: bold;
        }
        &:focus > .cursor-lines--cursor {
            background: $block-cursor-background;
            color: $block-cursor-foreground;
            text-style: $block-cursor-text-style;
        }
    }
    """
    COMPONENT_CLASSES: ClassVar[set[str]] = {"cursor-lines--cursor"}

    # Subclasses prefix ids with their pane name via ``PANE``.
    PANE: ClassVar[str] = "rows"
    ROW_NOUN: ClassVar[str] = "row"

    BINDINGS: ClassVar[list[BindingType]] = []

    # repaint=False: a cursor move refreshes only the two rows it touches (see watch_cursor).
    cursor: reactive[int] = reactive(0, init=False, repaint=False)

    class Highlighted(Message):
        def __init__(self, view: "CursorLines", row: int) -> None:
            super().__init__()
            self.view = view
            self.row = row

        @property
        def control(self) -> "CursorLines":
            return self.view

    class Activated(Message):
        def __init__(self, view: "CursorLines", row: int) -> None:
            super().__init__()
            self.view = view
            self.row = row

        @property
        def control(self) -> "CursorLines":
            return self.view

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._line_cache: LRUCache[tuple, Strip] = LRUCache(maxsize=1024)
        self._generation = 0
        self._rows = 0
        self._base_style: Style | None = None
        self._center_pending = False

    @classmethod
    def navigation_bindings(cls, pane: str, noun: str, open_tooltip: str) -> list[Binding]:
        """Arrow/page keys with vim aliases (see :func:`replay_tui.keys.navigation_bindings`)."""
        return navigation_bindings(pane, noun, open_tooltip)

    # -- rows -------------------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return self._rows

    def set_rows(self, count: int, cursor: int | None = None) -> None:
        """New content: ``count`` rows; clears the line cache; keeps the cursor in range."""
        self._rows = max(0, count)
        self._generation += 1
        self._line_cache.clear()
        self.virtual_size = Size(0, self._rows)
        target = self.cursor if cursor is None else cursor
        target = max(0, min(target, self._rows - 1)) if self._rows else 0
        if target != self.cursor:
            self.cursor = target
        else:
            self.scroll_to_cursor()
        self.refresh()

    def invalidate(self) -> None:
        """Same rows, new look (a style or a model attribute changed)."""
        self._generation += 1
        self._line_cache.clear()
        self.refresh()

    def render_row(self, row: int, width: int, base: Style) -> Strip:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- line API ---------------------------------------------------------------------------------
    @property
    def row_width(self) -> int:
        """Cells a row may use: the content width minus the vertical scrollbar, when there is one."""
        return self.scrollable_content_region.width

    def render_line(self, y: int) -> Strip:
        width = self.row_width
        row = self.scroll_offset.y + y
        base = self._base_style
        if base is None:
            # Widget.rich_style walks the ancestors; it only changes with the CSS (notify_style_update).
            base = self._base_style = self.rich_style
        if row >= self._rows:
            return Strip.blank(width, base)
        selected = row == self.cursor
        key = (row, width, selected, selected and self.has_focus, self._generation)
        strip = self._line_cache.get(key)
        if strip is None:
            strip = self.render_row(row, width, base)
            if selected:
                strip = self._cursor_strip(strip)
            self._line_cache[key] = strip
        return strip

    def _cursor_strip(self, strip: Strip) -> Strip:
        """The cursor row: the cursor background *over* the row (its red/green text colours stay)."""
        cursor = self.get_component_rich_style("cursor-lines--cursor")
        if cursor.bgcolor is not None:
            over = Style(bgcolor=cursor.bgcolor, bold=cursor.bold)
        else:
            over = Style(reverse=True)
        return Strip(list(Segment.apply_style(strip, post_style=over)), strip.cell_length)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._base_style = None
        self._line_cache.clear()

    def _refresh_row(self, row: int) -> None:
        y = row - self.scroll_offset.y
        if 0 <= y < self.size.height:
            self.refresh(Region(0, y, self.size.width, 1))

    def watch_cursor(self, old: int, new: int) -> None:
        self._refresh_row(old)
        self._refresh_row(new)
        self.scroll_to_cursor()
        self.post_message(self.Highlighted(self, new))

    def validate_cursor(self, value: int) -> int:
        if self._rows == 0:
            return 0
        return max(0, min(int(value), self._rows - 1))

    def scroll_to_cursor(self) -> None:
        height = self.scrollable_content_region.height
        if height <= 0:  # not laid out yet (content loaded at mount): see _size_updated
            self._center_pending = True
            return
        top = round(self.scroll_offset.y)
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False, immediate=True)
        elif self.cursor >= top + height:
            self.scroll_to(y=self.cursor - height + 1, animate=False, immediate=True)

    def center_cursor(self) -> None:
        height = self.scrollable_content_region.height
        if height <= 0:  # not laid out yet: centre as soon as the size is known, before the first paint
            self._center_pending = True
            return
        self._center_pending = False
        self.scroll_to(y=max(0, self.cursor - height // 2), animate=False, immediate=True)

    def _size_updated(self, size: Size, virtual_size: Size, container_size: Size, layout: bool = True) -> bool:
        # Called during the layout pass, before this widget is rendered: a cursor loaded before the
        # first layout is centred in the very first frame (a Resize handler would run a frame later).
        resized = super()._size_updated(size, virtual_size, container_size, layout)
        if self._center_pending and self.scrollable_content_region.height > 0:
            self.center_cursor()
        return resized

    def on_focus(self) -> None:
        self._refresh_row(self.cursor)

    def on_blur(self) -> None:
        self._refresh_row(self.cursor)

    def on_resize(self) -> None:
        self._line_cache.clear()
        self.scroll_to_cursor()

    # -- actions ----------------------------------------------------------------------------------
    def action_cursor(self, delta: int) -> None:
        self.cursor = self.cursor + delta

    def action_page(self, direction: int) -> None:
        height = max(1, self.scrollable_content_region.height)
        self.cursor = self.cursor + direction * height

    def action_edge(self, end: int) -> None:
        self.cursor = self._rows - 1 if end else 0

    def action_activate(self) -> None:
        if self._rows:
            self.post_message(self.Activated(self, self.cursor))

    def on_click(self, event: events.Click) -> None:
        row = event.y + round(self.scroll_offset.y)
        if 0 <= row < self._rows:
            self.cursor = row
            self.post_message(self.Activated(self, row))
