"""Bundle I/O: the atomic writer, the verifying reader and capture-directory resolution.

Writer protocol (SPEC §2): stage everything in a hidden sibling temp dir, write payloads, hash them, write
the JSON files, write the COMPLETE sentinels, publish with one atomic rename; never overwrite.
Reader protocol: verify *everything* (sentinels, checksums, sizes, ids, version, safety, tensor types)
before returning, so no stage ever runs on a bundle that is not exactly what the producer published.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import msgspec
import torch

from .errors import BundleError, SelectionError
from .layout import _PAYLOAD_NAME, _RANK_DIR, _RANK_SENTINEL, METADATA_FILES, PAYLOAD_DIR, PAYLOAD_SUFFIX  # noqa: F401
from .gcpause import gc_paused
from .schema import (
    BUNDLE_COMPLETE_DECODER,
    EXPECTED_DECODER,
    MANIFEST_DECODER,
    RANK_COMPLETE_DECODER,
    REDACTED_FIELDS,
    SUPPORTED_MAJOR,
    ActorStepId,
    BundleComplete,
    BundleIndex,
    Expected,
    Manifest,
    PayloadSpec,
    RankComplete,
    RecomputeConfig,
    RedactionPolicy,
    decode_index,
    encode_json,
    unknown_fields,
)



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


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
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


# --------------------------------------------------------------------------------------------- writer


class BundleWriter:
    """Writes one bundle (``rank=None``) or one rank shard of a cohort (``rank=r``).

    Single producer: ``BundleWriter(<DIR>/<bundle_id>, …).finalize(ranks=[0])``.
    Cohort: ``BundleWriter(<DIR>/<bundle_id>, …, rank=r).finalize(ranks=[0, 1])`` publishes
    ``rank-r/`` and ``COMPLETE.r`` and then *tries* to finalize the cohort ``COMPLETE``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        manifest: Manifest,
        index: BundleIndex,
        expected: Expected,
        *,
        rank: Optional[int] = None,
    ):
        self.rank = rank
        self.root = Path(path)
        self.final_path = self.root / f"rank-{rank}" if rank is not None else self.root
        if self.final_path.exists() or (rank is None and self.root.is_symlink()):
            raise FileExistsError(f"{self.final_path}: bundle already exists; refusing to overwrite")
        if manifest.bundle_id != index.bundle_id:
            raise ValueError(
                f"bundle_id mismatch: manifest {manifest.bundle_id!r} vs index {index.bundle_id!r}"
            )
        seen: dict[str, int] = {}
        for i, sample in enumerate(index.samples):
            if sample.sample_id in seen:
                raise ValueError(f"$.samples[{i}].sample_id: duplicate sample id {sample.sample_id!r}")
            seen[sample.sample_id] = i
        self.policy = RedactionPolicy(manifest.redaction)
        self.manifest = manifest
        self.index = self._redact(index)
        self.expected = expected
        self.payloads: dict[str, PayloadSpec] = {}
        parent = self.final_path.parent
        parent.mkdir(parents=True, exist_ok=True)
        self.staging = parent / f".{self.final_path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        (self.staging / PAYLOAD_DIR).mkdir(parents=True)
        self._finalized = False

    def _redact(self, index: BundleIndex) -> BundleIndex:
        samples = []
        for sample in index.samples:
            changes = {f: self.policy.apply(f, getattr(sample, f)) for f in REDACTED_FIELDS if hasattr(sample, f)}
            samples.append(msgspec.structs.replace(sample, **changes))
        return msgspec.structs.replace(index, samples=samples)

    def write_payload(self, name: str, tensor: torch.Tensor) -> PayloadSpec:
        check_payload_name(name, "write_payload")
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"payload {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if name in self.payloads:
            raise ValueError(f"payload {name!r} written twice")
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous()
        if type(t) is not torch.Tensor:  # Parameter or another subclass: store a plain tensor
            t = t.as_subclass(torch.Tensor)
        # torch.save stores the whole storage: a view of a bigger tensor must not leak the rest of it.
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
            t = t.clone()
        target = self.staging / PAYLOAD_DIR / f"{name}{PAYLOAD_SUFFIX}"
        torch.save(t, target)
        spec = PayloadSpec(
            name=name,
            dtype=str(t.dtype),
            shape=list(t.shape),
            bytes=target.stat().st_size,
            sha256=sha256_file(target),
        )
        self.payloads[name] = spec
        return spec

    def finalize(self, ranks: Iterable[int] = (0,)) -> Path:
        ranks = sorted(int(r) for r in ranks)
        if self._finalized:
            raise RuntimeError("finalize() called twice")
        try:
            manifest = msgspec.structs.replace(self.manifest, payloads=dict(sorted(self.payloads.items())))
            blobs = {
                "manifest.json": encode_json(manifest),
                "index.json": encode_json(self.index),
                "expected.json": encode_json(self.expected),
            }
            for fname, blob in blobs.items():
                (self.staging / fname).write_bytes(blob)
            metadata = {fname: sha256_bytes(blob) for fname, blob in blobs.items()}
            payload_hashes = {name: spec.sha256 for name, spec in sorted(self.payloads.items())}
            identity = self.index.identity
            if self.rank is None:
                shard = RankComplete(
                    actor_step_id=identity.actor_step_id,
                    rollout_id=identity.rollout_id,
                    payloads=payload_hashes,
                    metadata=metadata,
                )
                for r in ranks:
                    (self.staging / f"COMPLETE.{r}").write_bytes(encode_json(shard))
                (self.staging / "COMPLETE").write_bytes(
                    encode_json(BundleComplete(ranks=ranks, metadata=metadata))
                )
            if self.final_path.exists():
                raise FileExistsError(f"{self.final_path}: bundle already exists; refusing to overwrite")
            _fsync_dir(self.staging)
            os.rename(self.staging, self.final_path)
            _fsync_dir(self.final_path.parent)
        except BaseException:
            shutil.rmtree(self.staging, ignore_errors=True)
            raise
        self._finalized = True
        if self.rank is not None:
            if self.rank not in ranks:
                raise ValueError(f"rank {self.rank} is not among the expected ranks {ranks}")
            shard = RankComplete(
                actor_step_id=identity.actor_step_id,
                rollout_id=identity.rollout_id,
                payloads=payload_hashes,
                metadata=metadata,
                expected_ranks=ranks,
                relpath=f"rank-{self.rank}",
                bundle_id=self.index.bundle_id,
            )
            _atomic_write(self.root / f"COMPLETE.{self.rank}", encode_json(shard))
            try_finalize_cohort(self.root)
        return self.final_path

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def __enter__(self) -> "BundleWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._finalized:
            self.abort()


