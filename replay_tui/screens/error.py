"""The error screen: the CLI's one-line error and exit code; quitting returns that code."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Static

from replay_lib.errors import EXIT_INTERNAL
from replay_lib.safe_text import safe

from ..widgets.key_bar import KeyBar

EXIT_MEANING = {
    2: "bad command line",
    3: "bundle invalid, incomplete, unsafe or ambiguous (nothing was recomputed)",
    4: "unsupported topology, stage or config knob (nothing guessed)",
    EXIT_INTERNAL: "internal error: a bug in this tool (the traceback file is named above)",
}


class ErrorScreen(Screen):
    DEFAULT_CSS = """
    ErrorScreen { align: center middle; }
    ErrorScreen #error-box {
        width: 90%; height: auto; border: heavy $error; padding: 1 2; background: $surface;
    }
    ErrorScreen #error-line { color: $text; text-style: bold; }
    ErrorScreen #error-code { margin-top: 1; color: $text-muted; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "leave", "Quit", id="error.quit", tooltip="Quit with the error's exit code"),
        Binding("escape", "leave", "Quit", show=False, id="error.quit-escape",
                tooltip="Quit with the error's exit code"),
        Binding("enter", "leave", "Quit", show=False, id="error.quit-enter",
                tooltip="Quit with the error's exit code"),
    ]

    def __init__(self, line: str, code: int) -> None:
        super().__init__()
        self.line = line
        self.code = code

    def compose(self):
        with Vertical(id="error-box"):
            yield Static(Text(safe(self.line)), id="error-line")  # the line names bundle files
            yield Static(Text(f"exit code {self.code} — {EXIT_MEANING.get(self.code, 'error')}\npress q to quit"),
                         id="error-code")
        yield KeyBar()

    def on_mount(self) -> None:
        self.query_one("#error-box").border_title = "replay failed"

    def action_leave(self) -> None:
        self.app.exit(return_code=self.code)
