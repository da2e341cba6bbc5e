"""Jump to a sample by id (with completion from the bundle's ids)."""

from __future__ import annotations

from typing import ClassVar, Optional, Sequence

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.suggester import SuggestFromList
from textual.widgets import Input, Static

from ..widgets.key_bar import KeyBar

class JumpScreen(ModalScreen[Optional[str]]):
    DEFAULT_CSS = """
    JumpScreen { align: center middle; }
    JumpScreen #jump-box { width: 60; max-width: 95%; height: auto; border: round $accent; background: $surface;
                           padding: 0 1; }
    JumpScreen #jump-error { color: $error; height: auto; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="jump.cancel", tooltip="Close without jumping"),
    ]

    def __init__(self, sample_ids: Sequence[str]) -> None:
        super().__init__()
        self.sample_ids = set(sample_ids)
        self._example = next(iter(sample_ids), "s-0")  # this bundle's own form (a cohort's are r<rank>-…)
        self._suggester = SuggestFromList(list(sample_ids), case_sensitive=True)

    def compose(self):
        with Vertical(id="jump-box"):
            yield Input(placeholder=f"sample id, e.g. {self._example} (→ completes)", suggester=self._suggester,
                        id="jump-input")
            yield Static(id="jump-error")
        yield KeyBar()  # this screen's keys, not the pane's beneath it

    def on_mount(self) -> None:
        self.query_one("#jump-box").border_title = "Jump to sample"
        box = self.query_one(Input)
        box.cursor_blink = not self.app.is_headless  # a blinking cursor would make screenshots flaky
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        if value in self.sample_ids:
            self.dismiss(value)
        else:
            self.query_one("#jump-error", Static).update(Text(f"no sample {value!r} in this bundle"))

    def action_cancel(self) -> None:
        self.dismiss(None)
