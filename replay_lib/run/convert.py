"""``trajectory-replay convert SRC DST --to 2.0.0|1.0.0``: a bundle or cohort rewritten in the other major of the
original tool's format (SPEC §2.2).

SRC is opened and verified as ``validate`` opens it (exit 3 on any problem); DST is written into a hidden staging
directory beside it, read back and validated there, and published with one rename — never half-written, never
over an existing path. Payloads are carried as stored (a float8 payload stays float8). What the target format
cannot hold is named in the result's notes, never dropped silently: to 2.0 the reward stages (and their
recompute), raw rewards, expected reward values, ``n_samples_per_prompt`` / ``grpo_std_normalization`` and the
normalization cohort ids; to 1.x the reward stages come back declared ``recorded-only`` (2.0 records no raw
reward to recompute them from) and the two config knobs 2.0 removed are written at their defaults.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from ..bundle import open_bundle
from ..bundle.format2 import CONVERT_TARGETS, lost_in_2, missing_reward
from ..bundle.layout import PAYLOAD_DIR, staging_name
from ..bundle.packed import MASK_PAYLOAD, SAFETENSORS_SUFFIX, payload_file
from ..bundle.reader import BundleReader
from ..bundle.schema import (FORMAT_2_REMOVED_CONFIG, FORMAT_2_REMOVED_STAGES, FORMAT_2_STAGE_IDS,
                             FORMAT_2_VERSION, Expected, StageCapability, StageContract, StageId, format_major)
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
    an existing ``dst`` or a ``src`` already of that major; ``BundleError`` (3) for an invalid ``src``;
    ``UnsupportedError`` (4) for a bundle the target cannot hold at all (2.0 without a post-processed reward)."""
    if to not in TARGETS:
        raise UsageError(f"--to {to!r}: expected one of {', '.join(TARGETS)}")
    src, dst = Path(src), Path(dst)
    if os.path.lexists(dst):
        raise UsageError(f"{dst}: already exists; refusing to overwrite")
    bundles = open_bundle(src)
    major = format_major(to)
    versions = sorted({s.manifest.format_version for s in bundles.shards})
    if any(s.format_major == major for s in bundles.shards):
        raise UsageError(f"{src}: already format {versions[0]} (major {major}); nothing to convert")
    notes: list[str] = []
    prepared = [(shard, *_prepared(shard, major, notes)) for shard in bundles.shards]
    if not dst.parent.is_dir():
        raise UsageError(f"{dst.parent}: no such directory")
    stage = dst.parent / staging_name(dst.name)
    try:
        ranks = [shard.rank for shard in bundles.shards] if bundles.cohort else []
        for shard, manifest, index, expected in prepared:
            writer = BundleWriter(stage, manifest, index, expected, rank=shard.rank if bundles.cohort else None,
                                  format_version=FORMAT_2_VERSION if major == 2 else None)
            with writer:
                for name in sorted(shard.manifest.payloads):
                    if name == MASK_PAYLOAD and shard.packed_mask is not None:
                        continue  # format 1.3's packed masks: in the index the writer takes (index_with_masks)
                    writer.write_payload(name, _stored(shard, name))
                writer.finalize(ranks=ranks or [0])
        written = _verify(stage, bundles, notes)
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


def _prepared(shard: BundleReader, major: int, notes: list[str]):
    """``(manifest, index, expected)`` of one shard for the target major, its losses appended to ``notes``."""
    manifest, index = shard.manifest, shard.index_with_masks()  # every mask listed: the writer takes them
    expected: Expected = {stage: dict(values) for stage, values in shard.expected.items()}
    where = shard.path / "index.json"
    if major == 2:
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
            raise UnsupportedError(f"{where}: {absent}; it has no recorded post-processed reward "
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
    # 2.0 → 1.x
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
    if any(type(s.reward) is list for s in index.samples):
        _note(notes, "index.json $.samples[].reward: per-token rewards, written as format 1.2.0 (the minor that "
                     "added them; a 1.0.0 reader takes a sample's reward as one number)")
    manifest = msgspec.structs.replace(manifest, stage_contracts=contracts, format_version="1.0.0")
    return manifest, index, expected


def _verify(path: Path, source, notes: list[str]) -> str:
    """Read the written bundle back as ``validate`` does and check it holds what the source held; returns its
    format version. A failure is this tool's bug: the staging is removed and the error raised as internal."""
    from .validate import validate

    try:
        result = validate(path)
        back = open_bundle(path)
    except BundleError as exc:
        raise RuntimeError(f"the converted bundle does not validate, so it was not published: {exc}") from None
    for theirs, ours in zip(source.shards, back.shards):
        carried = sorted(n for n in theirs.manifest.payloads if n != MASK_PAYLOAD or theirs.packed_mask is None)
        if ([s.sample_id for s in theirs.index.samples] != [s.sample_id for s in ours.index.samples]
                or carried != sorted(ours.manifest.payloads)):
            raise RuntimeError(f"{ours.path}: the converted bundle's samples or payloads differ from the source's")
    for w in result.warnings:
        _note(notes, f"validate: {w}")
    return result.format_version