def try_finalize_cohort(cohort: str | os.PathLike) -> bool:
    """Write the cohort ``COMPLETE`` iff every expected rank has published and their anchors agree.

    Never waits. Two producers racing here are harmless: the sentinel is published with ``os.link``,
    which succeeds for exactly one of them; the other sees ``FileExistsError`` and returns.
    """
    cohort = Path(cohort)
    final = cohort / "COMPLETE"
    if final.exists():
        return True
    shards: dict[int, RankComplete] = {}
    for entry in cohort.iterdir():
        m = _RANK_SENTINEL.match(entry.name)
        if not m:
            continue
        try:
            shards[int(m.group(1))] = RANK_COMPLETE_DECODER.decode(entry.read_bytes())
        except (OSError, msgspec.MsgspecError, UnicodeDecodeError):
            return False
    if not shards:
        return False
    anchors = {shard.anchor() for shard in shards.values()}
    if len(anchors) != 1:
        return False
    expected = sorted(next(iter(shards.values())).expected_ranks or [])
    if not expected or sorted(shards) != expected:
        return False
    if not all((cohort / f"rank-{r}" / "manifest.json").is_file() for r in expected):
        return False
    blob = encode_json(BundleComplete(ranks=expected, shards={str(r): shards[r] for r in expected}))
    tmp = cohort / f".COMPLETE.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    with open(tmp, "wb") as fh:
        fh.write(blob)
        fh.flush()
        os.fsync(fh.fileno())
    try:
        os.link(tmp, final)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(cohort)
    return True


# --------------------------------------------------------------------------------------------- reader


