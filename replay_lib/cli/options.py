"""The arguments ``replay``, ``scan`` and ``replay-tui`` share (selection, anchor, judging, JSON limits) and
what they turn into: the options of :func:`replay_lib.run.runner.replay`."""

from __future__ import annotations

import argparse

from ..errors import UsageError

TOLERANCE_POLICIES = ("bundle", "default")  # replay_lib.judge.error_model's, without importing torch for --help

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
  5  internal error in a row (its line names the saved traceback), a worker that died, or a bundle over --timeout
  130  interrupted (Ctrl+C): the rows that finished are printed
"""



def add_selection_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("selection (repeatable, combinable; expands to whole semantic groups)")
    g.add_argument("--sample", action="append", default=[], metavar="ID", help="sample id, e.g. s-0")
    g.add_argument("--group", action="append", default=[], metavar="G", help="semantic group, e.g. g-1")
    g.add_argument("--batch", action="append", default=[], metavar="MB", help="micro-batch id, e.g. mb-0007")
    a = p.add_argument_group("anchor (mutually exclusive; also picks a bundle in a capture directory)")
    a.add_argument("--step", metavar="R:S", help="require actor_step_id == (R, S) exactly")
    a.add_argument("--rollout", metavar="R", help="require a rollout-level bundle with rollout_id R")


def _size(text: str) -> int:
    from ..bundle.safe_open import parse_size

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
    from ..bundle.safe_open import set_max_json_bytes

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
    j.add_argument("--bitwise", action="store_true",
                   help="the true-on-policy oracle for any bundle: every loss token where rollout_log_probs and "
                        "old_log_probs differ is a divergence at logprob.mismatch (tolerance 0), as the bundle's "
                        "config.true_on_policy asks")
    j.add_argument("--tolerance-policy", choices=TOLERANCE_POLICIES, default="bundle",
                   help="bundle (default): the bundle's atol/rtol are used as declared, and each one looser than "
                        "the defaults (atol 1e-6, rtol 1e-5) is reported as a warning; default: a bundle may only "
                        "tighten them, a looser value is capped at the default (and reported)")
    j.add_argument("--verbose", "-v", action="store_true",
                   help="text report: each divergence's tolerance and noise ratio |a - e| / tolerance, and each "
                        "stage's largest noise ratio")
    add_limit_arguments(p)


def anchor_from_args(args) -> tuple:
    from ..bundle.selection import parse_rollout, parse_step

    if args.step is not None and args.rollout is not None:
        raise UsageError("--step and --rollout are mutually exclusive")
    step = parse_step(args.step) if args.step is not None else None
    rollout = parse_rollout(args.rollout) if args.rollout is not None else None
    return step, rollout


def replay_options(args) -> dict:
    """``replay()`` keyword arguments from parsed replay flags (shared with ``replay-tui``); UsageError → 2."""
    from ..judge.error_model import Rules
    from ..run.runner import parse_stage_names
    from ..bundle.selection import Selection

    try:
        stages = parse_stage_names(args.stage)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.max_divergences < 1:
        raise UsageError("--max-divergences must be at least 1")
    step, rollout = anchor_from_args(args)
    apply_limits(args)
    selection = Selection(samples=tuple(args.sample), groups=tuple(args.group), batches=tuple(args.batch))
    rules = Rules(chain=args.chain, exact=args.exact, tolerance_policy=args.tolerance_policy,
                  bitwise=getattr(args, "bitwise", False))
    return dict(stages=stages, selection=selection, step=step, rollout=rollout, max_divergences=args.max_divergences,
                rules=rules)
