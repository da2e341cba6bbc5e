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

import bisect
from typing import Optional

import torch

from ..judge.error_model import advantage_bound, unit_roundoff
from ..judge.fields import FieldResult
from ..kernels import GrpoReturns
from ..stages import StageContext
from ..stages.advantage import grpo_rewards, recorded_token_rewards
from .base import Hypothesis, listing

STAGE = "advantage.estimate"


class _SampleOf:
    """The sample of each token of a contiguous range (a marks-and-cumsum scan, as ``kernels.token_chunks``
    does), remembered for the last few ranges: the hypotheses of the stage read the same row blocks, each
    shifted by at most one token."""

    def __init__(self, returns: GrpoReturns, lengths: torch.Tensor) -> None:
        self.returns = returns
        self.ends = returns.ends.tolist()
        self.starts = returns.ends - lengths.to(torch.int64)
        self.memo: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        key = (lo, hi)
        if key not in self.memo:
            if len(self.memo) > 8:
                self.memo.clear()
            first, last = bisect.bisect_right(self.ends, lo), bisect.bisect_right(self.ends, hi - 1)
            marks = torch.zeros(hi - lo, dtype=torch.int64)
            marks.index_add_(0, self.starts[first + 1:last + 1] - lo, torch.ones(last - first, dtype=torch.int64))
            self.memo[key] = marks.cumsum_(0).add_(first)
        return self.memo[key]


def _broadcast(rewards: torch.Tensor, sample_of: _SampleOf, u: float, shift: int = 0, in_sample: bool = False):
    """``(values, bound)`` columns of ``rewards`` broadcast over the tokens, each token reading the one ``shift``
    tokens before it (0 past either end; ``in_sample``: 0 where that token is another sample's)."""
    total = sample_of.returns.numel()
    last: dict[tuple[int, int], torch.Tensor] = {}

    def values(lo: int, hi: int) -> torch.Tensor:
        if (lo, hi) in last:
            return last[(lo, hi)]
        out = torch.zeros(hi - lo, dtype=torch.float64)
        a, b = max(lo - shift, 0), min(hi - shift, total)  # the source tokens inside the axis
        if a < b:
            src_sample = sample_of(a, b)
            keep = torch.ones(b - a, dtype=torch.bool)
            if in_sample:
                keep = src_sample == sample_of(a + shift, b + shift)
            out[a + shift - lo:b + shift - lo] = torch.where(keep, rewards[src_sample], torch.zeros(b - a,
                                                                                                 dtype=torch.float64))
        last.clear()
        last[(lo, hi)] = out
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
    cfg = ctx.config
    grpo = cfg.advantage_estimator == "grpo" and not cfg.normalize_advantages and cfg.kl_in_reward is None
    if not grpo or not any(f.name == "advantage" for f in fields) or not ctx.has("advantages"):
        return []  # only GRPO's broadcast rewards are varied here
    if recorded_token_rewards(ctx) is not None:
        return []  # per-token rewards: no per-sample reward to vary
    recorded = ctx.payload("advantages")
    u = unit_roundoff(recorded)
    rewards, _ = grpo_rewards(ctx)
    rewards = rewards.to(torch.float64)
    out: list[Hypothesis] = []

    sample_of = _SampleOf(GrpoReturns(rewards, ctx.lengths, dtype=torch.float64), ctx.lengths)

    def add(hid: str, detail: str, per_sample: torch.Tensor, shift: int = 0, in_sample: bool = False) -> None:
        values, bound = _broadcast(per_sample.to(torch.float64), sample_of, u, shift, in_sample)
        out.append(Hypothesis(stage=STAGE, id=hid, detail=detail, values={"advantage": values},
                              bounds={"advantage": bound}))

    raw = ctx.raw_rewards
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
