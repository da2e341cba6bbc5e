"""``replay-tui BUNDLE``: the Textual debugger. The replay runs in a worker thread through the same
runner as the CLI; the app renders the resulting :class:`ReplayReport` (and the model built from it)."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar, Optional, Sequence

import torch
from textual import work
from textual.app import App
from textual.binding import BindingType
from textual.command import CommandPalette

from replay_lib.bundle import open_bundle
from replay_lib.cli import error_line as cli_error_line
from replay_lib.run.crash import internal_error_line
from replay_lib.judge.error_model import Rules
from replay_lib.errors import EXIT_INTERNAL, EXIT_INVALID, EXIT_PASS, ReplayError
from replay_lib.bundle.gcpause import gc_paused
from replay_lib.judge.report import STATUS_SKIPPED
from replay_lib.run.runner import replay_run
from replay_lib.bundle.schema import ActorStepId, StageId
from replay_lib.bundle.selection import Selection

from .commands import ReplayCommands, ReplayPalette
from .messages import ReplayFailed, ReplayFinished, ReplayProgress
from .model import ReplayModel, build_model
from .screens.error import ErrorScreen
from .screens.help import HelpScreen
from .screens.main import DebuggerScreen
from .widgets.header_line import ForensicLabel
from .keys import APP_BINDINGS

PROG = "replay-tui"


def clear_style_cache() -> None:
    """Empty Textual's ``StylesCache.get_inner_outer`` cache, which memoizes on the instance and so keeps up to
    1,024 closed widgets' styles caches, with their rendered lines, alive (Textualize/textual#6665)."""
    try:
        from textual._styles_cache import StylesCache
    except ImportError:
        return
    clear = getattr(StylesCache.get_inner_outer, "cache_clear", None)
    if clear is not None:
        clear()


def release_frozen() -> int:
    """Give the frozen objects back to the collector, collect, and freeze what is still alive; returns how many
    were freed. A replay freezes its model with everything alive at that moment (:meth:`ReplayApp._replay`),
    the screen showing it included, and the collector never looks at frozen objects: once that screen is
    closed (the run view's esc), they are garbage only a collection after this can free. Textual's style cache
    of closed widgets is emptied too (:func:`clear_style_cache`)."""
    gc.unfreeze()
    clear_style_cache()
    freed = gc.collect()
    gc.freeze()
    return freed


def error_line(message: str, prog: str = PROG) -> str:
    """Exactly the line the CLI writes on stderr for a :class:`ReplayError` (escaped: it names bundle files)."""
    return cli_error_line(message, prog)


PROGRESS_INTERVAL_S = 0.15
# Quit before the replay reached a verdict (the shell's code for an interrupted command): never 0.
EXIT_NO_VERDICT = 130
# Before the first frame, the app waits up to this long for the replay: a bundle that replays within it
# opens directly on its result (no flash of a progress screen, and no UI start-up competing with the
# replay for the interpreter); a longer replay shows its progress from then on.
STARTUP_GRACE_S = 0.25


