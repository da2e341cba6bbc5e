"""The bottom line: the focused pane's keys, as Textual's compact ``Footer`` shows them, drawn as one
strip. The stock footer mounts a widget per key and recomposes on every focus change, which costs
a frame or two of start-up (~100 ms) and ~40 ms per Tab; here a focus change repaints one line.
Mouse: a click on a key presses it, hovering shows its tooltip."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from rich.style import Style
from textual import events
from textual.screen import Screen
from textual.strip import Strip
from textual.widget import Widget

from ..cells import strip_of


@dataclass(frozen=True, slots=True)
class KeyItem:
    key: str  # the key to press (Binding.key)
    display: str  # how it is shown ("tab", "^p", "?")
    description: str
    tooltip: str
    enabled: bool
    start: int  # first cell on the line
    end: int  # one past the last cell


class KeyBar(Widget):
    DEFAULT_CSS = """
    KeyBar {
        height: 1;
        dock: bottom;
        color: $footer-foreground;
        background: $footer-background;
        & > .key-bar--key { color: $footer-key-foreground; background: $footer-key-background; text-style: bold; }
        & > .key-bar--description {
            color: $footer-description-foreground;
            background: $footer-description-background;
        }
        & > .key-bar--hover { background: $block-hover-background; }
    }
    """
    COMPONENT_CLASSES: ClassVar[set[str]] = {"key-bar--key", "key-bar--description", "key-bar--hover"}
    ALLOW_SELECT = False

    def __init__(self, *, id: Optional[str] = None) -> None:
        super().__init__(id=id)
        self._items: Optional[tuple[KeyItem, ...]] = None
        self._hover: Optional[int] = None

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, self._bindings_changed)

    def _bindings_changed(self, screen: Screen) -> None:
        if screen is self.screen:
            self._items = None
            self.refresh()

    # -- what is shown ------------------------------------------------------------------------------
    @property
    def items(self) -> tuple[KeyItem, ...]:
        """The shown keys, one per action (the first binding of each, like the stock footer), laid
        out left to right; the command palette's key goes last."""
        if self._items is None:
            self._items = self._layout()
        return self._items

    def _layout(self) -> tuple[KeyItem, ...]:
        app = self.app
        active = self.screen.active_bindings
        seen: set[str] = set()
        entries = []
        for _node, binding, enabled, tooltip in active.values():
            if not binding.show or binding.action in seen:
                continue
            seen.add(binding.action)
            entries.append((binding, enabled, tooltip or binding.tooltip))
        palette = active.get(app.COMMAND_PALETTE_BINDING) if app.ENABLE_COMMAND_PALETTE else None
        if palette is not None and palette.binding.action not in seen:
            entries.append((palette.binding, palette.enabled, palette.tooltip or palette.binding.tooltip))
        items, x = [], 0
        for binding, enabled, tooltip in entries:
            display = app.get_key_display(binding)
            width = len(display) + (1 + len(binding.description) if binding.description else 0)
            items.append(KeyItem(binding.key, display, binding.description, tooltip or binding.description,
                                 enabled, x, x + width))
            x += width + 1  # one cell between keys
        return tuple(items)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.rich_style
        if y != 0:
            return Strip.blank(width, base)
        key_style = self.get_component_rich_style("key-bar--key", partial=True)
        desc_style = self.get_component_rich_style("key-bar--description", partial=True)
        hover_style = self.get_component_rich_style("key-bar--hover", partial=True)
        dim = Style(dim=True)
        parts: list[tuple[str, Optional[Style]]] = []
        for i, item in enumerate(self.items):
            if item.end > width:  # only whole keys: a narrow terminal drops the last ones (ctrl+p first)
                break
            extra = hover_style if i == self._hover else None
            off = None if item.enabled else dim
            parts.append((item.display, Style.chain(key_style, extra, off)))
            if item.description:
                parts.append((" " + item.description, Style.chain(desc_style, extra, off)))
            parts.append((" ", None))
        return strip_of(parts, width, base)

    # -- mouse --------------------------------------------------------------------------------------
    def item_at(self, x: int) -> Optional[int]:
        return next((i for i, item in enumerate(self.items) if item.start <= x < item.end <= self.size.width), None)

    def on_mouse_move(self, event: events.MouseMove) -> None:
        hover = self.item_at(event.x)
        if hover != self._hover:
            self._hover = hover
            self.tooltip = self.items[hover].tooltip if hover is not None else None
            self.refresh()

    def on_leave(self, event: events.Leave) -> None:
        if self._hover is not None:
            self._hover = None
            self.tooltip = None
            self.refresh()

    def on_click(self, event: events.Click) -> None:
        i = self.item_at(event.x)
        if i is None:
            return
        item = self.items[i]
        if item.enabled:
            self.app.simulate_key(item.key)
        else:
            self.app.bell()
