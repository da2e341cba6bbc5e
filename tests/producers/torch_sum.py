"""Family 1 — eager PyTorch in float32 with one ``torch.sum`` per sample: the common producer.

Imitates slime (THUDM/slime), the framework whose loss the SPEC's V1 formula is:
* ``slime/backends/megatron_utils/cp_utils.py`` ``get_sum_of_sample_mean`` (CP = 1): a Python ``sum`` over
  ``(x_i * loss_mask_i).sum() / torch.clamp_min(loss_mask_i.sum(), 1)`` for ``x.split(response_lengths)`` —
  torch's vectorized cascade sum inside a sample, then left-to-right float32 additions across samples;
* ``slime/utils/ppo_utils.py`` ``compute_approx_kl`` and ``compute_policy_loss`` (``log_ratio.exp() - 1 -
  log_ratio``, ``ratio.clamp(1 - eps_clip, 1 + eps_clip_high)``, ``torch.maximum``, ``torch.gt``);
* the rollout side's GRPO post-processing: ``rewards.mean(dim=-1)``, ``rewards - mean``, ``.std(dim=-1)``
  (unbiased) and ``/ (std + 1e-6)``, in float32 from the Python float rewards.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import STD_EPS, TOKEN_MEAN, Family, LossInputs, check_kl_type


def normalize(raw: np.ndarray, bounds, std: bool, ddof: int, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """Group by group in ``dtype`` (float32: this family's; float64: the upcasting family's), as float64."""
    rewards = torch.tensor(raw.tolist(), dtype=dtype)
    out = torch.empty_like(rewards)
    for a, b in bounds:
        group = rewards[a:b]
        centered = group - group.mean()
        if std:
            centered = centered / (centered.std(correction=ddof) + STD_EPS)
        out[a:b] = centered
    return out.numpy().astype(np.float64)


def kl(old: np.ndarray, ref: np.ndarray, kl_type: str, exp=torch.exp) -> np.ndarray:
    check_kl_type(kl_type)
    log_ratio = torch.from_numpy(old) - torch.from_numpy(ref)
    if kl_type == "k1":
        return log_ratio.numpy()
    if kl_type == "k2":
        return (log_ratio ** 2 / 2.0).numpy()
    log_ratio = -log_ratio
    value = exp(log_ratio) - 1 - log_ratio
    if kl_type == "low_var_kl":
        value = torch.clamp(value, min=-10, max=10)
    return value.numpy()


def token_terms(li: LossInputs, eps_clip: float, eps_clip_high: float, exp=torch.exp) -> dict[str, torch.Tensor]:
    """Per-token pg loss, clip indicator, ppo_kl and entropy (float32), as slime's compute_policy_loss."""
    ppo_kl = torch.from_numpy(li.old_log_probs) - torch.from_numpy(li.log_probs)
    advantages = torch.from_numpy(np.ascontiguousarray(li.advantages, dtype=np.float32))
    ratio = exp(-ppo_kl)
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    return {"pg": torch.maximum(pg_losses1, pg_losses2), "clip": torch.gt(pg_losses2, pg_losses1).float(),
            "kl": ppo_kl, "ent": torch.from_numpy(li.entropy)}


def fields(reduced: dict[str, torch.Tensor], entropy_coef: float) -> dict[str, float]:
    pg_loss, entropy_loss = reduced["pg"], reduced["ent"]
    return {"loss": float(pg_loss - entropy_coef * entropy_loss), "pg_loss": float(pg_loss),
            "entropy_loss": float(entropy_loss), "pg_clipfrac": float(reduced["clip"]), "ppo_kl": float(reduced["kl"])}


def sum_of_sample_mean(x: torch.Tensor, mask: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return sum([(x_i * m_i).sum() / torch.clamp_min(m_i.sum(), 1)
                for x_i, m_i in zip(x.split(lengths), mask.split(lengths))])


def token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / torch.clamp_min(mask.sum(), 1)


def loss(li: LossInputs, *, eps_clip: float, eps_clip_high: float, entropy_coef: float, agg: str,
         exp=torch.exp) -> dict[str, float]:
    """The five loss.policy scalars as slime reduces them (or one global token mean for ``token_mean``)."""
    terms = token_terms(li, eps_clip, eps_clip_high, exp=exp)
    mask = torch.from_numpy(li.mask).float()
    if agg == TOKEN_MEAN:
        reduced = {k: token_mean(x, mask) for k, x in terms.items()}
    else:
        lengths = li.lengths.tolist()
        reduced = {k: sum_of_sample_mean(x, mask, lengths) for k, x in terms.items()}
    return fields(reduced, entropy_coef)


def sample_sums(li: LossInputs, *, eps_clip: float, eps_clip_high: float, exp=torch.exp) -> dict[str, np.ndarray]:
    """Each sample's ``(x_i * loss_mask_i).sum()`` and ``loss_mask_i.sum()``, the float32 values slime's
    ``sum_of_sample_mean`` divides."""
    terms = token_terms(li, eps_clip, eps_clip_high, exp=exp)
    terms["mask"] = torch.ones(li.mask.size, dtype=torch.float32)
    lengths = li.lengths.tolist()
    masks = torch.from_numpy(li.mask).float().split(lengths)
    return {k: np.array([float((x_i * m_i).sum()) for x_i, m_i in zip(x.split(lengths), masks)])
            for k, x in terms.items()}


class TorchSum(Family):
    def __init__(self) -> None:
        super().__init__(name="torch_sum")

    def normalize(self, raw, bounds, std, ddof):
        return normalize(raw, bounds, std, ddof)

    def kl(self, old, ref, kl_type):
        return kl(old, ref, kl_type)

    def loss(self, li, *, eps_clip, eps_clip_high, entropy_coef, agg):
        return loss(li, eps_clip=eps_clip, eps_clip_high=eps_clip_high, entropy_coef=entropy_coef, agg=agg)

    def sample_sums(self, li, *, eps_clip, eps_clip_high):
        return sample_sums(li, eps_clip=eps_clip, eps_clip_high=eps_clip_high)
