"""``replay-tui DIR``: the run view (SPEC §9) — a capture directory's scan, its table filling in as bundles
finish; ⏎ opens a bundle in the debugger (its own replay), esc comes back with the cursor where it was.

The scan runs in a worker thread (:func:`replay_lib.run.scan.scan`, which starts the worker processes);
targets are listed by the same thread (``discover``), so the first frame never waits for the directory.
Each finished row is posted as a message; the screen applies them in batches (at most every
:data:`ROW_FLUSH_S`), so a thousand fast rows are a handful of repaints. ``q`` stops the scan
(``stop.set()``) and quits with its exit code (SPEC §9) once it finished, 130 before."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import ClassVar, Optional

from rich.text import Text
from textual import work
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Static

from replay_lib.run.crash import internal_error_line
from replay_lib.errors import EXIT_INTERNAL, ReplayError
from replay_lib.cli.scan import kind_anchor
from replay_lib.safe_text import safe

from ..app import EXIT_NO_VERDICT, PROG, ReplayApp, error_line, release_frozen
from ..widgets.cursor_lines import CursorLines
from ..widgets.header_line import HeaderLine
from ..widgets.key_bar import KeyBar
from ..keys import RUN_BINDINGS
from ..widgets.run_table import MARKS, RunRows, RunTable, relative_message
from ..widgets.mismatch_plot import MismatchPlot
from .error import RunErrorScreen
from .main import DebuggerScreen

ROW_FLUSH_S = 0.1
BAR_CELLS = 20


class ScanListed(Message):
    def __init__(self, targets: list) -> None:
        super().__init__()
        self.targets = targets


class ScanRowDone(Message):
    def __init__(self, row) -> None:
        super().__init__()
        self.row = row


class ScanDone(Message):
    def __init__(self, result, total: int) -> None:
        super().__init__()
        self.result = result
        self.total = total


class ScanFailed(Message):
    """The scan could not run at all (the directory is gone, empty, unreadable): the CLI's line, its code."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__()
        self.line = line
        self.code = code


