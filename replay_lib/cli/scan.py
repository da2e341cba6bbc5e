"""The ``scan`` command's arguments, progress bar and text / JSON output (``trajectory-replay scan`` and
``replay-tui DIR --check``); the work is :func:`replay_lib.run.scan.scan`.

Text: one row per bundle in (rollout_id, step_id) order, ``[  status] anchor  bundle  first stage  first
divergence``, then the summary (counts, links checked, ``first bad step: 23:0 (b-00023) — reward.post_process``).
A progress bar (rich) is drawn on stderr only when stderr is a terminal; rows are printed when the scan
ends, sorted. JSON: ``{"bundles": [row…], "links": [link…], "summary": {…}}``, each row carrying its
bundle's ``replay --format json`` report under ``report``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Optional, TextIO

from ..errors import UsageError
from ..safe_text import json_document, safe

EXIT_INTERRUPTED = 130


def default_jobs() -> int:
    """The CPUs this process may run on (its affinity), else the CPU count (``run.threads.usable_cpus``)."""
    from ..run.threads import usable_cpus

    return usable_cpus()


def add_scan_arguments(p: argparse.ArgumentParser) -> None:
    """The scan-only flags (``--jobs``, ``--executor``, ``--ray-address``, ``--fail-fast``, ``--timeout``)."""
    from ..run.executor import EXECUTORS
    from ..run.rows import DEFAULT_TIMEOUT

    p.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                   help="worker processes (default: the CPU count)")
    p.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="local worker processes (default) or Ray tasks on a cluster (pip install "
                        "'trajectory-replay[ray]')")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the Ray cluster to use with --executor ray (default: RAY_ADDRESS, else a local one)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first diverged bundle")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help=f"time limit per bundle: one still replaying after it is an error row naming the limit, its "
                        f"worker process is killed and replaced and the scan goes on (default: {DEFAULT_TIMEOUT:g}; "
                        f"0: no limit)")


def options_from_args(args):
    from ..run.rows import DEFAULT_TIMEOUT
    from ..run.scan import ScanOptions

    return ScanOptions(stages=tuple(getattr(args, "stage", None) or ()) or None, chain=getattr(args, "chain", False),
                       exact=getattr(args, "exact", False), bitwise=getattr(args, "bitwise", False),
                       tolerance_policy=getattr(args, "tolerance_policy", "bundle"),
                       max_divergences=getattr(args, "max_divergences", 5),
                       max_json_bytes=getattr(args, "max_json_bytes", None),
                       timeout=getattr(args, "timeout", DEFAULT_TIMEOUT) or None)


# ------------------------------------------------------------------------------------------ output


STATUS_STYLES = {"pass": "pass", "diverged": "fail", "invalid": "warning", "unsupported": "warning",
                 "vanished": "warning", "error": "fail"}


def kind_anchor(target) -> str:
    """``step 23:0``, ``cohort 23:0``, ``rollout 23`` or ``?``: the kind and the anchor in one column."""
    if target.kind in ("step", "cohort"):
        return f"{target.kind} {target.anchor}"
    return target.anchor


def row_line(row, verbose: bool = False) -> str:
    """``[   diverged] step 23:0      b-00023 — reward.post_process: reward s-0: expected=… actual=…``"""
    from ..judge.report import fmt_ratio

    t = row.target
    line = f"[{row.status:>11}] {kind_anchor(t):<14} {safe(row.bundle_id or t.relpath)}"
    if row.bundle_id and row.bundle_id != t.relpath:
        line += f" ({safe(t.relpath)})"
    if row.status == "diverged":
        line += f" — {row.first_stage}"
        if row.first_divergence:
            line += f": {row.first_divergence}"
            if verbose and row.noise_ratio is not None:
                line += f" ({fmt_ratio(row.noise_ratio)}× noise)"
    elif row.status != "pass":
        line += f" — {row.message}"
    if getattr(row, "mismatch", None) is not None:
        line += "  " + mismatch_cell(row.mismatch)
    return line


def mismatch_cell(m: dict) -> str:
    """``rollout≠old 3/42 max|Δ| 0.125 k3 7.87e-03``: a row's rollout-vs-old log-prob mismatch."""
    return f"rollout≠old {m['count']}/{m['tokens']} max|Δ| {m['max_abs']:.3g} k3 {m['k3']:.3g}"


def first_bad_line(result) -> str:
    row = result.first_bad
    if row is None:
        return "first bad step: none"
    return safe(f"first bad step: {row.target.anchor} ({row.bundle_id or row.target.relpath}) — {row.first_stage}")


def summary_lines(result, total: int) -> list[tuple[str, str]]:
    counts = {k: v for k, v in result.counts().items() if v}
    done = len(result.rows)
    head = f"{done} bundle(s) scanned" if done == total else f"{done} of {total} bundle(s) scanned"
    text = ", ".join(f"{n} {status}" for status, n in counts.items())
    links = [l for l in result.links if l.status != "skipped"]
    bad_links = sum(1 for l in links if l.status == "diverged")
    line = f"{head}: {text}" if text else head
    if result.links:
        line += f"; link: {len(links)} step(s) checked against their rollout bundle, {bad_links} diverged"
    out = [("title", line), ("header-fail" if result.first_bad else "header-pass", first_bad_line(result))]
    if result.interrupted:
        out.append(("warning", f"interrupted: {len(result.unfinished)} bundle(s) not scanned"))
    elif result.unfinished:  # --fail-fast stopped it (JSON: "unfinished", "interrupted": false, exit 1)
        out.append(("warning", f"stopped at the first diverged bundle (--fail-fast): {len(result.unfinished)} "
                               f"bundle(s) not scanned"))
    return out


