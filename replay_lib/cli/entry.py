"""``trajectory-replay``: headless CLI (never imports Textual).

Exit codes (an API):
  0  every compared stage passed (validate: the bundle is valid)
  1  a divergence was found
  2  bad command line
  3  bundle invalid, incomplete, unsafe or ambiguous; or a selection that can't be exact (nothing recomputed)
  4  the requested topology / stage / config knob is unsupported (fails loudly, nothing guessed)
  5  internal error: a bug in this tool (one line naming the saved traceback file; never 1)

Everything printed that came from a bundle passes through ``safe_text.safe`` (control characters escaped).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence, TextIO

from ..demo.catalog import DEMO_NAMES
from ..errors import EXIT_INTERNAL, EXIT_USAGE, ReplayError, UsageError
from ..safe_text import elided_listing, json_document, one_line, safe
from ..bundle.schema import RecomputeConfig, config_changes

from .options import (EXIT_CODES_HELP, REPLAY_DESCRIPTION, SCAN_EXIT_CODES_HELP, TOLERANCE_POLICIES,
                      add_limit_arguments, add_replay_arguments, add_selection_arguments, anchor_from_args,
                      apply_limits, replay_options)
from .output import STYLES, emit, use_color


def import_in_background(module: str) -> threading.Thread:
    """Import ``module`` (torch and the engine: seconds) on a daemon thread while the caller opens the bundle:
    the layout, the JSON and every sha256 need no torch (``bundle.reader`` imports it at its first tensor), so
    they run during the import, and a bundle they refuse is reported without waiting for it. A failed import is
    left to the caller's own import of ``module``, which raises it."""
    def run() -> None:
        try:
            __import__(module)  # (the import statement's path: ``-X importtime`` logs it)
        except BaseException:
            pass

    thread = threading.Thread(target=run, name="import-engine", daemon=True)
    thread.start()
    return thread


def _check_replay_usage(args) -> None:
    """The usage errors of replay flags that need no torch, ahead of the bundle (a usage error, exit 2, still comes
    before a refused bundle, exit 3); :func:`replay_options` makes the rest of them and words each one."""
    from ..bundle.schema import StageId

    anchor_from_args(args)
    if args.max_divergences < 1:
        raise UsageError("--max-divergences must be at least 1")
    for name in args.stage:
        if name != "all" and name not in {s.value for s in StageId}:
            replay_options(args)  # its message lists the stages


def run_check(args, stream: Optional[TextIO] = None) -> int:
    """The headless replay shared by ``trajectory-replay replay`` and ``replay-tui --check``. The bundle is opened
    (verified) while the engine imports (:func:`import_in_background`)."""
    import_in_background("replay_lib.run.runner")
    _check_replay_usage(args)
    apply_limits(args)
    from ..bundle.resolution import open_bundle
    from ..run.threads import cpu_window

    cpu_window()  # what other processes use of the CPUs is measured from here (run.threads.pass_threads)

    step, rollout = anchor_from_args(args)
    # a selection reads only its samples' rows: their chunks are verified when read (bundle.chunks); the stages
    # run while the other payloads' sha256 are still being computed; run_replay judges them all before it makes
    # the report, and a mismatch comes ahead of any error met meanwhile (SPEC §11)
    selected = bool(getattr(args, "sample", None) or getattr(args, "group", None) or getattr(args, "batch", None))
    bundles = open_bundle(args.bundle, step=step, rollout=rollout, defer_payloads=selected, defer_checksums=True)
    with bundles.checksums_first():
        from ..judge.report import render_text, report_to_json
        from ..run.runner import run_replay

        stream = stream or sys.stdout
        shard_runner = None
        if getattr(args, "executor", "local") == "ray":  # replay --executor ray: a task per rank shard
            from ..run.ray_replay import ray_shard_runner

            shard_runner = ray_shard_runner(getattr(args, "ray_address", None))
        options = replay_options(args)
        del options["step"], options["rollout"]
        report = run_replay(bundles, **options, shard_runner=shard_runner)
    if args.format == "json":
        stream.write(report_to_json(report))  # terminal-safe: hidden characters as \u escapes
    else:
        emit(render_text(report, max_lines=args.max_divergences, verbose=args.verbose), stream)
    return report.exit_code


