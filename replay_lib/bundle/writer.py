"""The atomic bundle writer and the cohort finalizer (SPEC §2).

Stage everything in a hidden sibling temp dir, write payloads, hash them, write the JSON files, write the
COMPLETE sentinels, publish with one atomic rename; never overwrite. What is written reads in the original
tool's format-1.0.0 reader too (SPEC §2.1): every contract in a place it can parse, and each rank shard of
a cohort a bundle directory of its own.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable, Optional

import msgspec
import torch

from .layout import _RANK_SENTINEL, PAYLOAD_DIR, PAYLOAD_SUFFIX, staging_name
from .schema import (
    ORIGINAL_RECOMPUTED_STAGE_IDS,
    ORIGINAL_STAGE_IDS,
    RANK_COMPLETE_DECODER,
    REDACTED_FIELDS,
    BundleComplete,
    BundleIndex,
    Expected,
    Manifest,
    PayloadChunks,
    PayloadSpec,
    RankComplete,
    RedactionPolicy,
    StageCapability,
    StageContract,
    StageId,
    encode_json,
    encode_json_literals,
    expected_float_paths,
    format_major,
    index_float_paths,
    FORMAT_2_VERSION,
    PER_TOKEN_REWARD_VERSION,
)
from . import chunks, packed, safetensors_io
from .files import _atomic_write, _fsync_dir, check_payload_name, sha256_bytes, sha256_file


class BundleWriter:
    """Writes one bundle (``rank=None``) or one rank shard of a cohort (``rank=r``).

    Single producer: ``BundleWriter(<DIR>/<bundle_id>, …).finalize(ranks=[0])``.
    Cohort: ``BundleWriter(<DIR>/<bundle_id>, …, rank=r).finalize(ranks=[0, 1])`` publishes
    ``rank-r/`` and ``COMPLETE.r`` and then *tries* to finalize the cohort ``COMPLETE``. ``rank-r/``
    carries its own ``COMPLETE`` and ``COMPLETE.r`` as a single bundle does, because the original's reader
    opens each rank shard as a bundle directory; ours takes a shard's checksums from the cohort ``COMPLETE``
    only, so a rank-local path stays refused until the cohort is final.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        manifest: Manifest,
        index: BundleIndex,
        expected: Expected,
        *,
        rank: Optional[int] = None,
        format_version: Optional[str] = None,
        redacted: bool = False,
    ):
        """``format_version``: ``"2.0.0"`` writes the original's format 2.0 (the manifest's version otherwise; a
        1.x bundle that holds a per-token reward is written as 1.2.0, the minor that added it). A 2.0 bundle
        cannot hold the reward stages, raw rewards or normalization cohort ids: asked to, it raises
        ``ValueError`` naming them (``replay_lib.bundle.convert`` drops them and says so). ``redacted``: the
        index's text fields already went through ``manifest.redaction`` (a published bundle rewritten: ``convert``)
        and are written as they are, not redacted again (a ``hash`` rule would hash the hash)."""
        from . import format2

        version = format_version or manifest.format_version
        major = format_major(version)
        if major == 2:
            refused = format2.refused_in_2(manifest, index, expected)
            if refused:
                raise ValueError("format 2.0 cannot hold: " + "; ".join(refused))
            version = FORMAT_2_VERSION if format_version else version
        elif major == 1 and format2.has_per_token_reward(index) and _older(version, PER_TOKEN_REWARD_VERSION):
            version = PER_TOKEN_REWARD_VERSION
        elif major != 1:
            raise ValueError(f"format_version {version!r}: this writer writes 1.x and 2.0.0")
        if version != manifest.format_version:
            manifest = msgspec.structs.replace(manifest, format_version=version)
        self.major = major
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
        self.index = index if redacted else self._redact(index)
        self.expected = expected
        self.payloads: dict[str, PayloadSpec] = {}
        # format 1.3 (packed.py): the masks go to the payload ``loss_mask``, every payload to a safetensors file
        self.packed = packed.is_packed(manifest.format_version)
        for i, sample in enumerate(index.samples):
            if sample.loss_mask is msgspec.UNSET:  # the record leaves it unset only in 1.3's index.json
                raise ValueError(f"$.samples[{i}].loss_mask: missing (every sample needs one)")
        parent = self.final_path.parent
        parent.mkdir(parents=True, exist_ok=True)
        self.staging = parent / staging_name(self.final_path.name)
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
        if self.packed and name == packed.MASK_PAYLOAD:
            raise ValueError(f"payload {name!r}: format {self.manifest.format_version} writes the samples' "
                             f"loss_mask there itself")
        return self._write(name, tensor)

    def _write(self, name: str, tensor: torch.Tensor) -> PayloadSpec:
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous()
        if type(t) is not torch.Tensor:  # Parameter or another subclass: store a plain tensor
            t = t.as_subclass(torch.Tensor)
        # torch.save stores the whole storage: a view of a bigger tensor must not leak the rest of it.
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
            t = t.clone()
        extra = {}
        if self.packed:
            target = self.staging / PAYLOAD_DIR / f"{name}{safetensors_io.SUFFIX}"
            safetensors_io.write(target, t)
            # the whole file's sha256 and each chunk's, in one read (a selected replay verifies what it reads)
            digest, sums = chunks.hash_file(target, chunks.CHUNK_BYTES)
            extra["chunks"] = PayloadChunks(bytes=chunks.CHUNK_BYTES, sha256=sums)
        else:
            target = self.staging / PAYLOAD_DIR / f"{name}{PAYLOAD_SUFFIX}"
            torch.save(t, target)
            digest = sha256_file(target)
        spec = PayloadSpec(
            name=name,
            dtype=str(t.dtype),
            shape=list(t.shape),
            bytes=target.stat().st_size,
            sha256=digest,
            **extra,
        )
        self.payloads[name] = spec
        return spec

    def finalize(self, ranks: Iterable[int] = (0,)) -> Path:
        ranks = sorted(int(r) for r in ranks)
        if self._finalized:
            raise RuntimeError("finalize() called twice")
        try:
            if self.packed:
                self._pack_masks()
            manifest = msgspec.structs.replace(self.manifest, payloads=dict(sorted(self.payloads.items())))
            blobs = wire_documents(manifest, self.index, self.expected, self.major)
            for fname, blob in blobs.items():
                (self.staging / fname).write_bytes(blob)
            metadata = {fname: sha256_bytes(blob) for fname, blob in blobs.items()}
            payload_hashes = {name: spec.sha256 for name, spec in sorted(self.payloads.items())}
            identity = self.index.identity
            shard = RankComplete(
                actor_step_id=identity.actor_step_id,
                rollout_id=identity.rollout_id,
                payloads=payload_hashes,
                metadata=metadata,
            )
            # a rank shard is the single bundle of its own rank (the layout the original reads)
            own_ranks = ranks if self.rank is None else [self.rank]
            for r in own_ranks:
                (self.staging / f"COMPLETE.{r}").write_bytes(encode_json(shard))
            (self.staging / "COMPLETE").write_bytes(
                encode_json(BundleComplete(ranks=own_ranks, metadata=metadata))
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

    def _pack_masks(self) -> None:
        """Format 1.3: the samples' masks as the payload ``loss_mask`` (flat token axis), index.json without them."""
        samples = self.index.samples
        for i, sample in enumerate(samples):
            if len(sample.loss_mask) != sample.response_length:
                raise ValueError(f"$.samples[{i}].loss_mask: {len(sample.loss_mask)} values, response_length is "
                                 f"{sample.response_length}")
        self._write(packed.MASK_PAYLOAD, packed.pack_masks([s.loss_mask for s in samples]))
        self.index = msgspec.structs.replace(
            self.index, samples=[msgspec.structs.replace(s, loss_mask=msgspec.UNSET) for s in samples])

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def __enter__(self) -> "BundleWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._finalized:
            self.abort()


def _older(version: str, than: str) -> bool:
    try:
        return tuple(int(x) for x in version.split(".")) < tuple(int(x) for x in than.split("."))
    except ValueError:
        return False


def wire_documents(manifest: Manifest, index: BundleIndex, expected: Expected, major: int) -> dict[str, bytes]:
    """The three JSON files as written, of format ``major``. A non-finite reward or expected value is written as
    Python's json writes it (``NaN``, ``Infinity``), the form both majors of the original read."""
    from . import format2

    doc = wire_manifest(manifest)
    if major == 2:
        doc = format2.wire_manifest_2(doc)
        index_doc = format2.wire_index(index)
        expected = format2.wire_expected(expected)
    else:
        index_doc = None
    if index_doc is None and not any(format2.nonfinite_reward(s) for s in index.samples):
        index_blob = encode_json(index)  # the usual index: one encode, no walk
    else:
        index_blob = encode_json_literals(index_doc if index_doc is not None else msgspec.to_builtins(index),
                                          index_float_paths)
    return {
        "manifest.json": encode_json(doc),
        "index.json": index_blob,
        "expected.json": encode_json_literals(msgspec.to_builtins(expected), expected_float_paths),
    }


def wire_manifest(manifest: Manifest) -> dict:
    """The manifest as written: in ``stage_contracts`` what the original's format-1.0.0 reader can parse
    and run, in ``extension_stage_contracts`` the rest (our reader merges the two back). An extension stage
    (``logprob.support``) goes there whole; a stage of the original's that its engine never recomputes
    (``loss.value``) but that we declare ``recompute`` stays in ``stage_contracts`` as ``unsupported`` — what
    the original writes there itself — and the real contract goes to the extension field."""
    original: dict[StageId, StageContract] = {}
    extension: dict[StageId, StageContract] = {}
    for stage, contract in manifest.stage_contracts.items():
        if stage.value not in ORIGINAL_STAGE_IDS:
            extension[stage] = contract
        elif stage.value not in ORIGINAL_RECOMPUTED_STAGE_IDS and contract.capability == StageCapability.RECOMPUTE:
            extension[stage] = contract
            original[stage] = msgspec.structs.replace(contract, capability=StageCapability.UNSUPPORTED)
        else:
            original[stage] = contract
    doc = msgspec.to_builtins(manifest)
    doc["stage_contracts"] = msgspec.to_builtins(original)
    doc["extension_stage_contracts"] = msgspec.to_builtins(extension)
    return doc


def _agree(shards: dict[int, RankComplete]) -> bool:
    """Whether the shards describe one cohort: the same anchor and expected ranks, and the same bundle_id
    among the shards that record one (the original's writer does not: a cohort it shares with ours still
    finalizes; the reader compares every shard's manifest bundle_id when the cohort is opened)."""
    if len({shard.anchor() for shard in shards.values()}) != 1:
        return False
    return len({shard.bundle_id for shard in shards.values() if shard.bundle_id is not None}) <= 1


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
    if not _agree(shards):
        return False
    expected = sorted(next(iter(shards.values())).expected_ranks or [])
    if not expected or sorted(shards) != expected:
        return False
    if not all((cohort / f"rank-{r}" / "manifest.json").is_file() for r in expected):
        return False
    blob = encode_json(BundleComplete(ranks=expected, shards={str(r): shards[r] for r in expected}))
    tmp = cohort / staging_name("COMPLETE")
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
