"""``loss.policy`` hypotheses for the loss families and masks of SPEC §4.2 beyond the clipped surrogate (issue 34):
each typical bug is the declared configuration with one thing changed, recomputed in float64 from the stage's own
inputs (:func:`variant_values`), its fields judged as the stage judges them.

* VESPO: the gamma weighting's ``(k, λ)`` taken by the wrong sign of the advantage;
* OPSM: the anchor swapped (slime's old log-probs where TRL's sampling log-probs are declared, or the reverse);
* TRL's entropy mask: the quantile of the kept share (``q``) where TRL takes ``1 − q``;
* rollout_is / IPO: the ratio taken to the old log-probs where the family's anchor is the rollout (inference)
  log-probs;
* on-policy distillation's loss term: the estimator on ``teacher − student`` (the direction swapped: the forward
  direction of a reverse-KL estimator; verl#5041 shows what mass-covering vs mode-seeking does to a run).

Every hypothesis of a loss family (these and ``explain.loss.FAMILY_BUGS``) predicts each field the stage compares
(:func:`variant_values`): the per-token surrogate ``pg_losses``, the per-sample terms (``pg_sum``, ``kl_sum``,
``clip_count``, …) and the reported scalars, from one float64 pass of the buggy producer's per-token terms over
the stage's own inputs, aggregated as declared; each element is judged within the larger of the stage's
tolerance and the rounding of the buggy formula itself (:func:`_own_bounds`: its decisions at its own edges, the
payloads stored coarser than the compute).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from ..judge.fields import PER_SCALAR, FieldResult
from ..kernels.families import slice_tokens
from ..kernels.loss import (LossKnobs, opd_estimate, policy_fields_from_sums, policy_sums, policy_token_terms,
                            sample_log_terms)
from ..stages import StageContext, StageInputError
from ..stages.loss import AGGREGATE_SUFFIX, LossInputs, loss_inputs
from .base import Hypothesis

STAGE = "loss.policy"


def _variants(knobs: LossKnobs) -> list[tuple[str, str, LossKnobs, dict]]:
    """``(id, detail, knobs, payload overrides)`` of each typical bug of the declared knobs."""
    out = []
    if knobs.policy_loss == "vespo":
        swapped = (("k_pos", knobs.param("k_neg")), ("k_neg", knobs.param("k_pos")),
                   ("lambda_pos", knobs.param("lambda_neg")), ("lambda_neg", knobs.param("lambda_pos")))
        out.append(("loss.vespo_sign_swapped", "VESPO's (k, λ) taken by the wrong sign of the advantage "
                    "((k_neg, λ_neg) for A ≥ 0)", dataclasses.replace(knobs, policy_loss_params=tuple(sorted(swapped))),
                    {}))
    if knobs.opsm:
        other = "old" if knobs.opsm_anchor == "rollout" else "rollout"
        out.append((f"loss.opsm_anchor_{other}", f"OPSM's sequence KL taken against the {other} log-probs (config: "
                    f"{knobs.opsm_anchor}; slime compares old vs current, TRL sampling vs current)",
                    dataclasses.replace(knobs, opsm_anchor=other), {}))
    if knobs.entropy_mask and knobs.top_entropy_quantile != 0.5:
        q = knobs.top_entropy_quantile
        out.append(("loss.entropy_quantile_flipped", f"the entropy mask's threshold at the {q:g} quantile (the kept "
                    f"share) where TRL takes 1 − q = {1 - q:g}", dataclasses.replace(knobs, top_entropy_quantile=1 - q),
                    {}))
    if knobs.policy_loss in ("rollout_is", "ipo", "icepop"):
        out.append((f"loss.{knobs.policy_loss}_old_anchor", f"{knobs.policy_loss}'s ratio taken to the old log-probs "
                    "where its anchor is the rollout (inference) log-probs", knobs, {"rollout_log_probs": "old"}))
    return out


# per-sample term (expected.json $.loss.policy.per_sample) → the row of the per-sample sums it records
TERM_ROWS = {"pg_sum": "pg", "entropy_sum": "ent", "kl_sum": "kl", "clip_count": "clip", "mask_count": "mask",
             "kl_loss_sum": "kl_loss"}
Chunk = Callable[[dict, int, int, torch.Tensor], torch.Tensor]


def variant_values(ctx: StageContext, li: LossInputs, fields: list[FieldResult], used: LossKnobs, *,
                   log_probs: Optional[torch.Tensor] = None, advantages: Optional[torch.Tensor] = None,
                   rollout: Optional[torch.Tensor] = None, pg_sign: float = 1.0, pg_of: Optional[Chunk] = None,
                   opd_of: Optional[Chunk] = None, keep_rows: tuple[str, ...] = (),
                   clip_alternative: Optional[Chunk] = None) -> tuple[dict, dict]:
    """``(values, bounds)`` of a hypothesis: every field of the stage a producer with a bug of its policy loss
    records — ``pg_losses`` per token, each recorded per-sample term, the reported scalars — from one float64
    pass of the per-token terms (``kernels.policy_token_terms``) with the knobs it ran (``used``) and the inputs
    it read in place of the stage's (``log_probs``, ``advantages``, ``rollout``), summed per sample and aggregated
    with the declared knobs (``li.knobs``: the aggregation is the config's, whatever the bug).

    ``pg_sign``: the surrogate recorded negated (a test taken on ``−A``, then its sign restored); ``pg_of(t, lo,
    hi, seg)`` / ``opd_of``: the chunk's surrogate / distillation term where the bug changes it beyond the knobs;
    ``keep_rows``: sums left as the declared loss gives them (metrics the bug does not reach);
    ``clip_alternative``: a second reading of the clip indicator (a metric that one framework computes from the
    ratio the loss took and another apart from it): the clip fields then match either reading (``bounds``)."""
    declared = li.knobs
    logp = li.log_probs if log_probs is None else log_probs
    adv = li.advantages if advantages is None else advantages
    if not isinstance(adv, torch.Tensor):
        adv = adv.materialize()
    rollout = li.rollout_log_probs if rollout is None else rollout
    mask = li.mask
    names = {f.name for f in fields}
    rows = list(policy_sums(declared)) + (["clip_alt"] if clip_alternative is not None else [])
    sums = {row: torch.zeros(ctx.n, dtype=torch.float64) for row in rows}
    token_pg = torch.zeros(int(mask.numel()), dtype=torch.float64) if "pg_losses" in names else None
    sample_terms = sample_log_terms(logp, li.old_log_probs, rollout, mask, ctx.lengths, used, dtype=torch.float64,
                                    entropy=li.entropy, advantages=adv, family_tokens=li.family_tokens)
    kept = _declared_rows(ctx, li, keep_rows) if keep_rows else {}
    for lo, hi, seg in ctx.token_chunks():
        a = adv[lo:hi].to(torch.float64)
        t = policy_token_terms(
            logp[lo:hi], li.old_log_probs[lo:hi], a, used, seg=seg, sample_terms=sample_terms,
            rollout_log_probs=rollout[lo:hi] if rollout is not None else None,
            ref_log_probs=li.ref_log_probs[lo:hi] if li.ref_log_probs is not None and used.kl_loss else None,
            dtype=torch.float64, entropy=li.entropy[lo:hi] if li.entropy is not None else None,
            teacher_log_probs=li.teacher_log_probs[lo:hi] if used.opd_loss else None,
            family_tokens=slice_tokens(li.family_tokens, slice(lo, hi)))
        pg = pg_of(t, lo, hi, seg) if pg_of is not None else t["pg"] * pg_sign
        if token_pg is not None:
            token_pg[lo:hi] = pg
        m = mask[lo:hi].to(torch.float64)
        zero = torch.zeros_like(m)
        columns = {"pg": pg, "clip": t["clip"], "kl": t["ppo_kl"], "mask": torch.ones_like(m),
                   "ent": li.entropy[lo:hi] if li.entropy is not None else zero,
                   "clip_lower": t.get("clip_lower", zero), "kl_loss": t.get("kl_loss", zero),
                   "opd_loss": opd_of(t, lo, hi, seg) if opd_of is not None else t.get("opd_loss", zero)}
        if clip_alternative is not None:
            columns["clip_alt"] = clip_alternative(t, lo, hi, seg)
        for row in rows:
            if row not in kept:
                sums[row].index_add_(0, seg, columns[row].to(torch.float64) * m)
    sums.update(kept)
    has_entropy = li.entropy is not None
    scalars = policy_fields_from_sums(sums, has_entropy, declared.entropy_coef, declared)
    values: dict = {}
    bounds: dict = {}
    other = None
    if clip_alternative is not None:
        other = policy_fields_from_sums(dict(sums, clip=sums["clip_alt"]), has_entropy, declared.entropy_coef,
                                        declared)
    for f in fields:
        if f.name == "loss" and f.per == PER_SCALAR and f.labels:
            keys = [label.removesuffix(AGGREGATE_SUFFIX) for label in f.labels]
            got = [float(scalars[k]) if k in scalars else float(f.actual[i]) for i, k in enumerate(keys)]
            alt = [float(other[k]) if other is not None and k in other else got[i] for i, k in enumerate(keys)]
            values[f.name] = torch.tensor([(x + y) / 2 for x, y in zip(got, alt)], dtype=torch.float64)
            if other is not None:
                bounds[f.name] = torch.tensor([abs(x - y) / 2 for x, y in zip(got, alt)], dtype=torch.float64)
        elif f.name in TERM_ROWS and TERM_ROWS[f.name] in sums:
            values[f.name] = sums[TERM_ROWS[f.name]]
            if f.name == "clip_count" and clip_alternative is not None:
                values[f.name] = (sums["clip"] + sums["clip_alt"]) / 2
                bounds[f.name] = (sums["clip"] - sums["clip_alt"]).abs() / 2
    if token_pg is not None:
        values["pg_losses"] = token_pg
    own = _own_bounds(ctx, li, fields, used, logp, adv, rollout, sums)
    for name, bound in own.items():
        bounds[name] = bounds[name] + bound if name in bounds else bound
    return values, bounds


# the knobs a family bug changes, by the config field that declares each (LossKnobs.of reads them by these names)
_CONFIG_KNOBS = ("policy_loss", "policy_loss_params", "opsm_anchor", "top_entropy_quantile")


def _own_bounds(ctx: StageContext, li: LossInputs, fields: list[FieldResult], used: LossKnobs,
                logp: torch.Tensor, adv: torch.Tensor, rollout: Optional[torch.Tensor],
                sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rounding bound of the buggy producer's own formula (``Hypothesis.bounds``): the stage's per-token bound
    (``stages.loss_terms``: the formula's rounding, payloads stored coarser than the compute, a mask or clip
    decision within rounding of the variant's own edge) evaluated on the variant's knobs and inputs, for
    ``pg_losses`` (plus the payload's own storage rounding), its per-sample sum ``pg_sum`` (plus a sequential
    sum's ``2·u_a·n_i·Σ|pg|``), ``clip_count`` (the tokens at an edge) and the policy term's scalars; ``{}`` when
    the variant is no config of the stage's (KL-Cov's partition)."""
    import msgspec

    from ..judge.error_model import UNIT_ROUNDOFF, storage_unit
    from ..kernels.loss import agg_weights
    from ..stages.loss_terms import ACCUMULATE_SLACK, TOKEN_TERMS_PAYLOAD, _precision, _Tokens

    declared = li.knobs
    if used.micro_batch != declared.micro_batch:
        return {}
    changed = {k: (dict(getattr(used, k)) if k == "policy_loss_params" else getattr(used, k))
               for k in _CONFIG_KNOBS if getattr(used, k) != getattr(declared, k)}
    try:
        config = msgspec.structs.replace(ctx.config, **changed) if changed else ctx.config
    except (TypeError, ValueError, msgspec.ValidationError):
        return {}
    compute, accumulate = _precision(ctx)
    names = {f.name: f for f in fields}
    store = li.storage(compute)
    if not store.any and not {"pg_losses", "pg_sum", "clip_count"} & set(names):
        return {}  # the recorded scalars alone, from payloads as fine as the compute: the stage's bound is theirs
    tokens = _Tokens(logp, li.old_log_probs, adv, li.entropy, li.mask, config, lengths=ctx.lengths,
                     samples=ctx.samples, u_t=UNIT_ROUNDOFF[compute], store=store,
                     advantage_bound=li.advantage_bound, rollout_log_probs=rollout, ref_log_probs=li.ref_log_probs,
                     teacher_log_probs=li.teacher_log_probs)
    n = ctx.n
    pg_bound = torch.zeros(n, dtype=torch.float64)
    pg_mag = torch.zeros(n, dtype=torch.float64)
    near = torch.zeros(n, dtype=torch.float64)
    token = torch.zeros(int(li.mask.numel()), dtype=torch.float64) if "pg_losses" in names else None
    u_own = storage_unit(compute, ctx.payload(TOKEN_TERMS_PAYLOAD)) if token is not None else 0.0
    for lo, hi, seg in ctx.token_chunks():
        c = tokens.chunk(lo, hi)
        m = c["mask"]
        pg_bound.index_add_(0, seg, c["pg_bound"] * m.abs())
        pg_mag.index_add_(0, seg, (c["pg"] * m).abs())
        near.index_add_(0, seg, tokens.near_clip_bound(c).to(torch.float64) * (m != 0))
        if token is not None:
            token[lo:hi] = c["pg_bound"] + c["pg"].abs() * u_own
    per_sample = pg_bound + pg_mag * ctx.lengths.to(torch.float64) * (ACCUMULATE_SLACK * UNIT_ROUNDOFF[accumulate])
    out: dict[str, torch.Tensor] = {}
    if token is not None:
        out["pg_losses"] = token
    if "pg_sum" in names:
        out["pg_sum"] = per_sample
    if "clip_count" in names:
        out["clip_count"] = near
    loss = names.get("loss")
    if loss is not None and loss.per == PER_SCALAR and loss.labels:
        weight = agg_weights(declared.loss_agg_mode, sums["mask"], declared) * abs(float(declared.loss_scale))
        scalar = float((weight * per_sample).sum())
        out["loss"] = torch.tensor([scalar if label.removesuffix(AGGREGATE_SUFFIX) in ("loss", "pg_loss") else 0.0
                                    for label in loss.labels], dtype=torch.float64)
    return out


def _declared_rows(ctx: StageContext, li: LossInputs, rows: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The per-sample sums ``rows`` of the declared loss (the stage's own recompute)."""
    from ..stages.loss import SUMS_OUTPUT, _loss_sums

    sums = ctx.outputs.get(SUMS_OUTPUT)
    if sums is None:
        sums = _loss_sums(ctx, li)
    return {row: sums[row].to(torch.float64) for row in rows if row in sums}


def variant_hypothesis(ctx: StageContext, li: LossInputs, fields: list[FieldResult], hid: str, detail: str,
                       used: LossKnobs, **how) -> Hypothesis:
    values, bounds = variant_values(ctx, li, fields, used, **how)
    return Hypothesis(stage=STAGE, id=hid, detail=detail, values=values, bounds=bounds)


def hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    knobs = LossKnobs.of(ctx.config, ctx.samples)
    if not (knobs.family or knobs.opsm or knobs.entropy_mask or knobs.opd_loss):
        return []
    try:
        li = loss_inputs(ctx)
    except StageInputError:
        return []
    out = []
    for hid, detail, variant, overrides in _variants(knobs):
        if overrides.get("rollout_log_probs") == "old" and li.rollout_log_probs is None:
            continue
        how = {"rollout": li.old_log_probs} if overrides.get("rollout_log_probs") == "old" else {}
        if variant.opsm and variant.opsm_anchor == "rollout" and li.rollout_log_probs is None:
            if not ctx.has("rollout_log_probs"):  # the sampler's log-probs the variant reads: not recorded
                continue
            how = {"rollout": ctx.payload("rollout_log_probs")}
        try:
            out.append(variant_hypothesis(ctx, li, fields, hid, detail, variant, **how))
        except (ValueError, KeyError):
            continue
    if knobs.opd_loss and li.teacher_log_probs is not None:
        def swapped(t: dict, lo: int, hi: int, seg: torch.Tensor) -> torch.Tensor:
            return opd_estimate(li.teacher_log_probs[lo:hi], li.log_probs[lo:hi], knobs, torch.float64)

        out.append(variant_hypothesis(ctx, li, fields, "loss.opd_direction_swapped", (
            f"the distillation term's {knobs.opd_kl_type} estimate on teacher − student (the direction swapped)"),
            knobs, opd_of=swapped))
    return out
