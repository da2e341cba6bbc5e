"""Files of a bundle: sha256, atomic writes, the checked reads of JSON files and their one-line errors."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
from pathlib import Path
from typing import Callable, Optional

import msgspec

from ..errors import BundleError
from .safe_open import json_cap, read_regular
from .json_limits import json_depth_error
from .layout import _PAYLOAD_NAME, _RANK_KEY, staging_name
from .schema import SUPPORTED_MAJORS


HASH_CHUNK = 16 << 20  # bytes per read: a payload of a few MB is one read and one GIL-free hash call


def sha256_file(path: Path, stop: Optional[threading.Event] = None) -> Optional[str]:
    """The file's sha256, read in large chunks (hashlib and the reads run without the GIL). ``stop`` set
    between two chunks → ``None`` (a background hash given up)."""
    with open(path, "rb", buffering=0) as fh:
        return _sha256_stream(fh, stop)


def _sha256_stream(fh, stop: Optional[threading.Event]) -> Optional[str]:
    digest = hashlib.sha256()
    size = os.fstat(fh.fileno()).st_size
    buf = bytearray(min(HASH_CHUNK, size + 1))  # a small file: one read, then the empty one at its end
    view = memoryview(buf)
    while True:
        if stop is not None and stop.is_set():
            return None
        n = fh.readinto(buf)
        if not n:
            return digest.hexdigest()
        digest.update(view[:n])


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_payload_name(name: str, where: str) -> None:
    """A payload name is a plain file stem: no separators, no ``..``, no absolute path, no hidden file."""
    if not isinstance(name, str) or not _PAYLOAD_NAME.match(name) or ".." in name:
        raise BundleError(f"{where}: unsafe payload name {name!r} (expected a plain file stem)")


def check_shard_keys(path: Path, shards: dict) -> None:
    """A cohort COMPLETE's ``$.shards`` is keyed by rank numbers as ``str(rank)`` writes them: ``"x"`` or
    ``" 0"`` would otherwise fail as ``int()`` of the key, or name a shard no rank looks up."""
    bad = next((key for key in shards if not _RANK_KEY.match(key)), None)
    if bad is not None:
        raise BundleError(f"{path}: $.shards: shard keys must be rank numbers, got {bad!r}")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(staging_name(path.name))
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_bytes(path: Path, what: str) -> bytes:
    """A JSON file or sentinel of a bundle: read only when it is a regular file inside its directory and
    under its size cap (``--max-json-bytes``), never blocking — a link to ``/dev/zero``, a FIFO or a file
    swapped for one would otherwise hang or flood the reader before any checksum is compared. The checks
    are :func:`replay_lib.bundle.safe_open.read_regular`'s (lstat, ``O_NOFOLLOW | O_NONBLOCK``, fstat, a bounded
    read); a link to a file beside it is followed, as the writer's layout allows."""
    return read_regular(path, path.parent, what, json_cap(path.name))


def _decode(path: Path, data: bytes, decoder, *, bounded: Optional[Callable[[bytes], object]] = None):
    """``decoder``: a ``msgspec.json.Decoder`` or a function of the bytes (e.g. ``decode_index``).

    ``bounded``: a strict decode (every type concrete, unknown fields forbidden: ``decode_index_strict``) whose
    schema bounds the nesting far below :data:`~replay_lib.bundle.json_limits.MAX_JSON_DEPTH`, returning what
    ``decoder`` would. A document it decodes cannot be too deep, so it is tried first and the byte scan is
    skipped; on any failure (a deep document has an unknown field or a value of the wrong type, or exhausts the
    decoder's recursion) the document goes the usual way — the depth scan, then ``decoder`` — and is reported
    exactly as without it."""
    if bounded is not None:
        try:
            return bounded(data)
        except Exception:  # the checks below name it (the depth scan first, as for any document)
            pass
    check_json_depth(path, data)
    try:
        return decoder.decode(data) if isinstance(decoder, msgspec.json.Decoder) else decoder(data)
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:
        # UTF-8 is checked only on failure (the decoder checks strings itself): a file that is not
        # UTF-8 is reported as such, with the byte offset in the file, whatever the decoder tripped on
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise BundleError(f"{path}: not valid UTF-8 (byte {bad.start})") from None
        if isinstance(exc, msgspec.ValidationError):
            raise BundleError(f"{path}: {_validation_message(exc)}") from None
        raise BundleError(f"{path}: invalid JSON: {exc}{_literal_hint(data, str(exc))}") from None


_AT_BYTE = re.compile(r"\(byte (\d+)\)")


def _literal_hint(data: bytes, message: str) -> str:
    """``; NaN is not JSON …`` when the decoder stopped at a bare ``NaN`` / ``Infinity`` literal (Python's json
    writes them; only expected.json, the original's, is read with them)."""
    m = _AT_BYTE.search(message)
    if m is None:
        return ""
    at = int(m.group(1))
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        if data[at:at + len(literal)] == literal or data[at - 1:at - 1 + len(literal)] == literal:
            return f"; {literal.decode()} is not JSON (only index.json and expected.json may hold NaN or Infinity)"
    return ""


def check_json_depth(path: Path, data: bytes) -> None:
    """Refuse a document nested deeper than the format allows before a decoder recurses into it (SPEC §11)."""
    too_deep = json_depth_error(data)
    if too_deep is not None:
        raise BundleError(f"{path}: {too_deep}")


def _validation_message(exc: msgspec.ValidationError) -> str:
    # msgspec: "Expected `int`, got `str` - at `$.samples[3].loss_mask`" → "$.samples[3].loss_mask: expected `int`, got `str`"
    text = str(exc)
    # A bad dict key: "Invalid enum value 'x' - at `key` in `$.stage_contracts`" → "$.stage_contracts (key): …"
    m = re.match(r"^(.*) - at `key` in `(.*)`$", text, re.S)
    if m:
        what = m.group(1)
        return f"{m.group(2)} (key): {what[:1].lower()}{what[1:]}"
    m = re.match(r"^(.*) - at `(.*)`$", text, re.S)
    if m:
        what = m.group(1)
        return f"{m.group(2)}: {what[:1].lower()}{what[1:]}"
    return text


def parse_format_version(version, where: str) -> tuple[int, int, int]:
    if not isinstance(version, str) or not re.match(r"\A[0-9]{1,9}\.[0-9]{1,9}\.[0-9]{1,9}\Z", version):
        raise BundleError(f"{where}: $.format_version: expected 'MAJOR.MINOR.PATCH', got {version!r}")
    major, minor, patch = (int(x) for x in version.split("."))
    if major not in SUPPORTED_MAJORS:
        raise BundleError(
            f"{where}: $.format_version: unsupported major version {version!r} "
            f"(this reader reads {' and '.join(f'{m}.x' for m in SUPPORTED_MAJORS)})"
        )
    return major, minor, patch


def open_payload(path: Path) -> int:
    """A descriptor of the payload file, opened without blocking (``O_NONBLOCK``: a FIFO swapped in after the
    reader's checks is opened at once, then refused) and checked on the descriptor: a regular file. An unreadable
    file is a one-line bundle error (exit 3), never an internal one."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise BundleError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BundleError(f"{path}: payload is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _checksum_mismatch(file: Path, manifest_sha: str, recorded: str, sentinel_name: str, digest: str) -> BundleError:
    """The one refusal of a payload whose sha256 is not what the manifest and its sentinel record."""
    return BundleError(f"{file}: sha256 mismatch (manifest {manifest_sha[:12]}…, {Path(sentinel_name).name} "
                       f"{recorded[:12]}…, file {digest[:12]}…)")
