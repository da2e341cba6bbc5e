"""``trajectory-replay convert SRC DST --to 2.0.0|1.0.0|1.3.0``: a bundle or cohort rewritten in another form of the
format, in one step from any of the others (SPEC §2.2, §2.3): the original tool's 2.0.0 and 1.0.0 (``.pt`` payloads,
masks in index.json) and our current 1.3.0 (packed masks, safetensors payloads).

SRC is opened and checked as ``validate`` checks it (exit 3 on any problem, with ``validate``'s line); DST is written
into a hidden staging directory beside it, read back and validated there, and published with one rename — never
half-written, never over an existing path. Payloads are carried as stored (a float8 payload stays float8). What the target format
cannot hold is named in the result's notes, never dropped silently: to 2.0 the reward stages (and their
recompute), raw rewards, expected reward values, ``n_samples_per_prompt`` / ``grpo_std_normalization`` and the
normalization cohort ids; from 2.0 to 1.x the reward stages come back declared ``recorded-only`` (2.0 records no
raw reward to recompute them from) and the two config knobs 2.0 removed are written at their defaults; to 1.0.0 a
per-token reward keeps the bundle at 1.2.0, the minor that added it. What the target cannot hold at all is refused
before anything is written (exit 4): 2.0 without a post-processed reward, 1.3.0 with a payload safetensors cannot
store (float8 ``*fnuz``). SRC already of the target's version (of its major, for 2.0.0): exit 2.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from ..bundle import open_bundle
from ..bundle.format2 import CONVERT_TARGETS, has_per_token_reward, lost_in_2, missing_reward
from ..bundle.layout import PAYLOAD_DIR, staging_name
from ..bundle.packed import (MASK_PAYLOAD, SAFETENSORS_SUFFIX, format_minor, is_packed, pack_masks,
                             payload_file)
from ..bundle.reader import BundleReader
from ..bundle.schema import (FORMAT_2_REMOVED_CONFIG, FORMAT_2_REMOVED_STAGES, FORMAT_2_STAGE_IDS,
                             FORMAT_2_VERSION, PER_TOKEN_REWARD_VERSION, Expected, StageCapability, StageContract,
                             StageId, format_major)
from ..bundle.writer import BundleWriter
from ..errors import BundleError, UnsupportedError, UsageError

TARGETS = CONVERT_TARGETS


@dataclass
class ConvertResult:
    source: str
    path: str
    source_version: str
    format_version: str  # what DST's manifests say
    bundle_id: str
    ranks: list = field(default_factory=list)  # a cohort's ranks; [] for one bundle
    samples: int = 0
    notes: list = field(default_factory=list)


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str) -> ConvertResult:
    """Convert ``src`` into ``dst`` (format ``to``). Raises ``UsageError`` (exit 2) for a target it does not write,
    an existing ``dst`` or a ``src`` already of that version (of that major, for 2.0.0); ``BundleError`` (3) for an
    invalid ``src``; ``UnsupportedError`` (4) for a bundle the target cannot hold at all (2.0 without a
    post-processed reward, 1.3.0 with a payload of a dtype safetensors cannot store)."""
    if to not in TARGETS:
        raise UsageError(f"--to {to!r}: expected one of {', '.join(TARGETS)}")
    src, dst = Path(src), Path(dst)
    if os.path.lexists(dst):
        raise UsageError(f"{dst}: already exists; refusing to overwrite")
    bundles = open_bundle(src)
    major = format_major(to)
    versions = sorted({s.manifest.format_version for s in bundles.shards})
    if major == 2 and any(s.format_major == major for s in bundles.shards):
        raise UsageError(f"{src}: already format {versions[0]} (major {major}); nothing to convert")
    if versions == [to]:
        raise UsageError(f"{src}: already format {to}; nothing to convert")
    from .validate import check_dependency_closure

    check_dependency_closure(bundles)  # what validate refuses (exit 3, its line): a copy of it would not validate
    notes: list[str] = []
    prepared = [(shard, *_prepared(shard, to, notes)) for shard in bundles.shards]
    if not dst.parent.is_dir():
        raise UsageError(f"{dst.parent}: no such directory")
    stage = dst.parent / staging_name(dst.name)
    try:
        ranks = [shard.rank for shard in bundles.shards] if bundles.cohort else []
        for shard, manifest, index, expected in prepared:
            writer = BundleWriter(stage, manifest, index, expected, rank=shard.rank if bundles.cohort else None,
                                  format_version=FORMAT_2_VERSION if major == 2 else None,
                                  redacted=True)  # its text fields as published: a hash is not hashed again
            with writer:
                for name in sorted(shard.manifest.payloads):
                    if name == MASK_PAYLOAD and shard.packed_mask is not None:
                        continue  # format 1.3's packed masks: in the index the writer takes (index_with_masks)
                    writer.write_payload(name, _stored(shard, name))
                writer.finalize(ranks=ranks or [0])
        written = _verify(stage, bundles, notes, dst)
        if os.path.lexists(dst):
            raise UsageError(f"{dst}: already exists; refusing to overwrite")
        os.rename(stage, dst)
    except OSError as exc:  # where DST goes cannot be written (read-only, full): the command's problem, one line
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(exc, FileExistsError):
            raise UsageError(f"{dst}: already exists; refusing to overwrite") from None
        raise UsageError(f"{dst}: cannot write the converted bundle: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return ConvertResult(source=str(src), path=str(dst), source_version=", ".join(versions),
                         format_version=written, bundle_id=bundles.bundle_id, ranks=ranks,
                         samples=sum(len(s.index.samples) for s in bundles.shards), notes=notes)


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


def _stored(shard: BundleReader, name: str) -> torch.Tensor:
    """The payload as stored (verified by the reader; a float8 one in its own dtype, not the float32 copy)."""
    file = payload_file(shard.path / PAYLOAD_DIR, name, shard.manifest.format_version)
    if file.name.endswith(SAFETENSORS_SUFFIX):  # format 1.3
        from ..bundle import safetensors_io
        from ..bundle.reader import open_payload

        fd = open_payload(file)
        try:
            return safetensors_io.load(file, fd)
        finally:
            os.close(fd)
    return torch.load(file, map_location="cpu", weights_only=True)


def _prepared(shard: BundleReader, to: str, notes: list[str]):
    """``(manifest, index, expected)`` of one shard in format ``to``, its losses appended to ``notes``; raises
    ``UnsupportedError`` for what ``to`` cannot hold at all."""
    manifest, index = shard.manifest, shard.index_with_masks()  # every mask listed: the writer takes them
    expected: Expected = {stage: dict(values) for stage, values in shard.expected.items()}
    if format_major(to) == 2:
        return _to_2(shard, manifest, index, expected, notes)
    if shard.format_major == 2:
        manifest = _from_2(manifest, index, notes)
    if has_per_token_reward(index) and format_minor(to) < format_minor(PER_TOKEN_REWARD_VERSION):
        _note(notes, "index.json $.samples[].reward: per-token rewards, written as format 1.2.0 (the minor that "
                     "added them; a 1.0.0 reader takes a sample's reward as one number)")
    if is_packed(to):
        _check_storable(shard, to)
    return msgspec.structs.replace(manifest, format_version=to), index, expected


def _to_2(shard: BundleReader, manifest, index, expected: Expected, notes: list[str]):
    """1.x → 2.0: each sample's reward the recorded normalized one, what 2.0 removed dropped and named."""
    recorded = expected.get("reward.post_process", {}).get("rewards")
    samples = index.samples
    if isinstance(recorded, list) and len(recorded) == len(samples):
        # what advantage.estimate consumes in 1.x (teacher forcing): 2.0 records it as each sample's reward
        samples = [msgspec.structs.replace(s, reward=r) if r is not None else s
                   for s, r in zip(samples, recorded)]
        _note(notes, "index.json $.samples[].reward: expected.json $.reward.post_process.rewards (the "
                     "normalized rewards advantage.estimate consumes)")
    index = msgspec.structs.replace(index, samples=samples)
    absent = missing_reward(index, manifest)
    if absent is not None:
        raise UnsupportedError(f"{shard.path / 'index.json'}: {absent}; it has no recorded post-processed reward "
                               f"(expected.json $.reward.post_process.rewards) either")
    for item in lost_in_2(manifest, index, expected):
        _note(notes, item)
    contracts = {s: c for s, c in manifest.stage_contracts.items() if s.value not in FORMAT_2_REMOVED_STAGES}
    manifest = msgspec.structs.replace(manifest, stage_contracts=contracts)
    index = msgspec.structs.replace(
        index, samples=[msgspec.structs.replace(s, raw_reward=None) if s.raw_reward is not None else s
                        for s in index.samples],
        identity=msgspec.structs.replace(index.identity, normalization_cohort_ids=[]))
    expected = {k: v for k, v in expected.items() if k not in FORMAT_2_REMOVED_STAGES}
    return manifest, index, expected


