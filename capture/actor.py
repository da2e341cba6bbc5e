"""The hooks a training actor calls: ``maybe_enable_for_actor`` → ``capture_rollout`` / ``begin_step``.

Everything here runs on the training thread and does only cheap work: argument normalisation, filter checks
and ``CaptureManager.submit`` (device-side copies + a non-blocking enqueue). See ``bundles.py`` for the
writer-thread side.

    capture = maybe_enable_for_actor(recompute_config, pp_rank=…, pp_size=…, dp_rank=…, dp_size=…)
    capture.capture_rollout(rollout_id, sample_ids=…, raw_rewards=…, rewards=…, old_log_probs=…, …)
    step = capture.begin_step(rollout_id, step_id, provenance=…)
    for mb in micro_batches:
        step.add_micro_batch(sample_ids=…, log_probs=…, old_log_probs=…, advantages=…, entropy=…, …)
    step.finish(loss_fields)        # the fields the trainer reports for the whole step
    capture.close(timeout=60)

Per-sample and per-token loss terms (SPEC §4, §6): each micro-batch may give ``loss_terms`` — its samples'
``pg_sum, entropy_sum, kl_sum`` (Σ_t x·mask of the surrogate, the entropy and ``old − logp``) and
``clip_count, mask_count`` (Σ_t of the clip indicator and of the mask), as the trainer's loss computed them —
and ``pg_losses``, the per-token surrogate before aggregation. They become ``expected.json
$.loss.policy.per_sample`` and (with ``RELAX_REPLAY_CAPTURE_TOKEN_TERMS=1``) the payload ``pg_losses``, which
the replay compares before the scalars, so a wrong loss is located to its sample and token. A micro-batch may
also give its reported ``loss_fields``; ``finish()`` without fields then reports their sum over the
micro-batches, taken in float64 on the writer thread.

Gradients (SPEC §4.3, ``RELAX_REPLAY_CAPTURE_GRAD=1``): ``step.grad_tap(log_probs)`` hooks the micro-batch's
log-prob tensor before backward; ``add_micro_batch(grad_log_probs=tap.gradient())`` after it records the payload
``grad_log_probs`` (``grad_values`` alike) and the step bundle declares ``loss.grad``.

Precision (``comparison_policy.producer_precision``, SPEC §5.1): ``compute`` is what the trainer computed its
per-token values in (``compute_precision``, default float32); ``accumulate`` is read off what it handed over:
``float64`` when every reported sum (the loss fields and the per-sample sums; Python numbers count as float64)
arrived as float64 — a float32 tensor carries float32 rounding whatever it was accumulated in — else
``float32``. A rollout bundle's is ``float64`` when its post-processed rewards arrived as float64.

Sample-support scoring (SPEC §7, stage ``logprob.support``): both hooks take ``side_channels`` — per-token
rows ``[Σ T, …]`` named in ``SUPPORT_CHANNELS`` (``support_ids``, ``support_logits``, ``sampled_token_ids``,
``full_log_probs``, ``routed_experts``, ``cp_shard``) — and ``support_scored``: the recorded log-probs the
trainer scored over the recorded support, with ``support_logits`` gathered from the same forward. Given
``support_scored``, the bundle declares ``logprob.support`` (``recompute`` with member logits,
``inspect-only`` with ids only) and writes ``config.support_scored``; without it, support rows are stored
for inspection and no contract is declared. Shapes and dtypes are checked here (metadata only, no device
synchronisation); the casts and device→host copies happen on the writer thread.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import weakref
from typing import Mapping, Optional, Sequence, Union

import torch

from replay_lib.kernels import POLICY_FIELDS, VALUE_FIELDS
from replay_lib.bundle.schema import ID_MAX_CHARS, PER_SAMPLE_TERMS, ActorStepId, RecomputeConfig, RedactionPolicy

from .grad import GradTap
from .bundles import (
    DEFAULT_REDACTION,
    SUPPORT_CHANNELS,
    SUPPORT_SCORABLE,
    COMPUTE_PRECISIONS,
    FIELD_PREFIX,
    TERM_PREFIX,
    BundleSink,
    ProducerContext,
    Provenance,
    RolloutMeta,
    SampleMeta,
    StepEndMeta,
    StepPartMeta,
    rollout_bundle_id,
    step_bundle_id,
)
from . import terminate
from .config import CaptureConfig, config_from_env
from .directory import check_fresh_directory, remove_stale_staging
from .lock import CaptureDirectoryBusy, CaptureLock, acquire_capture_lock
from .manager import CaptureItem, CaptureManager, CaptureStats
from .producer import producer_info
from .ring import GRAD_NORM_KEY, RING_OFF, CaptureRing, RingConfig, ring_config_from_env

logger = logging.getLogger("capture")

TensorLike = Union[torch.Tensor, Sequence[torch.Tensor], Sequence[float], Sequence[Sequence[float]]]


def _flat(value: TensorLike, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A 1-D tensor from a tensor, per-sample tensors (concatenated on their device) or Python numbers."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1) if value.dim() != 1 else value
    items = list(value)
    if items and isinstance(items[0], torch.Tensor):
        return torch.cat([t.reshape(-1) for t in items])
    if items and isinstance(items[0], (list, tuple)):
        items = [x for row in items for x in row]
    return torch.tensor(items, dtype=dtype if dtype is not None else torch.float32)


def _rows(value: Union[torch.Tensor, Sequence[torch.Tensor]]) -> torch.Tensor:
    """Per-token side channels ``[Σ T, …]``: a tensor as is, or per-sample tensors concatenated."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.cat(list(value))


