"""``loss.policy``'s per-sample and per-token loss terms (SPEC §4): compared before the scalars, so a loss
divergence is located to its sample and token like any per-token stage.

A producer may record, per sample, ``expected.json $.loss.policy.per_sample`` = ``{pg_sum, entropy_sum, kl_sum,
clip_count, mask_count}`` — ``Σ_t x·mask`` of the clipped surrogate, the entropy and ``ppo_kl = old − logp``,
and ``Σ_t`` of the clip indicator and of the mask — and the payload ``pg_losses``, the per-token surrogate
before aggregation. :func:`loss_term_fields` recomputes them in float64 from the loss stage's own inputs (the
recorded log-probs, old log-probs, advantages, entropy and mask) and returns one :class:`FieldResult` per
recorded term (``per="sample"``) and for ``pg_losses`` (``per="token"``).

Tolerances. Each bound is what a legitimate producer's rounding can reach, computed alongside in float64 (the
constants are those of ``replay_lib.judge.error_model``: 8 for a per-token formula, 2 per addition). ``u_t`` is the
unit roundoff of the producer's per-token arithmetic (``producer_precision.compute``), ``u_a`` that of its
accumulation (``producer_precision.accumulate``; default float32/float32, SPEC §5.1):

* the log-ratio ``Δ = old − logp`` is off by at most ``e_Δ = u_t·|Δ|`` (its one rounding);
* a per-token term is off by at most ``8·(u_t·|pg|·3 + 2·|pg|·e_Δ)`` for the surrogate (``exp`` of a rounded
  log-ratio, the clamp bound, the product with the advantage), ``8·e_Δ`` for ``ppo_kl``, 0 for the entropy (a
  recorded value) — the ``8·u·cond`` rule of the per-token stages;
* payloads stored coarser than ``compute`` (a bf16 copy of float32 values: the producer computed from values the
  bundle no longer has; ``error_model.StorageUnits``) add ``2·|∂x|·e`` per token as the scalars do: ``e`` =
  ``u_s·(|old| + |logp|)`` for the log-ratio (and the importance weight's ``u_s·(|old| + |rollout|)``, the
  advantage's ``u_s``) in the surrogate, the log-ratio's for ``ppo_kl``, ``u_s·|entropy|``, and the KL term's
  ``e_r·max|dKL/dr|``; the clip decisions within ``2·e`` of a bound are open;
* a per-sample sum of ``n_i`` such terms adds at most ``2·u_a·n_i·Σ_t |x_t|·mask`` — the worst case of a
  sequential sum (a √n bound is not sound for sequential producers, which reach 10–160× it on constant data);
  a pairwise or tree sum does better, so this never refuses a legitimate order. The sum's bound is the
  per-token bounds summed plus that; the bundle's ``atol + rtol·|e|`` comes on top (``StageContext.field``);
* ``mask_count`` is a whole number compared exactly (no float rounding produces another count; the bundle's
  atol/rtol do not apply, so ``atol 1`` cannot hide a one-token mask bug);
* ``clip_count`` is compared as a whole number too, with a tolerance of the number of the sample's loss tokens
  with ``A ≠ 0`` whose float64 ratio lies within ``8·(u_t + e_Δ)`` (relative) of a clip bound ``1 − eps_clip``
  or ``1 + eps_clip_high``: only there can a producer's rounding flip ``l2 > l1``; elsewhere a count that
  differs is a different clip rule or mask. The ratio of counts is then the clip fraction, exactly;
* ``pg_losses``: per token, the surrogate's bound plus the bundle's tolerance; only loss tokens (mask ≠ 0) are
  judged — producers differ in what they leave at masked-out positions, and those never reach the loss.
* under ``--chain`` the advantages are recomputed, ``ρ_i`` off per sample (``advantage_bound``): the
  surrogate's per-token bound adds ``ρ_i·max(ratio, clamp(ratio))``, and a token with ``|A| ≤ ρ_i`` counts as
  one whose clip decision is open.

Measured on the independent producers of ``tests/producers`` with their per-sample terms (eight families ×
six configs × 8×16, 64×2,048 and 256×4,096 tokens, 144 clean bundles): none diverges, worst error 0.013 of the
tolerance. A mask shifted by one token is caught by ``mask_count`` in every sample of every family; the upper
clip bound used for the lower one by ``clip_count`` (and ``pg_sum``) in every float32/float64 family, not in
the bf16 ones, whose declared rounding (8·2⁻⁸ of the ratio) covers the ratios the bug moves; a global token
mean is not (its per-sample sums are right: the scalars catch it).

``--exact`` recomputes the per-token terms with the producer's float32 arithmetic (the formula of
``kernels.compute_policy_loss``), sums them in token order in the declared accumulation format, and compares
bitwise: the example trainer's bundles then match to the bit.

Everything is evaluated a chunk of tokens at a time (``LOSS_CHUNK``): no full-length float64 temporaries.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ..judge.error_model import (C_STORE, UNIT_ROUNDOFF, StorageUnits, kl_condition, kl_slope, sample_exponent_condition,
                           storage_unit)
from ..judge.fields import PER_SAMPLE, PER_TOKEN, FieldResult
from ..kernels import LOSS_CHUNK
from ..kernels.families import slice_tokens
from ..kernels.loss import LossKnobs, agg_weights, policy_token_terms, sample_log_terms
from ..bundle.schema import PER_SAMPLE_KEY, PerSampleLossTerms, RecomputeConfig
from .base import StageContext, StageInputError
from .loss_inputs import LossInputs

STAGE = "loss.policy"
TOKEN_SLACK = 8.0  # roundings of one per-token formula, with room
ACCUMULATE_SLACK = 2.0  # per addition of a sequential sum (the n_i·u bound, doubled)
TOKEN_TERMS_PAYLOAD = "pg_losses"


def recorded_terms(ctx: StageContext) -> Optional[PerSampleLossTerms]:
    terms = ctx.reader.expected.get(STAGE, {}).get(PER_SAMPLE_KEY)
    return terms if isinstance(terms, PerSampleLossTerms) and terms.recorded() else None


def has_loss_terms(ctx: StageContext) -> bool:
    """Whether the bundle records per-sample terms or the per-token ``pg_losses``."""
    return recorded_terms(ctx) is not None or ctx.has(TOKEN_TERMS_PAYLOAD)


def _precision(ctx: StageContext) -> tuple[str, str]:
    """``(compute, accumulate)`` as the bundle declares them (float32/float32 when it does not)."""
    declared = getattr(ctx.reader.manifest.comparison_policy, "producer_precision", None)
    if isinstance(declared, dict):
        compute, accumulate = declared.get("compute"), declared.get("accumulate")
    else:
        compute, accumulate = getattr(declared, "compute", None), getattr(declared, "accumulate", None)
    compute = compute if compute in UNIT_ROUNDOFF else "float32"
    accumulate = accumulate if accumulate in UNIT_ROUNDOFF else "float32"
    return str(compute), str(accumulate)


def _exact(ctx: StageContext) -> bool:
    """``--exact``: the producer's float32 arithmetic recomputed and compared bitwise."""
    return bool(getattr(getattr(ctx, "rules", None), "exact", False))


