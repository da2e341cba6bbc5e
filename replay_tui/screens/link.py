"""The link view: a step bundle whose only failure is the scan's ``link`` stage (SPEC §9) — what the step
consumed against what its rollout bundle recorded, for the same sample ids. The step's own replay may well pass
(each bundle is consistent on its own), so opening it in the debugger would show a green screen; this view shows
the check that failed: the link's reason, its likely cause (the rollout whose advantages the step consumed, when
one matches), and each reported divergence — field, sample@token, the rollout's value, the step's, |err|.
``⏎`` replays the step alone in the debugger; ``esc`` goes back to the run view."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Static

from replay_lib.safe_text import safe

from ..cells import FAIL
from ..widgets.key_bar import KeyBar


def _number(x) -> str:
    return "—" if x is None else f"{x:.8g}" if isinstance(x, float) else safe(str(x))


def link_table(stage: dict) -> Table:
    """The link stage's reported divergences as rows (the values as the report carries them)."""
    grid = Table(expand=True, box=None, padding=(0, 1), header_style="bold")
    for name, justify in (("field", "left"), ("sample@token", "left"), ("rollout recorded", "right"),
                          ("step consumed", "right"), ("abs err", "right")):
        grid.add_column(name, justify=justify, no_wrap=True)
    for d in stage.get("divergences") or []:
        where = safe(str(d.get("sample_id") or "—"))
        if d.get("token_offset") is not None:
            where += f"@{d['token_offset']}"
        if d.get("message"):
            grid.add_row(safe(str(d.get("field") or "")), where, Text(safe(d["message"]), style=FAIL), "", "")
            continue
        grid.add_row(safe(str(d.get("field") or "")), where, _number(d.get("expected")), _number(d.get("actual")),
                     Text(_number(d.get("abs_error")), style=FAIL))
    return grid


class LinkScreen(Screen):
    DEFAULT_CSS = """
    LinkScreen { layout: vertical; }
    LinkScreen #link-title { height: 1; background: $panel; text-style: bold; padding: 0 1; text-wrap: nowrap;
                             text-overflow: ellipsis; }
    LinkScreen #link-box { height: 1fr; border: round $error; padding: 0 1; }
    LinkScreen #link-reason { margin-bottom: 1; }
    LinkScreen #link-cause { margin-bottom: 1; color: $warning; text-style: bold; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "open_step", "Replay step", id="link.open",
                tooltip="Replay the step bundle alone in the debugger (its own stages; the link is not among them)"),
        Binding("escape", "back", "Run view", id="link.back", tooltip="Back to the run view (the cursor where it was)"),
        Binding("q", "app.quit", "Quit", id="link.quit", tooltip="Quit (exit code: the scan's)"),
        Binding("question_mark", "app.help", "Help", id="link.help", tooltip="Show the help screen"),
    ]

    def __init__(self, target, row) -> None:
        super().__init__()
        self.target = target
        self.row = row

    @property
    def link(self):
        return self.row.link

    def compose(self):
        link = self.link
        rollout = link.rollout.relpath if link is not None else "?"
        yield Static(Text(safe(f"link · step {self.target.anchor} ({self.target.relpath}) against rollout bundle "
                               f"{rollout}"), no_wrap=True, overflow="ellipsis"), id="link-title")
        with VerticalScroll(id="link-box"):
            yield Static(Text(safe(link.message if link is not None else self.row.message)), id="link-reason")
            cause = getattr(link, "cause", None) if link is not None else None
            yield Static(Text("likely cause: " + (safe(cause) if cause else "no known cause matches")),
                         id="link-cause")
            yield Static(link_table((link.stage or {}) if link is not None else {}), id="link-table")
            yield Static(Text("rollout recorded = the value the rollout bundle holds for that sample id (the report's "
                              "expected); step consumed = the value the step trained on (its actual). Each bundle "
                              "replays on its own; only this check across the two fails. ⏎ replays the step "
                              "alone, esc goes back.", style="italic"), id="link-note")
        yield KeyBar()

    def on_mount(self) -> None:
        self.query_one("#link-box").border_title = "the step against its rollout bundle (stage link)"
        self.query_one("#link-box").focus()

    def action_open_step(self) -> None:
        self.app.open_target(self.target, self.row, link_view=False)

    def action_back(self) -> None:
        self.app.pop_screen()