def _validate_lines(result) -> list[tuple[str, str]]:
    ranks = f", {len(result.ranks)} ranks" if len(result.ranks) > 1 else ""
    lines = [("header-pass", f"bundle {result.bundle_id} — valid (format {result.format_version}, {result.kind}-level, "
                             f"{result.anchor}, {result.samples} sample(s), {result.tokens} token(s){ranks})")]
    for stage, cap in result.stages.items():
        lines.append(("pass" if cap == "recompute" else "skipped", f"  {stage:<20} {cap}"))
    for r in result.replay_refusals:
        lines.append(("warning", f"warning: replay would refuse (exit 4): {r}"))
    for w in result.warnings:
        lines.append(("warning", f"warning: {w}"))
    return lines


INSPECT_FOOTNOTE = ("inspect reads what is there without verifying it (payloads: sizes only); "
                    "validate checks checksums, schema and tensors")


def _inspect_lines(result) -> list[tuple[str, str]]:
    status = "complete" if result.complete else "INCOMPLETE"
    n = len(result.problems)
    status += f" · {n} problem{'s' if n != 1 else ''}" if n else ""
    ok = result.complete and not n
    lines = [("header-pass" if ok else "header-fail", f"{result.path} — {result.layout}, {status}")]
    if result.layout == "cohort":
        lines.append(("", f"  ranks published: {', '.join(map(str, result.ranks_published)) or 'none'}"))
    for b in result.bundles:
        title = f"bundle {b.bundle_id or '?'}" + (f" rank {b.rank}" if b.rank is not None else "")
        lines.append(("title", title))
        lines.append(("", f"  path      {b.path}"))
        if b.format_version:
            lines.append(("", f"  format    {b.format_version}"))
        if b.kind:
            lines.append(("", f"  kind      {b.kind}-level, {b.anchor}"))
        if b.identity:
            ident = b.identity
            if ident.get("rank"):
                lines.append(("", "  rank      " + " ".join(f"{k}={v}" for k, v in ident["rank"].items())))
            if "weight_lineage" in ident:
                wl = ident.get("weight_lineage") or {}
                lines.append(("", f"  weights   rollout={wl.get('rollout_weight')} actor={wl.get('actor_weight')}"))
            for key in ("rollout_partition_ids", "consumer_batch_ids", "micro_batch_ids", "normalization_cohort_ids"):
                if ident.get(key):
                    lines.append(("", f"  {key:<26}{elided_listing(ident[key], limit=8)}"))
        if b.producer:
            framework = (f" framework={b.producer.get('framework')} {b.producer.get('framework_version')}"
                         if b.producer.get("framework") or b.producer.get("framework_version") else "")
            lines.append(("", f"  producer  commit={b.producer.get('commit')} torch={b.producer.get('torch_version')}"
                              f"{framework}"))
        if b.samples is not None:
            lines.append(("", f"  samples   {b.samples} in {b.groups} group(s), {b.tokens} token(s)"))
        if b.config:
            changed = config_changes(b.config)
            knobs = ", ".join(f"{k}={v}" for k, v in changed.items())
            # every knob not listed is at its default: the ones the bundle writes and those it leaves out (a knob
            # newer than the bundle, or an optional one written only when set)
            rest = sum(1 for name in RecomputeConfig.__struct_fields__ if name in b.config and name not in changed)
            absent = sum(1 for name in RecomputeConfig.__struct_fields__ if name not in b.config)
            tail = [f"+{rest} knobs at their defaults"] if rest else []
            tail += [f"{absent} not recorded"] if absent else []
            lines.append(("", f"  config    {knobs}" + (f" ({'; '.join(tail)})" if tail else "")))
        if b.redaction:
            lines.append(("", "  redaction " + ", ".join(f"{k}:{v}" for k, v in b.redaction.items())))
        for stage, cap in b.stages.items():
            lines.append(("pass" if cap == "recompute" else "skipped", f"  stage     {stage:<20} {cap}"))
        if b.payloads:
            lines.append(("title", f"  {'payload':<18} {'dtype':<14} {'shape':<16} {'bytes':>10}  status"))
            for p in b.payloads:
                st = "size ok" if p.size_ok else ("size differs" if p.present else "MISSING")
                # escaped before padding, so an escaped name keeps its columns
                lines.append(("pass" if p.size_ok else "fail",
                              f"  {safe(p.name):<18} {safe(p.dtype):<14} {str(p.shape):<16} {p.bytes:>10}  {st}"))
    for problem in result.problems:
        lines.append(("warning", f"problem: {problem}"))
    for w in result.warnings:
        lines.append(("warning", f"warning: {w}"))
    for entry in result.skipped:
        lines.append(("skipped", f"skipped: {entry}"))
    lines.append(("skipped", INSPECT_FOOTNOTE))
    return lines