# Each side channel: (dimensions, "int" | "float").
_CHANNEL_KINDS = {
    "sampled_token_ids": (1, "int"), "support_ids": (2, "int"), "support_logits": (2, "float"),
    "full_log_probs": (1, "float"), "routed_experts": (3, "int"), "cp_shard": (1, "int"),
}
SideChannels = Mapping[str, Union[torch.Tensor, Sequence[torch.Tensor]]]


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _side_channels(label: str, channels: Optional[SideChannels], tokens: int,
                   config: RecomputeConfig) -> dict[str, torch.Tensor]:
    """Per-token side channels as ``[tokens, …]`` tensors, refused (``ValueError``) when a name, rank,
    row count or dtype is wrong — all metadata, so nothing here waits for a device."""
    out: dict[str, torch.Tensor] = {}
    for name, value in (channels or {}).items():
        if name not in _CHANNEL_KINDS:
            raise ValueError(f"{label}: unknown side channel {name!r} (expected one of {', '.join(SUPPORT_CHANNELS)})")
        t = _rows(value)
        dims, kind = _CHANNEL_KINDS[name]
        if t.dim() != dims:
            raise ValueError(f"{label}: side channel {name!r} must have {dims} dimension(s), got shape {list(t.shape)}")
        if t.shape[0] != tokens:
            raise ValueError(f"{label}: side channel {name!r} has {t.shape[0]} row(s) for Σ response_length {tokens}")
        if kind == "int" and not _is_integer(t):
            raise ValueError(f"{label}: side channel {name!r} must hold integers, got {t.dtype}")
        if kind == "float" and not t.dtype.is_floating_point:
            raise ValueError(f"{label}: side channel {name!r} must be floating point, got {t.dtype}")
        out[name] = t
    if "support_logits" in out:
        if "support_ids" not in out:
            raise ValueError(f"{label}: side channel 'support_logits' needs 'support_ids' "
                             "(the ids they were gathered at)")
        if out["support_logits"].shape != out["support_ids"].shape:
            raise ValueError(f"{label}: support_logits shape {list(out['support_logits'].shape)} != support_ids "
                             f"shape {list(out['support_ids'].shape)}")
    if "routed_experts" in out and config.num_experts is None:
        raise ValueError(f"{label}: side channel 'routed_experts' needs RecomputeConfig.num_experts")
    return out


def _support_scored(label: str, support_scored: Optional[Sequence[str]], recorded: Sequence[str],
                    config: RecomputeConfig) -> Optional[tuple[str, ...]]:
    """Validate the names of the log-probs the trainer scored over the recorded support."""
    if support_scored is None:
        return None
    names = tuple(str(n) for n in support_scored)
    if not names:
        raise ValueError(f"{label}: support_scored names no recorded log-probs")
    for name in names:
        if name not in SUPPORT_SCORABLE:
            raise ValueError(f"{label}: support_scored entry {name!r} is not one of {', '.join(SUPPORT_SCORABLE)}")
        if name not in recorded:
            raise ValueError(f"{label}: support_scored entry {name!r} is not recorded in this bundle "
                             f"(it records {', '.join(recorded)})")
    if config.vocab_size is None:
        raise ValueError(f"{label}: support_scored needs RecomputeConfig.vocab_size (the support id range)")
    return names


def _require_support_rows(label: str, channels: Mapping[str, torch.Tensor]) -> None:
    missing = [n for n in ("support_ids", "sampled_token_ids") if n not in channels]
    if missing:
        raise ValueError(f"{label}: support_scored needs the side channel(s) {', '.join(missing)}")


def _loss_terms(label: str, terms: Optional[Mapping[str, TensorLike]], n_samples: int) -> dict[str, torch.Tensor]:
    """A micro-batch's per-sample loss terms as 1-D tensors of one value per sample (Python numbers as
    float64), refused (``ValueError``) when a name, length or dtype is wrong — metadata only."""
    out: dict[str, torch.Tensor] = {}
    for name, value in (terms or {}).items():
        if name not in PER_SAMPLE_TERMS:
            raise ValueError(f"{label}: unknown loss term {name!r} (expected one of {', '.join(PER_SAMPLE_TERMS)})")
        t = _flat(value, torch.float64)
        if t.numel() != n_samples:
            raise ValueError(f"{label}: loss term {name!r} has {t.numel()} value(s) for {n_samples} sample(s)")
        if not t.dtype.is_floating_point and not _is_integer(t):
            raise ValueError(f"{label}: loss term {name!r} must hold numbers, got {t.dtype}")
        out[name] = t
    return out


