"""The replay's intra-op thread count, chosen by the tool for its work rather than inherited from torch.

Every float64 pass of the replay runs over chunks of ``kernels.LOSS_CHUNK`` tokens (a few rows of 16K
elements at most) or over per-sample vectors: thousands of small ops, each far too short to be worth a parallel
region. With torch's default intra-op pool, any such op above the parallel grain (a ``[3, 16384]`` copy or
``scatter_add_``, a 16K-element ``exp``) forks its work to the OpenMP threads and waits for them: on an idle host
a wake-up and a spin-wait per op, on a loaded host (or a training host whose cores are busy) a scheduler
time slice per op. Measured on a 256 × 8,192 step on this 2-core host under load: ``loss.policy`` 0.10 s of CPU
on one thread, 1.3–1.8 s of CPU and 4.6–6.5 s of wall with two (128 chunks × three parallel ops of ≈ 15 ms).

So the stages run on one intra-op thread; the parallelism the tool uses is elsewhere — the reader hashes the
payloads on its own thread (hashlib releases the GIL) while the stages run (``open_bundle(...,
defer_checksums=True)``), ``scan`` runs a bundle per worker, and ``replay --executor ray`` a shard per task — never
one op split over threads that other work is already using.

One pass is split: ``loss.policy``'s token pass (most of a replay's CPU) over a step of ``LARGE_PASS`` tokens or
more is cut into blocks of whole samples taken in turn by the stage's thread and, where :func:`pass_threads` allows
two, a second worker (``stages/split.py``: a forked process with its own GIL where that is safe, else a thread).
Every per-sample sum is the same sequence of operations, so the same bits; each worker runs its ops on the one
intra-op thread — large independent passes, where a worker's fixed cost is nothing beside its work, instead of
small parallel regions. The second worker joins only once the reader's thread has hashed every payload
(``BundleReader.wait_hashed``): until then the two cores are the stages' and the hashing's, and a third worker
would only make the three take turns. :func:`pass_threads` is at most :data:`PASS_THREADS` (2) and never more
than the CPUs this process may run on (``os.sched_getaffinity``); 1 where those CPUs are not free: other
processes used more of them than leaves one for the replay and :data:`FREE_CORE` of another (measured two threads
at a load of 2.7 on this 2-core host: 10–20% more CPU and more wall than one — they only take turns with the
others). What the others used is measured, where Linux's ``/proc/stat`` can be read, over the replay so far
(:class:`CpuWindow`, opened by the command — :func:`cpu_window` — or by :func:`replay_threads`: the busy time of this process's CPUs, steal included, less
this process's own CPU time), once that window is :data:`MIN_WINDOW` seconds long; elsewhere, and over a shorter
window, the 1-minute load average stands in for it (less than :data:`FREE_CORE` of the CPUs left: one worker).
The load average is the weaker signal: it counts tasks waiting on I/O (a network filesystem's) and, on this
virtual host, reads 1.5 while every CPU is idle — a second worker was then refused on half of the runs. 1 inside a
scan worker when several run (:func:`single_pass_thread`: the workers already use the cores) and inside a Ray task
(one CPU asked each). On a host of many cores a replay thus uses what it uses on two: one shard's pass has no
more than two workers, and the cores beyond are for other shards and bundles (``scan``, ``--executor ray``).
``OMP_NUM_THREADS`` does not change it: that is torch's intra-op setting, which the replay overrides (above).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

REPLAY_THREADS = 1  # intra-op threads of the replay's passes (module doc)
PASS_THREADS = 2  # at most: the threads loss.policy's token pass is split over (module doc)
FREE_CORE = 0.5  # the part of a second core the others must leave free for a second worker (module doc)
MIN_WINDOW = 0.25  # seconds: a shorter window of measured CPU use leaves the choice to the load average
STALE_WINDOW = 60.0  # seconds: a window opened longer ago than this before its replay started is opened again
_single_pass = False

_lock = threading.Lock()
_depth = 0
_saved = 0
_window: "Optional[CpuWindow]" = None  # opened by cpu_window() or the outermost replay_threads(); closed by the latter


@contextmanager
def replay_threads() -> Iterator[None]:
    """Torch's intra-op threads set to :data:`REPLAY_THREADS` over a replay, the caller's count restored when
    the last (outermost) replay ends. Nestable and thread-safe; torch's setting is process-wide, so a replay in
    one thread also holds another thread's torch work of the same process to that count meanwhile."""
    import torch  # (here: usable_cpus serves the scan command's parser without it)

    global _depth, _saved, _window
    with _lock:
        if _depth == 0:
            # the command's own (cpu_window) when it opened one just before; a stale one (a call that failed
            # before its replay) is replaced
            if _window is None or _window.age() > STALE_WINDOW:
                _window = CpuWindow.open()
            _saved = torch.get_num_threads()
            if _saved != REPLAY_THREADS:
                torch.set_num_threads(REPLAY_THREADS)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _window = None
                if torch.get_num_threads() != _saved:
                    torch.set_num_threads(_saved)


