"""Clip-Cov's draw size (``policy_loss="clip_cov"``): the recorded ``clip_cov_mask`` is the producer's random
draw, which no replay reproduces; its **size** is verl's rule (core_algos.py:1818-1824 in 0.9.1; SkyRL
ppo_utils.py:975-982): in each micro-batch of ``n_b`` loss tokens, ``min(max(1, int(clip_cov_ratio·n_b)), c_b)``
tokens, ``c_b`` the candidates (covariance inside the bounds, ratio not clipped). The field ``clip_cov_draw`` holds
each micro-batch's recorded count against that size; a candidate whose covariance or ratio lies within rounding of
its edge may count either way (the bound). A draw of another size (the count taken over the whole step, another
ratio) diverges here even where the loss, recomputed with the recorded mask, agrees."""

from __future__ import annotations

from typing import Optional

import torch

from ..judge.error_model import C_NEAR_CLIP
from ..judge.fields import PER_SCALAR, FieldResult
from ..kernels import GrpoReturns
from ..kernels.families import family, slice_tokens
from ..kernels.loss import sample_log_terms
from .base import StageContext
from .loss_inputs import LossInputs


# ctx.outputs key of the draw's counts accumulated by loss.policy's own token pass (stages/loss.py _loss_sums)
DRAW_OUTPUT = "clip_cov_draw_counts"


class DrawCounts:
    """Per micro-batch: loss tokens, recorded draws, candidates, candidates at an edge, non-candidates at an edge —
    added a chunk at a time from Clip-Cov's token terms (the stage's own pass: no second one)."""

    def __init__(self, micro_batch) -> None:
        self.mb = torch.tensor(micro_batch, dtype=torch.int64)
        self.counts = torch.zeros((5, int(self.mb.max()) + 1 if self.mb.numel() else 0), dtype=torch.float64)

    @classmethod
    def of(cls, knobs) -> Optional["DrawCounts"]:
        return cls(knobs.micro_batch) if knobs.policy_loss == "clip_cov" and knobs.micro_batch is not None else None

    def add(self, t: dict, seg: torch.Tensor, mask: torch.Tensor, u: float) -> None:
        m = (mask > 0).to(torch.float64)
        allowed = t["clipcov_allowed"].to(torch.float64)
        near = (t["clipcov_rule_gap"] <= C_NEAR_CLIP * u * (1.0 + t["log_ratio"].abs())).to(torch.float64)
        rows = torch.stack([m, t["clipcov_recorded"].to(torch.float64) * m, allowed * m, allowed * near * m,
                            (1 - allowed) * near * m])
        self.counts.index_add_(1, self.mb[seg], rows)


def clip_cov_draw_field(ctx: StageContext, li: LossInputs) -> Optional[FieldResult]:
    knobs = li.knobs
    if knobs.policy_loss != "clip_cov" or li.family_tokens is None or knobs.micro_batch is None or \
            getattr(ctx, "partial", False):
        return None
    draw = ctx.outputs.get(DRAW_OUTPUT)
    if draw is None:  # the stage's float64 pass did not run (--exact): a pass of its own
        draw = _own_pass(ctx, li)
    counts = draw.counts
    ratio = float(knobs.param("clip_cov_ratio"))
    size = torch.tensor([float(max(int(ratio * float(n)), 1)) for n in counts[0].tolist()], dtype=torch.float64)
    low = torch.minimum(size, counts[2] - counts[3])
    high = torch.minimum(size, counts[2] + counts[4])
    names: dict[int, str] = {}
    for s, b in zip(ctx.samples, knobs.micro_batch):
        names.setdefault(int(b), str(s.micro_batch_id))
    return ctx.field("loss.policy", "clip_cov_draw", PER_SCALAR, counts[1], (low + high) / 2,
                     bound=(high - low) / 2, labels=[f"clip_cov_draw[{names.get(b, b)}]" for b in range(counts.shape[1])],
                     exact=False,
                     note="each micro-batch's recorded clip_cov_mask count against min(max(1, int(clip_cov_ratio·n_b)), "
                          "candidates)")


def _own_pass(ctx: StageContext, li: LossInputs) -> DrawCounts:
    knobs = li.knobs
    f64 = torch.float64
    adv = li.advantages.materialize() if isinstance(li.advantages, GrpoReturns) else li.advantages
    st = sample_log_terms(li.log_probs, li.old_log_probs, li.rollout_log_probs, li.mask, ctx.lengths, knobs, f64,
                          advantages=adv, family_tokens=li.family_tokens)
    draw = DrawCounts(knobs.micro_batch)
    terms = family("clip_cov").token_terms
    for lo, hi, seg in ctx.token_chunks():
        t = terms(li.log_probs[lo:hi], li.old_log_probs[lo:hi], adv[lo:hi].to(f64), knobs, seg=seg, sample_terms=st,
                  dtype=f64, tokens=slice_tokens(li.family_tokens, slice(lo, hi)))
        draw.add(t, seg, li.mask[lo:hi], ctx.precision.token)
    return draw
