"""``loss.policy`` hypotheses of the SPEC §4.2 loss knobs, under every configuration: the stage's own per-token
terms (``kernels.policy_token_terms`` in float64, every declared knob) with one part of the formula changed —

* **the last loss token dropped**: each sample's sums leave out its last loss token (an off-by-one mask in the
  loss; the recorded loss mask keeps it);
* **dual-clip on every advantage** (``eps_clip_c`` declared): ``pg = min(pg, −c·A)`` for positive advantages
  too, where the bound is meant for ``A < 0`` only;
* **the importance weight inverted** (``is_level`` declared): ``exp(rollout − old)`` instead of
  ``exp(old − rollout)``;
* **the KL term's arguments swapped** (a KL term in the loss): the declared estimator of ``ref − logp``;
* **GSPO's sequence ratio from the summed log-ratio** (``importance_level=sequence``): ``exp(Σ_t (logp − old))``
  instead of the mean over the sample's loss tokens.

Each gives the per-token surrogate (``pg_losses``), the recorded per-sample terms and the reported scalars it
changes; its elements are judged with the stage's own tolerance. One pass over the tokens per hypothesis.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..judge.fields import PER_SCALAR, FieldResult
from ..kernels.loss import LossKnobs, policy_fields_from_sums, policy_token_terms, sample_log_terms
from ..stages import StageContext, StageInputError
from ..stages.loss import AGGREGATE_SUFFIX, LossInputs, loss_inputs
from .base import Hypothesis, fmt_number

STAGE = "loss.policy"
TERMS = {"pg_sum": "pg", "entropy_sum": "ent", "kl_sum": "kl", "clip_count": "clip", "mask_count": "mask",
         "kl_loss_sum": "kl_loss"}


def _last_loss_token(mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[tokens]`` bool: each sample's last loss token."""
    n = lengths.numel()
    total = int(mask.numel())
    seg = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), lengths.to(torch.int64))
    where = torch.nonzero(mask != 0).reshape(-1)
    last = torch.full((n,), -1, dtype=torch.int64)
    if where.numel():
        last.scatter_reduce_(0, seg[where], where, reduce="amax", include_self=True)
    out = torch.zeros(total, dtype=torch.bool)
    out[last[last >= 0]] = True
    return out


def _pass(ctx: StageContext, li: LossInputs, knobs: LossKnobs, *, mask: Optional[torch.Tensor] = None,
          sample_terms: Optional[dict] = None, rollout: Optional[torch.Tensor] = None,
          ref: Optional[torch.Tensor] = None,
          pg_of: Optional[Callable[[dict, torch.Tensor, int, int], torch.Tensor]] = None):
    """``(per-sample sums, per-token pg)`` of one variant: the stage's formula with ``knobs``, the mask, the
    per-sample terms, the rollout or reference log-probs replaced where given, and ``pg_of(terms, adv, lo, hi)``
    the surrogate of a chunk where the variant changes it."""
    mask = li.mask if mask is None else mask
    rollout = li.rollout_log_probs if rollout is None else rollout
    ref = li.ref_log_probs if ref is None else ref
    if sample_terms is None:
        sample_terms = sample_log_terms(li.log_probs, li.old_log_probs, rollout, mask, ctx.lengths, knobs,
                                        dtype=torch.float64)
    rows = ["pg", "ent", "kl", "clip", "mask"] + (["clip_lower"] if knobs.dual_clip else []) + (
        ["kl_loss"] if knobs.kl_loss else [])
    sums = torch.zeros((len(rows), ctx.n), dtype=torch.float64)
    token_pg = torch.zeros(int(mask.numel()), dtype=torch.float64)
    for lo, hi, seg in ctx.token_chunks():
        adv = li.advantages[lo:hi].to(torch.float64)
        t = policy_token_terms(li.log_probs[lo:hi], li.old_log_probs[lo:hi], adv, knobs, seg=seg,
                               sample_terms=sample_terms,
                               rollout_log_probs=rollout[lo:hi] if rollout is not None else None,
                               ref_log_probs=ref[lo:hi] if ref is not None and knobs.kl_loss else None,
                               dtype=torch.float64)
        pg = pg_of(t, adv, lo, hi) if pg_of is not None else t["pg"]
        token_pg[lo:hi] = pg
        m = mask[lo:hi].to(torch.float64)
        ent = li.entropy[lo:hi].to(torch.float64) if li.entropy is not None else torch.zeros_like(m)
        columns = [pg, ent, t["ppo_kl"], t["clip"].to(torch.float64), torch.ones_like(m)]
        if knobs.dual_clip:
            columns.append(t["clip_lower"].to(torch.float64))
        if knobs.kl_loss:
            columns.append(t["kl_loss"])
        sums.index_add_(1, seg, torch.stack(columns) * m)
    return dict(zip(rows, sums)), token_pg


def _without(ctx: StageContext, li: LossInputs, knobs: LossKnobs, declared: dict, dropped: torch.Tensor) -> dict:
    """The per-sample sums of ``declared`` (the stage's) with the tokens ``dropped`` taken out of them."""
    at = torch.nonzero(dropped).reshape(-1)
    seg = ctx.seg[at]
    adv = li.advantages[at].to(torch.float64)
    t = policy_token_terms(li.log_probs[at], li.old_log_probs[at], adv, knobs, seg=seg, sample_terms={},
                           rollout_log_probs=li.rollout_log_probs[at] if li.rollout_log_probs is not None else None,
                           ref_log_probs=li.ref_log_probs[at] if li.ref_log_probs is not None and knobs.kl_loss
                           else None, dtype=torch.float64)
    m = li.mask[at].to(torch.float64)
    ent = li.entropy[at].to(torch.float64) if li.entropy is not None else torch.zeros_like(m)
    terms = {"pg": t["pg"], "ent": ent, "kl": t["ppo_kl"], "clip": t["clip"].to(torch.float64),
             "mask": torch.ones_like(m)}
    if knobs.dual_clip:
        terms["clip_lower"] = t["clip_lower"].to(torch.float64)
    if knobs.kl_loss:
        terms["kl_loss"] = t["kl_loss"]
    out = {}
    for row, values in terms.items():
        if row in declared:
            out[row] = declared[row].to(torch.float64) - torch.zeros(ctx.n, dtype=torch.float64).index_add_(
                0, seg, values * m)
    return out


