"""One writing job per capture directory (SPEC §6).

Two jobs started into one directory write the same names (``rollout-<R>``, ``step-<R>-<S>``); the writer
never overwrites, so the slower job would lose every bundle to "bundle already exists". When capture starts,
each producer therefore takes a lock in its capture directory (``<DIR>``, or ``<DIR>/<run id>/``):

* ``.capture.lock`` is held with ``flock(LOCK_SH)`` by every producer of the job writing there, for as long as
  its capture is open (until ``close()`` flushed, else for the life of the process). It holds one JSON line
  naming the job and the process that took it first (pid, host, start). The operating system drops the lock
  when a process dies, however it dies: a crashed holder never blocks the next job (no pid files).
* ``.capture.lock.guard`` is held ``LOCK_EX`` for the few system calls of a decision, so that two producers
  enabling at the same instant see each other. A producer that finds the lock free (``LOCK_EX`` granted) records
  its job; one that finds it held joins when the record names its own job, else is refused.

A job is the process itself for a single producer. The ranks of a cohort (``world > 1``) are one job when they
share the rendezvous of ``torch.distributed`` (``MASTER_ADDR:MASTER_PORT``, which no two live jobs can share; a
loopback address is qualified by the host name). Ranks without one share the directory with any cohort of the
same size that has none either, and each also takes ``.capture.rank-<r>.lock`` (exclusive): a second such job
is then refused rank by rank.

The last holder to close removes the two files, so a finished job leaves only its bundles. Where the file
system does not support ``flock`` the capture runs unlocked and says so in one line. Only
:func:`capture.actor.maybe_enable_for_actor` locks; a :class:`~capture.actor.ReplayCapture` built directly
does not.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from replay_lib.safe_text import safe

from .config import ENV_DIR, ENV_RUN_ID, CaptureConfig
from .directory import CaptureDirectoryError

logger = logging.getLogger("capture")

LOCK_NAME = ".capture.lock"
GUARD_SUFFIX = ".guard"
GUARD_WAIT_S = 10.0  # a decision takes a few system calls; this bound only matters on a stuck file system
RECORD_MAX_BYTES = 4096  # a holder's record is one short JSON line; more is not read
_LOOPBACK = frozenset({"localhost", "0.0.0.0", "::1", "::", "ip6-localhost"})


class CaptureDirectoryBusy(CaptureDirectoryError):
    """Another job is writing into the capture directory (it holds the directory's ``.capture.lock``).
    ``maybe_enable_for_actor`` turns it into a warning and a disabled capture: training goes on."""


def job_identity(world: int, env: Mapping[str, str]) -> Optional[str]:
    """What the producers of one job share: ``None`` for a single producer (the process is the job), else
    the rendezvous ``rendezvous HOST:PORT``, or ``cohort of <world> producers`` when there is none."""
    if world <= 1:
        return None
    addr = (env.get("MASTER_ADDR") or "").strip()
    port = (env.get("MASTER_PORT") or "").strip()
    if addr and port:
        if addr.lower() in _LOOPBACK or addr.startswith("127."):
            addr = f"{addr}@{socket.gethostname()}"
        return f"rendezvous {addr}:{port}"
    return f"cohort of {world} producers"


def _where(config: CaptureConfig) -> tuple[str, str]:
    """How a message names the directory, and the way out (as ``check_fresh_directory`` says them)."""
    if config.run_id is None:
        return (f"{ENV_DIR}={str(config.directory)!r}",
                f"set {ENV_RUN_ID}=<id> to write under {safe(config.directory)}/<id>/, or use another directory")
    return f"{ENV_RUN_ID}={config.run_id!r}: {safe(config.directory)}", f"set another {ENV_RUN_ID}"


def _flock_until(fd: int, op: int, deadline: float) -> None:
    """``flock(fd, op)`` retried without blocking until ``deadline`` (``TimeoutError`` then)."""
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(errno.ETIMEDOUT, "the lock guard stayed taken") from None
            time.sleep(0.005)


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def _open_guard(path: Path, deadline: float) -> int:
    """The guard file, locked ``LOCK_EX``. A closing holder unlinks it: a lock won on an unlinked file is
    no guard, so the path is checked to still name the file locked, else opened again."""
    while True:
        fd = _open(path)
        try:
            _flock_until(fd, fcntl.LOCK_EX, deadline)
            if _same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _record(job: Optional[str], rank: Optional[int]) -> bytes:
    doc = {"job": job, "pid": os.getpid(), "host": socket.gethostname(), "rank": rank,
           "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return (json.dumps(doc, sort_keys=True) + "\n").encode()


def _read_record(fd: int) -> dict:
    """The holder's record (foreign: any field may be missing or odd)."""
    try:
        doc = json.loads(os.pread(fd, RECORD_MAX_BYTES, 0).decode("utf-8", "replace"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _holder(doc: dict) -> str:
    """``pid 123 on host-a since 2025-01-01T10:00:00Z`` (escaped), from a holder's record."""
    pid, host, since = doc.get("pid"), doc.get("host"), doc.get("since")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(host, str):
        return "a process whose record cannot be read"
    text = f"pid {pid} on {safe(host)}"
    if isinstance(since, str):
        text += f" since {safe(since)}"
    rank = doc.get("rank")
    if isinstance(rank, int) and not isinstance(rank, bool):
        text += f" (rank {rank})"
    return text


@dataclass
class _Held:
    path: Path
    fd: int


class CaptureLock:
    """The locks one producer holds on its capture directory; :meth:`release` drops them (idempotent)."""

    def __init__(self, directory: Path, held: list[_Held]):
        self.directory = directory
        self._held = held

    @property
    def held(self) -> bool:
        return bool(self._held)

    def release(self) -> None:
        """Drop the locks; the last holder of a lock file removes it (and its guard)."""
        held, self._held = self._held, []
        for item in reversed(held):
            guard_path = item.path.with_name(item.path.name + GUARD_SUFFIX)
            guard = None
            try:
                guard = _open_guard(guard_path, time.monotonic() + GUARD_WAIT_S)
                try:  # no other holder (they join only under the guard): the files can go
                    fcntl.flock(item.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    if _same_file(item.fd, item.path):
                        os.unlink(item.path)
                    os.unlink(guard_path)
                except (BlockingIOError, FileNotFoundError):
                    pass
            except OSError:
                pass  # the files stay; the lock itself goes with the descriptor
            finally:
                os.close(item.fd)
                if guard is not None:
                    os.close(guard)


def _take(path: Path, job: Optional[str], rank: Optional[int], deadline: float) -> tuple[Optional[_Held], dict]:
    """Take ``path`` for ``job`` (``None``: this process alone). Returns ``(held, {})`` or ``(None, record)``
    of the job that holds it."""
    guard = _open_guard(path.with_name(path.name + GUARD_SUFFIX), deadline)
    try:
        fd = _open(path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held by live processes: the record says whose
                doc = _read_record(fd)
                if job is None or doc.get("job") != job:
                    os.close(fd)
                    return None, doc
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # this job's: join it
                return _Held(path, fd), {}
            record = _record(job, rank)
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # under the guard: no one else decides meanwhile
            return _Held(path, fd), {}
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(guard)


def acquire_capture_lock(config: CaptureConfig, producer_rank: Optional[int], world: int,
                         env: Mapping[str, str]) -> Optional[CaptureLock]:
    """Lock ``config.directory`` for this producer (creating the directory). Raises
    :class:`CaptureDirectoryBusy` (one line naming the holder) when another job holds it. ``None`` when no
    lock can be taken here: a directory that cannot be created (the directory check and the writer report
    it), or lock files that cannot be made or locked (a file system without ``flock``; logged)."""
    directory = Path(config.directory)
    job = job_identity(world, env)
    deadline = time.monotonic() + GUARD_WAIT_S
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    names = [LOCK_NAME]
    if job is not None and job.startswith("cohort of") and producer_rank is not None:
        names.append(f".capture.rank-{producer_rank}.lock")
    held: list[_Held] = []
    lock = CaptureLock(directory, held)
    for i, name in enumerate(names):
        try:  # the rank lock is this process's alone: a second producer of that rank is another job
            item, doc = _take(directory / name, job if i == 0 else None, producer_rank, deadline)
        except OSError as exc:
            lock.release()
            logger.warning("replay capture: cannot lock %s (%s); a second job writing there is not detected",
                           safe(directory / name), exc.strerror or exc)
            return None
        if item is None:
            lock.release()
            where, way_out = _where(config)
            raise CaptureDirectoryBusy(
                f"replay capture off for this job: {where} is being written by another job ({_holder(doc)}, "
                f"lock {safe(directory / name)}); {way_out}")
        held.append(item)
    return lock
