"""Family 6 — NumPy in float32: ``np.sum``'s pairwise summation and NumPy's own SIMD ``np.exp``.

Imitates the NumPy side of RL stacks: OpenRLHF / verl metric and advantage code that moves rewards to NumPy,
TRL-style reference scripts, and the float32 arrays a data-analysis notebook replays a dump with. Every
reduction is ``np.sum`` on a float32 array (pairwise, 8-way unrolled blocks of 128: another order than
torch's cascade sum), the group std is ``np.std(ddof=1)`` (two-pass, float32), and ``exp`` is NumPy's
float32 loop (its own AVX2/AVX-512 polynomial, not torch's SLEEF/MKL one).
"""

from __future__ import annotations

import numpy as np

from .base import STD_EPS, TOKEN_MEAN, Family, LossInputs, check_kl_type

F32 = np.float32


class NumpyPairwise(Family):
    def __init__(self) -> None:
        super().__init__(name="numpy")

    def normalize(self, raw, bounds, std, ddof):
        rewards = raw.astype(F32)
        out = np.empty_like(rewards)
        for a, b in bounds:
            group = rewards[a:b]
            centered = group - np.mean(group, dtype=F32)
            if std:
                centered = centered / (np.std(group, ddof=ddof, dtype=F32) + F32(STD_EPS))
            out[a:b] = centered
        return out.astype(np.float64)

    def kl(self, old, ref, kl_type):
        check_kl_type(kl_type)
        r = old - ref
        if kl_type == "k1":
            return r
        if kl_type == "k2":
            return np.square(r) / F32(2)
        value = np.exp(-r) - F32(1) + r
        if kl_type == "low_var_kl":
            value = np.clip(value, F32(-10), F32(10))
        return value

    @staticmethod
    def _terms(li: LossInputs, eps_clip: float, eps_clip_high: float) -> dict[str, np.ndarray]:
        ppo_kl = li.old_log_probs - li.log_probs
        adv = li.advantages.astype(F32)
        ratio = np.exp(-ppo_kl)
        pg1 = -ratio * adv
        pg2 = -np.clip(ratio, F32(1 - eps_clip), F32(1 + eps_clip_high)) * adv
        return {"pg": np.maximum(pg1, pg2), "clip": (pg2 > pg1).astype(F32), "kl": ppo_kl, "ent": li.entropy}

    def sample_sums(self, li, *, eps_clip, eps_clip_high):
        terms = self._terms(li, eps_clip, eps_clip_high)
        mask = li.mask.astype(F32)
        terms["mask"] = np.ones_like(mask)
        bounds = np.cumsum(li.lengths).tolist()
        starts = [0] + bounds[:-1]
        out = {}
        for k, x in terms.items():
            masked = x * mask
            out[k] = np.array([np.sum(masked[a:b]) for a, b in zip(starts, bounds)], dtype=F32).astype(np.float64)
        return out

    def loss(self, li: LossInputs, *, eps_clip, eps_clip_high, entropy_coef, agg):
        terms = self._terms(li, eps_clip, eps_clip_high)
        mask = li.mask.astype(F32)
        if agg == TOKEN_MEAN:
            denom = max(np.sum(mask), F32(1))
            reduced = {k: np.sum(x * mask) / denom for k, x in terms.items()}
        else:
            bounds = np.cumsum(li.lengths).tolist()
            starts = [0] + bounds[:-1]
            counts = np.array([max(np.sum(mask[a:b]), F32(1)) for a, b in zip(starts, bounds)], dtype=F32)
            reduced = {}
            for k, x in terms.items():
                masked = x * mask
                sums = np.array([np.sum(masked[a:b]) for a, b in zip(starts, bounds)], dtype=F32)
                reduced[k] = np.sum(sums / counts)
        pg_loss, entropy_loss = reduced["pg"], reduced["ent"]
        return {"loss": float(pg_loss - F32(entropy_coef) * entropy_loss), "pg_loss": float(pg_loss),
                "entropy_loss": float(entropy_loss), "pg_clipfrac": float(reduced["clip"]),
                "ppo_kl": float(reduced["kl"])}
