"""Per-chunk payload checksums (format 1.3, SPEC §2.3): a selected replay verifies only what it reads.

The writer records, beside each safetensors payload's whole-file sha256, the sha256 of every fixed-size chunk of
the file (``manifest.payloads[name].chunks``: ``{"bytes": 4194304, "sha256": [...]}``), computed in the same read
as the whole-file hash. ``manifest.json`` is itself checksummed in ``COMPLETE``, so a chunk list is as trustworthy
as the whole-file sha256 beside it.

A reader opened with ``defer_payloads`` (``replay --sample/--group/--batch``) verifies such a payload's header
chunk(s) when it opens the bundle and every other chunk only when a byte of it is asked for: a :class:`ChunkGuard`
sits between the memory-mapped tensor and whoever reads it. ``BundleReader.payload_rows`` has the guard verify the
chunks that hold the requested token rows (each chunk hashed at most once) before it copies those rows out;
``BundleReader.payload`` has it verify the file's whole sha256 (the message of a full verification) before the
full tensor is handed out. Nothing unverified leaves the reader. A payload without a chunk list (every bundle
written before them, a ``.pt`` file) is verified whole when the bundle is opened, as always.

Chunk size: 4 MiB. A selected replay hashes, per payload, the chunk of its header and the chunk(s) of its rows: a
semantic group of a large step (16 samples × 16k tokens of float32) is 1 MiB a payload, so it costs 8–12 MiB a
payload at 4 MiB chunks against 32–48 MiB at 16 MiB (≈ 0.1 s less over the six payloads of a 134M-token step,
out of ≈ 1.5 s), while the list stays small: ≈ 650 checksums for a 2.7 GB step (its manifest.json ≈ 56 KB), and
the manifest's 64 MiB cap holds the list of ≈ 4 TB of payloads. The writer reads the file in 4 MiB buffers, one a
chunk, so each chunk's digest comes from the bytes already read for the whole file's.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

from ..errors import BundleError
from .files import _checksum_mismatch, _sha256_stream, open_payload

if TYPE_CHECKING:
    import torch

    from .schema import PayloadSpec

CHUNK_BYTES = 4 << 20  # what the writer records
# What a reader takes: a chunk list whose chunks are smaller than this would be long, larger ones would make a
# selected replay hash much more than it reads.
MIN_CHUNK_BYTES = 1 << 16
MAX_CHUNK_BYTES = 1 << 30
_READ = 16 << 20  # bytes per read while hashing (a larger chunk is hashed in several reads)
_PARALLEL = 1 << 20  # a read at least this large has its two digests computed on two threads


def hash_file(path: Path, chunk: int = CHUNK_BYTES) -> tuple[str, list[str]]:
    """``(sha256 of the file, [sha256 of each chunk of chunk bytes])`` in one read of the file (:func:`hash_stream`)."""
    with open(path, "rb", buffering=0) as fh:
        return hash_stream(fh, chunk)


def hash_stream(fh, chunk: int, stop: Optional[threading.Event] = None) -> Optional[tuple[str, list[str]]]:
    """:func:`hash_file` of an open binary file: each buffer read feeds the whole-file hash and its chunk's. A large
    buffer's chunk digest is computed on a second thread while the whole digest takes the same bytes (hashlib
    releases the GIL), so the wall time stays about one hash of the file where a second core is free. ``stop`` set
    between two reads → ``None`` (a background hash given up)."""
    if chunk > _READ and chunk % _READ:
        raise ValueError(f"chunk size {chunk}: expected at most {_READ} bytes or a multiple of it")
    whole = hashlib.sha256()
    digests: list[str] = []
    size = os.fstat(fh.fileno()).st_size
    buf = bytearray(min(chunk, _READ, size + 1))
    current = hashlib.sha256()
    filled = 0  # bytes of the current chunk fed to ``current``
    while True:
        if stop is not None and stop.is_set():
            return None
        n = fh.readinto(buf)
        if not n:
            break
        view = memoryview(buf)[:n]
        if n >= _PARALLEL:
            worker = threading.Thread(target=current.update, args=(view,), name="chunk-sha256")
            worker.start()
            try:
                whole.update(view)
            finally:
                worker.join()
        else:
            whole.update(view)
            current.update(view)
        filled += n
        if filled >= chunk:
            digests.append(current.hexdigest())
            current, filled = hashlib.sha256(), 0
    if filled:
        digests.append(current.hexdigest())
    return whole.hexdigest(), digests


def raw_chunk_bytes(raw_manifest, file: Path) -> Optional[int]:
    """The chunk size the manifest (as decoded JSON, unchecked) lists for ``file``'s payload, when it is one a reader
    takes (:data:`MIN_CHUNK_BYTES`–:data:`MAX_CHUNK_BYTES`, a multiple of a read when larger than one); else
    ``None`` — the reader's checks name what is wrong with it."""
    from .packed import SAFETENSORS_SUFFIX, payload_stem

    payloads = raw_manifest.get("payloads") if isinstance(raw_manifest, dict) else None
    spec = payloads.get(payload_stem(file.name)) if isinstance(payloads, dict) else None
    listed = spec.get("chunks") if isinstance(spec, dict) else None
    size = listed.get("bytes") if isinstance(listed, dict) else None
    if (not file.name.endswith(SAFETENSORS_SUFFIX) or type(size) is not int
            or not MIN_CHUNK_BYTES <= size <= MAX_CHUNK_BYTES or (size > _READ and size % _READ)):
        return None
    return size




