"""The debugger's model: what the panes render, built from a verified :class:`BundleSet` and the runner's
:class:`ReplayReport`. Pure data (torch + replay_lib only, no Textual), unit-tested without an App.

The report says *which* stage failed and keeps a few divergences; the panes also need every element of
the viewed field (the token diff, the per-sample mismatch marks). Those are the stages' own
:class:`~replay_lib.fields.FieldResult` objects: the model runs a stage adapter on a full
:class:`StageContext` (lazily, or reuses the replay's context) and reads ``ctx.fields`` — expected, actual,
tolerance and the bad mask exactly as the report judged them. It never re-derives a stage's values.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Iterable, Optional, Sequence

import numpy as np
from rich.cells import cell_len
import torch

from replay_lib.bundle import BundleReader, BundleSet
from replay_lib.compare import as_float64, list_tensor
from replay_lib.error_model import Rules, bundle_tolerance
from replay_lib.fields import PER_SCALAR, PER_TOKEN, FieldResult, noise_ratio
from replay_lib.gcpause import gc_paused
from replay_lib.kernels.loss import LossKnobs, agg_weights, sample_term
from replay_lib.inputs import ElementInputs, consumer_batch_labels, element_inputs, loss_scalar_inputs
from replay_lib.report import (STATUS_FAIL, STATUS_SKIPPED, ReplayReport, divergence_line, explanation_line, fmt_value,
                               tied_causes)
from replay_lib.runner import plan_stages
from replay_lib.safe_text import elided_listing, safe
from replay_lib.schema import CORE_KNOBS, StageId, config_changes
from replay_lib.schema import PER_SAMPLE_KEY, PER_SAMPLE_TERMS, PerSampleLossTerms
from replay_lib.selection import group_label
from replay_lib.stages import REGISTRY, StageContext, StageInputError
from replay_lib.stages.support import SCORED_FIELDS, SupportTokens, scored_sources
from replay_lib.support import SUPPORT_PAD, support_logprobs

# ------------------------------------------------------------------------------------------ fields

KIND_SAMPLE = "sample"  # one value per sample (a table of samples)
TREE_GROUP, TREE_SAMPLE = "group", "sample"  # the sample tree's row kinds
KIND_TOKEN = "token"  # one value per response token of the selected sample
KIND_COHORT = "cohort"  # one value per bundle (loss fields)
SUPPORT_STAGE = "logprob.support"


@dataclass(frozen=True)
class FieldSpec:
    name: str
    stage: str
    kind: str
    title: str
    sort: str = ""  # the diff viewer's default row order ("err": by |err|, largest first)


FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("raw_reward", "reward.raw", KIND_SAMPLE, "raw reward per sample"),
    FieldSpec("reward", "reward.post_process", KIND_SAMPLE, "normalized reward per sample"),
    FieldSpec("kl", "advantage.kl", KIND_TOKEN, "rollout-vs-reference KL per token"),
    FieldSpec("advantage", "advantage.estimate", KIND_TOKEN, "advantage per token"),
    FieldSpec("returns", "advantage.estimate", KIND_TOKEN, "returns per token (GAE: advantages + values)"),
    # logprob.support: one field per recorded log-prob payload the stage compares (log_probs first)
    FieldSpec("support_logprob", SUPPORT_STAGE, KIND_TOKEN, "recorded log_probs vs logp_S over the support"),
    FieldSpec("support_old_logprob", SUPPORT_STAGE, KIND_TOKEN, "recorded old_log_probs vs logp_S over the support"),
    FieldSpec("support_ref_logprob", SUPPORT_STAGE, KIND_TOKEN, "recorded ref_log_probs vs logp_S over the support"),
    FieldSpec("loss", "loss.policy", KIND_COHORT, "policy loss fields (cohort scalars)"),
    # loss.policy's per-token and per-sample terms (replay_lib.stages.loss_terms), when the bundle records them
    FieldSpec("pg_losses", "loss.policy", KIND_TOKEN, "per-token clipped surrogate (loss tokens)"),
    FieldSpec("pg_contribution", "loss.policy", KIND_SAMPLE,
              "each sample's term of pg_loss (w_i · pg_sum, the loss mode's weight)",
              sort="err"),
    *(FieldSpec(name, "loss.policy", KIND_SAMPLE, f"per-sample {name}") for name in PER_SAMPLE_TERMS),
)
FIELD_BY_NAME = {f.name: f for f in FIELDS}
# A stage's own field (what opening the stage shows): the first one listed for it.
FIELD_BY_STAGE = {f.stage: f for f in reversed(FIELDS)}
# Support field → the recorded payload it compares (the stage's own names, see replay_lib.stages.support).
SUPPORT_SOURCE = {field_name: source for source, field_name in SCORED_FIELDS.items()}
LOSS_TERM_FIELDS = ("pg_losses", *PER_SAMPLE_TERMS)
# Fields the model derives from a stage's fields (not compared by a stage; never counted as mismatches).
DERIVED_FIELDS = ("pg_contribution",)

def field_for_divergence(stage: str, field_name: str) -> Optional[str]:
    """The viewable field a report divergence belongs to (loss sub-fields → ``loss``)."""
    if field_name in FIELD_BY_NAME and FIELD_BY_NAME[field_name].stage == stage:
        return field_name
    spec = FIELD_BY_STAGE.get(stage)
    return spec.name if spec else None


def cohort_result(results: Iterable[FieldResult], name: str) -> Optional[FieldResult]:
    """The cohort table of a stage: every per-scalar field it compared, in the stage's order, as one result
    named ``name`` (loss.policy: the recorded scalars against the recorded per-sample terms' aggregation —
    ``pg_loss_from_terms`` — before the scalars against the recompute). ``None`` when it compared none."""
    scalars = [r for r in results if r.per == PER_SCALAR and r.length_mismatch is None]
    if len(scalars) <= 1:
        return scalars[0] if scalars else None
    own = next((r for r in scalars if r.name == name), scalars[-1])  # its note says what the values are
    labels = [label for r in scalars for label in (r.labels or [r.name] * r.size)]
    note = "; ".join([own.note, *(f"{r.name} rows: {r.note}" for r in scalars
                                  if r.note and r is not own)])
    return FieldResult(stage=own.stage, name=name, per=PER_SCALAR,
                       expected=torch.cat([r.expected for r in scalars]),
                       actual=torch.cat([r.actual for r in scalars]),
                       tolerance=torch.cat([r.tolerance for r in scalars]), labels=labels, note=note,
                       exact=own.exact, rank=own.rank)


# --------------------------------------------------------------------------------- per-field diff


class FieldDiff:
    """Rows of one field for the diff viewer: a sample's tokens, every sample, or the loss fields.

    ``labels`` is empty for token rows (the row index *is* the token offset). The values are kept as
    tensors; the viewer reads the rows it draws (:meth:`row`, converted a block at a time), so a
    32k-token sample costs its first frame nothing per token. ``expected`` / ``actual`` / ``abs_error``
    / ``bad`` are the whole columns as lists (converted on first use)."""

    BLOCK = 256

    def __init__(self, *, field: str, stage: str, kind: str, expected, actual, abs_error, bad,
                 mask: Optional[list[int]] = None, sample_id: Optional[str] = None,
                 labels: Optional[list[str]] = None, groups: Optional[list[str]] = None,
                 atol: float = 0.0, rtol: float = 0.0, note: str = "", tolerance=None) -> None:
        self.field, self.stage, self.kind = field, stage, kind
        self.expected_tensor = as_float64(expected)
        self.actual_tensor = as_float64(actual)
        self.error_tensor = as_float64(abs_error)
        self.bad_tensor = bad.detach().reshape(-1).to(torch.bool) if isinstance(bad, torch.Tensor) \
            else torch.tensor(list(bad), dtype=torch.bool)
        self.mask = mask
        self.sample_id = sample_id
        self.labels = labels if labels is not None else []
        self.groups = groups if groups is not None else []
        self.atol, self.rtol = atol, rtol  # the bundle's part of the tolerance (the header shows it)
        # the effective bound of each row (the bundle's atol + rtol·|e| plus the producer's rounding bound)
        self.tolerance_tensor: Optional[torch.Tensor] = as_float64(tolerance) if tolerance is not None else None
        self.note = note  # what the values are, when the table does not say it (the loss fields' sums)
        self.divergent: list[int] = torch.nonzero(self.bad_tensor).reshape(-1).tolist()
        self._blocks: dict[int, list[tuple[float, float, float, bool]]] = {}

    def row(self, i: int) -> tuple[float, float, float, bool]:
        """``(expected, actual, abs error, divergent)`` of row ``i``."""
        b, r = divmod(i, self.BLOCK)
        block = self._blocks.get(b)
        if block is None:
            lo, hi = b * self.BLOCK, (b + 1) * self.BLOCK
            block = self._blocks[b] = list(zip(self.expected_tensor[lo:hi].tolist(), self.actual_tensor[lo:hi].tolist(),
                                               self.error_tensor[lo:hi].tolist(), self.bad_tensor[lo:hi].tolist()))
        return block[r]

    def error_model_row(self, i: int) -> tuple[Optional[float], Optional[float]]:
        """``(tolerance, noise ratio)`` of row ``i`` (``(None, None)`` without tolerances), converted a block at
        a time like :meth:`row`: the viewer draws these two columns beside it on every cursor move."""
        if self.tolerance_tensor is None:
            return None, None
        b, r = divmod(i, self.BLOCK)
        block = self._error_model_blocks.get(b)
        if block is None:
            lo, hi = b * self.BLOCK, (b + 1) * self.BLOCK
            block = self._error_model_blocks[b] = list(zip(self.tolerance_tensor[lo:hi].tolist(),
                                                           self.noise_tensor[lo:hi].tolist()))
        return block[r]

    @functools.cached_property
    def _error_model_blocks(self) -> dict[int, list[tuple[float, float]]]:
        return {}

    @functools.cached_property
    def noise_tensor(self) -> Optional[torch.Tensor]:
        """``|a − e| / tolerance`` per row (NaN where a side is not finite); None without tolerances."""
        if self.tolerance_tensor is None:
            return None
        return noise_ratio(self.error_tensor, self.tolerance_tensor)

    @functools.cached_property
    def expected(self) -> list[float]:
        return self.expected_tensor.tolist()

    @functools.cached_property
    def actual(self) -> list[float]:
        return self.actual_tensor.tolist()

    @functools.cached_property
    def abs_error(self) -> list[float]:
        return self.error_tensor.tolist()

    @functools.cached_property
    def bad(self) -> list[bool]:
        return self.bad_tensor.tolist()

    def __len__(self) -> int:
        return self.expected_tensor.numel()

    @property
    def mismatches(self) -> int:
        return len(self.divergent)

    def label(self, row: int) -> str:
        return self.labels[row] if self.labels else str(row)

    def next_divergence(self, row: int, direction: int = 1) -> Optional[int]:
        """The next (``direction`` = 1) or previous (−1) divergent row strictly after/before ``row``."""
        if direction > 0:
            i = bisect.bisect_right(self.divergent, row)
            return self.divergent[i] if i < len(self.divergent) else None
        i = bisect.bisect_left(self.divergent, row)
        return self.divergent[i - 1] if i > 0 else None

    def error_profile(self, bins: int) -> list[tuple[float, bool]]:
        """``bins`` × ``(max |err| normalised to [0, 1], any divergence)`` along the row axis.

        Fewer rows than bins: each row spans several bins (the strip always fills its width). A
        non-finite element (NaN/Inf on either side) counts as the maximum error."""
        peaks, flagged, top = self.error_peaks(bins)
        scale = top if top > 0 else 1.0
        return [(min(p, scale) / scale, f) for p, f in zip(peaks, flagged)]

    def error_peaks(self, bins: int) -> tuple[list[float], list[bool], float]:
        """``(max |err| per bin, any divergence per bin, the largest finite |err|)`` along the row axis; a
        non-finite element (NaN/Inf on either side) is ``inf`` (the error plot draws it full height)."""
        n = len(self)
        if n == 0 or bins <= 0:
            return [], [], 0.0
        err = self.error_tensor
        top = float(err.max())  # a max propagates NaN: finite exactly when every element is
        if not math.isfinite(top):
            err = torch.where(torch.isnan(err) & self.bad_tensor, torch.full_like(err, float("inf")), err)
            err = torch.nan_to_num(err, nan=0.0, posinf=float("inf"))
            # the largest finite |err| (a where, not a boolean index: that costs ms on a 32k-token sample)
            top = float(torch.where(torch.isinf(err), torch.zeros_like(err), err).max())
        if bins >= n:
            rows = torch.arange(bins, dtype=torch.int64) * n // bins
            return err[rows].tolist(), self.bad_tensor[rows].tolist(), top
        # bin b draws the rows from row_of_bin(b) to the next bin's first: contiguous runs, none empty, each bin's
        # max one reduction over its run
        starts = [self.row_of_bin(b, bins) for b in range(bins)]
        peak = np.maximum.reduceat(err.numpy(), starts).tolist()
        flagged = torch.zeros(bins, dtype=torch.bool)
        flagged[torch.nonzero(self.bad_tensor).reshape(-1) * bins // n] = True
        return peak, flagged.tolist(), top

    def row_of_bin(self, b: int, bins: int) -> int:
        """The first row drawn in bin ``b`` (clicking the strip jumps there)."""
        n = len(self)
        if n == 0:
            return 0
        if bins >= n:
            return min(n - 1, b * n // bins)
        return min(n - 1, -(-b * n // bins))

    def bins_of_row(self, row: int, bins: int) -> range:
        """The bins that draw ``row`` (the cursor's marker on the strip)."""
        n = len(self)
        if n == 0:
            return range(0)
        if bins >= n:
            return range(-(-row * bins // n), -(-(row + 1) * bins // n))
        b = row * bins // n
        return range(b, b + 1)


# ------------------------------------------------------------------------------------ recompute


@dataclass
class ShardRecompute:
    """One rank shard recomputed over all its samples: per field the stage's :class:`FieldResult` and its
    float64 ``(expected, actual)`` columns.

    Lazy per field (:meth:`ensure`): building the model computes only the fields whose stage failed
    (they mark the samples); a passing field is computed the first time it is viewed."""

    reader: BundleReader
    ctx: StageContext
    ran: set[str] = field(default_factory=set)
    results: dict[str, FieldResult] = field(default_factory=dict)
    tolerances: dict[str, tuple[float, float]] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    loss_names: list[str] = field(default_factory=list)

    @property
    def rank(self) -> Optional[int]:
        return self.reader.rank

    # The columns of each computed field, read from its FieldResult (the one copy of them).
    @property
    def values(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {name: (r.expected, r.actual) for name, r in self.results.items()}

    @property
    def errors(self) -> dict[str, torch.Tensor]:
        return {name: r.abs_error for name, r in self.results.items()}

    @property
    def bad(self) -> dict[str, torch.Tensor]:
        return {name: r.divergent for name, r in self.results.items()}

    def ensure(self, name: str) -> bool:
        """Compute field ``name`` (and the stages it depends on) unless done; False if unavailable."""
        if name in self.results:
            return True
        if name in self.unavailable:
            return False
        spec = FIELD_BY_NAME[name]
        if spec.stage not in self.ran:
            self.unavailable[name] = "stage not run"
            return False
        try:
            self._compute(name)
        except StageInputError as exc:
            self.unavailable[name] = str(exc)
        return name in self.results

    def _run(self, stage: StageId) -> None:
        """Run a stage adapter once (after the stages it consumes), so ``ctx.fields`` holds exactly what the
        runner compared."""
        if stage.value in self.ran and stage.value not in self._done:
            for need in REGISTRY[stage].needs:
                self._run(need)
            self._done.add(stage.value)
            REGISTRY[stage].run(self.ctx)

    def _compute(self, name: str) -> None:
        if name == "pg_contribution":
            self._pg_contribution()
            return
        spec = FIELD_BY_NAME[name]
        stage = spec.stage
        self._run(StageId(stage))
        if spec.kind == KIND_COHORT:
            result = cohort_result(self.ctx.fields.get(stage, ()), name)
        else:
            result = next((f for f in self.ctx.fields.get(stage, ()) if f.name == name), None)
        if result is None:
            self.unavailable[name] = f"{stage} did not compare {name} on this bundle"
            return
        self._put(name, result)

    def _pg_contribution(self) -> None:
        """Each sample's term of pg_loss, ``loss_scale · w_i · pg_sum`` with ``w_i`` the configured mode's weight
        (``kernels.agg_weights``: ``1 / max(Σmask, 1)`` by default, ``1 / loss_token_count`` under token_mean, …),
        from loss.policy's ``pg_sum`` field (the recorded with the recorded mask count when there is one, the
        recomputed with the recomputed) with its tolerance scaled alike: a divergence of ``pg_sum`` is one here,
        now in pg_loss units, and the terms add up to the recomputed pg_loss."""
        if not self.ensure("pg_sum"):
            self.unavailable["pg_contribution"] = "the bundle records no per-sample pg_sum"
            return
        pg = self.results["pg_sum"]
        knobs = LossKnobs.of(self.ctx.config)
        mask = self.ctx.loss_mask.to(torch.float64)
        actual_mask = torch.zeros(len(self.ctx.samples), dtype=torch.float64).index_add_(0, self.ctx.seg, mask)
        expected_mask = self.results["mask_count"].expected if self.ensure("mask_count") else actual_mask
        mode = knobs.loss_agg_mode
        w_actual = agg_weights(mode, actual_mask, knobs) * knobs.loss_scale
        w_expected = agg_weights(mode, expected_mask, knobs) * knobs.loss_scale
        divisor, _ = sample_term(mode, 1.0, knobs)
        scale = f" × {knobs.loss_scale:g}" if knobs.loss_scale != 1 else ""
        result = FieldResult(stage=pg.stage, name="pg_contribution", per=pg.per, expected=pg.expected * w_expected,
                             actual=pg.actual * w_actual, tolerance=pg.tolerance * w_actual,
                             sample_ids=pg.sample_ids, group_indices=pg.group_indices, rank=pg.rank, exact=pg.exact,
                             note=f"pg_sum / {divisor}{scale} ({mode}): the sample's term of pg_loss")
        self._put("pg_contribution", result)

    def support_tokens(self) -> SupportTokens:
        """``logprob.support``'s per-token record of this shard, as the stage left it on the context (the
        stage runs here only when the replay did not run it on this context). Raises StageInputError when
        the support payloads are unusable."""
        if self._support_error is not None:  # unusable payloads: fail fast on every later cursor move
            raise self._support_error
        record = self.ctx.records.get("support")
        if record is None:
            try:
                self._run(StageId.LOGPROB_SUPPORT)
            except StageInputError as exc:
                self._support_error = exc
                raise
            record = self.ctx.records.get("support")
        if record is None:
            unusable = self.ctx.records.get("support_unusable", "the stage did not check the support rows")
            self._support_error = StageInputError(f"no per-token support record: {unusable}", field="support_ids")
            raise self._support_error
        return record

    def _put(self, name: str, result: FieldResult) -> None:
        if result.length_mismatch is not None:
            ne, na = result.length_mismatch
            self.unavailable[name] = f"expected {ne} value(s), recomputed {na}"
            return
        # materialized here, in the replay worker, not on the UI thread's first draw; a per-token field keeps its
        # judged chunks (a sample's rows are a window of them, token_rows) and only its divergent marks whole
        if result.per == PER_TOKEN:
            result.divergent  # noqa: B018
        else:
            result.expected, result.actual, result.abs_error, result.divergent  # noqa: B018
        self.results[name] = result
        self.tolerances[name] = bundle_tolerance(self.reader.manifest.comparison_policy, result.stage, name,
                                                 self.ctx.rules.tolerance_policy)
        if result.labels is not None:
            self.loss_names = list(result.labels)

    def __post_init__(self) -> None:
        self._done: set[str] = set()
        self._support_error: Optional[StageInputError] = None


def rules_of(report: ReplayReport) -> Rules:
    """How ``report`` was judged, for recomputing its fields the same way."""
    return Rules(chain=report.mode == "chained", exact=report.exact, tolerance_policy=report.tolerance_policy)


def stages_that_ran(report: Optional[ReplayReport], shard: BundleReader) -> set[str]:
    """Stages the report compared (pass/fail); without a report, what a full replay would run."""
    if report is not None:
        return {s.stage for s in report.stages if s.status != STATUS_SKIPPED}
    return {s.value for s in plan_stages(shard, None, partial=False).run}


def recompute_shard(shard: BundleReader, ran: Iterable[str], fields: Iterable[str] = (),
                    ctx: Optional[StageContext] = None, rules: Rules = Rules()) -> ShardRecompute:
    """A lazily recomputed shard; ``fields`` are computed now. ``ctx``: the runner's context of this
    shard, whose completed stages are not run again (used when it covers every sample); otherwise a fresh
    context judged by ``rules`` (the replay's: teacher forcing or --chain, --exact, --tolerance-policy)."""
    reuse = ctx is not None and not ctx.partial
    if not reuse:
        ctx = StageContext(reader=shard, indices=list(range(len(shard.index.samples))), partial=False, keep=1,
                           rules=rules)
    out = ShardRecompute(reader=shard, ctx=ctx, ran=set(ran))
    if reuse:
        out._done.update(ctx.completed)
    if SUPPORT_STAGE in out.ran:
        # known without computing: a support field exists only for the payloads the stage compares
        scored = scored_sources(shard)
        for name, source in SUPPORT_SOURCE.items():
            if source not in scored:
                out.unavailable[name] = f"{source} is not scored over the support in this bundle"
    if "loss.policy" in out.ran:
        # known without computing: a loss term field exists only for what the bundle records
        terms = shard.expected.get("loss.policy", {}).get(PER_SAMPLE_KEY)
        recorded = terms.recorded() if isinstance(terms, PerSampleLossTerms) else {}
        for name in LOSS_TERM_FIELDS:
            if name not in recorded and not (name == "pg_losses" and shard.has_payload("pg_losses")):
                out.unavailable[name] = f"the bundle records no {name}"
        if "pg_sum" not in recorded:
            out.unavailable["pg_contribution"] = "the bundle records no per-sample pg_sum"
    if "advantage.estimate" in out.ran and not shard.has_payload("returns"):
        out.unavailable["returns"] = "the bundle records no returns (GAE's)"  # known without computing
    for name in fields:
        out.ensure(name)
    return out


# ------------------------------------------------------------------------------- sample support


@dataclass(frozen=True)
class SupportRow:
    """The recorded support of one response token, for the support strip under the diff rows.

    ``ids``/``logits``/``probs`` list the members (slots with an id ≥ 0) in recorded slot order; ``probs``
    are the renormalized probabilities ``exp(logp_S(member))`` from the stage's kernel, so the sampled
    member's entry is ``exp(logp_S(y))``. ``issues`` are ``(stage field, text)`` pairs: the report's message
    where the report kept that divergence, else a short description of the broken invariant."""

    sample_id: str
    token_offset: int
    k: int  # slots per row (members + padding)
    ids: tuple[int, ...]
    logits: tuple[float, ...]
    probs: tuple[float, ...]
    sampled_id: int
    sampled_member: Optional[int]  # index into ``ids`` of the sampled token; None when it is not a member
    padding: int  # slots that are not members (−1 padding, or a negative id)
    loss_mask: int
    logp_s: float  # NaN without members or without the sampled token
    full_log_prob: Optional[float]
    eos: bool  # the one loss-bearing token of its trajectory allowed without support (the appended EOS)
    issues: tuple[tuple[str, str], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.ids

    def ranked(self) -> list[int]:
        """Member indices by logit, highest first (recorded order among equal logits)."""
        return sorted(range(len(self.ids)), key=lambda i: (-self.logits[i], i))

    def rank_of_sampled(self) -> Optional[int]:
        """1-based rank of the sampled member by logit."""
        if self.sampled_member is None:
            return None
        return self.ranked().index(self.sampled_member) + 1


def _row_issue_text(field_name: str, sup: SupportTokens, t: int, vocab: Optional[int]) -> str:
    row = sup.ids[t].tolist()
    y = int(sup.sampled[t])
    if field_name == "support_id_range":
        bad = next(x for x in row if x < SUPPORT_PAD or (vocab is not None and x >= vocab))
        return f"support id {bad} is outside [-1, vocab_size={vocab})"
    if field_name == "support_padding":
        return "padding (-1) precedes a member; padding must be trailing"
    if field_name == "support_duplicate":
        members = [x for x in row if x >= 0]
        dup = next(x for x in members if members.count(x) > 1)
        return f"member id {dup} appears {members.count(dup)} times in the row"
    if field_name == "sampled_id_range":
        return f"sampled token id {y} is outside [0, vocab_size={vocab})"
    if field_name == "sampled_not_in_support":
        return f"sampled token {y} is not in its support row"
    if field_name == "unsupported_token":
        return "loss-bearing token without support that is not its trajectory's one appended EOS"
    if field_name == "full_log_probs":
        return "token without support needs its full-vocabulary log-prob; the bundle has no full_log_probs"
    if field_name == "routed_experts":
        return "routed expert id out of range or repeated within a layer"
    if field_name == "cp_shard":
        return "cp_shard outside [0, identity.rank.cp)"
    return field_name


def support_row(shard: ShardRecompute, index: int, offset: int,
                report: Optional[ReplayReport] = None) -> SupportRow:
    """The support row of token ``offset`` of sample ``index`` (in the shard's index order). O(K): cheap
    enough to run on every cursor move, whatever the sample's length. Raises ``IndexError`` for an offset
    outside the sample and ``StageInputError`` for unusable support payloads."""
    ctx = shard.ctx
    n = int(ctx.lengths[index])
    if not 0 <= offset < n:
        raise IndexError(f"token offset {offset} outside sample {ctx.sample_ids[index]} ({n} token(s))")
    sup = shard.support_tokens()
    t = int(ctx.offsets[index]) + offset
    row_ids = sup.ids[t]
    member = row_ids >= 0
    ids = row_ids[member].to(torch.int64)
    logits = sup.logits[t][member].to(torch.float32)
    if ids.numel():
        # every member's logp_S with the stage's kernel: the row repeated once per member, each "sampled"
        m = ids.numel()
        logp = support_logprobs(ids[None, :].expand(m, m).contiguous(), logits[None, :].expand(m, m).contiguous(),
                                ids)
        probs = tuple(torch.exp(logp.to(torch.float64)).tolist())
    else:
        probs = ()
    y = int(sup.sampled[t])
    id_list = ids.tolist()
    sampled_member = id_list.index(y) if y in id_list else None
    sample_id = ctx.sample_ids[index]
    messages = {}
    if report is not None:
        stage = report.stage(SUPPORT_STAGE)
        for d in stage.divergences if stage is not None else ():
            if d.sample_id == sample_id and d.token_offset == offset and d.message and d.rank == shard.rank:
                messages.setdefault(d.field, d.message)
    issues = tuple((f, messages.get(f) or _row_issue_text(f, sup, t, ctx.config.vocab_size))
                   for f, flags in sup.invariants.items() if bool(flags[t]))
    return SupportRow(
        sample_id=sample_id, token_offset=offset, k=int(row_ids.numel()), ids=tuple(id_list),
        logits=tuple(logits.tolist()), probs=probs, sampled_id=y, sampled_member=sampled_member,
        padding=int((~member).sum()), loss_mask=int(ctx.loss_mask[t]), logp_s=float(sup.actual[t])
        if bool(sup.rows.has_support[t]) else float("nan"),
        full_log_prob=float(sup.full[t]) if sup.full is not None else None, eos=bool(sup.allowed_eos[t]),
        issues=issues,
    )


# ------------------------------------------------------------------------------------ the model


@dataclass(slots=True)
class SampleRow:
    sample_id: str
    shard: int  # index into ReplayModel.shards
    index: int  # index within the shard's samples
    rank: Optional[int]
    group_index: Optional[int]
    micro_batch_id: Optional[str]
    raw_reward: Optional[float]
    reward: Optional[float]
    response_length: int
    mismatches: dict[str, int]  # field → mismatching elements (only fields with some)
    compared: bool
    total_mismatches: int = 0


_NO_MISMATCH: dict[str, int] = {}  # shared by every row without a mismatch (never mutated)


class SampleRows(Sequence[SampleRow]):
    """The model's sample rows in tree order, each :class:`SampleRow` made on first access: a 4,096-sample
    step makes the few dozen rows the tree draws before its first frame, not 4,096 objects."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._blocks: list[tuple] = []
        self._ids: list[str] = []
        self._totals: list[int] = []
        self._made: dict[int, SampleRow] = {}

    def add_shard(self, si: int, records: Sequence, ids: list[str], picks: Optional[list[int]],
                  rank: Optional[int], diverging: dict[int, dict[str, int]], compared: bool, totals: list[int]) -> int:
        """Append shard ``si``'s rows (``ids``: every record's sample id, the reader's; ``picks``: its selected record
        indices, ``None`` for all); returns the first row's index."""
        start = len(self._ids)
        self._starts.append(start)
        self._blocks.append((start, si, records, picks, rank, diverging, compared, totals))
        if picks is None:
            self._ids += ids
            self._totals += totals
        else:
            self._ids += [ids[i] for i in picks]
            self._totals += [totals[i] for i in picks]
        return start

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(k)
        row = self._made.get(k)
        if row is None:
            start, si, records, picks, rank, diverging, compared, totals = \
                self._blocks[bisect.bisect_right(self._starts, k) - 1]
            i = picks[k - start] if picks is not None else k - start
            s = records[i]
            row = self._made[k] = SampleRow(s.sample_id, si, i, rank, s.group_index, s.micro_batch_id, s.raw_reward,
                                            s.reward, s.response_length, diverging.get(i, _NO_MISMATCH), compared,
                                            totals[i])
        return row

    @property
    def ids(self) -> list[str]:
        """Every row's sample id, in row order (no row is made)."""
        return self._ids

    @property
    def totals(self) -> list[int]:
        """Every row's mismatch count, in row order (no row is made)."""
        return self._totals


@dataclass(slots=True)
class GroupRow:
    rank: Optional[int]
    group_index: Optional[int]
    samples: Sequence[int]  # indices into ReplayModel.samples (a range when they sit together)
    diverging: int  # samples with at least one mismatch
    suffix: str = ""  # " · rank 1" in a cohort's tree

    @property
    def label(self) -> str:
        """``g-17`` (and the rank in a cohort): made when a row is drawn, not for each of a step's groups."""
        return (group_label(self.group_index) if self.group_index is not None else "(no group)") + self.suffix


# ReplayModel.group_row_of scans the groups this many times before it builds the sample → group table.
GROUP_SCANS = 8


class TreeRows(Sequence[tuple[str, int]]):
    """The sample tree's rows without a tuple per row: a group row, then its shown sample rows, found by
    bisecting the groups' first rows (a 4,096-sample step has 5,120 rows; the tree draws a screenful)."""

    def __init__(self, entries: list[tuple[int, tuple[int, ...]]], model: "ReplayModel") -> None:
        self._groups = [gi for gi, _ in entries]
        self._members = [members for _, members in entries]
        self._starts = list(itertools.accumulate((1 + len(m) for m in self._members), initial=0))
        self._model = model
        self._entry_of: Optional[dict[int, int]] = None

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(k)
        e = bisect.bisect_right(self._starts, k) - 1
        j = k - self._starts[e]
        return (TREE_GROUP, self._groups[e]) if j == 0 else (TREE_SAMPLE, self._members[e][j - 1])

    def index(self, row, start: int = 0, stop: Optional[int] = None) -> int:
        if self._entry_of is None:
            self._entry_of = {gi: e for e, gi in enumerate(self._groups)}
        kind, i = row
        gi = i if kind == TREE_GROUP else self._model.group_row_of(i) if kind == TREE_SAMPLE else None
        e = self._entry_of.get(gi) if gi is not None else None
        if e is not None:
            if kind == TREE_GROUP:
                k = self._starts[e]
            elif i in self._members[e]:
                k = self._starts[e] + 1 + self._members[e].index(i)
            else:
                k = -1
            if start <= k and (stop is None or k < stop):
                return k
        raise ValueError(f"{row!r} is not a row")

    def __contains__(self, row) -> bool:
        try:
            self.index(row)
        except (ValueError, TypeError):
            return False
        return True


@dataclass
class ReplayModel:
    report: ReplayReport
    name: str
    identity: list[tuple[str, str]]
    shards: list[ShardRecompute]
    samples: SampleRows
    groups: list[GroupRow]
    fields: list[str]  # viewable fields, FIELDS order
    unavailable: dict[str, str]
    # why the bundle set is not a verified whole (an incomplete cohort opened with --forensic), else None
    forensic: Optional[str] = None

    def __post_init__(self) -> None:
        # built with the model (in the replay worker), not by the first frame
        self.by_id = dict(zip(self.samples.ids, range(len(self.samples))))
        self._diffs: dict[tuple[Optional[str], str], FieldDiff] = {}
        self._all_rows = self._tree_rows(False, frozenset())
        self._group_scans = 0

    @functools.cached_property
    def group_of(self) -> dict[int, int]:
        """Sample row → its group's index in :attr:`groups`."""
        return {m: gi for gi, g in enumerate(self.groups) for m in g.samples}

    def group_row_of(self, sample_row: int) -> Optional[int]:
        """The index in :attr:`groups` of the group holding ``sample_row``: the first few found among the groups
        (the first frame places one sample: no table of thousands for it), then from :attr:`group_of`."""
        if "group_of" in self.__dict__ or self._group_scans >= GROUP_SCANS:
            return self.group_of.get(sample_row)
        self._group_scans += 1
        return next((gi for gi, g in enumerate(self.groups) if sample_row in g.samples), None)

    def tree_rows(self, diverging_only: bool, folded: AbstractSet[int]) -> "TreeRows":
        """The sample tree's rows: ``("group", group index)`` then its ``("sample", sample index)`` rows
        (none when folded), groups without a mismatch left out when ``diverging_only``."""
        return self._all_rows if not diverging_only and not folded else self._tree_rows(diverging_only, folded)

    def _tree_rows(self, diverging_only: bool, folded: AbstractSet[int]) -> "TreeRows":
        entries: list[tuple[int, tuple[int, ...]]] = []
        totals = self.samples.totals
        for gi, group in enumerate(self.groups):
            members = group.samples
            if diverging_only:
                members = tuple(m for m in members if totals[m])
                if not members:
                    continue
            entries.append((gi, () if gi in folded else members))
        return TreeRows(entries, self)

    # -- lookups ----------------------------------------------------------------------------------
    def sample(self, sample_id: str) -> Optional[SampleRow]:
        i = self.by_id.get(sample_id)
        return self.samples[i] if i is not None else None

    @property
    def multi_rank(self) -> bool:
        return len(self.shards) > 1

    def field_spec(self, name: str) -> FieldSpec:
        return FIELD_BY_NAME[name]

    def diverging_samples(self, field_name: Optional[str] = None) -> list[int]:
        if field_name is None:
            return [i for i, t in enumerate(self.samples.totals) if t]
        return [i for i, s in enumerate(self.samples) if s.mismatches.get(field_name, 0)]

    # -- diffs ------------------------------------------------------------------------------------
    def field_diff(self, field_name: str, sample_id: Optional[str] = None) -> FieldDiff:
        """Rows for the viewer: token fields need ``sample_id``; sample/cohort fields ignore it."""
        spec = FIELD_BY_NAME[field_name]
        key = (sample_id if spec.kind == KIND_TOKEN else None, field_name)
        diff = self._diffs.get(key)
        if diff is None:
            if len(self._diffs) > 64:
                self._diffs.clear()
            diff = self._build_diff(spec, sample_id)
            self._diffs[key] = diff
        return diff

    def _build_diff(self, spec: FieldSpec, sample_id: Optional[str]) -> FieldDiff:
        if spec.name not in self.fields:
            raise KeyError(f"field {spec.name!r} is not available: {self.unavailable.get(spec.name, 'stage skipped')}")
        if spec.kind == KIND_TOKEN:
            row = self.sample(sample_id) if sample_id is not None else None
            if row is None:
                raise KeyError(f"no sample {sample_id!r}")
            shard = self.shards[row.shard]
            if not shard.ensure(spec.name):
                raise KeyError(f"field {spec.name!r} is not available: {shard.unavailable[spec.name]}")
            return token_rows(shard, row.index, spec.name)
        ready = [sh for sh in self.shards if sh.ensure(spec.name)]
        if not ready:
            why = next(iter(sh.unavailable.get(spec.name) for sh in self.shards), "not recomputed")
            raise KeyError(f"field {spec.name!r} is not available: {why}")
        if spec.kind == KIND_SAMPLE:
            # one row per sample the model shows (a partial selection shows its group closure only)
            rows = {i: list_tensor([r.index for r in self.samples if r.shard == i], torch.int64)
                    for i, sh in enumerate(self.shards) if spec.name in sh.values}
            parts = [(i, self.shards[i]) for i in rows]
            e = torch.cat([sh.values[spec.name][0][rows[i]] for i, sh in parts])
            a = torch.cat([sh.values[spec.name][1][rows[i]] for i, sh in parts])
            err = torch.cat([sh.errors[spec.name][rows[i]] for i, sh in parts])
            bad = torch.cat([sh.bad[spec.name][rows[i]] for i, sh in parts])
            tol = torch.cat([sh.results[spec.name].tolerance[rows[i]] for i, sh in parts])
            labels, groups = [], []
            for i, sh in parts:
                records = sh.reader.index.samples
                for j in rows[i].tolist():
                    labels.append(records[j].sample_id)
                    groups.append(group_label(records[j].group_index))
            atol, rtol = parts[0][1].tolerances[spec.name]
            return FieldDiff(field=spec.name, stage=spec.stage, kind=spec.kind, expected=e, actual=a,
                             abs_error=err, bad=bad, labels=labels, groups=groups, atol=atol, rtol=rtol,
                             tolerance=tol)
        parts = [sh for sh in self.shards if "loss" in sh.values]
        labels = []
        for sh in parts:
            suffix = f" [rank {sh.rank}]" if self.multi_rank and sh.rank is not None else ""
            labels += [f"{n}{suffix}" for n in sh.loss_names]
        e = torch.cat([sh.values["loss"][0] for sh in parts])
        a = torch.cat([sh.values["loss"][1] for sh in parts])
        err = torch.cat([sh.errors["loss"] for sh in parts])
        bad = torch.cat([sh.bad["loss"] for sh in parts])
        tol = torch.cat([sh.results["loss"].tolerance for sh in parts])
        atol, rtol = parts[0].tolerances["loss"]
        # pg_clipfrac 2.0 on two samples is no bug: say what the numbers are (the stage's own words: its mode)
        n = sum(len(sh.ctx.samples) for sh in parts)
        note = parts[0].results["loss"].note or ""
        if len(parts) > 1:
            note = f"per rank: {note} ({n} samples in all)"
        return FieldDiff(field="loss", stage=spec.stage, kind=KIND_COHORT, expected=e, actual=a,
                         abs_error=err, bad=bad, labels=labels, atol=atol, rtol=rtol, note=note, tolerance=tol)

    # -- sample support ---------------------------------------------------------------------------
    @property
    def has_support(self) -> bool:
        """Some shard records support rows (ids and member logits) and its logprob.support stage ran."""
        return any(SUPPORT_STAGE in sh.ran and sh.reader.has_payload("support_ids")
                   and sh.reader.has_payload("support_logits") for sh in self.shards)

    def support_row(self, sample_id: str, offset: int) -> SupportRow:
        """The support row of ``sample_id``'s token ``offset``. Raises ``KeyError`` for an unknown sample or a
        bundle without usable support rows, ``IndexError`` for an offset outside the sample."""
        row = self.sample(sample_id)
        if row is None:
            raise KeyError(f"no sample {sample_id!r}")
        shard = self.shards[row.shard]
        if SUPPORT_STAGE not in shard.ran:
            raise KeyError(f"{SUPPORT_STAGE} did not run on this bundle")
        try:
            return support_row(shard, row.index, offset, self.report)
        except StageInputError as exc:
            raise KeyError(f"no support row: {exc}") from None

    def element_inputs(self, field_name: str, sample_id: Optional[str], row: int) -> ElementInputs:
        """The inputs of the element at ``row`` of ``field_name``'s diff (a token of ``sample_id``, or a row
        of a per-sample table), from :func:`replay_lib.inputs.element_inputs` on the shard's context; a
        cohort (loss) row says what its scalar sums. Raises ``KeyError``/``IndexError``/``StageInputError``
        when there is no breakdown."""
        spec = FIELD_BY_NAME[field_name]
        if spec.kind == KIND_COHORT:
            diff = self.field_diff(field_name)
            label = diff.label(row)
            base, _, rank = label.partition(" [rank ")
            shard = next((sh for sh in self.shards if rank and str(sh.rank) == rank.rstrip("]")), self.shards[0])
            more = "f: pg_contribution lists each sample's term by |err|" if "pg_contribution" in self.fields else ""
            # the scalar's sums, weights and value (replay_lib.inputs), else what the row's own field compares
            found = loss_scalar_inputs(shard.ctx, base) if spec.stage == "loss.policy" else None
            if found is not None:
                return dataclasses.replace(found, formula=found.formula.replace(base, label, 1), note=more)
            note = next((r.note for r in shard.ctx.fields.get(spec.stage, ())
                         if r.per == PER_SCALAR and r.note and base in (r.labels or ())), None) or diff.note
            return ElementInputs(field=field_name, sample_id=None, offset=None,
                                 formula=f"{label}: {note or 'a cohort scalar'}{' · ' + more if more else ''}")
        if spec.kind == KIND_SAMPLE:
            sample_id = self.field_diff(field_name).labels[row]
        sample = self.sample(sample_id) if sample_id is not None else None
        if sample is None:
            raise KeyError(f"no sample {sample_id!r}")
        shard = self.shards[sample.shard]
        if field_name not in DERIVED_FIELDS and FIELD_BY_NAME[field_name].stage != "reward.raw":
            shard.ensure(field_name)  # the stages before it ran on the context (--chain's outputs are in place)
        return element_inputs(shard.ctx, field_name, sample.index, row if spec.kind == KIND_TOKEN else None)

    def consumer_batch(self, row: SampleRow) -> str:
        """``row``'s consumer batch as the why strip and the tree show it (``replay_lib.inputs``: recorded, ``~``
        by stream order, or ``—``)."""
        return consumer_batch_labels(self.shards[row.shard].ctx)[row.index]

    @functools.cached_property
    def has_micro_batches(self) -> bool:
        """Some sample records its micro-batch (the first one, usually: no scan of a step's records)."""
        return any(s.micro_batch_id is not None for sh in self.shards for s in sh.reader.index.samples)

    @functools.cached_property
    def consumer_batch_width(self) -> int:
        """Cells of the longest consumer batch label the tree shows (escaped; a few names per shard)."""
        return max((cell_len(safe(name)) for sh in self.shards for name in consumer_batch_labels(sh.ctx).names),
                   default=1)

    @functools.cached_property
    def has_consumer_batches(self) -> bool:
        """Some shard places its samples in consumer batches (recorded, or by stream order)."""
        return any(consumer_batch_labels(sh.ctx).recorded_any() for sh in self.shards)

    def sample_row_index(self, field_name: str, sample_id: str) -> Optional[int]:
        """Row of ``sample_id`` in a per-sample field's table."""
        diff = self.field_diff(field_name)
        try:
            return diff.labels.index(sample_id)
        except ValueError:
            return None


def token_rows(shard: ShardRecompute, index: int, field_name: str) -> FieldDiff:
    """One sample's slice of a per-token field: offset | expected | actual | abs err | loss mask."""
    ctx = shard.ctx
    start = int(ctx.offsets[index])
    n = int(ctx.lengths[index])
    result = shard.results[field_name]
    w = result.window(start, start + n)  # the sample's rows of the judged chunks: no copy of the whole field
    err = w.shown_error
    bad = shard.bad[field_name][start:start + n]
    sample = shard.reader.index.samples[index]
    atol, rtol = shard.tolerances[field_name]
    recorded = sample.loss_mask  # read, never written: a 32k-token sample's list is not copied
    mask = recorded if len(recorded) == n else recorded[:n] + [0] * max(0, n - len(recorded))
    return FieldDiff(field=field_name, stage=FIELD_BY_NAME[field_name].stage, kind=KIND_TOKEN,
                     expected=w.expected, actual=w.actual, abs_error=err, bad=bad, mask=mask,
                     sample_id=sample.sample_id, atol=atol, rtol=rtol, tolerance=w.tolerance)


def token_diff(bundles: BundleSet, sample_id: str, field_name: str, rules: Rules = Rules()) -> FieldDiff:
    """Expected / actual / abs-error / loss-mask arrays of one sample's per-token (or per-sample) field.

    Standalone: recomputes the shard holding ``sample_id`` as a full replay would. Raises ``KeyError``
    for an unknown sample or a field the bundle does not compare."""
    spec = FIELD_BY_NAME.get(field_name)
    if spec is None:
        raise KeyError(f"unknown field {field_name!r} (expected one of {', '.join(FIELD_BY_NAME)})")
    for shard in bundles.shards:
        for i, s in enumerate(shard.index.samples):
            if s.sample_id != sample_id:
                continue
            rec = recompute_shard(shard, stages_that_ran(None, shard), fields=[field_name], rules=rules)
            if field_name not in rec.values:
                raise KeyError(f"field {field_name!r} is not available: {rec.unavailable.get(field_name, 'stage not run')}")
            if spec.kind == KIND_TOKEN:
                return token_rows(rec, i, field_name)
            if spec.kind == KIND_SAMPLE:
                e, a = rec.values[field_name]
                err, bad = rec.errors[field_name][i:i + 1], rec.bad[field_name][i:i + 1]
                atol, rtol = rec.tolerances[field_name]
                return FieldDiff(field=field_name, stage=spec.stage, kind=KIND_SAMPLE, expected=e[i:i + 1],
                                 actual=a[i:i + 1], abs_error=err, bad=bad, labels=[sample_id],
                                 groups=[group_label(s.group_index)], atol=atol, rtol=rtol,
                                 tolerance=rec.results[field_name].tolerance[i:i + 1])
            raise KeyError(f"field {field_name!r} is cohort-level, not per sample")
    raise KeyError(f"no sample {sample_id!r} in bundle {bundles.bundle_id}")


def _cohort_ids(bundles: BundleSet, key: str) -> list:
    """An identity list of the whole cohort: every shard's values, in rank order, each once (a cohort's ranks
    hold their own partitions, consumer batches and micro-batches)."""
    seen: dict = {}
    for shard in bundles.shards:
        for v in getattr(shard.index.identity, key):
            seen.setdefault(v, None)
    return list(seen)


def identity_lines(bundles: BundleSet, report: ReplayReport,
                   contexts: Optional[Sequence[Optional[StageContext]]] = None) -> list[tuple[str, str]]:
    """``(label, value)`` rows of the identity pane: logical identity, physical provenance, producer
    (``contexts``: the shards' replay contexts, when there are)."""
    first = bundles.shards[0]
    ident = first.index.identity
    manifest = first.manifest
    n_samples = sum(len(s.index.samples) for s in bundles.shards)
    # a replay context over all of a shard's samples has its lengths and groups as columns already
    whole = [c if c is not None and not c.partial else None for c in (contexts or [None] * len(bundles.shards))]
    n_tokens = sum(int(c.lengths.sum()) if c is not None else
                   sum(r.response_length for r in s.index.samples if r.response_length > 0)
                   for s, c in zip(bundles.shards, whole))
    ids = {g for s in bundles.shards for g in s.index.identity.semantic_group_ids}
    groups = sorted(ids) if all(type(g) is int for g in ids) else sorted(
        ids, key=lambda g: (isinstance(g, str), g if isinstance(g, int) else 0, str(g)))
    # a cohort's ranks each normalize their own groups: count (rank, group) pairs
    n_groups = sum(len(set(c.group_indices)) if c is not None else len({r.group_index for r in s.index.samples})
                   for s, c in zip(bundles.shards, whole))
    wl = ident.weight_lineage
    cfg = first.index.config
    prod = manifest.producer
    redaction = ", ".join(f"{k}:{v}" for k, v in sorted(manifest.redaction.items())) or "none (no text fields)"
    ranks = " ".join(f"{k}={v}" for k, v in ident.rank.items())
    if bundles.cohort:
        ranks += f" · {len(bundles.shards)} shards"
    # validation warnings first: the pane may be too short to show its last rows
    rows = [("warning", w) for w in report.warnings] + [
        ("bundle", report.bundle_id),
        ("kind", f"{ident.kind}-level"),
        ("anchor", ident.anchor),
        ("format", manifest.format_version),
        ("producer", f"commit {prod.commit or '—'}" + (f" + patch {prod.dirty_patch_digest[:12]}"
                                                        if prod.dirty_patch_digest else "")),
        ("torch", prod.torch_version or "—"),
        ("samples", f"{n_samples} in {n_groups} group{'s' if n_groups != 1 else ''}"
                    + (f" ({len(groups)} ids × {len(bundles.shards)} ranks)" if n_groups != len(groups) else "")
                    + f", {n_tokens} tokens"),
        ("groups", elided_listing(groups, fmt=group_label)),
        ("cohorts", elided_listing(_cohort_ids(bundles, "normalization_cohort_ids"))),
        ("partitions", elided_listing(_cohort_ids(bundles, "rollout_partition_ids"))),
        ("consumer", elided_listing(_cohort_ids(bundles, "consumer_batch_ids"))),
        ("micro-batch", elided_listing(_cohort_ids(bundles, "micro_batch_ids"))),
        ("weights", f"rollout={wl.rollout_weight} actor={wl.actor_weight}"),
        ("ranks", ranks),
        ("redaction", redaction),
        ("config", f"{cfg.advantage_estimator} n={cfg.n_samples_per_prompt} "
                   f"std={'on' if cfg.grpo_std_normalization else 'off'} kl={cfg.kl_loss_type}×{cfg.kl_coef} "
                   f"clip={cfg.eps_clip}/{cfg.eps_clip_high} ent={cfg.entropy_coef}"
                   + "".join(f" {k}={v}" for k, v in config_changes(cfg).items() if k not in CORE_KNOBS)),
    ]
    if report.selected_samples is not None:
        rows.append(("selection", f"{len(report.selected_samples)} sample(s) (semantic-group closure)"))
    return rows


def group_rows(gidx: Sequence[Optional[int]], first: int) -> dict[Optional[int], Sequence[int]]:
    """Each group's sample rows, for a shard whose samples are rows ``first, first + 1, …`` in index order; the
    groups in the order they first appear. When every group's samples sit together (the usual layout) its rows
    are a ``range``, found with a few tensor operations rather than a step per sample; otherwise lists."""
    try:
        g = list_tensor(gidx, torch.int64)
    except (TypeError, OverflowError):  # a sample without a group (None)
        g = None
    if g is not None and g.numel():
        starts = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), g[1:] != g[:-1]])).reshape(-1)
        keys = g[starts].tolist()
        if len(set(keys)) == len(keys):  # one run per group
            bounds = starts.tolist() + [g.numel()]
            return {k: range(first + bounds[j], first + bounds[j + 1]) for j, k in enumerate(keys)}
    order: dict[Optional[int], list[int]] = {}
    row = first
    for gi, run in itertools.groupby(gidx):  # one step per run of equal group indices
        n = len(list(run))
        members = order.get(gi)
        if members is None:
            order[gi] = list(range(row, row + n))
        else:
            members.extend(range(row, row + n))
        row += n
    return order


