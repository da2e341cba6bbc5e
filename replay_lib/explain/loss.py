"""``loss.policy`` hypotheses, evaluated from the loss stage's own inputs (``stages.loss.loss_inputs``: the
recorded log-probs, old log-probs, advantages, entropy and mask).

Per-token variants of the clipped surrogate, all summed per sample in **one pass** over the tokens (a chunk at a
time, every variant's masked terms stacked into one cumulative sum):

* other clip bounds: ``(eps_clip, eps_clip_high)`` from {0.2, 0.28, 0.3} and the declared pair's own values;
* dual-clip switched: on with ``c = 3`` (``pg = min(pg, −c·A)`` where ``A < 0``, verl's default) when the
  config has it off, off when on;
* the loss mask shifted one token later (or earlier) inside every sample;
* stale old log-probs: ``old = logp`` (ratio ≡ 1, ``ppo_kl`` = 0);
* the advantages negated inside the loss.

Aggregations of the declared surrogate (no extra pass): each other ``loss_agg_mode`` of SPEC §4.2
(``Σ_i w_i Σ_t x·mask`` with ``w_i`` = ``1/max(n_i,1)`` sum_of_sample_means · ``1/(N·max(n_i,1))``
seq_mean_token_mean · ``1/T`` token_mean · ``1/N`` seq_mean_token_sum · ``1/(N·L)`` seq_mean_token_sum_norm,
with the recorded ``T``, ``N``, ``L`` or else the bundle's token count, sample count and longest response),
and the per-sample mean taken over the response length instead of the loss tokens (``1/max(len_i, 1)``).

A token mean per micro-batch (:func:`micro_batch_hypotheses`): each micro-batch's sums over its own loss-token
count, summed or averaged over the micro-batches — a re-aggregation of the stage's own per-sample sums (every loss
knob), so it is tried under any configuration with a ``token_mean`` term and two or more micro-batches.

A variant gives every loss field it changes: the reported scalars, the recorded per-sample terms and the
per-token ``pg_losses``; its elements are judged with the stage's own tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..judge.fields import PER_SCALAR, FieldResult
from ..stages import StageContext, StageInputError
from ..stages.loss import AGGREGATE_SUFFIX, LossInputs, loss_inputs
from ..kernels.loss import LossKnobs, agg_weights, field_aggregation, loss_total
from .base import Hypothesis, fmt_number, listing, micro_batches

STAGE = "loss.policy"
CLIP_VALUES = (0.2, 0.28, 0.3)
DUAL_CLIP_C = 3.0
AGG_MODES = ("sum_of_sample_means", "seq_mean_token_mean", "token_mean", "seq_mean_token_sum",
             "seq_mean_token_sum_norm")
# The per-sample weight a producer records (``loss_scale·w_i`` of the policy term's mode): an aggregation
# hypothesis predicts it too.
WEIGHT_FIELD = "loss_weight"
TERMS = {"pg_sum": "pg", "entropy_sum": "ent", "kl_sum": "kl", "clip_count": "clip", "mask_count": "mask"}
ROWS = ("pg", "clip", "kl", "ent", "mask")
# The loss stage's fields besides the per-sample terms: the per-token surrogate, and the recorded scalars checked
# against the recorded per-sample terms' aggregation (when the bundle records them).
TOKEN_FIELD = "pg_losses"
AGGREGATE_FIELD = "aggregate"


@dataclass(frozen=True)
class Variant:
    id: str
    detail: str
    eps_clip: float
    eps_clip_high: float
    dual_c: Optional[float] = None
    mask_shift: int = 0
    stale: bool = False
    sign: float = 1.0

    def surrogate(self, ratio: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 per-token ``(pg, clip indicator)`` of this variant from the ratio ``exp(logp − old)`` (1 for a
        stale variant: pass it ``ones``) and the advantages."""
        a = adv * self.sign
        l1 = -ratio * a
        l2 = -ratio.clamp(1 - self.eps_clip, 1 + self.eps_clip_high) * a
        pg = torch.maximum(l1, l2)
        if self.dual_c is not None:
            pg = torch.where(a < 0, torch.minimum(pg, -self.dual_c * a), pg)
        return pg, (l2 > l1).to(torch.float64)

    def token_pg(self, li: LossInputs, lo: int, hi: int) -> torch.Tensor:
        """The per-token surrogate of tokens ``lo … hi − 1`` (the ``pg_losses`` a producer with this bug records)."""
        adv = li.advantages[lo:hi].to(torch.float64)
        if self.stale:
            return self.surrogate(torch.ones_like(adv), adv)[0]
        kl = li.old_log_probs[lo:hi].to(torch.float64) - li.log_probs[lo:hi].to(torch.float64)
        return self.surrogate((-kl).exp(), adv)[0]