def _read_bytes(path: Path, what: str) -> bytes:
    # A JSON file or sentinel must stay inside its directory and be a regular file: a link to /dev/zero or
    # a FIFO would otherwise hang the reader before any checksum is compared.
    if path.is_symlink() and not os.path.realpath(path).startswith(os.path.realpath(path.parent) + os.sep):
        raise BundleError(f"{path}: symlink leaves the bundle (→ {os.path.realpath(path)})")
    if path.exists() and not path.is_file() and not path.is_dir():
        raise BundleError(f"{path}: {what} is not a regular file")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise BundleError(f"{path}: missing {what}") from None
    except IsADirectoryError:
        raise BundleError(f"{path}: expected a file ({what}), found a directory") from None
    except OSError as exc:
        raise BundleError(f"{path}: cannot read {what}: {exc.strerror}") from None


def _decode(path: Path, data: bytes, decoder):
    """``decoder``: a ``msgspec.json.Decoder`` or a function of the bytes (e.g. ``decode_index``)."""
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
        raise BundleError(f"{path}: invalid JSON: {exc}") from None


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
    if not isinstance(version, str) or not re.match(r"^\d+\.\d+\.\d+$", version):
        raise BundleError(f"{where}: $.format_version: expected 'MAJOR.MINOR.PATCH', got {version!r}")
    major, minor, patch = (int(x) for x in version.split("."))
    if major != SUPPORTED_MAJOR:
        raise BundleError(
            f"{where}: $.format_version: unsupported major version {version!r} "
            f"(this reader reads {SUPPORTED_MAJOR}.x)"
        )
    return major, minor, patch


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

    def __init__(self, blobs: dict[str, bytes], files: list[Path]) -> None:
        self._meta: dict[str, str] = {}
        self._meta_done = threading.Event()
        self._files: dict[Path, str] = {}
        self._file_done = {file: threading.Event() for file in files}
        self._stop = threading.Event()
        # The largest blob first: the thread is inside the hash (GIL released) before the reader
        # starts a decode, which holds the GIL from start to end.
        order = sorted(blobs, key=lambda name: -len(blobs[name]))
        self._thread = threading.Thread(target=self._run, args=([(name, blobs[name]) for name in order], files),
                                        name="bundle-sha256", daemon=True)
        self._thread.start()

    def _run(self, blobs: list[tuple[str, bytes]], files: list[Path]) -> None:
        try:
            for name, blob in blobs:
                self._meta[name] = sha256_bytes(blob)
        except Exception:
            pass  # the reader hashes what is missing
        finally:
            self._meta_done.set()
        try:
            for file in files:
                try:
                    digest = None if self._stop.is_set() else _sha256_regular(file, self._stop)
                    if digest is not None:
                        self._files[file] = digest
                except Exception:
                    pass  # the reader's own checks name the problem
                finally:
                    self._file_done[file].set()
        finally:
            for done in self._file_done.values():  # whatever happened, no reader waits forever
                done.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def metadata(self, blobs: dict[str, bytes]) -> dict[str, str]:
        self._meta_done.wait()
        return {name: self._meta.get(name) or sha256_bytes(blob) for name, blob in blobs.items()}

    def file(self, path: Path) -> str:
        done = self._file_done.get(path)
        if done is not None:
            done.wait()
        digest = self._files.get(path)
        return digest if digest is not None else sha256_file(path)

    @staticmethod
    def payload_files(root: Path, raw_manifest) -> list[Path]:
        """The payload files worth hashing ahead: regular files (never links, FIFOs or devices) named by
        the manifest as decoded (unchecked, ``None`` when it does not decode); anything odd is left to the
        reader's checks."""
        names = raw_manifest.get("payloads") if isinstance(raw_manifest, dict) else None
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
            file = payload_dir / f"{name}{PAYLOAD_SUFFIX}"
            try:
                if stat.S_ISREG(os.lstat(file).st_mode):
                    files.append(file)
            except OSError:
                pass
        return files


