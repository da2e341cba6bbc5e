"""Token-axis segments: the sample of each token, per-sample sums, chunked passes over the token axis."""

from __future__ import annotations

import bisect
from typing import Callable, Iterator, Mapping

import numpy as np
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


class ChunkSums:
    """Per-sample sums of the rows of one token chunk, added into ``[rows, n]`` float64 totals: ``np.add.reduceat``
    over the chunk's runs of tokens (a sample cut by a chunk edge gets each part's sum in turn). The sums within a
    run are numpy's pairwise ones, so a float64 total may differ from a token-order one in its last bits; about
    twice as fast as ``index_add_`` over a few rows. ``lengths`` and ``offsets``: the samples of the token axis."""

    def __init__(self, lengths: torch.Tensor, offsets: torch.Tensor) -> None:
        present = lengths > 0
        self._all = bool(present.all())  # no empty sample: the chunk's samples are a slice of the totals
        self._samples = None if self._all else torch.nonzero(present).reshape(-1).numpy()
        # where each non-empty sample starts, for the bisection of each chunk's first and last
        self._starts = offsets[present].numpy()
        self._list = self._starts.tolist()

    def add(self, totals: torch.Tensor, lo: int, hi: int, rows: torch.Tensor) -> None:
        """``totals[:, s] += Σ rows[:, t]`` over the tokens ``t`` of ``[lo, hi)`` of each sample ``s``."""
        first = bisect.bisect_right(self._list, lo) - 1
        stop = bisect.bisect_left(self._list, hi)
        at = self._starts[first:stop] - lo
        at[0] = 0  # the first sample may have started in an earlier chunk
        sums = np.add.reduceat(rows.numpy(), at, axis=1)
        out = totals.numpy()
        if self._all:
            out[:, first:stop] += sums
        else:
            out[:, self._samples[first:stop]] += sums


# Tokens per pass of :func:`policy_loss_fields`: a million-token step then needs a few small temporaries
# instead of a dozen full-length ones. Below torch's parallel grain size (32768), so ops stay on one thread.
LOSS_CHUNK = 1 << 14


def token_chunks(lengths: torch.Tensor, chunk: int = LOSS_CHUNK) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, stop, seg)`` for consecutive chunks of the token axis; ``seg`` is the sample of each token of
    the chunk: the chunk's first sample plus the number of later samples starting at or before the token (an
    empty sample starts where the next one does, so it is skipped). A serial scan, where repeat_interleave
    would fan out to every thread for each chunk."""
    for start, stop, seg in token_chunk_spans(lengths, chunk):
        yield start, stop, seg()


def token_chunk_spans(lengths: torch.Tensor, chunk: int = LOSS_CHUNK, start: int = 0,
                      stop: "int | None" = None) -> Iterator[tuple[int, int, Callable]]:
    """:func:`token_chunks` with each chunk's ``seg`` made only when called (``seg()``: the same tensor): a pass
    that needs the sample of a token only where it finds something (a hit to count) skips the scan elsewhere.
    ``start``/``stop``: tokens ``[start, stop)`` only, cut on the same grid (each chunk ends at a multiple of
    ``chunk`` or at ``stop``)."""
    lengths = lengths.to(torch.int64)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    total = int(ends[-1]) if lengths.numel() else 0
    stop = total if stop is None else min(stop, total)

    def segments(start: int, stop: int) -> torch.Tensor:
        first = int(torch.searchsorted(ends, start, right=True))
        last = int(torch.searchsorted(ends, stop - 1, right=True))
        marks = torch.zeros(stop - start, dtype=torch.int64)
        marks.index_add_(0, starts[first + 1:last + 1] - start, torch.ones(last - first, dtype=torch.int64))
        return marks.cumsum_(0).add_(first)

    for lo, hi in grid(start, stop, chunk):
        yield lo, hi, _Once(segments, lo, hi)


def grid(start: int, stop: int, chunk: int) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` cut on the token axis's grid of ``chunk``: each piece ends at a multiple of ``chunk`` or at
    ``stop``, so a range cut anywhere on the grid gives the pieces the whole axis gives there."""
    lo = start
    while lo < stop:
        hi = min((lo // chunk + 1) * chunk, stop)
        yield lo, hi
        lo = hi


class _Once:
    """``fn(*args)``, computed on the first call and kept for the next ones."""

    __slots__ = ("_fn", "_args", "_value")

    def __init__(self, fn: Callable, *args) -> None:
        self._fn, self._args, self._value = fn, args, None

    def __call__(self):
        if self._value is None:
            self._value = self._fn(*self._args)
        return self._value


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
