"""Capture configuration, read from the environment (no command-line change in the training job).

``RELAX_REPLAY_CAPTURE=1``            enables capture (off by default);
``RELAX_REPLAY_CAPTURE_DIR=PATH``     where bundles go (required; without it capture warns once, stays off);
``RELAX_REPLAY_CAPTURE_STEPS=R:S,…``  step-level bundles to write (unset or blank = every actor step);
``RELAX_REPLAY_CAPTURE_ROLLOUTS=R,…`` rollout-level bundles to write (unset or blank = every rollout);
``RELAX_REPLAY_CAPTURE_RUN_ID=ID``    write under ``<DIR>/<ID>/`` instead of ``<DIR>/`` (a restarted job that
                                      keeps its directory: see ``capture.directory``);
``RELAX_REPLAY_CAPTURE_FORMAT=1|2``  the bundle format's major: 1 (default, ours: 1.3.0) or 2 (the original tool's 2.0.0:
                                      no reward stages, each sample's post-processed reward its ``reward``);
``RELAX_REPLAY_CAPTURE_TOKEN_TERMS=0`` do not write the per-token surrogate ``pg_losses`` into step bundles (on
                                      when unset or blank: one more float per token, measured within the noise of
                                      the example trainer's step time (bench/bench_capture.py --token-terms); the
                                      per-sample loss terms are always written when the trainer gives them).
``RELAX_REPLAY_CAPTURE_GRAD=1``       also write ``grad_log_probs`` (∂L/∂log_probs, from a tensor hook: stage
                                      ``loss.grad``) and, for PPO, ``grad_values`` into step bundles (off by
                                      default: one more float per token each).

The two filters are independent: ``STEPS`` selects step-level bundles, ``ROLLOUTS`` rollout-level ones.
A malformed value raises ``ValueError`` naming the variable and the bad item when capture is enabled.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

ENV_ENABLE = "RELAX_REPLAY_CAPTURE"
ENV_DIR = "RELAX_REPLAY_CAPTURE_DIR"
ENV_STEPS = "RELAX_REPLAY_CAPTURE_STEPS"
ENV_ROLLOUTS = "RELAX_REPLAY_CAPTURE_ROLLOUTS"
ENV_RUN_ID = "RELAX_REPLAY_CAPTURE_RUN_ID"
ENV_TOKEN_TERMS = "RELAX_REPLAY_CAPTURE_TOKEN_TERMS"
ENV_GRAD = "RELAX_REPLAY_CAPTURE_GRAD"
ENV_FORMAT = "RELAX_REPLAY_CAPTURE_FORMAT"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
# A run id is one plain, visible path component (the payload-name rule of the bundle format): the readers
# skip hidden entries, and a separator or ``..`` would put the run somewhere else than under the directory.
_RUN_ID = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
# Names the capture directory already gives a meaning to: a run id spelled like one would read as a bundle.
_RESERVED_RUN_ID = re.compile(r"\A(rollout-[0-9]+|step-[0-9]+-[0-9]+|rank-[0-9]+|COMPLETE(\.[0-9]+)?)\Z")

_warned_no_dir = False
_warn_lock = threading.Lock()


class CaptureDisabledWarning(RuntimeWarning):
    """Capture was requested but cannot run (for example ``RELAX_REPLAY_CAPTURE_DIR`` is unset)."""


@dataclass(frozen=True)
class CaptureConfig:
    """What to capture. ``steps`` / ``rollouts`` of ``None`` mean "all". ``directory`` is where bundles go:
    ``<DIR>/<run_id>`` when a run id is set, else ``<DIR>`` itself. ``token_terms``: step bundles carry the
    per-token ``pg_losses`` payload."""

    enabled: bool = False
    directory: Optional[Path] = None
    steps: Optional[frozenset[tuple[int, int]]] = None
    rollouts: Optional[frozenset[int]] = None
    run_id: Optional[str] = None
    token_terms: bool = False
    # step bundles carry grad_log_probs (and grad_values): RELAX_REPLAY_CAPTURE_GRAD
    grad: bool = False
    format_major: int = 1  # RELAX_REPLAY_CAPTURE_FORMAT: 1 (format 1.x) or 2 (the original's 2.0.0)

    @property
    def root(self) -> Optional[Path]:
        """The directory ``RELAX_REPLAY_CAPTURE_DIR`` names (the parent of a run's directory)."""
        if self.directory is None or self.run_id is None:
            return self.directory
        return self.directory.parent

    def wants_step(self, rollout_id: int, step_id: int) -> bool:
        return self.enabled and (self.steps is None or (int(rollout_id), int(step_id)) in self.steps)

    def wants_rollout(self, rollout_id: int) -> bool:
        return self.enabled and (self.rollouts is None or int(rollout_id) in self.rollouts)


DISABLED = CaptureConfig()


def _non_negative_int(text: str) -> Optional[int]:
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _items(variable: str, value: str) -> list[str]:
    items = value.split(",")
    for item in items:
        if not item.strip():
            raise ValueError(f"{variable}={value!r}: empty item (expected a comma-separated list without blanks)")
    return [item.strip() for item in items]


def parse_steps(value: str, variable: str = ENV_STEPS) -> frozenset[tuple[int, int]]:
    """``"0:0,3:1"`` → ``{(0, 0), (3, 1)}``: actor steps as ``ROLLOUT_ID:STEP_ID``."""
    steps = set()
    for item in _items(variable, value):
        parts = item.split(":")
        numbers = [_non_negative_int(p) for p in parts]
        if len(parts) != 2 or None in numbers:
            raise ValueError(
                f"{variable}={value!r}: bad item {item!r} (expected ROLLOUT_ID:STEP_ID with non-negative integers)"
            )
        steps.add((numbers[0], numbers[1]))
    return frozenset(steps)


def parse_rollouts(value: str, variable: str = ENV_ROLLOUTS) -> frozenset[int]:
    """``"0,2"`` → ``{0, 2}``: rollout ids."""
    rollouts = set()
    for item in _items(variable, value):
        number = _non_negative_int(item)
        if number is None:
            raise ValueError(f"{variable}={value!r}: bad item {item!r} (expected a non-negative integer rollout id)")
        rollouts.add(number)
    return frozenset(rollouts)


def parse_run_id(value: str, variable: str = ENV_RUN_ID) -> str:
    """A run id: one plain file stem (letters, digits, ``_ . -``; not hidden, no separator, no ``..``)."""
    text = value.strip()
    if not _RUN_ID.match(text) or ".." in text:
        raise ValueError(f"{variable}={value!r}: expected a plain file stem (letters, digits, '_', '.', '-'; "
                         "at most 128, not starting with '.' or '-', no '..')")
    if _RESERVED_RUN_ID.match(text):
        raise ValueError(f"{variable}={value!r}: reads as a bundle, rank or sentinel name of the capture "
                         "directory (expected another name)")
    return text


def parse_enabled(value: Optional[str], variable: str = ENV_ENABLE) -> bool:
    text = (value or "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{variable}={value!r}: expected 1 (on) or 0 (off)")


def parse_format(value: Optional[str], variable: str = ENV_FORMAT) -> int:
    """The bundle format's major: unset or blank → 1; ``1`` or ``2`` (``1.0.0`` / ``2.0.0`` too)."""
    text = (value or "").strip()
    if not text:
        return 1
    if text in ("1", "1.0.0"):
        return 1
    if text in ("2", "2.0.0"):
        return 2
    raise ValueError(f"{variable}={value!r}: expected 1 (format 1.x) or 2 (format 2.0.0)")


def _warn_no_dir() -> None:
    global _warned_no_dir
    with _warn_lock:
        if _warned_no_dir:
            return
        _warned_no_dir = True
    warnings.warn(
        f"{ENV_ENABLE}=1 but {ENV_DIR} is not set: replay capture stays off",
        CaptureDisabledWarning,
        stacklevel=3,
    )


def config_from_env(env: Optional[Mapping[str, str]] = None) -> CaptureConfig:
    """Read the capture configuration. Off unless ``RELAX_REPLAY_CAPTURE`` is on; filters are parsed
    (and malformed ones refused) only when capture is on, so a stale filter never breaks a plain run."""
    env = os.environ if env is None else env
    if not parse_enabled(env.get(ENV_ENABLE)):
        return DISABLED
    directory = (env.get(ENV_DIR) or "").strip()
    steps_text = env.get(ENV_STEPS)
    rollouts_text = env.get(ENV_ROLLOUTS)
    # A blank filter is treated as unset ("all"), like an empty ``export VAR=``.
    steps = parse_steps(steps_text) if steps_text and steps_text.strip() else None
    rollouts = parse_rollouts(rollouts_text) if rollouts_text and rollouts_text.strip() else None
    run_id_text = env.get(ENV_RUN_ID)
    run_id = parse_run_id(run_id_text) if run_id_text and run_id_text.strip() else None
    token_terms_text = env.get(ENV_TOKEN_TERMS)  # unset or blank: on (a loss bug is followed to its tokens)
    token_terms = parse_enabled(token_terms_text, ENV_TOKEN_TERMS) if token_terms_text and token_terms_text.strip() \
        else True
    grad = parse_enabled(env.get(ENV_GRAD), ENV_GRAD)
    format_major = parse_format(env.get(ENV_FORMAT))
    if not directory:
        _warn_no_dir()
        return DISABLED
    path = Path(directory) if run_id is None else Path(directory) / run_id
    return CaptureConfig(enabled=True, directory=path, steps=steps, rollouts=rollouts, run_id=run_id,
                         token_terms=token_terms, grad=grad, format_major=format_major)
