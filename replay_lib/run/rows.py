"""A scan's rows: the targets, their verdicts and the scan's exit code (SPEC §9) — the data the scan, its
executors, the link check, the CLI and the run view share.

Row statuses: ``pass``; ``diverged`` (a stage of the bundle, or the cross-bundle ``link`` stage, diverged:
exit 1); ``invalid`` (the bundle is invalid, incomplete, unsafe: exit 3); ``unsupported`` (exit 4);
``vanished`` (the bundle was listed but was gone when its turn came: exit 3); ``error`` (a bug in this
tool or a worker that died: exit 5, the message names the saved traceback or the signal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..errors import EXIT_DIVERGENCE, EXIT_INTERNAL, EXIT_INVALID, EXIT_PASS, EXIT_UNSUPPORTED, ReplayError
from ..safe_text import one_line, safe

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
    ``stage``: the JSON of the link :class:`~replay_lib.judge.report.StageReport`."""

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


DEFAULT_TIMEOUT = 600.0  # seconds per bundle, ``scan --timeout``'s default


@dataclass(frozen=True)
class ScanOptions:
    """What every row is replayed with (picklable: it travels to the workers). ``stages``: stage names
    (``None``: all); the judging rules of ``replay``; ``timeout``: the executors' limit per bundle."""

    stages: Optional[tuple[str, ...]] = None
    chain: bool = False
    exact: bool = False
    tolerance_policy: str = "bundle"
    bitwise: bool = False  # --bitwise (logprob.mismatch's oracle)
    max_divergences: int = 5
    max_json_bytes: Optional[int] = None
    link: bool = True
    # seconds one bundle may take (``--timeout``; ``None`` or 0: no limit): past it, the bundle's worker is killed
    # and replaced, and the bundle is an ``error`` row naming the limit
    timeout: Optional[float] = DEFAULT_TIMEOUT


def _status_of(exc: ReplayError) -> str:
    return STATUS_UNSUPPORTED if exc.exit_code == EXIT_UNSUPPORTED else STATUS_INVALID


def row_of_report(target: ScanTarget, report, seconds: float, link: Optional[LinkResult] = None) -> ScanRow:
    """A row from a bundle's :class:`~replay_lib.judge.report.ReplayReport` and its link result: the bundle's own
    first divergent stage first; ``link`` is the first when every stage of the bundle passed."""
    import msgspec

    from ..judge.report import divergence_line, header_line

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
                   message=one_line(message), seconds=seconds)


def timeout_row(target: ScanTarget, timeout: float, seconds: float, how: str) -> ScanRow:
    """The ``error`` row of a bundle whose replay ran past ``timeout`` seconds (``how``: what became of the
    process that was replaying it)."""
    return error_row(target, STATUS_ERROR, f"{target.path}: not replayed within the time limit of {timeout:g} s "
                                           f"(--timeout); {how}; the other bundles were scanned on", seconds)


def scan_exit_code(rows: Sequence[ScanRow]) -> int:
    """SPEC §9: 1 if any row diverged, else 3 (invalid or vanished), else 4 (unsupported), else 5 (error), else 0."""
    codes = {r.exit_code for r in rows}
    return next((c for c in _EXIT_PRECEDENCE if c in codes), EXIT_PASS)


def first_bad_row(rows: Sequence[ScanRow]) -> Optional[ScanRow]:
    """The first diverged row in (rollout_id, step_id) order — the first bad step."""
    return next((r for r in sorted(rows, key=lambda r: r.target.sort_key) if r.status == STATUS_DIVERGED), None)
