"""SkyRL ``policy_loss_type="cross_entropy"``: ``pg = −logp`` (supervised; the advantages and old log-probs are not
read), summed over the loss tokens (``reduce_loss``: the mapping's ``token_sum``), no clipping.

Read from NovaSky-AI/SkyRL @ a9564572eb8e ``skyrl/backends/skyrl_train/utils/ppo_utils.py:1057-1092``
(``cross_entropy_loss``) and ``:1145-1149`` (``reduce_loss``)."""

from __future__ import annotations

import torch

from . import PolicyFamily, register


def token_terms(log_probs, old_log_probs, advantages, knobs, *, seg, sample_terms, rollout_log_probs=None,
                ref_log_probs=None, dtype=torch.float32) -> dict[str, torch.Tensor]:
    logp = log_probs.to(dtype)
    lr = logp - old_log_probs.to(dtype)
    return {"pg": -logp, "clip": torch.zeros_like(logp), "ppo_kl": -lr, "ratio": lr.exp(), "log_ratio": lr,
            "pg_err": torch.zeros_like(logp)}


register(PolicyFamily(name="cross_entropy", defaults={}, token_terms=token_terms, metrics=(),
                      formula="pg = −logp", source="SkyRL ppo_utils.py:1057-1092"))
