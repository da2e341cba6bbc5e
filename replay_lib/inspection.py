"""``inspect``: a tolerant look at a bundle, cohort or capture directory that works on incomplete bundles
and verifies nothing (``validate`` does). It never imports torch: it answers in a fraction of a second."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import msgspec

from .errors import BundleError
from .layout import _RANK_DIR, _RANK_SENTINEL, METADATA_FILES, PAYLOAD_DIR, PAYLOAD_SUFFIX
from .schema import BUNDLE_COMPLETE_DECODER, EXPECTED_DECODER, MANIFEST_DECODER, StageId, decode_index


class PayloadRow(msgspec.Struct, kw_only=True):
    name: str
    dtype: str
    shape: list[int]
    bytes: int
    present: bool
    size_ok: bool


class BundleInfo(msgspec.Struct, kw_only=True):
    path: str
    rank: Optional[int] = None
    complete: bool = False
    bundle_id: Optional[str] = None
    format_version: Optional[str] = None
    producer: Optional[dict] = None
    kind: Optional[str] = None
    anchor: Optional[str] = None
    identity: Optional[dict] = None
    config: Optional[dict] = None
    samples: Optional[int] = None
    groups: Optional[int] = None
    tokens: Optional[int] = None
    stages: dict[str, str] = {}
    payloads: list[PayloadRow] = []
    redaction: dict[str, str] = {}
    problems: list[str] = []


class InspectResult(msgspec.Struct, kw_only=True):
    path: str
    layout: str
    complete: bool
    ranks_published: list[int] = []
    bundles: list[BundleInfo] = []
    problems: list[str] = []


def _pipeline_order(contracts) -> dict[str, str]:
    """Stage → capability in pipeline order (``sample`` first), as ``replay`` lists them; the manifest's
    keys are sorted alphabetically on disk."""
    order = {stage: i for i, stage in enumerate(StageId)}
    return {k.value: v.capability.value for k, v in sorted(contracts.items(), key=lambda kv: order[kv[0]])}


def _regular(file: Path, root: Path) -> bool:
    """A regular file whose real path stays inside ``root`` (a FIFO or /dev/zero would hang a read)."""
    real = os.path.realpath(file)
    return file.is_file() and real.startswith(os.path.realpath(root) + os.sep)


def _read_regular(file: Path, root: Path) -> bytes:
    if not _regular(file, root):
        raise FileNotFoundError(file)
    return file.read_bytes()


def _inspect_one(path: Path, rank: Optional[int] = None, published: bool = False) -> BundleInfo:
    """One bundle directory; a rank shard's ``published`` comes from its cohort (``COMPLETE.<rank>`` or
    the cohort ``COMPLETE``'s record of it, as the reader takes it)."""
    info = BundleInfo(path=str(path), rank=rank, complete=(path / "COMPLETE").is_file() if rank is None else published)
    manifest = index = None
    for name in METADATA_FILES:
        if not (path / name).exists():
            info.problems.append(f"missing {name}")
    for name in METADATA_FILES:
        if (path / name).exists() and not _regular(path / name, path):
            info.problems.append(f"{name}: not a regular file inside the bundle (not read)")
    try:
        manifest = MANIFEST_DECODER.decode(_read_regular(path / "manifest.json", path))
    except FileNotFoundError:
        pass
    except (msgspec.MsgspecError, UnicodeDecodeError, OSError) as exc:
        info.problems.append(f"manifest.json: {exc}")
    try:
        index, _ = decode_index(_read_regular(path / "index.json", path))
    except FileNotFoundError:
        pass
    except (msgspec.MsgspecError, UnicodeDecodeError, OSError) as exc:
        info.problems.append(f"index.json: {exc}")
    try:
        EXPECTED_DECODER.decode(_read_regular(path / "expected.json", path))
    except FileNotFoundError:
        pass
    except (msgspec.MsgspecError, UnicodeDecodeError, OSError) as exc:
        info.problems.append(f"expected.json: {exc}")
    if manifest is not None:
        info.bundle_id = manifest.bundle_id
        info.format_version = manifest.format_version
        info.producer = msgspec.to_builtins(manifest.producer)
        info.stages = _pipeline_order(manifest.stage_contracts)
        info.redaction = dict(manifest.redaction)
        for key, spec in sorted(manifest.payloads.items()):
            file = path / PAYLOAD_DIR / f"{key}{PAYLOAD_SUFFIX}"
            present = "/" not in key and ".." not in key and file.is_file()
            size_ok = present and file.stat().st_size == spec.bytes
            info.payloads.append(PayloadRow(name=key, dtype=spec.dtype, shape=list(spec.shape), bytes=spec.bytes,
                                            present=present, size_ok=size_ok))
            if not present:
                info.problems.append(f"missing payloads/{key}{PAYLOAD_SUFFIX}")
            elif not size_ok:
                info.problems.append(f"payloads/{key}{PAYLOAD_SUFFIX}: size differs from manifest")
    if index is not None:
        info.bundle_id = info.bundle_id or index.bundle_id
        info.kind = index.identity.kind
        info.anchor = index.identity.anchor
        info.identity = msgspec.to_builtins(index.identity)
        info.config = msgspec.to_builtins(index.config)
        info.samples = len(index.samples)
        info.groups = len({s.group_index for s in index.samples if s.group_index is not None})
        info.tokens = sum(max(s.response_length, 0) for s in index.samples)
    if rank is None and not info.complete:
        info.problems.append("missing COMPLETE (incomplete or still being written)")
    return info


