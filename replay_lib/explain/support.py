"""``logprob.support`` hypothesis: the recorded log-probs are the full-vocabulary ones (the bundle's
``full_log_probs`` payload, each sampled token's log-prob over the whole vocabulary) where the config claims
sample-support scoring — a trainer that records the support and then scores over the whole vocabulary. Judged
with the stage's own tolerance on the fields whose payload a full-vocabulary value can stand for."""

from __future__ import annotations

import torch

from ..judge.fields import FieldResult
from ..stages import StageContext
from .base import Hypothesis

STAGE = "logprob.support"
SCORED = {"support_logprob": "log_probs", "support_old_logprob": "old_log_probs", "support_ref_logprob": "ref_log_probs"}


def hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    scored = [f for f in fields if f.name in SCORED]
    if not scored or not ctx.has("full_log_probs"):
        return []
    full = ctx.payload("full_log_probs").reshape(-1).to(torch.float64)
    if any(full.numel() != f.size for f in scored):
        return []
    names = ", ".join(SCORED[f.name] for f in scored if bool(f.bad.any())) or "log-probs"
    return [Hypothesis(stage=STAGE, id="support.full_vocabulary", values={f.name: full for f in scored}, detail=(
        f"the recorded {names} are scored over the whole vocabulary (they equal full_log_probs), not over each "
        f"token's sampler support as the bundle declares"))]
