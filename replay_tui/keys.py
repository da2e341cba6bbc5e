"""One table of every key binding, by pane: the help screen and the command palette both read it."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding
from textual.keys import format_key


@dataclass(frozen=True)
class KeyAction:
    pane: str  # "main" for screen-wide actions, else a pane name
    section: str
    action: str
    description: str
    tooltip: str
    keys: tuple[str, ...]
    ids: tuple[str, ...]


def sections() -> list[tuple[str, str, list[Binding]]]:
    from .app import ReplayApp
    from .screens.main import DebuggerScreen
    from .widgets.diff_view import DiffView
    from .widgets.sample_tree import SampleTree
    from .widgets.stage_pane import StageList

    return [
        ("main", "Everywhere", list(DebuggerScreen.BINDINGS) + list(ReplayApp.BINDINGS)),
        ("stages", "Stages pane", list(StageList.BINDINGS)),
        ("samples", "Samples pane", list(SampleTree.BINDINGS)),
        ("diff", "Diff pane", list(DiffView.BINDINGS)),
    ]


def key_actions() -> list[KeyAction]:
    """Bindings merged by (pane, action): ``up`` and ``k`` are one action with two keys."""
    out: list[KeyAction] = []
    for pane, section, bindings in sections():
        merged: dict[str, KeyAction] = {}
        for b in bindings:
            if b.system:
                continue
            prev = merged.get(b.action)
            if prev is None:
                merged[b.action] = KeyAction(pane, section, b.action, b.description, b.tooltip, (b.key,), (b.id or "",))
            else:
                merged[b.action] = KeyAction(pane, section, b.action, prev.description, prev.tooltip,
                                             prev.keys + (b.key,), prev.ids + (b.id or "",))
        out.extend(merged.values())
    return out


def key_display(key: str) -> str:
    """A key as the key bar and the help show it (Textual's default ``App.get_key_display``): ``/`` for
    ``slash``, ``^p`` for ``ctrl+p``, ``shift+tab`` as written."""
    *modifiers, name = key.split("+")
    name = format_key(name)
    if "ctrl" in modifiers:
        modifiers.remove("ctrl")
        name = f"^{name}"
    return "+".join([*modifiers, name])
