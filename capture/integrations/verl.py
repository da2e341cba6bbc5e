"""Live capture from verl's PPO/GRPO trainer (SPEC §8): the driver's advantage computation becomes a rollout
bundle and every optimizer step of the actor a step bundle, written by the ordinary capture (``capture.actor`` /
``bundles`` / ``manager``) and configured by the usual ``RELAX_REPLAY_CAPTURE*`` variables.

    from capture.integrations.verl import enable_replay_capture
    hooks = enable_replay_capture(config)        # config: verl's trainer config (OmegaConf or dict); None when off
    hooks.install_driver()                       # in the driver: wraps ray_trainer.compute_advantage
    hooks.install_worker(worker.actor)           # in the actor (its TrainingWorker): wraps loss_fn, engine.train_batch

Tested with verl 0.9.1 only (``pip install -e '.[verl]'`` pins it); another version is refused in one line before
anything of verl is imported. File and line numbers below are of that release.

Where it hooks (instance or module attributes wrapping verl's own functions; verl's code runs unchanged):

* ``verl.trainer.ppo.ray_trainer.compute_advantage`` (``ray_trainer.py:187``; the trainer looks it up in its
  module at each step): after it returned, the batch as the estimator saw it: ``token_level_scores`` (the reward
  function's scores, ``[B, R]`` float32, the score at the last response token), ``token_level_rewards`` (the
  estimator's input: the scores minus the in-reward KL under ``use_kl_in_reward``), ``advantages`` (its output,
  ``[B, R]``), ``response_mask`` (``[B, R]``, with the zeros of multi-turn tool/observation spans),
  ``old_log_probs`` / ``ref_log_prob`` (``[B, R]``) and the ``uid`` grouping (``non_tensor_batch["uid"]``). One
  more per-sample int64 column, :data:`SAMPLE_KEY` (rollout id, group and position), is added to the batch so that
  the actor's micro-batches can name their samples; verl's loss selects its own fields (``losses.py:83-88``) and
  never reads it.
* the actor's loss function (``worker.loss_fn``, ``verl.workers.utils.losses.ppo_loss`` bound to the actor config,
  called by the engine once per micro-batch, ``engine/fsdp/transformer_impl.py:1578``): the micro-batch's current
  log-probs and entropy (``model_output``, cut to the response as verl's ``no_padding_2_padding`` cuts it), its
  old/ref/rollout log-probs, advantages and ``response_mask``, the global counts the loss divided by
  (``batch_num_tokens``, ``dp_size``, ``global_batch_size``, ``losses.py:64-67``), the loss it returned and the
  metrics (``verl.utils.metric.Metric``) it reported;
* the engine's ``train_batch`` (``engine/base.py:113``: zero the gradients, every micro-batch forward and
  backward, one optimizer step): one step bundle per call, its micro-batches in the engine's order.

What each bundle holds:

* ``rollout-<R>`` (R = the R-th call of ``compute_advantage``): samples ``s-<i>`` in the batch's order,
  ``group_index`` = the uid's rank of first appearance, ``raw_reward`` = ``Σ_t token_level_scores``, the
  normalized reward = the advantage at the sample's first loss token (GRPO and RLOO broadcast one value over the
  response, ``core_algos.py:330,636``), ``advantages`` and ``old_log_probs`` per token, ``ref_log_probs`` when the
  batch has them, and ``kl``: verl's own ``kl_penalty(old_log_probs, ref_log_prob) · response_mask`` under
  ``use_kl_in_reward`` (what ``apply_kl_penalty`` subtracted, ``ray_trainer.py:100-104``), else zeros.
* ``step-<R>-<S>`` (S = optimizer step on rollout R): per micro-batch its samples, ``loss_mask`` (the
  ``response_mask``), current/old log-probs, entropy (when verl computed it), advantages, ``ref_log_probs`` under
  ``use_kl_loss``, ``rollout_log_probs`` under a rollout correction; the step's fields as verl aggregates them
  (``_postprocess_output``, ``engine_workers.py:181-205``): ``loss`` = the sum of the micro-batches' losses, every
  ``Metric`` aggregated by its own type (``pg_loss``, ``entropy_loss``, ``kl_loss``: SUM; ``pg_clipfrac``,
  ``ppo_kl``, ``pg_clipfrac_lower``: MEAN over the micro-batches). The step's config records the counts:
  ``loss_token_count`` = ``batch_num_tokens`` (all-reduced over dp), ``loss_scale`` = ``dp_size``,
  ``loss_seq_count`` = ``global_batch_size`` (the seq-mean modes); ``loss_horizon`` is the mapping's
  ``loss_scale_factor``.

The mapping of the configuration is :func:`replay_lib.frameworks.verl.from_verl`; what it refuses (exit 4) makes
``enable_replay_capture`` raise before training starts, as a malformed capture variable does, and so does an
estimator whose advantages are not one value per sample (only ``grpo`` and ``rloo`` are captured). Once training
runs nothing here raises into it: a failing hook is logged and its bundle skipped; tensors are detached and copied
(``CaptureManager.submit``); verl's inputs, outputs, random draws and arithmetic are untouched (the extra batch
column aside, which no verl function reads).
"""