class ReplayApp(App[int]):
    TITLE = "replay-tui"
    BINDINGS: ClassVar[list[BindingType]] = APP_BINDINGS
    # Only the debugger's own actions: Textual's system commands (its Quit, a keys side panel that squeezes
    # the diff columns, screenshots, themes) would crowd the palette the help and README describe.
    COMMANDS = {ReplayCommands}

    def __init__(
        self,
        bundle: Path,
        *,
        name: Optional[str] = None,
        stages: Optional[Sequence[StageId]] = None,
        selection: Selection = Selection(),
        step: Optional[ActorStepId] = None,
        rollout: Optional[int] = None,
        max_divergences: int = 5,
        rules: Rules = Rules(),
        forensic: bool = False,
    ) -> None:
        super().__init__()
        # Start-up allocates heavily (widgets, styles, the verified bundle); move what the imports created
        # (torch, Textual) out of the collector's way so full collections don't walk it again and again.
        gc.freeze()
        self.bundle = Path(bundle)
        # Only the basename is ever shown: full paths differ between machines and runs.
        self.display_name = name or self.bundle.name or str(self.bundle)
        self.stages = stages
        self.selection = selection
        self.step = step
        self.rollout = rollout
        self.max_divergences = max_divergences
        self.rules = rules
        # --forensic: an incomplete cohort opens with the ranks that published; labelled, never exit 0
        self.forensic = forensic
        self.model: Optional[ReplayModel] = None
        self.error: Optional[tuple[str, int]] = None
        self.progress: tuple[str, int, int] = ("verify", 0, 0)
        self._run = 0
        self._first_result: Optional[ReplayModel] = None
        self._first_done = threading.Event()
        self._first_lock = threading.Lock()
        self._first_waiting = True

    def get_default_screen(self) -> DebuggerScreen:
        screen = DebuggerScreen(self.display_name)
        if self.forensic:
            screen.compose_add_child(ForensicLabel())  # composed first: the top line of the screen
        return screen

    @property
    def debugger(self) -> DebuggerScreen:
        screen = self.screen_stack[0] if self.screen_stack else None
        assert isinstance(screen, DebuggerScreen)
        return screen

    # -- the replay worker ------------------------------------------------------------------------
    async def on_load(self) -> None:
        # Start before the terminal is even switched over, then give the replay a short head start
        # with the interpreter to itself (the wait releases it). The screen picks up whatever arrived
        # before it was mounted (see DebuggerScreen.on_mount); later results come as messages.
        self.start_replay()
        await asyncio.sleep(0)  # lets the worker's task hand the replay to its thread
        done = self._first_done.wait(STARTUP_GRACE_S)
        with self._first_lock:  # from here the first model comes as a message only: no second reference to it
            self._first_waiting = False
            first, self._first_result = self._first_result, None
        if done and first is not None:
            self.model = first

    def start_replay(self) -> None:
        self._run += 1
        self.progress = ("verify", 0, 0)
        self.model = None
        self.error = None  # a retry from the error screen starts without the old error
        if self._screen_ready():
            self.debugger.show_progress("verify", 0, 0)
        self._replay(self._run)

    def _screen_ready(self) -> bool:
        return bool(self.screen_stack) and isinstance(self.screen_stack[0], DebuggerScreen) \
            and self.screen_stack[0].ready

    @work(thread=True, exclusive=True, group="replay")
    def _replay(self, run: int) -> None:
        last = [time.monotonic()]

        def progress(stage: str, rank: Optional[int], done: int, total: int) -> None:
            # Each progress message costs a frame, and frames compete with the replay for the GIL:
            # report a stage only when the replay has been quiet for a visible while.
            now = time.monotonic()
            if stage != "done" and now - last[0] >= PROGRESS_INTERVAL_S:
                last[0] = now
                self.post_message(ReplayProgress(run, stage, done, total))

        try:
            with gc_paused():  # one bulk phase: no collection between verify, replay and model either
                model = self._verify_replay_model(run, progress)
                # The model lives as long as the app shows it: out of the collector's way, or the next
                # collection walks its tens of thousands of records (on the UI thread, mid-frame). A model
                # nobody will show (its bundle was closed meanwhile) is left to the collector.
                if run == self._run:
                    gc.freeze()
        except ReplayError as exc:
            self.post_message(ReplayFailed(run, error_line(str(exc)), exc.exit_code))
            return
        except Exception as exc:  # a bug in this tool: its error screen and exit 5, not Textual's traceback
            self.post_message(ReplayFailed(run, internal_error_line(exc, PROG), EXIT_INTERNAL))
            return
        finally:
            self._first_done.set()
        self.post_message(ReplayFinished(run, model))

    def _verify_replay_model(self, run: int, progress) -> ReplayModel:
        # "verify" is on screen already (start_replay); later states are posted through the throttle.
        # The replay's kernels run a chunk of 16k tokens at a time, below torch's parallel grain, on the calling
        # thread; the few full-length ops above the grain would hand off to the OpenMP pool, whose threads sleep
        # between two replays of an app: waking them cost more than they save (bench_tui's 4,096-sample step:
        # 26.6 → 20.8 ms of replay in the app; a 2M-token step replays within 2 % either way, bench_replay). So
        # the app runs torch on one thread (a process-wide setting: the views' own tensor work is a screenful).
        torch.set_num_threads(1)
        bundles = open_bundle(self.bundle, step=self.step, rollout=self.rollout, forensic=self.forensic)
        report, contexts = replay_run(bundles, stages=self.stages, selection=self.selection,
                                      max_divergences=self.max_divergences, progress=progress, rules=self.rules)
        ran = sum(1 for s in report.stages if s.status != STATUS_SKIPPED)
        progress("model", None, ran, ran)
        model = build_model(bundles, report, name=self.display_name, contexts=contexts)
        with self._first_lock:
            if run == 1 and self._first_waiting:  # on_load still waits for it
                self._first_result = model
        return model

    def on_replay_progress(self, message: ReplayProgress) -> None:
        if message.run == self._run:
            self.progress = (message.stage, message.done, message.total)
            if self._screen_ready():
                self.debugger.show_progress(message.stage, message.done, message.total)

    def on_replay_finished(self, message: ReplayFinished) -> None:
        if message.run != self._run:
            return
        self.model = message.model
        if self._screen_ready() and self.debugger.model is not message.model:
            with self.batch_update():  # every pane changes at once: one layout, one frame
                self.debugger.load(message.model)

    def on_unmount(self) -> None:
        # What the replays froze (their models, the screens alive then) goes back to the collector with the
        # app, so a process running app after app (tests, an embedding) frees each one. Nothing is collected
        # here, and run_app freezes everything again before the process ends, so replay-tui exits as fast as
        # before. A replay still running then freezes nothing when it ends. Textual's style cache would keep
        # this app's widgets and their rendered lines (Textualize/textual#6665).
        self._run += 1
        gc.unfreeze()
        clear_style_cache()

    def on_replay_failed(self, message: ReplayFailed) -> None:
        if message.run != self._run:
            return
        self.error = (message.message, message.code)
        self.push_screen(ErrorScreen(message.message, message.code))

    @property
    def settled(self) -> bool:
        """The replay finished and its result is on screen (the report, or the error screen)."""
        if self.error is not None:
            return isinstance(self.screen, ErrorScreen) or len(self.screen_stack) > 1
        return self.model is not None and self._screen_ready() and self.debugger.model is self.model

    async def wait_settled(self, pilot) -> None:
        """Test helper: wait (without sleeping) until :attr:`settled`."""
        await self.workers.wait_for_complete()
        for _ in range(200):
            await pilot.pause()
            if self.settled:
                return
        raise TimeoutError("the replay result never reached the screen")

    # -- crashes ----------------------------------------------------------------------------------
    def _handle_exception(self, error: Exception) -> None:
        """A crash on the UI side (a handler, a render): the app exits with 5 and :func:`run_app` prints the
        internal-error line once the terminal is restored. Never Textual's own traceback, whose locals panel
        prints tensor values and file contents. (The widget that raised has stopped taking messages, so
        no screen of this app is trusted to show the line; a crash in the replay worker does get the error
        screen, see :meth:`_replay`.)"""
        if self.is_headless and self._exception is None:
            # a test harness (run_test) stops waiting and re-raises it at the end, as Textual has it
            self._exception = error
            self._exception_event.set()
        if self.error is None or self.error[1] != EXIT_INTERNAL:  # the first crash names the file
            self.error = (internal_error_line(error, PROG), EXIT_INTERNAL)
        self._return_code = EXIT_INTERNAL
        self._close_messages_no_wait()

    # -- actions ----------------------------------------------------------------------------------
    @property
    def exit_code(self) -> int:
        """The replay's exit code; quitting before it reached a verdict is not a pass: 130. A forensic
        replay is untrusted: a clean one exits 3 (the bundle is incomplete), never 0."""
        if self.error is not None:
            return self.error[1]
        if self.model is not None:
            code = self.model.report.exit_code
            return EXIT_INVALID if self.forensic and code == EXIT_PASS else code
        return EXIT_NO_VERDICT

    def action_command_palette(self) -> None:
        if self.use_command_palette and not CommandPalette.is_open(self):
            self.push_screen(ReplayPalette(id="--command-palette"))

    async def action_quit(self) -> None:
        self.exit(return_code=self.exit_code)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(lead=getattr(self.screen, "HELP_LEAD", None)))


