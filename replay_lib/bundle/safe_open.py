"""Reading a file under a capture directory without following it anywhere (SPEC §11).

A capture directory is data from someone else: any name in it may be a FIFO (a read blocks forever), a
device or a link to one (``/dev/zero`` reads until memory runs out), a link out of the tree, or a file
of many gigabytes. :func:`read_regular` reads a file only when it is a regular file inside the tree and
below its size cap, and never blocks:

- every directory between ``root`` (the path the user named, followed as given) and the file is opened
  with ``O_NOFOLLOW | O_DIRECTORY`` from its parent's descriptor: a component that is a link, or that
  is swapped for one meanwhile, is refused, never followed;
- the file is ``lstat``-ed before it is opened (a FIFO or device is never opened at all), then opened
  ``O_RDONLY | O_NONBLOCK | O_NOFOLLOW`` and ``fstat``-ed again (a file swapped meanwhile is refused);
- a file that is itself a link is followed only when its real path stays inside the file's own
  directory (a bundle may link ``index.json`` to a file beside it, as the reader allows); the target
  is then opened link-free from ``root`` like any other file;
- the size is checked against the cap before anything is read, and the read itself is bounded (a file
  that grows meanwhile is refused at the cap, not read to its end).

Caps (documented in the README; ``--max-json-bytes N`` sets one cap for every JSON file and sentinel):
``index.json`` 2 GiB (it holds every sample's loss mask as JSON ints: a 4M-token bundle's is tens of
MB), any other JSON file or sentinel 64 MiB.

It sits beside ``layout`` rather than in ``bundle/`` because ``inspect`` uses it too and must not
import torch (importing ``replay_lib.bundle`` loads the reader).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Optional

from ..errors import BundleError

INDEX_JSON_CAP = 2 << 30
JSON_CAP = 64 << 20
MAX_JSON_BYTES_FLAG = "--max-json-bytes"

_max_json_bytes: Optional[int] = None  # set by --max-json-bytes; None: the defaults above

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafeFile(BundleError):
    """A file that is not read: ``str(err)`` is the one line (path first), ``reason`` the part after it."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class MissingFile(UnsafeFile):
    """The file (or a directory on its way) does not exist."""


class NotRegular(UnsafeFile):
    """A FIFO, device, socket or directory, a link that leaves the file's directory, or a linked directory
    on the way to it."""


class TooLarge(UnsafeFile):
    """Over its size cap (``--max-json-bytes``)."""

    def __init__(self, path: Path, what: str, size: int, cap: int, grew: bool = False) -> None:
        grown = "; it grew while being read" if grew else ""
        super().__init__(path, f"{what} is {size} bytes, over the {cap}-byte cap "
                               f"(raise it with {MAX_JSON_BYTES_FLAG}){grown}")
        self.size = size
        self.cap = cap


def set_max_json_bytes(limit: Optional[int]) -> None:
    """One cap for every JSON file and sentinel (``--max-json-bytes``); ``None`` restores the defaults."""
    global _max_json_bytes
    if limit is not None and limit < 0:
        raise ValueError(f"a size cap cannot be negative, got {limit}")
    _max_json_bytes = limit


def json_cap(name: str) -> int:
    """The size cap of the JSON file or sentinel ``name``."""
    if _max_json_bytes is not None:
        return _max_json_bytes
    return INDEX_JSON_CAP if name == "index.json" else JSON_CAP


def parse_size(text: str) -> int:
    """``--max-json-bytes`` values: bytes, or with a binary suffix K, M, G, T (``4G`` = 4 GiB)."""
    units = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = body[-1:] if body[-1:] in units else ""
    number = body[: len(body) - len(unit)]
    if not number.isdigit():
        raise ValueError(f"expected a size in bytes such as 67108864, 64M or 2G, got {text!r}")
    return int(number) << units[unit]


def read_json_file(path: Path, root: Path, what: Optional[str] = None) -> bytes:
    """:func:`read_regular` with the JSON cap of ``path``'s name."""
    return read_regular(path, root, what or path.name, json_cap(path.name))


