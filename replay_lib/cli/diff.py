"""``trajectory-replay diff A B``: two captures of one step compared field by field (SPEC §9); the work is
:func:`replay_lib.run.diff.diff_bundles`."""

from __future__ import annotations

import sys
from typing import Optional

from ..errors import UsageError
from .output import emit


def run_diff_command(args, stream: Optional[object] = None) -> int:
    """``trajectory-replay diff A B [--format json]``."""
    from ..judge.report import DIFF_SIDES, render_text, report_to_json
    from ..run.diff import diff_bundles

    stream = stream or sys.stdout
    if args.max_divergences < 1:
        raise UsageError("--max-divergences must be at least 1")
    report = diff_bundles(args.bundle, args.other, max_divergences=args.max_divergences)
    if args.format == "json":
        stream.write(report_to_json(report))
    else:
        emit(render_text(report, max_lines=args.max_divergences, sides=DIFF_SIDES), stream)
    return report.exit_code
