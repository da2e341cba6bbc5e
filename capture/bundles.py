"""Writer-thread side: turn captured records into replay bundles with ``replay_lib.bundle.BundleWriter``.

Everything here runs on the writer thread: device→host copies, ``tolist()``, hashing and disk I/O.

Two bundle kinds (SPEC §6):
* rollout-level ``rollout-<R>`` — ``sample → reward.raw → reward.post_process → advantage.kl →
  advantage.estimate``, anchored by ``rollout_id``;
* step-level ``step-<R>-<S>`` — ``sample → loss.policy``, anchored by ``actor_step_id=(R, S)``; the step's
  micro-batches arrive as separate ``step-part`` records and are written once the ``step-end`` arrives.

A step bundle also carries the trainer's per-sample loss terms (``expected.json $.loss.policy.per_sample``, in
float64) and, when token terms are on, the per-token surrogate payload ``pg_losses`` (SPEC §4); every bundle
declares ``comparison_policy.producer_precision`` as the records it was built from show it (see
``capture.actor``).

Either kind adds ``logprob.support`` (SPEC §7) when the trainer scored its recorded log-probs over the
sampler's recorded support: the support side channels become payloads, ``config.support_scored`` names the
log-probs scored with the recorded member logits, and the contract is ``recompute`` (member logits present)
or ``inspect-only`` (ids only).

One producer writes ``<DIR>/<bundle_id>/``; several write ``<DIR>/<bundle_id>/rank-<r>/`` + ``COMPLETE.<r>``
and try to finalize the cohort (SPEC §2).

A publication (staging → payloads → rename → cohort sentinel) holds the sink's publishing lock, and looks
between its steps whether the process is terminating (:meth:`BundleSink.terminate`, called by the SIGTERM
handler of ``capture.terminate``): it then stops, and ``BundleWriter`` removes its staging, before the
process dies.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import msgspec
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.stages.support import SCORED_FIELDS, SUPPORT_TOKEN_PAYLOADS
from replay_lib.kernels import LOSS_FIELDS, POLICY_FIELDS, VALUE_FIELDS
from replay_lib.bundle.schema import (
    FORMAT_2_REMOVED_STAGES,
    FORMAT_2_VERSION,
    WRITE_FORMAT_VERSION,
    PER_SAMPLE_KEY,
    PER_SAMPLE_SUMS,
    PER_SAMPLE_TERMS,
    ActorStepId,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    ProducerInfo,
    RecomputeConfig,
    SampleRecord,
    StageCapability,
    StageId,
    Tolerance,
    WeightLineage,
    stage_contracts,
)

from .manager import CaptureItem

ROLLOUT_STAGES = (
    StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_KL,
    StageId.ADVANTAGE_ESTIMATE,
)
STEP_STAGES = (StageId.SAMPLE, StageId.LOSS_POLICY)

# Prompts and responses are stored as sha256 by default; labels only as ``label_hash``; the rest dropped.
DEFAULT_REDACTION = {"prompt": "hash", "response": "hash", "label": "drop", "tool_output": "drop"}

# Optional per-token side channels of a bundle (first dimension = Σ response_length), the payloads of stage
# ``logprob.support`` (SPEC §7): sampler support rows, the member logits of the forward that scored the
# recorded log-probs, the sampled ids, full-vocabulary log-probs, routed experts, context-parallel shard.
SUPPORT_CHANNELS = SUPPORT_TOKEN_PAYLOADS
# Recorded log-prob payloads a trainer may score over the recorded support (``config.support_scored``).
SUPPORT_SCORABLE = tuple(SCORED_FIELDS)
# Dtype each channel is written with (the writer casts after the device→host copy; integer channels keep
# their own integer dtype except the support ids, which the format fixes at int32).
_CHANNEL_DTYPES = {"support_ids": torch.int32, "support_logits": torch.float32, "full_log_probs": torch.float32}

# Names a step-part record gives its per-sample loss terms and its reported loss fields under (never payload
# names: the writer turns them into expected.json values).
# The fields a step may report (loss.policy's with the SPEC §4.2 knobs', loss.value's) and PPO's payloads.
REPORTED_FIELDS = POLICY_FIELDS + VALUE_FIELDS
VALUE_PAYLOADS = ("values", "old_values", "returns")
# loss.grad's payloads (SPEC §4.3), and its tolerance: per-token gradients are ~1/T of the loss, far below the
# loss fields' atol, so their rounding bound alone (plus 1e-6 relative) judges them.
GRAD_PAYLOADS = ("grad_log_probs", "grad_values")
GRAD_TOLERANCE = Tolerance(atol=0.0, rtol=1e-6)
TERM_PREFIX = "term:"
FIELD_PREFIX = "field:"
# The declared per-token compute formats (SPEC §5.1 ``producer_precision.compute``).
COMPUTE_PRECISIONS = ("float32", "bfloat16", "float16")


def rollout_bundle_id(rollout_id: int) -> str:
    return f"rollout-{int(rollout_id)}"


def step_bundle_id(rollout_id: int, step_id: int) -> str:
    return f"step-{int(rollout_id)}-{int(step_id)}"


def micro_batch_id(index: int) -> str:
    """The data-iterator index of a micro-batch within its actor step."""
    return f"mb-{int(index):04d}"


@dataclass(frozen=True)
class Provenance:
    """Physical provenance shared by a rollout and the steps trained on it."""

    rollout_weight: Optional[int | str] = None
    actor_weight: Optional[int | str] = None
    rollout_partition_ids: tuple = ()
    consumer_batch_ids: tuple = ()
    normalization_cohort_ids: tuple = ()

    def lineage(self) -> WeightLineage:
        return WeightLineage(rollout_weight=self.rollout_weight, actor_weight=self.actor_weight)


@dataclass(frozen=True)
class SampleMeta:
    """Host-side per-sample metadata (plain Python values, copied on the training thread)."""

    sample_ids: tuple[str, ...]
    group_index: tuple[Optional[int], ...]
    response_lengths: tuple[int, ...]
    total_lengths: tuple[int, ...]
    prompts: Optional[tuple[str, ...]] = None
    responses: Optional[tuple[str, ...]] = None
    labels: Optional[tuple[str, ...]] = None


@dataclass(frozen=True)
class RolloutMeta:
    rollout_id: int
    samples: SampleMeta
    provenance: Provenance
    # The recorded log-probs the trainer scored over the recorded support (None: not support-scored).
    support_scored: Optional[tuple[str, ...]] = None
    reward_terms: Mapping = field(default_factory=dict)  # more values under expected.json $.reward.raw
    config: Optional[RecomputeConfig] = None  # this rollout's own config (None: the producer's)


@dataclass(frozen=True)
class StepPartMeta:
    token: int
    actor_step_id: ActorStepId
    mb_index: int
    samples: SampleMeta


@dataclass(frozen=True)
class StepEndMeta:
    token: int
    actor_step_id: ActorStepId
    n_parts: int
    provenance: Provenance
    broken: Optional[str] = None  # why the training side gave up on this step (a dropped micro-batch)
    support_scored: Optional[tuple[str, ...]] = None
    config: Optional[RecomputeConfig] = None  # this step's own config (None: the producer's)
    advantage_estimate: bool = False  # also declare advantage.estimate (the samples carry their rewards)


@dataclass(frozen=True)
class ProducerContext:
    """Static facts of one producer: where it writes, its rank in the cohort, the recompute config."""

    directory: Path
    config: RecomputeConfig
    rank_sizes: dict
    producer_rank: Optional[int] = None  # None: the single producer (no rank-* shards)
    producer_world: int = 1
    redaction: dict = field(default_factory=lambda: dict(DEFAULT_REDACTION))
    tolerance: Tolerance = Tolerance(atol=1e-6, rtol=1e-5)
    compute_precision: str = "float32"
    format_major: int = 1  # 2: bundles of the original's format 2.0.0 (RELAX_REPLAY_CAPTURE_FORMAT=2)


def _as_format_2(stages, capabilities, index: BundleIndex, expected: dict):
    """A bundle's parts as format 2.0.0 holds them: without the reward stages (each sample's ``reward``, the
    post-processed one, is advantage.estimate's input), raw rewards, expected reward values or normalization
    cohort ids."""
    stages = tuple(s for s in stages if s.value not in FORMAT_2_REMOVED_STAGES)
    capabilities = {s: c for s, c in dict(capabilities or {}).items() if s.value not in FORMAT_2_REMOVED_STAGES}
    samples = [msgspec.structs.replace(s, raw_reward=None) if s.raw_reward is not None else s for s in index.samples]
    index = msgspec.structs.replace(index, samples=samples, identity=msgspec.structs.replace(
        index.identity, normalization_cohort_ids=[]))
    expected = {k: v for k, v in expected.items() if k not in FORMAT_2_REMOVED_STAGES}
    return stages, capabilities, index, expected


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu") if t.device.type != "cpu" else t


def _float_list(t: torch.Tensor) -> list[float]:
    """The values as JSON floats: float64, so a float64 producer's values are kept whole (a float32 tensor's
    values are the same either way)."""
    return [float(x) for x in _cpu(t).to(torch.float64).reshape(-1).tolist()]


def _comparison_policy(*, exact_fields: list[str], tolerances: dict[str, Tolerance],
                       precision: dict[str, str]) -> ComparisonPolicy:
    # decoded into the schema's own type for the declaration (and checked by it)
    return msgspec.convert({"exact_fields": exact_fields, "tolerances": msgspec.to_builtins(tolerances),
                            "producer_precision": precision}, ComparisonPolicy)


def _accumulated_in(tensors) -> str:
    """``producer_precision.accumulate`` as the reported sums show it: float64 only when every one of them
    arrived as float64 (a float32 result carries float32 rounding, whatever it was summed in)."""
    return "float64" if all(t.dtype == torch.float64 for t in tensors) else "float32"


def _channel(name: str, t: torch.Tensor) -> torch.Tensor:
    """A side channel on the host in the dtype the format fixes for it."""
    t = _cpu(t)
    want = _CHANNEL_DTYPES.get(name)
    return t.to(want) if want is not None and t.dtype != want else t


def support_capability(payloads: Mapping[str, torch.Tensor],
                       support_scored: Optional[Sequence[str]]) -> Optional[StageCapability]:
    """The ``logprob.support`` contract a bundle declares: ``recompute`` when the trainer scored log-probs
    over the recorded support and the member logits are recorded, ``inspect-only`` when only the ids are,
    none when the log-probs were not support-scored (support rows then ride along for inspection only)."""
    if support_scored is None or "support_ids" not in payloads:
        return None
    return StageCapability.RECOMPUTE if "support_logits" in payloads else StageCapability.INSPECT_ONLY


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


class CaptureTerminated(RuntimeError):
    """A publication stopped because the process is terminating (SIGTERM)."""


class BundleSink:
    """The writer-thread handler: ``handle(item)`` writes a bundle or stashes a micro-batch."""

    def __init__(
        self,
        context: ProducerContext,
        producer: Callable[[], ProducerInfo],
        note_abandoned: Callable[[str, str], None],
    ):
        self.context = context
        self._producer_fn = producer
        self._producer: Optional[ProducerInfo] = None
        self._note_abandoned = note_abandoned
        self._pending: dict[int, list[tuple[StepPartMeta, dict[str, torch.Tensor]]]] = {}
        self._publishing = threading.Lock()  # held by the writer thread while a bundle is published
        self._terminating = threading.Event()
        self._staging: Optional[Path] = None  # the staging of the publication in progress (or last aborted)
        self._finalizing = False

    # -- termination (SIGTERM) ---------------------------------------------------------------------
    def terminate(self, deadline: float) -> bool:
        """Stop publishing and make sure no staging of this sink is left: called on the main thread by
        the SIGTERM handler, just before the process dies. Waits (until ``deadline``, ``time.monotonic``)
        for the publication in progress to stop at its next step and remove its staging; past the deadline
        a staging directory still being filled is removed under the writer (one being renamed into place is
        left to it). Returns whether nothing of this sink is left staged."""
        self._terminating.set()
        if self._publishing.acquire(timeout=max(0.0, deadline - time.monotonic())):
            staging = self._staging  # kept: nothing publishes after this
        elif self._finalizing:
            return False
        else:
            staging = self._staging
        for _attempt in range(3):  # a writer still filling it may add a file between listing and rmdir
            if staging is None or not os.path.lexists(staging):
                return True
            shutil.rmtree(staging, ignore_errors=True)
        return not os.path.lexists(staging)

    def _check_running(self, bundle_id: str) -> None:
        if self._terminating.is_set():
            raise CaptureTerminated(f"{bundle_id}: not published, the process is terminating (SIGTERM)")

    # -- dispatch ----------------------------------------------------------------------------------
    def handle(self, item: CaptureItem) -> Optional[int]:
        if item.kind == "rollout":
            return self._write_rollout(item.meta, item.tensors)
        if item.kind == "step-part":
            self._stash(item.meta, item.tensors)
            return None
        if item.kind == "step-end":
            return self._write_step(item.meta, item.tensors)
        raise ValueError(f"unknown capture record kind {item.kind!r}")

    def abandon_pending(self, why: str) -> None:
        """Give up on steps whose end record never came (call only when the writer thread is idle)."""
        for token in sorted(self._pending):
            parts = self._pending.pop(token)
            self._note_abandoned(step_bundle_id(*_step_of(parts)), why)

    # -- shared pieces -----------------------------------------------------------------------------
    @property
    def producer(self) -> ProducerInfo:
        if self._producer is None:
            self._producer = self._producer_fn()
        return self._producer

    def _records(self, samples: SampleMeta, tensors: dict[str, torch.Tensor], mb_ids: Optional[list[str]] = None):
        lengths = [int(n) for n in samples.response_lengths]
        mask = [int(m) for m in _cpu(tensors["loss_mask"]).reshape(-1).tolist()] if "loss_mask" in tensors else None
        raw = _float_list(tensors["raw_rewards"]) if "raw_rewards" in tensors else None
        rewards = _float_list(tensors["rewards"]) if "rewards" in tensors else None
        records = []
        start = 0
        for i, sample_id in enumerate(samples.sample_ids):
            n = lengths[i]
            records.append(SampleRecord(
                sample_id=str(sample_id),
                group_index=None if samples.group_index[i] is None else int(samples.group_index[i]),
                response_length=n,
                total_length=int(samples.total_lengths[i]),
                loss_mask=mask[start:start + n] if mask is not None else [1] * n,
                raw_reward=raw[i] if raw is not None else None,
                reward=rewards[i] if rewards is not None else None,
                label_hash=_sha256(samples.labels[i]) if samples.labels is not None else None,
                micro_batch_id=mb_ids[i] if mb_ids is not None else None,
                # Raw text goes to the writer, which stores it only as the redaction policy says.
                prompt=samples.prompts[i] if samples.prompts is not None else None,
                response=samples.responses[i] if samples.responses is not None else None,
            ))
            start += n
        return records, raw, rewards

    def _identity(self, *, rollout_id=None, actor_step_id=None, provenance: Provenance, micro_batch_ids=(),
                  groups=()) -> Identity:
        return Identity(
            actor_step_id=actor_step_id,
            rollout_id=rollout_id,
            rollout_partition_ids=list(provenance.rollout_partition_ids),
            consumer_batch_ids=list(provenance.consumer_batch_ids),
            micro_batch_ids=list(micro_batch_ids),
            semantic_group_ids=sorted({g for g in groups if g is not None}),
            normalization_cohort_ids=list(provenance.normalization_cohort_ids),
            weight_lineage=provenance.lineage(),
            rank=dict(self.context.rank_sizes),
        )

    def _manifest(self, bundle_id: str, stages: Sequence[StageId],
                  capabilities: Optional[Mapping[StageId, StageCapability]] = None,
                  accumulate: str = "float32") -> Manifest:
        contracts = stage_contracts(stages, capabilities=dict(capabilities or {}),
                                    declare_value=StageId.LOSS_VALUE not in stages)
        policy = _comparison_policy(
            exact_fields=[] if self.context.format_major == 2 else ["reward.raw.raw_reward"],  # 2.0: no reward.raw
            tolerances={str(stage): GRAD_TOLERANCE if stage == StageId.LOSS_GRAD else self.context.tolerance
                        for stage in stages},
            precision={"compute": self.context.compute_precision, "accumulate": accumulate},
        )
        return Manifest(format_version=WRITE_FORMAT_VERSION, bundle_id=bundle_id, producer=self.producer,
                        stage_contracts=contracts, payloads={}, comparison_policy=policy,
                        redaction=dict(self.context.redaction))

    def _config(self, support_scored: Optional[Sequence[str]],
                own: Optional[RecomputeConfig] = None) -> RecomputeConfig:
        config = self.context.config if own is None else own
        if support_scored is None:
            return config
        return msgspec.structs.replace(config, support_scored=list(support_scored))

    def _with_support(self, stages: Sequence[StageId], payloads: dict, support_scored):
        """``(stages, capabilities)`` with ``logprob.support`` added when the bundle declares it."""
        capability = support_capability(payloads, support_scored)
        if capability is None:
            return tuple(stages), {}
        return (*stages, StageId.LOGPROB_SUPPORT), {StageId.LOGPROB_SUPPORT: capability}

    def _publish(self, bundle_id: str, stages, index: BundleIndex, expected: dict, payloads: dict,
                 capabilities: Optional[Mapping[StageId, StageCapability]] = None, accumulate: str = "float32") -> int:
        ctx = self.context
        if ctx.format_major == 2:
            stages, capabilities, index, expected = _as_format_2(stages, capabilities, index, expected)
        manifest = self._manifest(bundle_id, stages, capabilities, accumulate)
        root = ctx.directory / bundle_id
        with self._publishing:
            self._check_running(bundle_id)
            try:
                with BundleWriter(root, manifest, index, expected, rank=ctx.producer_rank,
                                  format_version=FORMAT_2_VERSION if ctx.format_major == 2 else None) as writer:
                    self._staging = writer.staging
                    for name, tensor in payloads.items():
                        self._check_running(bundle_id)
                        writer.write_payload(name, _cpu(tensor))
                    self._finalizing = True  # before the last look: terminate() never removes it after
                    self._check_running(bundle_id)
                    path = writer.finalize(ranks=[0] if ctx.producer_rank is None
                                           else list(range(ctx.producer_world)))
                self._staging = None  # renamed into place
            finally:
                self._finalizing = False
        written = _tree_bytes(path)
        if ctx.producer_rank is not None:
            sentinel = root / f"COMPLETE.{ctx.producer_rank}"
            written += sentinel.stat().st_size if sentinel.exists() else 0
        return written

    # -- rollout-level -----------------------------------------------------------------------------
    def _write_rollout(self, meta: RolloutMeta, tensors: dict[str, torch.Tensor]) -> int:
        bundle_id = rollout_bundle_id(meta.rollout_id)
        records, raw, rewards = self._records(meta.samples, tensors)
        index = BundleIndex(
            bundle_id=bundle_id,
            identity=self._identity(rollout_id=int(meta.rollout_id), provenance=meta.provenance,
                                    groups=meta.samples.group_index),
            samples=records,
            config=self._config(meta.support_scored, meta.config),
        )
        scored = _float_list(tensors["scored_rewards"]) if "scored_rewards" in tensors else raw
        expected = {
            "reward.raw": {**meta.reward_terms, "raw_rewards": scored},
            "reward.post_process": {"rewards": rewards},
        }
        payloads = {"old_log_probs": tensors["old_log_probs"]}
        if "ref_log_probs" in tensors:
            payloads["ref_log_probs"] = tensors["ref_log_probs"]
        payloads["kl"] = tensors["kl"]
        payloads["advantages"] = tensors["advantages"]
        # GAE's critic values and returns (SPEC §4.2); the engine's log-probs and the sampling policy versions
        # (stage logprob.mismatch, SPEC §4.4)
        for name in ("values", "returns", "rollout_log_probs", "policy_versions"):
            if name in tensors:
                payloads[name] = tensors[name]
        for name in SUPPORT_CHANNELS:
            if name in tensors:
                payloads[name] = _channel(name, tensors[name])
        stages, capabilities = self._with_support(ROLLOUT_STAGES, payloads, meta.support_scored)
        return self._publish(bundle_id, stages, index, expected, payloads, capabilities,
                             _accumulated_in([tensors["rewards"]]))

    # -- step-level --------------------------------------------------------------------------------
    def _stash(self, meta: StepPartMeta, tensors: dict[str, torch.Tensor]) -> None:
        self._drop_stale(meta.token)
        # The device→host copy happens here, micro-batch by micro-batch, while training continues.
        self._pending.setdefault(meta.token, []).append((meta, {k: _cpu(v) for k, v in tensors.items()}))

    def _drop_stale(self, token: int) -> None:
        # Steps are captured one after another: an older step still pending lost its end record.
        for old in [t for t in self._pending if t < token]:
            parts = self._pending.pop(old)
            self._note_abandoned(step_bundle_id(*_step_of(parts)), "its step-end record never arrived")

    def _write_step(self, meta: StepEndMeta, tensors: dict[str, torch.Tensor]) -> Optional[int]:
        self._drop_stale(meta.token)
        bundle_id = step_bundle_id(meta.actor_step_id.rollout_id, meta.actor_step_id.step_id)
        parts = self._pending.pop(meta.token, [])
        if meta.broken is not None:
            self._note_abandoned(bundle_id, meta.broken)
            return None
        if len(parts) != meta.n_parts or not parts:
            self._note_abandoned(bundle_id, f"{len(parts)} of {meta.n_parts} micro-batch record(s) arrived")
            return None
        parts.sort(key=lambda p: p[0].mb_index)
        records: list[SampleRecord] = []
        mb_ids: list[str] = []
        groups: list[Optional[int]] = []
        columns: dict[str, list[torch.Tensor]] = {}
        for part_meta, part in parts:
            mb = micro_batch_id(part_meta.mb_index)
            mb_ids.append(mb)
            part_records, _, _ = self._records(part_meta.samples, part, [mb] * len(part_meta.samples.sample_ids))
            records += part_records
            groups += list(part_meta.samples.group_index)
            for name, tensor in part.items():
                columns.setdefault(name, []).append(tensor.reshape(-1) if tensor.dim() <= 1 else tensor)
        payloads = {}
        for name in ("log_probs", "old_log_probs", "ref_log_probs", "rollout_log_probs", "entropy", "advantages",
                     "pg_losses", *VALUE_PAYLOADS, *SUPPORT_CHANNELS, *GRAD_PAYLOADS, "policy_versions",
                     "teacher_log_probs"):
            if name in columns:
                if len(columns[name]) != len(parts):
                    raise ValueError(f"{bundle_id}: payload {name!r} given for only some micro-batches")
                payloads[name] = _channel(name, torch.cat(columns[name]))
        index = BundleIndex(
            bundle_id=bundle_id,
            identity=self._identity(actor_step_id=meta.actor_step_id, provenance=meta.provenance,
                                    micro_batch_ids=mb_ids, groups=groups),
            samples=records,
            config=self._config(meta.support_scored, meta.config),
        )
        step_stages = STEP_STAGES
        if meta.advantage_estimate:
            missing = [r.sample_id for r in records if r.reward is None]
            if missing:
                raise ValueError(f"{bundle_id}: advantage.estimate needs every sample's reward; "
                                 f"{len(missing)} sample(s) have none (first {missing[0]!r})")
            step_stages = (StageId.SAMPLE, StageId.ADVANTAGE_ESTIMATE, StageId.LOSS_POLICY)
        reported = _reported_fields(bundle_id, tensors, columns, len(parts))
        loss = {name: float(_cpu(t).reshape(())) if t.dim() == 0 else math.fsum(t.tolist())
                for name, t in reported.items()}
        terms = _per_sample_terms(bundle_id, columns, len(parts))
        if terms:
            loss[PER_SAMPLE_KEY] = {name: t.tolist() for name, t in terms.items()}
        # as handed over (before the float64 casts above)
        sums = [tensors[n] for n in LOSS_FIELDS if n in tensors] + [
            t for n in (*(FIELD_PREFIX + f for f in LOSS_FIELDS), *(TERM_PREFIX + n for n in PER_SAMPLE_SUMS))
            for t in columns.get(n, ())]
        expected = {"loss.policy": loss}
        value = {name: loss.pop(name) for name in VALUE_FIELDS if name in loss}
        if value:  # PPO: loss.value recomputes the critic's loss from the recorded values and returns
            missing = [n for n in VALUE_PAYLOADS if n not in payloads]
            if missing:
                raise ValueError(f"{bundle_id}: loss fields {sorted(value)} need the payload(s) {', '.join(missing)}")
            expected["loss.value"] = value
            step_stages = (*step_stages, StageId.LOSS_VALUE)
        if "grad_log_probs" in payloads:  # loss.grad (SPEC §4.3): the gradient a hook on the log-probs saw
            step_stages = (*step_stages, StageId.LOSS_GRAD)
        stages, capabilities = self._with_support(step_stages, payloads, meta.support_scored)
        return self._publish(bundle_id, stages, index, expected, payloads, capabilities, _accumulated_in(sums))


def _reported_fields(bundle_id: str, end: dict[str, torch.Tensor], columns: dict[str, list[torch.Tensor]],
                     n_parts: int) -> dict[str, torch.Tensor]:
    """The step's reported loss fields: those ``finish()`` gave (0-d), else each field's micro-batch values
    (1-D, in data-iterator order), which the caller sums in float64."""
    if any(name in end for name in REPORTED_FIELDS):
        return {name: end[name] for name in REPORTED_FIELDS if name in end}
    return _joined_columns(bundle_id, columns, n_parts, FIELD_PREFIX, REPORTED_FIELDS, "loss field")


def _per_sample_terms(bundle_id: str, columns: dict[str, list[torch.Tensor]], n_parts: int) -> dict[str, torch.Tensor]:
    """``{term: float64 [samples]}`` of the per-sample loss terms the micro-batches gave, in index order."""
    return _joined_columns(bundle_id, columns, n_parts, TERM_PREFIX, PER_SAMPLE_TERMS, "loss term")


def _joined_columns(bundle_id: str, columns: dict[str, list[torch.Tensor]], n_parts: int, prefix: str,
                    names, what: str) -> dict[str, torch.Tensor]:
    """Each named column's micro-batch pieces joined in data-iterator order, as float64; a column that only
    some micro-batches gave is an error (the step's values would be a partial sum)."""
    out = {}
    for name in names:
        column = columns.get(prefix + name)
        if column is None:
            continue
        if len(column) != n_parts:
            raise ValueError(f"{bundle_id}: {what} {name!r} given for only some micro-batches")
        out[name] = torch.cat(column).to(torch.float64)
    return out


def _step_of(parts) -> tuple[int, int]:
    step = parts[0][0].actor_step_id
    return step.rollout_id, step.step_id


def _sha256(text: str) -> str:
    return hashlib.sha256(str(text).encode("utf-8")).hexdigest()
