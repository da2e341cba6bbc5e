"""Where a scan's rows are computed: worker processes on this host (``local``) or Ray tasks (``ray``)."""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

from ..errors import UsageError

EXECUTORS = ("local", "ray")

Work = Sequence[tuple]  # (ScanTarget, partner) pairs
RunFn = Callable[[Work, object, Callable, threading.Event], None]


def run_serial(work: Work, options, take: Callable, stop: threading.Event) -> None:
    """Every row in this process, one after the other (``--jobs 1``)."""
    from .scan import check_target

    for target, partner in work:
        if stop.is_set():
            return
        take(check_target(target, options, partner))


def make_executor(name: str, *, jobs: int, ray_address: Optional[str] = None) -> RunFn:
    if name not in EXECUTORS:
        raise UsageError(f"unknown executor {name!r} (expected one of: {', '.join(EXECUTORS)})")
    if jobs < 1:
        raise UsageError("--jobs must be at least 1")
    return run_serial