class _Tokens:
    """The loss stage's per-token inputs, evaluated a chunk at a time in ``dtype`` (float64; float32, the
    producer's kernels' arithmetic, under ``--exact``) with the configured knobs (``kernels.policy_token_terms``:
    dual-clip, GSPO, the importance weight) and handed out as float64 with their rounding bounds."""

    def __init__(self, log_probs, old_log_probs, advantages, entropy, mask, config: RecomputeConfig, *,
                 lengths: torch.Tensor, u_t: float, store: StorageUnits, dtype: torch.dtype = torch.float64,
                 advantage_bound: Optional[torch.Tensor] = None, rollout_log_probs: Optional[torch.Tensor] = None,
                 ref_log_probs: Optional[torch.Tensor] = None, teacher_log_probs: Optional[torch.Tensor] = None,
                 samples=None, family_tokens=None):
        self.log_probs, self.old, self.adv = log_probs, old_log_probs, advantages
        self.teacher = teacher_log_probs  # on-policy distillation's loss term (opd_placement="loss")
        self.entropy, self.mask = entropy, mask
        self.rollout, self.ref = rollout_log_probs, ref_log_probs
        self.family_tokens = family_tokens  # the family's own per-token payloads (clip_cov_mask)
        knobs = LossKnobs.of(config, samples)  # the samples: the micro-batch partition (KL-Cov's top-k)
        # the KL term of the loss per token only where its term (kl_loss_sum) can be recomputed
        self.knobs = knobs if knobs.kl_loss and ref_log_probs is not None else replace(knobs, kl_loss_coef=0.0)
        self.low = 1.0 - float(config.eps_clip)
        self.high = 1.0 + float(config.eps_clip_high)
        self.size = int(mask.numel())
        self.ends = torch.cumsum(lengths.to(torch.int64), 0)
        self.u_t, self.store, self.dtype = u_t, store, dtype
        self.rho = advantage_bound.to(torch.float64) if advantage_bound is not None else None
        self.sample_terms = sample_log_terms(log_probs, old_log_probs, rollout_log_probs, mask, lengths, self.knobs,
                                             dtype=dtype, entropy=entropy, advantages=advantages,
                                             family_tokens=family_tokens)
        if knobs.opsm:  # OPSM's sequence KL at its edge: its reach, as the stage's (stages.loss._opsm_reach)
            m = mask.to(torch.float64)
            anchor = rollout_log_probs if knobs.opsm_anchor == "rollout" else old_log_probs
            seg_all = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.to(torch.int64))
            count = torch.zeros(lengths.numel(), dtype=torch.float64).index_add_(0, seg_all, m).clamp_min(1.0)
            mag = (anchor.to(torch.float64).nan_to_num(nan=0.0).abs() + log_probs.to(torch.float64).abs()) * m
            self.opsm_reach = torch.zeros(lengths.numel(), dtype=torch.float64).index_add_(0, seg_all, mag) / count \
                * count.sqrt()
        # a per-sample exponent (GSPO's ratio, a sequence/geometric IS weight): its rounding, per sample
        self.sample_cond = sample_exponent_condition(log_probs, old_log_probs, rollout_log_probs, mask, lengths,
                                                     self.knobs)
        # payloads stored coarser than the declared compute: their rounding, per sample (GSPO, a sequence IS weight)
        self.sample_store = store.sample_errors(log_probs, old_log_probs, rollout_log_probs, mask, lengths,
                                                self.knobs) if store.any else None

    def _flips(self, t: dict, seg: torch.Tensor, e_delta: torch.Tensor) -> torch.Tensor:
        """The magnitude a mask may keep or drop within rounding at each token (OPSM's sequence KL against
        opsm_delta, an entropy against its threshold), as the stage's scalars admit it."""
        f64 = torch.float64
        out = torch.zeros_like(e_delta)
        open_ = torch.zeros_like(e_delta, dtype=torch.bool)
        if self.knobs.opsm:
            reach = TOKEN_SLACK * self.u_t * (1.0 + self.opsm_reach[seg])
            open_ |= ((t["opsm_seq_kl"].to(f64) - self.knobs.opsm_delta).abs() <= reach) & t["opsm_negative"]
        if self.knobs.entropy_mask:
            ent, thr = t["entropy"].to(f64), t["entropy_threshold"].to(f64)
            open_ |= (ent - thr).abs() <= (ent.abs() + thr.abs()) * TOKEN_SLACK * self.u_t
        if "pg_unmasked" in t:
            weight = t["is_weight"].to(f64) if "is_weight" in t else 1.0
            out += open_.to(f64) * t["pg_unmasked"].to(f64).abs() * weight
        return out

    def chunk(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """float64 per-token values of tokens ``[lo, hi)`` (the formula of ``kernels.policy_token_terms``) and
        their bounds (module docstring)."""
        seg = torch.searchsorted(self.ends, torch.arange(lo, hi, dtype=torch.int64), right=True)
        logp = self.log_probs[lo:hi].to(self.dtype)
        old = self.old[lo:hi].to(self.dtype)
        t = policy_token_terms(logp, old, self.adv[lo:hi], self.knobs, seg=seg, sample_terms=self.sample_terms,
                               rollout_log_probs=self.rollout[lo:hi] if self.rollout is not None else None,
                               ref_log_probs=self.ref[lo:hi] if self.knobs.kl_loss else None, dtype=self.dtype,
                               entropy=self.entropy[lo:hi] if self.entropy is not None else None,
                               teacher_log_probs=self.teacher[lo:hi] if self.teacher is not None else None,
                               family_tokens=slice_tokens(self.family_tokens, slice(lo, hi)))
        pg, ppo_kl, ratio = (t[k].to(torch.float64) for k in ("pg", "ppo_kl", "ratio"))
        adv = self.adv[lo:hi].to(self.dtype).to(torch.float64)
        clipped = t["clip"].to(torch.float64)
        lr = t["log_ratio"].to(torch.float64)
        e_delta = lr.abs().mul_(self.u_t)
        if self.sample_cond is not None:
            e_delta += self.sample_cond[seg] * self.u_t
        if "is_log_weight" in t and self.knobs.is_level == "token":
            e_delta += t["is_log_weight"].to(torch.float64).abs() * self.u_t
        out = {"pg": pg, "clipped": clipped, "ppo_kl": ppo_kl, "ratio": ratio, "adv": adv,
               "mask": self.mask[lo:hi].to(torch.float64), "e_delta": e_delta, "seg": seg,
               "pg_bound": pg.abs().mul_(TOKEN_SLACK).mul_(e_delta * 2.0 + 3.0 * self.u_t),
               "ppo_kl_bound": (ppo_kl.abs().mul_(self.u_t) + (e_delta - lr.abs().mul(self.u_t))) * TOKEN_SLACK}
        # payloads stored coarser than the declared compute (error_model.StorageUnits): C_STORE·|∂x|·e, as the scalars
        store = self.store.token_errors(self.knobs, seg, self.sample_store, self.log_probs[lo:hi], self.old[lo:hi],
                                        self.rollout[lo:hi] if self.rollout is not None else None,
                                        self.ref[lo:hi] if "kl_loss" in t else None) if self.store.any else None
        out["e_store"] = store["ratio"] if store else None
        if "edge_gap" in t:  # a policy-loss family's decision edges (kernels.families): its own near-edge test
            slack = (e_delta + self.u_t) * TOKEN_SLACK
            if store:
                slack = slack + store["ratio"] * C_STORE
            out["near_edge"] = t["edge_gap"].to(torch.float64) <= slack
            if "edge_open" in t:  # a decision that drops the term: the whole term is open at its edge
                w = t["is_weight"].to(torch.float64) if "is_weight" in t else 1.0
                out["pg_bound"] += out["near_edge"].to(torch.float64) * t["edge_open"].to(torch.float64) * w
        if "pg_err" in t:  # the family's own rounding scale of its surrogate
            w = t["is_weight"].to(torch.float64) if "is_weight" in t else 1.0
            out["pg_bound"] += t["pg_err"].to(torch.float64) * w * (e_delta * 2.0 + 3.0 * self.u_t) * TOKEN_SLACK
        if store:
            out["pg_bound"] += pg.abs().mul_(store["ratio"] + store["weight"] + self.store.advantage).mul_(C_STORE)
            out["ppo_kl_bound"] += store["log_ratio"] * C_STORE
        if "is_weight" in t and self.knobs.is_mode == "mask":  # a weight at an IcePop edge: kept or dropped
            raw = t["is_log_weight"].to(torch.float64)
            if self.knobs.is_log_clamp is not None:
                raw = raw.clamp(-self.knobs.is_log_clamp, self.knobs.is_log_clamp)
            raw = raw.exp()
            slack = e_delta.mul(TOKEN_SLACK).add(TOKEN_SLACK * self.u_t)
            if store:
                slack += store["weight"] * C_STORE
            near = torch.zeros_like(raw, dtype=torch.bool)
            for edge in (self.knobs.is_low, self.knobs.is_high):
                if edge is not None:
                    near |= (raw - edge).abs() <= raw * slack
            out["pg_bound"] += near.to(torch.float64) * t["pg_unweighted"].to(torch.float64).abs() * raw
        if self.knobs.opsm or self.knobs.entropy_mask:  # a keep/drop decision at its edge
            out["pg_bound"] += self._flips(t, seg, e_delta)
        if self.rho is not None:  # --chain: the advantage itself is a recomputed value, ρ off per sample
            rho = self.rho[seg]
            out["rho"] = rho
            scale = torch.maximum(ratio, ratio.clamp(self.low, self.high))
            if self.knobs.dual_clip:
                scale = torch.maximum(scale, torch.full_like(scale, float(self.knobs.eps_clip_c)))
            if "is_weight" in t:
                scale = scale * t["is_weight"].to(torch.float64)
            out["pg_bound"] += scale * rho
        if "kl_loss" in t:  # the KL term: 8·(u_t·cond + cond·|r|·u_t), and its inputs' storage error
            r = t["kl_r"].to(torch.float64)
            if self.knobs.kl_loss_input_clamp is not None:
                r = r.clamp(-self.knobs.kl_loss_input_clamp, self.knobs.kl_loss_input_clamp)
            cond = kl_condition(r, self.knobs.kl_loss_type)
            out["kl_loss"] = t["kl_loss"].to(torch.float64)
            out["kl_loss_bound"] = cond.mul_(r.abs() * self.u_t + self.u_t).mul_(TOKEN_SLACK)
            if store:
                out["kl_loss_bound"] += kl_slope(r, self.knobs.kl_loss_type, store["kl"]).mul_(store["kl"]).mul_(C_STORE)
            if self.knobs.kl_loss_ratio_weighted:  # kl·w: w·(kl's bound) + |kl·w|·(the ratio's rounding)
                out["kl_loss_bound"].mul_(ratio).add_(out["kl_loss"].abs() * (e_delta * 2.0 + 3.0 * self.u_t)
                                                     * TOKEN_SLACK)
                if store:
                    out["kl_loss_bound"] += out["kl_loss"].abs() * store["ratio"] * C_STORE
            if self.knobs.kl_loss_rollout_weighted:  # kl·w, w = exp(logp − rollout): as the ratio's, w's exponent
                w = t["kl_weight"].to(torch.float64)
                e_w = t["kl_weight_log"].to(torch.float64).abs() * self.u_t
                out["kl_loss_bound"].mul_(w).add_(out["kl_loss"].abs() * (e_w * 2.0 + 3.0 * self.u_t) * TOKEN_SLACK)
                if store:
                    out["kl_loss_bound"] += out["kl_loss"].abs() * store["kl_weight"] * C_STORE
        if self.entropy is not None:
            out["entropy"] = self.entropy[lo:hi].to(torch.float64)
            out["entropy_bound"] = out["entropy"].abs().mul_(C_STORE * self.store.entropy)
        return out

    def near_clip_bound(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        """Tokens whose clip decision a producer's rounding may flip: the ratio within its rounding of a bound
        (and a non-zero advantage: with A = 0 both sides are 0 and nothing is clipped)."""
        if "near_edge" in c:  # a policy-loss family: its own edges
            near = c["near_edge"].clone()
        else:
            slack = c["ratio"] * (c["e_delta"] + self.u_t).mul_(TOKEN_SLACK)
            if c["e_store"] is not None:
                slack += c["ratio"] * c["e_store"] * C_STORE
            near = ((c["ratio"] - self.low).abs() <= slack) | ((c["ratio"] - self.high).abs() <= slack)
            near &= c["adv"] != 0
        if "rho" in c:  # an advantage within its rounding of 0: its sign, and so the decision, is open
            near |= c["adv"].abs() <= c["rho"]
        return near


# per-sample term → its per-token value in a chunk's dict (the bound is ``<value>_bound``)
_TERMS = {"pg_sum": "pg", "entropy_sum": "entropy", "kl_sum": "ppo_kl", "kl_loss_sum": "kl_loss"}


def _per_sample(ctx: StageContext, tokens: _Tokens, names: list[str], u_a: float,
                accumulate: torch.dtype = torch.float64):
    """``(values, bounds)``: ``[samples]`` per recorded term, summed in token order a chunk at a time in
    ``accumulate`` (float64; the declared format under ``--exact``); a sum's bound is its per-token bounds
    summed plus ``2·u_a·n_i·Σ|x|·mask``, a count's the boundary tokens (clip) or 0 (mask)."""
    n = len(ctx.lengths)
    names = [k for k in names if k != "loss_weight"]  # not a sum over tokens: _weight_field
    values = {k: torch.zeros(n, dtype=accumulate) for k in names}
    token_bound = {k: torch.zeros(n, dtype=torch.float64) for k in names}
    magnitude = {k: torch.zeros(n, dtype=torch.float64) for k in names}
    for lo in range(0, tokens.size, LOSS_CHUNK):
        hi = min(lo + LOSS_CHUNK, tokens.size)
        c = tokens.chunk(lo, hi)
        seg = c["seg"]
        m = c["mask"]
        m_acc = m.to(accumulate)
        for name in names:
            if name == "mask_count":
                values[name].index_add_(0, seg, m_acc)
            elif name == "clip_count":
                values[name].index_add_(0, seg, c["clipped"].to(accumulate) * m_acc)
                token_bound[name].index_add_(0, seg, tokens.near_clip_bound(c).to(torch.float64) * (m != 0))
            else:
                value = _TERMS[name]
                values[name].index_add_(0, seg, c[value].to(accumulate) * m_acc)
                magnitude[name].index_add_(0, seg, (c[value] * m).abs_())
                token_bound[name].index_add_(0, seg, c[value + "_bound"] * m.abs())
    counts = ctx.lengths.to(torch.float64)
    return values, {name: token_bound[name].add_(magnitude[name] * counts * (ACCUMULATE_SLACK * u_a))
                    for name in names}


def _expected(ctx: StageContext, key: str, values: list) -> list:
    if len(values) != len(ctx.reader.index.samples):  # the reader refuses this; a bundle built in memory may not
        raise StageInputError(f"expected.json $.{STAGE}.{PER_SAMPLE_KEY}.{key} has {len(values)} value(s) for "
                              f"{len(ctx.reader.index.samples)} sample(s)", field=key)
    return [values[i] for i in ctx.indices] if ctx.partial else values


def loss_term_fields(ctx: StageContext, li: "LossInputs") -> list[FieldResult]:
    """The loss stage's per-token ``pg_losses`` field (when the bundle has the payload), then its per-sample
    fields (one per term ``expected.json $.loss.policy.per_sample`` records, in ``PER_SAMPLE_TERMS`` order),
    recomputed in float64 from the stage's own inputs; ``[]`` when the bundle records neither. Raises
    :class:`StageInputError` when a recorded term needs an input the bundle lacks (``entropy_sum`` without the
    ``entropy`` payload). ``li``: the loss stage's inputs (:class:`LossInputs`) — ``advantages`` a tensor, or
    anything sliced ``[lo:hi]`` into one (the lazy GRPO returns of ``--chain``); ``advantage_bound``: per sample, the rounding bound ``ρ_i`` of advantages that
    were recomputed rather than recorded (``--chain``): the surrogate's bounds add ``ρ_i·max(ratio,
    clamp(ratio))`` per token, and a token whose ``|A| ≤ ρ_i`` may be clipped either way."""
    terms = recorded_terms(ctx)
    has_tokens = ctx.has(TOKEN_TERMS_PAYLOAD)
    if terms is None and not has_tokens:
        return []
    compute, accumulate = _precision(ctx)
    exact = _exact(ctx)
    config, entropy, mask = ctx.config, li.entropy, li.mask
    tokens = _Tokens(li.log_probs, li.old_log_probs, li.advantages, entropy, mask, config, lengths=ctx.lengths,
                     samples=ctx.samples,
                     u_t=UNIT_ROUNDOFF[compute], store=li.storage(compute),
                     dtype=torch.float32 if exact else torch.float64,
                     advantage_bound=None if exact else li.advantage_bound, rollout_log_probs=li.rollout_log_probs,
                     ref_log_probs=li.ref_log_probs, teacher_log_probs=li.teacher_log_probs,
                     family_tokens=li.family_tokens)
    u_a = UNIT_ROUNDOFF[accumulate]
    summed_in = torch.float32 if exact and accumulate == "float32" else torch.float64
    fields: list[FieldResult] = []
    recorded = terms.recorded() if terms is not None else {}
    if "entropy_sum" in recorded and entropy is None:
        raise StageInputError(f"expected.json $.{STAGE}.{PER_SAMPLE_KEY}.entropy_sum needs the payload 'entropy'",
                              field="entropy_sum")
    if "kl_loss_sum" in recorded and not tokens.knobs.kl_loss:
        raise StageInputError(f"expected.json $.{STAGE}.{PER_SAMPLE_KEY}.kl_loss_sum needs a KL term in the loss "
                              "(use_kl_loss with kl_loss_coef != 0) and the payload 'ref_log_probs'",
                              field="kl_loss_sum")
    if has_tokens:  # first: a surrogate that is wrong at a token is named at that token
        fields.append(_token_field(ctx, tokens))
    if recorded:
        values, bounds = _per_sample(ctx, tokens, list(recorded), u_a, summed_in)
        for name, raw in recorded.items():
            expected = _expected(ctx, name, raw)
            if name in ("mask_count", "clip_count"):
                fields.append(_count_field(ctx, name, expected, values[name], bounds[name]))
            elif name == "loss_weight":
                fields.append(_weight_field(ctx, expected, mask, LossKnobs.of(config)))
            else:
                fields.append(ctx.field(STAGE, name, PER_SAMPLE, expected, values[name], bound=bounds[name],
                                        note=_NOTES[name]))
    return fields


_NOTES = {
    "pg_sum": "Σ_t pg·mask per sample (pg: the clipped surrogate)",
    "entropy_sum": "Σ_t entropy·mask per sample",
    "kl_sum": "Σ_t (old − logp)·mask per sample",
    "clip_count": "loss tokens where the clipped branch was taken, per sample",
    "mask_count": "loss tokens per sample (Σ_t mask)",
    "kl_loss_sum": "Σ_t kl(logp, ref)·mask per sample (the KL term of the loss)",
    "loss_weight": "the weight of each sample's sums in the policy term (loss_scale·w_i of loss_agg_mode)",
}


def _weight_field(ctx: StageContext, expected: list, mask: torch.Tensor, knobs: LossKnobs) -> FieldResult:
    """``loss_weight`` per sample against ``loss_scale·w_i`` of the configured mode (``kernels.agg_weights``, with
    ``n_i`` the sample's loss tokens): one division and one product a producer rounds, ``2·u32·|w|``. It is the
    policy term's weight: ``kl_loss_agg_mode`` / ``entropy_agg_mode`` do not change it (the KL and entropy sums are
    checked through the aggregate of ``kl_loss_sum`` / ``entropy_sum`` under their own modes)."""
    n = torch.zeros(ctx.n, dtype=torch.float64).index_add_(0, ctx.seg, mask.to(torch.float64))
    actual = agg_weights(knobs.loss_agg_mode, n, knobs) * knobs.loss_scale
    return ctx.field(STAGE, "loss_weight", PER_SAMPLE, expected, actual,
                     bound=actual.abs() * (2.0 * UNIT_ROUNDOFF["float32"]), note=_NOTES["loss_weight"])


def _count_field(ctx: StageContext, name: str, expected: list, actual: torch.Tensor,
                 ambiguous: torch.Tensor) -> FieldResult:
    """A whole-number count, judged as one: its tolerance is the tokens whose count rounding may flip (0 for
    the mask), not the bundle's atol/rtol."""
    where = dict(sample_ids=ctx.sample_ids, group_indices=ctx.group_indices)
    return FieldResult(stage=STAGE, name=name, per=PER_SAMPLE, expected=expected, actual=actual,
                       tolerance=ambiguous, note=_NOTES[name], rank=ctx.rank, exact=_exact(ctx), **where)


def _token_field(ctx: StageContext, tokens: _Tokens) -> FieldResult:
    """``pg_losses`` per token: the recorded payload against the float64 surrogate, judged on loss tokens."""
    recorded = ctx.payload(TOKEN_TERMS_PAYLOAD)
    if recorded.dim() != 1:
        raise StageInputError(f"payload {TOKEN_TERMS_PAYLOAD!r} must be 1-D (one value per token), got shape "
                              f"{list(recorded.shape)}", field=TOKEN_TERMS_PAYLOAD)

    def actual(lo: int, hi: int) -> torch.Tensor:
        return tokens.chunk(lo, hi)["pg"]

    # the payload itself stored coarser than the compute: one more rounding of the producer's value
    u_own = storage_unit(ctx.precision.compute, recorded)

    def bound(lo: int, hi: int) -> torch.Tensor:
        c = tokens.chunk(lo, hi)
        return c["pg_bound"] + c["pg"].abs() * u_own if u_own else c["pg_bound"]

    return ctx.field(STAGE, TOKEN_TERMS_PAYLOAD, PER_TOKEN, recorded, actual, bound=bound,
                     compared=tokens.mask != 0, note="the per-token surrogate before aggregation (loss tokens)")


__all__ = ["UNIT_ROUNDOFF", "has_loss_terms", "loss_term_fields", "recorded_terms"]
