"""Capture on trigger: keep the last N actor steps in a bounded in-memory ring, persist them when a trigger fires.

Many failures do not reproduce. With the ring on, capture still copies every selected record on the training
thread exactly as it does without the ring (``CaptureManager.submit``: device-side copies and a non-blocking
enqueue), but the writer thread holds the records in host memory instead of writing them; when a step's end
record arrives it evaluates the triggers on that step and, if one fires, hands everything the ring holds (the
step that fired and the steps before it, with their rollouts) to the bundle writer, oldest first, and empties
the ring. No trigger, nothing written. Everything here runs on the writer thread, so the training step costs
what it costs with plain capture.

Configuration (environment, read with the rest of ``RELAX_REPLAY_CAPTURE*``; the ring is off by default):

``RELAX_REPLAY_CAPTURE_RING=N``             hold the last N actor steps (N ≥ 1; unset, blank or 0: off);
``RELAX_REPLAY_CAPTURE_RING_MB=MB``         bound the bytes the ring holds (default 1024 MiB); the oldest steps
                                            are evicted first when either bound is exceeded;
``RELAX_REPLAY_CAPTURE_TRIGGER_MAX_DLOGP=X`` fire when a step's max |old − rollout| log-prob over loss tokens
                                            exceeds X (needs ``rollout_log_probs``);
``RELAX_REPLAY_CAPTURE_TRIGGER_K3=X``        fire when a step's mean k3 over loss tokens, mean(exp(d) − 1 − d)
                                            with d = old − rollout, exceeds X (needs ``rollout_log_probs``);
``RELAX_REPLAY_CAPTURE_TRIGGER_GRAD_SPIKE=F`` fire when a step's gradient norm (``finish(grad_norm=…)``) exceeds
                                            F × the median of the previous steps' norms (at least
                                            ``GRAD_SPIKE_MIN_HISTORY`` of them, the last
                                            ``RELAX_REPLAY_CAPTURE_TRIGGER_GRAD_WINDOW`` = 32 by default),
                                            or is not finite.

A non-finite reported ``loss`` always fires. A non-finite max |Δlogp| or k3 fires when its threshold is set.
The ring needs a single producer (``maybe_enable_for_actor`` refuses it for dp × cp > 1): the triggers are
evaluated per rank, and a cohort needs every rank's shard.

Rollout records are held beside the steps: a rollout is evicted once no held step was trained on it and a
newer rollout has arrived. Persisting goes through the same writer as plain capture: each bundle is staged and
renamed into place, so a crash mid-persist leaves complete bundles and a hidden staging directory (removed by
the next capture job), never a partial bundle.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

logger = logging.getLogger("capture")

ENV_RING = "RELAX_REPLAY_CAPTURE_RING"
ENV_RING_MB = "RELAX_REPLAY_CAPTURE_RING_MB"
ENV_MAX_DLOGP = "RELAX_REPLAY_CAPTURE_TRIGGER_MAX_DLOGP"
ENV_K3 = "RELAX_REPLAY_CAPTURE_TRIGGER_K3"
ENV_GRAD_SPIKE = "RELAX_REPLAY_CAPTURE_TRIGGER_GRAD_SPIKE"
ENV_GRAD_WINDOW = "RELAX_REPLAY_CAPTURE_TRIGGER_GRAD_WINDOW"

DEFAULT_RING_MB = 1024.0
DEFAULT_GRAD_WINDOW = 32
GRAD_SPIKE_MIN_HISTORY = 4
# The name a step's end record carries its gradient norm under (not a loss field: a trigger input only).
GRAD_NORM_KEY = "trigger:grad_norm"
_LOSS_FIELD_KEY = "field:loss"  # capture.bundles.FIELD_PREFIX + "loss": a micro-batch's reported loss


@dataclass(frozen=True)
class RingConfig:
    """The ring's bounds and triggers. ``steps == 0``: the ring is off (every record is written)."""

    steps: int = 0
    max_bytes: int = int(DEFAULT_RING_MB * 2**20)
    max_dlogp: Optional[float] = None
    k3: Optional[float] = None
    grad_spike: Optional[float] = None
    grad_window: int = DEFAULT_GRAD_WINDOW

    @property
    def enabled(self) -> bool:
        return self.steps > 0