def inspect(path: str | Path) -> InspectResult:
    """What a bundle, cohort or capture directory holds, read without verifying it (an incomplete bundle
    too, its problems listed); raises ``BundleError`` when the directory holds nothing of a bundle."""
    path = Path(path)
    result = _inspect(path)
    if result.layout == "empty":
        raise BundleError(f"{path}: no bundle found (no manifest.json, no COMPLETE, no bundle subdirectories)")
    return result


def _inspect(path: Path) -> InspectResult:
    if not path.exists():
        raise BundleError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise BundleError(f"{path}: not a bundle directory")
    names = sorted(os.listdir(path))
    rank_dirs = sorted((int(m.group(1)), n) for n in names if (m := _RANK_DIR.match(n)))
    sentinels = sorted(int(m.group(1)) for n in names if (m := _RANK_SENTINEL.match(n)))
    # a bundle's own files (even with its manifest or index gone): it is looked at as one, missing files listed
    if any((path / name).exists() for name in METADATA_FILES) or (path / PAYLOAD_DIR).is_dir():
        info = _inspect_one(path)
        return InspectResult(path=str(path), layout="bundle", complete=info.complete, ranks_published=sentinels,
                             bundles=[info], problems=list(info.problems))
    if rank_dirs or sentinels:
        return _inspect_cohort(path, rank_dirs, sentinels)
    result = InspectResult(path=str(path), layout="capture", complete=False)
    for name in names:
        child = path / name
        if name.startswith(".") or not child.is_dir():
            continue
        sub = _inspect(child)
        if sub.layout == "empty":
            continue
        result.bundles += sub.bundles
        result.problems += [f"{name}: {p}" for p in sub.problems]
    if not result.bundles:
        result.layout = "empty"
        result.problems.append("no bundle found")
    result.complete = bool(result.bundles) and all(b.complete for b in result.bundles)
    return result


def _inspect_cohort(path: Path, rank_dirs: list[tuple[int, str]], sentinels: list[int]) -> InspectResult:
    result = InspectResult(path=str(path), layout="cohort", complete=(path / "COMPLETE").is_file(),
                           ranks_published=sentinels)
    expected: list[int] = []
    recorded: set[int] = set()  # shards the cohort COMPLETE carries (the reader needs no COMPLETE.<r> then)
    if result.complete:
        try:
            complete = BUNDLE_COMPLETE_DECODER.decode((path / "COMPLETE").read_bytes())
            expected = complete.ranks
            recorded = {int(r) for r in (complete.shards or {}) if str(r).isdigit()}
        except (msgspec.MsgspecError, UnicodeDecodeError, OSError) as exc:
            result.problems.append(f"COMPLETE: {exc}")
    else:
        result.problems.append(f"no cohort COMPLETE (ranks published: {sentinels or 'none'})")
    for r, name in rank_dirs:
        info = _inspect_one(path / name, rank=r, published=r in sentinels or r in recorded)
        result.bundles.append(info)
        result.problems += [f"rank-{r}: {p}" for p in info.problems]
    for r in expected:
        if not (path / f"rank-{r}").is_dir():
            result.problems.append(f"missing rank shard rank-{r}")
        elif r not in sentinels and r not in recorded:
            result.problems.append(f"rank-{r}: not published (no COMPLETE.{r}, no record in COMPLETE $.shards)")
    return result
