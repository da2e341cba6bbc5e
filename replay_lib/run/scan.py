"""``trajectory-replay scan DIR``: every bundle and cohort under a capture directory, replayed (SPEC §9).

The API the CLI and the run view share:

* :func:`discover` lists the targets (what :func:`~replay_lib.bundle.resolve_capture` knows as candidates),
  sorted by (rollout_id, step_id, path); it never raises on a bad entry — an unreadable candidate is a target
  of kind ``unknown`` whose row says why.
* :func:`scan` replays them in worker processes (``executor="local"``, start-up paid once per worker) or Ray
  tasks (``executor="ray"``), calls ``on_row`` in the calling thread as each row finishes, and returns a
  :class:`ScanResult` sorted like :func:`discover`. ``stop.set()`` (Ctrl+C) stops the workers and returns
  what finished.
* :func:`check_target` is the work of one row (what a worker runs), :func:`scan_exit_code` the verdict.

Row statuses: ``pass``; ``diverged`` (a stage of the bundle, or the cross-bundle ``link`` stage, diverged:
exit 1); ``invalid`` (the bundle is invalid, incomplete, unsafe: exit 3); ``unsupported`` (exit 4);
``vanished`` (the bundle was listed but was gone when its turn came: exit 3); ``error`` (a bug in this
tool, a worker that died, or a bundle still replaying after ``ScanOptions.timeout`` seconds — its worker is
killed and replaced: exit 5, the message names the saved traceback, the signal or the time limit).

Exit code of a scan (SPEC §9): 1 if any bundle diverged, else 3 if any is invalid or vanished, else 4 if
any is unsupported, else 5 if any row is an error, else 0 (an empty scan is refused before, exit 3).
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from .check import LINK, check_target, split_stages
from .rows import (KIND_COHORT, KIND_ROLLOUT, KIND_STEP, KIND_UNKNOWN, STATUS_DIVERGED, STATUS_ERROR,
                   STATUS_INVALID, STATUS_PASS, STATUS_UNSUPPORTED, STATUS_VANISHED, STATUSES, LinkResult,
                   ScanOptions, ScanResult, ScanRow, ScanTarget, error_row, first_bad_row, row_of_report,
                   scan_exit_code)

# ------------------------------------------------------------------------------------------ discover


def _target(root: Path, path: Path, cohort: bool, anchor) -> ScanTarget:
    relpath = os.path.relpath(path, root) if path != root else path.name or str(path)
    if anchor.step is not None:
        r, s = int(anchor.step.rollout_id), int(anchor.step.step_id)
        return ScanTarget(path, relpath, KIND_COHORT if cohort else KIND_STEP, r, s, f"{r}:{s}")
    if anchor.rollout is not None:
        r = int(anchor.rollout)
        return ScanTarget(path, relpath, KIND_COHORT if cohort else KIND_ROLLOUT, r, None, f"rollout {r}")
    why = anchor.unreadable or "no identity in index.json"
    return ScanTarget(path, relpath, KIND_UNKNOWN, None, None, "?", problem=why)


def _candidate(root: Path, path: Path) -> ScanTarget:
    from ..bundle.locate import _Anchor, _anchor_of, _looks_like_cohort

    cohort = not os.path.lexists(path / "manifest.json") and _looks_like_cohort(path)  # a bundle has COMPLETE.0 too
    try:
        anchor = _anchor_of(root, path)
    except OSError as exc:  # gone or unreadable while listed
        anchor = _Anchor(None, None, f"cannot read: {exc.strerror or exc}")
    return _target(root, path, cohort, anchor)


def discover(directory: Path) -> list[ScanTarget]:
    """Every bundle and cohort in ``directory`` (a capture directory; a bundle or cohort path is one
    target), sorted by (rollout_id, step_id, path). Hidden entries and symbolic links are skipped as
    :func:`~replay_lib.bundle.resolve_capture` skips them; a candidate is a real subdirectory holding a
    ``manifest.json`` or rank shards. Never raises on a bad entry; a directory that is not there or not a
    directory raises :class:`~replay_lib.errors.BundleError` (the scan has nothing to look at). A real
    subdirectory that cannot be looked into (EACCES …) is a target too, of kind ``unknown``: its row says it
    cannot be read (exit 3); it is never left out."""
    from ..bundle.locate import _is_hidden, _looks_like_cohort, _real_dir, holds_a_bundle
    from ..errors import BundleError

    directory = Path(directory)
    if not directory.is_dir():
        what = "no such file or directory" if not os.path.lexists(directory) else "not a directory"
        raise BundleError(f"{directory}: {what}")
    if os.path.lexists(directory / "manifest.json") or _looks_like_cohort(directory):
        return [_candidate(directory.parent, directory)]
    targets = []
    try:
        entries = sorted(directory.iterdir())
    except OSError as exc:
        raise BundleError(f"{directory}: cannot list: {exc.strerror or exc}") from None
    for entry in entries:
        if _is_hidden(entry) or not _real_dir(entry):
            continue
        try:
            is_candidate = holds_a_bundle(entry)
        except OSError:  # cannot be looked into (EACCES …): a target whose row says why, never left out
            is_candidate = True
        if is_candidate:
            targets.append(_candidate(directory, entry))
    return sorted(targets, key=lambda t: t.sort_key)


def link_partners(targets: Sequence[ScanTarget]) -> dict[Path, ScanTarget | str]:
    """For each step-level target, the rollout-level target of its rollout (or why there is none to use:
    two rollout bundles of the same rollout are ambiguous). Steps without one are left out."""
    rollouts: dict[int, list[ScanTarget]] = {}
    for t in targets:
        if t.rollout_id is not None and t.step_id is None:
            rollouts.setdefault(t.rollout_id, []).append(t)
    out: dict[Path, ScanTarget | str] = {}
    for t in targets:
        if t.step_id is None or t.rollout_id not in rollouts:
            continue
        found = rollouts[t.rollout_id]
        others = sorted((r for rid, rs in rollouts.items() if rid != t.rollout_id for r in rs),
                        key=lambda r: (abs(r.rollout_id - t.rollout_id), r.rollout_id > t.rollout_id, r.relpath))
        out[t.path] = replace(found[0], siblings=tuple(others[:8])) if len(found) == 1 else (
            f"{len(found)} rollout-level bundles of rollout {t.rollout_id}: "
            f"{', '.join(r.relpath for r in found)}")
    return out


# ------------------------------------------------------------------------------------------ the scan


def scan(targets: Sequence[ScanTarget], *, jobs: int, executor: str = "local", ray_address: Optional[str] = None,
         stages: Optional[Sequence[str]] = None, fail_fast: bool = False,
         on_row: Optional[Callable[[ScanRow], None]] = None, stop: Optional[threading.Event] = None,
         options: Optional[ScanOptions] = None) -> ScanResult:
    """Replay every target in ``jobs`` worker processes (``executor="local"``) or as Ray tasks
    (``executor="ray"``, on the cluster at ``ray_address``, else a local one). ``on_row`` is called in
    this thread as each row finishes, in any order; ``fail_fast``: stop at the first diverged row (the
    rows already finished are kept); ``stop.set()`` from another thread stops the workers promptly.
    ``stages``: stage names as ``--stage`` takes them (``options`` carries the other replay flags)."""
    from .executor import make_executor

    options = options or ScanOptions()
    if stages is not None:
        options = replace(options, stages=tuple(stages) or None)
    split_stages(options.stages)  # ValueError on a bad name, before any worker starts
    targets = sorted(targets, key=lambda t: t.sort_key)
    partners = link_partners(targets) if options.link else {}
    stop = stop or threading.Event()
    rows: list[ScanRow] = []
    stopped_early = False

    def take(row: ScanRow) -> None:
        nonlocal stopped_early
        rows.append(row)
        if on_row is not None:
            on_row(row)
        if fail_fast and row.status == STATUS_DIVERGED:
            stopped_early = True
            stop.set()

    work = [(t, partners.get(t.path)) for t in targets]
    if work:
        run = make_executor(executor, jobs=jobs, ray_address=ray_address)
        run(work, options, take, stop)
    done = {r.target.path for r in rows}
    unfinished = [t for t in targets if t.path not in done]
    rows.sort(key=lambda r: r.target.sort_key)
    links = [r.link for r in rows if r.link is not None]
    return ScanResult(rows=rows, links=links, first_bad=first_bad_row(rows), exit_code=scan_exit_code(rows),
                      interrupted=bool(unfinished) and not stopped_early, unfinished=unfinished)


__all__ = ["KIND_COHORT", "KIND_ROLLOUT", "KIND_STEP", "KIND_UNKNOWN", "LINK", "STATUSES", "STATUS_DIVERGED",
           "STATUS_ERROR", "STATUS_INVALID", "STATUS_PASS", "STATUS_UNSUPPORTED", "STATUS_VANISHED", "LinkResult",
           "ScanOptions", "ScanResult", "ScanRow", "ScanTarget", "check_target", "discover", "error_row",
           "first_bad_row", "link_partners", "row_of_report", "scan", "scan_exit_code", "split_stages"]