CAUSE_INDENT = " " * 14


def result_lines(result, total: int, verbose: bool = False) -> list[tuple[str, str]]:
    lines = []
    for r in result.rows:
        lines.append((STATUS_STYLES.get(r.status, ""), row_line(r, verbose)))
        if r.status == "diverged" and r.cause:  # the row's likely cause, under it
            lines.append(("explanation", f"{CAUSE_INDENT}likely cause: {r.cause}"))
    for link in result.links:
        if link.status == "skipped":
            lines.append(("skipped", safe(f"link {link.target.anchor}: skipped — {link.message}")))
    from ..run.mismatch_series import run_series, series_line

    series = run_series(result.rows)
    if series is not None:
        lines.append(("", series_line(series)))
    return lines + summary_lines(result, total)


def result_json(result, total: int) -> dict:
    doc = {
        "bundles": [r.to_json() for r in result.rows],
        "links": [l.to_json() for l in result.links],
        "summary": {
            "bundles": total, "scanned": len(result.rows), "counts": result.counts(),
            "exit_code": result_exit_code(result), "interrupted": result.interrupted,
            "unfinished": [t.relpath for t in result.unfinished],
            "first_bad": None if result.first_bad is None else {
                "anchor": result.first_bad.target.anchor, "path": result.first_bad.target.relpath,
                "bundle_id": result.first_bad.bundle_id, "stage": result.first_bad.first_stage,
                "first_divergence": result.first_bad.first_divergence},
        },
    }
    from ..run.mismatch_series import run_series

    series = run_series(result.rows)  # only where the step bundles record rollout_log_probs
    if series is not None:
        doc["summary"]["mismatch_series"] = series
    return doc


def result_exit_code(result) -> int:
    return EXIT_INTERRUPTED if result.interrupted else result.exit_code


class _Progress:
    """A rich progress bar on stderr while the scan runs, only when stderr is a terminal."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.bar = None
        if total and stream.isatty() and os.environ.get("TERM") != "dumb":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("scan"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[bad]} bad"), TimeRemainingColumn(),
                                console=Console(file=stream), transient=True)
            self.task = self.bar.add_task("scan", total=total, bad=0)
            self.bad = 0
            self.bar.start()

    def advance(self, row) -> None:
        if self.bar is not None:
            self.bad += row.bad
            self.bar.update(self.task, advance=1, bad=self.bad)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_scan_command(args, stream: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    """``trajectory-replay scan DIR``: discover, scan, print; the exit code of SPEC §9 (130: interrupted)."""
    from .output import emit
    from ..run.scan import discover, scan, split_stages

    stream = stream or sys.stdout
    err = err or sys.stderr
    directory = getattr(args, "dir", None) or args.bundle
    jobs = args.jobs if getattr(args, "jobs", None) is not None else default_jobs()
    if jobs < 1:
        raise UsageError("--jobs must be at least 1")
    if getattr(args, "max_divergences", 5) < 1:
        raise UsageError("--max-divergences must be at least 1")
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not timeout >= 0:  # negative or NaN
        raise UsageError(f"--timeout must be a number of seconds, 0 for no limit (got {timeout:g})")
    options = options_from_args(args)
    try:
        split_stages(options.stages)
    except ValueError as exc:
        raise UsageError(str(exc).replace("(expected one of: all, ", "(expected one of: all, link, ")) from None
    targets = discover(directory)
    if not targets:
        from ..errors import BundleError

        raise BundleError(f"{directory}: no bundle found (no manifest.json, no bundle subdirectories)")
    stop = threading.Event()
    progress = _Progress(len(targets), err)
    previous = _stop_on_sigint(stop)
    try:
        result = scan(targets, jobs=min(jobs, len(targets)), executor=getattr(args, "executor", "local"),
                      ray_address=getattr(args, "ray_address", None), fail_fast=getattr(args, "fail_fast", False),
                      on_row=progress.advance, stop=stop, options=options)
    finally:
        progress.close()
        _restore_sigint(previous)
    if getattr(args, "format", "text") == "json":
        stream.write(json_document(result_json(result, len(targets))))
        stream.flush()
    else:
        emit(result_lines(result, len(targets), getattr(args, "verbose", False)), stream)
    return result_exit_code(result)


def main_check(args, stream: Optional[TextIO] = None) -> int:
    """``replay-tui DIR --check``: the same as ``trajectory-replay scan DIR`` with the replay flags of
    ``args`` (``--jobs`` etc. when the parser has them, else their defaults)."""
    return run_scan_command(args, stream)


def _stop_on_sigint(stop: threading.Event):
    """Ctrl+C sets ``stop`` (the scan returns what finished) instead of raising in the middle of it."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        stop.set()

    return signal.signal(signal.SIGINT, handler)


def _restore_sigint(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGINT, previous)


def is_capture_dir(path) -> bool:
    """Whether ``path`` is a capture directory of several bundles (``replay-tui DIR`` opens the run view)."""
    from pathlib import Path

    from ..bundle import resolve_bundle
    from ..errors import ReplayError

    try:
        return resolve_bundle(Path(path)).kind == "capture"
    except ReplayError:
        return False


__all__ = ["add_scan_arguments", "default_jobs", "is_capture_dir", "main_check", "run_scan_command"]
