"""``loss.value`` hypothesis: the value loss without its ½ — ``(v − R)²`` (slime's convention) where the config
declares verl's ``½·(v − R)²``: the recorded ``vf_loss`` is twice the recompute (the clip fraction unchanged),
judged with the stage's own tolerance."""

from __future__ import annotations

import torch

from ..judge.fields import FieldResult
from ..stages import StageContext
from .base import Hypothesis

STAGE = "loss.value"


def hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    field = next((f for f in fields if f.name == "value" and f.labels and "vf_loss" in f.labels), None)
    if field is None:
        return []
    at = list(field.labels).index("vf_loss")
    doubled = field.actual.to(torch.float64).clone()
    doubled[at] = 2 * doubled[at]
    return [Hypothesis(stage=STAGE, id="value.no_half", values={"value": doubled}, detail=(
        "the recorded vf_loss is the value loss without its ½: (v − R)² (slime's convention) where the config "
        "declares ½·(v − R)² (verl's)"))]
