"""Jump to a sample by id (with completion from the bundle's ids).

The ids are offered as they are shown everywhere else: escaped (a completion is drawn on the terminal).
Either form jumps: the id as typed, or its escaped form as the tree and the completion show it. A pasted
id that holds control characters is shown (and looked up) in its escaped form too."""

from __future__ import annotations

from typing import ClassVar, Optional, Sequence

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.suggester import SuggestFromList
from textual.widgets import Input, Static

from replay_lib.safe_text import safe

from ..widgets.key_bar import KeyBar

class JumpScreen(ModalScreen[Optional[str]]):
    DEFAULT_CSS = """
    JumpScreen { align: center middle; }
    JumpScreen #jump-box { width: 66; max-width: 95%; height: auto; border: round $accent; background: $surface;
                           padding: 0 1; }
    JumpScreen #jump-error { color: $error; height: auto; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="jump.cancel", tooltip="Close without jumping"),
    ]

    def __init__(self, sample_ids: Sequence[str]) -> None:
        super().__init__()
        self.sample_ids = set(sample_ids)
        self.shown_ids: dict[str, str] = {}  # escaped form → id (the first id wins a tie)
        for sid in sample_ids:
            self.shown_ids.setdefault(safe(sid), sid)
        # this bundle's own form (a cohort's are r<rank>-…)
        self._example = safe(next(iter(sample_ids), "s-0"))
        self._suggester = SuggestFromList(list(self.shown_ids), case_sensitive=True)

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

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_one("#jump-error", Static).update("")  # the last error was about another value
        if not event.value.isprintable():
            event.input.value = safe(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        if value in self.sample_ids:
            self.dismiss(value)
        elif value in self.shown_ids:
            self.dismiss(self.shown_ids[value])
        else:
            self.query_one("#jump-error", Static).update(Text(f"no sample '{safe(value)}' in this bundle"))

    def action_cancel(self) -> None:
        self.dismiss(None)
