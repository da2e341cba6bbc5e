"""Bundle identity: id, kind, anchor, logical and physical identity, producer, format, redaction policy,
rank layout, and the validation warnings."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Static
from rich.table import Table
from rich.text import Text


class IdentityPane(VerticalScroll, can_focus=True):
    DEFAULT_CSS = """
    IdentityPane {
        border: round $panel-lighten-2;
        height: auto;
        max-height: 55%;
        scrollbar-size-vertical: 1;
        &:focus { border: round $accent; }
        border-subtitle-color: $warning;
        #identity-text { width: 1fr; }
    }
    """

    def compose(self):
        yield Static(Text("verifying bundle…", style="dim"), id="identity-text")

    def on_mount(self) -> None:
        self.border_title = "Identity"

    def set_rows(self, rows: list[tuple[str, str]]) -> None:
        grid = Table.grid(padding=(0, 1), expand=True)
        grid.add_column(no_wrap=True)
        grid.add_column(ratio=1, overflow="fold")
        for key, value in rows:
            warn = key == "warning"
            grid.add_row(Text(key, style="bold yellow" if warn else "dim"), Text(value, style="yellow" if warn else ""))
        self.query_one("#identity-text", Static).update(grid)
        warnings = sum(1 for key, _ in rows if key == "warning")
        self.border_subtitle = f"⚠ {warnings} warning{'s' if warnings != 1 else ''}" if warnings else ""
