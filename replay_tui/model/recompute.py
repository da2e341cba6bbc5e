"""A shard's stages re-run on demand for the views (:class:`ShardRecompute`): every element of a field, as the report judged it.

Part of :mod:`replay_tui.model` (pure data, no Textual)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import torch

from replay_lib.bundle import BundleReader
from replay_lib.bundle.schema import PER_SAMPLE_KEY, PerSampleLossTerms, StageId
from replay_lib.judge.error_model import Rules, bundle_tolerance
from replay_lib.judge.fields import PER_TOKEN, FieldResult
from replay_lib.judge.report import STATUS_SKIPPED, ReplayReport
from replay_lib.kernels.loss import LossKnobs, agg_weights, sample_term
from replay_lib.run.runner import plan_stages
from replay_lib.stages import REGISTRY, StageContext, StageInputError
from replay_lib.stages.support import SupportTokens, scored_sources

from .fields import FIELD_BY_NAME, KIND_COHORT, LOSS_TERM_FIELDS, SUPPORT_SOURCE, SUPPORT_STAGE, cohort_result


class _PerField(Mapping):
    """``{field name: get(its FieldResult)}`` over ``results``, each value read only when looked up."""

    def __init__(self, results: dict[str, FieldResult], get: Callable[[FieldResult], object]) -> None:
        self._results, self._get = results, get

    def __getitem__(self, name: str):
        return self._get(self._results[name])

    def __contains__(self, name: object) -> bool:
        return name in self._results

    def __iter__(self) -> Iterator[str]:
        return iter(self._results)

    def __len__(self) -> int:
        return len(self._results)


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

    # The columns of each computed field, read from its FieldResult (the one copy of them) when that field is asked
    # for: a view of one field never materializes another's (a per-token field's float64 columns are ≈ 34 bytes a
    # token, 4.4 GiB at 134M tokens, where the view keeps one byte a token and reads a sample's window).
    @property
    def values(self) -> Mapping[str, tuple[torch.Tensor, torch.Tensor]]:
        return _PerField(self.results, lambda r: (r.expected, r.actual))

    @property
    def errors(self) -> Mapping[str, torch.Tensor]:
        return _PerField(self.results, lambda r: r.abs_error)

    @property
    def bad(self) -> Mapping[str, torch.Tensor]:
        return _PerField(self.results, lambda r: r.divergent)

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
        finally:
            self.ctx.drop_mask()  # a stage run for this view built the whole-step mask: the views read windows of it
        return name in self.results

    def _run(self, stage: StageId) -> None:
        """Run a stage adapter once (after the stages it consumes), so ``ctx.fields`` holds exactly what the
        runner compared."""
        if stage.value in self.ran and stage.value not in self._done:
            for need in REGISTRY[stage].needs:
                self._run(need)
            self._done.add(stage.value)
            REGISTRY[stage].run(self.ctx)
            self.reader.release_pages()  # as the runner does after each stage: read again where a view needs it

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
        views = f"{stage}.view_fields"  # fields a stage computes for a view only, on the first ask
        if result is None and callable(self.ctx.records.get(views)):
            self.ctx.fields[stage] = [*self.ctx.fields.get(stage, ()), *self.ctx.records.pop(views)(self.ctx)]
            result = next((f for f in self.ctx.fields[stage] if f.name == name), None)
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
        actual_mask = torch.zeros(len(self.ctx.samples), dtype=torch.float64)
        for lo, hi, seg in self.ctx.token_chunks():  # a chunk of the mask at a time: no whole-step mask or sample map
            actual_mask.index_add_(0, seg, self.ctx.mask_rows(lo, hi).to(torch.float64))
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
            finally:
                self.ctx.drop_mask()
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
            # the pass over the step lets each block of payload rows go behind it (the runner's stages do the
            # same), or the model would keep every page of the field's payloads resident for as long as it lives
            result.release = self.ctx.release
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
    return Rules(chain=report.mode == "chained", exact=report.exact, tolerance_policy=report.tolerance_policy,
                 bitwise=report.bitwise is True)

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
    if "loss.grad" in out.ran and not shard.has_payload("grad_values"):
        out.unavailable["grad_values"] = "the bundle records no grad_values"  # known without computing
    if "advantage.estimate" in out.ran and not shard.has_payload("returns"):
        out.unavailable["returns"] = "the bundle records no returns (GAE's)"  # known without computing
    for name in fields:
        out.ensure(name)
    ctx.drop_mask()  # the replay's whole-step float32 mask (4 bytes a token): the views read the packed one
    return out
