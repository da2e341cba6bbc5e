"""Opening exactly one bundle or cohort that a path names (:mod:`.locate` says what the path is): its verified
rank shards as a :class:`BundleSet`."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from ..errors import BundleError, SelectionError
from .files import _decode, _read_bytes
from .gcpause import gc_paused
from .layout import _RANK_DIR
from .locate import Resolved, _cohort_complete, _real_dir, resolve_bundle, resolve_capture
from .reader import BundleReader
from .schema import RANK_COMPLETE_DECODER, ActorStepId, BundleComplete, RankComplete


@dataclass
class BundleSet:
    """One bundle, or every rank shard of a cohort, verified. Stages run per shard."""

    path: Path
    shards: list[BundleReader]
    cohort: bool
    # Why this set is not a verified whole (``open_bundle(..., forensic=True)`` on an incomplete cohort);
    # ``None`` for every strict open.
    forensic: Optional[str] = None

    @property
    def bundle_id(self) -> str:
        return self.shards[0].bundle_id

    @property
    def warnings(self) -> list[str]:
        return ([self.forensic] if self.forensic else []) + [w for s in self.shards for w in s.warnings]

    def verify_selected(self, resolutions) -> None:
        """Before a replay's stages run (``defer_payloads``): each shard's payloads verified as far as its selection
        (``selection.Resolution``) reads them — the chunks of the selected samples' tokens for a partial one, every
        payload whole otherwise; a shard that selects nothing is not read."""
        for shard, res in zip(self.shards, resolutions):
            if not res.partial:
                shard.verify_deferred()
            elif res.indices:
                shard.verify_samples(res.indices)

    def confirm(self) -> None:
        """Every shard's deferred payload checksums judged (``open_bundle(..., defer_checksums=True)``;
        :meth:`BundleReader.confirm`): the first mismatch raised, shard by shard; a no-op for an eager open."""
        for shard in self.shards:
            shard.confirm()

    @contextmanager
    def checksums_first(self) -> Iterator[None]:
        """Whatever the block raises gives way to a deferred checksum's mismatch (SPEC §11): on an exception the
        checksums are judged first, and a mismatch is raised in its place."""
        try:
            yield
        except Exception:
            self.confirm()
            raise


def open_bundle(
    path: str | os.PathLike, step: Optional[ActorStepId] = None, rollout: Optional[int] = None,
    *, forensic: bool = False, defer_payloads: bool = False, defer_checksums: bool = False,
    verify_chunks: bool = False,
) -> BundleSet:
    """Resolve and verify a bundle, a cohort or a capture directory; anchors are checked exactly.

    ``defer_checksums=True`` (the replay's runner): the sha256 of safetensors payloads still being hashed are
    judged by :meth:`BundleSet.confirm`, which the caller calls before it reports anything derived from a payload
    and on any error before that (``reader`` module doc); every check of the open itself still gives way to them.

    ``forensic=True`` (the debugger's ``--forensic``, never a default) also opens a cohort whose final
    COMPLETE is missing: see :func:`_published_shards`. Everything else stays as strict as without it.
    ``defer_payloads=True`` (a selected replay): payloads with per-chunk checksums are verified chunk by chunk as
    they are read (``BundleReader``); :meth:`BundleSet.verify_selected` verifies what a selection reads.
    ``verify_chunks=True`` (``validate``): every payload's chunk list is checked against its chunks too."""
    with gc_paused():
        return _open_bundle(Path(path), step, rollout, forensic, defer_payloads, defer_checksums, verify_chunks)


def _published_shards(cohort: Path) -> tuple[BundleComplete, str]:
    """The ranks of an incomplete cohort that did publish, as a cohort COMPLETE would list them, and a line
    saying what is missing. A rank counts when its ``rank-<r>/`` directory is there with a rank sentinel:
    the cohort's ``COMPLETE.<r>``, else (a writer stopped between publishing the directory and the
    sentinel) the shard's own ``rank-<r>/COMPLETE.<r>``. Each shard is then verified by the reader as
    strictly as in a complete cohort (checksums, sizes, ids, tensors): only the cohort's promise that every
    expected rank is there is missing."""
    shards: dict[str, RankComplete] = {}
    expected: set[int] = set()
    for entry in sorted(cohort.iterdir(), key=lambda e: e.name):
        m = _RANK_DIR.match(entry.name)
        if not m or not _real_dir(entry) or not os.path.lexists(entry / "manifest.json"):
            continue
        rank = int(m.group(1))
        for sentinel in (cohort / f"COMPLETE.{rank}", entry / f"COMPLETE.{rank}"):
            if os.path.lexists(sentinel):
                shard = _decode(sentinel, _read_bytes(sentinel, f"COMPLETE.{rank}"), RANK_COMPLETE_DECODER)
                shards[str(rank)] = shard
                expected.update(shard.expected_ranks or ())
                break
    if not shards:
        raise BundleError(f"{cohort}: no rank shard published (no rank-<r>/ with a COMPLETE.<r>); nothing to "
                          f"open, even in forensic mode")
    ranks = sorted(int(r) for r in shards)
    missing = sorted(expected - set(ranks))
    note = (f"{cohort}: FORENSIC: incomplete cohort (no final COMPLETE), opened with rank(s) "
            f"{', '.join(map(str, ranks))}" + (f" of {', '.join(map(str, sorted(expected)))}; missing: "
                                              f"{', '.join(map(str, missing))}" if missing else "")
            + "; untrusted: the result cannot pass")
    return BundleComplete(ranks=ranks, shards=shards), note


def _open_bundle(path: Path, step: Optional[ActorStepId], rollout: Optional[int], forensic: bool = False,
                 defer_payloads: bool = False, defer_checksums: bool = False,
                 verify_chunks: bool = False) -> BundleSet:
    resolved = resolve_capture(path, step, rollout)
    shards: list[BundleReader] = []
    try:
        return _open_resolved(resolved, step, rollout, forensic, shards, defer_payloads, defer_checksums,
                              verify_chunks)
    except Exception:
        for shard in shards:  # the shards opened so far: a deferred checksum's mismatch comes first
            shard.confirm()
        raise


def _open_resolved(resolved: Resolved, step: Optional[ActorStepId], rollout: Optional[int], forensic: bool,
                   shards: list[BundleReader], defer_payloads: bool, defer_checksums: bool,
                   verify_chunks: bool = False) -> BundleSet:
    note = None
    if resolved.kind == "bundle":
        shards.append(BundleReader(resolved.path, _shard=resolved.shard, _rank=resolved.rank,
                                   defer_payloads=defer_payloads, defer_checksums=defer_checksums,
                                   verify_chunks=verify_chunks))
        cohort = False
    else:
        if forensic and not os.path.lexists(resolved.path / "COMPLETE"):
            complete, note = _published_shards(resolved.path)
        else:
            complete = _cohort_complete(resolved.path)
        for r in sorted(complete.ranks):
            shard_dir = resolved.path / f"rank-{r}"
            if not (shard_dir / "manifest.json").exists():
                raise BundleError(f"{shard_dir}: missing rank shard listed in cohort COMPLETE $.ranks")
            shards.append(BundleReader(shard_dir, _shard=complete.shards[str(r)], _rank=r,
                                       defer_payloads=defer_payloads, defer_checksums=defer_checksums,
                                       verify_chunks=verify_chunks))
        ids = {s.bundle_id for s in shards}
        if len(ids) != 1:
            raise BundleError(f"{resolved.path}: rank shards disagree on bundle_id: {sorted(ids)}")
        cohort = True
    first = shards[0].index.identity
    for s in shards[1:]:
        if (s.index.identity.actor_step_id, s.index.identity.rollout_id) != (first.actor_step_id, first.rollout_id):
            raise BundleError(f"{s.path / 'index.json'}: $.identity: anchor differs from rank {shards[0].rank}")
    check_anchor(resolved.path, first.actor_step_id, first.rollout_id, step, rollout)
    return BundleSet(path=resolved.path, shards=shards, cohort=cohort, forensic=note)


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


# What a path is, re-exported: callers that open bundles resolve paths through this module too.
__all__ = ["BundleSet", "Resolved", "check_anchor", "open_bundle", "resolve_bundle", "resolve_capture"]