def _sha256_regular(path: Path, stop: threading.Event) -> Optional[str]:
    """:func:`sha256_file` of a regular file that is not a link, checked on the open descriptor (a file
    swapped for a FIFO or a link after the directory scan is not read: ``None``)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
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


def _load_tensor(path: Path) -> torch.Tensor:
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc) and "zipfile" not in str(exc).lower():
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError for objects, RuntimeError for corrupt archives
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # torch's first line is generic advice (incl. "retry with weights_only=False"); name the blocked global.
        first = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else type(exc).__name__)
        raise BundleError(f"{path}: not a loadable weights-only tensor file ({first[:160]})") from None
    if type(obj) is not torch.Tensor:
        raise BundleError(f"{path}: payload must be a plain torch.Tensor, got {type(obj).__module__}.{type(obj).__qualname__}")
    if obj.layout != torch.strided:
        raise BundleError(f"{path}: payload must be a dense (strided) tensor, got layout {obj.layout}")
    return obj


class BundleReader:
    """A verified bundle (or one verified rank shard of a cohort); ``open_bundle`` resolves cohorts too."""

    manifest: Manifest
    index: BundleIndex
    expected: Expected

    def __init__(self, path: str | os.PathLike, *, _shard: Optional[RankComplete] = None, _rank: Optional[int] = None):
        """Open and verify a single bundle directory. A rank-local path requires its cohort's COMPLETE."""
        path = Path(path)
        if _shard is None:
            resolved = resolve_bundle(path)
            if resolved.kind != "bundle":
                raise BundleError(f"{path}: is a {resolved.kind}, not a single bundle; use open_bundle()")
            if resolved.shard is not None:
                _shard, _rank = resolved.shard, resolved.rank
        self.path = path
        self.rank = _rank
        self.warnings = []
        self._tensors = {}
        self._verify(_shard)

    # -- verification ------------------------------------------------------------------------------
    def _verify(self, shard: Optional[RankComplete]) -> None:
        root = self.path
        blobs = {name: _read_bytes(root / name, name) for name in METADATA_FILES}
        # decoded once: its payload names start the hashing; its error, if any, is raised in its place
        manifest_attempt = _attempt(lambda: self._raw(root / "manifest.json", blobs["manifest.json"]))
        digests = _Digests(blobs, _Digests.payload_files(root, manifest_attempt[0]))
        try:
            self._check(shard, blobs, digests, manifest_attempt)
        finally:
            digests.close()  # a bundle refused early leaves no hashing behind

    def _check(self, shard: Optional[RankComplete], blobs: dict[str, bytes], digests: _Digests,
               manifest_attempt) -> None:
        root = self.path
        # Decoded while the thread hashes; a decode error is raised where it always was (after the
        # checksum checks), so a bundle altered on disk still reports its sha256 mismatch first.
        index_attempt = _attempt(lambda: _decode(root / "index.json", blobs["index.json"], decode_index))
        expected_attempt = _attempt(lambda: _decode(root / "expected.json", blobs["expected.json"], EXPECTED_DECODER))
        actual_meta = digests.metadata(blobs)
        if shard is None:
            complete_path = root / "COMPLETE"
            if not complete_path.exists():
                raise BundleError(f"{complete_path}: missing COMPLETE sentinel (bundle incomplete or still being written)")
            complete: BundleComplete = _decode(complete_path, _read_bytes(complete_path, "COMPLETE"), BUNDLE_COMPLETE_DECODER)
            if complete.metadata is None:
                raise BundleError(f"{complete_path}: $.metadata: missing (a cohort COMPLETE was found in a bundle directory)")
            self._check_metadata(complete_path, complete.metadata, actual_meta)
            shards = {}
            for r in complete.ranks:
                spath = root / f"COMPLETE.{r}"
                if not spath.exists():
                    raise BundleError(f"{spath}: missing rank sentinel listed in COMPLETE $.ranks")
                shards[r] = _decode(spath, _read_bytes(spath, f"COMPLETE.{r}"), RANK_COMPLETE_DECODER)
                self._check_metadata(spath, shards[r].metadata, actual_meta)
            if not shards:
                raise BundleError(f"{complete_path}: $.ranks: expected at least one rank")
            shard = shards[min(shards)]
            sentinel_name = f"COMPLETE.{min(shards)}"
        else:
            sentinel_name = f"../COMPLETE (shard {self.rank})"
            self._check_metadata(root.parent / "COMPLETE", shard.metadata, actual_meta)

        raw_manifest = _settle(manifest_attempt)
        if not isinstance(raw_manifest, dict):
            raise BundleError(f"{root / 'manifest.json'}: $: expected an object")
        parse_format_version(raw_manifest.get("format_version"), str(root / "manifest.json"))
        self.manifest = _decode(root / "manifest.json", blobs["manifest.json"], MANIFEST_DECODER)
        self.index, has_unknown = _settle(index_attempt)
        self.expected = _settle(expected_attempt)
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
        for stage, contract in self.manifest.stage_contracts.items():
            if contract.stage != stage:
                raise BundleError(
                    f"{root / 'manifest.json'}: $.stage_contracts.{stage.value}.stage: "
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
        ids = [s.sample_id for s in self.index.samples]
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

    @staticmethod
    def _raw(path: Path, blob: bytes):
        try:
            return msgspec.json.decode(blob)
        except msgspec.DecodeError as exc:
            raise BundleError(f"{path}: invalid JSON: {exc}") from None
        except UnicodeDecodeError as exc:
            raise BundleError(f"{path}: not valid UTF-8 (byte {exc.start})") from None

    @staticmethod
    def _check_metadata(sentinel: Path, recorded: dict[str, str], actual: dict[str, str]) -> None:
        for name in METADATA_FILES:
            if name not in recorded:
                raise BundleError(f"{sentinel}: $.metadata: no checksum for {name}")
            if recorded[name] != actual[name]:
                raise BundleError(
                    f"{sentinel.parent / name if sentinel.parent.exists() else name}: sha256 mismatch "
                    f"(sentinel {recorded[name][:12]}…, file {actual[name][:12]}…)"
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
            file = payload_dir / f"{key}{PAYLOAD_SUFFIX}"
            if file.is_symlink() and not os.path.realpath(file).startswith(real_root + os.sep):
                raise BundleError(f"{file}: symlink leaves the bundle (→ {os.path.realpath(file)})")
            if not file.exists():
                raise BundleError(f"{file}: missing payload listed in manifest.json $.payloads.{key}")
            if not file.is_file():
                raise BundleError(f"{file}: payload is not a regular file")
            size = file.stat().st_size
            if size != spec.bytes:
                raise BundleError(f"{file}: size {size} bytes, manifest says {spec.bytes} (truncated or altered)")
            if key not in shard.payloads:
                raise BundleError(f"{root / sentinel_name}: $.payloads: no checksum for payload {key!r}")
            digest = digests.file(file)
            if digest != spec.sha256 or digest != shard.payloads[key]:
                raise BundleError(
                    f"{file}: sha256 mismatch (manifest {spec.sha256[:12]}…, sentinel "
                    f"{shard.payloads[key][:12]}…, file {digest[:12]}…)"
                )
            tensor = _load_tensor(file)
            if str(tensor.dtype) != spec.dtype:
                raise BundleError(f"{file}: dtype {tensor.dtype}, manifest $.payloads.{key}.dtype says {spec.dtype}")
            if list(tensor.shape) != list(spec.shape):
                raise BundleError(
                    f"{file}: shape {list(tensor.shape)}, manifest $.payloads.{key}.shape says {list(spec.shape)}"
                )
            self._tensors[key] = tensor
        if payload_dir.is_dir():
            for entry in sorted(payload_dir.iterdir()):
                stem = entry.name[: -len(PAYLOAD_SUFFIX)] if entry.name.endswith(PAYLOAD_SUFFIX) else None
                if stem not in self.manifest.payloads:
                    self.warnings.append(f"{entry}: file not listed in manifest.json (ignored)")

    # -- access ------------------------------------------------------------------------------------
    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id

    def has_payload(self, name: str) -> bool:
        return name in self._tensors

    def payload(self, name: str) -> torch.Tensor:
        """The verified, memory-mapped tensor (pages are read only when a stage touches them)."""
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"payload {name!r} not in bundle {self.bundle_id}") from None

    @property
    def payload_names(self) -> list[str]:
        return sorted(self._tensors)


# ---------------------------------------------------------------------------------- resolution


@dataclass
class Resolved:
    """What a path on disk is: one ``bundle`` (maybe a rank shard of a finished cohort) or a ``cohort``."""

    kind: str
    path: Path
    rank: Optional[int] = None
    shard: Optional[RankComplete] = None


def _is_hidden(p: Path) -> bool:
    return p.name.startswith(".")


def _looks_like_cohort(path: Path) -> bool:
    try:
        names = [e.name for e in path.iterdir()]
    except OSError:
        return False
    return any(_RANK_DIR.match(n) for n in names) or any(_RANK_SENTINEL.match(n) for n in names)


def _cohort_complete(cohort: Path) -> BundleComplete:
    final = cohort / "COMPLETE"
    if not final.exists():
        present = sorted(e.name for e in cohort.iterdir() if _RANK_SENTINEL.match(e.name))
        raise BundleError(
            f"{final}: cohort has no final COMPLETE (ranks published: {', '.join(present) or 'none'}); "
            f"a rank-local bundle is refused until every expected rank has flushed"
        )
    complete = _decode(final, _read_bytes(final, "cohort COMPLETE"), BUNDLE_COMPLETE_DECODER)
    if complete.shards is None:
        raise BundleError(f"{final}: $.shards: missing (expected a cohort COMPLETE)")
    if sorted(int(k) for k in complete.shards) != sorted(complete.ranks):
        raise BundleError(f"{final}: $.shards: keys do not match $.ranks {complete.ranks}")
    return complete


def resolve_bundle(path: Path) -> Resolved:
    """Classify ``path`` without selecting among several bundles (see :func:`resolve_capture`)."""
    if not path.exists():
        raise BundleError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise BundleError(f"{path}: not a bundle directory")
    if (path / "manifest.json").exists() or (path / "COMPLETE").is_file() and not _looks_like_cohort(path):
        m = _RANK_DIR.match(path.name)
        if m and _looks_like_cohort(path.parent):
            rank = int(m.group(1))
            complete = _cohort_complete(path.parent)
            shard = complete.shards.get(str(rank))
            if shard is None:
                raise BundleError(f"{path.parent / 'COMPLETE'}: $.shards: rank {rank} is not part of this cohort")
            return Resolved("bundle", path, rank=rank, shard=shard)
        return Resolved("bundle", path)
    if _looks_like_cohort(path):
        return Resolved("cohort", path)
    entries = [e for e in path.iterdir() if not _is_hidden(e)]
    if not entries:
        raise BundleError(f"{path}: empty directory (no manifest.json, no COMPLETE, no bundles)")
    return Resolved("capture", path)


def _anchor_of(path: Path) -> tuple[Optional[ActorStepId], Optional[int]]:
    """Read the identity anchor from a (possibly unverified) bundle or cohort, for selection only."""
    index_path = path / "index.json"
    if not index_path.exists():
        ranks = sorted((e for e in path.iterdir() if _RANK_DIR.match(e.name)), key=lambda e: e.name)
        if not ranks:
            return None, None
        index_path = ranks[0] / "index.json"
    try:
        raw = msgspec.json.decode(index_path.read_bytes())
        ident = raw.get("identity") or {}
        step = ident.get("actor_step_id")
        return (ActorStepId(**step) if step else None), ident.get("rollout_id")
    except Exception:
        return None, None


def _describe(anchor: tuple[Optional[ActorStepId], Optional[int]]) -> str:
    step, rollout = anchor
    if step is not None:
        return f"step {step}"
    if rollout is not None:
        return f"rollout {rollout}"
    return "unreadable identity"


def _matches(anchor, step: Optional[ActorStepId], rollout: Optional[int]) -> bool:
    a_step, a_rollout = anchor
    if step is not None:
        return a_step == step
    if rollout is not None:
        return a_step is None and a_rollout == rollout
    return True


def resolve_capture(path: Path, step: Optional[ActorStepId] = None, rollout: Optional[int] = None) -> Resolved:
    """Resolve a bundle, cohort or capture directory to exactly one bundle or cohort (fails when ambiguous)."""
    if step is not None and rollout is not None:
        raise SelectionError("--step and --rollout are mutually exclusive")
    resolved = resolve_bundle(path)
    if resolved.kind != "capture":
        return resolved
    candidates = []
    for entry in sorted(path.iterdir()):
        if _is_hidden(entry) or not entry.is_dir():
            continue
        if (entry / "manifest.json").exists() or _looks_like_cohort(entry):
            candidates.append((entry, _anchor_of(entry)))
    if not candidates:
        raise BundleError(f"{path}: no bundle found (no manifest.json, no COMPLETE, no bundle subdirectories)")
    def listing(found) -> str:
        return "; ".join(f"{c.name} ({_describe(a)})" for c, a in found)

    matching = [(c, a) for c, a in candidates if _matches(a, step, rollout)]
    if len(matching) == 1:
        return resolve_bundle(matching[0][0])
    want = f"--step {step}" if step is not None else f"--rollout {rollout}"
    if not matching:
        raise SelectionError(f"{path}: no bundle matches {want}; candidates: {listing(candidates)}")
    if step is None and rollout is None:
        # an anchor settles it only when no two candidates share one
        anchors = [a for _, a in candidates]
        hint = ("pass --step R:S or --rollout R" if len(set(anchors)) == len(anchors)
                else "pass --step R:S or --rollout R, or one bundle's own path")
    else:
        hint = f"all match {want}; pass one bundle's own path"
    raise SelectionError(f"{path}: ambiguous capture directory with {len(matching)} bundles ({hint}); "
                         f"candidates: {listing(matching)}")


@dataclass
class BundleSet:
    """One bundle, or every rank shard of a cohort, verified. Stages run per shard."""

    path: Path
    shards: list[BundleReader]
    cohort: bool

    @property
    def bundle_id(self) -> str:
        return self.shards[0].bundle_id

    @property
    def warnings(self) -> list[str]:
        return [w for s in self.shards for w in s.warnings]


def open_bundle(
    path: str | os.PathLike, step: Optional[ActorStepId] = None, rollout: Optional[int] = None
) -> BundleSet:
    """Resolve and verify a bundle, a cohort or a capture directory; anchors are checked exactly."""
    with gc_paused():
        return _open_bundle(Path(path), step, rollout)


def _open_bundle(path: Path, step: Optional[ActorStepId], rollout: Optional[int]) -> BundleSet:
    resolved = resolve_capture(path, step, rollout)
    if resolved.kind == "bundle":
        shards = [BundleReader(resolved.path, _shard=resolved.shard, _rank=resolved.rank)]
        cohort = False
    else:
        complete = _cohort_complete(resolved.path)
        shards = []
        for r in sorted(complete.ranks):
            shard_dir = resolved.path / f"rank-{r}"
            if not (shard_dir / "manifest.json").exists():
                raise BundleError(f"{shard_dir}: missing rank shard listed in cohort COMPLETE $.ranks")
            shards.append(BundleReader(shard_dir, _shard=complete.shards[str(r)], _rank=r))
        ids = {s.bundle_id for s in shards}
        if len(ids) != 1:
            raise BundleError(f"{resolved.path}: rank shards disagree on bundle_id: {sorted(ids)}")
        cohort = True
    first = shards[0].index.identity
    for s in shards[1:]:
        if (s.index.identity.actor_step_id, s.index.identity.rollout_id) != (first.actor_step_id, first.rollout_id):
            raise BundleError(f"{s.path / 'index.json'}: $.identity: anchor differs from rank {shards[0].rank}")
    check_anchor(resolved.path, first.actor_step_id, first.rollout_id, step, rollout)
    return BundleSet(path=resolved.path, shards=shards, cohort=cohort)


def check_anchor(path, actual_step, actual_rollout, step, rollout) -> None:
    if step is not None:
        if actual_step is None:
            raise SelectionError(
                f"{path}: --step {step} given but the bundle is rollout-level (rollout_id={actual_rollout}); use --rollout"
            )
        if actual_step != step:
            raise SelectionError(f"{path}: --step {step} does not match the bundle's actor_step_id {actual_step}")
    if rollout is not None:
        if actual_step is not None:
            raise SelectionError(
                f"{path}: --rollout {rollout} given but the bundle is step-level (actor_step_id={actual_step}); use --step"
            )
        if actual_rollout != rollout:
            raise SelectionError(f"{path}: --rollout {rollout} does not match the bundle's rollout_id {actual_rollout}")
