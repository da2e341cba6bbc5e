"""The export dialog (``x`` / ``X`` in the diff pane): a file path, CSV or JSON by its extension.

Enter writes; a path that exists is refused with "exists — enter again to overwrite", and only a second
enter on the same path replaces it. The dialog closes with the written file's one-line summary (shown as a
toast); a path that cannot be written keeps it open with the reason.

The file is written on a worker thread (a whole stage of a large step is minutes of rows: 3–4 µs each), the
dialog saying how many rows are written so far; escape then cancels it between two blocks, removing the partial
file. While it writes, the dialog stays on top (the debugger below it takes no keys)."""

from __future__ import annotations

import threading
from typing import Callable, ClassVar, Optional

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static
from textual.worker import Worker, WorkerState

from replay_lib.safe_text import safe

from ..export import ExportCancelled, ExportRequest
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

    def __init__(self, request: ExportRequest, path: str, write: Callable[..., str]) -> None:
        """``write(path, overwrite, progress=, cancelled=)``: ``export.export_field`` bound to the model."""
        super().__init__()
        self.request = request
        self.path = path
        self.write = write
        self.confirm: Optional[str] = None  # the path the user was told exists
        self.writing: Optional[str] = None  # the path being written (on the worker thread)
        self._cancel = threading.Event()
        self._rows = 0  # written so far, set by the worker thread, shown by a timer

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
        if self.writing is not None:
            return
        path = event.value.strip()
        error = self.query_one("#export-error", Static)
        if not path:
            error.update("type a file path (.csv or .json)")
            return
        overwrite = self.confirm == path
        self.writing = path
        self._rows = 0
        self._cancel.clear()
        self.query_one(Input).disabled = True
        error.update("writing…")
        self._ticker = self.set_interval(0.25, self._show_rows)

        def progress(rows: int) -> None:
            self._rows = rows

        self.run_worker(lambda: self.write(path, overwrite, progress=progress, cancelled=self._cancel.is_set),
                        name="export", thread=True, exit_on_error=False)

    def _show_rows(self) -> None:
        if self.writing is not None and not self._cancel.is_set():
            self.query_one("#export-error", Static).update(
                Text(f"writing {safe(self.writing)}… {self._rows:,} row(s) — escape cancels"))

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.name != "export" or event.state not in (WorkerState.SUCCESS, WorkerState.ERROR):
            return
        path, self.writing = self.writing, None
        self._ticker.stop()
        if event.state == WorkerState.SUCCESS:
            self.dismiss(event.worker.result)
            return
        exc = event.worker.error
        if isinstance(exc, ExportCancelled):
            self.dismiss(f"export cancelled: {path} not written")
            return
        box = self.query_one(Input)
        box.disabled = False
        box.focus()
        error = self.query_one("#export-error", Static)
        if isinstance(exc, FileExistsError):
            self.confirm = path
            error.update(Text(f"{safe(path)} exists — enter again to overwrite it, escape to keep it"))
        elif isinstance(exc, OSError):
            error.update(Text(f"cannot write {safe(path)}: {safe(exc.strerror or str(exc))}"))
        else:  # a bug in the export: its one line, the dialog kept (the debugger goes on)
            error.update(Text(f"export failed: {safe(type(exc).__name__)}: {safe(str(exc))}"))

    def action_cancel(self) -> None:
        if self.writing is not None:  # the worker stops before its next block and removes the partial file
            self._cancel.set()
            self.query_one("#export-error", Static).update("cancelling…")
            return
        self.dismiss(None)
