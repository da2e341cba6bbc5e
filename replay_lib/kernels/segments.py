"""Token-axis segments: the sample of each token, per-sample sums, chunked passes over the token axis."""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch


def segment_ids(lengths: torch.Tensor) -> torch.Tensor:
    """``[Σ lengths]`` int64: the sample index of every token."""
    lengths = lengths.to(torch.int64)
    return torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int64), lengths)


def segment_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64: where each sample's tokens start in the concatenated axis."""
    lengths = lengths.to(torch.int64)
    return torch.cumsum(lengths, 0) - lengths


def segment_sum(values: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=values.dtype)
    return out.index_add_(0, seg, values)


# Tokens per pass of :func:`policy_loss_fields`: a million-token step then needs a few small temporaries
# instead of a dozen full-length ones. Below torch's parallel grain size (32768), so ops stay on one thread.
LOSS_CHUNK = 1 << 14


def token_chunks(lengths: torch.Tensor, chunk: int = LOSS_CHUNK) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, stop, seg)`` for consecutive chunks of the token axis; ``seg`` is the sample of each token of
    the chunk: the chunk's first sample plus the number of later samples starting at or before the token (an
    empty sample starts where the next one does, so it is skipped). A serial scan, where repeat_interleave
    would fan out to every thread for each chunk."""
    lengths = lengths.to(torch.int64)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    total = int(ends[-1]) if lengths.numel() else 0
    for start in range(0, total, chunk):
        stop = min(start + chunk, total)
        first = int(torch.searchsorted(ends, start, right=True))
        last = int(torch.searchsorted(ends, stop - 1, right=True))
        marks = torch.zeros(stop - start, dtype=torch.int64)
        marks.index_add_(0, starts[first + 1:last + 1] - start, torch.ones(last - first, dtype=torch.int64))
        yield start, stop, marks.cumsum_(0).add_(first)


def masked_sample_sums(
    lengths: torch.Tensor, loss_mask: torch.Tensor, columns: Callable[[int, int, torch.Tensor], Mapping[str, torch.Tensor]],
    dtypes: Mapping[str, torch.dtype],
) -> dict[str, torch.Tensor]:
    """Per-sample masked sums ``Σ_t x_t·mask_t`` of the per-token columns ``columns(start, stop, mask chunk)``
    returns for each chunk (:func:`token_chunks`), each accumulated in its ``dtypes[name]`` by ``index_add_``
    in token order (the same additions in the same order as one pass over all tokens)."""
    n = lengths.numel()
    sums = {name: torch.zeros(n, dtype=dt) for name, dt in dtypes.items()}
    for start, stop, seg in token_chunks(lengths):
        for name, x in columns(start, stop, seg).items():
            sums[name].index_add_(0, seg, x)
    return sums
