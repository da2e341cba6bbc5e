"""``--executor ray``: the scan's rows as Ray tasks, for captures that outgrow one host (SPEC §9).

Each row is one task running :func:`~replay_lib.run.scan.check_target` — the same work as a local worker —
on a Ray worker process; Ray reuses its workers, so the torch import is paid once per worker, not per
bundle. ``--ray-address`` names the cluster (``ray.init(address=…)``); without it ``RAY_ADDRESS`` is used,
else a local Ray instance is started for the scan and shut down after it. At most ``--jobs`` tasks are in
flight (each asks for one CPU). The bundles are read by path: every node must see the capture directory
at the same path (a shared file system) and have this package installed.

A task whose worker dies (killed, out of memory) becomes an ``error`` row; so does one still running
``options.timeout`` seconds after it was submitted (``scan --timeout``; at most ``--jobs`` are in flight, one CPU
each): it is cancelled with ``force=True``, which kills its worker process, and Ray starts another; ``stop`` cancels the tasks in
flight (``ray.cancel(force=True)``) and keeps the rows already finished.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from ..errors import UnsupportedError, UsageError

POLL_SECONDS = 0.1
MESSAGE_LIMIT = 300  # characters of a Ray error kept in its row (the first line: Ray appends tracebacks)
_single_thread = False


def _ray_check(target, partner, options):
    """One row, on a Ray worker (single-threaded torch: the other tasks use the other CPUs)."""
    global _single_thread
    if not _single_thread:
        import torch

        from .threads import single_pass_thread

        torch.set_num_threads(1)
        single_pass_thread()
        _single_thread = True
    from .check import check_target

    return check_target(target, options, partner)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise UnsupportedError("--executor ray: Ray is not installed (pip install 'trajectory-replay[ray]')") from None
    return ray


def connect(ray, address: Optional[str]) -> bool:
    """Ray initialized for ``--executor ray`` (the cluster at ``address``, else ``RAY_ADDRESS``, else a local one)
    unless it already is; whether this call started it (its caller then shuts it down). A cluster that cannot be
    started or reached is a usage error naming where it was looked for."""
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", configure_logging=True)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        where = f"at {address}" if address else "(RAY_ADDRESS or a local one)"
        raise UsageError(f"--executor ray: cannot start or reach the Ray cluster {where}: "
                         f"{' '.join(str(exc).split())}") from None
    return True


def make_ray_executor(*, jobs: int, address: Optional[str] = None):
    ray = _import_ray()

    def run(work, options, take, stop: threading.Event) -> None:
        from .rows import STATUS_ERROR, error_row, timeout_row

        started = connect(ray, address)
        check = ray.remote(num_cpus=1, max_retries=0)(_ray_check)
        pending = list(reversed(work))
        flight: dict = {}
        sent: dict = {}  # when each task in flight was submitted (time.monotonic())
        limit = getattr(options, "timeout", None) or None
        try:
            while (pending or flight) and not stop.is_set():
                while pending and len(flight) < jobs:
                    target, partner = pending.pop()
                    ref = check.remote(target, partner, options)
                    flight[ref], sent[ref] = target, time.monotonic()
                done, _ = ray.wait(list(flight), num_returns=1, timeout=POLL_SECONDS)
                if limit is not None:  # a task past the limit: its worker process is killed (Ray starts another)
                    now = time.monotonic()
                    for ref in [r for r in flight if r not in done and now - sent[r] > limit]:
                        target = flight.pop(ref)
                        try:
                            ray.cancel(ref, force=True)
                        except Exception:  # finished meanwhile, or its worker is gone: nothing to cancel
                            pass
                        take(timeout_row(target, limit, now - sent.pop(ref),
                                         "its Ray task was cancelled and its worker process killed"))
                        if stop.is_set():
                            break
                    if stop.is_set():
                        break
                for ref in done:
                    if ref not in flight:
                        continue
                    target = flight.pop(ref)
                    sent.pop(ref, None)
                    try:
                        row = ray.get(ref)
                    except ray.exceptions.RayError as exc:
                        why = (str(exc).strip().splitlines() or [""])[0][:MESSAGE_LIMIT]
                        row = error_row(target, STATUS_ERROR, f"{target.path}: the Ray task replaying it failed "
                                                              f"({type(exc).__name__}: {why})")
                    take(row)
                    if stop.is_set():
                        break
        finally:
            for ref in flight:
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # already finished or its worker is gone: nothing to cancel
                    pass
            if started:
                ray.shutdown()

    return run
