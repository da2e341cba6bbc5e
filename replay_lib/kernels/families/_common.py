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


def micro_batch_tokens(lengths: torch.Tensor, loss_mask: torch.Tensor, micro_batch) -> tuple[list, torch.Tensor]:
    """``([the loss-token indices of each micro-batch], micro-batch of each sample)``: one stable sort of the loss
    tokens by their sample's micro-batch, then a contiguous slice per micro-batch (the per-micro-batch passes read
    only their own tokens, never a step-long boolean mask per micro-batch)."""
    n = lengths.numel()
    seg = torch.repeat_interleave(torch.arange(n), lengths.to(torch.int64))
    mb_of_sample = torch.tensor(micro_batch, dtype=torch.int64)
    k = int(mb_of_sample.max()) + 1 if n else 0
    at = torch.nonzero(loss_mask > 0).reshape(-1)
    mb = mb_of_sample[seg[at]]
    if n > 1 and not bool((mb_of_sample[1:] >= mb_of_sample[:-1]).all()):  # micro-batches not in sample order
        order = torch.argsort(mb, stable=True)
        at, mb = at[order], mb[order]
    counts = torch.bincount(mb, minlength=k).tolist()
    out, start = [], 0
    for c in counts:
        out.append(at[start:start + c])
        start += c
    return out, mb_of_sample
