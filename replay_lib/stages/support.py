"""``logprob.support``: sample-support scoring (SPEC §7) — invariants of the recorded support rows, and
``logp_S(y)`` recomputed from the member logits against the log-probs the trainer consumed.

Payloads (per-token, packed over Σ response_length in index order):

* ``support_ids``        int32 ``[Σ T, K]``, right-padded with −1 (an all-padding row = no support)
* ``support_logits``     float32 ``[Σ T, K]``: member logits (or full-vocab log-probs) at those ids
* ``sampled_token_ids``  int64/int32 ``[Σ T]``
* ``full_log_probs``     float32 ``[Σ T]`` (optional): the recorded full-vocabulary value, used for the one
  loss-bearing token per trajectory that may lack support (the appended EOS)
* ``routed_experts``     int ``[Σ T, layers, topk]`` (optional; needs ``config.num_experts``)
* ``cp_shard``           int ``[Σ T]`` (optional): the context-parallel rank that held each token

Config: ``vocab_size`` (required: the id range), ``num_experts`` (with ``routed_experts``) and
``support_scored``: the recorded log-prob payloads the trainer scored over this support (default: every
recorded one of ``log_probs``, ``old_log_probs``, ``ref_log_probs``). Each is compared on the loss-bearing
tokens whose row is sound: ``logp_S`` where the row has members, ``full_log_probs`` for the allowed EOS.

Context parallelism: a sample record is always one whole trajectory — the producer joins its CP shards
(after the CP all-gather) before writing — and ``cp_shard`` only records provenance. The "at most one
unsupported token, and only as the last" rule is therefore evaluated over the whole trajectory and can't
be satisfied shard by shard. With ``identity.rank.cp > 1`` the runner refuses the GRPO stages but runs
``sample`` and ``logprob.support`` (``--stage logprob.support``). Contract: ``recompute`` when
``support_logits`` is recorded, ``inspect-only`` when only the ids are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..bundle import BundleReader
import msgspec

from ..judge.compare import Comparison
from ..judge.error_model import C_STORE, C_TOKEN, U32, storage_unit
from ..judge.fields import PER_TOKEN
from ..judge.report import STATUS_FAIL, Divergence, StageReport
from ..bundle.schema import RecomputeConfig, StageId
from ..kernels.support import (
    SUPPORT_PAD,
    SupportRows,
    check_routed_experts,
    check_support_rows,
    support_logprobs,
    unsupported_violations,
)
from .base import StageContext, StageDef, StageInputError

STAGE = StageId.LOGPROB_SUPPORT.value

# Recorded log-prob payload → divergence field of its support rescoring.
SCORED_FIELDS = {
    "log_probs": "support_logprob",
    "old_log_probs": "support_old_logprob",
    "ref_log_probs": "support_ref_logprob",
}
# Per-token payloads this stage aligns with the response tokens.
SUPPORT_TOKEN_PAYLOADS = (
    "support_ids", "support_logits", "sampled_token_ids", "full_log_probs", "routed_experts", "cp_shard",
)

# Invariant fields, in the order they are listed for one token.
FIELD_ORDER = (
    "support_id_range", "support_padding", "support_duplicate", "sampled_id_range", "sampled_not_in_support",
    "unsupported_token", "full_log_probs", "routed_experts", "cp_shard",
)


def scored_sources(reader: BundleReader) -> list[str]:
    """Recorded log-prob payloads the support rescoring is compared with."""
    cfg = reader.index.config
    if cfg.support_scored is not None:
        return list(cfg.support_scored)
    return [name for name in SCORED_FIELDS if reader.has_payload(name)]


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


@dataclass(frozen=True)
class SupportTokens:
    """What ``logprob.support`` found, per token of one shard (all ``[Σ T]`` unless noted): left in
    ``ctx.records["support"]`` by the stage for a view of single tokens (the debugger's support strip)."""

    ids: torch.Tensor  # [Σ T, K] int, right-padded with −1
    logits: torch.Tensor  # [Σ T, K] float
    sampled: torch.Tensor  # int64
    full: Optional[torch.Tensor]  # float32 full-vocabulary log-probs, when recorded
    rows: SupportRows
    loss: torch.Tensor  # bool: loss-bearing
    actual: torch.Tensor  # float32: logp_S where the row has members, else the recorded full-vocab value
    compared: torch.Tensor  # bool: tokens whose value the stage compares
    allowed_eos: torch.Tensor  # bool: the one loss-bearing last token per trajectory allowed without support
    invariants: dict[str, torch.Tensor]  # divergence field → bool flags (only fields with a flag)

    @property
    def violation(self) -> torch.Tensor:
        out = torch.zeros_like(self.loss)
        for flags in self.invariants.values():
            out |= flags
        return out


class _Violations:
    """Invariant violations, counted in full but materialized only for the first ``keep`` tokens."""

    def __init__(self, ctx: StageContext):
        self.ctx = ctx
        self.count = 0
        self.by_field: dict[str, int] = {}
        self.found: list[tuple[int, int, Divergence]] = []
        self.flags: dict[str, torch.Tensor] = {}  # field → every flagged token

    def add(self, field: str, flags: torch.Tensor,
            describe: Callable[[int], tuple[str, Optional[float], Optional[float]]]) -> None:
        idx = torch.nonzero(flags).reshape(-1)
        if idx.numel() == 0:
            return
        self.flags[field] = self.flags[field] | flags if field in self.flags else flags.clone()
        self.count += int(idx.numel())
        self.by_field[field] = self.by_field.get(field, 0) + int(idx.numel())
        order = FIELD_ORDER.index(field)
        for t in idx[: self.ctx.keep].tolist():
            message, expected, actual = describe(t)
            s = int(self.ctx.seg[t])
            self.found.append((t, order, Divergence(
                stage=STAGE, rank=self.ctx.rank, sample_id=self.ctx.sample_ids[s],
                group_index=self.ctx.group_indices[s], field=field, token_offset=t - int(self.ctx.offsets[s]),
                expected=expected, actual=actual,
                abs_error=abs(actual - expected) if expected is not None and actual is not None else None,
                message=message,
            )))

    def divergences(self) -> list[Divergence]:
        return [d for _, _, d in sorted(self.found, key=lambda x: (x[0], x[1]))][: self.ctx.keep]

    def flags_union(self, like: torch.Tensor) -> torch.Tensor:
        """bool per token: any invariant broken there."""
        out = torch.zeros_like(like, dtype=torch.bool)
        for flags in self.flags.values():
            out |= flags
        return out

    def summary(self) -> str:
        return ", ".join(f"{f} ×{self.by_field[f]}" for f in FIELD_ORDER if f in self.by_field)


def _row_count_divergences(ctx: StageContext) -> list[Divergence]:
    """One row per response token: a payload with another row count can't be aligned with the samples."""
    out = []
    samples = ctx.reader.index.samples
    total = ctx.full_total
    for name in SUPPORT_TOKEN_PAYLOADS:
        if not ctx.has(name):
            continue
        t = ctx.reader.payload(name)
        rows = int(t.shape[0]) if t.dim() else 0
        if rows == total:
            continue
        sid = grp = off = None
        if rows < total:  # the first response token that has no row
            start = 0
            for s in samples:
                n = max(s.response_length, 0)
                if rows < start + n:
                    sid, grp, off = s.sample_id, s.group_index, rows - start
                    break
                start += n
            where = f"{sid}@{off} onward has no row"
        else:
            where = f"{rows - total} extra row(s) after the last response token"
        out.append(Divergence(
            stage=STAGE, rank=ctx.rank, sample_id=sid, group_index=grp, field="support_rows", token_offset=off,
            expected=float(total), actual=float(rows), abs_error=float(abs(rows - total)),
            message=f"payload {name!r} has {rows} row(s) for Σ response_length {total} ({where})",
        ))
    return out


def _token_payload(ctx: StageContext, name: str, dims: int, kind: str) -> torch.Tensor:
    t = ctx.payload(name)
    if t.dim() != dims:
        raise StageInputError(f"payload {name!r} must have {dims} dimension(s), got shape {list(t.shape)}", field=name)
    if kind == "int" and not _is_integer(t):
        raise StageInputError(f"payload {name!r} must hold integer ids, got {t.dtype}", field=name)
    if kind == "float" and not t.dtype.is_floating_point:
        raise StageInputError(f"payload {name!r} must be floating point, got {t.dtype}", field=name)
    return t


def run_logprob_support(ctx: StageContext) -> StageReport:
    cfg = ctx.config
    vocab = cfg.vocab_size
    if vocab is None:
        raise StageInputError("index.json $.config.vocab_size is required: the support id range check needs the "
                              "vocabulary size", field="vocab_size")
    sources = scored_sources(ctx.reader)
    if not sources:
        raise StageInputError("no recorded log-probs to compare: the bundle has none of "
                              + ", ".join(SCORED_FIELDS), field="log_probs")
    row_divs = _row_count_divergences(ctx)
    if row_divs:
        ctx.records["support_unusable"] = row_divs[0].message
        return StageReport(stage=STAGE, status=STATUS_FAIL, reason=row_divs[0].message, mismatches=len(row_divs),
                           divergences=row_divs[: ctx.keep], compared=0)

    ids = _token_payload(ctx, "support_ids", 2, "int")
    logits = _token_payload(ctx, "support_logits", 2, "float")
    sampled = _token_payload(ctx, "sampled_token_ids", 1, "int").to(torch.int64)
    if logits.shape != ids.shape:
        raise StageInputError(f"payload 'support_logits' has shape {list(logits.shape)}, support_ids has "
                              f"{list(ids.shape)}", field="support_logits")
    rows = check_support_rows(ids, sampled, vocab)
    loss = ctx.loss_mask != 0
    unsupported = loss & ~rows.has_support
    violating, counts = unsupported_violations(unsupported, ctx.lengths)
    not_in_row = loss & rows.has_support & ~rows.sampled_in_row
    cp_shard = _token_payload(ctx, "cp_shard", 1, "int") if ctx.has("cp_shard") else None
    full = _token_payload(ctx, "full_log_probs", 1, "float").to(torch.float32) if ctx.has("full_log_probs") else None
    allowed_unsupported = unsupported & ~violating

    v = _Violations(ctx)

    def row_text(t: int) -> str:
        return "[" + ", ".join(str(x) for x in ids[t].tolist()) + "]"

    def id_range(t: int):
        row = ids[t].tolist()
        k, bad = next((k, x) for k, x in enumerate(row) if x < SUPPORT_PAD or x >= vocab)
        return f"support id {bad} at slot {k} is outside [-1, vocab_size={vocab})", None, float(bad)

    def padding(t: int):
        row = ids[t].tolist()
        k = row.index(SUPPORT_PAD)
        k2 = next(j for j in range(k + 1, len(row)) if row[j] != SUPPORT_PAD)
        return (f"padding (-1) at slot {k} precedes id {row[k2]} at slot {k2}; padding must be trailing "
                f"{row_text(t)}"), None, None

    def duplicate(t: int):
        row = [x for x in ids[t].tolist() if x >= 0]
        dup = next(x for x in row if row.count(x) > 1)
        return f"member id {dup} appears {row.count(dup)} times in the row {row_text(t)}", None, float(dup)

    def sampled_range(t: int):
        y = int(sampled[t])
        return f"sampled token id {y} is outside [0, vocab_size={vocab})", None, float(y)

    def not_in(t: int):
        y = int(sampled[t])
        return f"sampled token {y} is not in its support row {row_text(t)}", None, float(y)

    def shard_of(t: int) -> str:
        return f" [cp shard {int(cp_shard[t])}]" if cp_shard is not None else ""

    def unsupported_text(t: int):
        s = int(ctx.seg[t])
        start, n = int(ctx.offsets[s]), int(ctx.lengths[s])
        offs = torch.nonzero(unsupported[start:start + n]).reshape(-1).tolist()
        where = ", ".join(f"{o}{shard_of(start + o)}" for o in offs)
        return (f"{len(offs)} loss-bearing token(s) of trajectory {ctx.sample_ids[s]} have no support row "
                f"(offsets {where}); at most one is allowed, and only as the last token {n - 1} (the appended EOS)",
                None, float(int(counts[s])))

    v.add("support_id_range", rows.id_out_of_range, id_range)
    v.add("support_padding", rows.padding_not_trailing & ~rows.id_out_of_range, padding)
    v.add("support_duplicate", rows.duplicate, duplicate)
    v.add("sampled_id_range", rows.sampled_out_of_range, sampled_range)
    v.add("sampled_not_in_support", not_in_row & ~rows.sampled_out_of_range, not_in)
    v.add("unsupported_token", violating, unsupported_text)
    if full is None:
        v.add("full_log_probs", allowed_unsupported, lambda t: (
            "loss-bearing token without support needs its recorded full-vocabulary log-prob; the bundle has no "
            "full_log_probs payload", None, None))
    if ctx.has("routed_experts"):
        _check_experts(ctx, v)
    if cp_shard is not None:
        cp = int(ctx.reader.index.identity.rank.get("cp", 1))
        v.add("cp_shard", (cp_shard < 0) | (cp_shard >= cp), lambda t: (
            f"cp_shard {int(cp_shard[t])} is outside [0, identity.rank.cp={cp})", None, float(int(cp_shard[t]))))

    # Value check: loss-bearing tokens whose row is structurally sound.
    sound = ~(rows.id_out_of_range | rows.padding_not_trailing | rows.duplicate | rows.sampled_out_of_range)
    scored = loss & sound & rows.has_support & rows.sampled_in_row
    fallback = allowed_unsupported if full is not None else torch.zeros_like(loss)
    compared = scored | fallback
    logp_s = support_logprobs(ids, logits, sampled, rows)
    actual = torch.where(rows.has_support, logp_s, full if full is not None else logp_s)
    n_compared = int(compared.sum())
    ctx.records["support"] = SupportTokens(ids=ids, logits=logits, sampled=sampled, full=full, rows=rows, loss=loss,
                                           actual=actual, compared=compared, allowed_eos=allowed_unsupported,
                                           invariants=dict(v.flags))

    violation = v.flags_union(loss)
    bound = _support_bound(ctx, ids, logits, actual) if not ctx.rules.exact else None
    fields = []
    for source in sources:
        recorded = _token_payload(ctx, source, 1, "float")
        # a log-prob payload stored coarser than the compute: one rounding of the producer's value more
        u_own = storage_unit(ctx.precision.compute, recorded)
        own = bound + actual.to(torch.float64).abs().nan_to_num(0.0) * u_own if bound is not None and u_own else bound
        fields.append(ctx.field(STAGE, SCORED_FIELDS.get(source, f"support_{source}"), PER_TOKEN,
                                recorded.to(torch.float32), actual, compared=compared, flagged=violation, bound=own))

    def fail_reason(total: Comparison, per: dict[str, Comparison]) -> str:
        bad_fields = [f"{source} ({cmp.mismatches} token(s) of {cmp.bad_samples} sample(s))"
                      for source, cmp in zip(sources, per.values()) if cmp.mismatches]
        if not v.count:
            return f"support log-prob mismatch in {', '.join(bad_fields)}"
        reason = f"support invariants broken at {v.count} place(s): {v.summary()}"
        if bad_fields:
            reason += f"; support log-prob mismatch in {', '.join(bad_fields)}"
        return reason

    fallback_n = int(fallback.sum())
    pass_reason = (f"{int(scored.sum())} loss-bearing token(s) rescored over the support against {', '.join(sources)}"
                   + (f"; {fallback_n} unsupported last token(s) use full_log_probs" if fallback_n else ""))
    found = Comparison(mismatches=v.count, divergences=v.divergences())
    report = ctx.report(StageId.LOGPROB_SUPPORT, fields, structural=found, fail_reason=fail_reason,
                        pass_reason=pass_reason)
    return msgspec.structs.replace(report, compared=n_compared)


def _support_bound(ctx: StageContext, ids: torch.Tensor, logits: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """The rounding bound of ``logp_S = (l_y − m) − log Σ_j exp(l_j − m)`` per token, for the producer's
    evaluation (its declared ``compute`` precision) and for this stage's own float32 one: the subtraction is
    off by ``u·|l_y − m| ≤ u·|logp_S|``, the sum of K terms in [1, K] by ``K·u`` relative, so its log by
    ``K·u`` absolute; ``8·(u_t + u32)·(|logp_S| + K)`` (see ``error_model``). Support logits stored coarser
    than the compute (``error_model.storage_unit``) add ``2·2·u_s·max_j|l_j|``: ``logp_S`` moves by at most
    twice the largest change of a member logit."""
    members = (ids >= 0).sum(1).to(torch.float64)
    bound = C_TOKEN * (ctx.precision.token + U32) * (actual.to(torch.float64).abs().nan_to_num(0.0) + members)
    u_logits = storage_unit(ctx.precision.compute, logits)
    if u_logits and logits.numel():
        member = logits.to(torch.float64).abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
        largest = torch.where(ids >= 0, member, torch.zeros_like(member)).amax(1)  # padding is no member
        bound += (2 * C_STORE * u_logits) * largest
    return bound


def _check_experts(ctx: StageContext, v: _Violations) -> None:
    routes = _token_payload(ctx, "routed_experts", 3, "int")
    experts = ctx.config.num_experts
    if experts is None:
        raise StageInputError("index.json $.config.num_experts is required to check the routed_experts payload",
                              field="num_experts")
    checked = check_routed_experts(routes, experts)

    def out_of_range(t: int):
        layer = int(checked.out_of_range_layer[t])
        row = routes[t, layer].tolist()
        bad = next(e for e in row if e < 0 or e >= experts)
        return f"layer {layer}: expert id {bad} is outside [0, num_experts={experts}) in {row}", None, float(bad)

    def repeated(t: int):
        layer = int(checked.duplicate_layer[t])
        row = routes[t, layer].tolist()
        dup = next(e for e in row if row.count(e) > 1)
        return f"layer {layer}: expert {dup} appears {row.count(dup)} times in {row}", None, float(dup)

    v.add("routed_experts", checked.out_of_range_layer >= 0, out_of_range)
    v.add("routed_experts", (checked.duplicate_layer >= 0) & (checked.out_of_range_layer < 0), repeated)


def _support_requirements(reader: BundleReader) -> list[str]:
    cfg = reader.index.config
    missing = [reader.payload_label(n) for n in ("support_ids", "support_logits", "sampled_token_ids")
               if not reader.has_payload(n)]
    if cfg.vocab_size is None:
        missing.append("index.json $.config.vocab_size")
    if reader.has_payload("routed_experts") and cfg.num_experts is None:
        missing.append("index.json $.config.num_experts")
    if cfg.support_scored is None:
        if not scored_sources(reader):
            missing.append("recorded log-probs ({}, {} or {})".format(
                *(reader.payload_label(n) for n in ("log_probs", "old_log_probs", "ref_log_probs"))))
    else:
        missing += [reader.payload_label(n) for n in cfg.support_scored if n in SCORED_FIELDS and not reader.has_payload(n)]
    return missing


def _support_refuse(cfg: RecomputeConfig) -> list[tuple[str, str]]:
    out = []
    if cfg.support_scored is not None:
        unknown = [n for n in cfg.support_scored if n not in SCORED_FIELDS]
        if unknown:
            out.append(("support_scored", f"{cfg.support_scored!r}: {', '.join(map(repr, unknown))} is not one of "
                                          f"{', '.join(SCORED_FIELDS)}"))
        elif not cfg.support_scored:
            out.append(("support_scored", "[]: names no recorded log-probs to compare"))
    if cfg.vocab_size is not None and cfg.vocab_size < 1:
        out.append(("vocab_size", f"{cfg.vocab_size}: must be positive"))
    if cfg.num_experts is not None and cfg.num_experts < 1:
        out.append(("num_experts", f"{cfg.num_experts}: must be positive"))
    return out


LOGPROB_SUPPORT = StageDef(
    id=StageId.LOGPROB_SUPPORT, run=run_logprob_support, needs=(StageId.SAMPLE,), refuse=_support_refuse,
    requirements=_support_requirements,
    description="sampled tokens rescored over the recorded sampler support; support-row invariants",
    any_cp=True, optional=True,
)
