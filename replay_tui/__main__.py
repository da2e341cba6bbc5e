"""``replay-tui``: the Textual debugger, or ``--check`` headless through the same runner.

Textual is imported only when the app starts, so ``--check`` stays headless.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from replay_lib.cli.entry import (_Parser, _print_error, add_replay_arguments, add_version_argument, end_process,
                                  print_internal_error, run_check)
from replay_lib.demo.catalog import demo_list
from replay_lib.errors import ReplayError
from replay_lib.cli.scan import add_scan_arguments, main_check

PROG = "replay-tui"

# The codes of EXIT_CODES_HELP as the debugger (or --check) returns them when it quits: the same API, worded for it.
TUI_EXIT_CODES_HELP = """exit codes (on quitting the debugger, or of --check):
  0  every compared stage passed
  1  a divergence was found
  2  bad command line
  3  bundle invalid, incomplete, unsafe or ambiguous, or a selection that cannot be exact (nothing recomputed)
  4  unsupported topology, stage or config knob (nothing guessed)
  5  internal error: a bug in this tool; one line names the saved traceback file (never 1)
  130  quit before the replay reached a verdict (the debugger only)
"""

# A directory of several bundles: the scan's code (SPEC §9), whichever bundle the debugger showed last.
RUN_VIEW_EXIT_HELP = """  of a directory of several bundles (the run view, or --check): 1 if any bundle diverged, else 3 if any is
  invalid, else 4 if any is unsupported, else 5 on an internal error, else 0; 130 if quit before the scan finished
  with --forensic: never 0 (3 when the replay of the incomplete cohort is clean)
"""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Keyboard-driven replay debugger. With --check: headless, same report and exit codes as "
                    "'trajectory-replay replay'.",
        epilog=TUI_EXIT_CODES_HELP + RUN_VIEW_EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("bundle", nargs="?", type=Path, metavar="BUNDLE")
    p.add_argument("--demo", nargs="?", const="pr65-buggy", default=None, metavar="NAME",
                   help="open an embedded demo bundle: " + demo_list())
    p.add_argument("--check", action="store_true", help="run headless and exit with the replay's exit code")
    p.add_argument("--forensic", action="store_true",
                   help="open an incomplete cohort (no final COMPLETE) read-only with the ranks that published, "
                        "labelled FORENSIC: untrusted, it never exits 0 (3 when the replay is clean, else its code)")
    add_replay_arguments(p)
    add_scan_arguments(p.add_argument_group(
        "run view (BUNDLE is a directory of several bundles: a scan, as 'trajectory-replay scan' runs it)"))
    add_version_argument(p)
    return p


_check = False  # set by _main: a headless check (--check), whose process may end quickly


def console_main() -> None:
    """The ``replay-tui`` console script: :func:`main`, then the process ends — quickly after ``--check``, as the
    read-only commands of ``trajectory-replay`` do (``replay_lib.cli.end_process``)."""
    end_process(main(), _check)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return _main(argv)
    except Exception as exc:  # a bug in this tool (the debugger's own crashes are caught in the app): exit 5
        return print_internal_error(exc, PROG)


def _main(argv: Optional[Sequence[str]]) -> int:
    global _check
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.bundle is None and args.demo is None:
        parser.error("a BUNDLE path or --demo is required")
    if args.bundle is not None and args.demo is not None:
        parser.error("pass either BUNDLE or --demo, not both")
    if args.format != "text" and not args.check:  # the debugger prints no report: say so rather than ignore it
        parser.error(f"--format {args.format} needs --check (the debugger itself prints no report)")
    if args.forensic and args.check:
        parser.error("--forensic opens the debugger only: drop --check (a headless check refuses an incomplete cohort with exit 3)")
    loading = LoadingLine(enabled=not args.check)
    loading.show()  # torch takes a second or two to import: say something at once, over SSH especially
    try:
        if args.demo is not None:
            from replay_lib.demo import materialize_demo

            try:
                args.bundle = materialize_demo(args.demo)
            except ValueError as exc:
                loading.clear()
                parser.error(str(exc))
        run_view = run_view_wanted(args, parser)
        _check = bool(args.check) and not run_view  # one bundle's replay (a scan's workers end as they always did)
        if args.check:
            return main_check(args) if run_view else run_check(args)
        from .app import run_app
    except ReplayError as exc:
        loading.clear()
        _print_error(str(exc), PROG)
        return exc.exit_code
    except BaseException:
        loading.clear()
        raise
    loading.clear()
    if run_view:
        from .screens.run import app_from_args as run_view_app

        return run_app(args, build=run_view_app)
    return run_app(args)


def run_view_wanted(args, parser) -> bool:
    """``BUNDLE`` is a directory of several bundles and no ``--step``/``--rollout`` picks one: the run view (or,
    with ``--check``, the scan). The scan's own flags on a single bundle are refused, not ignored."""
    from replay_lib.bundle.locate import holds_several_bundles

    if args.step is None and args.rollout is None and holds_several_bundles(args.bundle):
        if args.forensic:
            parser.error("--forensic opens one cohort: pass its own path (or --step/--rollout), not a directory")
        chosen = [f for f, on in (("--sample", getattr(args, "sample", None)), ("--group", getattr(args, "group", None)),
                                  ("--batch", getattr(args, "batch", None))) if on]
        if chosen:  # as scan refuses them: a run view never silently drops a selection
            parser.error(f"{', '.join(chosen)} select{'s' if len(chosen) == 1 else ''} inside one bundle: pass its own "
                         f"path (or --step/--rollout), not a directory of several")
        return True
    flags = [f for f, on in (("--jobs", args.jobs is not None), ("--executor", args.executor != "local"),
                             ("--ray-address", args.ray_address is not None), ("--fail-fast", args.fail_fast)) if on]
    if flags:
        verb = "applies" if len(flags) == 1 else "apply"
        parser.error(f"{', '.join(flags)} {verb} to a directory of several bundles (the run view), not to one bundle")
    return False


class LoadingLine:
    """``replay-tui: loading…`` on the terminal while the imports run, erased before the debugger (or an
    error line) takes the screen. Only when both ends are a terminal: never in a pipe or a log."""

    TEXT = "replay-tui: loading…"

    def __init__(self, enabled: bool = True, stream=None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.enabled = enabled and sys.stdin.isatty() and self.stream.isatty()
        self.shown = False

    def show(self) -> None:
        if self.enabled and not self.shown:
            self.stream.write(self.TEXT)
            self.stream.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")  # back to the line's start, erase it
            self.stream.flush()
            self.shown = False


if __name__ == "__main__":  # pragma: no cover
    console_main()
