"""The verifying reader (SPEC §2, §11): verify *everything* — sentinels, checksums, sizes, ids, version,
safety, tensor types — before returning, so no stage ever runs on a bundle that is not exactly what the
producer published.

One opt-in exception (``BundleReader(..., defer_checksums=True)``, ``open_bundle(..., defer_checksums=True)``;
the replay's runner alone asks for it): the sha256 of a format-1.3 safetensors payload (read without any
unpickler, its header validated, its size, dtype, shape and form checked) that the hashing thread has not finished
yet is judged later, by :meth:`BundleReader.confirm`, so the stages can run while the thread hashes. The rule
(SPEC §11): every checksum is judged before anything derived from a payload is reported, printed, drawn or written,
and whatever fails meanwhile — a later check of the reader, a stage's exception — gives way to a checksum
mismatch, reported with the message and exit code of the eager reader. ``.pt`` payloads (which go through an
unpickler) and every other caller keep the eager order: a checksum judged before the payload's checks."""

from __future__ import annotations

import math
import os
import re
import stat
import sys
import threading
import warnings
import zipfile
from pathlib import Path
from typing import Optional

import msgspec

from ..errors import BundleError

from .layout import _PAYLOAD_NAME, MASK_PAYLOADS, METADATA_FILES, PAYLOAD_DIR, PAYLOAD_FORMS, TOKENS
from .schema import (
    BUNDLE_COMPLETE_DECODER,
    EARLY_COMPLETE_WARNING,
    MANIFEST_DECODER,
    RANK_COMPLETE_DECODER,
    BundleComplete,
    BundleIndex,
    Expected,
    Manifest,
    PayloadSpec,
    RANK_AXES,
    RankComplete,
    RecomputeConfig,
    RedactionPolicy,
    decode_expected,
    decode_index_strict,
    decode_index_whole,
    loss_terms_length_error,
    unknown_fields,
)
from . import chunks, packed
from .files import (
    _decode,
    _read_bytes,
    _checksum_mismatch,
    _sha256_stream,
    check_json_depth,
    check_payload_name,
    open_payload,
    parse_format_version,
    sha256_bytes,
)


