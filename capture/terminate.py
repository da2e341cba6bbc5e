"""SIGTERM while a bundle is being written: stop the writer and remove its staging, then die as before.

A launcher stops a job with SIGTERM (then SIGKILL after a grace period). With Python's default disposition
the process dies at once, and a bundle the writer thread was staging stays behind as a hidden
``.<name>.tmp-<pid>-<hex>`` directory (the next capture into that directory removes it, SPEC §6). Where a
handler can be installed, :func:`register` installs one that, for every open capture, tells its writer to
stop at the next step of the publication in progress (its ``BundleWriter`` removes the staging as it stops),
waits for that at most :data:`SIGTERM_WAIT_S` seconds (then removes a staging directory still being filled
under the writer), drops the directory lock, restores the default disposition and sends the signal again: the process still dies by SIGTERM (exit status −15 / 143), atexit handlers still do not run.

A handler is installed only where that changes nothing else:

* on the main thread (Python runs signal handlers there only);
* over the default disposition. A handler the framework installed (its own shutdown, which flushes the
  capture through ``close()``/atexit when it exits), ``SIG_IGN`` or a handler set outside Python is left
  as it is. A framework that installs its handler later and chains to the previous one reaches ours, and
  the process dies by SIGTERM as with the default.

The handler is removed (the default restored) when the last open capture has closed and flushed. Like every
Python signal handler it runs when the main thread next executes Python code: a main thread stuck in a
native call (a hung collective) is ended by the launcher's SIGKILL, as with any framework's handler.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from typing import Any

from replay_lib.safe_text import safe

logger = logging.getLogger("capture")

SIGTERM_WAIT_S = 5.0  # well inside the grace period launchers give before SIGKILL (torchrun, Kubernetes: 30 s)

# id → weak reference of every open capture that registered (read without a lock by the handler, which may
# interrupt the main thread anywhere).
_captures: dict[int, "weakref.ref[Any]"] = {}


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def register(capture: Any) -> bool:
    """Clean ``capture``'s staging on SIGTERM (``capture.sink.terminate(deadline)``). Returns whether the
    handler is in place; ``False`` where it cannot be (see the module docstring)."""
    if not _on_main_thread():
        return False
    try:
        current = signal.getsignal(signal.SIGTERM)
        if current is not _on_sigterm:
            if current is not signal.SIG_DFL:
                return False
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return False
    _captures[id(capture)] = weakref.ref(capture)
    return True


def unregister(capture: Any) -> None:
    """``capture`` has closed and flushed; the last one to go restores the default disposition."""
    _captures.pop(id(capture), None)
    if _captures or not _on_main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):
        pass


def _on_sigterm(signum: int, frame: Any) -> None:
    deadline = time.monotonic() + SIGTERM_WAIT_S
    for ref in list(_captures.values()):
        capture = ref()
        if capture is None:
            continue
        try:
            if capture.sink.terminate(deadline):
                capture.release_lock()  # nothing of it is staged: the next job need not find a stale lock file
            else:
                logger.warning("replay capture: SIGTERM: a bundle being published under %s was left to its "
                               "writer", safe(capture.config.directory))
        except Exception:  # the process dies next whatever happened here
            pass
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
