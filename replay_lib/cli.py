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
from pathlib import Path
from typing import Optional, Sequence, TextIO

from .demo_catalog import DEMO_NAMES
from .errors import EXIT_INTERNAL, EXIT_USAGE, ReplayError, UsageError
from .safe_text import elided_listing, json_document, safe
from .schema import config_changes

TOLERANCE_POLICIES = ("bundle", "default")  # replay_lib.error_model's, without importing torch for --help

REPLAY_DESCRIPTION = """Recompute every declared stage and report the first divergent one.

Each stage is recomputed in float64 from its recorded inputs (teacher forcing; --chain: from the recomputed
outputs before it). An element diverges when either side is NaN or Inf, or when
  |actual - expected| > atol + rtol*|expected| + the producer's rounding bound
(the bound follows from the formula's condition and comparison_policy.producer_precision; see the README,
"Judging"). Hazards (rounding-dominated or undefined places: zero-std groups, clamps, extreme ratios) are
listed after the stages and never fail one."""

EXIT_CODES_HELP = """exit codes:
  0  every compared stage passed (validate: bundle valid; inspect: a bundle was found, its problems listed)
  1  a divergence was found
  2  bad command line
  3  bundle invalid, incomplete, unsafe or ambiguous, or a selection that cannot be exact (nothing recomputed)
  4  unsupported topology, stage or config knob (nothing guessed)
  5  internal error: a bug in this tool; one line names the saved traceback file (never 1)
"""

SCAN_EXIT_CODES_HELP = """exit codes (SPEC §9):
  0  every bundle passed
  1  a bundle diverged (a stage of its own, or stage link against its rollout bundle)
  2  bad command line
  3  no bundle under DIR, or a bundle invalid, incomplete or gone during the scan (and none diverged)
  4  a bundle needs an unsupported topology, stage or knob (and none diverged or was invalid)
  5  internal error in a row (its line names the saved traceback), or a worker that died
  130  interrupted (Ctrl+C): the rows that finished are printed
"""

STYLES = {
    "header-fail": "bold red",
    "header-pass": "bold green",
    "pass": "green",
    "fail": "bold red",
    "skipped": "dim",
    "detail": "yellow",
    "hazard": "cyan",
    "explanation": "bold yellow",
    "warning": "magenta",
    "title": "bold",
    "": "",
}


def use_color(stream: TextIO) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def emit(lines: Sequence[tuple[str, str]], stream: Optional[TextIO] = None) -> None:
    """Rich colours on a TTY, plain text otherwise (pipes, CI logs, files). Every line is escaped here, the
    last step before the terminal: whatever a view forgot, a bundle string never writes an escape sequence."""
    stream = stream or sys.stdout
    lines = [(style, safe(line)) for style, line in lines]
    if use_color(stream):
        from rich.console import Console
        from rich.text import Text

        console = Console(file=stream, highlight=False, soft_wrap=True)
        for style, line in lines:
            console.print(Text(line, style=STYLES.get(style, "")))
    else:
        stream.write("".join(line + "\n" for _, line in lines))
    stream.flush()


# ------------------------------------------------------------------------------------- arguments


def add_selection_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("selection (repeatable, combinable; expands to whole semantic groups)")
    g.add_argument("--sample", action="append", default=[], metavar="ID", help="sample id, e.g. s-0")
    g.add_argument("--group", action="append", default=[], metavar="G", help="semantic group, e.g. g-1")
    g.add_argument("--batch", action="append", default=[], metavar="MB", help="micro-batch id, e.g. mb-0007")
    a = p.add_argument_group("anchor (mutually exclusive; also picks a bundle in a capture directory)")
    a.add_argument("--step", metavar="R:S", help="require actor_step_id == (R, S) exactly")
    a.add_argument("--rollout", metavar="R", help="require a rollout-level bundle with rollout_id R")


def _size(text: str) -> int:
    from .safe_open import parse_size

    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < 1:  # no file fits a cap of 0: a usage error, not every bundle refused (exit 3)
        raise argparse.ArgumentTypeError(f"expected a positive size in bytes such as 67108864, 64M or 2G, got {text!r}")
    return size


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-json-bytes", type=_size, default=None, metavar="N",
                   help="size cap of every JSON file and sentinel read (bytes, or 64M, 4G; "
                        "default: index.json 2G, the others 64M)")


def apply_limits(args) -> None:
    """The file size caps of this command (``--max-json-bytes``, else the defaults)."""
    from .safe_open import set_max_json_bytes

    set_max_json_bytes(getattr(args, "max_json_bytes", None))


def add_replay_arguments(p: argparse.ArgumentParser, selection: bool = True) -> None:
    p.add_argument("--stage", action="append", default=[], metavar="NAME",
                   help="stage to replay (repeatable, or 'all'); what it needs runs too")
    if selection:
        add_selection_arguments(p)
    p.add_argument("--format", choices=("text", "json"), default="text", help="report format (default text)")
    p.add_argument("--max-divergences", type=int, default=5, metavar="N",
                   help="divergences kept per stage (default 5)")
    j = p.add_argument_group("judging (SPEC §4 teacher forcing, §5.1 error model)")
    j.add_argument("--chain", action="store_true",
                   help="recompute end to end: each stage consumes the recomputed outputs before it (would the "
                        "correct pipeline have produced the recorded loss?). Default: teacher forcing, each stage "
                        "judged on its recorded inputs, so the first divergence is the stage that is wrong")
    j.add_argument("--exact", action="store_true",
                   help="compare bitwise with a float32 recompute (same kernels, same hardware) instead of the "
                        "float64 recompute within the error model's tolerance")
    j.add_argument("--tolerance-policy", choices=TOLERANCE_POLICIES, default="bundle",
                   help="bundle (default): the bundle's atol/rtol are used as declared, and each one looser than "
                        "the defaults (atol 1e-6, rtol 1e-5) is reported as a warning; default: a bundle may only "
                        "tighten them, a looser value is capped at the default (and reported)")
    j.add_argument("--verbose", "-v", action="store_true",
                   help="text report: each divergence's tolerance and noise ratio |a - e| / tolerance, and each "
                        "stage's largest noise ratio")
    add_limit_arguments(p)


