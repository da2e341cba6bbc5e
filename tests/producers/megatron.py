"""Family 3 — Megatron/slime with data parallelism: micro-batches, a ring all-reduce and a CUDA-like exp.

Imitates slime's Megatron backend (``slime/backends/megatron_utils/loss.py`` + ``cp_utils.py``) on a data-
parallel group: the step's samples are dealt to ``ranks`` DP ranks (a strided partition: sample i to rank
i mod R), each rank runs ``micro_batches`` micro-batches; a micro-batch reduces its
samples' masked means in float32 (``x_i.split`` + ``.sum()``, a Python ``sum``), the rank adds its micro-
batches' values left to right (gradient accumulation of the reported metrics) and the ranks' partials are
summed by an NCCL-style ring all-reduce: the 5-element metrics vector is cut into one chunk per rank, and
chunk c is accumulated around the ring starting at rank c + 1 (``((p[c+1] + p[c+2]) + …) + p[c]``).

Per-token ``exp`` is CUDA's fast path, ``exp2(x · log2 e)`` in float32 steps (what ``__expf`` /
``--use_fast_math`` compile to): within ~2 ulp of the true value but not bit-for-bit torch's CPU ``exp``.
Rewards are normalized on the rollout side in float32, the whole batch at once (``rewards.view(-1, n)``).
"""

from __future__ import annotations

import numpy as np
import torch

from .base import STD_EPS, TOKEN_MEAN, Family, LossInputs
from . import torch_sum

LOG2E = torch.tensor(1.4426950408889634, dtype=torch.float32)
RING_FIELDS = ("pg", "ent", "clip", "kl", "mask")


def cuda_exp(x: torch.Tensor) -> torch.Tensor:
    """float32 ``exp`` as the fast CUDA intrinsic evaluates it: ``exp2(x · log2 e)``, two float32 steps."""
    return torch.exp2(x * LOG2E)


def ring_allreduce(partials: list[torch.Tensor]) -> torch.Tensor:
    """Sum ``[R]`` equal-shape float32 vectors in ring order: element j (in chunk c = j mod R) is accumulated
    starting at rank c + 1 and ending at rank c."""
    stacked = torch.stack(partials)  # [R, F]
    ranks, width = stacked.shape
    out = torch.empty(width, dtype=stacked.dtype)
    for j in range(width):
        c = j % ranks
        acc = stacked[(c + 1) % ranks, j].clone()
        for step in range(2, ranks + 1):
            acc = acc + stacked[(c + step) % ranks, j]
        out[j] = acc
    return out


class Megatron(Family):
    def __init__(self, ranks: int = 4, micro_batches: int = 4) -> None:
        super().__init__(name="megatron", options={"ranks": ranks, "micro_batches": micro_batches})
        self.ranks = ranks
        self.micro_batches_per_rank = micro_batches

    def layout(self, samples: int) -> list[list[list[int]]]:
        """``[rank][micro-batch] → sample indices``: strided over ranks, contiguous micro-batches per rank."""
        out = []
        for r in range(self.ranks):
            mine = list(range(r, samples, self.ranks))
            per = -(-len(mine) // self.micro_batches_per_rank) if mine else 0
            out.append([mine[m * per:(m + 1) * per] for m in range(self.micro_batches_per_rank)])
        return out

    def micro_batches(self, samples):
        ids = [0] * samples
        for r, mbs in enumerate(self.layout(samples)):
            for m, members in enumerate(mbs):
                for i in members:
                    ids[i] = r * self.micro_batches_per_rank + m
        return ids

    def normalize(self, raw, bounds, std, ddof):
        rewards = torch.tensor(raw.tolist(), dtype=torch.float32)
        sizes = {b - a for a, b in bounds}
        if len(sizes) == 1 and bounds[0][0] == 0:  # equal groups in order: one batched view
            view = rewards.view(-1, sizes.pop())
            centered = view - view.mean(dim=-1, keepdim=True)
            if std:
                centered = centered / (centered.std(dim=-1, keepdim=True, correction=ddof) + STD_EPS)
            return centered.reshape(-1).numpy().astype(np.float64)
        return torch_sum.normalize(raw, bounds, std, ddof)

    def kl(self, old, ref, kl_type):
        return torch_sum.kl(old, ref, kl_type, exp=cuda_exp)

    def loss(self, li: LossInputs, *, eps_clip, eps_clip_high, entropy_coef, agg):
        terms = torch_sum.token_terms(li, eps_clip, eps_clip_high, exp=cuda_exp)
        lengths = li.lengths.tolist()
        # each sample's tokens as views: a micro-batch packs its samples' tokens (THD), and its reductions
        # only ever see one sample at a time
        pieces = {k: x.split(lengths) for k, x in terms.items()}
        masks = torch.from_numpy(li.mask).float().split(lengths)
        partials = []
        for mbs in self.layout(len(lengths)):
            rank_total = torch.zeros(len(RING_FIELDS), dtype=torch.float32)
            for members in mbs:
                if members:
                    rank_total = rank_total + self._micro_batch(pieces, masks, members, agg)
            partials.append(rank_total)
        total = dict(zip(RING_FIELDS, ring_allreduce(partials)))
        if agg == TOKEN_MEAN:  # the ranks' token sums over the all-reduced token count
            denom = torch.clamp_min(total["mask"], 1)
            total = {k: v / denom for k, v in total.items()}
        return torch_sum.fields(total, entropy_coef)

    def sample_sums(self, li, *, eps_clip, eps_clip_high):
        # a micro-batch reduces its samples one at a time: the same per-sample sums, with the CUDA-like exp
        return torch_sum.sample_sums(li, eps_clip=eps_clip, eps_clip_high=eps_clip_high, exp=cuda_exp)

    @staticmethod
    def _micro_batch(pieces, masks, members, agg) -> torch.Tensor:
        """One micro-batch's ``RING_FIELDS`` values (float32): per-sample masked means summed left to right
        (``token_mean``: masked token sums, and the token count)."""
        out = []
        for k in RING_FIELDS:
            if k == "mask":
                count = sum([masks[i].sum() for i in members]) if agg == TOKEN_MEAN else 0.0
                out.append(torch.as_tensor(count, dtype=torch.float32))
            elif agg == TOKEN_MEAN:
                out.append(sum([(pieces[k][i] * masks[i]).sum() for i in members]))
            else:
                out.append(sum([(pieces[k][i] * masks[i]).sum() / torch.clamp_min(masks[i].sum(), 1)
                                for i in members]))
        return torch.stack(out)