def read_regular(path: Path, root: Path, what: str, cap: int) -> bytes:
    """The bytes of ``path``, a regular file under ``root`` (see the module docstring); ``UnsafeFile``
    (``MissingFile`` when it is not there) names the path and the reason otherwise."""
    path, root = Path(path), Path(root)
    parts = _relative_parts(path, root)
    try:
        dir_fd = os.open(root, os.O_RDONLY | _DIRECTORY)
    except FileNotFoundError:
        raise MissingFile(path, f"missing {what}") from None
    except OSError as exc:
        raise UnsafeFile(path, f"cannot read {what}: {exc.strerror}") from None
    try:
        return _read_under(dir_fd, path, root, parts, what, cap, follow_link=True)
    finally:
        os.close(dir_fd)


def _relative_parts(path: Path, root: Path) -> list[str]:
    try:
        parts = list(path.relative_to(root).parts)
    except ValueError:
        raise UnsafeFile(path, f"not under {root}") from None
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise UnsafeFile(path, f"not a plain path under {root}")
    return parts


def _read_under(root_fd: int, path: Path, root: Path, parts: list[str], what: str, cap: int,
                follow_link: bool) -> bytes:
    fd = _open_parent(root_fd, path, parts[:-1], what)
    try:
        name = parts[-1]
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise MissingFile(path, f"missing {what}") from None
        except OSError as exc:
            raise UnsafeFile(path, f"cannot read {what}: {exc.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            if not follow_link:
                raise NotRegular(path, f"{what} is not a regular file (a symlink that does not end at one)")
            return _read_link_target(root_fd, path, root, what, cap)
        _check_regular(path, st, what, cap)
        return _read_opened(fd, name, path, what, cap)
    finally:
        if fd != root_fd:
            os.close(fd)


def _open_parent(root_fd: int, path: Path, dirs: list[str], what: str) -> int:
    """The directory holding the file, each step opened link-free from the one before."""
    fd = root_fd
    for i, part in enumerate(dirs):
        try:
            nxt = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=fd)
        except FileNotFoundError:
            raise MissingFile(path, f"missing {what}") from None
        except OSError as exc:
            where = "/".join(dirs[: i + 1])
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise NotRegular(path, f"{where} is not a directory inside the tree (a link is never followed)") from None
            raise UnsafeFile(path, f"cannot read {what}: {exc.strerror}") from None
        finally:
            if fd != root_fd:
                os.close(fd)
        fd = nxt
    return fd


def _read_link_target(root_fd: int, path: Path, root: Path, what: str, cap: int) -> bytes:
    real, home = os.path.realpath(path), os.path.realpath(path.parent)
    if not real.startswith(home + os.sep):
        raise NotRegular(path, f"symlink leaves the bundle (→ {real})")
    target = Path(os.path.realpath(root)) / os.path.relpath(real, os.path.realpath(root))
    parts = _relative_parts(target, Path(os.path.realpath(root)))
    return _read_under(root_fd, path, root, parts, what, cap, follow_link=False)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a plain file")


def _check_regular(path: Path, st: os.stat_result, what: str, cap: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(path, f"{what} is not a regular file ({_kind(st.st_mode)})")
    if st.st_size > cap:
        raise TooLarge(path, what, st.st_size, cap)


def _read_opened(dir_fd: int, name: str, path: Path, what: str, cap: int) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | _NONBLOCK | _NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        raise MissingFile(path, f"missing {what}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # swapped for a link since the lstat
            raise NotRegular(path, f"{what} is not a regular file (a symlink)") from None
        raise UnsafeFile(path, f"cannot read {what}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        _check_regular(path, st, what, cap)  # swapped for a FIFO or grown since the lstat
        return _bounded_read(fd, st.st_size, path, what, cap)
    except OSError as exc:
        raise UnsafeFile(path, f"cannot read {what}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _bounded_read(fd: int, size: int, path: Path, what: str, cap: int) -> bytes:
    """Read to the end, never past ``cap``: one read of the whole file, then the empty one at its end
    (a single part is joined without a copy)."""
    parts: list[bytes] = []
    total = 0
    while True:
        want = (size - total + 1) if total <= size else (1 << 20)
        chunk = os.read(fd, min(want, cap + 1 - total))
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        total += len(chunk)
        if total > cap:
            raise TooLarge(path, what, total, cap, grew=True)
