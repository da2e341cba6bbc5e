"""The error screen: the CLI's one-line error and exit code. ``q`` quits with the app's exit code (that
error's; the scan's in the run view), ``r`` verifies and replays the bundle again (after the file is
fixed), and ``esc`` goes back where there is a screen to go back to (the run view), else quits."""

from __future__ import annotations

from typing import Callable, ClassVar, Optional

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
        Binding("r", "retry", "Retry", id="error.retry",
                tooltip="Verify and replay the bundle again (after fixing the file)"),
        Binding("escape", "back", "Back", show=False, id="error.back",
                tooltip="Back to the run view (where there is one), else quit with the error's exit code"),
        Binding("enter", "leave", "Quit", show=False, id="error.quit-enter",
                tooltip="Quit with the error's exit code"),
    ]

    def __init__(self, line: str, code: int, *, back: Optional[Callable[[], None]] = None) -> None:
        """``back``: what ``esc`` does instead of quitting (the run view returns to its table)."""
        super().__init__()
        self.line = line
        self.code = code
        self.back = back

    def compose(self):
        hint = "q to quit · r to retry" + (" · esc to go back" if self.back else "")
        with Vertical(id="error-box"):
            yield Static(Text(safe(self.line)), id="error-line")  # the line names bundle files
            yield Static(Text(f"exit code {self.code} — {EXIT_MEANING.get(self.code, 'error')}\npress {hint}"),
                         id="error-code")
        yield KeyBar()

    def on_mount(self) -> None:
        self.query_one("#error-box").border_title = "replay failed"

    async def action_leave(self) -> None:
        # the app's code: this error's (it is the app's error), or the scan's in the run view
        await self.app.run_action("quit")

    def action_retry(self) -> None:
        """Close this screen and run the replay again from the start (the debugger under it shows its
        progress); a bundle still broken brings a fresh error screen with the new line."""
        self.app.pop_screen()
        self.app.start_replay()

    async def action_back(self) -> None:
        if self.back is None:
            await self.action_leave()
        else:
            self.back()


class RunErrorScreen(ErrorScreen):
    """The error screen of a bundle opened from the run view: ``esc`` goes back to it, and the key bar says so."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "back", "Run view", id="error.back-run",
                tooltip="Back to the run view (the cursor where it was)"),
    ]