RING_OFF = RingConfig()


def _number(env: Mapping[str, str], variable: str, *, positive: bool = True) -> Optional[float]:
    text = (env.get(variable) or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{variable}={env.get(variable)!r}: expected a {'positive' if positive else 'non-negative'}"
                         " finite number")
    return value


def _count(env: Mapping[str, str], variable: str, default: int, minimum: int) -> int:
    text = (env.get(variable) or "").strip()
    if not text:
        return default
    if not (text.isascii() and text.isdigit()) or int(text) < minimum:
        raise ValueError(f"{variable}={env.get(variable)!r}: expected an integer ≥ {minimum}")
    return int(text)


def ring_config_from_env(env: Mapping[str, str]) -> RingConfig:
    """Read the ring's variables; a malformed one raises ``ValueError`` naming the variable. The trigger
    variables are read (and refused when malformed) only when the ring is on."""
    steps = _count(env, ENV_RING, 0, 0)
    if steps == 0:
        return RING_OFF
    mb = _number(env, ENV_RING_MB)
    return RingConfig(
        steps=steps,
        max_bytes=int((DEFAULT_RING_MB if mb is None else mb) * 2**20),
        max_dlogp=_number(env, ENV_MAX_DLOGP, positive=False),
        k3=_number(env, ENV_K3, positive=False),
        grad_spike=_number(env, ENV_GRAD_SPIKE),
        grad_window=_count(env, ENV_GRAD_WINDOW, DEFAULT_GRAD_WINDOW, GRAD_SPIKE_MIN_HISTORY),
    )


def step_mismatch(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, int]:
    """(max |d|, mean k3, count of d ≠ 0) over loss tokens, d = old − rollout, in float64; (0, 0, 0) without
    loss tokens. k3 = exp(d) − 1 − d, the estimator of KL(π_old ‖ π_rollout) the frameworks log."""
    keep = mask.reshape(-1) != 0
    d = old.reshape(-1).to(torch.float64)[keep] - rollout.reshape(-1).to(torch.float64)[keep]
    if d.numel() == 0:
        return 0.0, 0.0, 0
    k3 = torch.expm1(d) - d
    return float(d.abs().max()), float(k3.mean()), int((d != 0).sum())


def _nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass
class _Entry:
    kind: str  # "step" or "rollout"
    rollout_id: int
    label: str = ""
    items: list = field(default_factory=list)
    nbytes: int = 0


