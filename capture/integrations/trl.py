"""Live capture from TRL's ``GRPOTrainer`` (SPEC §8): every generation batch becomes a rollout-level bundle and
every optimizer step a step-level bundle, written by the ordinary capture (``capture.actor`` / ``bundles`` /
``manager``) and configured by the usual ``RELAX_REPLAY_CAPTURE*`` variables.

    from capture.integrations.trl import ReplayGRPOTrainer      # a GRPOTrainer that captures
    trainer = ReplayGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...)

    from capture.integrations.trl import enable_replay_capture  # or instrument any GRPOTrainer (subclass)
    enable_replay_capture(trainer)

Tested with TRL 1.16.0 only (``pip install -e '.[trl]'`` pins it); another version is refused at import in one
line. Line numbers below are of ``trl/trainer/grpo_trainer.py`` in that release.

Where it hooks (instance attributes wrapping the trainer's own methods, so whatever subclass overrides them is
captured as TRL's call sites see it, and TRL's own code runs unchanged):

* the reward functions (``reward_funcs``, plain synchronous callables): each call's scores as returned, with
  ``None`` as NaN (TRL's conversion, ``:1629-1630``) — the expected raw rewards;
* ``_calculate_rewards`` (called at ``:2753``): the ``[B·P, K]`` rewards TRL goes on to weight and normalize;
* ``_generate_and_score_completions`` (``:2324``): its output (masks, ``advantages`` — TRL's normalized rewards,
  ``num_items_in_batch``, old/ref/sampling log-probs when TRL computed them); one more tensor, the sample index
  (rollout id and position), rides along through TRL's shuffle and split (``:1543-1544``) and is removed again
  before TRL's loss sees the inputs;
* ``_compute_loss`` (``:3020``): the micro-batch as the loss consumed it and the loss it returned;
  ``_get_per_token_logps_and_entropies`` called from it (``:3030``): the current log-probs and entropies;
* a ``TrainerCallback``'s ``on_step_end`` (after each optimizer step) finishes the step bundle;
* with ``RELAX_REPLAY_CAPTURE_GRAD=1``, a tensor hook (``capture.GradTap``) on the log-probs
  ``_get_per_token_logps_and_entropies`` returned inside the loss: TRL backpropagates the loss ``_compute_loss``
  returned as it is (``GRPOTrainer.loss_is_scaled_for_ga = True``, the accelerator's own divisor 1), so the hook
  sees ∂loss/∂logp — times the mixed-precision scaler's scale, recorded as ``grad_scale`` when there is one. A
  micro-batch is handed to capture once its backward has run (at the next micro-batch, or the step's end), with
  its ``grad_log_probs``; the step declares ``loss.grad``.

What each bundle holds:

* ``rollout-<R>`` (R = generation batch, counted from 0): samples ``s-<i>`` in TRL's generation order (global
  index over the processes), ``group_index = i // num_generations`` (TRL's ``view(-1, num_generations)``,
  ``:2765``), ``raw_reward`` = ``Σ_k w_k·r_k`` over the rewards TRL normalized (float32, TRL's ``nansum``,
  ``:2763``), ``reward.raw.raw_rewards`` = the same sum over the scores the reward functions returned,
  ``reward.raw.rewards_per_func`` (``[B, K]`` row-major) and ``reward.raw.reward_weights``, the normalized
  rewards = TRL's ``advantages``, the per-token ``advantages`` payload = each one broadcast over its completion
  (as ``_compute_loss`` does, ``:3059``), ``old_log_probs`` (TRL's when it computed them, ``:2643-2656``,
  else the detached current log-probs of each sample's first loss forward, which is what TRL uses, ``:3066``),
  ``ref_log_probs`` when ``beta != 0``, and a zero ``kl`` (TRL puts no KL into the rewards).
* ``step-<R>-<S>`` (S = optimizer step within generation R): per micro-batch the samples it trained on (their
  ids and normalized rewards), the loss mask (``completion_mask × tool_mask``, ``:3027``), current and old
  log-probs, entropy, the advantages the loss consumed, ``ref_log_probs`` when ``beta != 0``,
  ``rollout_log_probs`` (vLLM's sampling log-probs, whenever TRL holds them: with ``use_vllm``; on CPU without
  vLLM TRL's own ``generate`` returns none, ``:1889``, and none is recorded), and as ``loss`` the sum
  over the step's micro-batches of the loss ``_compute_loss`` returned. The denominators TRL divided by are in
  the step's config: ``loss_token_count`` = ``num_items_in_batch`` (``dapo``; the micro-batch's own tokens for
  ``bnpo``), ``loss_seq_count`` = B × gradient-accumulation steps (``grpo``, ``dr_grpo``), ``loss_scale`` =
  processes × steps_per_generation / gradient-accumulation steps (``dapo``), and ``identity.rank.dp`` = the
  processes. The step also declares ``advantage.estimate``: the advantages the loss consumed must be the
  samples' normalized rewards (advantages handed to the wrong samples fail there).

The mapping of the configuration is :func:`replay_lib.frameworks.trl.from_trl`; what it refuses (exit 4) makes
``enable_replay_capture`` raise before training starts, as a malformed capture variable does. Once training
runs, nothing here raises into it: a failing hook is logged and its bundle skipped; tensors are detached and
copied (``CaptureManager.submit``); TRL's inputs, outputs, random draws and arithmetic are untouched.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import msgspec
import torch

import trl

from replay_lib.bundle.schema import RecomputeConfig

from .. import maybe_enable_for_actor
from ..grad import GradTap
from ..manager import _error_logged

TESTED_VERSIONS = {"trl": "1.16.0", "transformers": "5.24.0", "datasets": "5.2.0"}


class UntestedTRLVersion(ImportError):
    """The installed TRL is not the version this integration was tested with."""


def require_tested_trl(version: Optional[str] = None) -> None:
    """Refuse (one line) a TRL other than :data:`TESTED_VERSIONS` ``["trl"]``: its trainer's internals, which the
    hooks wrap, change between releases."""
    found = trl.__version__ if version is None else version
    if found != TESTED_VERSIONS["trl"]:
        raise UntestedTRLVersion(
            f"capture.integrations.trl is tested with trl=={TESTED_VERSIONS['trl']} only, found trl {found}: "
            f"install the tested version (pip install -e '.[trl]')")


require_tested_trl()

from transformers import TrainerCallback  # noqa: E402  (after the version check: it names the real problem)
from trl import GRPOTrainer  # noqa: E402

logger = logging.getLogger("capture")

# The extra column of TRL's generation batch: rollout id << 32 | position in the generation batch.
SAMPLE_KEY = "replay_capture_sample"
_POSITION_BITS = 32


def _tokens(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, C]`` right-padded rows → the first ``lengths[i]`` values of each row, concatenated."""
    width = rows.shape[1]
    valid = torch.arange(width, device=rows.device)[None, :] < lengths.to(rows.device)[:, None]
    return rows[valid]