def _variants(ctx: StageContext) -> list[Variant]:
    cfg = ctx.config
    lo, hi = float(cfg.eps_clip), float(cfg.eps_clip_high)
    dual = cfg.eps_clip_c
    out = [Variant("loss.declared", "", lo, hi, dual)]
    values = sorted(set(CLIP_VALUES) | {lo, hi})
    for a in values:
        for b in values:
            if (a, b) != (lo, hi):
                out.append(Variant(f"loss.clip_{fmt_number(a)}_{fmt_number(b)}",
                                   f"the recorded loss equals clip bounds eps_clip={fmt_number(a)}, eps_clip_high="
                                   f"{fmt_number(b)} (config: {fmt_number(lo)}, {fmt_number(hi)})", a, b, dual))
    if dual is None:
        out.append(Variant("loss.dual_clip_on", f"the recorded loss equals dual-clip PPO with c={DUAL_CLIP_C:g} "
                           f"(config: dual-clip off)", lo, hi, DUAL_CLIP_C))
    else:
        out.append(Variant("loss.dual_clip_off", f"the recorded loss equals the loss without dual-clip (config: "
                           f"eps_clip_c={fmt_number(dual)})", lo, hi, None))
    out.append(Variant("loss.mask_shifted_later", "the recorded loss equals the loss mask shifted one token later "
                       "in every sample", lo, hi, dual, mask_shift=1))
    out.append(Variant("loss.mask_shifted_earlier", "the recorded loss equals the loss mask shifted one token "
                       "earlier in every sample", lo, hi, dual, mask_shift=-1))
    out.append(Variant("loss.stale_old_log_probs", "the recorded loss equals a ratio of 1 everywhere: the old "
                       "log-probs were the current ones (stale old_log_probs)", lo, hi, dual, stale=True))
    out.append(Variant("loss.advantages_negated", "the recorded loss equals the surrogate of the negated "
                       "advantages", lo, hi, dual, sign=-1.0))
    return out


def _shifted_mask(mask: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, lo: int, hi: int,
                  shift: int) -> torch.Tensor:
    """The mask of tokens ``lo … hi − 1`` read one token back (``shift`` 1) or ahead (−1) inside their own sample:
    0 at a sample's first (last) token."""
    total = mask.numel()
    a, b = max(lo - shift, 0), min(hi - shift, total)
    out = torch.zeros(hi - lo, dtype=torch.float64)
    out[a + shift - lo:b + shift - lo] = mask[a:b].to(torch.float64)
    edges = starts if shift > 0 else ends - 1
    edges = edges[(edges >= lo) & (edges < hi)] - lo
    out[edges] = 0.0
    return out


def _sums(ctx: StageContext, li: LossInputs, variants: list[Variant]) -> list[dict[str, torch.Tensor]]:
    """Per variant, the per-sample sums ``Σ_t x·mask`` of :data:`ROWS` (float64), in one pass over the tokens.

    Six full-length rows per chunk: the declared variant's five and the stale variant's surrogate ``−A``. The
    others differ from the declared one on few tokens, which are summed alone: inside the narrowest clip bounds
    of all variants the surrogate is ``−ratio·A`` for every one (none clips; dual-clip's ``−c·A`` cap binds only
    at ratios beyond ``c``) and ``+ratio·A`` for the negated advantages, so a clip, dual-clip or negated variant
    adds its difference on the tokens outside those bounds; a shifted mask differs from the mask where the mask
    changes and at sample edges only."""
    n = ctx.n
    ends = torch.cumsum(ctx.lengths.to(torch.int64), 0)
    starts = ends - ctx.lengths.to(torch.int64)
    declared = variants[0]
    sparse = [k for k, v in enumerate(variants) if k and not (v.mask_shift or v.stale)]
    bounded = [variants[k] for k in [0, *sparse]]
    low = min(v.eps_clip for v in bounded)
    high = min([v.eps_clip_high for v in bounded] + [v.dual_c - 1 for v in bounded if v.dual_c is not None])
    full = torch.zeros((6, n), dtype=torch.float64)
    extra = {k: torch.zeros((2, n), dtype=torch.float64) for k in sparse}
    shifted = {v.mask_shift: torch.zeros((5, n), dtype=torch.float64) for v in variants if v.mask_shift}
    for lo, hi, seg in ctx.token_chunks():
        old = li.old_log_probs[lo:hi].to(torch.float64)
        kl = old - li.log_probs[lo:hi].to(torch.float64)
        ratio = (-kl).exp()
        adv = li.advantages[lo:hi].to(torch.float64)
        ent = li.entropy[lo:hi].to(torch.float64) if li.entropy is not None else torch.zeros_like(old)
        mask = li.mask[lo:hi].to(torch.float64)
        pg, clip = declared.surrogate(ratio, adv)
        terms = torch.stack([pg, clip, kl, ent, torch.ones_like(old), -adv])
        full.index_add_(1, seg, terms * mask)
        outside = torch.nonzero((ratio < 1 - low) | (ratio > 1 + high)).reshape(-1)
        if outside.numel():
            r, a, m, sg = ratio[outside], adv[outside], mask[outside], seg[outside]
            p0, c0 = pg[outside], clip[outside]
            for k in sparse:
                pg_k, clip_k = variants[k].surrogate(r, a)
                base = -p0 if variants[k].sign != 1.0 else p0  # the variant's value inside the bounds, per token
                extra[k].index_add_(1, sg, torch.stack([(pg_k - base) * m, (clip_k - (0 if variants[k].sign != 1.0
                                                                                      else c0)) * m]))
        for shift, acc in shifted.items():
            delta = _shifted_mask(li.mask, starts, ends, lo, hi, shift) - mask
            at = torch.nonzero(delta).reshape(-1)
            if at.numel():
                acc.index_add_(1, seg[at], terms[:5, at] * delta[at])
    base = dict(zip(ROWS, full[:5]))
    zeros = torch.zeros(n, dtype=torch.float64)
    found = []
    for k, v in enumerate(variants):
        if k == 0:
            found.append(base)
        elif v.mask_shift:
            found.append(dict(zip(ROWS, full[:5] + shifted[v.mask_shift])))
        elif v.stale:
            found.append({**base, "pg": full[5], "clip": zeros, "kl": zeros})
        elif v.sign != 1.0:
            found.append({**base, "pg": -full[0] + extra[k][0], "clip": extra[k][1]})
        else:
            found.append({**base, "pg": full[0] + extra[k][0], "clip": full[1] + extra[k][1]})
    return found