def _pg_losses(label: str, value: TensorLike, tokens: int) -> torch.Tensor:
    t = _flat(value)
    if t.numel() != tokens:
        raise ValueError(f"{label}: pg_losses has {t.numel()} value(s) for Σ response_length {tokens}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{label}: pg_losses must be floating point, got {t.dtype}")
    return t


def _per_token(label: str, name: str, value: TensorLike, tokens: int) -> torch.Tensor:
    t = _flat(value)
    if t.numel() != tokens:
        raise ValueError(f"{label}: {name} has {t.numel()} value(s) for Σ response_length {tokens}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{label}: {name} must be floating point, got {t.dtype}")
    return t


def _scalar(value) -> torch.Tensor:
    """A reported loss field as a 0-d tensor: a tensor as given (it stays on its device), a Python number as
    float64 (what it is)."""
    return value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)


# What a step may report (SPEC §4.2): loss.policy's fields, with the knobs' pg_clipfrac_lower and kl_loss, and
# loss.value's (PPO).
REPORTED_FIELDS = POLICY_FIELDS + VALUE_FIELDS


def _loss_fields(label: str, fields: Mapping[str, object], what: str) -> dict[str, torch.Tensor]:
    unknown = sorted(set(fields) - set(REPORTED_FIELDS))
    if unknown:
        raise ValueError(f"{label}: unknown loss field(s) {unknown} in {what} (expected {', '.join(REPORTED_FIELDS)})")
    out = {name: _scalar(value) for name, value in fields.items()}
    for name, t in out.items():
        if t.numel() != 1:
            raise ValueError(f"{label}: loss field {name!r} in {what} must be one number, got shape {list(t.shape)}")
    return out


def _sample_meta(sample_ids, group_index, response_lengths, total_lengths, prompts=None, responses=None,
                 labels=None) -> SampleMeta:
    n = len(sample_ids)
    meta = SampleMeta(
        sample_ids=tuple(str(s) for s in sample_ids),
        group_index=tuple(None if g is None else int(g) for g in group_index),
        response_lengths=tuple(int(x) for x in response_lengths),
        total_lengths=tuple(int(x) for x in total_lengths),
        prompts=None if prompts is None else tuple(str(p) for p in prompts),
        responses=None if responses is None else tuple(str(r) for r in responses),
        labels=None if labels is None else tuple(str(x) for x in labels),
    )
    for name in ("group_index", "response_lengths", "total_lengths", "prompts", "responses", "labels"):
        column = getattr(meta, name)
        if column is not None and len(column) != n:
            raise ValueError(f"{name} has {len(column)} entries for {n} sample id(s)")
    bad = next((i for i, s in enumerate(meta.sample_ids) if not 0 < len(s) <= ID_MAX_CHARS), None)
    if bad is not None:  # the reader would refuse the bundle: say so here, where the id comes from
        raise ValueError(f"sample_ids[{bad}] has {len(meta.sample_ids[bad])} characters; an id has 1 to "
                         f"{ID_MAX_CHARS}")
    return meta


class _NullStep:
    """What ``begin_step`` returns when this step is not captured: every call is a no-op."""

    captured = False

    def add_micro_batch(self, **_kwargs) -> bool:
        return False

    def grad_tap(self, _tensor) -> None:
        return None

    def finish(self, _fields: Optional[Mapping[str, torch.Tensor]] = None, **_kwargs) -> bool:
        return False


NULL_STEP = _NullStep()


