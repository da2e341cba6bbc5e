"""A large token pass split in blocks of whole samples between the stage's thread and one more worker.

``loss.policy``'s token pass over a step of ``LARGE_PASS`` tokens or more (most of a replay's CPU) is cut into
:data:`PASS_BLOCKS` blocks of whole samples (:func:`sample_blocks`), taken in turn by the stage's thread and a
second worker (``run.threads.pass_threads`` says whether there may be one). Every per-sample sum is the same
sequence of operations whoever takes its block, so the result has the same bits as one pass. The second worker
starts once the reader's thread has hashed every payload (``BundleReader.wait_hashed``): until then the two
cores are the stages' and the hashing's.

The worker is a forked process where that is safe (:func:`can_fork`), else a thread:

* A thread shares the GIL with the stage's thread. The pass is thousands of short torch ops per block, and the
  GIL changes hands around each one. Measured on 134M tokens (8,192×16,384, this 2-core host): one thread
  3.47 s; two threads 2.85 s wall and 4.4 s of CPU. Two processes each running the whole pass ran at the
  single-thread speed side by side, so the cores were free and the loss was the GIL.
* A forked process has its own GIL. It reads the payloads, masks and per-sample terms from the memory it
  shares with its parent (copy-on-write: nothing is copied unless written). It writes its blocks' sums into the
  totals, which :func:`shared_zeros` allocates in an anonymous shared mapping. Blocks are handed out through a
  pipe, each index a byte, read by whichever process is free (a read of one byte from a pipe is atomic). The
  child reports each block it finished on a second pipe and ends with ``os._exit`` (no atexit handler, no
  buffered output, no garbage collection of its parent's objects: it runs with ``gc`` disabled).

A child that fails, or that has not ended within its deadline (:data:`WORKER_GRACE` seconds plus 10× the
slowest block), is killed and reaped, and every block it took and did not report is summed again by the parent:
``redo`` first clears that block's columns. So an error inside a block is raised in the parent with its own
type and message, and a child that hangs costs time, never a wrong sum. A replay interrupted in the parent
(Ctrl-C) kills its child before the exception leaves :func:`split_pass`.

:func:`can_fork`: Linux only (where ``os.fork`` of a process that has imported torch is well trodden: data
loaders fork so), and only while the calling thread is the process's only Python thread. A forked child has
only the thread that forked it, and a lock held by any other thread at that moment would stay held forever in
the child. Torch's idle intra-op pool threads are native threads the child never uses: the replay runs every op
on one intra-op thread (``run.threads``). The debugger (a Textual app with its own threads), a scan beside other
work, or a library caller with threads of its own gets the thread worker.
"""

from __future__ import annotations

import gc
import math
import mmap
import os
import select
import signal
import sys
import threading
import time
import warnings
from typing import Callable, Optional

import torch

Block = tuple[int, int]
PassFn = Callable[[int, int], None]

# Blocks of whole samples the pass is cut into: the second worker joins at a block's end (a forked one) and the
# two end within about one block of each other.
PASS_BLOCKS = 32
# Seconds a forked worker may take beyond 10× the slowest block before it is killed and its blocks redone.
WORKER_GRACE = 10.0


