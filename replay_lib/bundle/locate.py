"""What a path is (a bundle, a rank shard, a cohort, a capture directory); :mod:`.resolution` opens it.

A capture directory is looked through without following anything out of it (SPEC §11): a candidate is a
real subdirectory (``lstat``), never a symbolic link — not even one to a sibling, which would list the
same bundle twice and make an anchor ambiguous; pass a linked bundle's path to open it. Each candidate's
``index.json`` is read for its anchor through :func:`~replay_lib.bundle.safe_open.read_json_file` (a regular file inside
the candidate, under its size cap): a FIFO, device, link out or oversized file makes that candidate
"unreadable" at once, so it never blocks the lookup of another one.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import msgspec

from ..errors import BundleError, SelectionError
from .layout import _RANK_DIR, _RANK_SENTINEL
from .schema import BUNDLE_COMPLETE_DECODER, ActorStepId, BundleComplete, RankComplete
from .files import _decode, _read_bytes, check_shard_keys
from .safe_open import UnsafeFile, read_json_file


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
    check_shard_keys(final, complete.shards)
    if sorted(int(k) for k in complete.shards) != sorted(complete.ranks):
        raise BundleError(f"{final}: $.shards: keys do not match $.ranks {complete.ranks}")
    return complete


def unreadable(path: Path, exc: OSError) -> BundleError:
    """The one line of a directory that could not be looked into (EACCES, EIO …) — the failing call was a
    ``stat`` or listing of it or of a name in it, which only the directory's own permissions deny — and why."""
    return BundleError(f"{path}: cannot read: {exc.strerror or exc}")


def holds_a_bundle(entry: Path) -> bool:
    """Whether the real directory ``entry`` holds a bundle (``manifest.json``) or a cohort (rank shards).
    Raises ``OSError`` when that cannot be told — the directory cannot be searched or listed (EACCES …) —
    rather than answer "no": an unreadable bundle is never silently left out of a capture directory."""
    try:
        os.lstat(entry / "manifest.json")
        return True
    except (FileNotFoundError, NotADirectoryError):
        pass
    with os.scandir(entry) as it:
        return any(_RANK_DIR.match(e.name) or _RANK_SENTINEL.match(e.name) for e in it)


def resolve_bundle(path: Path) -> Resolved:
    """Classify ``path`` without selecting among several bundles (see :func:`resolve_capture`). A path that
    cannot be looked into (EACCES …) is a :class:`BundleError` naming it (exit 3)."""
    try:
        return _resolve_bundle(path)
    except OSError as exc:
        raise unreadable(path, exc) from None


def _resolve_bundle(path: Path) -> Resolved:
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


class _AnchorIdentity(msgspec.Struct):
    actor_step_id: Optional[ActorStepId] = None
    rollout_id: Optional[int] = None


class _AnchorOnly(msgspec.Struct):
    """Only the anchor of an index.json: the samples are skipped by the decoder, never built."""

    identity: Optional[_AnchorIdentity] = None


_ANCHOR_DECODER = msgspec.json.Decoder(_AnchorOnly)


class _Anchor(NamedTuple):
    step: Optional[ActorStepId]
    rollout: Optional[int]
    unreadable: Optional[str] = None  # why there is no anchor: the file was not read, or did not decode


def _real_dir(entry: Path) -> bool:
    """A directory itself, not a link to one (``lstat``)."""
    try:
        return stat.S_ISDIR(os.lstat(entry).st_mode)
    except OSError:
        return False


def _decode_anchor(blob: bytes):
    """The anchor part of index.json; one holding Python's ``NaN`` / ``Infinity`` literals (a non-finite reward, as
    the original writes it) is read through the stdlib parser."""
    try:
        return _ANCHOR_DECODER.decode(blob)
    except msgspec.DecodeError as exc:
        if isinstance(exc, msgspec.ValidationError):
            raise
        from .schema import _python_json

        return msgspec.convert(_python_json(blob, exc), _ANCHOR_DECODER.type)