def _step_counts(ctx: StageContext, count: torch.Tensor) -> dict[str, float]:
    """The counts another aggregation mode divides by: the recorded ones, else the step's own (its loss tokens,
    samples, longest response)."""
    cfg = ctx.config
    return {"loss_token_count": float(cfg.loss_token_count or max(float(count.sum()), 1.0)),
            "loss_seq_count": float(cfg.loss_seq_count or ctx.n or 1),
            "loss_horizon": float(cfg.loss_horizon or max(int(ctx.lengths.max()) if ctx.n else 1, 1))}


def _weights(ctx: StageContext, mode: str, sums: dict[str, torch.Tensor]) -> torch.Tensor:
    count = sums["mask"]
    n_i = count.clamp(min=1.0)
    counts = _step_counts(ctx, count)
    T, N, L = counts["loss_token_count"], counts["loss_seq_count"], counts["loss_horizon"]
    if mode == "sum_of_sample_means":
        w = 1.0 / n_i
    elif mode == "seq_mean_token_mean":
        w = 1.0 / (N * n_i)
    elif mode == "token_mean":
        w = torch.full_like(count, 1.0 / T)
    elif mode == "seq_mean_token_sum":
        w = torch.full_like(count, 1.0 / N)
    elif mode == "seq_mean_token_sum_norm":
        w = torch.full_like(count, 1.0 / (N * L))
    else:  # "response_length": a per-sample mean over the whole response, the mask ignored in the denominator
        w = 1.0 / ctx.lengths.to(torch.float64).clamp(min=1.0)
    return w


def _fields(ctx: StageContext, li: LossInputs, sums: dict[str, torch.Tensor], mode: str,
            metric_mode: Optional[str] = None) -> dict[str, float]:
    """The loss fields of per-sample sums ``sums`` (:data:`ROWS`): the loss terms aggregated with ``mode`` and the
    loss scale, the metrics (clip fraction, ppo_kl) with ``metric_mode`` (default: ``mode``)."""
    w = _weights(ctx, mode, sums) * float(ctx.config.loss_scale)
    wm = _weights(ctx, metric_mode or mode, sums)
    pg = float((w * sums["pg"]).sum())
    ent = float((w * sums["ent"]).sum()) if li.entropy is not None else 0.0
    return {"loss": pg - ctx.config.entropy_coef * ent, "pg_loss": pg, "entropy_loss": ent,
            "pg_clipfrac": float((wm * sums["clip"]).sum()), "ppo_kl": float((wm * sums["kl"]).sum())}


