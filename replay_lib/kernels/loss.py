"""loss.policy kernels: the clipped surrogate and its aggregation into the reported fields."""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from .segments import masked_sample_sums, segment_sum


def compute_policy_loss(
    ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate: ``(pg_losses, clipfrac)`` with ``ppo_kl = old − logp``, in the dtype of
    ``ppo_kl``."""
    pg_losses, clipfrac, _ = policy_loss_terms(ppo_kl, advantages, eps_clip, eps_clip_high)
    return pg_losses, clipfrac


def policy_loss_terms(
    ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`compute_policy_loss` and the ratio ``exp(−ppo_kl)`` it took: ``(pg_losses, clipfrac, ratio)``."""
    ratio = (-ppo_kl).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).to(ppo_kl.dtype)
    return pg_losses, clipfrac, ratio


def sum_of_sample_mean(values: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor, n_samples: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Σ_samples Σ_t x·mask / max(Σ_t mask, 1)``: the sum of per-sample masked means."""
    mask = mask.to(dtype)
    per_sample = segment_sum(values.to(dtype) * mask, seg, n_samples)
    denom = torch.clamp_min(segment_sum(mask, seg, n_samples), 1.0)
    return (per_sample / denom).sum()


LOSS_FIELDS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl")


def policy_loss_fields(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    entropy: torch.Tensor | None,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    entropy_coef: float,
    dtype: torch.dtype = torch.float32,
) -> Mapping[str, torch.Tensor]:
    """The reported loss.policy fields: ``loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl`` (0-d ``dtype``).

    Each field is :func:`sum_of_sample_mean` of its per-token value. The masked per-sample sums are
    accumulated chunk by chunk; ``index_add_`` adds in token order either way, so the result is the same
    as one pass over all tokens.
    """
    sums = masked_sample_sums(lengths, loss_mask, policy_loss_columns(
        log_probs, old_log_probs, advantages, entropy, loss_mask, eps_clip=eps_clip, eps_clip_high=eps_clip_high,
        dtype=dtype), {name: dtype for name in POLICY_SUMS})
    return policy_fields_from_sums(sums, entropy is not None, entropy_coef)


# The per-sample sums :func:`policy_loss_fields` reduces: Σ_t x·mask of the surrogate, the clip indicator,
# ppo_kl and entropy, and Σ_t mask.
POLICY_SUMS = ("pg", "clip", "kl", "ent", "mask")


def policy_loss_columns(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, entropy: Optional[torch.Tensor],
    loss_mask: torch.Tensor, *, eps_clip: float, eps_clip_high: float, dtype: torch.dtype,
) -> Callable[[int, int, torch.Tensor], dict[str, torch.Tensor]]:
    """The masked per-token terms of :data:`POLICY_SUMS` for one chunk, in ``dtype``."""
    mask = loss_mask.to(dtype)

    def columns(start: int, stop: int, seg: torch.Tensor) -> dict[str, torch.Tensor]:
        m = mask[start:stop]
        ppo_kl = old_log_probs[start:stop].to(dtype) - log_probs[start:stop].to(dtype)
        pg_losses, clipfrac = compute_policy_loss(ppo_kl, advantages[start:stop].to(dtype), eps_clip, eps_clip_high)
        out = {"pg": pg_losses * m, "clip": clipfrac * m, "kl": ppo_kl * m}
        if entropy is not None:
            out["ent"] = entropy[start:stop].to(dtype) * m
        out["mask"] = m
        return out

    return columns


def policy_fields_from_sums(sums: Mapping[str, torch.Tensor], has_entropy: bool,
                            entropy_coef: float) -> dict[str, torch.Tensor]:
    """The five loss.policy fields from the per-sample sums of :data:`POLICY_SUMS`: each a sum over samples of
    the masked means (``Σ_t x·mask / max(Σ_t mask, 1)``)."""
    denom = torch.clamp_min(sums["mask"], 1.0)
    pg_loss = (sums["pg"] / denom).sum()
    entropy_loss = (sums["ent"] / denom).sum() if has_entropy else torch.zeros((), dtype=pg_loss.dtype)
    return {
        "loss": pg_loss - entropy_coef * entropy_loss,
        "pg_loss": pg_loss,
        "entropy_loss": entropy_loss,
        "pg_clipfrac": (sums["clip"] / denom).sum(),
        "ppo_kl": (sums["kl"] / denom).sum(),
    }