def _from_2(manifest, index, notes: list[str]):
    """2.0 → 1.x (the mapping the reader applies, written down): the reward stages declared recorded-only, every
    stage back at version ``v1``; the two config knobs 2.0 removed stay at their defaults (said in a note)."""
    contracts = dict(manifest.stage_contracts)
    for stage in FORMAT_2_REMOVED_STAGES:
        contracts[StageId(stage)] = StageContract(stage=StageId(stage), version="v1",
                                                  capability=StageCapability.RECORDED_ONLY)
    for stage, contract in list(contracts.items()):
        if stage.value in FORMAT_2_STAGE_IDS and contract.version == "v2":
            contracts[stage] = msgspec.structs.replace(contract, version="v1")
    _note(notes, "stages reward.raw, reward.post_process: declared recorded-only (format 2.0 records no raw "
                 "reward to recompute them from; each sample's reward stays advantage.estimate's input)")
    defaults = msgspec.to_builtins(index.config)
    _note(notes, "index.json $.config." + ", $.config.".join(FORMAT_2_REMOVED_CONFIG) + ": not in format 2.0, "
                 "written at their defaults (" + ", ".join(repr(defaults[k]) for k in FORMAT_2_REMOVED_CONFIG) +
                 "; only reward.post_process reads them, and it is recorded-only)")
    return msgspec.structs.replace(manifest, stage_contracts=contracts)