class _Torch:
    """torch, imported on first use: the checks that need no tensor (the layout, the JSON, every sha256) run
    while another thread imports it, and a bundle they refuse is reported without it (``cli.entry``)."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch, name)


torch = _Torch()


def _torch_ready() -> bool:
    """torch imported whole (not absent, not half-way through its import on another thread)."""
    module = sys.modules.get("torch")
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


# For the unknown-field scan of a decoded (valid) index.json: the samples' field values are kept as
# zero-copy JSON slices, so millions of loss-mask ints are not built a second time (SampleRecord has no
# nested objects whose keys would need a look).
_INDEX_TOP_DECODER = msgspec.json.Decoder(dict[str, msgspec.Raw])
_SAMPLE_KEYS_DECODER = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])


def _index_keys(blob: bytes) -> dict:
    return {key: _SAMPLE_KEYS_DECODER.decode(value) if key == "samples" else msgspec.json.decode(value)
            for key, value in _INDEX_TOP_DECODER.decode(blob).items()}


class _Digests:
    """The sha256 of the metadata blobs and of the payload files the manifest lists, computed on a
    background thread while the reader decodes the JSON and loads the tensors (hashing does not hold
    the GIL). The reader asks for each digest where it always did, so every check keeps its order and
    its message; a file the thread did not hash (for whatever reason) is hashed by the reader itself.
    :meth:`close` stops the thread within one chunk and waits for it: a refused bundle leaves nothing
    running."""

    def __init__(self, blobs: dict[str, bytes], files: list[Path], chunk_sizes: Optional[dict[Path, int]] = None) -> None:
        self._chunk_sizes = chunk_sizes or {}  # files whose chunks are hashed in the same read (verify_chunks)
        self._parts: dict[Path, list[str]] = {}
        self._meta: dict[str, str] = {}
        self._meta_done = threading.Event()
        self._files: dict[Path, str] = {}
        self._file_done = {file: threading.Event() for file in files}
        self._stop = threading.Event()
        self.idle = threading.Event()  # set when the thread has ended (every file hashed or given up)
        # The largest blob first: the thread is inside the hash (GIL released) before the reader
        # starts a decode, which holds the GIL from start to end.
        # The thread lets go of each blob once hashed: the reader drops a blob once decoded (its memory, not
        # just the reader's reference to it, is then freed).
        self._blobs = [(name, blobs[name]) for name in sorted(blobs, key=lambda name: -len(blobs[name]))]
        self._thread = threading.Thread(target=self._run, args=(files,), name="bundle-sha256", daemon=True)
        self._thread.start()

    def _run(self, files: list[Path]) -> None:
        try:
            while self._blobs:
                name, blob = self._blobs.pop(0)
                self._meta[name] = sha256_bytes(blob)
                del blob
        except Exception:
            pass  # the reader hashes what is missing
        finally:
            self._blobs = []
            self._meta_done.set()
        try:
            for file in files:
                try:
                    digest, parts = (None, None) if self._stop.is_set() else \
                        _hash_payload(file, self._stop, self._chunk_sizes.get(file))
                    if digest is not None:
                        self._files[file] = digest
                        if parts is not None:
                            self._parts[file] = parts
                except Exception:
                    pass  # the reader's own checks name the problem
                finally:
                    self._file_done[file].set()
        finally:
            for done in self._file_done.values():  # whatever happened, no reader waits forever
                done.set()
            self.idle.set()

    @property
    def stop(self) -> threading.Event:
        """Set by :meth:`close`: a hash given up (the reader's own, ahead of its checks, too)."""
        return self._stop

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def join(self) -> None:
        """Wait for the thread to end (after :attr:`idle`: at once)."""
        self._thread.join()

    def metadata(self, blobs: dict[str, bytes]) -> dict[str, str]:
        self._meta_done.wait()
        return {name: self._meta.get(name) or sha256_bytes(blob) for name, blob in blobs.items()}

    def hashed(self, path: Path) -> bool:
        """Whether the thread is done with ``path`` (:meth:`file` then returns at once)."""
        done = self._file_done.get(path)
        return done is None or done.is_set()

    def parts(self, path: Path) -> Optional[list[str]]:
        """The chunks' sha256 of ``path`` hashed with its chunk size (after :meth:`file`), else ``None``."""
        return self._parts.get(path)

    def file(self, path: Path) -> str:
        done = self._file_done.get(path)
        if done is not None:
            done.wait()
        digest = self._files.get(path)
        return digest if digest is not None else _sha256_payload(path)

    @staticmethod
    def payload_files(root: Path, raw_manifest) -> list[Path]:
        """The payload files worth hashing ahead: regular files (never links, FIFOs or devices) named by
        the manifest as decoded (unchecked, ``None`` when it does not decode); anything odd is left to the
        reader's checks."""
        names = raw_manifest.get("payloads") if isinstance(raw_manifest, dict) else None
        version = raw_manifest.get("format_version") if isinstance(raw_manifest, dict) else None
        payload_dir = root / PAYLOAD_DIR
        try:  # a linked payload directory is refused by the reader: nothing in it is read ahead
            if not stat.S_ISDIR(os.lstat(payload_dir).st_mode):
                return []
        except OSError:
            return []
        files = []
        for name in names if isinstance(names, dict) else ():
            if not isinstance(name, str) or not _PAYLOAD_NAME.match(name) or ".." in name:
                continue
            file = packed.payload_file(payload_dir, name, version)
            try:
                if stat.S_ISREG(os.lstat(file).st_mode):
                    files.append(file)
            except OSError:
                pass
        return files


def _hash_payload(path: Path, stop: threading.Event,
                  chunk: Optional[int] = None) -> tuple[Optional[str], Optional[list[str]]]:
    """``(sha256, None)`` of the payload file (:func:`_sha256_regular`); with ``chunk`` (``verify_chunks``),
    ``(sha256, [each chunk's sha256])`` from the same read (``chunks.hash_stream``). ``(None, None)`` where
    :func:`_sha256_regular` gives ``None``."""
    if chunk is None:
        return _sha256_regular(path, stop), None
    fd = _regular_descriptor(path)
    if fd is None:
        return None, None
    try:
        with open(fd, "rb", buffering=0, closefd=False) as fh:
            return chunks.hash_stream(fh, chunk, stop) or (None, None)
    finally:
        os.close(fd)


def _sha256_regular(path: Path, stop: threading.Event) -> Optional[str]:
    """:func:`sha256_file` of a regular file that is not a link, checked on the open descriptor (a file
    swapped for a FIFO or a link after the directory scan is not read: ``None``)."""
    fd = _regular_descriptor(path)
    return None if fd is None else _sha256_descriptor(fd, stop)


def _regular_descriptor(path: Path) -> Optional[int]:
    """A descriptor of ``path`` opened without following a link or blocking, ``None`` (closed) unless it is a
    regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        return None
    return fd


def _sha256_payload(path: Path) -> str:
    """The reader's own hash of a payload the thread did not hash: through :func:`open_payload`'s descriptor."""
    return _sha256_descriptor(open_payload(path), None)


def _sha256_descriptor(fd: int, stop: Optional[threading.Event]) -> Optional[str]:
    """The sha256 of the file open as ``fd`` (:func:`_sha256_stream`), which it closes."""
    try:
        with open(fd, "rb", buffering=0, closefd=False) as fh:
            return _sha256_stream(fh, stop)
    finally:
        os.close(fd)


def config_knob_active(value) -> bool:
    """Whether an unknown config knob is set to something (a replay refuses it) rather than off/empty."""
    return value not in (None, False, 0, "", [], {})


def _attempt(decode):
    """``(value, None)``, or ``(None, BundleError)`` to raise where the reader used to decode."""
    try:
        return decode(), None
    except BundleError as exc:
        return None, exc


def _settle(attempt):
    value, error = attempt
    if error is not None:
        raise error
    return value


# A compressed archive is inflated into memory: its records may hold this much more than the tensor the
# manifest declares (the pickle and torch's small bookkeeping records), not a decompression bomb.
_INFLATE_SLACK = 1 << 20


def _payload_size(file: Path, key: str, real_root: str) -> int:
    """The size of the payload file the manifest lists as ``key``, after the checks that name what is wrong with
    it: a link out of the bundle or to nothing, a missing file, not a regular file, an unreadable directory."""
    try:
        if file.is_symlink():
            target = os.path.realpath(file)
            if not target.startswith(real_root + os.sep):
                raise BundleError(f"{file}: symlink leaves the bundle (→ {target})")
            if not file.exists():
                raise BundleError(f"{file}: payload is a link that leads nowhere (dangling, or a loop)")
        if not file.exists():
            raise BundleError(f"{file}: missing payload listed in manifest.json $.payloads.{key}")
        if not file.is_file():
            raise BundleError(f"{file}: payload is not a regular file")
        return file.stat().st_size
    except OSError as exc:
        raise BundleError(f"{exc.filename or file}: cannot read: {exc.strerror or exc}") from None


def _descriptor_path(fd: int, path: Path) -> str:
    """A name that opens the very file behind ``fd`` (Linux's ``/proc/self/fd``): what torch and zipfile open by
    name is then the regular file checked, whatever the directory entry became meanwhile; elsewhere the path."""
    name = f"/proc/self/fd/{fd}"
    return name if os.path.exists(name) else str(path)


def _load_tensor(path: Path, spec: PayloadSpec) -> torch.Tensor:
    """The payload as a plain dense CPU tensor of real numbers (SPEC §2, §11), memory-mapped when its
    archive stores the records as they are; read through a descriptor :func:`open_payload` checked."""
    fd = open_payload(path)
    try:
        if path.name.endswith(packed.SAFETENSORS_SUFFIX):  # format 1.3: no unpickler
            from . import safetensors_io  # (imports torch: after the checks that need none)

            return _checked_tensor(path, safetensors_io.load(path, fd))
        return _load_opened(path, _descriptor_path(fd, path), spec)
    finally:
        os.close(fd)


# The first torch whose weights_only unpickler has no published escape: CVE-2025-32434 (a weights_only bypass with
# code execution, fixed in 2.6.0) and CVE-2026-24747 (memory corruption in that unpickler, fixed in 2.10).
SAFE_UNPICKLER_TORCH = (2, 10)


def torch_version() -> tuple[int, ...]:
    """The running torch's ``MAJOR.MINOR.PATCH`` as numbers (``"2.9.1+cu121"`` → ``(2, 9, 1)``)."""
    numbers = re.match(r"\s*(\d+(?:\.\d+)*)", str(torch.__version__))
    return tuple(int(n) for n in numbers.group(1).split(".")) if numbers else ()


def require_safe_unpickler(path: "Path | str") -> None:
    """Refuse (exit 3) to unpickle the foreign ``.pt`` file ``path`` on a torch whose weights_only unpickler has
    known escapes (before :data:`SAFE_UNPICKLER_TORCH`), naming the advisories."""
    if torch_version() >= SAFE_UNPICKLER_TORCH:
        return
    advisories = "CVE-2025-32434, code execution; CVE-2026-24747, memory corruption" \
        if torch_version() < (2, 6) else "CVE-2026-24747, memory corruption"
    raise BundleError(f"{path}: not loaded: torch {torch.__version__}'s weights_only unpickler has known "
                      f"escapes ({advisories}); install torch>=2.10 to read .pt payloads")


def _load_opened(path: Path, source: str, spec: PayloadSpec) -> torch.Tensor:
    """:func:`_load_tensor` of the file opened as ``source`` (messages name ``path``)."""
    require_safe_unpickler(path)
    mmap = not _compressed_archive(path, spec, source)
    try:
        # torch may warn while it rebuilds a tensor (a quantized one is deprecated): the checks below
        # decide about such a tensor, and a passing run prints nothing of torch's
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                obj = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as exc:
                if not mmap or ("mmap" not in str(exc) and "zipfile" not in str(exc).lower()):
                    raise
                obj = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError for objects, RuntimeError for corrupt archives
        raise BundleError(f"{path}: not a loadable weights-only tensor file ({_load_failure(exc)})") from None
    return _checked_tensor(path, obj)


def _checked_tensor(path: Path, obj) -> torch.Tensor:
    """``obj`` if it is a plain dense CPU tensor of real numbers (SPEC §2, §11); a one-line refusal otherwise."""
    if type(obj) is not torch.Tensor:
        raise BundleError(f"{path}: payload must be a plain torch.Tensor, got {type(obj).__module__}.{type(obj).__qualname__}")
    if obj.is_quantized:
        raise BundleError(f"{path}: payload must hold real numbers, got the quantized dtype {obj.dtype}")
    if obj.layout != torch.strided:
        raise BundleError(f"{path}: payload must be a dense (strided) tensor, got layout {obj.layout}")
    if obj.device.type != "cpu":
        raise BundleError(f"{path}: payload must be a CPU tensor, got device {obj.device.type!r}")
    if obj.dtype.is_complex:
        raise BundleError(f"{path}: payload must hold real numbers, got the complex dtype {obj.dtype}")
    if not (obj.dtype.is_floating_point or _is_integer(obj.dtype)):
        raise BundleError(f"{path}: payload must have a floating point or integer dtype, got {obj.dtype}")
    # a payload saved from a tensor in an autograd graph: the values are what was recorded, the flag is not
    return obj.detach() if obj.requires_grad else obj


# torch's weights-only refusal opens with generic advice (incl. "retry with weights_only=False"); what it refused
# follows this marker.
_UNPICKLER_MARKER = "WeightsUnpickler error:"
_REASON_CAP = 160


def _load_failure(exc: Exception) -> str:
    """What torch.load refused, in a sentence: the blocked global or opcode of a weights-only refusal, else the first
    sentence of torch's message (never cut mid-word: at most :data:`_REASON_CAP` characters, then "…")."""
    text = str(exc)
    if _UNPICKLER_MARKER in text:
        text = text.split(_UNPICKLER_MARKER, 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else type(exc).__name__)
    sentence = line.split(". ", 1)[0].rstrip(".")
    if len(sentence) > _REASON_CAP:
        sentence = sentence[:_REASON_CAP].rsplit(" ", 1)[0] + " …"
    return sentence


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _compressed_archive(path: Path, spec: PayloadSpec, source: Optional[str] = None) -> bool:
    """Whether the payload's zip archive compresses a record. Memory-mapping such an archive would read the
    compressed bytes as the tensor's values, so it is loaded into memory instead — within the size the
    manifest declares. A file that is no zip archive (torch's legacy format) is left to ``torch.load``."""
    try:
        with zipfile.ZipFile(source or path) as archive:
            records = archive.infolist()
    except zipfile.BadZipFile:
        return False
    except Exception as exc:  # a damaged directory: zipfile raises what it meets
        raise BundleError(f"{path}: not a loadable weights-only tensor file (zip archive: {exc})") from None
    if all(info.compress_type == zipfile.ZIP_STORED for info in records):
        return False
    inflated = sum(info.file_size for info in records)
    allowed = _declared_bytes(spec) + _INFLATE_SLACK
    if inflated > allowed:
        raise BundleError(
            f"{path}: compressed records inflate to {inflated} bytes, more than the {allowed} that "
            f"manifest $.payloads.{spec.name}.shape and .dtype allow"
        )
    return True


def _declared_bytes(spec: PayloadSpec) -> int:
    dtype = getattr(torch, spec.dtype[len("torch."):], None) if spec.dtype.startswith("torch.") else None
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 8
    return math.prod(spec.shape) * itemsize


def _check_form(path: Path, key: str, tensor: torch.Tensor) -> None:
    """A payload a stage reads has that stage's kind and rank (a ``[Σ, 1]`` log-prob tensor would broadcast
    against the ``[Σ]`` ones into a ``[Σ, Σ]`` product); any other payload has a token dimension."""
    form = PAYLOAD_FORMS.get(key)
    if form is None:
        return
    kind, dims = form
    where = f"{path}: manifest $.payloads.{key}"
    if tensor.dim() != len(dims):
        raise BundleError(f"{where}.shape: {list(tensor.shape)}, expected {len(dims)}-D [{', '.join(dims)}]")
    if kind == "float" and not tensor.dtype.is_floating_point:
        raise BundleError(f"{where}.dtype: {tensor.dtype}, expected a floating point dtype")
    if kind == "int" and not _is_integer(tensor.dtype):
        raise BundleError(f"{where}.dtype: {tensor.dtype}, expected an integer dtype")
    if key in MASK_PAYLOADS:
        bad = torch.nonzero((tensor != 0) & (tensor != 1)).reshape(-1)
        if bad.numel():
            raise BundleError(f"{where}: {int(bad.numel())} value(s) other than 0 and 1, the first "
                              f"{int(tensor[int(bad[0])])} at token {int(bad[0])} (a mask: 1 where the producer "
                              "selected the token)")


# Payloads of up to this many bytes in all (≈ 50 ms of hashing) are hashed by the reader itself, ahead of the JSON
# decodes (:meth:`BundleReader._verify`).
HASH_AHEAD_BYTES = 64 << 20


def _sizes(files: list[Path]) -> Optional[dict[Path, int]]:
    """Each file's size, or ``None`` when one vanished under the reader (its checks will say what)."""
    try:
        return {file: os.lstat(file).st_size for file in files}
    except OSError:
        return None


def _preload(manifest_blob: bytes, sizes: dict[Path, int]) -> dict[Path, tuple]:
    """``{file: (spec, load attempt, None)}`` for the payload files worth loading ahead (``_attempt`` of
    :func:`_load_tensor`, judged in its place by :meth:`BundleReader._verify_payloads`, its checksum first): of the
    regular files the reader would hash ahead (:meth:`_Digests.payload_files`, with their ``sizes``), those whose
    key the manifest lists under that name with exactly their size — what a load may inflate is bounded by the
    declared size. Nothing when the manifest does not decode (the reader reports it in its place), nor while torch
    is not imported yet (another thread may be importing it: the checks that need no tensor go first, each payload
    is loaded in its place)."""
    if not _torch_ready():
        return {}
    try:
        manifest = MANIFEST_DECODER.decode(manifest_blob)
    except Exception:
        return {}
    out: dict[Path, tuple] = {}
    for file, size in sizes.items():
        key = packed.payload_stem(file.name)
        spec = manifest.payloads.get(key)
        if spec is None or spec.name != key or size != spec.bytes:
            continue
        out[file] = (spec, _attempt(lambda: _load_tensor(file, spec)), None)
    return out


class BundleReader:
    """A verified bundle (or one verified rank shard of a cohort); ``open_bundle`` resolves cohorts too."""

    manifest: Manifest
    index: BundleIndex
    expected: Expected
    format_major: int = 1  # of manifest.json $.format_version (1 or 2)

    def __init__(self, path: str | os.PathLike, *, _shard: Optional[RankComplete] = None, _rank: Optional[int] = None,
                 defer_payloads: bool = False, defer_checksums: bool = False, verify_chunks: bool = False):
        """Open and verify a single bundle directory. A rank-local path requires its cohort's COMPLETE.

        ``defer_payloads`` (a selected replay): a payload with per-chunk checksums (``bundle.chunks``) has its
        header chunk verified here and every other chunk only when a byte of it is read (:meth:`payload_rows`,
        :meth:`verify_samples`; :meth:`payload` and :attr:`packed_mask` verify the whole file first). Every other
        check is made here as without it.

        ``defer_checksums``: the sha256 of a safetensors payload (format 1.3) still being hashed is judged by
        :meth:`confirm`, which the caller must call before it reports anything derived from a payload, and on any
        error it meets before that (module doc). With both, a payload verified chunk by chunk is never hashed
        whole; the others are confirmed as without ``defer_payloads``.

        ``verify_chunks`` (``validate``): each safetensors payload's chunk list (``bundle.chunks``) is checked too,
        its chunks hashed in the same read as the whole file (on a second thread where a core is free); a chunk
        whose sha256 differs from its listed one is refused as a selected replay would refuse it."""
        path = Path(path)
        if _shard is None:
            from .locate import resolve_bundle

            resolved = resolve_bundle(path)
            if resolved.kind != "bundle":
                raise BundleError(f"{path}: is a {resolved.kind}, not a single bundle; use open_bundle()")
            if resolved.shard is not None:
                _shard, _rank = resolved.shard, resolved.rank
        self.path = path
        self.rank = _rank
        self.warnings = []
        self._tensors = {}
        self._mask = None  # format 1.3's packed masks (packed_mask)
        self._defer_payloads = defer_payloads
        self._guards: dict[str, chunks.ChunkGuard] = {}  # payloads whose chunks are verified when read
        self._defer_checksums = defer_checksums
        self._verify_chunks = verify_chunks
        self._parts_ahead: dict[Path, list[str]] = {}  # the chunk digests of payloads hashed ahead (verify_chunks)
        # the payload checksums left to confirm(): (file, manifest sha256, sentinel sha256, sentinel name)
        self._pending: list[tuple[Path, str, str, str]] = []
        self._digests: Optional[_Digests] = None
        self._refusal: Optional[BundleError] = None  # what confirm() raised, raised again on every later call
        self._verify(_shard)

    # -- verification ------------------------------------------------------------------------------
    def _verify(self, shard: Optional[RankComplete]) -> None:
        root = self.path
        blobs = {name: _read_bytes(root / name, name) for name in METADATA_FILES}
        # decoded once: its payload names start the hashing; its error, if any, is raised in its place
        manifest_attempt = _attempt(lambda: self._raw(root / "manifest.json", blobs["manifest.json"]))
        files = _Digests.payload_files(root, manifest_attempt[0])
        if self._defer_payloads:  # the payloads verified chunk by chunk when read are neither hashed nor loaded ahead
            files = [f for f in files if not chunks.deferrable_raw(manifest_attempt[0], f)]
        # Payloads of a usual size are loaded and hashed by the reader while the thread hashes the JSON blobs (one
        # call each, the GIL released; loads, reads and hash calls release it often, so the thread's return finds
        # it soon), before the JSON decodes, which hold the GIL from start to end: a thread hashing files beside a
        # decode would wait for all of it between two files. Larger payloads are hashed by the thread (after the
        # blobs, so altered JSON files are refused without waiting for them) while the reader decodes and checks.
        sizes = _sizes(files)
        ahead = sizes is not None and sum(sizes.values()) <= HASH_AHEAD_BYTES
        chunk_sizes = {}
        if self._verify_chunks:
            chunk_sizes = {f: n for f in files if (n := chunks.raw_chunk_bytes(manifest_attempt[0], f)) is not None}
        digests = _Digests(blobs, [] if ahead else files, chunk_sizes)
        self._digests = digests
        try:
            self._loaded = _preload(blobs["manifest.json"], sizes or {})
            if ahead:
                for file, (spec, attempt, _) in self._loaded.items():
                    try:
                        digest, parts = _hash_payload(file, digests.stop, chunk_sizes.get(file))
                        if parts is not None:
                            self._parts_ahead[file] = parts
                    except Exception:
                        digest = None  # hashed again in its place, where its checks name what is wrong
                    self._loaded[file] = (spec, attempt, digest)
            try:
                self._check(shard, blobs, digests, manifest_attempt)
            except Exception:
                try:
                    self._judge_pending()  # a deferred checksum's mismatch comes first, as in the eager order
                finally:
                    self._pending = []
                raise
        finally:
            if not self._pending:
                digests.close()  # a bundle refused early leaves no hashing behind
                self._digests = None
            self._loaded = {}  # what was loaded ahead and not taken (a refused bundle's) is let go

    # -- deferred checksums (defer_checksums=True) ---------------------------------------------------
    @property
    def verified(self) -> bool:
        """Every payload checksum judged (always, unless opened with ``defer_checksums`` and not yet confirmed)."""
        return not self._pending and self._refusal is None

    def confirm(self) -> None:
        """Judge every checksum left to judge (waiting for the hashing thread, bounded by the payloads' sizes) and
        raise the eager reader's :class:`BundleError` on the first mismatch, in manifest order; a no-op when there
        is none left. Idempotent: a refusal is raised again on every later call."""
        if self._refusal is not None:
            raise self._refusal
        if not self._pending:
            return
        try:
            self._judge_pending()
        except BundleError as exc:
            self._refusal = exc
            raise
        finally:
            self._pending = []
            if self._digests is not None:
                self._digests.close()
                self._digests = None

    wait_verified = confirm

    def wait_hashed(self, timeout: Optional[float] = None) -> bool:
        """Whether the reader's thread is done hashing the payloads (waiting up to ``timeout`` seconds for it): a
        pass that could use a second core knows when the hashing no longer takes it. True for an eager open."""
        digests = self._digests
        if digests is None:
            return True
        if not digests.idle.wait(timeout):
            return False
        digests.join()  # ended, not only done: the process may fork (stages/split.py)
        return True

    def _judge_pending(self) -> None:
        """The pending checksums judged in order (each waits for its digest); the first mismatch raised. Those
        judged equal are dropped from the list."""
        while self._pending:
            file, manifest_sha, recorded, sentinel_name = self._pending[0]
            digest = self._digests.file(file)
            if digest != manifest_sha or digest != recorded:
                raise _checksum_mismatch(file, manifest_sha, recorded, sentinel_name, digest)
            self._pending.pop(0)

    def _check(self, shard: Optional[RankComplete], blobs: dict[str, bytes], digests: _Digests,
               manifest_attempt) -> None:
        root = self.path
        # Decoded while the thread hashes; a decode error is raised where it always was (after the
        # checksum checks), so a bundle altered on disk still reports its sha256 mismatch first.
        # Each JSON file's bytes are let go once it is decoded and hashed (index.json's kept for the rare scan of
        # its unknown fields): the records of a large index never share the memory with its text and
        # expected.json's values both.
        index_attempt = _attempt(lambda: _decode(root / "index.json", blobs["index.json"], decode_index_whole,
                                                     bounded=decode_index_strict))
        actual_meta = digests.metadata(blobs)
        if not (index_attempt[0] is not None and index_attempt[0][1]):
            del blobs["index.json"]
        expected_attempt = _attempt(lambda: _decode(root / "expected.json", blobs["expected.json"], decode_expected))
        del blobs["expected.json"]
        if shard is None:
            complete_path = root / "COMPLETE"
            if not complete_path.exists():
                raise BundleError(f"{complete_path}: missing COMPLETE sentinel (bundle incomplete or still being written)")
            complete: BundleComplete = _decode(complete_path, _read_bytes(complete_path, "COMPLETE"), BUNDLE_COMPLETE_DECODER)
            if complete.shards is not None:
                raise BundleError(f"{complete_path}: $.shards: a cohort COMPLETE in a bundle directory "
                                  f"(a bundle's COMPLETE holds $.ranks and $.metadata)")
            early = complete.early_writer
            if early:
                self._accept_early_writer(complete_path, manifest_attempt)
            else:
                self._check_metadata(complete_path, complete.metadata, actual_meta)
            self._check_ranks(complete_path, complete.ranks, index_attempt[0])
            shards = {}
            verified = not early
            for r in complete.ranks:
                spath = root / f"COMPLETE.{r}"
                if not spath.exists():
                    raise BundleError(f"{spath}: missing rank sentinel listed in COMPLETE $.ranks")
                shards[r] = _decode(spath, _read_bytes(spath, f"COMPLETE.{r}"), RANK_COMPLETE_DECODER)
                if shards[r].metadata or not early:  # the early writer's rank sentinels may lack them too
                    self._check_metadata(spath, shards[r].metadata, actual_meta)
                    verified = True
            if not shards:
                raise BundleError(f"{complete_path}: $.ranks: expected at least one rank")
            if not verified:
                self.warnings.append(f"{complete_path}: {EARLY_COMPLETE_WARNING}")
            shard = shards[min(shards)]
            sentinel_name = f"COMPLETE.{min(shards)}"
        else:
            sentinel_name = f"../COMPLETE (shard {self.rank})"
            self._check_metadata(root.parent / "COMPLETE", shard.metadata, actual_meta)

        raw_manifest = _settle(manifest_attempt)
        if not isinstance(raw_manifest, dict):
            raise BundleError(f"{root / 'manifest.json'}: $: expected an object")
        self.format_major = parse_format_version(raw_manifest.get("format_version"), str(root / "manifest.json"))[0]
        self.packed = packed.is_packed(raw_manifest.get("format_version"))
        chunk_error = chunks.raw_error(raw_manifest)  # named by payload (the schema's message says $.payloads[...])
        if chunk_error is not None:
            raise BundleError(f"{root / 'manifest.json'}: {chunk_error}")
        self.manifest = _decode(root / "manifest.json", blobs["manifest.json"], MANIFEST_DECODER)
        self.index, has_unknown = _settle(index_attempt)
        self.expected = _settle(expected_attempt)
        from .format2 import check_read  # either major: per-token rewards; 2.0: its own rules

        error, notes = check_read(self.manifest, self.index, self.expected, self.format_major, raw_manifest)
        if error is not None:
            raise BundleError(f"{root / error[0]}: {error[1]}")
        self.warnings += [f"{root / name}: {message}" for name, message in notes]
        for p in unknown_fields(raw_manifest, Manifest):
            self.warnings.append(f"{root / 'manifest.json'}: {p}: unknown field (ignored)")
        self.unknown_config = {}
        if has_unknown:  # rare: find and list them all
            raw_index = _index_keys(blobs["index.json"])
            raw_config = raw_index.get("config") if isinstance(raw_index, dict) else None
            known = {f.encode_name for f in msgspec.structs.fields(RecomputeConfig)}
            self.unknown_config = {
                k: v for k, v in (raw_config.items() if isinstance(raw_config, dict) else ()) if k not in known
            }
            for p in unknown_fields(raw_index, BundleIndex):
                knob = p[len("$.config."):] if p.startswith("$.config.") else None
                if knob in self.unknown_config and config_knob_active(self.unknown_config[knob]):
                    continue  # not ignored: a replay refuses it (validate lists it as a refusal)
                self.warnings.append(f"{root / 'index.json'}: {p}: unknown field (ignored)")

        if self.manifest.bundle_id != self.index.bundle_id:
            raise BundleError(
                f"{root / 'index.json'}: $.bundle_id: {self.index.bundle_id!r} does not match "
                f"manifest.json $.bundle_id {self.manifest.bundle_id!r}"
            )
        terms_error = loss_terms_length_error(self.expected, len(self.index.samples))
        if terms_error is not None:
            raise BundleError(f"{root / 'expected.json'}: {terms_error}")
        extension = raw_manifest.get("extension_stage_contracts")
        for stage, contract in self.manifest.stage_contracts.items():
            if contract.stage != stage:
                # the decoded map holds both placements (schema.Manifest): name the one the key came from
                section = ("extension_stage_contracts" if isinstance(extension, dict) and stage.value in extension
                           else "stage_contracts")
                raise BundleError(
                    f"{root / 'manifest.json'}: $.{section}.{stage.value}.stage: "
                    f"{contract.stage.value!r} does not match its key"
                )
        ident = self.index.identity
        if (ident.actor_step_id is None) == (ident.rollout_id is None):
            raise BundleError(
                f"{root / 'index.json'}: $.identity: a bundle is anchored by exactly one of "
                f"actor_step_id (step-level) or rollout_id (rollout-level)"
            )
        if shard.actor_step_id != ident.actor_step_id or shard.rollout_id != ident.rollout_id:
            raise BundleError(f"{root / sentinel_name}: identity anchor does not match index.json $.identity")
        # the records' ids, in index order: checked for repeats here, read by every replay context and view
        self.sample_ids = ids = [s.sample_id for s in self.index.samples]
        if len(set(ids)) != len(ids):  # find and name the first repeat
            seen: dict[str, int] = {}
            for i, sample_id in enumerate(ids):
                if sample_id in seen:
                    raise BundleError(
                        f"{root / 'index.json'}: $.samples[{i}].sample_id: duplicate sample id "
                        f"{sample_id!r} (first at $.samples[{seen[sample_id]}])"
                    )
                seen[sample_id] = i
        for rule_field, rule in self.manifest.redaction.items():
            try:
                RedactionPolicy({rule_field: rule})
            except ValueError as exc:
                raise BundleError(f"{root / 'manifest.json'}: $.redaction.{rule_field}: {exc}") from None
        self._verify_payloads(shard, sentinel_name, digests)
        self._read_masks()

    @staticmethod
    def _raw(path: Path, blob: bytes):
        check_json_depth(path, blob)
        try:
            return msgspec.json.decode(blob)
        except msgspec.DecodeError as exc:
            raise BundleError(f"{path}: invalid JSON: {exc}") from None
        except UnicodeDecodeError as exc:
            raise BundleError(f"{path}: not valid UTF-8 (byte {exc.start})") from None

    @staticmethod
    def _accept_early_writer(complete_path: Path, manifest_attempt) -> None:
        """A COMPLETE without the JSON files' checksums is what the original's early writer (93902db)
        published. It is accepted only where that writer could have written it: in a bundle directory
        (not a cohort's, with ``$.shards``: refused above) whose manifest says format 1.0.0. Every writer
        of a later format (ours) records the checksums, so deleting the key from one of our bundles does
        not dodge the check: it is refused here. Relabelling such a bundle 1.0.0 as well opens it, but
        never silently — the warning says the JSON files were not verified (a checksum guards against
        damage, not against someone who rewrites the files: they could recompute it as easily). The
        payloads are still verified against both the manifest and every COMPLETE.<r>, and so are the
        JSON files against any COMPLETE.<r> that records their checksums."""
        raw = _settle(manifest_attempt)
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if version != "1.0.0":
            raise BundleError(
                f"{complete_path}: $.metadata: missing (a bundle of format {version!r} records the JSON files' "
                f"checksums there; only an early 1.0.0 writer omitted them)"
            )

    @staticmethod
    def _check_ranks(complete_path: Path, ranks: list[int], decoded_index) -> None:
        """COMPLETE's ``$.ranks`` names each producer once, and no more producers than the world sizes in
        index.json (dp·tp·pp·cp) hold: a list of a million ranks is refused before a sentinel is read for
        each. (An index.json that did not decode is reported in its place; only the count waits for it.)"""
        if len(set(ranks)) != len(ranks):
            seen: dict[int, int] = {}
            for i, r in enumerate(ranks):
                if r in seen:
                    raise BundleError(f"{complete_path}: $.ranks[{i}]: duplicate rank {r} (first at $.ranks[{seen[r]}])")
                seen[r] = i
        if decoded_index is not None:
            sizes = decoded_index[0].identity.rank
            world = math.prod(sizes[axis] for axis in RANK_AXES)
            if len(ranks) > world:
                raise BundleError(
                    f"{complete_path}: $.ranks: {len(ranks)} ranks, more than the {world} producer(s) that "
                    f"index.json $.identity.rank allows (dp·tp·pp·cp = "
                    f"{'·'.join(str(sizes[axis]) for axis in RANK_AXES)})"
                )

    @staticmethod
    def _check_metadata(sentinel: Path, recorded: dict[str, str], actual: dict[str, str]) -> None:
        for name in METADATA_FILES:
            if name not in recorded:
                raise BundleError(f"{sentinel}: $.metadata: no checksum for {name}")
            if recorded[name] != actual[name]:
                raise BundleError(
                    f"{sentinel.parent / name if sentinel.parent.exists() else name}: sha256 mismatch "
                    f"({sentinel.name} {recorded[name][:12]}…, file {actual[name][:12]}…)"
                )

    def _verify_payloads(self, shard: RankComplete, sentinel_name: str, digests: _Digests) -> None:
        root = self.path
        real_root = os.path.realpath(root)
        payload_dir = root / PAYLOAD_DIR
        if payload_dir.is_symlink():
            raise BundleError(f"{payload_dir}: payload directory must not be a symlink")
        for name in shard.payloads:
            check_payload_name(name, f"{root / sentinel_name}: $.payloads")
            if name not in self.manifest.payloads:
                raise BundleError(f"{root / sentinel_name}: $.payloads.{name}: not listed in manifest.json $.payloads")
        for key, spec in self.manifest.payloads.items():
            where = f"{root / 'manifest.json'}: $.payloads.{key}"
            check_payload_name(key, where)
            check_payload_name(spec.name, f"{where}.name")
            if spec.name != key:
                raise BundleError(f"{where}.name: {spec.name!r} does not match its key")
            file = packed.payload_file(payload_dir, key, self.manifest.format_version)
            size = _payload_size(file, key, real_root)
            if size != spec.bytes:
                raise BundleError(f"{file}: size {size} bytes, manifest says {spec.bytes} (truncated or altered)")
            if key not in shard.payloads:
                raise BundleError(f"{root / sentinel_name}: $.payloads: no checksum for payload {key!r}")
            chunk_error = chunks.structure_error(spec)
            if chunk_error is not None:
                raise BundleError(f"{root / 'manifest.json'}: {chunk_error}")
            if self._defer_payloads and self._defer_payload(file, key, spec, shard.payloads[key], sentinel_name):
                continue  # its header chunk verified and the tensor mapped: its other chunks are verified when read
            # Loaded while the thread still hashes it (weights_only, within the declared size: no less safe
            # before the checksum than after, a checksum is no signature); the checksum is judged first all
            # the same, so an altered file reports its sha256 mismatch whatever its content does to the load.
            early = self._loaded.pop(file, None)
            if early is not None and early[0] == spec:
                tensor, unloadable = early[1]
                digest = early[2]
            else:
                tensor, unloadable = _attempt(lambda: _load_tensor(file, spec))
                digest = None
            # defer_checksums: a safetensors payload still being hashed is checked now, its checksum judged by
            # confirm() (or, when a check below or later fails, by _verify ahead of that failure)
            if (digest is None and self._defer_checksums and not self._verify_chunks
                    and file.name.endswith(packed.SAFETENSORS_SUFFIX)
                    and not digests.hashed(file)):
                self._pending.append((file, spec.sha256, shard.payloads[key], sentinel_name))
            else:
                self._judge_pending()  # the eager order: every checksum before this one's
                digest = digest if digest is not None else digests.file(file)
                if digest != spec.sha256 or digest != shard.payloads[key]:
                    raise _checksum_mismatch(file, spec.sha256, shard.payloads[key], sentinel_name, digest)
                if self._verify_chunks and spec.chunks is not msgspec.UNSET:
                    self._check_chunk_list(file, spec, shard.payloads[key], sentinel_name,
                                           self._parts_ahead.pop(file, None) or digests.parts(file))
            if unloadable is not None:
                raise unloadable
            if str(tensor.dtype) != spec.dtype:
                raise BundleError(f"{file}: dtype {tensor.dtype}, manifest $.payloads.{key}.dtype says {spec.dtype}")
            if list(tensor.shape) != list(spec.shape):
                raise BundleError(
                    f"{file}: shape {list(tensor.shape)}, manifest $.payloads.{key}.shape says {list(spec.shape)}"
                )
            _check_form(file, key, tensor)
            # a float8 payload: its float32 copy (exact), which torch computes with and which keeps the stored dtype
            from .dtypes import upcast_stored

            self._tensors[key] = upcast_stored(tensor)
        try:
            entries = sorted(payload_dir.iterdir()) if payload_dir.is_dir() else []
        except OSError as exc:  # searchable, not listable: every listed payload was read all the same
            entries = []
            self.warnings.append(f"{payload_dir}: cannot list the directory ({exc.strerror or exc}): files not listed "
                                 f"in manifest.json were not looked for")
        for entry in entries:
            stem = packed.payload_stem(entry.name)
            if stem not in self.manifest.payloads or entry != packed.payload_file(
                    payload_dir, stem, self.manifest.format_version):
                self.warnings.append(f"{entry}: file not listed in manifest.json (ignored)")

    @staticmethod
    def _check_chunk_list(file: Path, spec, sentinel_sha256: str, sentinel_name: str,
                          parts: Optional[list[str]]) -> None:
        """``verify_chunks``: the payload's chunk list against its chunks' digests (hashed with the whole file, or
        here when they were not: a file the thread did not hash)."""
        guard = chunks.ChunkGuard(file, spec, sentinel_sha256, sentinel_name)
        if parts is None or len(parts) != len(spec.chunks.sha256):
            guard.verify_all()
        else:
            guard.check_digests(parts)

    def _read_masks(self) -> None:
        """The samples' masks (packed.py): from the verified payload ``loss_mask`` of a 1.3 bundle that has one,
        else from index.json, where every sample must then have one."""
        root = self.path
        samples = self.index.samples
        mask = self._tensors.pop(packed.MASK_PAYLOAD, None) if self.packed else None
        inline = [i for i, s in enumerate(samples) if s.loss_mask is not msgspec.UNSET]
        if mask is None:
            if len(inline) != len(samples):
                i = next(i for i, s in enumerate(samples) if s.loss_mask is msgspec.UNSET)
                where = (f"neither in index.json nor in the payload {packed.MASK_PAYLOAD!r}" if self.packed
                         else f"required in format {self.manifest.format_version}")
                raise BundleError(f"{root / 'index.json'}: $.samples[{i}].loss_mask: missing ({where})")
            return
        file = packed.payload_file(root / PAYLOAD_DIR, packed.MASK_PAYLOAD, self.manifest.format_version)
        if inline:
            raise BundleError(f"{root / 'index.json'}: $.samples[{inline[0]}].loss_mask: the masks are in the "
                              f"payload {file.name}; index.json must not hold them too")
        if mask.dim() != 1 or not _is_integer(mask.dtype):
            raise BundleError(f"{file}: manifest $.payloads.{packed.MASK_PAYLOAD}: {mask.dtype} "
                              f"{list(mask.shape)}, expected a 1-D integer tensor [{TOKENS}]")
        lengths = [s.response_length for s in samples]
        if any(n < 0 for n in lengths) or sum(lengths) != mask.shape[0]:
            raise BundleError(f"{file}: {mask.shape[0]} tokens, Σ response_length in index.json is {sum(lengths)}")
        # kept packed: the records' loss_mask stays unset (a list of every token's int is 8 bytes a token, more
        # than the float32 payloads' 4); sample_mask() lists one sample's, index_with_masks() every sample's
        self._mask = mask
        self._mask_starts = [0] * len(lengths)
        start = 0
        for i, n in enumerate(lengths):
            self._mask_starts[i] = start
            start += n

    # -- access ------------------------------------------------------------------------------------
    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id

    @property
    def packed_mask(self) -> Optional[torch.Tensor]:
        """Every sample's loss mask on the flat token axis (1-D integer, index order: the verified payload
        ``loss_mask`` of format 1.3), ``None`` when the masks are the records' lists in index.json. Where it is set,
        each record's ``loss_mask`` is unset: :meth:`sample_mask` reads one sample's."""
        self._verified_whole(packed.MASK_PAYLOAD)  # a deferred open: the whole file verified first
        return self._mask

    def sample_mask(self, i: int) -> list[int]:
        """Sample ``i``'s loss mask as a list (its record's, or its slice of :attr:`packed_mask`)."""
        sample = self.index.samples[i]
        if self._mask is None or sample.loss_mask is not msgspec.UNSET:
            return sample.loss_mask
        start = self._mask_starts[i]
        guard = self._guards.get(packed.MASK_PAYLOAD)
        if guard is not None:  # a deferred open: the chunks of this sample's rows verified first
            guard.rows([start], [start + sample.response_length])
        return self._mask[start:start + sample.response_length].tolist()

    def mask_length(self, i: int) -> int:
        """How many values sample ``i``'s loss mask holds (a packed mask: its ``response_length``, checked)."""
        sample = self.index.samples[i]
        if self._mask is None or sample.loss_mask is not msgspec.UNSET:
            return len(sample.loss_mask)
        return sample.response_length

    def index_with_masks(self) -> BundleIndex:
        """:attr:`index` with every record's ``loss_mask`` listed (what a writer takes), a packed mask unpacked."""
        if self._mask is None:
            return self.index
        lengths = [s.response_length for s in self.index.samples]
        return msgspec.structs.replace(self.index, samples=[
            msgspec.structs.replace(s, loss_mask=values)
            for s, values in zip(self.index.samples, packed.unpack_masks(self.packed_mask, lengths))])

    def has_payload(self, name: str) -> bool:
        return name in self._tensors

    def payload_label(self, name: str) -> str:
        """``payloads/<name>`` with the file suffix of this bundle's format (``.safetensors`` in format 1.3, ``.pt``
        before): how a requirement names a payload the bundle lacks."""
        return f"{PAYLOAD_DIR}/{name}{packed.payload_suffix(self.manifest.format_version)}"

    def payload(self, name: str) -> torch.Tensor:
        """The verified, memory-mapped tensor (pages are read only when a stage touches them)."""
        self._verified_whole(name)  # a deferred open: the whole file verified first
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"payload {name!r} not in bundle {self.bundle_id}") from None

    @property
    def payload_names(self) -> list[str]:
        return sorted(self._tensors)

    def release_pages(self, lo: int = 0, hi: Optional[int] = None) -> None:
        """Drop the resident pages of token rows ``[lo, hi)`` (all by default) of every memory-mapped safetensors
        payload (``safetensors_io.release``): they are read again from the page cache where touched. A replay streams
        through the payloads a chunk at a time, so its peak memory holds what one chunk reads, not every payload."""
        from . import safetensors_io

        for tensor in (*self._tensors.values(), *([self._mask] if self._mask is not None else [])):
            safetensors_io.release(tensor, lo, hi)

    # -- deferred payloads (a selected replay: bundle.chunks) -------------------------------------------
    def _defer_payload(self, file: Path, key: str, spec: PayloadSpec, sentinel_sha256: str,
                       sentinel_name: str) -> bool:
        """Open payload ``key`` of a deferred open without hashing it whole, where it has a chunk list
        (:func:`chunks.deferrable`): its whole-file checksums agree, its header chunk(s) verified, then mapped and
        checked as any payload. ``False``: verified whole by the caller, as without ``defer_payloads``."""
        if not chunks.deferrable(key, spec, file):
            return False
        sentinel = Path(sentinel_name).name
        if spec.sha256 != sentinel_sha256:
            raise BundleError(f"{file}: sha256 mismatch (manifest {spec.sha256[:12]}…, {sentinel} "
                              f"{sentinel_sha256[:12]}…)")
        guard = chunks.ChunkGuard(file, spec, sentinel_sha256, sentinel)
        guard.check_header()
        tensor = _load_tensor(file, spec)
        if str(tensor.dtype) != spec.dtype:
            raise BundleError(f"{file}: dtype {tensor.dtype}, manifest $.payloads.{key}.dtype says {spec.dtype}")
        if list(tensor.shape) != list(spec.shape):
            raise BundleError(
                f"{file}: shape {list(tensor.shape)}, manifest $.payloads.{key}.shape says {list(spec.shape)}")
        _check_form(file, key, tensor)
        guard.layout(tensor)
        self._tensors[key] = tensor
        self._guards[key] = guard
        return True

    @property
    def deferred(self) -> list[str]:
        """The payloads not verified whole yet (a deferred open): each chunk is verified when it is read."""
        return sorted(self._guards)

    def verified_chunks(self) -> dict[str, list[int]]:
        """Of each payload still deferred, the chunks verified so far (what a selected replay has read)."""
        return {name: sorted(guard.verified) for name, guard in sorted(self._guards.items())}

    def _verified_whole(self, name: str) -> None:
        guard = self._guards.get(name)
        if guard is not None:
            guard.whole()
            del self._guards[name]

    def verify_deferred(self) -> None:
        """Verify every payload a deferred open left (its whole sha256, as a full open does): a full replay."""
        for name in sorted(self._guards):
            self._verified_whole(name)

    def _sample_rows(self, indices) -> tuple[list[int], list[int]]:
        """The token rows of samples ``indices`` as ``([starts], [stops])``, adjacent samples merged."""
        lengths = [max(s.response_length, 0) for s in self.index.samples]
        begin = [0] * len(lengths)
        at = 0
        for i, n in enumerate(lengths):
            begin[i] = at
            at += n
        starts: list[int] = []
        stops: list[int] = []
        for i in sorted(set(indices)):
            lo, hi = begin[i], begin[i] + lengths[i]
            if starts and stops[-1] == lo:
                stops[-1] = hi
            else:
                starts.append(lo)
                stops.append(hi)
        return starts, stops

    def verify_samples(self, indices) -> None:
        """Verify, in every deferred payload, the chunks that hold the tokens of samples ``indices`` (a selection,
        before its stages run: an altered chunk is refused before any stage reads it)."""
        if not self._guards:
            return
        starts, stops = self._sample_rows(indices)
        for guard in self._guards.values():
            guard.rows(starts, stops)

    def payload_rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """A copy of the token rows ``index`` (1-D int64) of payload ``name``: of a deferred payload, only once the
        chunks holding them are verified. What a selection's stages read (``StageContext.payload``)."""
        from .dtypes import keep_stored

        try:
            tensor = self._tensors[name]
        except KeyError:
            raise KeyError(f"payload {name!r} not in bundle {self.bundle_id}") from None
        guard = self._guards.get(name)
        if guard is not None:
            guard.rows(*chunks.runs(index))
        return keep_stored(tensor.index_select(0, index), tensor)

    @property
    def has_packed_mask(self) -> bool:
        """Whether the masks are the payload ``loss_mask`` (:attr:`packed_mask`), without reading it."""
        return self._mask is not None

    def mask_rows(self, index: torch.Tensor) -> Optional[torch.Tensor]:
        """A copy of the packed mask's token rows ``index`` (verified chunk by chunk when deferred), ``None`` when
        the masks are the records' lists."""
        if self._mask is None:
            return None
        guard = self._guards.get(packed.MASK_PAYLOAD)
        if guard is not None:
            guard.rows(*chunks.runs(index))
        return self._mask.index_select(0, index)

    def payload_meta(self, name: str) -> torch.Tensor:
        """Payload ``name``'s shape and dtype (and stored dtype) as a tensor without data (device ``meta``): what a
        check of its form needs, with no byte of the file read."""
        from .dtypes import keep_stored

        try:
            tensor = self._tensors[name]
        except KeyError:
            raise KeyError(f"payload {name!r} not in bundle {self.bundle_id}") from None
        return keep_stored(torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"), tensor)
