"""The replay's intra-op thread count, chosen by the tool for its work rather than inherited from torch.

Every float64 pass of the replay runs over chunks of ``kernels.LOSS_CHUNK`` tokens (a few rows of 16K
elements at most) or over per-sample vectors: thousands of small ops, each far too short to be worth a parallel
region. With torch's default intra-op pool, any such op above the parallel grain (a ``[3, 16384]`` copy or
``scatter_add_``, a 16K-element ``exp``) forks its work to the OpenMP threads and waits for them: on an idle host
a wake-up and a spin-wait per op, on a loaded host (or a training host whose cores are busy) a scheduler
time slice per op. Measured on a 256 × 8,192 step on this 2-core host under load: ``loss.policy`` 0.10 s of CPU
on one thread, 1.3–1.8 s of CPU and 4.6–6.5 s of wall with two (128 chunks × three parallel ops of ≈ 15 ms).

So the stages run on one intra-op thread; the parallelism the tool uses is elsewhere — the reader hashes the
payloads on its own thread (hashlib releases the GIL), ``scan`` runs a bundle per worker, and ``replay
--executor ray`` a shard per task — never one op split over threads that other work is already using.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

REPLAY_THREADS = 1  # intra-op threads of the replay's passes (module doc)

_lock = threading.Lock()
_depth = 0
_saved = 0


@contextmanager
def replay_threads() -> Iterator[None]:
    """Torch's intra-op threads set to :data:`REPLAY_THREADS` over a replay, the caller's count restored when
    the last (outermost) replay ends. Nestable and thread-safe; torch's setting is process-wide, so a replay in
    one thread also holds another thread's torch work of the same process to that count meanwhile."""
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