def _anchor_of(capture: Path, path: Path) -> _Anchor:
    """Read the identity anchor from a (possibly unverified) bundle or cohort under ``capture``, for
    selection only; nothing on the way is followed (see the module docstring)."""
    index_path = path / "index.json"
    if not os.path.lexists(index_path):
        ranks = sorted((e for e in path.iterdir() if _RANK_DIR.match(e.name)), key=lambda e: e.name)
        if not ranks:
            return _Anchor(None, None)
        index_path = ranks[0] / "index.json"
    try:
        identity = _decode_anchor(read_json_file(index_path, capture)).identity
    except UnsafeFile as exc:
        return _Anchor(None, None, exc.reason)
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):  # the reader names the field if chosen
        return _Anchor(None, None, "index.json does not decode")
    if identity is None:
        return _Anchor(None, None)
    return _Anchor(identity.actor_step_id, identity.rollout_id)


def _describe(anchor: _Anchor) -> str:
    if anchor.step is not None:
        return f"step {anchor.step}"
    if anchor.rollout is not None:
        return f"rollout {anchor.rollout}"
    return "unreadable identity" + (f"; {anchor.unreadable}" if anchor.unreadable else "")


def _matches(anchor: _Anchor, step: Optional[ActorStepId], rollout: Optional[int]) -> bool:
    if step is not None:
        return anchor.step == step
    if rollout is not None:
        return anchor.step is None and anchor.rollout == rollout
    return True


def holds_several_bundles(path: Path) -> bool:
    """Whether ``path`` is a capture directory with two or more bundle or cohort subdirectories (the
    candidates :func:`resolve_capture` would have to choose among). Stops at the second one, reads no
    ``index.json``: ``replay-tui DIR`` asks it before its first frame."""
    try:
        if resolve_bundle(path).kind != "capture":
            return False
        found = 0
        for entry in path.iterdir():
            if _is_hidden(entry) or not _real_dir(entry):
                continue
            try:
                candidate = holds_a_bundle(entry)
            except OSError:  # unreadable: a candidate the run view shows as an error row
                candidate = True
            if candidate:
                found += 1
                if found > 1:
                    return True
    except (BundleError, OSError):
        return False
    return False


def resolve_capture(path: Path, step: Optional[ActorStepId] = None, rollout: Optional[int] = None) -> Resolved:
    """Resolve a bundle, cohort or capture directory to exactly one bundle or cohort (fails when ambiguous)."""
    if step is not None and rollout is not None:
        raise SelectionError("--step and --rollout are mutually exclusive")
    resolved = resolve_bundle(path)
    if resolved.kind != "capture":
        return resolved
    candidates, links = [], []
    try:
        entries = sorted(path.iterdir())
    except OSError as exc:
        raise unreadable(path, exc) from None
    for entry in entries:
        if _is_hidden(entry):
            continue
        if not _real_dir(entry):
            if entry.is_symlink():
                links.append(entry.name)
            continue
        try:  # an entry that cannot be looked into may be the bundle asked for: never choose without it
            if holds_a_bundle(entry):
                candidates.append((entry, _anchor_of(path, entry)))
        except OSError as exc:
            raise BundleError(f"{unreadable(entry, exc)} (a subdirectory of the capture directory {path}, which "
                              f"may hold a bundle; pass one bundle's own path)") from None
    if not candidates:
        more = f", and {len(links) - 5} more" if len(links) > 5 else ""
        skipped = f"; symbolic links are not followed: {', '.join(links[:5])}{more}" if links else ""
        raise BundleError(f"{path}: no bundle found (no manifest.json, no COMPLETE, no bundle subdirectories)"
                          f"{skipped}")
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
        anchors = [(a.step, a.rollout) for _, a in candidates]
        hint = ("pass --step R:S or --rollout R" if len(set(anchors)) == len(anchors)
                else "pass --step R:S or --rollout R, or one bundle's own path")
    else:
        hint = f"all match {want}; pass one bundle's own path"
    raise SelectionError(f"{path}: ambiguous capture directory with {len(matching)} bundles ({hint}); "
                         f"candidates: {listing(matching)}")