class CaptureRing:
    """The writer thread's hold on the last N steps: :meth:`take` receives every record and returns those to
    write now (none while held; everything held, oldest first, when a trigger fires)."""

    def __init__(self, config: RingConfig):
        if not config.enabled:
            raise ValueError("CaptureRing needs a RingConfig with steps ≥ 1")
        self.config = config
        self._entries: deque[_Entry] = deque()
        self._open: dict[int, _Entry] = {}  # step token → its micro-batches, until its end record
        self._grad_norms: deque[float] = deque(maxlen=config.grad_window)
        self.fired: list[tuple[str, str]] = []  # (step label, why), one per trigger that persisted the ring
        self.evicted = 0  # steps evicted unpersisted

    @property
    def held_steps(self) -> int:
        return sum(e.kind == "step" for e in self._entries)

    @property
    def held_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries) + sum(e.nbytes for e in self._open.values())

    def take(self, item) -> list:
        item.tensors = {k: (v.to("cpu") if v.device.type != "cpu" else v) for k, v in item.tensors.items()}
        size = _nbytes(item.tensors)
        if item.kind == "rollout":
            self._entries.append(_Entry("rollout", int(item.meta.rollout_id), item.label, [item], size))
            self._evict()
            return []
        if item.kind == "step-part":
            step = item.meta.actor_step_id
            entry = self._open.setdefault(item.meta.token, _Entry("step", int(step.rollout_id), "", []))
            entry.items.append(item)
            entry.nbytes += size
            return []
        if item.kind != "step-end":
            return [item]
        entry = self._open.pop(item.meta.token, None) or _Entry("step", int(item.meta.actor_step_id.rollout_id))
        for stale in [t for t in self._open if t < item.meta.token]:  # their end record never came
            del self._open[stale]
        entry.label = item.label
        entry.items.append(item)
        entry.nbytes += size
        why = self._trigger(entry)
        self._entries.append(entry)
        self._evict()
        if why is None:
            return []
        held = self.held_steps
        self.fired.append((entry.label, why))
        logger.warning("replay capture: trigger at %s: %s; persisting the %d step(s) the ring holds",
                       entry.label, why, held)
        out = [it for e in self._entries for it in e.items]
        self._entries.clear()
        return out

    def discard(self) -> None:
        self._entries.clear()
        self._open.clear()

    # -- triggers ----------------------------------------------------------------------------------
    def _trigger(self, entry: _Entry) -> Optional[str]:
        end = entry.items[-1].tensors
        parts = [it.tensors for it in entry.items[:-1]]
        losses = [end["loss"]] if "loss" in end else [p[_LOSS_FIELD_KEY] for p in parts if _LOSS_FIELD_KEY in p]
        if losses:
            loss = math.fsum(float(t.to(torch.float64).sum()) for t in losses)
            if not math.isfinite(loss):
                return f"non-finite loss ({loss})"
        cfg = self.config
        if (cfg.max_dlogp is not None or cfg.k3 is not None) and parts and all(
                "rollout_log_probs" in p for p in parts):
            old = torch.cat([p["old_log_probs"].reshape(-1) for p in parts])
            rollout = torch.cat([p["rollout_log_probs"].reshape(-1) for p in parts])
            mask = torch.cat([p["loss_mask"].reshape(-1) for p in parts])
            max_d, k3, count = step_mismatch(old, rollout, mask)
            if cfg.max_dlogp is not None and not max_d <= cfg.max_dlogp:
                return f"max |Δlogp| {max_d:.6g} > {cfg.max_dlogp:g} ({count} loss token(s) differ)"
            if cfg.k3 is not None and not k3 <= cfg.k3:
                return f"mean k3 {k3:.6g} > {cfg.k3:g}"
        if cfg.grad_spike is not None and GRAD_NORM_KEY in end:
            norm = float(end[GRAD_NORM_KEY].to(torch.float64).reshape(-1)[0])
            history = list(self._grad_norms)
            self._grad_norms.append(norm)
            if not math.isfinite(norm):
                return f"non-finite gradient norm ({norm})"
            if len(history) >= GRAD_SPIKE_MIN_HISTORY:
                median = statistics.median(history)
                if norm > cfg.grad_spike * median:
                    return (f"gradient norm {norm:.6g} > {cfg.grad_spike:g} × the running median {median:.6g} "
                            f"of the last {len(history)} step(s)")
        return None

    # -- bounds ------------------------------------------------------------------------------------
    def _evict(self) -> None:
        cfg = self.config
        newest = self._entries[-1] if self._entries and self._entries[-1].kind == "step" else None
        while self.held_steps > cfg.steps or (self.held_bytes > cfg.max_bytes and len(self._entries) > 1):
            # the oldest step; the newest is kept whatever it weighs (a trigger on it persists it)
            oldest = next((e for e in self._entries if e.kind == "step" and e is not newest), None)
            if oldest is None:  # only rollouts (and the newest step) left, still over the byte bound
                rollout = next((e for e in self._entries if e.kind == "rollout"), None)
                if rollout is None:
                    return
                self._entries.remove(rollout)
                continue
            self._entries.remove(oldest)
            self.evicted += 1
            self._drop_orphan_rollouts()

    def _drop_orphan_rollouts(self) -> None:
        used = {e.rollout_id for e in self._entries if e.kind == "step"}
        used |= {e.rollout_id for e in self._open.values()}
        rollouts = [e for e in self._entries if e.kind == "rollout"]
        newest = rollouts[-1] if rollouts else None
        for e in rollouts:
            if e is not newest and e.rollout_id not in used:
                self._entries.remove(e)