class StepCapture:
    """Accumulates one actor step's micro-batches into one step-level bundle.

    Each micro-batch is submitted on its own (so its device→host copy overlaps the next micro-batch);
    the writer publishes the bundle when ``finish`` arrives with every micro-batch accounted for. If a
    micro-batch record is dropped the step is abandoned: a bundle missing a micro-batch would replay a
    different loss than the one the trainer reported.
    """

    captured = True
    _tokens = itertools.count()

    def __init__(self, capture: "ReplayCapture", actor_step_id: ActorStepId, provenance: Provenance,
                 support_scored: Optional[tuple[str, ...]] = None, advantage_estimate: bool = False):
        self._capture = capture
        self.advantage_estimate = advantage_estimate
        self.actor_step_id = actor_step_id
        self.provenance = provenance
        self.support_scored = support_scored
        self.token = next(StepCapture._tokens)
        self._parts = 0
        self._broken: Optional[str] = None
        self._finished = False
        self._channels: Optional[frozenset[str]] = None  # the side channels of the first micro-batch
        # What the first micro-batch gave of the loss terms: (terms, pg_losses?, loss fields); every later
        # one gives the same, or the per-sample lists and the summed fields would not cover the step.
        self._terms_layout: Optional[tuple] = None
        self.label = step_bundle_id(actor_step_id.rollout_id, actor_step_id.step_id)

    def add_micro_batch(
        self,
        *,
        sample_ids: Sequence[str],
        group_index: Sequence[Optional[int]],
        response_lengths: Sequence[int],
        total_lengths: Sequence[int],
        loss_mask: TensorLike,
        log_probs: TensorLike,
        old_log_probs: TensorLike,
        advantages: TensorLike,
        entropy: Optional[TensorLike] = None,
        raw_rewards: Optional[TensorLike] = None,
        rewards: Optional[TensorLike] = None,
        ref_log_probs: Optional[TensorLike] = None,
        rollout_log_probs: Optional[TensorLike] = None,
        teacher_log_probs: Optional[TensorLike] = None,
        policy_versions: Optional[TensorLike] = None,
        values: Optional[TensorLike] = None,
        old_values: Optional[TensorLike] = None,
        returns: Optional[TensorLike] = None,
        side_channels: Optional[SideChannels] = None,
        loss_terms: Optional[Mapping[str, TensorLike]] = None,
        pg_losses: Optional[TensorLike] = None,
        loss_fields: Optional[Mapping[str, torch.Tensor]] = None,
        grad_log_probs: Optional[TensorLike] = None,
        grad_values: Optional[TensorLike] = None,
    ) -> bool:
        """Record one micro-batch (in data-iterator order: ``mb-0000``, ``mb-0001``, …). ``side_channels``:
        the micro-batch's per-token support rows (see the module docstring). ``loss_terms``: its samples'
        per-sample loss terms (``PER_SAMPLE_TERMS``, one value per sample each); ``pg_losses``: its per-token
        surrogate (kept only under ``RELAX_REPLAY_CAPTURE_TOKEN_TERMS=1``, else not even copied);
        ``loss_fields``: the loss fields it reports (summed by ``finish()``). ``ref_log_probs`` /
        ``rollout_log_probs``: per token, for a KL term in the loss and the train/rollout importance correction
        (SPEC §4.2; with ``old_log_probs`` they declare stage ``logprob.mismatch``, SPEC §4.4);
        ``policy_versions``: per token, the policy version that sampled it (partial / async rollouts, the
        mismatch stage's staleness lints); ``teacher_log_probs``: per token, an on-policy distillation teacher's
        (``opd_*`` knobs); ``values`` / ``old_values`` / ``returns``: per token, PPO's critic (the step bundle then
        declares ``loss.value``, whose fields ``vf_loss`` / ``vf_clipfrac`` come in ``loss_fields``). Every
        micro-batch of a step gives the same side channels, terms and fields. ``grad_log_probs`` /
        ``grad_values``: ∂L/∂log_probs and ∂L/∂values per token as backward gave them (``grad_tap``), of the
        loss as backpropagated (kept only under ``RELAX_REPLAY_CAPTURE_GRAD=1``; the step then declares
        ``loss.grad``; a trainer that scales the loss it backpropagates records ``grad_scale`` in its config)."""
        if self._finished:
            raise RuntimeError(f"{self.label}: add_micro_batch() after finish()")
        if self._broken is not None:
            return False
        index = self._parts
        where = f"{self.label} mb-{index:04d}"
        tokens = sum(int(n) for n in response_lengths)
        channels = _side_channels(where, side_channels, tokens, self._capture.recompute_config)
        if self.support_scored is not None:
            _require_support_rows(where, channels)
        if self._channels is None:
            self._channels = frozenset(channels)
        elif frozenset(channels) != self._channels:
            raise ValueError(f"{where}: side channels {sorted(channels)} differ from the step's first micro-batch "
                             f"{sorted(self._channels)}")
        terms = _loss_terms(where, loss_terms, len(sample_ids))
        token_terms = None
        if pg_losses is not None and self._capture.config.token_terms:
            token_terms = _pg_losses(where, pg_losses, tokens)
        fields = _loss_fields(where, loss_fields or {}, "loss_fields")
        grads = {}
        if self._capture.config.grad:
            grads = {name: _per_token(where, name, value, tokens) for name, value in
                     (("grad_log_probs", grad_log_probs), ("grad_values", grad_values)) if value is not None}
        self._check_terms_layout(where, (frozenset(terms), token_terms is not None, frozenset(fields),
                                         frozenset(grads)))
        tensors = {
            "loss_mask": _flat(loss_mask, torch.int64),
            "log_probs": _flat(log_probs),
            "old_log_probs": _flat(old_log_probs),
            "advantages": _flat(advantages),
            "entropy": None if entropy is None else _flat(entropy),
            "ref_log_probs": None if ref_log_probs is None else _flat(ref_log_probs),
            "rollout_log_probs": None if rollout_log_probs is None else _flat(rollout_log_probs),
            "teacher_log_probs": None if teacher_log_probs is None else _flat(teacher_log_probs),
            "policy_versions": None if policy_versions is None else _flat(policy_versions, torch.int64),
            **{name: None if t is None else _flat(t) for name, t in (("values", values), ("old_values", old_values),
                                                                    ("returns", returns))},
            "raw_rewards": None if raw_rewards is None else _flat(raw_rewards, torch.float64),
            "rewards": None if rewards is None else _flat(rewards, torch.float64),
            **channels,
            "pg_losses": token_terms,
            **grads,
            **{TERM_PREFIX + name: t for name, t in terms.items()},
            **{FIELD_PREFIX + name: t for name, t in fields.items()},
        }
        meta = StepPartMeta(token=self.token, actor_step_id=self.actor_step_id, mb_index=index,
                            samples=_sample_meta(sample_ids, group_index, response_lengths, total_lengths))
        item = CaptureItem(kind="step-part", label=f"{self.label}/{index:04d}", meta=meta, tensors=tensors)
        if not self._capture.manager.submit(item):
            self._broken = f"micro-batch mb-{index:04d} was dropped (capture queue full)"
            return False
        self._parts += 1
        return True

    def _check_terms_layout(self, where: str, layout: tuple) -> None:
        if self._terms_layout is None:
            self._terms_layout = layout
            return
        if layout != self._terms_layout:
            any_grads = bool(layout[3] or self._terms_layout[3])

            def show(lay):
                terms, token, fields, grads = lay
                return (f"loss terms {sorted(terms)}, pg_losses {'given' if token else 'not given'}, "
                        f"loss fields {sorted(fields)}" + (f", gradients {sorted(grads)}" if any_grads else ""))
            raise ValueError(f"{where}: {show(layout)} differ from the step's first micro-batch "
                             f"({show(self._terms_layout)})")

    def grad_tap(self, tensor: torch.Tensor) -> Optional[GradTap]:
        """A hook on ``tensor`` (the micro-batch's log-probs, or values) that keeps the gradient backward gives
        it (``capture.grad``), ``None`` when gradient capture (``RELAX_REPLAY_CAPTURE_GRAD``) is off."""
        if not self._capture.config.grad or self._broken is not None:
            return None
        return GradTap(tensor)

    def finish(self, fields: Optional[Mapping[str, torch.Tensor]] = None, *,
               config: Optional[RecomputeConfig] = None, grad_norm=None, **kwargs: torch.Tensor) -> bool:
        """Submit the loss fields the trainer reports for the whole step (``loss, pg_loss, entropy_loss,
        pg_clipfrac, ppo_kl``; 0-d tensors, they stay on their device; Python numbers are float64). For a
        step of several micro-batches this is the reduction ``loss.policy`` recomputes over the whole
        bundle: the sum of per-sample masked means over all samples, i.e. the sum of the micro-batch values.
        Without fields, that sum is taken of the micro-batches' ``loss_fields`` (in float64, on the writer
        thread); a step gives its fields one way or the other, not both. ``config``: this step's own
        ``RecomputeConfig`` (e.g. with the recorded counts ``loss_token_count`` of SPEC §4.2) instead of the
        capture's. ``grad_norm``: the step's gradient norm (a number or a 0-d tensor), read only by the
        capture ring's gradient-spike trigger (``capture.ring``), never written."""
        if self._finished:
            raise RuntimeError(f"{self.label}: finish() called twice")
        self._finished = True
        given = _loss_fields(self.label, dict(fields or {}, **kwargs), "finish()")
        summed = self._terms_layout[2] if self._terms_layout is not None else frozenset()
        if given and summed:
            raise ValueError(f"{self.label}: finish() got loss fields, but the micro-batches gave loss_fields "
                             "(which finish() sums): give them one way")
        if "loss" not in given and "loss" not in summed:
            raise ValueError(f"{self.label}: finish() needs at least the 'loss' field")
        if config is not None and not isinstance(config, RecomputeConfig):
            raise TypeError(f"{self.label}: finish() config must be a RecomputeConfig, got {type(config).__name__}")
        tensors = given
        if grad_norm is not None and self._capture.ring is not None:
            tensors = {**given, GRAD_NORM_KEY: _scalar(grad_norm)}
        meta = StepEndMeta(token=self.token, actor_step_id=self.actor_step_id, n_parts=self._parts,
                           provenance=self.provenance, broken=self._broken, support_scored=self.support_scored,
                           config=config, advantage_estimate=self.advantage_estimate)
        return self._capture.manager.submit(CaptureItem(kind="step-end", label=self.label, meta=meta, tensors=tensors))


