"""The export dialog (``x`` / ``X`` in the diff pane): a file path, CSV or JSON by its extension.

Enter writes; a path that exists is refused with "exists — enter again to overwrite", and only a second
enter on the same path replaces it. The dialog closes with the written file's one-line summary (shown as a
toast); a path that cannot be written keeps it open with the reason."""

from __future__ import annotations

from typing import Callable, ClassVar, Optional

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from replay_lib.safe_text import safe

from ..export import ExportRequest
from ..widgets.key_bar import KeyBar


class ExportScreen(ModalScreen[Optional[str]]):
    DEFAULT_CSS = """
    ExportScreen { align: center middle; }
    ExportScreen #export-box { width: 72; max-width: 95%; height: auto; border: round $accent;
                               background: $surface; padding: 0 1; }
    ExportScreen #export-what { color: $text-muted; height: auto; }
    ExportScreen #export-error { color: $error; height: auto; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="export.cancel", tooltip="Close without writing"),
    ]

    def __init__(self, request: ExportRequest, path: str, write: Callable[[str, bool], str]) -> None:
        super().__init__()
        self.request = request
        self.path = path
        self.write = write
        self.confirm: Optional[str] = None  # the path the user was told exists

    def compose(self):
        r = self.request
        what = {"sample": f"{r.field} of {safe(r.sample_id or '')}, every token",
                "stage": f"{r.field} over every sample of the stage", "cohort": f"{r.field}, every row"}[r.scope]
        with Vertical(id="export-box"):
            yield Static(Text(f"{what}: expected, actual, abs err, tolerance (.csv or .json)"), id="export-what")
            yield Input(value=self.path, id="export-input")
            yield Static(id="export-error")
        yield KeyBar()

    def on_mount(self) -> None:
        self.query_one("#export-box").border_title = "Export"
        box = self.query_one(Input)
        box.cursor_blink = not self.app.is_headless
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.value.strip() != self.confirm:
            self.confirm = None
            self.query_one("#export-error", Static).update("")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        path = event.value.strip()
        error = self.query_one("#export-error", Static)
        if not path:
            error.update("type a file path (.csv or .json)")
            return
        try:
            message = self.write(path, self.confirm == path)
        except FileExistsError:
            self.confirm = path
            error.update(Text(f"{safe(path)} exists — enter again to overwrite it, escape to keep it"))
            return
        except OSError as exc:
            error.update(Text(f"cannot write {safe(path)}: {safe(exc.strerror or str(exc))}"))
            return
        self.dismiss(message)

    def action_cancel(self) -> None:
        self.dismiss(None)
