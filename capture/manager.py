"""The training thread never waits: a bounded queue in front of one writer thread.

``submit`` runs on the training thread. It copies the tensors it is given (``t.detach().clone()`` — on an
accelerator that is an asynchronous device-side copy), enqueues the record without blocking and returns.
A full queue drops the record, counts it and warns. Everything slow happens on the writer thread: the
device→host copy, hashing and all disk I/O. A writer error is logged and counted, never raised into
training; the log is rate-limited (a full disk fails every record): the first few errors one by one, then
only the 8th, 16th, 32nd … (each saying how many went unlogged), and ``close`` says how many there were in
all. ``close(timeout=…)`` (also registered with ``atexit``) flushes with a bound on time.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger("capture")

_STOP = object()
ERRORS_LOGGED_ONE_BY_ONE = 4  # then only every power of two


def _error_logged(n: int) -> bool:
    return n <= ERRORS_LOGGED_ONE_BY_ONE or n & (n - 1) == 0


@dataclass
class CaptureItem:
    """One unit of work for the writer thread. ``label`` names it in logs (``rollout-3``, ``step-3-1``)."""

    kind: str
    label: str
    meta: Any = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # Recorded on the submitting stream after the device-side copies; the writer waits on it, not training.
    ready: Any = None


@dataclass(frozen=True)
class CaptureStats:
    submitted: int = 0  # records accepted into the queue
    dropped: int = 0  # records refused: queue full, or submitted after close
    written: int = 0  # bundles (or rank shards) published
    errors: int = 0  # records whose handling raised (logged, never raised into training)
    abandoned: int = 0  # partial records never completed (e.g. a step whose micro-batch was dropped)
    unflushed: int = 0  # records still queued when close() ran out of time
    bytes_written: int = 0  # bytes of published bundle files


# The handler runs on the writer thread; it returns the bytes it published (None: nothing published yet).
Handler = Callable[[CaptureItem], Optional[int]]
# Runs once on the writer thread before the first record (house-keeping that must not delay training).
StartHook = Callable[[], None]


class CaptureManager:
    """Bounded queue + one daemon writer thread running ``handler(item)`` for every accepted item (after
    ``on_start()``, if given; ``flush`` waits for it too)."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_queue: int = 32,
        close_timeout: float = 60.0,
        name: str = "replay-capture-writer",
        register_atexit: bool = True,
        on_start: Optional[StartHook] = None,
        ring: Any = None,
    ):
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self._handler = handler
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.max_queue = max_queue
        self.close_timeout = close_timeout
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._on_start = on_start
        # capture.ring.CaptureRing (capture on trigger): holds records, returns those to write now
        self._ring = ring
        self._outstanding = 1 if on_start is not None else 0
        self._last_logged_error = 0
        self._counts = dict.fromkeys(CaptureStats.__dataclass_fields__, 0)
        self._closed = False
        self._flushed: Optional[bool] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if register_atexit:
            atexit.register(_close_at_exit, weakref.ref(self))

    # -- training thread ------------------------------------------------------------------------------
    def submit(self, item: CaptureItem) -> bool:
        """Copy ``item.tensors`` and enqueue ``item`` without blocking. ``False``: dropped (counted)."""
        if self._closed:
            self._drop(item, "capture is closed")
            return False
        if self._queue.full():  # cheap pre-check: no device copies for a record that cannot be queued
            self._drop(item, "queue full")
            return False
        copies = {}
        cuda_device = None
        for name, tensor in item.tensors.items():
            if tensor is None:
                continue
            copies[name] = tensor.detach().clone()
            if copies[name].is_cuda and cuda_device is None:
                cuda_device = copies[name].device
        item.tensors = copies
        if cuda_device is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(cuda_device))
            item.ready = event
        with self._lock:
            self._outstanding += 1
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                self._outstanding -= 1
            self._drop(item, "queue full")
            return False
        self._count("submitted")
        return True

    def _drop(self, item: CaptureItem, why: str) -> None:
        n = self._count("dropped")
        if n & (n - 1) == 0:  # 1st, 2nd, 4th, 8th … drop: visible without flooding the log
            logger.warning(
                "replay capture: dropped %s (%s, queue holds %d); %d record(s) dropped so far",
                item.label, why, self.max_queue, n,
            )

    # -- writer thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception:  # house-keeping only: never stops the writer
                logger.debug("replay capture: the writer's start-up step failed", exc_info=True)
            finally:
                self._done()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                if item.ready is not None:
                    item.ready.synchronize()  # waits for the device-side copies; blocks this thread only
                batch = [item] if self._ring is None else self._ring.take(item)
            except Exception as exc:  # never raised into training: logged (rate-limited) and counted
                self._log_error(item, exc)
                batch = []
            try:
                for record in batch:
                    self._handle(record)
            finally:
                if self._ring is None:
                    item.tensors = {}
                self._done()

    def _handle(self, item: CaptureItem) -> None:
        try:
            published = self._handler(item)
            if published is not None:
                self._count("written")
                self._count("bytes_written", int(published))
        except Exception as exc:  # never raised into training: logged (rate-limited) and counted
            self._log_error(item, exc)
        finally:
            item.tensors = {}

    def _done(self) -> None:
        with self._idle:
            self._outstanding -= 1
            self._idle.notify_all()

    def _log_error(self, item: CaptureItem, exc: Exception) -> None:
        n = self._count("errors")
        if not _error_logged(n):
            return
        unlogged = n - 1 - self._last_logged_error
        self._last_logged_error = n
        if unlogged:
            tail = f"{n} error(s) so far, {unlogged} not logged since error {n - 1 - unlogged}"
        elif n == ERRORS_LOGGED_ONE_BY_ONE:
            after = 1 << n.bit_length()  # the next power of two
            tail = f"{n} error(s) so far; from now on only the {after}th, {2 * after}th … are logged"
        else:
            tail = f"{n} error(s) so far"
        logger.error("replay capture: writing %s failed: %s (%s)", item.label, exc, tail)
        logger.debug("replay capture: traceback of the failed write", exc_info=True)

    def _log_unlogged_errors(self) -> None:
        with self._lock:
            n = self._counts["errors"]
        if n > self._last_logged_error:
            logger.error("replay capture: %d write error(s) in all, the last %d not logged", n,
                         n - self._last_logged_error)
            self._last_logged_error = n

    # -- either thread --------------------------------------------------------------------------------
    def _count(self, name: str, by: int = 1) -> int:
        with self._lock:
            self._counts[name] += by
            return self._counts[name]

    def note_abandoned(self, label: str, why: str) -> None:
        """Called by a handler for a partial record that will never be written."""
        n = self._count("abandoned")
        logger.warning("replay capture: abandoned %s (%s); %d abandoned so far", label, why, n)

    @property
    def stats(self) -> CaptureStats:
        with self._lock:
            return CaptureStats(**self._counts)

    @property
    def closed(self) -> bool:
        return self._closed

    def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until every accepted record has been handled. Not for the
        training loop: for the end of a run, tests and tools."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._outstanding:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop accepting records and flush what is queued, waiting at most ``timeout`` seconds.
        Returns whether everything was flushed; what was not is counted in ``stats.unflushed``."""
        timeout = self.close_timeout if timeout is None else timeout
        with self._lock:
            already = self._closed
            self._closed = True
        if already:
            if self._flushed is None:  # another thread is closing: wait for it within our own bound
                self._thread.join(timeout)
                return not self._thread.is_alive()
            return self._flushed
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        flushed = not self._thread.is_alive()
        if flushed:
            self._log_unlogged_errors()
        if not flushed:
            with self._lock:
                self._counts["unflushed"] = self._outstanding
            logger.warning(
                "replay capture: close() gave up after %.1f s with %d record(s) unwritten", timeout, self._outstanding
            )
        self._flushed = flushed
        return flushed


def _close_at_exit(ref: "weakref.ref[CaptureManager]") -> None:
    manager = ref()
    if manager is not None and not manager.closed:
        manager.close()
