"""Where a scan's rows are computed: worker processes on this host (``local``) or Ray tasks (``ray``).

Local: a persistent pool of ``jobs`` worker processes (:mod:`replay_lib.run.worker`), each a fresh
interpreter started once — the torch import is paid once per worker, not per bundle — never a fork of the
caller (which may be a threaded TUI) nor a re-run of the caller's main script. Each worker replays one bundle
at a time — its memory stays that of one bundle — and gets the next when it sends its row, so a slow bundle
never holds up the others. torch runs single-threaded in each worker when there are several (they already
use the CPUs). Workers run in their own session: Ctrl+C reaches the scan only, which stops them.

A bundle whose replay runs past ``options.timeout`` seconds (``scan --timeout``) is an ``error`` row naming the
limit: its worker is killed (SIGKILL) and a new one takes its place; the scan goes on. A worker that dies
(killed, out of memory, a crash in native code) turns the bundle it was replaying into
an ``error`` row naming the exit signal or status (and the last line the worker wrote on stderr), and a new
worker takes its place; the scan goes on. Workers that die before they are ready, three in a row, end the
scan with an ``error`` row for each bundle left (where no worker can start, none is respawned forever).
``stop`` (Ctrl+C, ``--fail-fast``) terminates the workers at once and keeps the rows already finished.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
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
    from .check import check_target

    for target, partner in work:
        if stop.is_set():
            return
        take(check_target(target, options, partner))


# ------------------------------------------------------------------------------------ local pool


def worker_command(tasks_fd: int, rows_fd: int, single_thread: bool) -> list[str]:
    """The command line of one worker (see :mod:`replay_lib.run.worker`)."""
    return [sys.executable, "-m", "replay_lib.run.worker", str(tasks_fd), str(rows_fd), "1" if single_thread else "0"]


def _worker_env() -> dict:
    """This environment, with the directory holding ``replay_lib`` first on PYTHONPATH: a worker imports the
    same package as its scan, installed or not."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


LAST_LINE_LIMIT = 200  # characters of a dead worker's last stderr line kept in its row


class _Worker:
    def __init__(self, single_thread: bool) -> None:
        tasks_r, tasks_w = os.pipe()
        rows_r, rows_w = os.pipe()
        self.log = tempfile.TemporaryFile()
        try:
            self.process = subprocess.Popen(worker_command(tasks_r, rows_w, single_thread), pass_fds=(tasks_r, rows_w),
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log,
                                            env=_worker_env(), start_new_session=True)
        except BaseException:
            for fd in (tasks_r, tasks_w, rows_r, rows_w):
                os.close(fd)
            self.log.close()
            raise
        os.close(tasks_r)
        os.close(rows_w)
        self.tasks = Connection(tasks_w, readable=False)
        self.conn = Connection(rows_r, writable=False)
        self.task: Optional[tuple] = None  # (target, partner) being replayed
        self.started = 0.0  # time.monotonic() when it was sent its task
        self.ready = False

    def send(self, item, options) -> None:
        self.task = item
        self.started = time.monotonic()
        self.tasks.send((item[0], item[1], options))

    def kill(self) -> None:
        """SIGKILL, at once (a worker over its time limit is not asked to stop: it may be stuck)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the group holds it alone
        except (ProcessLookupError, PermissionError):
            pass

    def death(self) -> str:
        """How it ended: the signal or exit status, and the last line it wrote on stderr."""
        try:
            code = self.process.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        if code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        try:
            self.log.seek(0)
            lines = [ln for ln in self.log.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return f"{how}: {lines[-1].strip()[:LAST_LINE_LIMIT]}" if lines else how

    def stop(self) -> None:
        for conn in (self.tasks, self.conn):
            try:
                conn.close()
            except OSError:
                pass
        if self.process.poll() is None:
            self.process.terminate()

    def close(self) -> None:
        try:
            self.process.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(STOP_GRACE_SECONDS)
        self.log.close()


def _retire(w: "_Worker", workers: list, *, replace: bool, single_thread: bool) -> None:
    """A worker that died or was killed leaves the pool (its pipes closed); a new one takes its place while
    bundles are left to scan."""
    workers.remove(w)
    w.stop()
    w.close()
    if replace:
        workers.append(_Worker(single_thread))


def _reap(workers: Sequence[_Worker]) -> None:
    for w in workers:
        w.stop()
    for w in workers:
        w.close()


def run_local(work: Work, options, take: TakeFn, stop: threading.Event, *, jobs: int) -> None:
    """The rows of ``work`` in ``jobs`` worker processes (see the module docstring)."""
    from .rows import STATUS_ERROR, error_row

    from .rows import timeout_row

    pending = list(reversed(work))
    single_thread = jobs > 1
    limit = getattr(options, "timeout", None) or None
    workers: list[_Worker] = []
    for _ in range(min(jobs, len(pending))):
        workers.append(_Worker(single_thread))
    failed_starts = 0  # workers in a row that died before they were ready
    try:
        while (pending or any(w.task is not None for w in workers)) and not stop.is_set():
            for w in workers:
                if w.task is None and w.ready and pending:
                    item = pending.pop()
                    try:
                        w.send(item, options)
                    except OSError:  # died between two rows: the end of its pipe says so below
                        w.task = None
                        pending.append(item)
            ready = wait([w.conn for w in workers], POLL_SECONDS)
            if limit is not None:  # a worker past the limit: killed and replaced, its bundle an error row
                now = time.monotonic()
                for w in [w for w in workers if w.task is not None and now - w.started > limit]:
                    w.kill()
                    take(timeout_row(w.task[0], limit, now - w.started,
                                     "its worker process was killed and replaced"))
                    w.task = None
                    _retire(w, workers, replace=bool(pending) and not stop.is_set(), single_thread=single_thread)
                ready = [c for c in ready if any(c is w.conn for w in workers)]
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
                if died:
                    how = w.death()
                    if not w.ready:
                        failed_starts += 1
                        if failed_starts >= MAX_FAILED_STARTS:  # no worker can start: say so, never respawn forever
                            why = f"no worker process could start ({how}; {failed_starts} times)"
                            for target, _ in reversed(pending):
                                take(error_row(target, STATUS_ERROR, f"{target.path}: not scanned: {why}"))
                            pending.clear()
                    if w.task is not None:
                        target = w.task[0]
                        take(error_row(target, STATUS_ERROR, f"{target.path}: the worker replaying it died ({how}); "
                                                             f"the other bundles were scanned on"))
                        w.task = None
                    _retire(w, workers, replace=bool(pending) and not stop.is_set(), single_thread=single_thread)
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