from __future__ import annotations

import functools
import logging
from importlib import metadata
from typing import Any, Callable, Mapping, Optional

import msgspec
import torch

from replay_lib.bundle.schema import RecomputeConfig

from .. import maybe_enable_for_actor
from ..manager import _error_logged

TESTED_VERSIONS = {"verl": "0.9.1"}
# The estimators whose advantages are one value per sample broadcast over the response (core_algos.py:330,636).
CAPTURED_ESTIMATORS = ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized")


class UntestedVerlVersion(ImportError):
    """The installed verl is not the version this integration was tested with."""


def require_tested_verl(version: Optional[str] = None) -> None:
    """Refuse (one line) a verl other than :data:`TESTED_VERSIONS` ``["verl"]``: the functions the hooks wrap
    change between releases. Reads the installed distribution's metadata, not the package."""
    if version is None:
        try:
            version = metadata.version("verl")
        except metadata.PackageNotFoundError:
            version = "(not installed)"
    if version != TESTED_VERSIONS["verl"]:
        raise UntestedVerlVersion(
            f"capture.integrations.verl is tested with verl=={TESTED_VERSIONS['verl']} only, found verl {version}: "
            f"install the tested version (pip install -e '.[verl]')")


require_tested_verl()

logger = logging.getLogger("capture")

# The extra column of verl's batch: rollout id << 40 | group << 20 | position in the rollout batch.
SAMPLE_KEY = "replay_capture_sample"
_FIELD_BITS = 20
_FIELD_MASK = (1 << _FIELD_BITS) - 1
# verl's metric names (losses.py:101-130) → the replay's loss fields
METRICS = {"actor/pg_loss": "pg_loss", "actor/entropy_loss": "entropy_loss", "kl_loss": "kl_loss",
           "actor/pg_clipfrac": "pg_clipfrac", "actor/ppo_kl": "ppo_kl",
           "actor/pg_clipfrac_lower": "pg_clipfrac_lower"}


def _get(cfg: Any, path: str, default: Any) -> Any:
    node = cfg
    for part in path.split("."):
        if node is None:
            return default
        try:
            node = node[part] if isinstance(node, Mapping) or hasattr(node, "__getitem__") else getattr(node, part)
        except (KeyError, AttributeError, TypeError):
            return default
    return default if node is None else node


