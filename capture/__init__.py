"""Training-side capture of replay bundles (SPEC §6). Framework-neutral: imports neither Ray, Megatron
nor anything that needs a GPU; a trainer calls :func:`maybe_enable_for_actor` once and then the hooks."""

from .actor import NULL_STEP, DisabledCapture, ReplayCapture, StepCapture, maybe_enable_for_actor
from .bundles import (
    DEFAULT_REDACTION,
    SUPPORT_CHANNELS,
    SUPPORT_SCORABLE,
    Provenance,
    micro_batch_id,
    rollout_bundle_id,
    step_bundle_id,
    support_capability,
)
from .config import (
    ENV_DIR,
    ENV_ENABLE,
    ENV_GRAD,
    ENV_ROLLOUTS,
    ENV_RUN_ID,
    ENV_STEPS,
    ENV_TOKEN_TERMS,
    CaptureConfig,
    CaptureDisabledWarning,
    config_from_env,
    parse_rollouts,
    parse_run_id,
    parse_steps,
)
from .grad import GradTap
from .directory import CaptureDirectoryError, check_fresh_directory, remove_stale_staging
from .lock import CaptureDirectoryBusy
from .manager import CaptureItem, CaptureManager, CaptureStats
from .producer import producer_info

__all__ = [
    "DEFAULT_REDACTION", "ENV_DIR", "ENV_ENABLE", "ENV_ROLLOUTS", "ENV_RUN_ID", "ENV_STEPS", "ENV_TOKEN_TERMS",
    "ENV_GRAD", "GradTap", "NULL_STEP",
    "CaptureConfig", "CaptureDirectoryBusy", "CaptureDirectoryError", "CaptureDisabledWarning", "CaptureItem", "CaptureManager",
    "CaptureStats", "DisabledCapture", "Provenance", "ReplayCapture", "SUPPORT_CHANNELS", "SUPPORT_SCORABLE",
    "StepCapture", "check_fresh_directory", "config_from_env", "maybe_enable_for_actor", "micro_batch_id",
    "parse_rollouts", "parse_run_id", "parse_steps", "producer_info", "remove_stale_staging",
    "rollout_bundle_id", "step_bundle_id", "support_capability",
]