class RunScreen(Screen, inherit_bindings=False):
    DEFAULT_CSS = """
    RunScreen { layout: vertical; }
    RunScreen #run-title { height: 1; background: $panel; color: $text; text-style: bold; padding: 0 1;
                           text-wrap: nowrap; text-overflow: ellipsis; }
    RunScreen #run-progress { height: 1; padding: 0 1; text-wrap: nowrap; text-overflow: ellipsis; }
    RunScreen #run-progress.-fail { background: $error 20%; }
    RunScreen #run-progress.-pass { background: $success 15%; }
    RunScreen #run-panel { height: 1fr; border: round $panel-lighten-2; }
    RunScreen #run-panel:focus-within { border: round $accent; }
    RunScreen #run-detail { height: 3; padding: 0 1; color: $text-muted; text-overflow: ellipsis; }
    """
    BINDINGS: ClassVar[list[BindingType]] = list(RUN_BINDINGS)
    HELP_LEAD = "runs"  # ? over the run view: its keys first

    def __init__(self, directory: Path, *, jobs: int, executor: str = "local", ray_address: Optional[str] = None,
                 fail_fast: bool = False, options=None) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.jobs = jobs
        self.executor = executor
        self.ray_address = ray_address
        self.fail_fast = fail_fast
        self.options = options
        self.data = RunRows()
        self.stop = threading.Event()
        self.listed = False
        self.result = None
        self.total = 0
        self.failure: Optional[tuple[str, int]] = None
        self._pending: list = []
        self._flush_timer: Optional[Timer] = None
        # the cursor follows the first bad step as rows finish until the user moves it (or opens a bundle)
        self._auto_cursor = True
        self._placed: Optional[int] = None

    def compose(self):
        yield Static(id="run-title")
        yield Static(id="run-progress")
        table = RunTable(self.data, id="run-table")
        with Vertical(id="run-panel"):
            yield HeaderLine(table, id="run-header")
            yield table
        yield MismatchPlot(id="run-mismatch")
        yield Static(id="run-detail")
        yield KeyBar()

    def on_mount(self) -> None:
        title = Text(no_wrap=True, overflow="ellipsis")
        title.append("replay-tui", style="bold")
        title.append(f"  run view · {safe(self.directory.name or str(self.directory))}", style="not bold")
        self.query_one("#run-title", Static).update(title)
        self.query_one("#run-panel").border_title = "Bundles"
        self._show_progress()
        self.set_focus(self.table)
        self._scan()

    def on_unmount(self) -> None:
        self.stop.set()  # the workers stop with the screen, whatever ends it

    @property
    def table(self) -> RunTable:
        return self.query_one(RunTable)

    @property
    def finished(self) -> bool:
        return self.result is not None or self.failure is not None

    @property
    def exit_code(self) -> int:
        """SPEC §9's exit code of the finished scan (the CLI's), the failure's code, else 130."""
        if self.failure is not None:
            return self.failure[1]
        if self.result is not None:
            from replay_lib.cli.scan import result_exit_code

            return result_exit_code(self.result)
        return EXIT_NO_VERDICT

    # -- the scan worker ----------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="scan")
    def _scan(self) -> None:
        try:
            from replay_lib.errors import BundleError
            from replay_lib.run.scan import discover, scan

            targets = discover(self.directory)
            if not targets:
                raise BundleError(f"{self.directory}: no bundle found (no manifest.json, no bundle subdirectories)")
            self.post_message(ScanListed(targets))
            result = scan(targets, jobs=min(self.jobs, len(targets)), executor=self.executor,
                          ray_address=self.ray_address, fail_fast=self.fail_fast, options=self.options,
                          on_row=lambda row: self.post_message(ScanRowDone(row)), stop=self.stop)
        except ReplayError as exc:
            self.post_message(ScanFailed(error_line(str(exc)), exc.exit_code))
            return
        except Exception as exc:  # a bug in this tool: a line naming the saved traceback, exit 5
            self.post_message(ScanFailed(internal_error_line(exc, PROG), EXIT_INTERNAL))
            return
        self.post_message(ScanDone(result, len(targets)))

    def on_scan_listed(self, message: ScanListed) -> None:
        self.listed = True
        self.total = len(message.targets)
        self.data.set_targets(message.targets)
        self._placed = 0
        self.table.refresh_rows(cursor=0)
        self.query_one("#run-header", HeaderLine).refresh()
        self._show_progress()
        self._show_detail()

    def on_scan_row_done(self, message: ScanRowDone) -> None:
        self._pending.append(message.row)
        if self._flush_timer is None:
            self._flush_timer = self.set_timer(ROW_FLUSH_S, self._flush)

    def on_scan_done(self, message: ScanDone) -> None:
        self.total = message.total
        self._pending.extend(r for r in message.result.rows if r.target.path not in self.data.rows)
        self.result = message.result
        self._flush()

    def on_scan_failed(self, message: ScanFailed) -> None:
        self.failure = (message.line, message.code)
        self._flush()

    def _flush(self) -> None:
        """Apply the rows that arrived since the last flush: one table update, one progress line."""
        if self._flush_timer is not None:
            self._flush_timer.stop()
            self._flush_timer = None
        if self._pending:
            rows, self._pending = self._pending, []
            selected = self.table.target
            shown = list(self.data.visible)
            self.data.add(rows)
            self.query_one(MismatchPlot).show_rows(self.data.rows.values())
            if self.data.visible == shown:  # the same rows in the same places: repaint the finished ones only
                self.table.rows_finished([self.data.visible_index(r.target.path) for r in rows])
            else:
                self._placed = self.data.nearest_visible(selected.path if selected else None)
                self.table.refresh_rows(cursor=self._placed)
            self._land_on_first_bad()
            self._show_detail()
        self._show_progress()

    def _land_on_first_bad(self) -> None:
        """Put the cursor on the first bad step found so far, until the user moves it: ⏎ then opens what failed."""
        if not self._auto_cursor:
            return
        from replay_lib.run.scan import first_bad_row

        first = first_bad_row(list(self.data.rows.values()))
        index = self.data.visible_index(first.target.path) if first is not None else None
        if index is not None and index != self.table.cursor:
            self._placed = index
            self.table.cursor = index

    # -- drawing ------------------------------------------------------------------------------------
    def _show_progress(self) -> None:
        line = self.query_one("#run-progress", Static)
        text = Text(no_wrap=True, overflow="ellipsis")
        verdict = ""
        if self.failure is not None:
            verdict = "-fail"
            text.append("✗ ", style="bold red")
            text.append(f"q exits {self.failure[1]} · ", style="dim")
            text.append(safe(self.failure[0]), style="bold red")
        elif self.result is not None:
            from replay_lib.cli.scan import summary_lines

            code = self.exit_code
            verdict = "-pass" if code == 0 else "-fail"
            text.append("✓ " if code == 0 else "✗ ", style="bold green" if code == 0 else "bold red")
            # the exit code, then the first bad step: on a narrow terminal they are what must stay on the line
            text.append(f"q exits {code} · ", style="dim")
            lines = [safe(part) for _, part in summary_lines(self.result, self.total)]
            text.append(" · ".join(lines[1:2] + lines[:1] + lines[2:]))
        elif not self.listed:
            text.append(f"⟳ looking for bundles in {safe(self.directory.name or str(self.directory))}…")
        else:
            done = len(self.data.rows)
            filled = BAR_CELLS * done // max(self.total, 1)
            text.append(f"⟳ scanning {done}/{self.total} ", style="bold")
            text.append("■" * filled + "□" * (BAR_CELLS - filled), style="dim")
            self._append_counts(text)
        if set(line.classes) != ({verdict} if verdict else set()):
            line.set_classes(verdict)  # a class change restyles the screen: only when the verdict arrives
        line.update(text, layout=False)

    def _append_counts(self, text: Text) -> None:
        for status, n in self.data.counts().items():
            if n:
                mark, style = MARKS[status]
                text.append("  ")
                text.append(f"{mark} {n} {status}", style=style)

    def _show_detail(self) -> None:
        """The bundle under the cursor, whole: its path and the row's message, on two rows (a fixed height: a
        cursor move lays nothing out again); a message longer than both ends in ``…``."""
        target = self.table.target
        detail = self.query_one("#run-detail", Static)
        if target is None:
            detail.update("no bundle shows: d shows them all again" if self.data.bad_only and self.data.targets
                          else "", layout=False)
            return
        row = self.data.rows.get(target.path)
        text = Text(overflow="ellipsis")
        text.append(safe(target.relpath), style="bold")
        text.append(f" · {kind_anchor(target)}")  # "step 7:0", "rollout 3" (not "rollout rollout 3")
        if row is not None and row.bundle_id and row.bundle_id != target.relpath:
            text.append(f" · {safe(row.bundle_id)}")
        if row is not None and row.status != "pass" and row.message:
            text.append(f" — {safe(relative_message(row.message, target))}")
        if row is not None and getattr(row, "mismatch", None) is not None:
            from replay_lib.cli.scan import mismatch_cell

            text.append(f" · {mismatch_cell(row.mismatch)}")
        cause = getattr(row, "cause", None) if row is not None else None
        if cause:
            text.append("\nlikely cause: ", style="bold")
            text.append(safe(cause))
        count = self.data.grouped_with(target.path)
        if count > 1:
            text.append(f"\n×{count}: this row and {count - 1} later bundle(s) failed alike (same stage, field and "
                        f"cause) — c lists each", style="bold")
        detail.update(text, layout=False)

    # -- events and actions -------------------------------------------------------------------------
    def on_cursor_lines_highlighted(self, event: CursorLines.Highlighted) -> None:
        if isinstance(event.view, RunTable):
            if event.row != self._placed:
                self._auto_cursor = False  # the user chose a row: the cursor stays where they put it
            self._show_detail()

    def on_cursor_lines_activated(self, event: CursorLines.Activated) -> None:
        if isinstance(event.view, RunTable):
            self._auto_cursor = False
            target = self.data.target_at(event.row)
            if target is not None:
                self.app.open_target(target, self.data.rows.get(target.path))

    def action_toggle_bad(self) -> None:
        selected = self.table.target
        self.data.set_bad_only(not self.data.bad_only)
        self.table.refresh_rows(cursor=self.data.nearest_visible(selected.path if selected else None))
        self.query_one("#run-panel").border_title = "Bundles — not passing only (d: all)" if self.data.bad_only \
            else "Bundles"
        self._show_detail()

    def action_toggle_grouped(self) -> None:
        selected = self.table.target
        self.data.set_grouped(not self.data.grouped)
        self.table.refresh_rows(cursor=self.data.nearest_visible(selected.path if selected else None))
        self.notify("identical failures grouped (×N)" if self.data.grouped else "every bundle listed", timeout=2)
        self._show_detail()

    def action_first_bad(self) -> None:
        from replay_lib.run.scan import first_bad_row

        first = first_bad_row(list(self.data.rows.values()))
        index = self.data.visible_index(first.target.path) if first is not None else None
        if index is None:
            self.app.bell()
            self.notify("no diverged bundle" + (" so far" if not self.finished else ""), timeout=2)
            return
        self.table.cursor = index


