"""``validate``: format, integrity, safety, dependency closure — never recomputes numbers. (``inspect``, the
tolerant look that works on incomplete bundles, is :mod:`replay_lib.bundle.inspection`, re-exported here.)"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import msgspec

from ..bundle import BundleSet, open_bundle
from ..judge.error_model import tolerance_warnings
from ..errors import BundleError, UnsupportedError
from ..bundle.layout import PAYLOAD_DIR
from ..bundle.packed import payload_file
from .runner import check_closure, check_topology, stage_contracts
from ..bundle.schema import ActorStepId, StageCapability, StageId
from ..bundle.inspection import BundleInfo, InspectResult, PayloadRow, _pipeline_order, inspect  # noqa: F401
from ..stages import REGISTRY, STAGE_ORDER, UNSUPPORTED
from ..stages.loss import KNOB_TOKEN_PAYLOADS
from ..stages.grad import GRAD_PAYLOAD, GRAD_VALUES_PAYLOAD
from ..stages.sample import TOKEN_PAYLOADS

GRAD_TOKEN_PAYLOADS = (GRAD_PAYLOAD, GRAD_VALUES_PAYLOAD)  # loss.grad's (SPEC §4.3): their rows checked alike


class ValidationResult(msgspec.Struct, kw_only=True):
    bundle_id: str
    valid: bool
    path: str
    format_version: str
    kind: str
    anchor: str
    ranks: list[int]
    samples: int
    tokens: int
    stages: dict[str, str]
    warnings: list[str] = []
    replay_refusals: list[str] = []


def validate(path: str | Path, step: Optional[ActorStepId] = None, rollout: Optional[int] = None) -> ValidationResult:
    """Raise :class:`BundleError` (exit 3) on the first problem; return what was checked otherwise."""
    bundles = open_bundle(path, step=step, rollout=rollout, verify_chunks=True)
    return check_dependency_closure(bundles)


def check_dependency_closure(bundles: BundleSet) -> ValidationResult:
    refusals: list[str] = []
    for shard in bundles.shards:
        where = shard.path / "manifest.json"
        closed: list[StageId] = []
        for stage in STAGE_ORDER:
            contract = shard.manifest.stage_contracts.get(stage)
            if contract is None or contract.capability != StageCapability.RECOMPUTE:
                continue
            if stage in UNSUPPORTED or stage not in REGISTRY:
                refusals.append(f"{where}: $.stage_contracts.{stage.value}: declared recompute but "
                                f"{UNSUPPORTED.get(stage, 'this engine has no adapter for it')}")
                continue
            closed.append(stage)
        check_closure(shard, closed)
        for name in shard.payload_names:
            t = shard.payload(name)
            if t.dim() == 0:
                raise BundleError(f"{payload_file(shard.path / PAYLOAD_DIR, name, shard.manifest.format_version)}: per-token payload must have a token dimension")
        check_token_counts(shard)
        runnable = [s for s in STAGE_ORDER if s in REGISTRY and s not in UNSUPPORTED
                    and (c := shard.manifest.stage_contracts.get(s)) is not None and c.capability == StageCapability.RECOMPUTE]
        try:
            check_topology(shard, runnable)
        except UnsupportedError as exc:
            refusals.append(str(exc))
    first = bundles.shards[0]
    return ValidationResult(
        bundle_id=bundles.bundle_id,
        valid=True,
        path=str(bundles.path),
        format_version=first.manifest.format_version,
        kind=first.index.identity.kind,
        anchor=first.index.identity.anchor,
        ranks=[s.rank if s.rank is not None else 0 for s in bundles.shards],
        samples=sum(len(s.index.samples) for s in bundles.shards),
        tokens=sum(sum(max(x.response_length, 0) for x in s.index.samples) for s in bundles.shards),
        stages=_pipeline_order(stage_contracts(first)),  # with the stages replay plans on its own (logprob.mismatch)
        # the bundle's own looser tolerances, worded as replay words them (under its default policy)
        warnings=list(dict.fromkeys([*bundles.warnings, *(w for shard in bundles.shards for w in tolerance_warnings(
            shard.manifest, str(shard.path / "manifest.json")))])),
        replay_refusals=sorted(set(refusals)),
    )


def check_token_counts(shard) -> None:
    """What the ``sample`` stage checks that needs no arithmetic (SPEC §4): every sample's loss mask holds
    ``response_length`` values, and every per-token payload has Σ response_length rows. ``validate`` refuses
    a bundle where they do not (exit 3, naming the sample or the payload); a replay runs the sample stage,
    which reports the same facts as its divergences."""
    samples = shard.index.samples
    lengths = [s.response_length for s in samples]
    if [shard.mask_length(i) for i in range(len(samples))] != lengths:
        i = next(i for i, s in enumerate(samples) if shard.mask_length(i) != s.response_length)
        raise BundleError(
            f"{shard.path / 'index.json'}: $.samples[{i}].loss_mask: {shard.mask_length(i)} value(s), "
            f"$.samples[{i}].response_length is {lengths[i]} (sample {samples[i].sample_id!r})"
        )
    total = sum(lengths)  # each is a mask's length now: no sum of hostile numbers
    for name in (*TOKEN_PAYLOADS, *KNOB_TOKEN_PAYLOADS, *GRAD_TOKEN_PAYLOADS):
        if not shard.has_payload(name):
            continue
        rows = int(shard.payload(name).shape[0])
        if rows == total:
            continue
        if rows > total:
            where = f"{rows - total} row(s) after the last sample's tokens"
        else:  # the first sample whose tokens have no row
            start, i = 0, 0
            while start + lengths[i] <= rows:
                start, i = start + lengths[i], i + 1
            where = f"sample {samples[i].sample_id!r} ($.samples[{i}]) has none from its token {rows - start} on"
        raise BundleError(f"{payload_file(shard.path / PAYLOAD_DIR, name, shard.manifest.format_version)}: {rows} row(s), "
                          f"index.json Σ $.samples[*].response_length is {total} ({where})")


# ------------------------------------------------------------------------------------------ inspect