def build_model(bundles: BundleSet, report: ReplayReport, name: Optional[str] = None,
                contexts: Optional[Sequence[Optional[StageContext]]] = None) -> ReplayModel:
    """What the panes show, built in the replay worker (off the UI thread). The fields of the failing
    stages are compared now (they mark the diverging samples); the others on first view. ``contexts``
    (from :func:`replay_lib.runner.replay_run`) carry what the replay already recomputed."""
    with gc_paused(), torch.inference_mode():
        return _build_model(bundles, report, name, contexts)


def _build_model(bundles: BundleSet, report: ReplayReport, name: Optional[str],
                 contexts: Optional[Sequence[Optional[StageContext]]]) -> ReplayModel:
    failed = {s.stage for s in report.stages if s.status == STATUS_FAIL}
    failing = [f.name for f in FIELDS if f.stage in failed and f.name not in DERIVED_FIELDS]
    shards: list[ShardRecompute] = []
    for i, shard in enumerate(bundles.shards):
        ctx = contexts[i] if contexts is not None else None
        rec = recompute_shard(shard, stages_that_ran(report, shard), fields=failing, ctx=ctx,
                              rules=rules_of(report))
        if SUPPORT_STAGE in rec.ran and shard.has_payload("support_ids") and shard.has_payload("support_logits"):
            try:  # here, off the UI thread: the support strip reads these rows on every cursor move
                rec.support_tokens()
            except StageInputError:
                pass  # the support fields say why when viewed
        shards.append(rec)
    selected = set(report.selected_samples) if report.selected_samples is not None else None
    per_sample_fields = [f.name for f in FIELDS if f.kind != KIND_COHORT and f.name not in DERIVED_FIELDS]
    samples = SampleRows()
    groups: list[GroupRow] = []
    for si, rec in enumerate(shards):
        n = len(rec.reader.index.samples)
        counts = {fname: c for fname in per_sample_fields if fname in rec.results
                  and (c := rec.results[fname].per_sample_counts()) is not None}
        # Only diverging samples get a per-field dict; the rest share one empty (never mutated) mapping.
        total = sum(counts.values()) if counts else torch.zeros(n, dtype=torch.int64)
        diverging = {i: {f: int(c[i]) for f, c in counts.items() if int(c[i])}
                     for i in torch.nonzero(total).reshape(-1).tolist()}
        totals = total.tolist()
        compared = any(FIELD_BY_STAGE[st].kind != KIND_COHORT for st in rec.ran if st in FIELD_BY_STAGE) or (
            "loss.policy" in rec.ran and any(f not in rec.unavailable for f in LOSS_TERM_FIELDS))  # per-sample terms
        records = rec.reader.index.samples
        picks = None if selected is None else [i for i, s in enumerate(records) if s.sample_id in selected]
        rank = rec.rank
        first = samples.add_shard(si, records, rec.reader.sample_ids, picks, rank, diverging, compared, totals)
        gidx = rec.ctx.group_indices  # the shard's context covers all its samples, in order
        order: dict[Optional[int], Sequence[int]] = {}
        if picks is None:
            order = group_rows(gidx, first)
            shown = diverging  # every sample is a row
        else:
            pos = {i: row for row, i in enumerate(picks, first)}
            for i, row in pos.items():
                order.setdefault(gidx[i], []).append(row)
            shown = [k for k in diverging if k in pos]
        bad_per_group = Counter(gidx[k] for k in shown)  # diverging rows per group
        suffix = f" · rank {rank}" if len(shards) > 1 and rank is not None else ""
        groups += [GroupRow(rank, gi, members if isinstance(members, range) else tuple(members),
                            bad_per_group.get(gi, 0), suffix) for gi, members in order.items()]
    fields, unavailable = [], {}
    for spec in FIELDS:
        status = report.stage(spec.stage)
        if status is None or status.status == STATUS_SKIPPED:
            unavailable[spec.name] = status.reason if status else "stage not in this bundle"
            continue
        missing = [rec.unavailable[spec.name] for rec in shards if spec.name in rec.unavailable]
        if len(missing) == len(shards):  # a failing field that could not be recomputed on any rank
            unavailable[spec.name] = missing[0]
            continue
        fields.append(spec.name)
    model = ReplayModel(
        report=report, name=name or Path(str(bundles.path)).name,
        identity=identity_lines(bundles, report, [rec.ctx for rec in shards]),
        shards=shards, samples=samples, groups=groups, fields=fields, unavailable=unavailable,
        forensic=bundles.forensic,
    )
    model.has_consumer_batches  # noqa: B018 - placed here, in the worker, not by the tree's first frame
    return model


# ----------------------------------------------------------------------------------- formatting


def first_divergence_text(report: ReplayReport) -> str:
    """The report's first divergence line exactly as the CLI prints it (``reward s-0: expected=…``)."""
    if report.first_divergence is None:
        return ""
    return divergence_line(report.first_divergence, len(report.ranks) > 1)


def explanation_text(report: ReplayReport) -> str:
    """The best explanation of the first divergent stage as the CLI prints it (``likely cause: … — 4/4
    samples``); "" when no known cause matches (``replay_lib.explain``)."""
    for e in report.explanations:
        if e.stage == report.first_divergent_stage:
            tied = tied_causes(report, e.stage)
            return explanation_line(e) + (f" (or {tied - 1} more that fit{'s' if tied == 2 else ''} as well)"
                                          if tied > 1 else "")
    return ""


def fmt_cell(x: Optional[float]) -> str:
    """A table cell: the CLI's shortest float32 form; NaN shows as ``nan``."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    return fmt_value(x)