def cpu_window() -> None:
    """Open the window of measured CPU use (:class:`CpuWindow`) now, ahead of the replay that will use it: a command
    calls it before it opens the bundle (torch-free), so the choice of :func:`pass_threads` sees the opening too.
    The outermost :func:`replay_threads` closes it."""
    global _window
    with _lock:
        if _depth == 0:
            _window = CpuWindow.open()


def pass_threads() -> int:
    """How many workers loss.policy's token pass may be split over (module doc): :data:`PASS_THREADS`, at most the
    CPUs this process may run on, 1 where the others leave no second core free, 1 after
    :func:`single_pass_thread`."""
    if _single_pass:
        return 1
    cpus = usable_cpus()
    if cpus < 2:
        return 1
    window = _window
    others = window.others_busy() if window is not None else None
    if others is not None:  # measured over this replay: the replay's one core, and FREE_CORE of another
        free = cpus - 1 - others
    else:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average on this platform: the CPUs taken as free
            load = 0.0
        free = cpus - load
    if free < FREE_CORE:
        return 1
    return min(PASS_THREADS, cpus)


class CpuWindow:
    """The CPU time other processes used on this process's CPUs since :meth:`open` (Linux ``/proc/stat``)."""

    def __init__(self, start: tuple[float, float, float]) -> None:
        self._start = start

    @classmethod
    def open(cls) -> "Optional[CpuWindow]":
        """A window from now; ``None`` where ``/proc/stat`` cannot be read or parsed."""
        start = _cpu_times()
        return None if start is None else cls(start)

    def age(self) -> float:
        """Seconds since the window was opened."""
        return time.monotonic() - self._start[0]

    def others_busy(self) -> Optional[float]:
        """The cores' worth the others kept busy over the window (busy time of this process's CPUs — user, nice,
        system, irq, softirq, steal — less this process's and its reaped children's CPU time, ÷ the window's
        wall time); ``None`` before :data:`MIN_WINDOW` seconds or when ``/proc/stat`` can no longer be read."""
        now = _cpu_times()
        if now is None:
            return None
        wall = now[0] - self._start[0]
        if wall < MIN_WINDOW:
            return None
        return max(0.0, ((now[1] - self._start[1]) - (now[2] - self._start[2])) / wall)


_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)  # user nice system [idle iowait] irq softirq steal


def _cpu_times(path: str = "/proc/stat") -> Optional[tuple[float, float, float]]:
    """``(monotonic seconds, busy seconds of this process's CPUs, this process's CPU seconds)``; ``None`` where
    ``path`` cannot be read or a CPU of the affinity has no line."""
    try:
        cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        tick = os.sysconf("SC_CLK_TCK")
        with open(path, "rb") as fh:
            text = fh.read(1 << 20).decode("ascii", "replace")
    except (AttributeError, OSError, ValueError):
        return None
    busy, seen = 0, 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name in cpus:
            values = rest.split()
            try:
                busy += sum(int(values[k]) for k in _BUSY_COLUMNS if k < len(values))
            except ValueError:
                return None
            seen += 1
    if seen != len(cpus) or tick <= 0:
        return None
    t = os.times()
    return time.monotonic(), busy / tick, t.user + t.system + t.children_user + t.children_system


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), else the CPU count; at least 1 (also ``scan``'s default
    ``--jobs``)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):  # no affinity on this platform
        return max(os.cpu_count() or 1, 1)


def single_pass_thread() -> None:
    """Every later pass of this process on one thread (a scan worker beside others, a Ray task)."""
    global _single_pass
    _single_pass = True
