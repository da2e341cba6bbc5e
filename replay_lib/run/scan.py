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
tool or a worker that died: exit 5, the message names the saved traceback or the signal).

Exit code of a scan (SPEC §9): 1 if any bundle diverged, else 3 if any is invalid or vanished, else 4 if
any is unsupported, else 5 if any row is an error, else 0 (an empty scan is refused before, exit 3).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..errors import EXIT_DIVERGENCE, EXIT_INTERNAL, EXIT_INVALID, EXIT_PASS, EXIT_UNSUPPORTED, ReplayError
from ..safe_text import safe

STATUS_PASS = "pass"
STATUS_DIVERGED = "diverged"
STATUS_INVALID = "invalid"
STATUS_UNSUPPORTED = "unsupported"
STATUS_ERROR = "error"
STATUS_VANISHED = "vanished"
STATUSES = (STATUS_PASS, STATUS_DIVERGED, STATUS_INVALID, STATUS_UNSUPPORTED, STATUS_ERROR, STATUS_VANISHED)

KIND_ROLLOUT, KIND_STEP, KIND_COHORT, KIND_UNKNOWN = "rollout", "step", "cohort", "unknown"

_EXIT_OF_STATUS = {STATUS_PASS: EXIT_PASS, STATUS_DIVERGED: EXIT_DIVERGENCE, STATUS_INVALID: EXIT_INVALID,
                   STATUS_VANISHED: EXIT_INVALID, STATUS_UNSUPPORTED: EXIT_UNSUPPORTED,
                   STATUS_ERROR: EXIT_INTERNAL}
# SPEC §9's precedence: a divergence first, then invalid input, then unsupported; a tool error after them.
_EXIT_PRECEDENCE = (EXIT_DIVERGENCE, EXIT_INVALID, EXIT_UNSUPPORTED, EXIT_INTERNAL)


@dataclass(frozen=True)
class ScanTarget:
    """One bundle or cohort of a scan. ``kind``: ``rollout`` | ``step`` | ``cohort`` | ``unknown`` (the
    identity could not be read: ``problem`` says why; its row gives the reader's own error). ``anchor``:
    ``"23:0"`` for a step (or a step cohort), ``"rollout 23"`` for a rollout, ``"?"`` unknown."""

    path: Path
    relpath: str
    kind: str
    rollout_id: Optional[int]
    step_id: Optional[int]
    anchor: str
    problem: Optional[str] = None

    @property
    def sort_key(self) -> tuple:
        """(rollout_id, step_id, path): a rollout-level bundle before the steps of its rollout, unknown last."""
        big = float("inf")
        rollout = self.rollout_id if self.rollout_id is not None else big
        step = self.step_id if self.step_id is not None else (-1 if self.rollout_id is not None else big)
        return (rollout, step, self.relpath)

    @property
    def step_level(self) -> bool:
        return self.step_id is not None


@dataclass(frozen=True)
class ScanRow:
    """The verdict on one target (see the module docstring for ``status``). ``first_divergence``: one
    escaped line (field, sample@token, expected, actual); ``noise_ratio``: that divergence's
    ``|err| / tolerance``; ``message``: one escaped line; ``report``: the bundle's JSON report as
    ``replay --format json`` gives it (with the ``link`` stage appended when it ran), ``None`` when nothing
    was recomputed; ``link``: the cross-bundle check of a step bundle against its rollout bundle."""

    target: ScanTarget
    status: str
    exit_code: int
    first_stage: Optional[str] = None
    first_divergence: Optional[str] = None
    noise_ratio: Optional[float] = None
    message: str = ""
    report: Optional[dict] = None
    seconds: float = 0.0
    bundle_id: Optional[str] = None
    link: Optional["LinkResult"] = None

    @property
    def bad(self) -> bool:
        return self.status != STATUS_PASS

    def to_json(self) -> dict:
        t = self.target
        return {"path": t.relpath, "kind": t.kind, "anchor": t.anchor, "rollout_id": t.rollout_id,
                "step_id": t.step_id, "bundle_id": self.bundle_id, "status": self.status,
                "exit_code": self.exit_code, "first_stage": self.first_stage,
                "first_divergence": self.first_divergence, "noise_ratio": self.noise_ratio,
                "message": self.message, "seconds": round(self.seconds, 6), "report": self.report}


