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


# Kept by a short bar (the actions of "?" and "q").
ESSENTIAL = frozenset({"app.help", "app.quit"})


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
        self._items: Optional[tuple[int, tuple[KeyItem, ...]]] = None  # (width, its keys)
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
        out left to right in the bar's width; the command palette's key goes last."""
        width = self.size.width or 10_000  # not laid out yet: every key
        if self._items is None or self._items[0] != width:
            self._items = (width, self._layout(width))
        return self._items[1]

    def _layout(self, width: int) -> tuple[KeyItem, ...]:
        """Whole keys only. The focused pane's keys come first; when they all do not fit, the last ones go,
        except the help and quit keys (``ESSENTIAL``), which a short bar keeps (a new user's way out)."""
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
        sized = []
        for binding, enabled, tooltip in entries:
            display = app.get_key_display(binding)
            size = len(display) + (1 + len(binding.description) if binding.description else 0)
            sized.append((binding, enabled, tooltip, display, size))
        room = width - sum(e[4] + 1 for e in sized if e[0].action in ESSENTIAL)
        kept, used = [], 0
        for entry in sized:
            if entry[0].action in ESSENTIAL or used + entry[4] <= room:
                kept.append(entry)
                used += 0 if entry[0].action in ESSENTIAL else entry[4] + 1
        items, x = [], 0
        for binding, enabled, tooltip, display, size in kept:
            if x + size > width:
                break
            items.append(KeyItem(binding.key, display, binding.description, tooltip or binding.description,
                                 enabled, x, x + size))
            x += size + 1  # one cell between keys
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
        for i, item in enumerate(self.items):  # whole keys, laid out for this width
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