class RunApp(ReplayApp):
    """``replay-tui DIR``: the run view at the bottom of the stack; ⏎ pushes a :class:`DebuggerScreen` with its
    own replay of that bundle (the replay options of the command line apply to it), esc pops back."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "back_to_run", "Run view", id="app.back-to-run",
                tooltip="Back to the run view (the cursor where it was)"),
    ]

    def __init__(self, directory: Path, *, jobs: int, executor: str = "local", ray_address: Optional[str] = None,
                 fail_fast: bool = False, scan_options=None, **replay_options) -> None:
        super().__init__(directory, **replay_options)
        self.directory = Path(directory)
        # multiprocessing starts its resource tracker (which the scan's worker processes need) passing
        # sys.stderr's descriptor; while Textual runs, sys.stderr is its capture object, whose descriptor is
        # not one ("bad value(s) in fds_to_keep"): start the tracker now, with the real stderr.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        self._run_screen = RunScreen(self.directory, jobs=jobs, executor=executor, ray_address=ray_address,
                                     fail_fast=fail_fast, options=scan_options)

    def get_default_screen(self) -> RunScreen:
        return self._run_screen

    @property
    def run_screen(self) -> RunScreen:
        return self._run_screen

    async def on_load(self, event) -> None:
        event.prevent_default()  # no replay at start: the run view starts its scan when it mounts
        self._first_waiting = False  # nothing waits for a first model: each comes as a message

    # -- the debugger on top of the run view ----------------------------------------------------------
    @property
    def debugger(self) -> DebuggerScreen:
        screen = next((s for s in reversed(self.screen_stack) if isinstance(s, DebuggerScreen)), None)
        assert screen is not None
        return screen

    def _screen_ready(self) -> bool:
        return any(isinstance(s, DebuggerScreen) and s.ready for s in self.screen_stack)

    def open_target(self, target, row=None, link_view: bool = True) -> None:
        """Open one bundle of the run in the debugger: a fresh replay of it, as ``replay-tui PATH`` would. A step
        the scan's ``link`` stage failed (a check across two bundles, which the debugger of one does not run)
        opens in the link view (:class:`~replay_tui.screens.link.LinkScreen`: what the step consumed against
        its rollout bundle); from there ``⏎`` replays it alone, and the debugger says why the row was ✗."""
        if link_view and row is not None and row.first_stage == "link" and row.link is not None:
            from .link import LinkScreen

            self.push_screen(LinkScreen(target, row))
            return
        while not isinstance(self.screen, RunScreen) and not isinstance(self.screen, DebuggerScreen) \
                and len(self.screen_stack) > 1:
            self.pop_screen()  # the link view: the debugger takes its place (esc still goes back to the table)
        self.bundle = target.path
        self.display_name = target.relpath
        self.step = self.rollout = None
        self.model = None
        self.error = None
        self.push_screen(DebuggerScreen(self.display_name))
        self.start_replay()
        if row is not None and row.first_stage == "link":
            what = row.first_divergence or row.message
            self.notify(f"the scan's link stage: this step diverges from its rollout bundle ({what}); the debugger "
                        f"replays the step alone — esc goes back to the run view", severity="warning", timeout=12,
                        markup=False)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # "esc Run view" is in the key bar only over an opened bundle
        if action == "back_to_run":
            return any(isinstance(s, DebuggerScreen) for s in self.screen_stack)
        return super().check_action(action, parameters)

    def action_back_to_run(self) -> None:
        if not any(isinstance(s, DebuggerScreen) for s in self.screen_stack):
            return
        while self.screen is not self._run_screen:
            self.pop_screen()
        self._run += 1  # a replay still running for the closed bundle reports to nobody
        self.model = None
        self.error = None
        self._first_result = None
        # the closed bundle's screen and model were frozen with its replay: freed once the run view is drawn
        self.call_after_refresh(release_frozen)

    def on_replay_failed(self, message) -> None:
        message.prevent_default()
        if message.run != self._run:
            return
        self.error = (message.message, message.code)
        self.push_screen(RunErrorScreen(message.message, message.code, back=self.action_back_to_run))

    def action_command_palette(self) -> None:
        if self.screen is self._run_screen:  # its commands are the debugger's: they act on an open bundle
            self.notify("the command palette holds the debugger's commands: open a bundle first (⏎)", timeout=3)
            return
        super().action_command_palette()

    @property
    def settled(self) -> bool:
        """With a bundle open: its replay's result is on screen (as in ``replay-tui PATH``); on the run view: the
        scan finished (or failed) and every row of it is in the table."""
        if len(self.screen_stack) > 1:
            return super().settled
        return self._run_screen.finished and not self._run_screen._pending

    @property
    def exit_code(self) -> int:
        return self._run_screen.exit_code

    async def action_quit(self) -> None:
        self._run_screen.stop.set()
        if self.error is not None and self.error[1] != EXIT_INTERNAL:
            self.error = None  # a bundle's error was on screen; the run's code is what the exit says
        self.exit(return_code=self.exit_code)


def app_from_args(args) -> RunApp:
    """The run view from parsed ``replay-tui DIR`` arguments; raises UsageError (exit 2) like the CLI."""
    from replay_lib.cli import replay_options
    from replay_lib.errors import UsageError
    from replay_lib.cli.scan import default_jobs, options_from_args

    jobs = args.jobs if getattr(args, "jobs", None) is not None else default_jobs()
    if jobs < 1:
        raise UsageError("--jobs must be at least 1")
    options = replay_options(args)
    options.pop("step", None)
    options.pop("rollout", None)
    return RunApp(args.bundle, jobs=jobs, executor=getattr(args, "executor", "local"),
                  ray_address=getattr(args, "ray_address", None), fail_fast=getattr(args, "fail_fast", False),
                  scan_options=options_from_args(args), **options)
