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
than the CPUs this process may run on (``os.sched_getaffinity``); 1 where those CPUs are not free (the 1-minute
load average leaves less than :data:`FREE_CORE` of a core: measured on this 2-core host at a load of 2.7, two
threads took 10–20% more CPU and more wall than one — they only take turns with the others); 1 inside a scan
worker when several run (:func:`single_pass_thread`: the workers already use the cores) and inside a Ray task
(one CPU asked each). On a host of many cores a replay thus uses what it uses on two: one shard's pass has no
more than two workers, and the cores beyond are for other shards and bundles (``scan``, ``--executor ray``).
``OMP_NUM_THREADS`` does not change it: that is torch's intra-op setting, which the replay overrides (above).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

REPLAY_THREADS = 1  # intra-op threads of the replay's passes (module doc)
PASS_THREADS = 2  # at most: the threads loss.policy's token pass is split over (module doc)
FREE_CORE = 0.5  # the part of a core the load average must leave free for a second thread (module doc)
_single_pass = False

_lock = threading.Lock()
_depth = 0
_saved = 0


@contextmanager
def replay_threads() -> Iterator[None]:
    """Torch's intra-op threads set to :data:`REPLAY_THREADS` over a replay, the caller's count restored when
    the last (outermost) replay ends. Nestable and thread-safe; torch's setting is process-wide, so a replay in
    one thread also holds another thread's torch work of the same process to that count meanwhile."""
    import torch  # (here: usable_cpus serves the scan command's parser without it)

    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = torch.get_num_threads()
            if _saved != REPLAY_THREADS:
                torch.set_num_threads(REPLAY_THREADS)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and torch.get_num_threads() != _saved:
                torch.set_num_threads(_saved)


def pass_threads() -> int:
    """How many threads loss.policy's token pass may be split over (module doc): :data:`PASS_THREADS`, at most the
    CPUs this process may run on, 1 after :func:`single_pass_thread`."""
    if _single_pass:
        return 1
    cpus = usable_cpus()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform: the CPUs taken as free
        load = 0.0
    if cpus - load < FREE_CORE:
        return 1
    return max(1, min(PASS_THREADS, cpus))


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
