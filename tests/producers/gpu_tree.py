"""Family 5 — GPU-style tree reductions: per-block stride-halving trees, then a tree over the block partials.

Imitates the reductions a CUDA trainer's masked sums run on (verl / Megatron on GPU: ``torch.sum`` over a
``[batch, seq]`` tensor lowers to a block reduction): each sample's ``x·mask`` is cut into blocks of
``block`` (256 or 1024) elements, padded with zeros, every block is reduced by the shared-memory tree of
CUB's ``BlockReduce`` / the classic reduction kernel (``s[t] += s[t + stride]`` for stride = block/2 … 1),
and the block partials (padded to a power of two) by the same tree. The sum over samples, the group sums of
the reward normalization and the token-mean's global sums are trees too. ``exp`` and ``sqrt`` are correctly
rounded float32 values (float64 evaluated, rounded once), as CUDA's ``expf`` (≤ 2 ulp) and IEEE ``sqrtf``
give — not bit-for-bit torch's CPU ``exp``.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import STD_EPS, TOKEN_MEAN, Family, LossInputs, check_kl_type


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tree(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (padded with zeros to a power of two) by stride-halving: ``x[:h] + x[h:]``."""
    width = x.shape[-1]
    if width == 0:
        return torch.zeros(x.shape[:-1], dtype=x.dtype)
    pad = _pow2(width) - width
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def block_tree(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[rows, L]`` → ``[rows]``: a tree inside each block of ``block`` elements, then over the blocks."""
    rows, width = x.shape
    nb = max(1, -(-width // block))
    if nb * block != width:
        x = torch.nn.functional.pad(x, (0, nb * block - width))
    return tree(tree(x.view(rows, nb, block)))


def exp32(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.to(torch.float64)).to(torch.float32)


class GPUTree(Family):
    def __init__(self, block: int = 256) -> None:
        if block & (block - 1):
            raise ValueError(f"block must be a power of two, got {block}")
        super().__init__(name=f"gpu_tree_{block}", options={"block": block})
        self.block = block

    def normalize(self, raw, bounds, std, ddof):
        rewards = torch.tensor(raw.tolist(), dtype=torch.float32)
        out = torch.empty_like(rewards)
        for a, b in bounds:
            group = rewards[a:b]
            n = torch.tensor(float(b - a), dtype=torch.float32)
            centered = group - block_tree(group[None], self.block)[0] / n
            if std:
                var = block_tree((centered * centered)[None], self.block)[0] / (n - ddof)
                centered = centered / (torch.sqrt(var.to(torch.float64)).to(torch.float32) + STD_EPS)
            out[a:b] = centered
        return out.numpy().astype(np.float64)

    def kl(self, old, ref, kl_type):
        check_kl_type(kl_type)
        log_ratio = torch.from_numpy(old) - torch.from_numpy(ref)
        if kl_type == "k1":
            return log_ratio.numpy()
        if kl_type == "k2":
            return (log_ratio * log_ratio * 0.5).numpy()
        value = exp32(-log_ratio) - 1 + log_ratio
        if kl_type == "low_var_kl":
            value = value.clamp(-10, 10)
        return value.numpy()

    @staticmethod
    def _terms(li: LossInputs, eps_clip: float, eps_clip_high: float) -> dict[str, torch.Tensor]:
        ppo_kl = torch.from_numpy(li.old_log_probs) - torch.from_numpy(li.log_probs)
        adv = torch.from_numpy(np.ascontiguousarray(li.advantages, dtype=np.float32))
        ratio = exp32(-ppo_kl)
        pg1 = -ratio * adv
        pg2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * adv
        return {"pg": torch.maximum(pg1, pg2), "clip": (pg2 > pg1).float(), "kl": ppo_kl,
                "ent": torch.from_numpy(li.entropy)}

    def sample_sums(self, li, *, eps_clip, eps_clip_high):
        terms = self._terms(li, eps_clip, eps_clip_high)
        mask = torch.from_numpy(li.mask).float()
        rows = _Rows(li.lengths)
        out = {k: block_tree(rows.matrix(x * mask), self.block) for k, x in terms.items()}
        out["mask"] = block_tree(rows.matrix(mask), self.block)
        return {k: v.to(torch.float64).numpy() for k, v in out.items()}

    def loss(self, li: LossInputs, *, eps_clip, eps_clip_high, entropy_coef, agg):
        terms = self._terms(li, eps_clip, eps_clip_high)
        mask = torch.from_numpy(li.mask).float()
        if agg == TOKEN_MEAN:
            denom = torch.clamp_min(block_tree(mask[None], self.block)[0], 1)
            reduced = {k: block_tree((x * mask)[None], self.block)[0] / denom for k, x in terms.items()}
        else:
            rows = _Rows(li.lengths)
            counts = torch.clamp_min(block_tree(rows.matrix(mask), self.block), 1)
            reduced = {k: tree(block_tree(rows.matrix(x * mask), self.block) / counts) for k, x in terms.items()}
        pg_loss, entropy_loss = reduced["pg"], reduced["ent"]
        return {"loss": float(pg_loss - entropy_coef * entropy_loss), "pg_loss": float(pg_loss),
                "entropy_loss": float(entropy_loss), "pg_clipfrac": float(reduced["clip"]),
                "ppo_kl": float(reduced["kl"])}


class _Rows:
    """The flat token axis laid out as a zero-padded ``[samples, max length]`` matrix, one sample a row."""

    def __init__(self, lengths: np.ndarray) -> None:
        lengths_t = torch.from_numpy(lengths)
        self.samples = lengths.size
        self.width = int(lengths.max()) if lengths.size else 0
        seg = torch.repeat_interleave(torch.arange(self.samples), lengths_t)
        starts = torch.cumsum(lengths_t, 0) - lengths_t
        self.position = seg * self.width + (torch.arange(seg.numel()) - starts[seg])

    def matrix(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.samples * self.width, dtype=x.dtype)
        out[self.position] = x
        return out.view(self.samples, self.width)