def _broadcast(per_sample: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """One value per sample repeated over its tokens (TRL's ``advantages.unsqueeze(1)``)."""
    return torch.repeat_interleave(per_sample.reshape(-1), lengths.to(per_sample.device))


def _weighted(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """TRL's reward of a sample: ``(rewards_per_func * reward_weights).nansum(dim=1)`` in float32
    (grpo_trainer.py:2763)."""
    return (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)


@dataclass
class _Rollout:
    """One generation batch, held until every sample's old log-probs are known."""

    rollout_id: int
    sample_ids: list[str]
    groups: list[int]
    lengths: torch.Tensor  # [B] completion tokens
    prompt_lengths: torch.Tensor  # [B]
    loss_mask: torch.Tensor  # [B, C]
    rewards: torch.Tensor  # [B] TRL's normalized rewards (its advantages)
    raw: torch.Tensor  # [B] the weighted sum TRL normalized
    scored: torch.Tensor  # [B] the weighted sum of the reward functions' scores
    per_func: torch.Tensor  # [B, K]
    weights: list[float]
    num_items: int
    old: Optional[torch.Tensor]  # [B, C] when TRL computed them
    ref: Optional[torch.Tensor]
    # [B, C] the sampling engine's log-probs of the sampled tokens (vLLM's, grpo_trainer.py:1775-1782, 2910-2911);
    # None without vLLM: TRL's own generate() returns none (:1889, :1811), there is nothing to record
    sampling: Optional[torch.Tensor] = None
    filled: dict[int, torch.Tensor] = field(default_factory=dict)  # position → old log-probs row, from the loss
    submitted: bool = False
    steps: int = 0  # optimizer steps begun on it


class TRLCapture:
    """The hooks on one ``GRPOTrainer`` and the capture they feed (see the module docstring)."""

    def __init__(self, trainer: GRPOTrainer, capture, config: RecomputeConfig):
        self.trainer = trainer
        self.capture = capture
        self.config = config
        self.loss_type = trainer.loss_type
        self.process = int(trainer.accelerator.process_index)
        self.processes = int(trainer.accelerator.num_processes)
        self.generations = 0
        self.rollouts: dict[int, _Rollout] = {}
        self.errors = 0
        self._scores: dict[int, torch.Tensor] = {}
        self._rewards_per_func: Optional[torch.Tensor] = None
        self._in_loss = False
        self._forward: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None
        self._step = None  # the StepCapture of the optimizer step in progress
        self._step_rollout: Optional[int] = None
        self._step_samples = 0
        self._step_items: set[int] = set()
        self._step_tokens = 0
        self._step_broken: Optional[str] = None
        # RELAX_REPLAY_CAPTURE_GRAD: the hook on this micro-batch's log-probs, and the micro-batch waiting for its
        # backward (its add_micro_batch arguments and hook)
        self._tap: Optional[GradTap] = None
        self._pending: Optional[tuple[dict, GradTap, Any]] = None
        self.closed = False

    # ------------------------------------------------------------------------------------------ errors
    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if _error_logged(self.errors):
            logger.error("replay capture (TRL): %s failed: %s (%d hook error(s) so far; training goes on)",
                         what, exc, self.errors)
            logger.debug("replay capture (TRL): traceback", exc_info=True)

    # --------------------------------------------------------------------------------------- wrappers
    def install(self) -> None:
        t = self.trainer
        t.reward_funcs = [self._scorer(i, f) for i, f in enumerate(t.reward_funcs)]
        for name, make in (("_calculate_rewards", self._wrap_rewards),
                           ("_generate_and_score_completions", self._wrap_generation),
                           ("_compute_loss", self._wrap_loss),
                           ("_get_per_token_logps_and_entropies", self._wrap_forward)):
            setattr(t, name, make(getattr(t, name)))
        t.add_callback(_StepEnd(self))

    def _scorer(self, index: int, func: Any) -> Any:
        """A plain synchronous reward function, recording the scores it returns (modules and coroutines are
        left alone: their scores are read from ``_calculate_rewards``)."""
        if isinstance(func, torch.nn.Module) or not callable(func) or inspect.iscoroutinefunction(func) \
                or inspect.iscoroutinefunction(getattr(func, "__call__", None)):
            return func

        def scored(*args, **kwargs):
            out = func(*args, **kwargs)
            try:
                self._scores[index] = torch.tensor([torch.nan if r is None else float(r) for r in out],
                                                   dtype=torch.float32)
            except Exception as exc:  # the reward function's own output is TRL's to judge
                self._failed(f"recording reward function {index}'s scores", exc)
            return out

        scored.__name__ = getattr(func, "__name__", type(func).__name__)
        scored.__wrapped__ = func
        return scored

    def _wrap_rewards(self, inner: Callable) -> Callable:
        def calculate_rewards(*args, **kwargs):
            self._scores = {}
            out = inner(*args, **kwargs)
            self._rewards_per_func = out.detach().clone()
            return out

        return calculate_rewards

    def _wrap_generation(self, inner: Callable) -> Callable:
        def generate_and_score(inputs):
            out = inner(inputs)
            if not self.trainer.model.training or self.closed:
                return out
            try:
                rollout_id = self._on_generation(out)
            except Exception as exc:
                self._failed(f"rollout {self.generations}", exc)
                self.generations += 1
                return out
            positions = torch.arange(out["completion_mask"].shape[0], dtype=torch.int64)
            out[SAMPLE_KEY] = (positions + (rollout_id << _POSITION_BITS)).to(out["completion_mask"].device)
            return out

        return generate_and_score

    def _wrap_loss(self, inner: Callable) -> Callable:
        def compute_loss(model, inputs):
            if SAMPLE_KEY not in inputs:
                return inner(model, inputs)
            key = inputs[SAMPLE_KEY]
            inputs = {k: v for k, v in inputs.items() if k != SAMPLE_KEY}  # TRL's loss never sees the column
            if not self.trainer.model.training or self.closed:
                return inner(model, inputs)
            self._in_loss, self._forward, self._tap = True, None, None
            self._flush_pending()  # the previous micro-batch's backward has run: its gradient is in
            try:
                loss = inner(model, inputs)
            finally:
                self._in_loss = False
            try:
                self._on_micro_batch(inputs, key, loss)
            except Exception as exc:
                self._step_broken = self._step_broken or f"a micro-batch was not captured ({exc})"
                self._failed("a micro-batch", exc)
            self._forward = None
            return loss

        return compute_loss

    def _wrap_forward(self, inner: Callable) -> Callable:
        def per_token_logps(*args, **kwargs):
            out = inner(*args, **kwargs)
            if self._in_loss and kwargs.get("compute_entropy"):
                self._forward = (out[0], out[1])
                if getattr(getattr(self.capture, "config", None), "grad", False) and out[0].requires_grad:
                    try:
                        self._tap = GradTap(out[0])
                    except Exception as exc:  # never into TRL's forward: the micro-batch goes without it
                        self._failed("a gradient hook", exc)
            return out

        return per_token_logps

    # ---------------------------------------------------------------------------------------- rollout
    def _on_generation(self, out: Mapping[str, Any]) -> int:
        rollout_id = self.generations
        self.generations += 1
        for old_id in [r for r, ro in self.rollouts.items() if r < rollout_id]:
            stale = self.rollouts.pop(old_id)
            if not stale.submitted:
                logger.warning("replay capture (TRL): rollout-%d abandoned: %d of %d sample(s) reached the loss",
                               old_id, len(stale.filled), len(stale.sample_ids))
        completion = out["completion_mask"]
        batch = completion.shape[0]
        mask = completion if out.get("tool_mask") is None else completion * out["tool_mask"]
        per_func = self._rewards_per_func
        if per_func is None or per_func.shape[0] != batch * self.processes:
            raise ValueError(f"rewards of {None if per_func is None else per_func.shape[0]} sample(s) for a "
                             f"generation batch of {batch} × {self.processes} process(es)")
        scores = per_func.clone()
        for k, s in self._scores.items():
            if s.numel() == scores.shape[0]:
                scores[:, k] = s.to(scores.device)
        weights = self.trainer.reward_weights
        here = slice(self.process * batch, (self.process + 1) * batch)
        first = self.process * batch
        n = int(self.trainer.num_generations)
        rollout = _Rollout(
            rollout_id=rollout_id,
            sample_ids=[f"s-{first + i}" for i in range(batch)],
            groups=[(first + i) // n for i in range(batch)],
            lengths=completion.sum(1).detach().to(torch.int64),
            prompt_lengths=out["prompt_mask"].sum(1).detach().to(torch.int64),
            loss_mask=mask.detach().clone(),
            rewards=out["advantages"].detach().reshape(-1).clone(),
            raw=_weighted(per_func, weights)[here].clone(),
            scored=_weighted(scores, weights)[here].clone(),
            per_func=per_func[here].clone(),
            weights=[float(w) for w in weights.tolist()],
            num_items=int(out["num_items_in_batch"]),
            old=None if out.get("old_per_token_logps") is None else out["old_per_token_logps"].detach().clone(),
            ref=None if out.get("ref_per_token_logps") is None else out["ref_per_token_logps"].detach().clone(),
            sampling=None if out.get("sampling_per_token_logps") is None
            else out["sampling_per_token_logps"].detach().clone(),
        )
        self.rollouts[rollout_id] = rollout
        if rollout.old is not None:
            self._submit_rollout(rollout)
        return rollout_id

    def _rollout_config(self, rollout: _Rollout) -> RecomputeConfig:
        if self.loss_type in ("dapo", "cispo"):  # TRL divides both by num_items_in_batch
            return msgspec.structs.replace(self.config, loss_token_count=max(rollout.num_items, 1))
        return self.config

    def _submit_rollout(self, rollout: _Rollout) -> None:
        rollout.submitted = True
        if not self.capture.wants_rollout(rollout.rollout_id):
            return
        old = rollout.old
        if old is None:
            old = torch.stack([rollout.filled[i] for i in range(len(rollout.sample_ids))])
        lengths = rollout.lengths
        tokens = int(lengths.sum())
        self.capture.capture_rollout(
            rollout.rollout_id,
            sample_ids=rollout.sample_ids,
            group_index=rollout.groups,
            response_lengths=lengths.tolist(),
            total_lengths=(lengths + rollout.prompt_lengths).tolist(),
            loss_mask=_tokens(rollout.loss_mask, lengths),
            raw_rewards=rollout.raw,
            scored_rewards=rollout.scored,
            rewards=rollout.rewards,
            old_log_probs=_tokens(old, lengths),
            ref_log_probs=None if rollout.ref is None else _tokens(rollout.ref, lengths),
            rollout_log_probs=None if rollout.sampling is None else _tokens(rollout.sampling, lengths),
            kl=torch.zeros(tokens, dtype=torch.float32),
            advantages=_broadcast(rollout.rewards, lengths),
            reward_terms={"rewards_per_func": rollout.per_func.reshape(-1).tolist(),
                          "reward_weights": rollout.weights},
            config=self._rollout_config(rollout),
        )

    # ------------------------------------------------------------------------------------------- step
    def _on_micro_batch(self, inputs: Mapping[str, Any], key: torch.Tensor, loss: torch.Tensor) -> None:
        keys = key.detach().to("cpu", torch.int64)
        rollout_ids = set((keys >> _POSITION_BITS).tolist())
        if len(rollout_ids) != 1:
            raise ValueError(f"a micro-batch mixes generation batches {sorted(rollout_ids)}")
        rollout_id = rollout_ids.pop()
        positions = (keys & ((1 << _POSITION_BITS) - 1)).tolist()
        rollout = self.rollouts.get(rollout_id)
        if rollout is None:
            raise ValueError(f"rollout-{rollout_id} is no longer held")
        if self._forward is None:
            raise ValueError("TRL's loss did not compute the per-token log-probs through "
                             "_get_per_token_logps_and_entropies")
        logps, entropy = self._forward
        completion = inputs["completion_mask"]
        mask = completion if "tool_mask" not in inputs else completion * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old  # grpo_trainer.py:3066
        if rollout.old is None and not rollout.submitted:
            for row, p in enumerate(positions):
                rollout.filled.setdefault(p, old[row].detach().clone())
            if len(rollout.filled) == len(rollout.sample_ids):
                self._submit_rollout(rollout)

        if self._step is None:
            self._step = self.capture.begin_step(rollout_id, rollout.steps, advantage_estimate=True)
            rollout.steps += 1
            self._step_rollout = rollout_id
        elif self._step_rollout != rollout_id:
            raise ValueError(f"an optimizer step takes micro-batches of rollout-{self._step_rollout} and "
                             f"rollout-{rollout_id}")
        self._step_samples += len(positions)
        self._step_items.add(int(inputs["num_items_in_batch"]))
        self._step_tokens += int(mask.sum())
        if not self._step.captured:
            return
        lengths = completion.sum(1).detach().to(torch.int64)
        at = torch.tensor(positions, dtype=torch.int64)
        advantages = inputs["advantages"]
        advantages = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(-1, completion.shape[1])
        ref = inputs.get("ref_per_token_logps") if self.trainer.beta != 0.0 else None
        # the sampling engine's log-probs whenever TRL holds them (vLLM), corrected or not: stage logprob.mismatch
        sampling = inputs.get("sampling_per_token_logps")
        part = dict(
            sample_ids=[rollout.sample_ids[p] for p in positions],
            group_index=[rollout.groups[p] for p in positions],
            response_lengths=lengths.tolist(),
            total_lengths=(lengths + inputs["prompt_mask"].sum(1).to(torch.int64).cpu()).tolist(),
            loss_mask=_tokens(mask, lengths),
            log_probs=_tokens(logps.detach(), lengths),
            old_log_probs=_tokens(old, lengths),
            advantages=_tokens(advantages, lengths),
            entropy=None if entropy is None else _tokens(entropy.detach(), lengths),
            raw_rewards=rollout.raw[at],
            rewards=rollout.rewards[at],
            ref_log_probs=None if ref is None else _tokens(ref, lengths),
            rollout_log_probs=None if sampling is None else _tokens(sampling, lengths),
            loss_fields={"loss": loss.detach()},
        )
        if self._tap is not None:  # handed over once backward has filled the hook
            self._pending, self._tap = (part, self._tap, lengths), None
            return
        self._step.add_micro_batch(**part)

    def _flush_pending(self) -> None:
        """Hand the micro-batch that waited for its backward to capture, with its gradient."""
        pending, self._pending = self._pending, None
        if pending is None or self._step is None or not self._step.captured:
            return
        part, tap, lengths = pending
        try:
            tap.remove()
            self._step.add_micro_batch(**part, grad_log_probs=_tokens(tap.gradient(), lengths))
        except Exception as exc:
            self._step_broken = self._step_broken or f"a micro-batch was not captured ({exc})"
            self._failed("a micro-batch's gradient", exc)

    def _step_config(self, label: str) -> Optional[RecomputeConfig]:
        """This step's config with the counts TRL divided by, or ``None`` (logged) when its micro-batches do not
        fit one (a last, short accumulation window)."""
        cfg = self.config
        why = None
        if self.loss_type in ("dapo", "cispo"):  # TRL divides both by num_items_in_batch
            if len(self._step_items) == 1:
                return msgspec.structs.replace(cfg, loss_token_count=max(next(iter(self._step_items)), 1))
            why = f"num_items_in_batch differs between its micro-batches: {sorted(self._step_items)}"
        elif self.loss_type == "bnpo" and cfg.loss_agg_mode == "micro_batch_token_mean":
            return cfg  # each sample's micro_batch_id is the partition TRL averaged its token means over
        elif self.loss_type == "bnpo":
            return msgspec.structs.replace(cfg, loss_token_count=max(self._step_tokens, 1))
        elif self._step_samples == cfg.loss_seq_count:
            return cfg
        else:
            why = (f"{self._step_samples} sample(s) where TRL's {self.loss_type} divides by {cfg.loss_seq_count} "
                   "(per_device_train_batch_size × gradient_accumulation_steps)")
        logger.warning("replay capture (TRL): %s not written: %s", label, why)
        return None

    def end_step(self) -> None:
        self._flush_pending()
        step, self._step = self._step, None
        try:
            if step is not None and step.captured:
                config = self._step_config(step.label) if self._step_broken is None else None
                scaler = getattr(self.trainer.accelerator, "scaler", None)
                if config is not None and scaler is not None and \
                        getattr(getattr(self.capture, "config", None), "grad", False):
                    config = msgspec.structs.replace(config, grad_scale=float(scaler.get_scale()))
                if self._step_broken is not None:
                    logger.warning("replay capture (TRL): %s not written: %s", step.label, self._step_broken)
                if config is not None:
                    step.finish(config=config)
        except Exception as exc:
            self._failed("finishing an optimizer step", exc)
        finally:
            self._step_rollout, self._step_samples, self._step_tokens = None, 0, 0
            self._step_items, self._step_broken = set(), None

    def close(self, timeout: Optional[float] = None) -> bool:
        if self.closed:
            return True
        self.closed = True
        flushed = self.capture.close(timeout)
        stats = self.capture.stats
        logger.info("replay capture (TRL): %d bundle(s) written (%d dropped, %d write error(s), %d hook error(s))",
                    stats.written, stats.dropped, stats.errors, self.errors)
        return flushed


class _StepEnd(TrainerCallback):
    def __init__(self, capture: TRLCapture):
        self.capture = capture

    def on_step_end(self, args, state, control, **kwargs):
        self.capture.end_step()

    def on_train_end(self, args, state, control, **kwargs):
        self.capture.close()


def _compute_precision(trainer: GRPOTrainer) -> str:
    dtype = getattr(trainer.model, "dtype", torch.float32)
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def enable_replay_capture(trainer: GRPOTrainer, *, env: Optional[Mapping[str, str]] = None,
                          **capture_kwargs) -> Optional[TRLCapture]:
    """Instrument ``trainer`` (a ``GRPOTrainer`` or subclass, after its ``__init__``) when
    ``RELAX_REPLAY_CAPTURE=1``; ``None`` (and nothing changed) when capture is off or this process does not
    capture. Raises before training starts what the capture cannot honour: a malformed ``RELAX_REPLAY_CAPTURE*``
    value or a directory holding a previous run (``ValueError``), a configuration the replay cannot recompute
    (``UnsupportedFrameworkConfig`` from ``from_trl``, naming the key). ``capture_kwargs`` go to
    ``maybe_enable_for_actor`` (``max_queue``, ``redaction``, …)."""
    from replay_lib.frameworks.trl import from_trl

    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"enable_replay_capture needs a trl.GRPOTrainer, got {type(trainer).__name__}")
    if getattr(trainer, "_replay_capture_hooks", None) is not None:
        raise RuntimeError("enable_replay_capture: this trainer is already instrumented")
    from capture.config import config_from_env

    if not config_from_env(env).enabled:
        return None
    processes = int(trainer.accelerator.num_processes)
    config = from_trl(trainer.args, num_processes=processes)
    if getattr(trainer, "aux_loss_enabled", False):
        from replay_lib.errors import UnsupportedFrameworkConfig

        raise UnsupportedFrameworkConfig("TRL trainer: the model's router auxiliary loss is added to the loss TRL "
                                         "reports and is not recomputed (router_aux_loss_coef=0 turns it off)")
    capture = maybe_enable_for_actor(config, dp_rank=int(trainer.accelerator.process_index), dp_size=processes,
                                     env=env, compute_precision=_compute_precision(trainer),
                                     framework=("trl", trl.__version__), **capture_kwargs)
    if not capture.enabled:
        return None
    hooks = TRLCapture(trainer, capture, config)
    hooks.install()
    trainer._replay_capture_hooks = hooks
    return hooks


class ReplayGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with replay capture (``RELAX_REPLAY_CAPTURE*``); ``replay_env`` replaces
    ``os.environ`` for reading them. ``self.replay_capture`` is the :class:`TRLCapture` (``None`` when off)."""

    def __init__(self, *args, replay_env: Optional[Mapping[str, str]] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.replay_capture = enable_replay_capture(self, env=replay_env)
