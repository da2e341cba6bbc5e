"""``advantage.estimate`` hypotheses: the advantages are not the normalized rewards broadcast, but

* the **raw** rewards broadcast (un-normalized);
* the normalized rewards **negated** (sign-flipped);
* **shifted by one token** along the packed token axis (``A'[t] = A[t − 1]``, later, or ``A[t + 1]``,
  earlier: a sample's first or last token carries its neighbour's value), or inside every sample (the
  vacated token 0);
* **permuted between samples**: the recorded per-sample values are the normalized rewards of other samples
  (as a multiset they equal the normalized rewards, within tolerance, and some sample holds another's).

The normalized rewards are the ones the stage consumed on its recorded inputs (teacher forcing:
``stages.advantage.grpo_rewards``). Each value's own bound is ``error_model.advantage_bound``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..compare import as_float64
from ..error_model import advantage_bound, unit_roundoff
from ..fields import FieldResult
from ..kernels import GrpoReturns
from ..stages import StageContext
from ..stages.advantage import grpo_rewards
from .base import Hypothesis, listing

STAGE = "advantage.estimate"


def _broadcast(rewards: torch.Tensor, ctx: StageContext, u: float, shift: int = 0, in_sample: bool = False):
    """``(values, bound)`` columns of ``rewards`` broadcast over the tokens, each token reading the one ``shift``
    tokens before it (0 past either end; ``in_sample``: 0 where that token is another sample's)."""
    returns = GrpoReturns(rewards, ctx.lengths, dtype=torch.float64)
    total = returns.numel()

    def values(lo: int, hi: int) -> torch.Tensor:
        src = torch.arange(lo, hi, dtype=torch.int64) - shift
        keep = (src >= 0) & (src < total)
        src_sample = torch.searchsorted(returns.ends, src.clamp(0, max(total - 1, 0)), right=True)
        if in_sample:
            keep &= src_sample == returns.sample_of(lo, hi)
        out = torch.zeros(hi - lo, dtype=torch.float64)
        out[keep] = returns.rewards[src_sample[keep]]
        return out

    def bound(lo: int, hi: int) -> torch.Tensor:
        return advantage_bound(values(lo, hi), u)

    return values, bound


def _permutation(ctx: StageContext, rewards: torch.Tensor, recorded: torch.Tensor, u: float) -> Optional[torch.Tensor]:
    """The sample whose normalized reward each sample's recorded advantages hold, when the recorded per-sample
    values are the normalized rewards rearranged (module doc); ``None`` otherwise."""
    nonempty = torch.nonzero(ctx.lengths > 0).reshape(-1)
    if nonempty.numel() < 2:
        return None
    starts = (torch.cumsum(ctx.lengths, 0) - ctx.lengths)[nonempty]
    rec = recorded[starts].to(torch.float64)
    cor = rewards[nonempty]
    tol = advantage_bound(cor, u) + 1e-6 + 1e-5 * cor.abs()
    rs, _ = torch.sort(rec)
    cs, corder = torch.sort(cor)
    if not bool(((rs - cs).abs() <= torch.maximum(tol[corder], advantage_bound(rs, u) + 1e-6 + 1e-5 * rs.abs())).all()):
        return None
    at = torch.searchsorted(cs, rec).clamp(max=cs.numel() - 1)
    below = (at - 1).clamp(min=0)
    nearest = torch.where((cs[below] - rec).abs() < (cs[at] - rec).abs(), below, at)
    source = nonempty[corder[nearest]]
    stays = (rec - cor).abs() <= tol
    source = torch.where(stays, nonempty, source)
    if bool(stays.all()):
        return None
    full = torch.arange(ctx.n, dtype=torch.int64)
    full[nonempty] = source
    return full


def hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    if not any(f.name == "advantage" for f in fields) or not ctx.has("advantages"):
        return []
    recorded = ctx.payload("advantages")
    u = unit_roundoff(recorded.dtype)
    rewards, _ = grpo_rewards(ctx)
    rewards = rewards.to(torch.float64)
    out: list[Hypothesis] = []

    def add(hid: str, detail: str, per_sample: torch.Tensor, shift: int = 0, in_sample: bool = False) -> None:
        values, bound = _broadcast(per_sample, ctx, u, shift, in_sample)
        out.append(Hypothesis(stage=STAGE, id=hid, detail=detail, values={"advantage": values},
                              bounds={"advantage": bound}))

    raw = as_float64([s.raw_reward for s in ctx.samples])
    if bool(torch.isfinite(raw).all()):
        add("advantage.unnormalized", "the recorded advantages are the raw rewards broadcast (not normalized)", raw)
    add("advantage.sign_flipped", "the recorded advantages are the normalized rewards negated", -rewards)
    add("advantage.shifted_later", "the recorded advantages are shifted one token later along the packed tokens "
        "(each sample's first token holds the previous sample's)", rewards, shift=1)
    add("advantage.shifted_earlier", "the recorded advantages are shifted one token earlier along the packed "
        "tokens (each sample's last token holds the next sample's)", rewards, shift=-1)
    add("advantage.shifted_later_in_sample", "the recorded advantages are shifted one token later inside every "
        "sample (its first token 0)", rewards, shift=1, in_sample=True)
    add("advantage.shifted_earlier_in_sample", "the recorded advantages are shifted one token earlier inside "
        "every sample (its last token 0)", rewards, shift=-1, in_sample=True)
    source = _permutation(ctx, rewards, recorded, u)
    if source is not None:
        moved = [i for i in range(ctx.n) if int(source[i]) != i]
        pairs = [f"{ctx.sample_ids[i]} has {ctx.sample_ids[int(source[i])]}'s" for i in moved]
        add("advantage.permuted", f"the recorded advantages are the normalized rewards permuted between samples "
            f"({listing(pairs, 3)})", rewards[source])
    return out
