"""Where a scan's rows are computed: worker processes on this host (``local``) or Ray tasks (``ray``).

Local: a persistent pool of ``jobs`` worker processes, each started once (the torch import is paid once
per worker, not per bundle) from a fork server that imported the replay before forking (on platforms
without one: spawned). Each worker replays one bundle at a time — its memory stays that of one bundle —
and asks for the next when it sends its row, so a slow bundle never holds up the others. torch runs
single-threaded in each worker (``jobs`` processes already use the CPUs). Workers ignore SIGINT: Ctrl+C
reaches the scan, which stops them.

A worker that dies (killed, out of memory, a crash in native code) turns the bundle it was replaying into
an ``error`` row naming the exit signal or status, and a new worker takes its place; the scan goes on.
Workers that die before they are ready, three in a row, end the scan with an ``error`` row for each bundle
left (an environment where no worker can start must not respawn them forever).
``stop`` (Ctrl+C, ``--fail-fast``) terminates the workers at once and keeps the rows already finished.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import wait
from typing import Callable, Optional, Sequence

from ..errors import UsageError

EXECUTORS = ("local", "ray")
POLL_SECONDS = 0.1  # how often a waiting scan looks at ``stop``
STOP_GRACE_SECONDS = 2.0  # a terminated worker's time to exit before it is killed
MAX_FAILED_STARTS = 3  # workers in a row dying before they are ready: the rest of the scan is error rows

Work = Sequence[tuple]  # (ScanTarget, partner) pairs
TakeFn = Callable[[object], None]
RunFn = Callable[[Work, object, TakeFn, threading.Event], None]


def run_serial(work: Work, options, take: TakeFn, stop: threading.Event) -> None:
    """Every row in this process, one after the other (``--jobs 1``)."""
    from .scan import check_target

    for target, partner in work:
        if stop.is_set():
            return
        take(check_target(target, options, partner))


# ------------------------------------------------------------------------------------ local pool


def _worker_main(conn, single_thread: bool) -> None:
    """A worker: replay each (target, partner, options) received, send its row back; ``None`` ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from .scan import check_target

    if single_thread:
        torch.set_num_threads(1)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        target, partner, options = task
        conn.send(("row", check_target(target, options, partner)))


def _context():
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["replay_lib.run.scan", "replay_lib.runner", "replay_lib.run.link"])
        return ctx
    return multiprocessing.get_context("spawn")


def _death(process) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited with status {code}"


class _Worker:
    def __init__(self, ctx, single_thread: bool) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child, single_thread), daemon=True,
                                   name="trajectory-replay-scan")
        self.process.start()
        child.close()
        self.task: Optional[tuple] = None  # (target, partner) being replayed
        self.ready = False

    def send(self, item, options) -> None:
        self.task = item
        self.conn.send((item[0], item[1], options))

    def stop(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.process.is_alive():
            self.process.terminate()


def _reap(workers: Sequence[_Worker]) -> None:
    for w in workers:
        w.stop()
    for w in workers:
        w.process.join(STOP_GRACE_SECONDS)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(STOP_GRACE_SECONDS)


def run_local(work: Work, options, take: TakeFn, stop: threading.Event, *, jobs: int) -> None:
    """The rows of ``work`` in ``jobs`` worker processes (see the module docstring)."""
    from .scan import STATUS_ERROR, error_row

    pending = list(reversed(work))
    ctx = _context()
    single_thread = jobs > 1
    workers = [_Worker(ctx, single_thread) for _ in range(min(jobs, len(pending)))]
    failed_starts = 0  # workers in a row that died before they were ready
    try:
        while (pending or any(w.task is not None for w in workers)) and not stop.is_set():
            for w in workers:
                if w.task is None and w.ready and pending:
                    try:
                        w.send(pending.pop(), options)
                    except OSError:  # died between two rows: its sentinel says so below
                        pass
            ready = wait([w.conn for w in workers] + [w.process.sentinel for w in workers], POLL_SECONDS)
            if not ready:
                continue
            for w in list(workers):
                died = False
                if w.conn in ready:
                    try:
                        kind, value = w.conn.recv()
                    except (EOFError, OSError):
                        died = True
                    else:
                        if kind == "ready":
                            w.ready = True
                            failed_starts = 0
                        else:
                            w.task = None
                            take(value)
                            if stop.is_set():
                                return
                elif w.process.sentinel in ready:
                    died = True
                if died:
                    w.process.join(STOP_GRACE_SECONDS)
                    if not w.ready:
                        failed_starts += 1
                        if failed_starts >= MAX_FAILED_STARTS:  # no worker can start: say so, never respawn forever
                            why = f"no worker process could start ({_death(w.process)}, {failed_starts} times)"
                            for target, _ in reversed(pending):
                                take(error_row(target, STATUS_ERROR, f"{target.path}: not scanned: {why}"))
                            pending.clear()
                    if w.task is not None:
                        target = w.task[0]
                        take(error_row(target, STATUS_ERROR,
                                       f"{target.path}: the worker replaying it died ({_death(w.process)}); "
                                       f"the other bundles were scanned on"))
                        w.task = None
                    workers.remove(w)
                    w.stop()
                    if pending and not stop.is_set():
                        workers.append(_Worker(ctx, single_thread))
    finally:
        _reap(workers)


# ------------------------------------------------------------------------------------------- ray


def make_executor(name: str, *, jobs: int, ray_address: Optional[str] = None) -> RunFn:
    """The run function of an executor name (UsageError for an unknown one or ``jobs < 1``)."""
    if name not in EXECUTORS:
        raise UsageError(f"unknown executor {name!r} (expected one of: {', '.join(EXECUTORS)})")
    if jobs < 1:
        raise UsageError("--jobs must be at least 1")
    if name == "ray":
        from .ray_executor import make_ray_executor

        return make_ray_executor(jobs=jobs, address=ray_address)

    def run(work, options, take, stop):
        run_local(work, options, take, stop, jobs=jobs)

    return run