@dataclass(frozen=True)
class LinkResult:
    """Stage ``link`` of one step bundle against the rollout bundle of its rollout (SPEC §9). ``status``:
    ``pass`` | ``diverged`` | ``skipped`` (the rollout bundle could not be read: ``message`` says why).
    ``stage``: the JSON of the link :class:`~replay_lib.report.StageReport`."""

    target: ScanTarget
    rollout: ScanTarget
    status: str
    first_divergence: Optional[str] = None
    noise_ratio: Optional[float] = None
    message: str = ""
    stage: Optional[dict] = None
    step_bundle_id: Optional[str] = None
    rollout_bundle_id: Optional[str] = None

    @property
    def exit_code(self) -> int:
        return EXIT_DIVERGENCE if self.status == STATUS_DIVERGED else EXIT_PASS

    def to_json(self) -> dict:
        return {"step": self.target.relpath, "rollout": self.rollout.relpath, "anchor": self.target.anchor,
                "step_bundle_id": self.step_bundle_id, "rollout_bundle_id": self.rollout_bundle_id,
                "status": self.status, "first_divergence": self.first_divergence,
                "noise_ratio": self.noise_ratio, "message": self.message, "stage": self.stage}


@dataclass(frozen=True)
class ScanResult:
    rows: list[ScanRow]
    links: list[LinkResult]
    first_bad: Optional[ScanRow]
    exit_code: int
    interrupted: bool = False
    # targets that never got a row (the scan was stopped first)
    unfinished: list[ScanTarget] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATUSES}
        for r in self.rows:
            out[r.status] += 1
        return out


