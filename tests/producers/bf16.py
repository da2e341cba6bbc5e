"""Family 4 — bf16 payloads: a trainer whose log-probs (and entropy) come out of a bfloat16 forward.

Imitates a Megatron/slime or verl actor running with ``bf16: true`` that records its per-token statistics as
the model produced them (verl's ``old_log_prob``/``ref_log_prob`` under bf16 autocast, NeMo-RL's bf16
``prev_logprobs``): every recorded log-prob and entropy is a bfloat16 value. The per-token KL is computed in
bfloat16 arithmetic (each op rounded to bf16, as a bf16 elementwise kernel does), the loss in float32 from
the bf16 log-probs upcast (``logp.float()``, slime's ``compute_policy_loss``), reduced as slime does
(:mod:`producers.torch_sum`); rewards and advantages stay float32.

It declares ``comparison_policy.producer_precision = {"compute": "bfloat16", "accumulate": "float32"}``.
``payload_dtype`` picks how the bf16 values are stored: ``"bfloat16"`` (the payload dtype the reader takes
as is) or ``"float32"`` (float32 tensors holding bf16-representable values).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .base import Family, check_kl_type
from . import torch_sum

PRECISION = {"compute": "bfloat16", "accumulate": "float32"}
PAYLOAD_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def bf16_values(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to the nearest bfloat16 (kept in a float32 array)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).float().numpy()


class BF16(Family):
    def __init__(self, payload_dtype: str = "bfloat16") -> None:
        if payload_dtype not in PAYLOAD_DTYPES:
            raise ValueError(f"payload_dtype must be one of {', '.join(PAYLOAD_DTYPES)}, got {payload_dtype!r}")
        super().__init__(name=f"bf16_{payload_dtype}", precision=dict(PRECISION),
                         options={"payload_dtype": payload_dtype})
        self.dtype = PAYLOAD_DTYPES[payload_dtype]

    def prepare(self, inputs):
        return dataclasses.replace(
            inputs, old_log_probs=bf16_values(inputs.old_log_probs), log_probs=bf16_values(inputs.log_probs),
            ref_log_probs=bf16_values(inputs.ref_log_probs), entropy=bf16_values(inputs.entropy))

    def payload(self, values):
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(self.dtype)

    def normalize(self, raw, bounds, std, ddof):
        return torch_sum.normalize(raw, bounds, std, ddof)

    def kl(self, old, ref, kl_type):
        check_kl_type(kl_type)
        log_ratio = torch.from_numpy(old).to(torch.bfloat16) - torch.from_numpy(ref).to(torch.bfloat16)
        if kl_type == "k1":
            value = log_ratio
        elif kl_type == "k2":
            value = log_ratio * log_ratio / 2.0
        else:
            neg = -log_ratio
            value = neg.exp() - 1 - neg
            if kl_type == "low_var_kl":
                value = torch.clamp(value, min=-10, max=10)
        return value.float().numpy()

    def loss(self, li, *, eps_clip, eps_clip_high, entropy_coef, agg):
        # float32 from the bf16 values upcast: the recorded payload is what the loss consumed
        return torch_sum.loss(li, eps_clip=eps_clip, eps_clip_high=eps_clip_high, entropy_coef=entropy_coef, agg=agg)

    def sample_sums(self, li, *, eps_clip, eps_clip_high):
        return torch_sum.sample_sums(li, eps_clip=eps_clip, eps_clip_high=eps_clip_high)