def sample_blocks(offsets: torch.Tensor, lengths: torch.Tensor, total: int, count: int) -> list[Block]:
    """``[(start, stop)]``: the token axis ``[0, total)`` cut into about ``count`` blocks, each cut where a sample
    starts (a sample is in one block); fewer where the samples are fewer."""
    starts = offsets[lengths > 0]
    cuts = [0]
    for k in range(1, count):
        at = int(torch.searchsorted(starts, total * k // count))  # the first sample starting at or after the mark
        if at < starts.numel() and cuts[-1] < int(starts[at]) < total:
            cuts.append(int(starts[at]))
    cuts.append(total)
    return list(zip(cuts, cuts[1:]))


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros in an anonymous shared mapping: what a forked worker writes into it, its parent reads."""
    count = math.prod(shape)
    size = count * torch.empty(0, dtype=dtype).element_size()
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    with warnings.catch_warnings():  # frombuffer of a writable mapping: nothing to warn about
        warnings.simplefilter("ignore")
        return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype, count=count).view(shape)


def can_fork() -> bool:
    """Whether the second worker may be a forked process now (module doc): on Linux, from the main thread, the
    process's only Python thread (the reader's hashing thread has ended once ``wait_hashed`` is true)."""
    return (sys.platform.startswith("linux") and hasattr(os, "fork") and threading.active_count() == 1
            and threading.current_thread() is threading.main_thread())


def split_pass(blocks: list[Block], mine: PassFn, others: PassFn, wait_hashed: Callable[[float], bool],
               redo: Optional[PassFn] = None, *, fork: Optional[bool] = None) -> list[Block]:
    """Sum ``blocks`` with ``mine(lo, hi)`` here and ``others(lo, hi)`` in a second worker (module doc); return the
    blocks the second worker summed. ``redo(lo, hi)``: a block again in this thread after a forked worker failed
    in it (default ``mine``; it must first clear what the child may have added). ``fork``: whether the worker
    may be a forked process (default: on Linux), decided by :func:`can_fork` when it starts."""
    if fork is False or (fork is None and not sys.platform.startswith("linux")):
        return two_threads(blocks, mine, others, wait_hashed)
    return _forked(blocks, mine, others, wait_hashed, redo or mine)


def two_threads(blocks: list[Block], mine: PassFn, others: PassFn, wait_hashed: Callable[[float], bool]) -> list[Block]:
    """``blocks`` taken in order by this thread (``mine``) and by a second thread (``others``), the second joining
    once ``wait_hashed(timeout)`` is true — it takes none when this thread is done first. Each thread runs under
    ``torch.inference_mode`` (the stages' tensors are inference tensors). Returns the blocks the second thread
    summed; the first error (this thread's first) is raised once both ended."""
    lock = threading.Lock()
    queue = list(reversed(blocks))
    taken: list[Block] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def take():
        with lock:
            return queue.pop() if queue and not stop.is_set() else None

    def run() -> None:
        try:
            while not wait_hashed(0.05):
                if stop.is_set():
                    return
            with torch.inference_mode():
                while (block := take()) is not None:
                    others(*block)
                    taken.append(block)
        except BaseException as exc:  # raised on the caller's thread below
            errors.append(exc)
            stop.set()

    thread = threading.Thread(target=run, name="loss-pass", daemon=True)
    thread.start()
    try:
        while (block := take()) is not None:
            mine(*block)
    except BaseException:
        stop.set()
        raise
    finally:
        stop.set()
        thread.join()
    if errors:
        raise errors[0]
    return taken


def _forked(blocks: list[Block], mine: PassFn, others: PassFn, wait_hashed: Callable[[float], bool],
            redo: PassFn) -> list[Block]:
    if len(blocks) > 255:  # one byte per index on the pipes
        raise ValueError(f"{len(blocks)} blocks: at most 255 can be handed to a forked worker")
    k = 0
    worker: Optional[_Worker] = None
    slowest = 0.0  # seconds: this process's slowest block, which bounds the wait for the child's last

    def sum_here(i: int) -> None:
        nonlocal slowest
        started = time.perf_counter()
        mine(*blocks[i])
        slowest = max(slowest, time.perf_counter() - started)

    try:
        while k < len(blocks):
            if len(blocks) - k >= 2 and wait_hashed(0):
                if not can_fork():  # another thread appeared: the rest with a thread worker
                    return two_threads(blocks[k:], mine, others, wait_hashed)
                worker = _Worker.start(blocks, k, others)
                if worker is not None:
                    break
            sum_here(k)
            k += 1
        if worker is None:
            return []
        while (i := worker.take()) is not None:
            sum_here(i)
        done = worker.finish(WORKER_GRACE + 10 * slowest)
        for i in sorted(worker.given - worker.mine - done):  # the child's blocks it did not finish: redone here
            redo(*blocks[i])
        return [blocks[i] for i in sorted(done)]
    finally:
        if worker is not None:
            worker.kill()


class _Worker:
    """A forked child summing the blocks it reads from a pipe (module doc)."""

    def __init__(self, pid: int, todo: int, done: int, given: set[int]) -> None:
        self.pid = pid
        self._todo = todo  # read end: the indices left, shared with the child
        self._done = done  # read end: the indices the child finished
        self.given = given  # the indices put on the pipe
        self.mine: set[int] = set()  # those this process read back and summed itself
        self._finished: set[int] = set()
        self._status: Optional[int] = None

    @classmethod
    def start(cls, blocks: list[Block], first: int, others: PassFn) -> Optional["_Worker"]:
        """Fork the child with blocks ``first…`` on the pipe; ``None`` (this process then sums them) when the pipes
        or the fork fail."""
        try:
            todo_r, todo_w = os.pipe()
        except OSError:
            return None
        try:
            done_r, done_w = os.pipe()
        except OSError:
            os.close(todo_r), os.close(todo_w)
            return None
        given = set(range(first, len(blocks)))
        os.write(todo_w, bytes(sorted(given)))  # a few dozen bytes: far below a pipe's buffer
        os.close(todo_w)  # read() then ends with b"" once every index is taken
        try:
            with warnings.catch_warnings():  # Python ≥ 3.12 warns of any other thread; can_fork() allowed these
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError:
            for fd in (todo_r, done_r, done_w):
                os.close(fd)
            return None
        if pid == 0:  # the child: never returns
            _child(blocks, others, todo_r, done_w)
        os.close(done_w)
        return cls(pid, todo_r, done_r, given)

    def take(self) -> Optional[int]:
        """The next block index for this process, ``None`` when none is left."""
        b = os.read(self._todo, 1)
        if not b:
            return None
        self.mine.add(b[0])
        return b[0]

    def finish(self, deadline_s: float) -> set[int]:
        """Wait for the child to report every block it took (or to end, or for ``deadline_s`` seconds); the
        indices it finished. A child that ended with an error still reports the blocks it finished first."""
        owed = self.given - self.mine
        end = time.monotonic() + deadline_s
        while not owed <= self._finished:
            left = end - time.monotonic()
            if left <= 0 or not self._read_done(left):
                break
        return set(self._finished)

    def _read_done(self, timeout: float) -> bool:
        """Read what the child reported within ``timeout`` seconds; False once it closed its end (ended)."""
        ready, _, _ = select.select([self._done], [], [], timeout)
        if not ready:
            return True  # the deadline is checked by the caller
        data = os.read(self._done, 256)
        self._finished.update(data)
        return bool(data)

    def kill(self) -> None:
        """The child ended (killed when still running) and reaped; the pipes closed."""
        if self._status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == 0:
                    os.kill(self.pid, signal.SIGKILL)
                    pid, status = os.waitpid(self.pid, 0)
                self._status = status
            except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler of the caller's)
                self._status = -1
        for fd in (self._todo, self._done):
            try:
                os.close(fd)
            except OSError:
                pass
        self._todo = self._done = -1


def _child(blocks: list[Block], others: PassFn, todo: int, done: int) -> None:
    """The forked worker: the blocks read from ``todo`` summed with ``others``, each reported on ``done``; then
    ``os._exit`` (0, or 1 after an error: the parent redoes the block)."""
    code = 1
    try:
        gc.disable()  # no finalizer of the parent's objects runs here
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends the child at once; the parent handles it
        with torch.inference_mode():
            while b := os.read(todo, 1):
                others(*blocks[b[0]])
                os.write(done, b)
        code = 0
    except BaseException:
        pass
    finally:
        os._exit(code)
