"""advantage.kl kernels: the per-token KL estimators k1, k2, k3, low_var_kl, abs."""

from __future__ import annotations

from typing import Optional

import torch


KL_TYPES = ("k1", "k2", "k3", "low_var_kl", "abs")


# low_var_kl's clamp of the k3 value
KL_CLAMP = 10.0


def compute_approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, kl_loss_type: str,
                      dtype: torch.dtype = torch.float32, clamp: Optional[float] = None) -> torch.Tensor:
    """Per-token KL estimate with ``r = log_probs − log_probs_base``, in ``dtype``.

    k1 = r; k2 = r²/2; k3 = exp(−r) − 1 + r; low_var_kl = k3 clamped to [−10, 10]; abs = |r| (verl
    ``kl_penalty_forward``'s ``abs``); ``clamp``: the estimate clamped to ``[−clamp, clamp]`` as well
    (OpenRLHF clamps every estimator's value at ±10).
    """
    if kl_loss_type not in KL_TYPES:
        raise ValueError(f"unknown kl_loss_type {kl_loss_type!r} (expected one of {', '.join(KL_TYPES)})")
    return kl_of_log_ratio(log_probs.to(dtype) - log_probs_base.to(dtype), kl_loss_type, clamp)[0]


def kl_of_log_ratio(log_ratio: torch.Tensor, kl_loss_type: str,
                    clamp: Optional[float] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(estimate, exp(−r))`` of :func:`compute_approx_kl` at ``r = log_ratio`` (in its dtype); the exponential
    is ``None`` for k1, k2 and abs, which have none (the error model's bound of k3 reads the same one). ``clamp``
    clamps the estimate to ``[−clamp, clamp]`` (1-Lipschitz: the unclamped rounding bound holds at the edge)."""
    if kl_loss_type == "k1":
        kl, e = log_ratio, None
    elif kl_loss_type == "abs":
        kl, e = log_ratio.abs(), None
    elif kl_loss_type == "k2":
        kl, e = log_ratio * log_ratio / 2.0, None
    else:
        neg = -log_ratio
        e = neg.exp()
        kl = e - 1 - neg
        if kl_loss_type == "low_var_kl":
            kl = torch.clamp(kl, min=-KL_CLAMP, max=KL_CLAMP)
    if clamp is not None:
        kl = torch.clamp(kl, min=-clamp, max=clamp)
    return kl, e


def rollout_kl(
    old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor | None, kl_coef: float, kl_loss_type: str,
    dtype: torch.dtype = torch.float32, clamp: Optional[float] = None,
) -> torch.Tensor:
    """advantage.kl: rollout vs reference; all zeros when ``kl_coef == 0`` (no reference needed); ``clamp``:
    the estimate's ``±clamp`` (``kl_penalty_clamp``)."""
    if kl_coef == 0:
        return torch.zeros(old_log_probs.shape[0], dtype=dtype)
    if ref_log_probs is None:
        raise ValueError("ref_log_probs is required when kl_coef != 0")
    return compute_approx_kl(old_log_probs, ref_log_probs, kl_loss_type, dtype=dtype, clamp=clamp)