def app_from_args(args) -> ReplayApp:
    """Build the app from parsed ``replay-tui`` arguments; raises UsageError (exit 2) like the CLI."""
    from replay_lib.cli import replay_options

    name = getattr(args, "demo", None) or None
    return ReplayApp(args.bundle, name=name, forensic=getattr(args, "forensic", False), **replay_options(args))


def run_app(args, build=app_from_args) -> int:
    """Run the debugger (``build``: the app from the arguments; the run view passes its own); returns its
    exit code (the replay's, or the error's: 2/3/4)."""
    try:
        try:
            app = build(args)
        except ReplayError as exc:
            sys.stderr.write(error_line(str(exc)) + "\n")
            return exc.exit_code
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            # Textual needs a terminal both ways; without one it draws into a pipe and never ends
            sys.stderr.write(error_line("the debugger needs a terminal (stdin and stdout); use --check for a "
                                        "headless run") + "\n")
            return 2
        app.run()
        # The process ends here: everything alive goes back out of the collector's way (the app gave it back
        # when it exited), or the interpreter's final collection walks it all (≈ 0.3 s on this host).
        gc.freeze()
        if app.error is not None:
            sys.stderr.write(app.error[0] + "\n")
        return app.return_code if app.return_code is not None else app.exit_code
    finally:
        if getattr(args, "demo", None):
            remove_materialized_demo(Path(args.bundle))


def remove_materialized_demo(bundle: Path) -> None:
    """``--demo`` bundles live in a fresh ``replay-demo-*`` temporary directory: remove it on exit."""
    import shutil
    import tempfile

    root = bundle.parent
    if root.name.startswith("replay-demo-") and root.parent == Path(tempfile.gettempdir()):
        shutil.rmtree(root, ignore_errors=True)
