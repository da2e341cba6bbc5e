"""``reward.raw`` hypothesis: the rewards the trainer normalized (the samples' ``raw_reward``) are the reward
functions' scores **normalized over the whole batch**, each function's column ``(s − mean)/(std + eps)``, where
the recorded ``raw_rewards`` are the weighted sum of the scores as the functions returned them.

The evidence, from the recorded values alone: every column of ``reward.raw.rewards_per_func`` (``[B, K]``
row-major, the per-function rewards the trainer summed; without it, the one column of the samples'
``raw_reward``) has mean 0 and standard deviation 1 over the batch (within :data:`STANDARD`), and the recorded
``raw_rewards`` are, within the field's tolerance, ``Σ_k a_k·column_k + b`` with every ``a_k > 0`` — the
weighted sum of scores ``s_k = column_k·(std_k + eps) + mean_k`` (a least-squares fit of the ``K + 1``
coefficients, only with more samples than coefficients). The hypothesis's values are that fit, each within
``C_FIT·u32·(Σ_k |a_k·column_k| + |b|)``: the recorded columns are a float32 trainer's values.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..judge.fields import FieldResult
from ..stages import StageContext
from .base import Hypothesis

STAGE = "reward.raw"
STANDARD = 1e-3  # |mean| and |std − 1| of a column normalized in float32 over a batch
C_FIT = 8.0  # roundings of a float32 column, its scale and the sum, with room
U32 = 2.0 ** -24


def _columns(ctx: StageContext) -> Optional[torch.Tensor]:
    """``[B, K]`` float64: the recorded per-function rewards, else the samples' raw rewards as one column;
    ``None`` when what is recorded is not a finite ``[B, K]`` table of the selected samples."""
    recorded = ctx.reader.expected.get(STAGE, {})
    per_func = recorded.get("rewards_per_func") if isinstance(recorded, dict) else None
    n = len(ctx.reader.index.samples)
    if isinstance(per_func, list) and per_func and n and len(per_func) % n == 0 and \
            all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in per_func):
        table = torch.tensor(per_func, dtype=torch.float64).reshape(n, -1)
        if ctx.partial:
            table = table[torch.tensor(ctx.indices, dtype=torch.int64)]
    else:
        table = ctx.raw_rewards.reshape(-1, 1)
    return table if bool(torch.isfinite(table).all()) else None


def hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    field = next((f for f in fields if f.name == "raw_reward"), None)
    if field is None or ctx.partial:  # the batch's statistics need the whole batch
        return []
    table = _columns(ctx)
    if table is None:
        return []
    b, k = table.shape
    if b < k + 2:
        return []
    mean, std = table.mean(0), table.std(0)
    if not (bool((mean.abs() <= STANDARD).all()) and bool(((std - 1).abs() <= STANDARD).all())):
        return []
    expected = field.expected.to(torch.float64)
    if not bool(torch.isfinite(expected).all()):
        return []
    design = torch.cat([table, torch.ones(b, 1, dtype=torch.float64)], 1)
    coef = torch.linalg.lstsq(design, expected.reshape(-1, 1)).solution.reshape(-1)
    if not bool(torch.isfinite(coef).all()) or not bool((coef[:k] > 0).all()):
        return []
    fitted = design @ coef
    bound = C_FIT * U32 * ((table * coef[:k]).abs().sum(1) + coef[k].abs())
    scales = ", ".join(f"{float(a):.4g}" for a in coef[:k])
    what = f"each of the {k} reward functions' scores" if k > 1 else "the scores"
    return [Hypothesis(stage=STAGE, id="reward.raw_batch_normalized", values={"raw_reward": fitted},
                       bounds={"raw_reward": bound}, detail=(
        f"the rewards the trainer normalized are {what} normalized over the whole batch of {b} samples "
        f"((s − mean)/std) before its group normalization; the recorded raw_rewards (the scores as returned) are "
        f"their affine image (weight·std {scales}; offset {float(coef[k]):.4g})"))]


__all__ = ["hypotheses", "STAGE"]