def _check_storable(shard: BundleReader, to: str) -> None:
    """Refuse (exit 4), before anything is written, a payload format ``to`` (safetensors payloads, the masks under
    the name ``loss_mask``) cannot hold."""
    from ..bundle import safetensors_io

    storable = [str(dtype) for dtype in safetensors_io.DTYPES.values()]
    where = shard.path / "manifest.json"
    for name, spec in sorted(shard.manifest.payloads.items()):
        if name == MASK_PAYLOAD and shard.packed_mask is not None:
            continue  # the source's own packed masks
        if name == MASK_PAYLOAD:
            raise UnsupportedError(f"{where}: $.payloads.{name}: format {to} keeps the samples' loss masks under "
                                   f"this name, so a payload of its own cannot be carried")
        if spec.dtype not in storable:
            raise UnsupportedError(f"{where}: $.payloads.{name}.dtype: {spec.dtype}, which format {to} cannot hold "
                                   f"(a payload there is a safetensors file of {', '.join(storable)})")


def _verify(path: Path, source, notes: list[str], dst: Path) -> str:
    """Read the written bundle back as ``validate`` does and check it holds what the source held (the samples, every
    payload's dtype and shape, every mask); returns its format version. A failure is this tool's bug: the staging is
    removed and the error raised as internal. A warning of ``validate`` is noted naming ``dst``, where the bundle is
    published, not its staging ``path``."""
    from .validate import check_dependency_closure

    try:
        back = open_bundle(path)  # validate's two steps, the bundle opened once
        result = check_dependency_closure(back)
    except BundleError as exc:
        raise RuntimeError(f"the converted bundle does not validate, so it was not published: {exc}") from None
    for theirs, ours in zip(source.shards, back.shards):
        if ([s.sample_id for s in theirs.index.samples] != [s.sample_id for s in ours.index.samples]
                or _carried(theirs) != _carried(ours) or not _same(_masks(theirs), _masks(ours))):
            raise RuntimeError(f"{ours.path}: the converted bundle's samples, payloads or masks differ from the "
                               f"source's")
    for w in result.warnings:
        _note(notes, f"validate: {w.replace(str(path), str(dst))}")
    return result.format_version


def _carried(reader: BundleReader) -> dict:
    """Each payload's ``(dtype, shape)`` as its manifest records it, a 1.3 bundle's packed masks left out."""
    return {name: (spec.dtype, list(spec.shape)) for name, spec in reader.manifest.payloads.items()
            if name != MASK_PAYLOAD or reader.packed_mask is None}


def _masks(reader: BundleReader) -> torch.Tensor:
    """Every sample's mask on the flat token axis, in the form the 1.3 writer packs it."""
    if reader.packed_mask is not None:
        return reader.packed_mask
    return pack_masks([s.loss_mask for s in reader.index.samples])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype:  # a producer's packed masks of another integer dtype than the writer picks
        a, b = a.to(torch.int64), b.to(torch.int64)
    return torch.equal(a, b)
