"""Sample-support scoring (SPEC §7) and the invariants of the packed support rows.

With top-k/top-p sampling the sampler draws token ``y`` from a bounded support ``S_t``; the trainer
renormalizes each sampled token over that support::

    logp_S(y) = l_y − m − log Σ_{j∈S_t} exp(l_j − m),   m = max_{j∈S_t} l_j

Any additive normalizer cancels, so the member logits and the members' full-vocabulary log-probs give the
same value. Layout: ``support_ids`` int ``[Σ T, K]`` (one row per response token, right-padded with −1),
``support_logits`` float ``[Σ T, K]`` gathered at those ids (padding slots arbitrary), ``sampled_token_ids``
``[Σ T]``. Everything here is vectorized over the packed token axis; the only Python loop walks blocks of
``BLOCK_ROWS`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SUPPORT_PAD = -1


def sort_rows(x: torch.Tensor, out: Optional["np.ndarray"] = None) -> torch.Tensor:
    """Each row of a 2-D integer tensor sorted ascending (``out``: an optional numpy buffer to sort in).

    numpy's SIMD sort is several times faster than ``torch.sort`` on CPU for short rows (K ≈ 20, millions
    of rows), and the duplicate check is the most expensive part of the support invariants.
    """
    if x.shape[-1] <= 1:
        return x
    try:
        import numpy as np

        src = x.detach().cpu().numpy()
        if out is None or out.shape != src.shape or out.dtype != src.dtype:
            return torch.from_numpy(np.sort(src, axis=-1))
        out[...] = src
        out.sort(axis=-1)
        return torch.from_numpy(out)
    except (ImportError, RuntimeError, TypeError):  # numpy missing or an incompatible build
        return torch.sort(x, dim=-1).values


def _sort_buffer(shape: tuple[int, int], dtype: torch.dtype):
    """A reusable numpy buffer for :func:`sort_rows`, or ``None`` where numpy is not installed."""
    try:
        return torch.empty(shape, dtype=dtype).numpy()
    except (ImportError, RuntimeError, TypeError):  # torch without numpy: sort_rows falls back to torch
        return None


def _first_true(flags: torch.Tensor) -> torch.Tensor:
    """``[rows, K]`` bool → int64 index of the first true slot per row (0 where none).

    numpy's argmax over short boolean rows is about twice as fast as torch's."""
    try:
        import numpy as np

        return torch.from_numpy(np.argmax(flags.numpy(), axis=1).astype(np.int64, copy=False))
    except (ImportError, RuntimeError, TypeError):  # numpy missing or an incompatible build
        return flags.view(torch.uint8).argmax(1).to(torch.int64)


# Rows per block: the [block, K] temporaries stay small and are reused by the allocator, which on a large
# bundle is twice as fast as whole-tensor passes that fault in fresh pages for every [Σ T, K] temporary.
BLOCK_ROWS = 65536


@dataclass(frozen=True)
class SupportRows:
    """Per-token results of :func:`check_support_rows` (all ``[Σ T]``)."""

    id_out_of_range: torch.Tensor  # bool: an id outside [−1, vocab_size)
    padding_not_trailing: torch.Tensor  # bool: a −1 slot precedes a slot that is not −1
    duplicate: torch.Tensor  # bool: a member id appears twice
    has_support: torch.Tensor  # bool: at least one member (id ≥ 0)
    padded: torch.Tensor  # bool: at least one slot is not a member (padding or a negative id)
    sampled_out_of_range: torch.Tensor  # bool: sampled id outside [0, vocab_size)
    sampled_in_row: torch.Tensor  # bool: the sampled id is a member of its row
    sampled_slot: torch.Tensor  # int64: first slot holding the sampled id (0 when absent)


def check_support_rows(
    support_ids: torch.Tensor, sampled_token_ids: torch.Tensor, vocab_size: Optional[int]
) -> SupportRows:
    """Structural invariants of each support row. ``vocab_size=None`` skips the upper bound only."""
    if support_ids.dim() != 2:
        raise ValueError(f"support_ids must be [tokens, K], got shape {list(support_ids.shape)}")
    n, k = support_ids.shape
    sampled = sampled_token_ids.reshape(-1).to(torch.int64)
    if sampled.numel() != n:
        raise ValueError(f"sampled_token_ids has {sampled.numel()} entries for {n} support rows")
    sampled_bad = sampled < 0
    if vocab_size is not None:
        sampled_bad |= sampled >= vocab_size
    false = torch.zeros(n, dtype=torch.bool)
    if k == 0:
        return SupportRows(false, false, false, false, false, sampled_bad, false, torch.zeros(n, dtype=torch.int64))
    ids = support_ids if support_ids.dtype in (torch.int32, torch.int64) else support_ids.to(torch.int64)
    # Ids beyond the dtype's range can't equal any row id; clamp so the comparison stays in ids' dtype.
    info = torch.iinfo(ids.dtype)
    sampled_as_ids = sampled.clamp(info.min, info.max).to(ids.dtype)
    lowest = torch.empty(n, dtype=ids.dtype)
    highest = torch.empty(n, dtype=ids.dtype)
    duplicate = torch.empty(n, dtype=torch.bool)
    slot = torch.empty(n, dtype=torch.int64)
    in_row = torch.empty(n, dtype=torch.bool)
    buffer = _sort_buffer((min(n, BLOCK_ROWS), k), ids.dtype) if n else None
    for start in range(0, n, BLOCK_ROWS):
        stop = min(start + BLOCK_ROWS, n)
        block = ids[start:stop]
        ordered = sort_rows(block, buffer[: stop - start] if buffer is not None else None)
        lowest[start:stop] = ordered[:, 0]
        highest[start:stop] = ordered[:, -1]
        # Sorted rows: a zero gap between neighbours is a duplicate, except repeated −1 padding (refined
        # below). The gap of two int32 values can wrap but never to 0.
        duplicate[start:stop] = (ordered[:, 1:] - ordered[:, :-1]).amin(1) == 0
        match = block == sampled_as_ids[start:stop, None]
        first = _first_true(match)
        slot[start:stop] = first
        in_row[start:stop] = match.gather(1, first[:, None]).squeeze(1)
    out_of_range = lowest < SUPPORT_PAD
    if vocab_size is not None:
        out_of_range |= highest >= vocab_size
    padded = lowest < 0
    suspects = duplicate & padded
    if bool(suspects.any()):
        rows = torch.nonzero(suspects).reshape(-1)
        ordered = sort_rows(ids[rows])
        duplicate[rows] = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1)
    # Trailing padding can only break in rows that have padding (few): check those alone.
    padding_bad = false.clone()
    if bool(padded.any()):
        rows = torch.nonzero(padded).reshape(-1)
        pad = ids[rows] == SUPPORT_PAD
        padding_bad[rows] = (pad[:, :-1] & ~pad[:, 1:]).any(1)
    return SupportRows(
        id_out_of_range=out_of_range, padding_not_trailing=padding_bad, duplicate=duplicate,
        has_support=highest >= 0, padded=padded, sampled_out_of_range=sampled_bad,
        sampled_in_row=in_row & ~sampled_bad, sampled_slot=slot,
    )


def support_logprobs(
    support_ids: torch.Tensor,
    support_logits: torch.Tensor,
    sampled_token_ids: torch.Tensor,
    rows: Optional[SupportRows] = None,
) -> torch.Tensor:
    """``[Σ T]`` float32 ``logp_S(y)`` per token; NaN where the row has no member or lacks the sampled id.

    Padding slots (id < 0) are excluded whatever their logit. ``rows`` (from :func:`check_support_rows`)
    avoids recomputing the sampled slot.
    """
    if support_logits.shape != support_ids.shape:
        raise ValueError(
            f"support_logits shape {list(support_logits.shape)} != support_ids shape {list(support_ids.shape)}"
        )
    if rows is None:
        rows = check_support_rows(support_ids, sampled_token_ids, None)
    n, k = support_ids.shape
    out = torch.full((n,), float("nan"), dtype=torch.float32)
    if k == 0 or n == 0:
        return out

    def score(logits: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        m = logits.amax(1)
        l_y = logits.gather(1, slot[:, None]).squeeze(1)
        return (l_y - m) - (logits - m[:, None]).exp_().sum(1).log_()

    for start in range(0, n, BLOCK_ROWS):  # every slot a member (the usual full top-k row)
        stop = min(start + BLOCK_ROWS, n)
        out[start:stop] = score(support_logits[start:stop].to(torch.float32), rows.sampled_slot[start:stop])
    if bool(rows.padded.any()):  # few rows: mask their padding slots, whose logits are arbitrary
        idx = torch.nonzero(rows.padded).reshape(-1)
        logits = support_logits[idx].to(torch.float32).masked_fill(support_ids[idx] < 0, float("-inf"))
        out[idx] = score(logits, rows.sampled_slot[idx])
    return torch.where(rows.has_support & rows.sampled_in_row, out, torch.full_like(out, float("nan")))


@dataclass(frozen=True)
class ExpertRows:
    """Per-token results of :func:`check_routed_experts` (``[Σ T]``): the first offending layer, −1 if none."""

    out_of_range_layer: torch.Tensor
    duplicate_layer: torch.Tensor


def _first_layer(flags: torch.Tensor) -> torch.Tensor:
    """``[N, L]`` bool → ``[N]`` int64 index of the first true layer, −1 where none."""
    if flags.shape[1] == 0:
        return torch.full((flags.shape[0],), -1, dtype=torch.int64)
    first = flags.view(torch.uint8).argmax(1).to(torch.int64)
    return torch.where(flags.any(1), first, torch.full_like(first, -1))


def check_routed_experts(routed_experts: torch.Tensor, num_experts: Optional[int]) -> ExpertRows:
    """``[Σ T, layers, topk]`` routes: ids in [0, num_experts) and no repeated expert within a (token, layer) row."""
    if routed_experts.dim() != 3:
        raise ValueError(f"routed_experts must be [tokens, layers, topk], got shape {list(routed_experts.shape)}")
    n, layers, topk = routed_experts.shape
    if n == 0 or layers == 0 or topk == 0:
        none = torch.full((n,), -1, dtype=torch.int64)
        return ExpertRows(none, none)
    ordered = sort_rows(routed_experts.reshape(n * layers, topk)).reshape(n, layers, topk)
    bad_range = ordered[:, :, 0] < 0
    if num_experts is not None:
        bad_range |= ordered[:, :, -1] >= num_experts
    dup = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(2) if topk > 1 else torch.zeros(n, layers, dtype=torch.bool)
    return ExpertRows(out_of_range_layer=_first_layer(bad_range), duplicate_layer=_first_layer(dup))


def unsupported_violations(
    unsupported: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(violating [Σ T] bool, per-trajectory count [n])`` for loss-bearing tokens without support.

    Each entry of ``lengths`` is one whole trajectory (context-parallel shards already joined), so the
    count is over the trajectory, never over one shard. A trajectory may leave at most one loss-bearing
    token unsupported, and only its last token (the appended EOS); every other unsupported token violates.
    """
    lengths = lengths.to(torch.int64)
    ends = torch.cumsum(lengths, 0)
    running = torch.cumsum(unsupported.to(torch.int64), 0)
    before = torch.cat([torch.zeros(1, dtype=torch.int64), running])
    counts = before[ends] - before[ends - lengths]
    last = torch.zeros(unsupported.numel(), dtype=torch.bool)
    last[(ends - 1)[lengths > 0]] = True
    return unsupported & ~last, counts