class ReplayCapture:
    """Capture for one producer rank. Build it with :func:`maybe_enable_for_actor` (which also locks the
    directory against a second job, ``capture.lock``, and refuses one holding a previous run's bundles). Its
    writer thread first removes the staging that killed writers left in the directory
    (``capture.directory``); on the main thread it also stops the writer and removes its staging on
    SIGTERM (``capture.terminate``). ``lock``: the directory lock, released when ``close()`` has flushed."""

    enabled = True

    def __init__(
        self,
        config: CaptureConfig,
        recompute_config: RecomputeConfig,
        *,
        rank_sizes: Optional[Mapping[str, int]] = None,
        producer_rank: Optional[int] = None,
        producer_world: int = 1,
        redaction: Optional[Mapping[str, str]] = None,
        max_queue: int = 32,
        close_timeout: float = 60.0,
        source_dir: Optional[str | os.PathLike] = None,
        register_atexit: bool = True,
        compute_precision: str = "float32",
        lock: Optional[CaptureLock] = None,
        framework: Optional[tuple[str, str]] = None,
        ring: RingConfig = RING_OFF,
    ):
        """``ring``: capture on trigger (``capture.ring``; off by default: every record is written).
        ``compute_precision``: the format the trainer computes its per-token values in (``float32``,
        ``bfloat16``, ``float16``), declared as ``producer_precision.compute`` (see the module docstring)."""
        if not config.enabled or config.directory is None:
            raise ValueError("ReplayCapture needs an enabled CaptureConfig with a directory")
        if not isinstance(recompute_config, RecomputeConfig):
            raise TypeError(f"recompute_config must be a RecomputeConfig, got {type(recompute_config).__name__}")
        rules = dict(DEFAULT_REDACTION if redaction is None else redaction)
        RedactionPolicy(rules)  # refuse a malformed rule now, not on the writer thread
        if producer_rank is not None and not 0 <= producer_rank < producer_world:
            raise ValueError(f"producer_rank {producer_rank} outside [0, {producer_world})")
        if compute_precision not in COMPUTE_PRECISIONS:
            raise ValueError(f"compute_precision {compute_precision!r} is not one of {', '.join(COMPUTE_PRECISIONS)}")
        self.config = config
        self.recompute_config = recompute_config
        self.context = ProducerContext(
            directory=config.directory, config=recompute_config,
            rank_sizes={"dp": 1, "tp": 1, "pp": 1, "cp": 1, **dict(rank_sizes or {})},
            producer_rank=producer_rank, producer_world=producer_world, redaction=rules,
            compute_precision=compute_precision, format_major=config.format_major,
        )
        self.sink = BundleSink(self.context, producer=lambda: producer_info(source_dir, framework),
                               note_abandoned=lambda label, why: self.manager.note_abandoned(label, why))
        directories = [config.root, config.directory]
        self._lock = lock
        if register_atexit and lock is not None:  # runs after the manager's own close at exit (LIFO)
            atexit.register(_release_at_exit, weakref.ref(self))
        self.ring = CaptureRing(ring) if ring.enabled else None
        self.manager = CaptureManager(self.sink.handle, max_queue=max_queue, close_timeout=close_timeout,
                                      register_atexit=register_atexit,
                                      on_start=lambda: remove_stale_staging(directories), ring=self.ring)
        terminate.register(self)

    # -- filters -----------------------------------------------------------------------------------
    @property
    def token_terms(self) -> bool:
        """Whether step bundles keep the per-token ``pg_losses`` (``RELAX_REPLAY_CAPTURE_TOKEN_TERMS``)."""
        return self.config.token_terms

    def wants_rollout(self, rollout_id: int) -> bool:
        return not self.manager.closed and self.config.wants_rollout(rollout_id)

    def wants_step(self, rollout_id: int, step_id: int) -> bool:
        return not self.manager.closed and self.config.wants_step(rollout_id, step_id)

    # -- hooks -------------------------------------------------------------------------------------
    def capture_rollout(
        self,
        rollout_id: int,
        *,
        sample_ids: Sequence[str],
        group_index: Sequence[Optional[int]],
        response_lengths: Sequence[int],
        total_lengths: Sequence[int],
        loss_mask: TensorLike,
        raw_rewards: TensorLike,
        rewards: TensorLike,
        old_log_probs: TensorLike,
        kl: TensorLike,
        advantages: TensorLike,
        ref_log_probs: Optional[TensorLike] = None,
        prompts: Optional[Sequence[str]] = None,
        responses: Optional[Sequence[str]] = None,
        labels: Optional[Sequence[str]] = None,
        provenance: Optional[Provenance] = None,
        side_channels: Optional[SideChannels] = None,
        support_scored: Optional[Sequence[str]] = None,
        scored_rewards: Optional[TensorLike] = None,
        reward_terms: Optional[Mapping[str, Sequence[float]]] = None,
        config: Optional[RecomputeConfig] = None,
        values: Optional[TensorLike] = None,
        returns: Optional[TensorLike] = None,
        rollout_log_probs: Optional[TensorLike] = None,
        policy_versions: Optional[TensorLike] = None,
    ) -> bool:
        """Record what ``reward.raw … advantage.estimate`` consumed and produced for one rollout.
        ``rollout_log_probs``: per token, the inference engine's own log-probs of the sampled tokens (computed
        apart from ``old_log_probs``; the bundle then runs stage ``logprob.mismatch``, SPEC §4.4);
        ``policy_versions``: per token, the policy version that sampled it (partial / async rollouts).
        ``values`` / ``returns``: per token, the critic's values GAE consumed and the returns it produced
        (``advantage_estimator="gae"``, SPEC §4.2).

        ``raw_rewards`` / ``rewards``: per sample, raw and as post-processed by the trainer; ``kl`` and
        ``advantages``: per token, as the trainer computed them. ``side_channels``: optional per-token
        rows (``SUPPORT_CHANNELS``); ``support_scored``: which of ``old_log_probs`` / ``ref_log_probs``
        the trainer scored over the recorded support with the ``support_logits`` given here (declares
        ``logprob.support``). ``scored_rewards``: the raw rewards as the reward functions produced them, when
        the trainer sees them apart from ``raw_rewards`` (what entered the normalization): they become
        ``reward.raw``'s expected values. ``reward_terms``: more lists or numbers stored beside them under
        ``expected.json $.reward.raw`` (per reward function scores and weights). ``config``: this rollout's
        own ``RecomputeConfig`` instead of the capture's. Returns False if not captured.
        """
        if not self.wants_rollout(rollout_id):
            return False
        label = rollout_bundle_id(rollout_id)
        recorded = ("old_log_probs",) + (() if ref_log_probs is None else ("ref_log_probs",))
        scored = _support_scored(label, support_scored, recorded, self.recompute_config)
        channels = _side_channels(label, side_channels, sum(int(n) for n in response_lengths), self.recompute_config)
        if scored is not None:
            _require_support_rows(label, channels)
        terms = {str(k): [float(x) for x in v] if isinstance(v, (list, tuple)) else float(v)
                 for k, v in (reward_terms or {}).items()}
        if "raw_rewards" in terms:
            raise ValueError(f"{label}: reward_terms may not be named 'raw_rewards' (give scored_rewards)")
        if config is not None and not isinstance(config, RecomputeConfig):
            raise TypeError(f"{label}: config must be a RecomputeConfig, got {type(config).__name__}")
        meta = RolloutMeta(
            rollout_id=int(rollout_id),
            samples=_sample_meta(sample_ids, group_index, response_lengths, total_lengths, prompts, responses, labels),
            provenance=provenance or Provenance(),
            support_scored=scored,
            reward_terms=terms,
            config=config,
        )
        tensors = {
            "loss_mask": _flat(loss_mask, torch.int64),
            "raw_rewards": _flat(raw_rewards, torch.float64),
            "scored_rewards": None if scored_rewards is None else _flat(scored_rewards, torch.float64),
            "rewards": _flat(rewards, torch.float64),
            "old_log_probs": _flat(old_log_probs),
            "ref_log_probs": None if ref_log_probs is None else _flat(ref_log_probs),
            "kl": _flat(kl),
            "advantages": _flat(advantages),
            "values": None if values is None else _flat(values),
            "returns": None if returns is None else _flat(returns),
            "rollout_log_probs": None if rollout_log_probs is None else _flat(rollout_log_probs),
            "policy_versions": None if policy_versions is None else _flat(policy_versions, torch.int64),
            **channels,
        }
        item = CaptureItem(kind="rollout", label=label, meta=meta, tensors=tensors)
        return self.manager.submit(item)

    def begin_step(self, rollout_id: int, step_id: int, *, provenance: Optional[Provenance] = None,
                   support_scored: Optional[Sequence[str]] = None, advantage_estimate: bool = False):
        """A :class:`StepCapture` for actor step ``(rollout_id, step_id)``, or a no-op if not captured.
        ``support_scored``: which of ``log_probs`` / ``old_log_probs`` the trainer scored over the recorded
        support with the ``support_logits`` its micro-batches give (declares ``logprob.support``).
        ``advantage_estimate``: the micro-batches give every sample's normalized reward (``rewards``), and the
        bundle also declares ``advantage.estimate``: the advantages the loss consumed must be those rewards
        broadcast over each sample's tokens (catches advantages handed to the wrong samples)."""
        if not self.wants_step(rollout_id, step_id):
            return NULL_STEP
        scored = _support_scored(step_bundle_id(rollout_id, step_id), support_scored,
                                 ("log_probs", "old_log_probs"), self.recompute_config)
        return StepCapture(self, ActorStepId(rollout_id=int(rollout_id), step_id=int(step_id)),
                           provenance or Provenance(), scored, advantage_estimate)

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def stats(self) -> CaptureStats:
        return self.manager.stats

    def flush(self, timeout: float) -> bool:
        return self.manager.flush(timeout)

    def close(self, timeout: Optional[float] = None) -> bool:
        """Flush (bounded by ``timeout``) and stop; steps whose end never arrived are abandoned."""
        flushed = self.manager.close(timeout)
        if flushed:
            self.sink.abandon_pending("capture closed before the step finished")
            self._release()
        return flushed

    def _release(self) -> None:
        """Nothing is written any more: the directory lock and the SIGTERM clean-up go."""
        terminate.unregister(self)
        self.release_lock()

    def release_lock(self) -> None:
        """Drop the capture directory's lock (``capture.lock``); only once nothing is written any more."""
        if self._lock is not None:
            self._lock.release()