# ------------------------------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (it may quote an argument: escaped)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {safe(message)}\n")


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trajectory-replay",
        description="Verifiable offline replay of one RL post-training step (GRPO V1): inspect, validate, "
                    "replay and report the first divergent stage.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_version_argument(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    p = sub.add_parser("inspect", help="identity, capabilities, producer, payloads; works on incomplete bundles",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path, metavar="BUNDLE")
    p.add_argument("--format", choices=("text", "json"), default="text")
    add_limit_arguments(p)
    p = sub.add_parser("validate", help="format, integrity, safety and dependency closure (no numbers)",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path, metavar="BUNDLE")
    a = p.add_argument_group("anchor")
    a.add_argument("--step", metavar="R:S")
    a.add_argument("--rollout", metavar="R")
    p.add_argument("--format", choices=("text", "json"), default="text")
    add_limit_arguments(p)
    p = sub.add_parser("replay", help="recompute the stages and report the first divergence",
                       description=REPLAY_DESCRIPTION, epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path, metavar="BUNDLE")
    add_replay_arguments(p)
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="replay the rank shards of a cohort here, one after the other (default), or in parallel as "
                        "Ray tasks merged into the same report (pip install 'trajectory-replay[ray]')")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the Ray cluster to use with --executor ray (default: RAY_ADDRESS, else a local one)")
    p = sub.add_parser("scan", help="replay every bundle and cohort of a capture directory in parallel (SPEC §9)",
                       description="Replay every bundle and cohort under DIR in worker processes, check each step "
                                   "bundle against its rollout bundle (stage link), and name the first bad step.",
                       epilog=SCAN_EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path, metavar="DIR")
    from .scan import add_scan_arguments

    add_scan_arguments(p)
    add_replay_arguments(p, selection=False)
    p = sub.add_parser("diff", help="compare two captures of the same step field by field (SPEC §9)",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path, metavar="A")
    p.add_argument("other", type=Path, metavar="B")
    p.add_argument("--format", choices=("text", "json"), default="text", help="report format (default text)")
    p.add_argument("--max-divergences", type=int, default=5, metavar="N",
                   help="differences kept per field (default 5)")
    add_limit_arguments(p)
    p = sub.add_parser("import", help="write a bundle from slime's or NeMo-RL's debug dump (SPEC §8)",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    from .importing import add_import_arguments

    add_import_arguments(p, _Parser)
    p = sub.add_parser("convert", help="rewrite a bundle or cohort in format 2.0.0, 1.0.0 or 1.3.0, verified (SPEC §2.2, §2.3)",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    from .convert import add_convert_arguments

    add_convert_arguments(p)
    p = sub.add_parser("reseal", help="recompute the checksums of a bundle edited by hand, marked resealed (SPEC §2)",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    from .reseal import add_reseal_arguments

    add_reseal_arguments(p)
    p = sub.add_parser("config", help="map a framework's config file to the RecomputeConfig JSON (SPEC §8)",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    from .config import add_config_arguments

    add_config_arguments(p)
    p = sub.add_parser("schema", help="print the JSON Schema of a JSON output (report), stable keys marked",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    from .schema import add_schema_arguments

    add_schema_arguments(p)
    p = sub.add_parser("demo", help="write demo or synthetic bundles")
    dsub = p.add_subparsers(dest="demo_command", metavar="ACTION", parser_class=_Parser)
    dsub.required = True
    w = dsub.add_parser("write", help="write a deterministic synthetic bundle (N samples × L tokens)",
                        description="Write a clean synthetic bundle (every stage passes) whose numbers come from "
                                    "the replay's own kernels; the same arguments give the same numbers on every "
                                    "machine (the bundle id is the directory's name).",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    w.add_argument("dir", type=Path, nargs="+", metavar="[NAME] DIR",
                   help="where to publish it (must not exist); with a NAME before it, that shipped demo instead ("
                        + ", ".join(DEMO_NAMES) + ")")
    w.add_argument("--samples", type=int, default=8, metavar="N", help="samples (a multiple of --group-size)")
    w.add_argument("--tokens", type=int, default=16, metavar="L", help="response tokens per sample")
    w.add_argument("--seed", type=int, default=0, help="random seed of the log-probs and rewards")
    w.add_argument("--group-size", type=int, default=4, metavar="G",
                   help="samples per semantic group (n_samples_per_prompt)")
    w.add_argument("--vary-lengths", action="store_true", help="random response lengths in [0, L]")
    w.add_argument("--kl-coef", type=float, default=0.05, help="kl_coef of the recorded config")
    w = dsub.add_parser("write-all", help="write the shipped demo bundles: " + ", ".join(DEMO_NAMES))
    w.add_argument("dir", type=Path, metavar="DIR", help="a directory to write them in, one subdirectory each "
                                                         "(created; an existing demo subdirectory is refused)")
    return parser


def error_line(err: str, prog: str = "trajectory-replay") -> str:
    """The one stderr line of an error. Its message embeds paths, ids and keys from the bundle: it is
    escaped whole (a newline in it shows as ``\\n``), runs of spaces are collapsed, and a message longer than
    :data:`~replay_lib.safe_text.MAX_LINE_CHARS` is cut with its length said (:func:`~replay_lib.safe_text.one_line`)."""
    return f"{prog}: error: {one_line(err)}"


def _print_error(err: str, prog: str = "trajectory-replay") -> None:
    sys.stderr.write(error_line(err, prog) + "\n")
    sys.stderr.flush()


def print_internal_error(exc: BaseException, prog: str = "trajectory-replay") -> int:
    """An exception nobody expected: save its traceback, print the one line naming the file; exit 5."""
    from ..run.crash import internal_error_line

    try:
        sys.stdout.flush()
    except Exception:  # a closed or broken stdout must not hide the line
        pass
    sys.stderr.write(internal_error_line(exc, prog) + "\n")
    sys.stderr.flush()
    return EXIT_INTERNAL


# Commands that only read bundles and print: their console process ends without the interpreter's teardown
# (:func:`end_process`).
QUICK_EXIT_COMMANDS = frozenset({"replay", "validate", "inspect", "diff"})
_quick_exit = False  # set by _main for the command it parsed


def console_main() -> None:
    """The ``trajectory-replay`` console script: :func:`main`, then the process ends (:func:`end_process`)."""
    end_process(main(), _quick_exit)


def end_process(code: int, quick: bool) -> None:
    """End the console process with ``code``. ``quick`` (a command that only reads and prints): stdout and stderr
    flushed, then ``os._exit``, skipping the interpreter's teardown — module finalization and torch's destructors,
    ≈ 0.35 s of every process that imported torch on the 2-core bench host (`python -c "import torch"`: 1.3 s
    ending normally, 0.95 s with ``os._exit``) and nothing a read-only command needs: it wrote nothing but its
    streams, and its forked workers are reaped before it returns (``stages/split.py``). Not when Ray was imported
    (``--executor ray``: its exit handler stops the local Ray it started), nor under coverage (it writes its data at
    exit), nor while a non-daemon thread lives."""
    if quick and "ray" not in sys.modules and "coverage" not in sys.modules and not any(
            t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.current_thread()):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can reach the reader
                pass
        os._exit(code)
    sys.exit(code)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return _main(argv)
    except Exception as exc:  # a bug in this tool: exit 5, never 1 ("a divergence was found")
        return print_internal_error(exc)


def _main(argv: Optional[Sequence[str]]) -> int:
    global _quick_exit
    parser = build_parser()
    args = parser.parse_args(argv)
    _quick_exit = args.command in QUICK_EXIT_COMMANDS
    try:
        return _dispatch(args)
    except ReplayError as exc:
        _print_error(str(exc))
        return exc.exit_code
    except FileExistsError as exc:
        _print_error(str(exc))
        return 3
    except KeyboardInterrupt:
        _print_error("interrupted")
        return 130
    except BrokenPipeError:
        return 0


def _dispatch(args) -> int:
    apply_limits(args)
    if args.command == "replay":
        return run_check(args)
    if args.command == "scan":
        from .scan import run_scan_command

        return run_scan_command(args)
    if args.command == "diff":
        from .diff import run_diff_command

        return run_diff_command(args)
    if args.command == "import":
        from .importing import run_import_command

        return run_import_command(args)
    if args.command == "convert":
        from .convert import run_convert_command

        return run_convert_command(args)
    if args.command == "reseal":
        from .reseal import run_reseal_command

        return run_reseal_command(args)
    if args.command == "schema":
        from .schema import run_schema_command

        return run_schema_command(args)
    if args.command == "config":
        from .config import run_config_command

        return run_config_command(args)
    if args.command == "validate":
        import_in_background("replay_lib.run.validate")
        from ..bundle.resolution import open_bundle

        step, rollout = anchor_from_args(args)
        # a refused bundle: exit 3 without torch; the chunk lists checked beside the whole files (bundle.chunks)
        bundles = open_bundle(args.bundle, step=step, rollout=rollout, verify_chunks=True)
        from ..run.validate import check_dependency_closure

        result = check_dependency_closure(bundles)
        if args.format == "json":
            sys.stdout.write(json_document(result))
        else:
            emit(_validate_lines(result))
        return 0
    if args.command == "inspect":
        from ..bundle.inspection import inspect

        result = inspect(args.bundle)
        if args.format == "json":
            sys.stdout.write(json_document(result))
        else:
            emit(_inspect_lines(result))
        return 0
    if args.command == "demo":
        try:
            return _demo(args)
        except OSError as exc:  # the target directory (exists, not writable…): the command's problem, not a bundle's
            if exc.filename is None:  # the writer's own refusal names the path
                raise UsageError(str(exc)) from None
            raise UsageError(f"{exc.filename}: cannot write the demo bundle: {exc.strerror}") from None
    raise UsageError(f"unknown command {args.command!r}")


def _demo(args) -> int:
    from .. import demo
    from ..bundle.packed import PACKED_FORMAT_VERSION

    if args.demo_command == "write-all":
        if args.dir.exists() and not args.dir.is_dir():
            raise UsageError(f"{args.dir}: not a directory (demo write-all writes one subdirectory per demo in DIR)")
        written = demo.write_demos(args.dir)
        emit([("", f"wrote {name}: {path}") for name, path in written.items()])
        return 0
    if len(args.dir) > 2:
        raise UsageError("demo write takes [NAME] DIR")
    if len(args.dir) == 2:  # a shipped demo by name
        name, target = str(args.dir[0]), args.dir[1]
        if name not in DEMO_NAMES:
            raise UsageError(f"unknown demo {name!r} (expected one of {', '.join(DEMO_NAMES)})")
        emit([("", f"wrote {name}: {demo.write_demo(name, target)}")])
        return 0
    args.dir = args.dir[0]
    if args.samples < 1 or args.tokens < 0 or args.group_size < 1 or args.samples % args.group_size:
        raise UsageError("--samples must be a positive multiple of --group-size; --tokens must be >= 0")
    path = demo.write_synthetic(args.dir, samples=args.samples, tokens=args.tokens, seed=args.seed,
                                group_size=args.group_size, vary_lengths=args.vary_lengths,
                                kl_coef=args.kl_coef, bundle_id=args.dir.name, settle=True,
                                format_version=PACKED_FORMAT_VERSION)
    emit([("", f"wrote {path}")])
    return 0


if __name__ == "__main__":  # pragma: no cover
    console_main()
