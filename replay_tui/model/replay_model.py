"""The model the app holds (:class:`ReplayModel`), built from a verified bundle set and its report.

Part of :mod:`replay_tui.model` (pure data, no Textual)."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import AbstractSet, Optional, Sequence

import torch
from rich.cells import cell_len

from replay_lib.bundle import BundleSet
from replay_lib.bundle.gcpause import gc_paused
from replay_lib.bundle.selection import group_label
from replay_lib.explain.inputs import ElementInputs, consumer_batch_labels, element_inputs, loss_scalar_inputs
from replay_lib.judge.compare import list_tensor
from replay_lib.judge.fields import PER_SCALAR
from replay_lib.judge.report import STATUS_FAIL, STATUS_SKIPPED, ReplayReport
from replay_lib.safe_text import safe
from replay_lib.stages import StageContext, StageInputError

from .fields import (
    DERIVED_FIELDS, FIELD_BY_NAME, FIELD_BY_STAGE, FIELDS, KIND_COHORT, KIND_SAMPLE, KIND_TOKEN, LOSS_TERM_FIELDS,
    SUPPORT_STAGE, FieldSpec
)
from .identity import identity_lines
from .recompute import ShardRecompute, recompute_shard, rules_of, stages_that_ran
from .sample_table import GROUP_SCANS, GroupRow, SampleRow, SampleRows, TreeRows, group_rows
from .support_rows import SupportRow, support_row
from .token_diff import FieldDiff, token_rows


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
        of a per-sample table), from :func:`replay_lib.explain.inputs.element_inputs` on the shard's context; a
        cohort (loss) row says what its scalar sums. Raises ``KeyError``/``IndexError``/``StageInputError``
        when there is no breakdown."""
        spec = FIELD_BY_NAME[field_name]
        if spec.kind == KIND_COHORT:
            diff = self.field_diff(field_name)
            label = diff.label(row)
            base, _, rank = label.partition(" [rank ")
            shard = next((sh for sh in self.shards if rank and str(sh.rank) == rank.rstrip("]")), self.shards[0])
            more = "f: pg_contribution lists each sample's term by |err|" if "pg_contribution" in self.fields else ""
            # the scalar's sums, weights and value (replay_lib.explain.inputs), else what the row's own field compares
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
        """``row``'s consumer batch as the why strip and the tree show it (``replay_lib.explain.inputs``: recorded, ``~``
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

def build_model(bundles: BundleSet, report: ReplayReport, name: Optional[str] = None,
                contexts: Optional[Sequence[Optional[StageContext]]] = None) -> ReplayModel:
    """What the panes show, built in the replay worker (off the UI thread). The fields of the failing
    stages are compared now (they mark the diverging samples); the others on first view. ``contexts``
    (from :func:`replay_lib.run.runner.replay_run`) carry what the replay already recomputed."""
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
        if spec.present is not None and not any(spec.present[0](rec.reader) for rec in shards):
            unavailable[spec.name] = spec.present[1]
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
