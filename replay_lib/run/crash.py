"""Internal errors: an exception nobody expected is a bug in this tool, exit 5 (SPEC §5.2), never 1.

Exit 1 means "a divergence was found": a crash reported as 1 would tell a script that the bundle is
wrong. Each entry point (``trajectory-replay``, ``python -m replay_lib``, ``replay-tui`` with or without
``--check``, the debugger's worker and UI) catches what escaped at its outermost level and prints one
line naming a file that holds the traceback. The file has no local variables (Textual's and Rich's
tracebacks print them: tensor values, file contents, bundle strings) and its text is escaped like
everything else shown from a bundle, so ``cat``-ing it into a terminal is safe too.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

from ..errors import EXIT_INTERNAL
from ..safe_text import safe

CRASH_DIR_NAME = "trajectory-replay"
MESSAGE_LIMIT = 200  # characters of the exception's message on the one line (the file has it whole)

__all__ = ["EXIT_INTERNAL", "crash_dirs", "internal_error_line", "save_traceback"]


def crash_dirs() -> list[Path]:
    """Where a traceback is saved, in order of preference: the user's cache dir (``$XDG_CACHE_HOME`` or
    ``~/.cache``), then the temp dir."""
    dirs = []
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if cache and os.path.isabs(cache):
        dirs.append(Path(cache) / CRASH_DIR_NAME)
    else:
        try:
            dirs.append(Path.home() / ".cache" / CRASH_DIR_NAME)
        except RuntimeError:  # no home directory to be found
            pass
    dirs.append(Path(tempfile.gettempdir()))
    return dirs


def traceback_text(exc: BaseException, prog: str) -> str:
    """The file's text: what ran, then the traceback (frames and source lines, no locals), escaped."""
    from .. import __version__

    head = [f"{prog} {__version__} internal error (a bug in this tool)",
            f"time: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}",
            f"python: {sys.version.split()[0]} ({sys.executable})",
            f"argv: {' '.join(sys.argv)}", ""]
    body = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "\n".join(safe(line) for line in head + body.splitlines()) + "\n"


def save_traceback(exc: BaseException, prog: str = "trajectory-replay") -> tuple[Optional[Path], str]:
    """Write the traceback to a fresh ``crash-<time>-<pid>.txt``; ``(path, "")``, or ``(None, why)``
    when no directory would take it."""
    text = traceback_text(exc, prog).encode("utf-8", "backslashreplace")
    stamp = time.strftime("%Y%m%dT%H%M%S")
    why = "no writable directory"
    for directory in crash_dirs():
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            for n in range(100):
                path = directory / f"crash-{stamp}-{os.getpid()}{f'-{n}' if n else ''}.txt"
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
                except FileExistsError:
                    continue
                with os.fdopen(fd, "wb") as f:
                    f.write(text)
                return path, ""
        except OSError as err:
            why = f"{directory}: {err.strerror or err}"
    return None, why


def short_message(exc: BaseException) -> str:
    """``<ExcType>: <message>``, escaped and cut to :data:`MESSAGE_LIMIT` characters."""
    name = type(exc).__qualname__
    try:
        message = safe(str(exc))
    except Exception:  # a __str__ that fails is a bug too; the type names it
        message = ""
    if len(message) > MESSAGE_LIMIT:
        message = message[:MESSAGE_LIMIT - 1] + "…"
    return f"{name}: {message}" if message else name


def internal_error_line(exc: BaseException, prog: str = "trajectory-replay") -> str:
    """Save the traceback and return the one line to print (no newline)."""
    path, why = save_traceback(exc, prog)
    where = f"traceback saved to {safe(path)}" if path is not None else f"traceback not saved ({safe(why)})"
    return f"{prog}: internal error (a bug in this tool): {short_message(exc)}; {where}"