def _release_at_exit(ref: "weakref.ref[ReplayCapture]") -> None:
    capture = ref()
    if capture is not None and capture.manager.closed and capture.manager.flush(0):
        capture._release()


class DisabledCapture:
    """The capture of a rank that does not capture: same interface, does nothing, costs nothing."""

    enabled = False
    token_terms = False

    def __init__(self, reason: str = "capture is off"):
        self.reason = reason

    def wants_rollout(self, rollout_id: int) -> bool:
        return False

    def wants_step(self, rollout_id: int, step_id: int) -> bool:
        return False

    def capture_rollout(self, rollout_id: int, **_kwargs) -> bool:
        return False

    def begin_step(self, rollout_id: int, step_id: int, **_kwargs):
        return NULL_STEP

    @property
    def stats(self) -> CaptureStats:
        return CaptureStats()

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: Optional[float] = None) -> bool:
        return True


def _check_rank(name: str, rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"{name}_rank={rank} must lie in [0, {name}_size={size})")


def maybe_enable_for_actor(
    recompute_config: RecomputeConfig,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    dp_rank: int = 0,
    dp_size: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
    cp_rank: int = 0,
    cp_size: int = 1,
    env: Optional[Mapping[str, str]] = None,
    **kwargs,
) -> Union[ReplayCapture, DisabledCapture]:
    """Capture for this actor rank, configured from the environment (``RELAX_REPLAY_CAPTURE*``).

    Only last-pipeline-stage ranks capture (they own the post-forward statistics); of the tensor-parallel
    peers, which hold identical post-forward tensors, only ``tp_rank == 0`` writes. Producers are numbered
    over (dp, cp); with more than one, each writes ``<DIR>/<bundle_id>/rank-<r>/`` of a cohort. Every
    other rank gets a :class:`DisabledCapture`. A malformed filter raises ``ValueError`` here, and so does
    (as :class:`~capture.directory.CaptureDirectoryError`) a directory that already holds bundles this
    producer would write — a restarted job; call this once per process, before the rank captures anything.

    A directory another job is writing into (it holds ``.capture.lock``, see ``capture.lock``) is not an
    error: this job trains on without capture, after one warning on the ``capture`` logger naming the
    holder, and gets a :class:`DisabledCapture` whose ``reason`` is that line.
    """
    for name, rank, size in (("pp", pp_rank, pp_size), ("dp", dp_rank, dp_size), ("tp", tp_rank, tp_size),
                             ("cp", cp_rank, cp_size)):
        _check_rank(name, rank, size)
    config = config_from_env(env)
    if not config.enabled:
        return DisabledCapture()
    ring = ring_config_from_env(os.environ if env is None else env)
    if pp_rank != pp_size - 1:
        return DisabledCapture(f"pipeline stage {pp_rank} of {pp_size} is not the last")
    if tp_rank != 0:
        return DisabledCapture(f"tensor-parallel rank {tp_rank} duplicates tp_rank 0")
    world = dp_size * cp_size
    rank = dp_rank * cp_size + cp_rank
    if ring.enabled and world > 1:  # each rank's trigger would fire alone: a cohort short of shards
        raise ValueError(f"RELAX_REPLAY_CAPTURE_RING={ring.steps}: capture on trigger needs a single producer, this "
                         f"job has {world} (dp × cp): the triggers are evaluated per rank and a cohort needs every "
                         "rank's shard")
    producer_rank = rank if world > 1 else None
    try:
        lock = acquire_capture_lock(config, producer_rank, world, os.environ if env is None else env)
    except CaptureDirectoryBusy as busy:
        logger.warning("%s", busy)
        return DisabledCapture(str(busy))
    try:
        check_fresh_directory(config, producer_rank)
        return ReplayCapture(
            config, recompute_config,
            rank_sizes={"dp": dp_size, "tp": tp_size, "pp": pp_size, "cp": cp_size},
            producer_rank=producer_rank, producer_world=world, lock=lock, **{"ring": ring, **kwargs},
        )
    except BaseException:
        if lock is not None:
            lock.release()
        raise
