"""Family 2 — float64 everywhere, each output rounded once to float32 at the end.

Imitates a producer that upcasts before it reduces: this project's own capture (SPEC §6: it accumulates the
reported scalars in float64) and the float64 reference recompute that torchtitan's numerics-debugging guide
(``agent_tooling/numerics_debugging``, ``compare_numerics.py``) prescribes. The rewards are normalized from
the float64 raw rewards, the KL is taken on the float32 log-probs upcast, the loss consumes the float64
advantages it computed (the recorded ``advantages`` payload is their float32 rounding), and every reduction is
a float64 ``torch.sum``. It declares ``accumulate: float64``; its per-token outputs are still rounded to
float32 once, which is ``compute: float32``.
"""

from __future__ import annotations

import numpy as np
import torch

from . import torch_sum
from .base import TOKEN_MEAN, Family, LossInputs, check_kl_type

PRECISION = {"compute": "float32", "accumulate": "float64"}


def _f64(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x, dtype=np.float64))


def _f32(x: torch.Tensor) -> float:
    """A float64 0-d result rounded once to float32 (as a Python float)."""
    return float(x.to(torch.float32))


class Float64(Family):
    def __init__(self) -> None:
        super().__init__(name="float64", precision=dict(PRECISION))

    def normalize(self, raw, bounds, std, ddof):
        # torch_sum's group loop in float64; rounded to float32 where it is recorded (Family.recorded)
        return torch_sum.normalize(raw, bounds, std, ddof, dtype=torch.float64)

    def kl(self, old, ref, kl_type):
        check_kl_type(kl_type)
        r = _f64(old) - _f64(ref)
        if kl_type == "k1":
            value = r
        elif kl_type == "k2":
            value = r * r / 2
        else:
            value = torch.exp(-r) - 1 + r
            if kl_type == "low_var_kl":
                value = value.clamp(-10, 10)
        return value.to(torch.float32).numpy()

    def advantages(self, rewards, lengths):
        # the loss consumes the float64 advantages; the payload records their float32 rounding
        adv64 = np.repeat(np.asarray(rewards, dtype=np.float64), lengths)
        return adv64.astype(np.float32), adv64

    @staticmethod
    def _terms(li: LossInputs, eps_clip: float, eps_clip_high: float) -> dict[str, torch.Tensor]:
        ppo_kl = _f64(li.old_log_probs) - _f64(li.log_probs)
        adv = _f64(li.advantages)
        ratio = torch.exp(-ppo_kl)
        pg1 = -ratio * adv
        pg2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * adv
        return {"pg": torch.maximum(pg1, pg2), "clip": (pg2 > pg1).to(torch.float64), "kl": ppo_kl,
                "ent": _f64(li.entropy)}

    def sample_sums(self, li, *, eps_clip, eps_clip_high):
        """float64 per-sample sums, recorded unrounded (a float64 accumulator, as this project's capture)."""
        terms = self._terms(li, eps_clip, eps_clip_high)
        mask = torch.from_numpy(li.mask).to(torch.float64)
        terms["mask"] = torch.ones_like(mask)
        lengths = li.lengths.tolist()
        return {k: torch.stack([(x_i * m_i).sum() for x_i, m_i in zip(x.split(lengths), mask.split(lengths))]).numpy()
                for k, x in terms.items()}

    def loss(self, li: LossInputs, *, eps_clip, eps_clip_high, entropy_coef, agg):
        terms = self._terms(li, eps_clip, eps_clip_high)
        mask = torch.from_numpy(li.mask).to(torch.float64)
        if agg == TOKEN_MEAN:
            denom = max(float(mask.sum()), 1.0)
            reduced = {k: (x * mask).sum() / denom for k, x in terms.items()}
        else:
            lengths = li.lengths.tolist()
            counts = torch.stack([m.sum() for m in mask.split(lengths)]).clamp_min(1)
            reduced = {k: (torch.stack([(x_i * m_i).sum() for x_i, m_i in zip(x.split(lengths), mask.split(lengths))])
                           / counts).sum()
                       for k, x in terms.items()}
        loss = reduced["pg"] - entropy_coef * reduced["ent"]
        return {"loss": _f32(loss), "pg_loss": _f32(reduced["pg"]), "entropy_loss": _f32(reduced["ent"]),
                "pg_clipfrac": _f32(reduced["clip"]), "ppo_kl": _f32(reduced["kl"])}
