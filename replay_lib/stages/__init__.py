"""The stage DAG: one adapter per stage family, registered in pipeline order."""

from __future__ import annotations

from ..bundle.schema import StageId
from .advantage import ADVANTAGE_ESTIMATE, ADVANTAGE_KL
from .base import StageContext, StageDef, StageInputError
from .grad import LOSS_GRAD
from .loss import LOSS_POLICY
from .mismatch import LOGPROB_MISMATCH
from .reward import REWARD_POST_PROCESS, REWARD_RAW
from .sample import SAMPLE
from .support import LOGPROB_SUPPORT
from .value import LOSS_VALUE

# Pipeline order; the first failing stage in this order is the first divergence.
STAGE_ORDER: tuple[StageId, ...] = (
    StageId.SAMPLE,
    StageId.REWARD_RAW,
    StageId.REWARD_POST_PROCESS,
    StageId.ADVANTAGE_KL,
    StageId.ADVANTAGE_ESTIMATE,
    StageId.LOGPROB_SUPPORT,
    StageId.LOGPROB_MISMATCH,
    StageId.LOSS_POLICY,
    StageId.LOSS_VALUE,
    StageId.LOSS_GRAD,
)

REGISTRY: dict[StageId, StageDef] = {
    d.id: d for d in (SAMPLE, REWARD_RAW, REWARD_POST_PROCESS, ADVANTAGE_KL, ADVANTAGE_ESTIMATE, LOGPROB_SUPPORT,
                      LOGPROB_MISMATCH, LOSS_POLICY, LOSS_VALUE, LOSS_GRAD)
}

# Stages this engine can never recompute, whatever the manifest declares (loss.value is recomputed since SPEC
# §4.2: stages/value.py).
UNSUPPORTED: dict[StageId, str] = {}


__all__ = ["REGISTRY", "STAGE_ORDER", "UNSUPPORTED", "StageContext", "StageDef", "StageInputError"]
