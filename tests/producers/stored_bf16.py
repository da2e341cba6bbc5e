"""Family 5 — a float32 trainer whose capture stores its per-token values as bfloat16 payloads.

The trainer is :mod:`producers.torch_sum` (slime's float32 arithmetic on float32 log-probs, as verl computes
its log-probs from float32 logits), but the capture keeps a bfloat16 copy of every per-token tensor to halve
the bundle (the ``kl`` it computed, the log-probs, the reference log-probs and the entropy): every expected
value was computed from values the bundle no longer has, each within one bfloat16 rounding (2⁻⁸ relative) of
what is recorded. It declares ``producer_precision = {"compute": "float32", "accumulate": "float32"}``.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import Family
from . import torch_sum

PRECISION = {"compute": "float32", "accumulate": "float32"}


class StoredBF16(Family):
    def __init__(self) -> None:
        super().__init__(name="stored_bf16", precision=dict(PRECISION))

    def payload(self, values):
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)

    def normalize(self, raw, bounds, std, ddof):
        return torch_sum.normalize(raw, bounds, std, ddof)

    def kl(self, old, ref, kl_type):
        return torch_sum.kl(old, ref, kl_type)

    def loss(self, li, *, eps_clip, eps_clip_high, entropy_coef, agg):
        return torch_sum.loss(li, eps_clip=eps_clip, eps_clip_high=eps_clip_high, entropy_coef=entropy_coef, agg=agg)

    def sample_sums(self, li, *, eps_clip, eps_clip_high):
        return torch_sum.sample_sums(li, eps_clip=eps_clip, eps_clip_high=eps_clip_high)