def _tokens(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` right-padded rows → the first ``lengths[i]`` values of each row, concatenated."""
    width = rows.shape[1]
    valid = torch.arange(width, device=rows.device)[None, :] < lengths.to(rows.device)[:, None]
    return rows[valid]


def _first_masked(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The value of each row at its first mask-1 token (0 for a row without one)."""
    m = mask.to(torch.bool)
    first = torch.where(m.any(1), m.to(torch.int8).argmax(1), torch.zeros_like(m[:, 0], dtype=torch.int64))
    value = rows.gather(1, first.unsqueeze(1).to(torch.int64)).squeeze(1)
    return torch.where(m.any(1), value, torch.zeros_like(value))


def pack_key(rollout_id: int, groups: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return (rollout_id << (2 * _FIELD_BITS)) + (groups.to(torch.int64) << _FIELD_BITS) + positions.to(torch.int64)


def unpack_key(key: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    k = key.detach().to("cpu", torch.int64)
    return (k >> (2 * _FIELD_BITS)).tolist(), ((k >> _FIELD_BITS) & _FIELD_MASK).tolist(), (k & _FIELD_MASK).tolist()


def _lengths(data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's valid prompt and response tokens: the offsets of nested ``prompts`` / ``responses`` (verl's
    no-padding layout) or the two parts of ``attention_mask`` (as ``no_padding_2_padding`` reads them,
    padding.py:115-125)."""
    prompts, responses = data["prompts"], data["responses"]
    if getattr(prompts, "is_nested", False):
        return prompts.offsets().diff().to(torch.int64), responses.offsets().diff().to(torch.int64)
    width = prompts.shape[1]
    mask = data["attention_mask"]
    return mask[:, :width].sum(1).to(torch.int64), mask[:, width:].sum(1).to(torch.int64)


def _response_tokens(output: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The response tokens of a model output in verl's no-padding layout (nested ``[b, j]`` or ``(total_nnz,)``),
    concatenated: token t of sample i is at ``offset_i + prompt_i − 1 + t`` (the output scores the next token),
    what ``no_padding_2_padding`` slices row by row (padding.py:127-141), gathered here in one index."""
    values = output.values() if output.is_nested else output
    values = values.detach()
    lengths = lengths.to(values.device)
    ends = (prompt_lengths.to(values.device) + lengths).cumsum(0)
    width = int(lengths.max()) if lengths.numel() else 0
    steps = torch.arange(width, device=values.device)
    index = (ends - lengths - 1).unsqueeze(1) + steps.unsqueeze(0)
    return values[index[steps.unsqueeze(0) < lengths.unsqueeze(1)]]


class VerlCapture:
    """The hooks on verl's driver and actor and the capture they feed (see the module docstring)."""

    def __init__(self, capture, config: RecomputeConfig, trainer_config: Any):
        self.capture = capture
        self.config = config
        self.trainer_config = trainer_config
        self.rollouts = 0
        self.errors = 0
        self.closed = False
        self._steps: dict[int, int] = {}  # rollout id → optimizer steps begun on it
        self._step = None
        self._step_rollout: Optional[int] = None
        self._losses: list[torch.Tensor] = []
        self._metrics: dict[str, list[Any]] = {}
        self._counts: set[tuple] = set()
        self._step_broken: Optional[str] = None
        self._training = False  # inside the engine's train_batch
        self._installed: list[tuple[Any, str, Any]] = []

    # ------------------------------------------------------------------------------------------ errors
    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if _error_logged(self.errors):
            logger.error("replay capture (verl): %s failed: %s (%d hook error(s) so far; training goes on)",
                         what, exc, self.errors)
            logger.debug("replay capture (verl): traceback", exc_info=True)

    # --------------------------------------------------------------------------------------- installing
    def install_driver(self, module: Any = None) -> None:
        """Wrap ``compute_advantage`` in verl's trainer module (``verl.trainer.ppo.ray_trainer`` by default)."""
        if module is None:
            from verl.trainer.ppo import ray_trainer as module
        self._replace(module, "compute_advantage", self.wrap_compute_advantage(module.compute_advantage))

    def install_worker(self, worker: Any) -> None:
        """Wrap the actor's ``TrainingWorker`` (``ActorRolloutRefWorker.actor``, engine_workers.py:644-646): its
        ``loss_fn`` and its engine's ``train_batch`` (call after ``set_loss_fn``)."""
        if getattr(worker, "loss_fn", None) is None:
            raise ValueError("install_worker: the worker has no loss_fn yet (call it after worker.set_loss_fn)")
        self._replace(worker, "loss_fn", self.wrap_loss_fn(worker.loss_fn))
        self._replace(worker.engine, "train_batch", self.wrap_train_batch(worker.engine.train_batch))

    def _replace(self, owner: Any, name: str, value: Any) -> None:
        self._installed.append((owner, name, owner.__dict__.get(name, _ABSENT) if hasattr(owner, "__dict__")
                                else getattr(owner, name)))
        setattr(owner, name, value)

    def uninstall(self) -> None:
        """Put back what :meth:`install_driver` / :meth:`install_worker` replaced."""
        for owner, name, old in reversed(self._installed):
            if old is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._installed.clear()

    # ---------------------------------------------------------------------------------------- wrappers
    def wrap_compute_advantage(self, inner: Callable) -> Callable:
        @functools.wraps(inner)
        def compute_advantage(data, *args, **kwargs):
            out = inner(data, *args, **kwargs)
            if self.closed:
                return out
            rollout_id = self.rollouts
            self.rollouts += 1
            try:
                self._on_advantage(out, rollout_id)
            except Exception as exc:
                self._failed(f"rollout {rollout_id}", exc)
            return out

        return compute_advantage

    def wrap_loss_fn(self, inner: Callable) -> Callable:
        @functools.wraps(inner)
        def loss_fn(*args, **kwargs):
            out = inner(*args, **kwargs)
            if self.closed or not self._training or self._step_broken is not None:
                return out  # infer_batch's forward-only calls (engine_workers.py:419) are not a step
            try:
                self._on_micro_batch(kwargs.get("model_output", args[0] if args else None),
                                     kwargs.get("data", args[1] if len(args) > 1 else None), out)
            except Exception as exc:
                self._step_broken = f"a micro-batch was not captured ({exc})"
                self._failed("a micro-batch", exc)
            return out

        return loss_fn

    def wrap_train_batch(self, inner: Callable) -> Callable:
        @functools.wraps(inner)
        def train_batch(data, *args, **kwargs):
            self._begin_step()
            self._training = True
            try:
                out = inner(data, *args, **kwargs)
            except BaseException:
                self._reset_step()
                raise
            finally:
                self._training = False
            self.end_step()
            return out

        return train_batch

    # ---------------------------------------------------------------------------------------- rollout
    def _on_advantage(self, data: Any, rollout_id: int) -> None:
        batch = data.batch
        mask = batch["response_mask"]
        count = mask.shape[0]
        uids = list(data.non_tensor_batch["uid"])
        first: dict[Any, int] = {}
        groups = torch.tensor([first.setdefault(u, len(first)) for u in uids], dtype=torch.int64)
        positions = torch.arange(count, dtype=torch.int64)
        batch[SAMPLE_KEY] = pack_key(rollout_id, groups, positions).to(mask.device)
        if not self.capture.wants_rollout(rollout_id):
            return
        lengths = batch["attention_mask"][:, -batch["responses"].shape[1]:].sum(1).to("cpu", torch.int64)
        prompt_lengths = batch["attention_mask"][:, : -batch["responses"].shape[1]].sum(1).to("cpu", torch.int64)
        scores = batch["token_level_scores"].detach()
        advantages = batch["advantages"].detach()
        old = batch["old_log_probs"].detach()
        ref = batch["ref_log_prob"].detach() if "ref_log_prob" in batch.keys() else None
        if self.config.kl_in_reward is not None:
            from verl.trainer.ppo import core_algos

            kl_type = str(_get(self.trainer_config, "algorithm.kl_penalty", "kl"))
            kl = core_algos.kl_penalty(old, ref, kl_penalty=kl_type) * mask
        else:
            kl = torch.zeros_like(old)
        self.capture.capture_rollout(
            rollout_id,
            sample_ids=[f"s-{i}" for i in range(count)],
            group_index=groups.tolist(),
            response_lengths=lengths.tolist(),
            total_lengths=(lengths + prompt_lengths).tolist(),
            loss_mask=_tokens(mask, lengths),
            raw_rewards=scores.sum(-1),
            rewards=_first_masked(advantages, mask),
            old_log_probs=_tokens(old, lengths),
            ref_log_probs=None if ref is None else _tokens(ref, lengths),
            kl=_tokens(kl, lengths),
            advantages=_tokens(advantages, lengths),
        )

    # ------------------------------------------------------------------------------------------- step
    def _begin_step(self) -> None:
        self._reset_step()

    def _reset_step(self) -> None:
        self._step, self._step_rollout, self._step_broken = None, None, None
        self._losses, self._metrics, self._counts = [], {}, set()

    def _on_micro_batch(self, model_output: Mapping[str, Any], data: Any, out: Any) -> None:
        loss, metrics = out
        if SAMPLE_KEY not in data.keys():
            raise ValueError(f"the micro-batch has no {SAMPLE_KEY} column (was compute_advantage wrapped?)")
        rollout_ids, groups, positions = unpack_key(data[SAMPLE_KEY])
        if len(set(rollout_ids)) != 1:
            raise ValueError(f"a micro-batch mixes rollouts {sorted(set(rollout_ids))}")
        rollout_id = rollout_ids[0]
        if self._step is None:
            step_id = self._steps.get(rollout_id, 0)
            self._steps[rollout_id] = step_id + 1
            self._step = self.capture.begin_step(rollout_id, step_id)
            self._step_rollout = rollout_id
        elif self._step_rollout != rollout_id:
            raise ValueError(f"an optimizer step takes micro-batches of rollout-{self._step_rollout} and "
                             f"rollout-{rollout_id}")
        keys = set(data.keys())
        self._counts.add(tuple(_plain(data[k]) if k in keys else d for k, d in
                               (("batch_num_tokens", None), ("dp_size", 1), ("global_batch_size", None))))
        self._losses.append(loss.detach())
        for name, value in metrics.items():
            self._metrics.setdefault(name, []).append(value)
        if not self._step.captured:
            return
        fields = ["response_mask", "old_log_probs", "advantages"]
        fields += [f for f in ("ref_log_prob", "rollout_log_probs") if f in data.keys()]
        padded = data.select(*fields).to_padded_tensor()
        prompt_lengths, lengths = _lengths(data)
        entropy = model_output.get("entropy", None)
        ref = padded["ref_log_prob"] if self.config.use_kl_loss and "ref_log_prob" in fields else None
        sampling = padded["rollout_log_probs"] if self.config.is_level is not None and \
            "rollout_log_probs" in fields else None
        self._step.add_micro_batch(
            sample_ids=[f"s-{p}" for p in positions],
            group_index=groups,
            response_lengths=lengths.tolist(),
            total_lengths=(lengths + prompt_lengths).tolist(),
            loss_mask=_tokens(padded["response_mask"], lengths),
            log_probs=_response_tokens(model_output["log_probs"], prompt_lengths, lengths),
            old_log_probs=_tokens(padded["old_log_probs"], lengths),
            advantages=_tokens(padded["advantages"], lengths),
            entropy=None if entropy is None else _response_tokens(entropy, prompt_lengths, lengths),
            ref_log_probs=None if ref is None else _tokens(ref, lengths),
            rollout_log_probs=None if sampling is None else _tokens(sampling, lengths),
        )

    def _step_fields(self) -> dict[str, torch.Tensor]:
        """The step's fields as verl aggregates them (engine_workers.py:181-205 and utils/metric/utils.py)."""
        from verl.utils.metric import Metric

        fields = {"loss": torch.stack([x.to(torch.float64).cpu() for x in self._losses]).sum()}
        for name, values in self._metrics.items():
            ours = METRICS.get(name)
            if ours is None or not values or not isinstance(values[0], Metric):
                continue
            total = Metric(aggregation=values[0].aggregation)
            for v in values:
                total.extend(v)
            fields[ours] = torch.tensor(float(total.aggregate()), dtype=torch.float64)
        return fields

    def _step_config(self, label: str) -> Optional[RecomputeConfig]:
        if len(self._counts) != 1:
            logger.warning("replay capture (verl): %s not written: its micro-batches give different global counts "
                           "%s", label, sorted(map(str, self._counts)))
            return None
        tokens, dp, seqs = next(iter(self._counts))
        update: dict[str, Any] = {"loss_scale": float(dp or 1)}
        if tokens is not None:
            update["loss_token_count"] = max(int(tokens), 1)
        if seqs is not None and self.config.loss_seq_count is not None:
            update["loss_seq_count"] = max(int(seqs), 1)
        return msgspec.structs.replace(self.config, **update)

    def end_step(self) -> None:
        step = self._step
        try:
            if step is not None and step.captured:
                if self._step_broken is not None:
                    logger.warning("replay capture (verl): %s not written: %s", step.label, self._step_broken)
                else:
                    config = self._step_config(step.label)
                    if config is not None:
                        step.finish(self._step_fields(), config=config)
        except Exception as exc:
            self._failed("finishing an optimizer step", exc)
        finally:
            self._reset_step()

    def close(self, timeout: Optional[float] = None) -> bool:
        if self.closed:
            return True
        self.closed = True
        flushed = self.capture.close(timeout)
        stats = self.capture.stats
        logger.info("replay capture (verl): %d bundle(s) written (%d dropped, %d write error(s), %d hook error(s))",
                    stats.written, stats.dropped, stats.errors, self.errors)
        return flushed


_ABSENT = object()


def _plain(value: Any) -> Any:
    """A count as a Python number (verl keeps them as NonTensorData or 0-d tensors in the TensorDict)."""
    value = getattr(value, "data", value) if type(value).__name__ == "NonTensorData" else value
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def enable_replay_capture(trainer_config: Any, *, dp_rank: int = 0, dp_size: int = 1,
                          env: Optional[Mapping[str, str]] = None, compute_precision: str = "float32",
                          **capture_kwargs) -> Optional[VerlCapture]:
    """Capture for verl's trainer configured by ``trainer_config`` (the whole ``ppo_trainer`` config, OmegaConf or
    dict) when ``RELAX_REPLAY_CAPTURE=1``; ``None`` when capture is off or this rank does not capture. Raises
    before training starts what the capture cannot honour: a malformed ``RELAX_REPLAY_CAPTURE*`` value or a
    directory holding a previous run (``ValueError``), a configuration the replay cannot recompute
    (``UnsupportedFrameworkConfig`` from ``from_verl``, naming the key, or an estimator other than
    :data:`CAPTURED_ESTIMATORS`). ``capture_kwargs`` go to ``maybe_enable_for_actor``."""
    from capture.config import config_from_env
    from replay_lib.errors import UnsupportedFrameworkConfig
    from replay_lib.frameworks.verl import from_verl
    from replay_lib.kernels.families import token_payloads

    if not config_from_env(env).enabled:
        return None
    config = from_verl(trainer_config, version=TESTED_VERSIONS["verl"])
    estimator = str(_get(trainer_config, "algorithm.adv_estimator", "gae"))
    if estimator not in CAPTURED_ESTIMATORS:
        raise UnsupportedFrameworkConfig(
            f"verl config: algorithm.adv_estimator={estimator}: capture.integrations.verl records estimators with "
            f"one advantage per sample ({', '.join(CAPTURED_ESTIMATORS)})")
    # a loss family whose own per-token payload (Clip-Cov's random draw, clip_cov_mask) this capture does not record
    own = token_payloads(config.policy_loss) if isinstance(config.policy_loss, str) else ()
    if own:
        mode = _get(trainer_config, "actor_rollout_ref.actor.policy_loss.loss_mode", config.policy_loss)
        raise UnsupportedFrameworkConfig(
            f"verl config: actor_rollout_ref.actor.policy_loss.loss_mode={mode}: capture.integrations.verl does not "
            f"record the payload the replay needs for it ({', '.join(own)}: the loss's random token draw)")
    capture = maybe_enable_for_actor(config, dp_rank=dp_rank, dp_size=dp_size, env=env,
                                     compute_precision=compute_precision,
                                     framework=("verl", TESTED_VERSIONS["verl"]), **capture_kwargs)
    if not capture.enabled:
        return None
    return VerlCapture(capture, config, trainer_config)