def chunk_count(nbytes: int, chunk: int) -> int:
    return -(-nbytes // chunk)


def spans(starts: Iterable[int], stops: Iterable[int], row_bytes: int, base: int, chunk: int) -> set[int]:
    """The chunks holding the bytes of the token-row ranges ``[start, stop)`` of a payload whose row 0 starts at
    byte ``base`` of the file and whose rows are ``row_bytes`` long."""
    out: set[int] = set()
    for lo, hi in zip(starts, stops):
        if hi <= lo or row_bytes == 0:
            continue
        first = (base + lo * row_bytes) // chunk
        last = (base + hi * row_bytes - 1) // chunk
        out.update(range(first, last + 1))
    return out


def runs(index: "torch.Tensor") -> tuple[list[int], list[int]]:
    """The runs of consecutive values of the 1-D int64 ``index`` (sorted or not) as ``([starts], [stops])``."""
    import torch

    if index.numel() == 0:
        return [], []
    breaks = torch.nonzero(index[1:] != index[:-1] + 1).reshape(-1) + 1
    cut = torch.cat([torch.zeros(1, dtype=torch.int64), breaks, torch.tensor([index.numel()])])
    starts = index[cut[:-1]]
    stops = index[cut[1:] - 1] + 1
    return starts.tolist(), stops.tolist()


class ChunkGuard:
    """The verification of one payload file that a deferred open left for later: its chunks, each hashed at most
    once, against ``spec.chunks`` (the manifest's, itself verified), and the whole file's sha256 against the
    manifest and the rank sentinel."""

    def __init__(self, path: Path, spec: "PayloadSpec", sentinel_sha256: str, sentinel_name: str) -> None:
        self.path = path
        self.spec = spec
        self.chunk = spec.chunks.bytes
        self.expected = spec.chunks.sha256
        self.sentinel_sha256 = sentinel_sha256
        self.sentinel_name = sentinel_name
        self.verified: set[int] = set()
        self.complete = False
        self.base = 0  # byte of the file where row 0 starts (known once the header is read)
        self.row_bytes = 0

    def check_header(self) -> None:
        """Verify the chunk(s) holding the safetensors header: the 8-byte length and the JSON it counts (the
        header itself is validated afterwards by ``safetensors_io.parse_header``, from these very bytes)."""
        self._verify({0})
        fd = open_payload(self.path)
        try:
            head = os.pread(fd, 8, 0)
        finally:
            os.close(fd)
        if len(head) == 8:
            from .safetensors_io import HEADER_MAX

            length = int.from_bytes(head, "little")
            end = 8 + min(length, HEADER_MAX)
            self._verify(set(range(0, chunk_count(min(end, self.spec.bytes), self.chunk))))

    def layout(self, tensor: "torch.Tensor") -> None:
        """Where the rows of the loaded ``tensor`` lie in the file (its data fills the file's tail exactly)."""
        nbytes = tensor.numel() * tensor.element_size()
        self.base = self.spec.bytes - nbytes
        rows = tensor.shape[0] if tensor.dim() else 1
        self.row_bytes = nbytes // rows if rows else 0

    def rows(self, starts: list[int], stops: list[int]) -> None:
        """Verify every chunk that holds a byte of the token rows ``[start, stop)``."""
        if not self.complete:
            self._verify(spans(starts, stops, self.row_bytes, self.base, self.chunk))

    def whole(self) -> None:
        """Verify the whole file (its sha256 against the manifest and the rank sentinel, as a full open does)."""
        if self.complete:
            return
        fd = open_payload(self.path)
        try:
            with open(fd, "rb", buffering=0, closefd=False) as fh:
                digest = _sha256_stream(fh, None)
        finally:
            os.close(fd)
        if digest != self.spec.sha256 or digest != self.sentinel_sha256:
            raise _checksum_mismatch(self.path, self.spec.sha256, self.sentinel_sha256, self.sentinel_name, digest)
        self.complete = True

    def verify_all(self) -> None:
        """Verify every chunk against its listed sha256."""
        self._verify(set(range(len(self.expected))))

    def _verify(self, wanted: set[int]) -> None:
        todo = sorted(i for i in wanted - self.verified if i < len(self.expected))  # none past the file's end
        if not todo:
            return
        fd = open_payload(self.path)
        try:
            size = os.fstat(fd).st_size
            if size != self.spec.bytes:
                raise BundleError(f"{self.path}: size {size} bytes, manifest says {self.spec.bytes} "
                                  f"(truncated or altered)")
            for i in todo:
                lo = i * self.chunk
                hi = min(lo + self.chunk, size)
                digest = hashlib.sha256()
                at = lo
                while at < hi:
                    block = os.pread(fd, min(_READ, hi - at), at)
                    if not block:
                        break
                    digest.update(block)
                    at += len(block)
                self._judge(i, digest.hexdigest())
        finally:
            os.close(fd)

    def check_digests(self, digests: list[str]) -> None:
        """Every chunk's sha256 computed elsewhere (in the read that hashed the whole file, ``verify_chunks``; as
        many as the list holds) against the list."""
        for i, got in enumerate(digests):
            self._judge(i, got)

    def _judge(self, i: int, got: str) -> None:
        """Chunk ``i``'s sha256 against its listed one: verified, or the one-line refusal naming it."""
        if got != self.expected[i]:
            lo = i * self.chunk
            raise BundleError(
                f"{self.path}: chunk {i} (bytes {lo}–{min(lo + self.chunk, self.spec.bytes)}): sha256 mismatch "
                f"(manifest $.payloads.{self.spec.name}.chunks.sha256[{i}] {self.expected[i][:12]}…, file {got[:12]}…)"
            )
        self.verified.add(i)
        if len(self.verified) == len(self.expected):
            self.complete = True  # every chunk: the file is as the manifest lists it


def structure_error(spec: "PayloadSpec") -> Optional[str]:
    """What is wrong with a payload spec's chunk list beyond its JSON types (which the schema checks): the number
    of checksums for the file's bytes. ``None`` when it is consistent (or absent)."""
    import msgspec

    chunks = spec.chunks
    if chunks is msgspec.UNSET:
        return None
    want = chunk_count(spec.bytes, chunks.bytes)
    if len(chunks.sha256) != want:
        return (f"$.payloads.{spec.name}.chunks.sha256: {len(chunks.sha256)} checksum(s), expected {want} "
                f"(one per {chunks.bytes}-byte chunk of the {spec.bytes}-byte file)")
    return None


def _float8(dtype) -> bool:
    return isinstance(dtype, str) and "float8" in dtype


def deferrable(name: str, spec: "PayloadSpec", file: Path) -> bool:
    """Whether a deferred open may leave this payload's chunks for later: a safetensors file with a chunk list,
    neither a 0/1 mask whose every value is checked at open (``layout.MASK_PAYLOADS``) nor a float8 payload
    (upcast whole at open)."""
    import msgspec

    from .layout import MASK_PAYLOADS
    from .packed import SAFETENSORS_SUFFIX

    return (spec.chunks is not msgspec.UNSET and file.name.endswith(SAFETENSORS_SUFFIX)
            and name not in MASK_PAYLOADS and not _float8(spec.dtype))


def deferrable_raw(raw_manifest, file: Path) -> bool:
    """:func:`deferrable` on the manifest as decoded JSON (unchecked), for the files the reader reads ahead."""
    from .layout import MASK_PAYLOADS
    from .packed import SAFETENSORS_SUFFIX, payload_stem

    payloads = raw_manifest.get("payloads") if isinstance(raw_manifest, dict) else None
    name = payload_stem(file.name)
    spec = payloads.get(name) if isinstance(payloads, dict) else None
    return (isinstance(spec, dict) and isinstance(spec.get("chunks"), dict)
            and file.name.endswith(SAFETENSORS_SUFFIX) and name not in MASK_PAYLOADS
            and not _float8(spec.get("dtype")))


_HEX = frozenset("0123456789abcdef")


def _kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def raw_error(raw_manifest) -> Optional[str]:
    """The first malformed chunk list of the manifest as decoded JSON, as ``<field path>: <what is wrong>`` (the
    payload named: the schema's own message says ``$.payloads[...]``), else ``None``. Its count is checked against
    the file's bytes by :func:`structure_error` once the manifest is decoded."""
    payloads = raw_manifest.get("payloads") if isinstance(raw_manifest, dict) else None
    for name, spec in payloads.items() if isinstance(payloads, dict) else ():
        if not isinstance(spec, dict) or "chunks" not in spec:
            continue
        where = f"$.payloads.{name}.chunks"
        value = spec["chunks"]
        if not isinstance(value, dict):
            return f"{where}: expected an object, got {_kind(value)}"
        size = value.get("bytes")
        if "bytes" not in value:
            return f"{where}.bytes: missing (the size of each chunk)"
        if type(size) is not int or not MIN_CHUNK_BYTES <= size <= MAX_CHUNK_BYTES:
            got = size if type(size) is int else _kind(size)
            return f"{where}.bytes: expected an integer from {MIN_CHUNK_BYTES} to {MAX_CHUNK_BYTES}, got {got}"
        sums = value.get("sha256")
        if "sha256" not in value:
            return f"{where}.sha256: missing (one checksum per chunk)"
        if not isinstance(sums, list):
            return f"{where}.sha256: expected an array of sha256 digests, got {_kind(sums)}"
        for i, digest in enumerate(sums):
            if not isinstance(digest, str):
                return f"{where}.sha256[{i}]: expected a sha256 digest (64 lowercase hex digits), got {_kind(digest)}"
            if len(digest) != 64 or not _HEX.issuperset(digest):
                return (f"{where}.sha256[{i}]: expected a sha256 digest (64 lowercase hex digits), got a string of "
                        f"{len(digest)} character(s) that is not one")
    return None
