"""The stage DAG: one adapter per stage family, registered in pipeline order."""

from __future__ import annotations

from ..schema import StageId
from .advantage import ADVANTAGE_ESTIMATE, ADVANTAGE_KL
from .base import StageContext, StageDef, StageInputError
from .loss import LOSS_POLICY
from .reward import REWARD_POST_PROCESS, REWARD_RAW
from .sample import SAMPLE
from .support import LOGPROB_SUPPORT

# Pipeline order; the first failing stage in this order is the first divergence.
STAGE_ORDER: tuple[StageId, ...] = (
    StageId.SAMPLE,
    StageId.REWARD_RAW,
    StageId.REWARD_POST_PROCESS,
    StageId.ADVANTAGE_KL,
    StageId.ADVANTAGE_ESTIMATE,
    StageId.LOGPROB_SUPPORT,
    StageId.LOSS_POLICY,
    StageId.LOSS_VALUE,
)

REGISTRY: dict[StageId, StageDef] = {
    d.id: d for d in (SAMPLE, REWARD_RAW, REWARD_POST_PROCESS, ADVANTAGE_KL, ADVANTAGE_ESTIMATE, LOGPROB_SUPPORT,
                      LOSS_POLICY)
}

# Stages this engine can never recompute, whatever the manifest declares.
UNSUPPORTED: dict[StageId, str] = {StageId.LOSS_VALUE: "value loss is unsupported in V1 (GRPO has no critic)"}


__all__ = ["REGISTRY", "STAGE_ORDER", "UNSUPPORTED", "StageContext", "StageDef", "StageInputError"]