def add_sums(add, hid: str, detail: str, sums: dict) -> None:
    """``add`` a hypothesis of per-sample sums alone (its per-token surrogate the declared one)."""
    add(hid, detail, sums, None)


def hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    try:
        li = loss_inputs(ctx)
    except StageInputError:
        return []
    if not isinstance(li.advantages, torch.Tensor):
        return []
    knobs = li.knobs
    if knobs.kl_loss and li.ref_log_probs is None:
        return []
    names = {f.name: f for f in fields}
    has_entropy = li.entropy is not None
    out: list[Hypothesis] = []

    def add(hid: str, detail: str, sums: dict, token_pg: Optional[torch.Tensor]) -> None:
        values: dict = {}
        scalars = {k: float(v) for k, v in policy_fields_from_sums(sums, has_entropy, knobs.entropy_coef,
                                                                    knobs).items()}
        for f in fields:
            if f.name == "loss" and f.per == PER_SCALAR and f.labels:
                values[f.name] = torch.tensor([scalars.get(label.removesuffix(AGGREGATE_SUFFIX), float(f.actual[i]))
                                               for i, label in enumerate(f.labels)], dtype=torch.float64)
        for term, row in TERMS.items():
            if term in names and row in sums:
                values[term] = sums[row]
        if "pg_losses" in names and token_pg is not None:
            values["pg_losses"] = token_pg
        out.append(Hypothesis(stage=STAGE, id=hid, detail=detail, values=values))

    dropped = _last_loss_token(li.mask, ctx.lengths)
    if bool(dropped.any()):
        detail = ("the recorded loss leaves each sample's last loss token out of its sums (an off-by-one mask in the "
                  "loss; the recorded loss mask keeps it)")
        from ..stages.loss import SUMS_OUTPUT

        declared = ctx.outputs.get(SUMS_OUTPUT)
        if declared is not None and not knobs.needs_sample_pass:
            # the stage's own per-sample sums less the one token each sample drops (no per-sample term changes, so
            # no other token's value does): a pass over n tokens, not over the step; the per-token surrogate is
            # the declared one (left to the stage's own comparison)
            add_sums(add, "loss.last_loss_token_dropped", detail, _without(ctx, li, knobs, declared, dropped))
        else:
            mask = li.mask.to(torch.float64).masked_fill(dropped, 0.0)
            add("loss.last_loss_token_dropped", detail, *_pass(ctx, li, knobs, mask=mask))
    if knobs.dual_clip:
        c = float(knobs.eps_clip_c)

        def every_advantage(t: dict, adv: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
            pg = t["pg_unweighted"] if "pg_unweighted" in t else t["pg"]
            # the declared pg with its lower bound on A < 0 only; the bug caps every token at −c·A
            pg = torch.minimum(pg, -c * adv)
            return pg * t["is_weight"] if "is_weight" in t else pg

        sums, token_pg = _pass(ctx, li, knobs, pg_of=every_advantage)
        add("loss.dual_clip_every_advantage", f"the recorded loss applies the dual-clip bound c={fmt_number(c)} to "
            f"every advantage: pg = min(pg, −c·A) for positive advantages too (it is meant for A < 0 only)",
            sums, token_pg)
    if knobs.is_level is not None and li.rollout_log_probs is not None:
        old = li.old_log_probs.to(torch.float64)
        inverted = 2 * old - li.rollout_log_probs.to(torch.float64)  # old − rollout' = rollout − old
        add("loss.is_weight_inverted", f"the recorded loss uses the inverted importance weight exp(rollout − old) "
            f"instead of exp(old − rollout) (is_level={knobs.is_level})", *_pass(ctx, li, knobs, rollout=inverted))
    if knobs.kl_loss and li.ref_log_probs is not None:
        swapped = 2 * li.log_probs.to(torch.float64) - li.ref_log_probs.to(torch.float64)  # logp − ref' = ref − logp
        add("loss.kl_loss_arguments_swapped", f"the recorded KL term of the loss is {knobs.kl_loss_type} of ref − logp "
            f"(its arguments swapped) instead of logp − ref", *_pass(ctx, li, knobs, ref=swapped))
    if knobs.sequence_ratio and knobs.log_ratio_clamp is None:
        terms = sample_log_terms(li.log_probs, li.old_log_probs, li.rollout_log_probs, li.mask, ctx.lengths, knobs,
                                 dtype=torch.float64)
        lr = (li.log_probs.to(torch.float64) - li.old_log_probs.to(torch.float64)) * li.mask.to(torch.float64)
        summed = torch.zeros(ctx.n, dtype=torch.float64).index_add_(0, ctx.seg, lr)
        add("loss.sequence_ratio_summed", "the recorded loss takes GSPO's sequence ratio from the summed log-ratio "
            "exp(Σ_t (logp − old)) instead of its mean over the sample's loss tokens",
            *_pass(ctx, li, knobs, sample_terms=dict(terms, seq_log_ratio=summed)))
    return out