def _recorded_sums(fields: dict[str, FieldResult], sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-sample sums as the bundle records them (the per-sample term fields' expected values), the
    recompute's where a term is not recorded."""
    out = dict(sums)
    for term, row in TERMS.items():
        if term in fields:
            out[row] = fields[term].expected
    return out


def modelled(cfg) -> bool:
    """Whether the declared loss is the clipped surrogate these variants vary: no KL term in the loss, no
    train/rollout importance weights, no log-ratio clamp, token-level ratios (other configurations get no loss
    hypotheses rather than ones built on the wrong formula)."""
    kl_loss = cfg.use_kl_loss and cfg.kl_loss_coef != 0
    knobs = LossKnobs.of(cfg)  # another loss family, OPSM, the entropy mask, distillation: explain.families
    return not (kl_loss or cfg.use_tis or cfg.is_level is not None or cfg.log_ratio_clamp is not None
                or cfg.importance_level != "token" or cfg.use_rollout_logprobs or knobs.family or knobs.opsm
                or knobs.entropy_mask or knobs.opd_loss)


def micro_batch_hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    """A token mean taken per micro-batch: each micro-batch's ``Σ x·mask`` over its own loss-token count instead
    of the recorded ``loss_token_count``, the micro-batches' means then summed (gradient accumulation adding
    their losses) or averaged — for each loss term aggregated ``token_mean``, each sample's recorded loss weight
    then 1/(its micro-batch's tokens); the metrics as declared, or (a producer whose one aggregation function
    took the micro-batch's count for everything, verl's ``agg_loss``) per micro-batch too, where they are a token
    mean and that changes them.

    Only a re-aggregation of per-sample sums: of the stage's own recompute (every loss knob included, so no
    :func:`modelled` gate) for the recorded scalars, and of the recorded per-sample terms for their aggregation
    check."""
    from ..stages.loss import ROW_OF_FIELD, SUMS_OUTPUT, TERM_OF_FIELD, _loss_sums

    knobs = LossKnobs.of(ctx.config, ctx.samples)
    # (the recompute's row, the field) of each loss term and metric, with its mode and scale
    terms = [(ROW_OF_FIELD[name], name, *field_aggregation(name, knobs))
             for name in ("pg_loss", "entropy_loss", *(("kl_loss",) if knobs.kl_loss else ()))]
    metrics = [(ROW_OF_FIELD[name], name, *field_aggregation(name, knobs)) for name in ("pg_clipfrac", "ppo_kl")]
    if not any(mode == "token_mean" for _, _, mode, _ in terms):
        return []
    placed = micro_batches(ctx.samples)
    if placed is None or len(placed[0]) < 2:
        return []
    try:
        # the stage's own sums (its one pass over the tokens); --exact's float32 kernel leaves none: one more pass
        sums = ctx.outputs.get(SUMS_OUTPUT) or _loss_sums(ctx, loss_inputs(ctx))
    except StageInputError:
        return []
    ids, mb = placed
    k = len(ids)
    names = {f.name: f for f in fields}

    def micro_batch_tokens(counts: torch.Tensor) -> torch.Tensor:
        return torch.zeros(k, dtype=torch.float64).index_add_(0, mb, counts).clamp(min=1.0)

    def scalars(per_sample: dict[str, torch.Tensor], counts: torch.Tensor, averaged: bool,
                with_metrics: bool) -> dict[str, float]:
        """The loss terms of ``per_sample`` with each token-mean term taken per micro-batch (the metrics too when
        ``with_metrics``), and ``loss``."""
        tokens = micro_batch_tokens(counts)
        out: dict[str, float] = {}
        for row, name, mode, scale in terms + (metrics if with_metrics else []):
            values = per_sample.get(row)
            if values is None:
                continue
            if mode == "token_mean":
                means = torch.zeros(k, dtype=torch.float64).index_add_(0, mb, values) / tokens
                total = float(means.sum()) / (k if averaged else 1)
            else:
                total = float((values * agg_weights(mode, counts, knobs)).sum())
            out[name] = total * scale
        out["loss"] = loss_total(out["pg_loss"], out.get("entropy_loss", 0.0), out.get("kl_loss", 0.0),
                                 knobs.entropy_coef, knobs)
        return out

    recorded = {row: names[TERM_OF_FIELD[name]].expected for row, name, _, _ in terms + metrics
                if TERM_OF_FIELD[name] in names}
    recorded_counts = names["mask_count"].expected if "mask_count" in names else sums["mask"]
    _, _, pg_mode, pg_scale = terms[0]
    step_tokens = micro_batch_tokens(sums["mask"])[mb]  # each sample's micro-batch's loss tokens
    metric_choices = [False] + ([True] if any(mode == "token_mean" for _, _, mode, _ in metrics) else [])
    out = []
    for averaged in (False, True):
        how = f"averaged over the {k} micro-batches" if averaged else "summed over the micro-batches"
        for with_metrics in metric_choices:
            loss_fields = scalars(sums, sums["mask"], averaged, with_metrics)
            aggregated = scalars(recorded, recorded_counts, averaged, with_metrics) if "pg" in recorded else None
            values = {}
            if WEIGHT_FIELD in names and pg_mode == "token_mean":  # each sample's weight: 1 / its micro-batch's tokens
                values[WEIGHT_FIELD] = pg_scale / (step_tokens * (k if averaged else 1))
            for f in fields:
                by_label = aggregated if f.name == AGGREGATE_FIELD else loss_fields if f.name == "loss" else None
                if by_label is None or f.per != PER_SCALAR or not f.labels:
                    continue
                keys = [label.removesuffix(AGGREGATE_SUFFIX) for label in f.labels]
                values[f.name] = torch.tensor([by_label.get(key, float(f.actual[i])) for i, key in enumerate(keys)],
                                              dtype=torch.float64)
            count = f"loss_token_count={knobs.loss_token_count}" if knobs.loss_token_count is not None else \
                "the step's loss tokens"
            also = " (the metrics pg_clipfrac, ppo_kl too)" if with_metrics else ""
            base = "loss.micro_batch_token_mean" + ("_averaged" if averaged else "")
            out.append(Hypothesis(
                stage=STAGE, id=base + ("_with_metrics" if with_metrics else ""),
                detail=f"the recorded loss equals a token mean per micro-batch ({listing(ids)}): each one's Σ x·mask "
                       f"over its own loss tokens, {how}, instead of over {count}{also}", values=values,
                extends=base if with_metrics else None))
    return out


def aggregation_hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    """Each other ``loss_agg_mode`` (the metrics following it, as the modelled family's ``loss.agg_*``) under a
    configuration the surrogate variants do not model (a KL term in the loss, IS weights, a log-ratio clamp, GSPO):
    only a re-aggregation of the stage's own per-sample sums (every knob included) with the kernel's field rule,
    of the recorded terms for their aggregation check, and each sample's weight. A count the other mode needs and
    the bundle does not record is the step's own (its loss tokens, samples, longest response)."""
    import msgspec

    from ..kernels.loss import policy_fields_from_sums
    from ..stages.loss import ROW_OF_FIELD, SUMS_OUTPUT, TERM_OF_FIELD, _loss_sums

    cfg = ctx.config
    try:
        sums = ctx.outputs.get(SUMS_OUTPUT) or _loss_sums(ctx, loss_inputs(ctx))
    except StageInputError:
        return []
    names = {f.name: f for f in fields}
    recorded = dict(sums)
    for field_name, term in TERM_OF_FIELD.items():
        if term in names:
            recorded[ROW_OF_FIELD[field_name]] = names[term].expected
    if "mask_count" in names:
        recorded["mask"] = names["mask_count"].expected
    has_entropy = ctx.has("entropy")
    counts = _step_counts(ctx, sums["mask"])
    out = []
    for other in AGG_MODES:
        if other == cfg.loss_agg_mode and (cfg.metric_agg_mode or other) == other:
            continue
        knobs = LossKnobs.of(msgspec.structs.replace(cfg, loss_agg_mode=other, metric_agg_mode=None, **counts),
                              ctx.samples)
        by = {"loss": policy_fields_from_sums(sums, has_entropy, knobs.entropy_coef, knobs),
              AGGREGATE_FIELD: policy_fields_from_sums(recorded, has_entropy, knobs.entropy_coef, knobs)}
        values: dict = {}
        for f in fields:
            fields_of = by.get(f.name)
            if fields_of is None or f.per != PER_SCALAR or not f.labels:
                continue
            keys = [label.removesuffix(AGGREGATE_SUFFIX) for label in f.labels]
            values[f.name] = torch.tensor([float(fields_of[key]) if key in fields_of else float(f.actual[i])
                                           for i, key in enumerate(keys)], dtype=torch.float64)
        if WEIGHT_FIELD in names:
            values[WEIGHT_FIELD] = agg_weights(other, sums["mask"], knobs) * knobs.loss_scale
        out.append(Hypothesis(stage=STAGE, id=f"loss.agg_{other}", values=values,
                              detail=f"the recorded loss fields equal a {other} aggregation (config: {cfg.loss_agg_mode})"))
    return out


def _swap_params(knobs: LossKnobs, a: str, b: str) -> LossKnobs:
    pa, pb = knobs.param(a), knobs.param(b)
    params = dict(knobs.policy_loss_params)
    params.update({a: pb, b: pa})
    return replace(knobs, policy_loss_params=tuple(sorted(params.items())))


def _with_param(knobs: LossKnobs, name: str, value) -> LossKnobs:
    params = dict(knobs.policy_loss_params)
    params[name] = value
    return replace(knobs, policy_loss_params=tuple(sorted(params.items())))


# Each policy-loss family's typical bugs: (id, what the report says, the knobs the buggy producer ran).
FAMILY_BUGS = {
    "cispo": [("loss.cispo_cap_swapped", lambda k: (
        "CISPO's cap swapped: the absolute cap min(r, ε_high) (TRL's) where the relative clamp(r, 1 − ε_low, "
        "1 + ε_high) (verl's, SkyRL's) is declared" if k.param("cap") == "relative" else
        "CISPO's cap swapped: the relative clamp(r, 1 − ε_low, 1 + ε_high) (verl's) where TRL's absolute cap "
        "min(r, ε_high) is declared"),
        lambda k: _with_param(k, "cap", "absolute" if k.param("cap") == "relative" else "relative"))],
    "sapo": [("loss.sapo_tau_sign", lambda k: "SAPO's temperature taken by the wrong sign of A: τ_neg where A > 0 "
              "and τ_pos elsewhere", lambda k: _swap_params(k, "tau_pos", "tau_neg"))],
    "dppo_tv": [("loss.dppo_divergence_swapped", lambda k: "DPPO's trust region tested on the binary KL (dppo_kl) "
                 "where the total variation (dppo_tv) is declared", lambda k: replace(k, policy_loss="dppo_kl"))],
    "dppo_kl": [("loss.dppo_divergence_swapped", lambda k: "DPPO's trust region tested on the total variation "
                 "(dppo_tv) where the binary KL (dppo_kl) is declared", lambda k: replace(k, policy_loss="dppo_tv"))],
    "kl_cov": [("loss.kl_cov_global_topk", lambda k: "KL-Cov's top-k covariance tokens taken over the whole step "
                "instead of within each micro-batch", lambda k: replace(k, micro_batch=(0,) * len(k.micro_batch or ()))),
               ("loss.cov_advantage_scaling", lambda k: _cov_scaling_detail("KL-Cov", k),
                lambda k: _with_param(k, "advantages", _other_scaling(k)))],
    "clip_cov": [("loss.cov_advantage_scaling", lambda k: _cov_scaling_detail("Clip-Cov", k),
                  lambda k: _with_param(k, "advantages", _other_scaling(k)))],
    "dro": [("loss.dro_beta_sign", lambda k: "DRO's quadratic penalty ½·β·(log r)² added to the objective instead "
             "of subtracted (it rewards moving away from the old policy)", lambda k: _with_param(k, "beta", -float(k.param("beta"))))],
}


def _other_scaling(knobs: LossKnobs) -> str:
    return "raw" if knobs.param("advantages") == "prescaled" else "prescaled"


def _cov_scaling_detail(name: str, knobs: LossKnobs) -> str:
    """The covariance families' advantage scaling swapped: verl's raw advantages (the penalty normalized with
    the loss) against SkyRL's pre-scaled ones (the covariance on w_i·A, the penalty summed)."""
    skyrl = ("the advantages pre-scaled by the loss reduction's normalizer (SkyRL's: the covariance on w_i·A"
             + (", the penalty summed" if name == "KL-Cov" else "") + ")")
    verl = "the raw advantages (verl's" + (": the penalty normalized with the loss" if name == "KL-Cov" else "") + ")"
    got, declared = (skyrl, verl) if knobs.param("advantages") == "raw" else (verl, skyrl)
    return f"{name} taken on {got} where {declared} are declared"


def family_hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    """A policy-loss family's typical bugs (:data:`FAMILY_BUGS`, and those of its inputs below) and, for every
    family, PPO's clipped surrogate run in its place (a mapping that lost ``policy_loss``): each the buggy
    producer's per-token terms recomputed in float64 (``explain.families.variant_values``), predicting every
    field the stage compares — ``pg_losses``, the per-sample terms and the scalars."""
    from .families import variant_hypothesis

    knobs = LossKnobs.of(ctx.config, ctx.samples)
    try:
        li = loss_inputs(ctx)
    except StageInputError:
        return []
    variants = [(id_, detail(knobs), make(knobs)) for id_, detail, make in FAMILY_BUGS.get(knobs.policy_loss, ())]
    variants.append(("loss.family_ignored", f"PPO's clipped surrogate where policy_loss {knobs.policy_loss!r} is "
                                            "declared (a mapping or trainer that ignored the loss mode)",
                     replace(knobs, policy_loss="ppo", policy_loss_params=())))
    from ..kernels import GrpoReturns

    adv = li.advantages.materialize() if isinstance(li.advantages, GrpoReturns) else li.advantages
    # bugs of a family's inputs rather than its knobs: (id, detail, knobs) with the inputs changed below
    if knobs.policy_loss in ("dppo_tv", "dppo_kl"):  # the test of the other sign: −pg(−A), its mask and metrics
        variants.insert(0, ("loss.dppo_mask_sign", "DPPO's trust-region test taken by the wrong sign of A (the "
                                                   "upper bound where A ≤ 0, the lower where A > 0)", knobs))
    if knobs.policy_loss == "geo_mean":
        variants.insert(0, ("loss.gmpo_arith_mean", "GMPO's sequence ratio taken as the arithmetic mean of the "
                                                    "clipped token ratios instead of their geometric mean", knobs))
    if knobs.policy_loss == "gpg":
        variants.insert(0, ("loss.gpg_old_logp", "GPG's −logp·A taken on the old log-probs instead of the current "
                                                   "(a constant: the loss gives the policy no gradient)",
                            knobs))
    if knobs.policy_loss == "importance_sampling":
        variants.insert(0, ("loss.importance_sampling_advantages_negated", "importance_sampling's advantages "
                            "negated: pg = +exp(logp − old)·A, which lowers the likelihood of the better samples",
                            knobs))
    if knobs.policy_loss == "cross_entropy":
        variants.insert(0, ("loss.cross_entropy_sign", "cross_entropy's sign flipped: pg = +logp, which lowers the "
                            "likelihood of the samples it is meant to fit", knobs))

    out = []
    for id_, detail, k in variants:
        how: dict = {}
        if id_ in ("loss.dppo_mask_sign", "loss.importance_sampling_advantages_negated"):
            how = {"advantages": -adv, "pg_sign": -1.0 if id_ == "loss.dppo_mask_sign" else 1.0}
        elif id_ == "loss.cross_entropy_sign":
            how = {"pg_sign": -1.0}
        elif id_ == "loss.gmpo_arith_mean":
            how = {"pg_of": _gmpo_arith_token_pg(ctx, li, k, adv)}
        elif id_ == "loss.gpg_old_logp":
            how = {"log_probs": li.old_log_probs}
        elif id_ == "loss.kl_cov_global_topk":  # the selection only: the metrics keep the recorded partition
            how = {"keep_rows": ("clip", "kl", "clip_lower")}
        elif id_ == "loss.cispo_cap_swapped":
            how = {"clip_alternative": _cispo_clip_reading(knobs, adv)}
        try:
            out.append(variant_hypothesis(ctx, li, fields, id_, detail, k, **how))
        except (KeyError, ValueError):
            continue
    return out


def _cispo_clip_reading(declared: LossKnobs, adv: torch.Tensor):
    """The clip indicator of a CISPO whose cap was swapped, as the declared framework's metric reads it: verl's
    ``1[r ≠ clip(r)]`` of the absolute cap is ``1[r > ε_high]``; TRL's ``1[r > ε_high ∧ A > 0]`` does not read
    the cap the loss took (the variant's own kernel gives the other framework's reading)."""
    high = declared.eps_clip_high

    def reading(t: dict, lo: int, hi: int, seg: torch.Tensor) -> torch.Tensor:
        above = t["ratio"].to(torch.float64) > high
        if declared.param("cap") == "absolute":
            above &= adv[lo:hi] > 0
        return above.to(torch.float64)

    return reading


def _gmpo_arith_token_pg(ctx: StageContext, li: LossInputs, knobs: LossKnobs, adv: torch.Tensor):
    """GMPO's per-token surrogate with each sample's ratio the arithmetic mean of its sign-clipped token ratios:
    each loss token carries ``−Ā·R/n`` (``kernels.families.geo_mean``'s convention), so its sample sums to
    ``−Ā·R``."""
    from ..kernels.families.geo_mean import _clipped
    from ..kernels.segments import masked_sample_sums

    mask = li.mask.to(torch.float64)

    def columns(lo: int, hi: int, seg: torch.Tensor) -> dict[str, torch.Tensor]:
        lr = li.log_probs[lo:hi].to(torch.float64) - li.old_log_probs[lo:hi].to(torch.float64)
        a = adv[lo:hi].to(torch.float64)
        m = mask[lo:hi]
        clipped, _ = _clipped(lr, a, knobs)
        return {"r": clipped.exp() * m, "a": a * m, "mask": m}

    sums = masked_sample_sums(ctx.lengths, li.mask, columns, dict.fromkeys(("r", "a", "mask"), torch.float64))
    denom = sums["mask"] + 1e-8
    per_token = -(sums["a"] / denom) * (sums["r"] / denom) / sums["mask"].clamp(min=1.0)

    def pg_of(t: dict, lo: int, hi: int, seg: torch.Tensor) -> torch.Tensor:
        return per_token[seg]

    return pg_of


def hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    from .families import hypotheses as mask_hypotheses  # VESPO, rollout_is/IPO, OPSM, entropy mask, distillation

    if getattr(ctx.config, "policy_loss", "ppo") != "ppo":
        # a family's own bugs (FAMILY_BUGS), and those of explain.families; PPO's knob bugs do not apply
        # the family's own bugs before PPO run in its place, which is named only where it explains more than the
        # first of them: on an on-policy step (ratio ≡ 1) PPO's surrogate and a bug of a family's ratio coincide
        own = family_hypotheses(ctx, fields)
        ignored = [h for h in own if h.id == "loss.family_ignored"]
        specific = [h for h in own if h.id != "loss.family_ignored"] + mask_hypotheses(ctx, fields)
        for h in ignored:
            h.extends = specific[0].id if specific else None
        return specific + ignored + aggregation_hypotheses(ctx, fields) + micro_batch_hypotheses(ctx, fields)
    from . import loss_knobs  # the knobs' bugs, under every configuration (first: the more specific wording)

    kn = LossKnobs.of(ctx.config, ctx.samples)
    # the knobs' bugs are modelled on the PPO terms alone: not under a mask or term of explain.families
    masked = kn.opsm or kn.entropy_mask or kn.opd_loss or bool(kn.is_keep)
    knob_bugs = [] if masked else loss_knobs.hypotheses(ctx, fields)
    if not modelled(ctx.config):
        return knob_bugs + mask_hypotheses(ctx, fields) + aggregation_hypotheses(ctx, fields) + \
            micro_batch_hypotheses(ctx, fields)
    try:
        li = loss_inputs(ctx)
    except StageInputError:  # an input the stage itself reported as missing: nothing to hypothesize from
        return []
    cfg = ctx.config
    names = {f.name: f for f in fields}
    variants = _variants(ctx)
    sums = _sums(ctx, li, variants)
    mode = cfg.loss_agg_mode
    metric_mode = getattr(cfg, "metric_agg_mode", None) or mode
    recorded = _recorded_sums(names, sums[0])
    out: list[Hypothesis] = knob_bugs

    def values_of(loss_fields: dict[str, float], per_sample: Optional[dict[str, torch.Tensor]],
                  token: Optional[Variant], aggregated: Optional[dict[str, float]] = None,
                  weights: Optional[torch.Tensor] = None) -> dict:
        """The hypothesis's values of each field it changes: the recomputed scalars (``loss_fields``), the
        recorded scalars' check against the recorded terms (``aggregated``: an aggregation hypothesis), the
        per-sample terms, each sample's loss weight (``weights``: another aggregation's) and the per-token
        surrogate."""
        values: dict = {}
        for f in fields:
            if f.per != PER_SCALAR or not f.labels:
                continue
            by_label = aggregated if f.name == AGGREGATE_FIELD else loss_fields
            if by_label is None:
                continue
            actual = f.actual
            # the aggregate check's rows are the fields they check, suffixed (pg_loss_from_terms)
            keys = [label.removesuffix(AGGREGATE_SUFFIX) for label in f.labels]
            values[f.name] = torch.tensor([by_label.get(key, float(actual[i])) for i, key in enumerate(keys)],
                                          dtype=torch.float64)
        if per_sample is not None:
            for term, row in TERMS.items():
                if term in names:
                    values[term] = per_sample[row]
        if weights is not None and WEIGHT_FIELD in names:
            values[WEIGHT_FIELD] = weights
        if token is not None and TOKEN_FIELD in names:
            values[TOKEN_FIELD] = lambda lo, hi, v=token: v.token_pg(li, lo, hi)
        return values

    dropped = "loss.last_loss_token_dropped"
    for v, s in zip(variants[1:], sums[1:]):
        # a mask whose loss tokens run to each sample's end, shifted earlier, is its last loss token dropped: the
        # shift is reported only where it explains more
        extends = dropped if v.mask_shift == -1 and any(h.id == dropped for h in knob_bugs) else None
        out.append(Hypothesis(stage=STAGE, id=v.id, detail=v.detail, values=values_of(
            _fields(ctx, li, s, mode, metric_mode), s, v if v.mask_shift == 0 else None), extends=extends))
    for other in (*AGG_MODES, "response_length"):
        if other == mode and other == metric_mode:
            continue
        what = (f"a {other} aggregation" if other != "response_length" else
                "per-sample means over the response length instead of the loss tokens")
        out.append(Hypothesis(stage=STAGE, id=f"loss.agg_{other}", detail=f"the recorded loss fields equal {what} "
                              f"(config: {mode})", values=values_of(
                                  _fields(ctx, li, sums[0], other), None, None, _fields(ctx, li, recorded, other),
                                  _weights(ctx, other, sums[0]) * float(cfg.loss_scale))))
    return out + micro_batch_hypotheses(ctx, fields)
