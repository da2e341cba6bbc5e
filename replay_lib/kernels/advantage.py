"""advantage.estimate kernels: GRPO returns (the normalized reward broadcast over the response tokens)."""

from __future__ import annotations

import torch


def get_grpo_returns(rewards: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GRPO advantages: each sample's normalized reward broadcast over its response tokens.
    KL does not enter GRPO advantages."""
    return torch.repeat_interleave(rewards.to(dtype), lengths.to(torch.int64))


class GrpoReturns:
    """:func:`get_grpo_returns` evaluated a slice at a time: ``view[lo:hi]`` is the ``dtype`` advantages of
    tokens ``lo … hi − 1`` (each its sample's reward), without a full-length tensor."""

    def __init__(self, rewards: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        self.rewards = rewards.to(dtype)
        self.ends = torch.cumsum(lengths.to(torch.int64), 0)
        self.dtype = dtype
        self.shape = torch.Size([int(self.ends[-1]) if self.ends.numel() else 0])

    def numel(self) -> int:
        return self.shape[0]

    def __len__(self) -> int:
        return self.shape[0]

    def sample_of(self, lo: int, hi: int) -> torch.Tensor:
        """The sample of each token ``lo … hi − 1`` (an empty sample ends where it starts: skipped)."""
        return torch.searchsorted(self.ends, torch.arange(lo, hi, dtype=torch.int64), right=True)

    def __getitem__(self, index: slice) -> torch.Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("GrpoReturns takes a contiguous slice")
        lo, hi, _ = index.indices(self.shape[0])
        return self.rewards[self.sample_of(lo, max(lo, hi))]

    def materialize(self) -> torch.Tensor:
        return self[0:self.shape[0]]
