"""SkyRL ``policy_loss_type="importance_sampling"`` (Tinker's): ``pg = −exp(logp − old)·A``, unclipped and
unclamped, summed over the loss tokens (the mapping's ``token_sum``).

Read from NovaSky-AI/SkyRL @ a9564572eb8e ``skyrl/backends/skyrl_train/utils/ppo_utils.py:1095-1142``
(``importance_sampling_loss``)."""

from __future__ import annotations

import torch

from . import PolicyFamily, register


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg, sample_terms, rollout_log_probs=None,
                ref_log_probs=None, dtype=torch.float32) -> dict[str, torch.Tensor]:
    lr = log_probs.to(dtype) - old_log_probs.to(dtype)
    ratio = lr.exp()
    pg = ratio * -advantages.to(dtype)
    return {"pg": pg, "clip": torch.zeros_like(pg), "ppo_kl": -lr, "ratio": ratio, "log_ratio": lr}


register(PolicyFamily(name="importance_sampling", defaults={}, token_terms=token_terms, metrics=("ppo_kl",),
                      formula="pg = −exp(logp − old)·A", source="SkyRL ppo_utils.py:1095-1142"))
