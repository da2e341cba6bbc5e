"""The work of one scan row (what a worker process or a Ray task runs): replay one target as
``trajectory-replay replay PATH`` would, then stage ``link`` against its rollout bundle."""

from __future__ import annotations

import os
import time
from typing import Optional, Sequence

from ..errors import ReplayError
from .rows import (STATUS_ERROR, STATUS_INVALID, STATUS_VANISHED, ScanOptions, ScanRow, ScanTarget, _status_of,
                   error_row, row_of_report)

LINK = "link"


def split_stages(names: Optional[Sequence[str]]):
    """``--stage`` names of a scan → (the bundle stages, ``None`` for all; whether stage link runs).
    ``link`` is the scan's own stage: ``--stage link`` alone checks the links and replays nothing else;
    without ``--stage`` (or with ``all``) everything runs. An unknown name raises ``ValueError``."""
    from .runner import parse_stage_names

    if not names or "all" in names:
        return None, True
    own = [n for n in names if n != LINK]
    return (parse_stage_names(own) or []) if own else [], LINK in names


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
        from ..judge.error_model import Rules
        from ..bundle import open_bundle
        from .runner import run_replay
        from ..bundle.safe_open import set_max_json_bytes

        set_max_json_bytes(options.max_json_bytes)
        rules = Rules(chain=options.chain, exact=options.exact, tolerance_policy=options.tolerance_policy,
                      bitwise=options.bitwise)
        stages, run_link = split_stages(options.stages)
        # the stages run while the payloads' sha256 are still being computed: run_replay judges them before it
        # makes the report, and a mismatch comes ahead of any error met meanwhile (SPEC §11)
        bundles = open_bundle(target.path, defer_checksums=True)
        with bundles.checksums_first():
            if stages is not None:  # --stage in a scan: the requested stages each bundle declares recompute
                from ..bundle.schema import StageCapability

                from .runner import stage_contracts

                contracts = stage_contracts(bundles.shards[0])
                stages = [s for s in stages if s in contracts and contracts[s].capability == StageCapability.RECOMPUTE]
            report = run_replay(bundles, stages=stages, max_divergences=options.max_divergences, rules=rules)
        link = None
        if options.link and run_link and partner is not None:
            from .link import check_link

            link = check_link(target, bundles, partner, options)
        row = row_of_report(target, report, elapsed(), link)
        return _with_mismatch(row, bundles, report)
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
        from .crash import internal_error_line

        line = internal_error_line(exc).removeprefix("trajectory-replay: ")
        return error_row(target, STATUS_ERROR, f"{target.path}: {line}", elapsed())


def _with_mismatch(row: ScanRow, bundles, report=None) -> ScanRow:
    """The row with its bundle's rollout-vs-old mismatch (``run.mismatch_series``) when it records both: the
    values the replay's ``logprob.mismatch`` stage measured where it ran on the whole bundle, else recomputed."""
    from dataclasses import replace

    from .mismatch_series import bundle_mismatch, stage_mismatch

    found = stage_mismatch(report)
    if found is None:
        found = bundle_mismatch(bundles)
    return row if found is None else replace(row, mismatch=found.to_json())
