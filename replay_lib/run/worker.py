"""A worker process of a local scan: ``python -m replay_lib.run.worker IN_FD OUT_FD SINGLE_THREAD``.

Started by :mod:`replay_lib.run.executor` as a fresh interpreter (never a fork of the caller, never a re-run
of the caller's main script): it imports the replay once, says ``("ready", pid)`` on ``OUT_FD``, then for
each ``(target, partner, options)`` read from ``IN_FD`` sends ``("row", ScanRow)``; ``None`` or the end of
``IN_FD`` (its scan is gone) ends it. Both descriptors carry :class:`multiprocessing.connection.Connection`
messages (length-prefixed pickles between two processes of this package). SIGINT is ignored: the scan
decides when its workers stop.
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from multiprocessing.connection import Connection

    tasks = Connection(int(argv[1]), writable=False)
    rows = Connection(int(argv[2]), readable=False)
    import torch

    from .check import check_target

    if argv[3] == "1":
        from .threads import single_pass_thread

        torch.set_num_threads(1)
        single_pass_thread()  # the workers already use the cores (run.threads)
    rows.send(("ready", os.getpid()))
    while True:
        try:
            task = tasks.recv()
        except (EOFError, OSError):
            return 0
        if task is None:
            return 0
        target, partner, options = task
        rows.send(("row", check_target(target, options, partner)))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
