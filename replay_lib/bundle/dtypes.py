"""Payloads stored in a float8 format (``torch.float8_e4m3fn``, ``float8_e5m2`` and their ``fnuz`` variants).

torch does no arithmetic on them, not even a promotion (``float64 − float8`` raises), so the reader hands every
stage a float32 copy — exact: each float8 value is a float32 value — and keeps the dtype it was stored in on the
copy (:func:`stored_dtype`), which is what the error model takes a payload's storage rounding of (2⁻⁴ for e4m3,
2⁻³ for e5m2: ``u = 2^-p``, ``p`` = stored mantissa bits + 1, as 2⁻⁸ for bfloat16)."""

from __future__ import annotations

import torch

FLOAT8_DTYPES = tuple(getattr(torch, name) for name in
                      ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, name))

_STORED = "_replay_stored_dtype"


def upcast_stored(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or for a float8 one its float32 copy (exact) that remembers the float8 dtype."""
    if tensor.dtype not in FLOAT8_DTYPES:
        return tensor
    return keep_stored(tensor.to(torch.float32), tensor.dtype)


def keep_stored(tensor: torch.Tensor, like: "torch.Tensor | torch.dtype") -> torch.Tensor:
    """``tensor`` (a slice or copy of a payload) marked with the dtype ``like`` was stored in (a float8 one only;
    any other dtype is the tensor's own)."""
    dtype = like if isinstance(like, torch.dtype) else stored_dtype(like)
    if dtype in FLOAT8_DTYPES:
        setattr(tensor, _STORED, dtype)
    return tensor


def stored_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a payload was stored in: its own, or the float8 one of an upcast copy (:func:`upcast_stored`)."""
    return getattr(tensor, _STORED, None) or tensor.dtype