@dataclass(frozen=True)
class ScanOptions:
    """What every row is replayed with (picklable: it travels to the workers). ``stages``: stage names
    (``None``: all); the judging rules of ``replay``."""

    stages: Optional[tuple[str, ...]] = None
    chain: bool = False
    exact: bool = False
    tolerance_policy: str = "bundle"
    max_divergences: int = 5
    max_json_bytes: Optional[int] = None
    link: bool = True


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
    from ..bundle.resolution import _Anchor, _anchor_of, _looks_like_cohort

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
    directory raises :class:`~replay_lib.errors.BundleError` (the scan has nothing to look at)."""
    from ..bundle.resolution import _is_hidden, _looks_like_cohort, _real_dir
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
            is_candidate = os.path.lexists(entry / "manifest.json") or _looks_like_cohort(entry)
        except OSError:
            continue
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
        out[t.path] = found[0] if len(found) == 1 else (
            f"{len(found)} rollout-level bundles of rollout {t.rollout_id}: "
            f"{', '.join(r.relpath for r in found)}")
    return out


# ------------------------------------------------------------------------------------------ one row

LINK = "link"


def split_stages(names: Optional[Sequence[str]]):
    """``--stage`` names of a scan → (the bundle stages, ``None`` for all; whether stage link runs).
    ``link`` is the scan's own stage: ``--stage link`` alone checks the links and replays nothing else;
    without ``--stage`` (or with ``all``) everything runs. An unknown name raises ``ValueError``."""
    from ..runner import parse_stage_names

    if not names or "all" in names:
        return None, True
    own = [n for n in names if n != LINK]
    return (parse_stage_names(own) or []) if own else [], LINK in names


def _status_of(exc: ReplayError) -> str:
    return STATUS_UNSUPPORTED if exc.exit_code == EXIT_UNSUPPORTED else STATUS_INVALID


def row_of_report(target: ScanTarget, report, seconds: float, link: Optional[LinkResult] = None) -> ScanRow:
    """A row from a bundle's :class:`~replay_lib.report.ReplayReport` and its link result: the bundle's own
    first divergent stage first; ``link`` is the first when every stage of the bundle passed."""
    import msgspec

    from ..report import divergence_line, header_line

    doc = msgspec.to_builtins(report)
    first_stage = report.first_divergent_stage
    first_line = divergence_line(report.first_divergence) if report.first_divergence is not None else None
    ratio = report.first_divergence.noise_ratio if report.first_divergence is not None else None
    message = header_line(report)
    if report.first_divergence is None and first_stage is not None:
        stage = report.stage(first_stage)
        first_line = stage.reason if stage is not None else None
    if link is not None and link.stage is not None:
        doc["stages"].append(link.stage)
        if link.status == STATUS_DIVERGED and first_stage is None:
            first_stage, first_line, ratio = "link", link.first_divergence, link.noise_ratio
            doc.update(passed=False, first_divergent_stage="link",
                       first_divergence=(link.stage.get("divergences") or [None])[0])
            message = f"bundle {report.bundle_id} — first divergent stage: link ({link.message})"
    status = STATUS_DIVERGED if first_stage is not None else STATUS_PASS
    return ScanRow(target=target, status=status, exit_code=_EXIT_OF_STATUS[status], first_stage=first_stage,
                   first_divergence=safe(first_line) if first_line is not None else None, noise_ratio=ratio,
                   message=safe(message), report=doc, seconds=seconds, bundle_id=report.bundle_id, link=link)


def error_row(target: ScanTarget, status: str, message: str, seconds: float = 0.0) -> ScanRow:
    """A row for a target nothing was recomputed for (``message``: one line, escaped here)."""
    return ScanRow(target=target, status=status, exit_code=_EXIT_OF_STATUS[status],
                   message=" ".join(safe(message).split()), seconds=seconds)


def check_target(target: ScanTarget, options: ScanOptions = ScanOptions(),
                 partner: ScanTarget | str | None = None) -> ScanRow:
    """Replay one target as ``trajectory-replay replay PATH`` would, then (a step bundle with a rollout
    bundle in the scan) stage ``link``. Never raises: every failure is a row. ``options.stages``: of the
    requested stages, those this bundle declares ``recompute`` run; a bundle declaring none of them passes
    with nothing compared (``--stage loss.policy`` over a run checks the step bundles, and the rollout
    bundles are not "unsupported" for lacking a loss)."""
    start = time.perf_counter()

    def elapsed() -> float:
        return time.perf_counter() - start

    if not os.path.lexists(target.path):
        return error_row(target, STATUS_VANISHED, f"{target.path}: vanished during the scan (listed, then gone)")
    try:
        from ..error_model import Rules
        from ..bundle import open_bundle
        from ..runner import run_replay
        from ..safe_open import set_max_json_bytes

        set_max_json_bytes(options.max_json_bytes)
        rules = Rules(chain=options.chain, exact=options.exact, tolerance_policy=options.tolerance_policy)
        stages, run_link = split_stages(options.stages)
        bundles = open_bundle(target.path)
        if stages is not None:  # --stage in a scan: the requested stages each bundle declares recompute
            from ..schema import StageCapability

            contracts = bundles.shards[0].manifest.stage_contracts
            stages = [s for s in stages if s in contracts and contracts[s].capability == StageCapability.RECOMPUTE]
        report = run_replay(bundles, stages=stages, max_divergences=options.max_divergences, rules=rules)
        link = None
        if options.link and run_link and partner is not None:
            from .link import check_link

            link = check_link(target, bundles, partner, options)
        return row_of_report(target, report, elapsed(), link)
    except ReplayError as exc:
        if not os.path.lexists(target.path):
            return error_row(target, STATUS_VANISHED, f"{target.path}: vanished during the scan ({exc})", elapsed())
        return error_row(target, _status_of(exc), str(exc), elapsed())
    except OSError as exc:  # unreadable, or gone while it was read
        if not os.path.lexists(target.path):
            return error_row(target, STATUS_VANISHED, f"{target.path}: vanished during the scan", elapsed())
        where = exc.filename if exc.filename is not None else target.path
        return error_row(target, STATUS_INVALID, f"{where}: cannot read: {exc.strerror or exc}", elapsed())
    except Exception as exc:  # a bug in this tool: the row names the saved traceback, the scan goes on
        from ..crash import internal_error_line

        line = internal_error_line(exc).removeprefix("trajectory-replay: ")
        return error_row(target, STATUS_ERROR, f"{target.path}: {line}", elapsed())


# ------------------------------------------------------------------------------------------ the scan


def scan_exit_code(rows: Sequence[ScanRow]) -> int:
    """SPEC §9: 1 if any row diverged, else 3 (invalid or vanished), else 4 (unsupported), else 5 (error), else 0."""
    codes = {r.exit_code for r in rows}
    return next((c for c in _EXIT_PRECEDENCE if c in codes), EXIT_PASS)


def first_bad_row(rows: Sequence[ScanRow]) -> Optional[ScanRow]:
    """The first diverged row in (rollout_id, step_id) order — the first bad step."""
    return next((r for r in sorted(rows, key=lambda r: r.target.sort_key) if r.status == STATUS_DIVERGED), None)


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


def main_check(args, stream=None) -> int:
    """``replay-tui DIR --check``: exactly ``trajectory-replay scan DIR`` (see
    :func:`replay_lib.run.command.main_check`)."""
    from .command import main_check as check

    return check(args, stream)
