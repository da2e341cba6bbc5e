"""What the family kernels share: the token log-ratio as every family takes it, and the gap to a decision edge."""

from __future__ import annotations

import math
from typing import Optional

import torch

INF = math.inf


def log_ratio(log_probs: torch.Tensor, anchor: torch.Tensor, clamp: Optional[float],
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, Δ)`` in ``dtype``: ``Δ = logp − anchor`` clamped to ``±clamp`` when set (verl's ±20)."""
    logp = log_probs.to(dtype)
    lr = logp - anchor.to(dtype)
    return logp, (lr if clamp is None else lr.clamp(-clamp, clamp))


def relative_gap(x: torch.Tensor, *edges: float) -> torch.Tensor:
    """``min_e |x − e| / |x|``: the relative distance of ``x`` to its nearest edge (``inf`` for none)."""
    gap = torch.full_like(x, INF)
    for e in edges:
        gap = torch.minimum(gap, (x - e).abs() / x.abs())
    return gap


def zeros(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like)