def anchor_from_args(args) -> tuple:
    from .selection import parse_rollout, parse_step

    if args.step is not None and args.rollout is not None:
        raise UsageError("--step and --rollout are mutually exclusive")
    step = parse_step(args.step) if args.step is not None else None
    rollout = parse_rollout(args.rollout) if args.rollout is not None else None
    return step, rollout


def replay_options(args) -> dict:
    """``replay()`` keyword arguments from parsed replay flags (shared with ``replay-tui``); UsageError → 2."""
    from .error_model import Rules
    from .runner import parse_stage_names
    from .selection import Selection

    try:
        stages = parse_stage_names(args.stage)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.max_divergences < 1:
        raise UsageError("--max-divergences must be at least 1")
    step, rollout = anchor_from_args(args)
    apply_limits(args)
    selection = Selection(samples=tuple(args.sample), groups=tuple(args.group), batches=tuple(args.batch))
    rules = Rules(chain=args.chain, exact=args.exact, tolerance_policy=args.tolerance_policy)
    return dict(stages=stages, selection=selection, step=step, rollout=rollout, max_divergences=args.max_divergences,
                rules=rules)


def run_check(args, stream: Optional[TextIO] = None) -> int:
    """The headless replay shared by ``trajectory-replay replay`` and ``replay-tui --check``."""
    from .report import render_text, report_to_json
    from .runner import replay

    stream = stream or sys.stdout
    report = replay(args.bundle, **replay_options(args))
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
            lines.append(("", "  rank      " + " ".join(f"{k}={v}" for k, v in ident.get('rank', {}).items())))
            wl = ident.get("weight_lineage") or {}
            lines.append(("", f"  weights   rollout={wl.get('rollout_weight')} actor={wl.get('actor_weight')}"))
            for key in ("rollout_partition_ids", "consumer_batch_ids", "micro_batch_ids", "normalization_cohort_ids"):
                if ident.get(key):
                    lines.append(("", f"  {key:<26}{elided_listing(ident[key], limit=8)}"))
        if b.producer:
            lines.append(("", f"  producer  commit={b.producer.get('commit')} torch={b.producer.get('torch_version')}"))
        if b.samples is not None:
            lines.append(("", f"  samples   {b.samples} in {b.groups} group(s), {b.tokens} token(s)"))
        if b.config:
            changed = config_changes(b.config)
            knobs = ", ".join(f"{k}={v}" for k, v in changed.items())
            rest = len(b.config) - len(changed)
            lines.append(("", f"  config    {knobs}" + (f" (+{rest} knobs at their defaults)" if rest else "")))
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
    from . import __version__

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
    p = sub.add_parser("scan", help="replay every bundle and cohort of a capture directory in parallel (SPEC §9)",
                       description="Replay every bundle and cohort under DIR in worker processes, check each step "
                                   "bundle against its rollout bundle (stage link), and name the first bad step.",
                       epilog=SCAN_EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path, metavar="DIR")
    from .run.command import add_scan_arguments

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
    from .importers.command import add_import_arguments

    add_import_arguments(p, _Parser)
    p = sub.add_parser("config", help="map a framework's config file to the RecomputeConfig JSON (SPEC §8)",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    from .frameworks.command import add_config_arguments

    add_config_arguments(p)
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
    escaped whole (a newline in it shows as ``\\n``), then runs of spaces are collapsed."""
    return f"{prog}: error: {' '.join(safe(err).split())}"


def _print_error(err: str, prog: str = "trajectory-replay") -> None:
    sys.stderr.write(error_line(err, prog) + "\n")
    sys.stderr.flush()


def print_internal_error(exc: BaseException, prog: str = "trajectory-replay") -> int:
    """An exception nobody expected: save its traceback, print the one line naming the file; exit 5."""
    from .crash import internal_error_line

    try:
        sys.stdout.flush()
    except Exception:  # a closed or broken stdout must not hide the line
        pass
    sys.stderr.write(internal_error_line(exc, prog) + "\n")
    sys.stderr.flush()
    return EXIT_INTERNAL


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return _main(argv)
    except Exception as exc:  # a bug in this tool: exit 5, never 1 ("a divergence was found")
        return print_internal_error(exc)


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
        from .run.command import run_scan_command

        return run_scan_command(args)
    if args.command == "diff":
        from .run.diff import run_diff_command

        return run_diff_command(args)
    if args.command == "import":
        from .importers.command import run_import_command

        return run_import_command(args)
    if args.command == "config":
        from .frameworks.command import run_config_command

        return run_config_command(args)
    if args.command == "validate":
        from .validate import validate

        step, rollout = anchor_from_args(args)
        result = validate(args.bundle, step=step, rollout=rollout)
        if args.format == "json":
            sys.stdout.write(json_document(result))
        else:
            emit(_validate_lines(result))
        return 0
    if args.command == "inspect":
        from .inspection import inspect

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
    from . import demo

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
                                kl_coef=args.kl_coef, bundle_id=args.dir.name, settle=True)
    emit([("", f"wrote {path}")])
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
