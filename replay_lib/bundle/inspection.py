"""``inspect``: a tolerant look at a bundle, cohort or capture directory that works on incomplete bundles
and verifies nothing (``validate`` does). It never imports torch: it answers in a fraction of a second.

The walk never leaves the tree it was given (SPEC §11): directories are told apart with ``lstat``, a
symbolic link is never followed (out of the tree, to ``/``, ``/proc/self``, ``.`` or ``..`` alike; one
that stays inside points at something the walk reaches under its own name) and is listed in
``skipped`` with the reason; a directory seen twice (a bind-mount loop) or nested deeper than
``MAX_DEPTH`` is skipped too. Files are read through :mod:`.safe_open` (regular files inside the
bundle, under their size caps)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import msgspec

from .safe_open import MissingFile, NotRegular, TooLarge, UnsafeFile, read_json_file
from ..errors import BundleError
from .json_limits import json_depth_error
from .layout import _RANK_DIR, _RANK_SENTINEL, METADATA_FILES, PAYLOAD_DIR, PAYLOAD_SUFFIX
from .schema import (BUNDLE_COMPLETE_DECODER, EARLY_COMPLETE_WARNING, MANIFEST_DECODER, RANK_COMPLETE_DECODER,
                     StageId, decode_expected, decode_index)


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
    warnings: list[str] = []


class InspectResult(msgspec.Struct, kw_only=True):
    path: str
    layout: str
    complete: bool
    ranks_published: list[int] = []
    bundles: list[BundleInfo] = []
    problems: list[str] = []
    warnings: list[str] = []
    skipped: list[str] = []  # entries not looked into: "<path under the directory> → <link>: why"


MAX_DEPTH = 32  # nested capture directories looked into
SKIPPED_LISTED = 5  # skipped entries named in the one-line "no bundle found" error


def _pipeline_order(contracts) -> dict[str, str]:
    """Stage → capability in pipeline order (``sample`` first), as ``replay`` lists them; the manifest's
    keys are sorted alphabetically on disk."""
    order = {stage: i for i, stage in enumerate(StageId)}
    return {k.value: v.capability.value for k, v in sorted(contracts.items(), key=lambda kv: order[kv[0]])}


def _read_regular(file: Path, root: Path) -> bytes:
    """``file``'s bytes when it is a regular file inside ``root`` under its cap (a FIFO or /dev/zero
    would hang a read) and nested no deeper than the format's limit; ``FileNotFoundError`` when it is missing, else an ``OSError`` saying why it was
    not read (listed as the file's problem)."""
    try:
        data = read_json_file(file, root)
    except MissingFile:
        raise FileNotFoundError(file) from None
    except NotRegular:
        raise OSError("not a regular file inside the bundle (not read)") from None
    except TooLarge as exc:
        raise OSError(f"{exc.size} bytes, over the {exc.cap}-byte cap (not read; raise it with --max-json-bytes)") from None
    except UnsafeFile as exc:
        raise OSError(exc.reason) from None
    deep = json_depth_error(data)  # a decoder would recurse out of its stack: listed, never decoded
    if deep is not None:
        raise OSError(deep)
    return data


def _problem(name: str, exc: Exception) -> str:
    """A file's decode error worded as ``validate`` words it (``$.samples[3].loss_mask: expected `array`, …``)."""
    if isinstance(exc, msgspec.ValidationError):
        from .files import _validation_message

        return f"{name}: {_validation_message(exc)}"
    return f"{name}: {exc}"


def _inspect_one(path: Path, rank: Optional[int] = None, published: bool = False) -> BundleInfo:
    """One bundle directory; a rank shard's ``published`` comes from its cohort (``COMPLETE.<rank>`` or
    the cohort ``COMPLETE``'s record of it, as the reader takes it)."""
    info = BundleInfo(path=str(path), rank=rank, complete=(path / "COMPLETE").is_file() if rank is None else published)
    manifest = index = None
    for name in METADATA_FILES:
        if not (path / name).exists():
            info.problems.append(f"missing {name}")
    try:
        manifest = MANIFEST_DECODER.decode(_read_regular(path / "manifest.json", path))
    except FileNotFoundError:
        pass
    except (msgspec.MsgspecError, UnicodeDecodeError, OSError) as exc:
        info.problems.append(_problem("manifest.json", exc))
    try:
        index, _ = decode_index(_read_regular(path / "index.json", path))
    except FileNotFoundError:
        pass
    except (msgspec.MsgspecError, UnicodeDecodeError, OSError) as exc:
        info.problems.append(_problem("index.json", exc))
    try:
        decode_expected(_read_regular(path / "expected.json", path))
    except FileNotFoundError:
        pass
    except (msgspec.MsgspecError, UnicodeDecodeError, OSError) as exc:
        info.problems.append(_problem("expected.json", exc))
    if manifest is not None:
        info.bundle_id = manifest.bundle_id
        info.format_version = manifest.format_version
        info.producer = msgspec.to_builtins(manifest.producer)
        info.stages = _pipeline_order(manifest.stage_contracts)
        from .schema import FORMAT_2_REMOVED_STAGES, NOT_IN_FORMAT_2, format_major

        if format_major(manifest.format_version) == 2:  # the reward stages, named: replay skips them so
            order = {stage.value: i for i, stage in enumerate(StageId)}
            listed = {**info.stages, **{s: NOT_IN_FORMAT_2 for s in FORMAT_2_REMOVED_STAGES if s not in info.stages}}
            info.stages = dict(sorted(listed.items(), key=lambda kv: order[kv[0]]))
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
    unknown_major = manifest is not None and _unknown_major(manifest.format_version)
    if unknown_major:
        info.problems.append(unknown_major)
        info.stages = {}
    if index is not None:
        info.bundle_id = info.bundle_id or index.bundle_id
        info.kind = index.identity.kind
        info.anchor = index.identity.anchor
        if not unknown_major:  # only what index.json records: a default this reader fills in is never shown
            recorded = _recorded_keys(path)
            info.identity = _only(msgspec.to_builtins(index.identity), recorded.identity)
            if "rank" in info.identity:
                info.identity["rank"] = _only(info.identity["rank"], recorded.rank)
            info.config = _only(msgspec.to_builtins(index.config), recorded.config)
        info.samples = len(index.samples)
        info.groups = len({s.group_index for s in index.samples if s.group_index is not None})
        info.tokens = sum(max(s.response_length, 0) for s in index.samples)
    if rank is None and not info.complete:
        info.problems.append("missing COMPLETE (incomplete or still being written)")
    if rank is None and info.complete:
        _check_early_writer(path, info)
    return info


class _RecordedIdentity(msgspec.Struct):
    rank: dict[str, msgspec.Raw] = {}


class _Recorded(msgspec.Struct):
    """The keys index.json records (values left undecoded)."""

    config: dict[str, msgspec.Raw] = {}
    identity: dict[str, msgspec.Raw] = {}


class _RecordedKeys(msgspec.Struct):
    config: frozenset = frozenset()
    identity: frozenset = frozenset()
    rank: frozenset = frozenset()


_RECORDED_DECODER = msgspec.json.Decoder(_Recorded)


def _recorded_keys(path: Path) -> _RecordedKeys:
    """Which config knobs, identity fields and rank axes index.json records (it decoded already: read again for
    its keys only; a document with Python's NaN literals through the stdlib parser)."""
    try:
        blob = _read_regular(path / "index.json", path)
        try:
            head = _RECORDED_DECODER.decode(blob)
            config, identity = head.config, head.identity
        except msgspec.DecodeError as exc:
            from .schema import _python_json

            doc = _python_json(blob, exc)
            config, identity = dict(doc.get("config") or {}), dict(doc.get("identity") or {})
        rank = identity.get("rank")
        if isinstance(rank, msgspec.Raw):
            rank = msgspec.json.decode(rank)
        return _RecordedKeys(config=frozenset(config), identity=frozenset(identity),
                             rank=frozenset(rank) if isinstance(rank, dict) else frozenset())
    except (msgspec.MsgspecError, OSError, UnicodeDecodeError, RecursionError, AttributeError, TypeError):
        return _RecordedKeys()


def _only(values: dict, keys: frozenset) -> dict:
    return {k: v for k, v in values.items() if k in keys}


def _unknown_major(version) -> Optional[str]:
    """The problem line of a format version this reader does not read, else ``None``."""
    from .schema import SUPPORTED_MAJORS, format_major

    major = format_major(version)
    if major in SUPPORTED_MAJORS:
        return None
    reads = " and ".join(f"{m}.x" for m in SUPPORTED_MAJORS)
    what = f"major version {major} is unknown to this reader" if major is not None else "not 'MAJOR.MINOR.PATCH'"
    return (f"manifest.json: $.format_version {version!r}: {what} (it reads {reads}); its stages, config and "
            f"identity fields are not shown (what they mean is that format's)")


def _check_early_writer(path: Path, info: BundleInfo) -> None:
    """A COMPLETE without the JSON files' checksums: the original's early 1.0.0 writer (a warning, as in
    ``validate``, unless a COMPLETE.<r> records them), anything later (a problem: validate refuses it)."""
    try:
        complete = BUNDLE_COMPLETE_DECODER.decode(_read_regular(path / "COMPLETE", path))
    except (msgspec.MsgspecError, UnicodeDecodeError, OSError):
        return  # validate names it
    if not complete.early_writer:
        return
    if info.format_version != "1.0.0":
        info.problems.append(f"COMPLETE: $.metadata: missing (format {info.format_version!r} records the checksums)")
        return
    for r in complete.ranks:
        try:
            if RANK_COMPLETE_DECODER.decode(_read_regular(path / f"COMPLETE.{r}", path)).metadata:
                return
        except (msgspec.MsgspecError, UnicodeDecodeError, OSError):
            pass
    info.warnings.append(f"{path / 'COMPLETE'}: {EARLY_COMPLETE_WARNING}")


def inspect(path: str | Path) -> InspectResult:
    """What a bundle, cohort or capture directory holds, read without verifying it (an incomplete bundle
    too, its problems listed); raises ``BundleError`` when the directory holds nothing of a bundle."""
    path = Path(path)
    if not path.exists():
        raise BundleError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise BundleError(f"{path}: not a bundle directory")
    walk = _Walk(path)
    try:
        result = _inspect(path, walk)
    except OSError as exc:
        raise BundleError(f"{path}: cannot list the directory: {exc.strerror}") from None
    result.skipped = walk.skipped
    if result.layout == "empty":
        more = len(walk.skipped) - SKIPPED_LISTED
        skipped = ("; not looked into: " + "; ".join(walk.skipped[:SKIPPED_LISTED])
                   + (f"; and {more} more" if more > 0 else "")) if walk.skipped else ""
        raise BundleError(f"{path}: no bundle found (no manifest.json, no COMPLETE, no bundle subdirectories)"
                          f"{skipped}")
    return result


@dataclass
class _Walk:
    """One inspect's walk: where it started, the directories it entered (by device and inode) and what it
    did not look into."""

    top: Path
    seen: set = field(default_factory=set)
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.real = os.path.realpath(self.top)
        st = os.stat(self.top)
        self.seen.add((st.st_dev, st.st_ino))

    def skip(self, entry: Path, why: str) -> None:
        self.skipped.append(f"{os.path.relpath(entry, self.top)}: {why}")

    def link_reason(self, link: Path) -> str:
        """Why a symbolic link is not followed, from where it points (nothing is opened)."""
        try:
            target = os.readlink(link)
        except OSError as exc:
            return f"symbolic link (unreadable: {exc.strerror}), not followed"
        real, home = os.path.realpath(link), os.path.realpath(link.parent)
        if not os.path.exists(link) or not os.path.lexists(real):
            where = "it resolves to no path: dangling, a loop of links or a special file"
        elif os.path.commonpath([real, home]) == real:
            where = "a loop: it points at a directory that holds it"
        elif os.path.commonpath([real, self.real]) != self.real:
            where = "it leaves the directory"
        else:
            where = "it stays inside: its target is looked at under its own name"
        return f"symbolic link → {target}, not followed ({where})"


def _real_dir(path: Path) -> Optional[os.stat_result]:
    """``lstat`` of a directory itself (not a link to one), else ``None``."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISDIR(st.st_mode) else None


def _enter(child: Path, walk: _Walk, depth: int) -> bool:
    """Whether the walk looks into ``child``: a real directory not seen before, not too deep; a link is
    listed as skipped, with the reason."""
    if os.path.islink(child):
        walk.skip(child, walk.link_reason(child))
        return False
    st = _real_dir(child)
    if st is None:
        return False
    if (st.st_dev, st.st_ino) in walk.seen:
        walk.skip(child, "a directory already looked into (a bind mount loop?), not entered again")
        return False
    if depth >= MAX_DEPTH:
        walk.skip(child, f"deeper than {MAX_DEPTH} directories, not looked into")
        return False
    walk.seen.add((st.st_dev, st.st_ino))
    return True


def _inspect(path: Path, walk: _Walk, depth: int = 0) -> InspectResult:
    names = sorted(os.listdir(path))
    for n in names:
        if _RANK_DIR.match(n) and os.path.islink(path / n):
            walk.skip(path / n, walk.link_reason(path / n))
    names = [n for n in names if not (_RANK_DIR.match(n) and os.path.islink(path / n))]
    rank_dirs = sorted((int(m.group(1)), n) for n in names if (m := _RANK_DIR.match(n)))
    sentinels = sorted(int(m.group(1)) for n in names if (m := _RANK_SENTINEL.match(n)))
    # a bundle's own files (even with its manifest or index gone): it is looked at as one, missing files listed
    if any((path / name).exists() for name in METADATA_FILES) or (path / PAYLOAD_DIR).is_dir():
        m = _RANK_DIR.match(path.name)
        if m:  # a rank shard is read once its cohort is final (its own COMPLETE is for the original's reader)
            info = _inspect_one(path, rank=int(m.group(1)), published=(path.parent / "COMPLETE").is_file())
            if not info.complete:
                info.problems.append(f"no cohort COMPLETE in {path.parent} (a rank shard is read once its "
                                     f"cohort is final)")
        else:
            info = _inspect_one(path)
        return InspectResult(path=str(path), layout="bundle", complete=info.complete, ranks_published=sentinels,
                             bundles=[info], problems=list(info.problems), warnings=list(info.warnings))
    if rank_dirs or sentinels:
        return _inspect_cohort(path, rank_dirs, sentinels)
    result = InspectResult(path=str(path), layout="capture", complete=False)
    for name in names:
        child = path / name
        if name.startswith(".") or not _enter(child, walk, depth):
            continue
        try:
            sub = _inspect(child, walk, depth + 1)
        except OSError as exc:
            walk.skip(child, f"cannot list the directory: {exc.strerror}")
            continue
        if sub.layout == "empty":
            continue
        result.bundles += sub.bundles
        result.problems += [f"{name}: {p}" for p in sub.problems]
        result.warnings += sub.warnings
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
            complete = BUNDLE_COMPLETE_DECODER.decode(_read_regular(path / "COMPLETE", path))
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
        if _real_dir(path / f"rank-{r}") is None:
            result.problems.append(f"missing rank shard rank-{r}")
        elif r not in sentinels and r not in recorded:
            result.problems.append(f"rank-{r}: not published (no COMPLETE.{r}, no record in COMPLETE $.shards)")
    return result
