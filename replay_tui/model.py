"""The debugger's model: what the panes render, built from a verified :class:`BundleSet` and the runner's
:class:`ReplayReport`. Pure data (torch + replay_lib only, no Textual), unit-tested without an App.

The report says *which* stage failed and keeps a few divergences; the panes also need every element of
the viewed field (the token diff, the per-sample mismatch marks). Those come from running the same
stage adapters on a full :class:`StageContext` (so "actual" is exactly what the runner recomputed) and
comparing with the same rule as ``replay_lib.compare``: ``|a − e| > atol + rtol·|e|``, NaN/Inf diverge.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from replay_lib.bundle import BundleReader, BundleSet
from replay_lib.compare import as_float64, tolerance_for
from replay_lib.kernels import LOSS_FIELDS, policy_loss_fields
from replay_lib.report import STATUS_FAIL, STATUS_SKIPPED, ReplayReport, divergence_line, fmt_value
from replay_lib.runner import plan_stages
from replay_lib.schema import StageId
from replay_lib.selection import group_label
from replay_lib.stages import REGISTRY, StageContext, StageInputError

# ------------------------------------------------------------------------------------------ fields

KIND_SAMPLE = "sample"  # one value per sample (a table of samples)
KIND_TOKEN = "token"  # one value per response token of the selected sample
KIND_COHORT = "cohort"  # one value per bundle (loss fields)


@dataclass(frozen=True)
class FieldSpec:
    name: str
    stage: str
    kind: str
    title: str


FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("raw_reward", "reward.raw", KIND_SAMPLE, "raw reward per sample"),
    FieldSpec("reward", "reward.post_process", KIND_SAMPLE, "normalized reward per sample"),
    FieldSpec("kl", "advantage.kl", KIND_TOKEN, "rollout-vs-reference KL per token"),
    FieldSpec("advantage", "advantage.estimate", KIND_TOKEN, "GRPO advantage per token"),
    FieldSpec("loss", "loss.policy", KIND_COHORT, "policy loss fields (cohort scalars)"),
)
FIELD_BY_NAME = {f.name: f for f in FIELDS}
FIELD_BY_STAGE = {f.stage: f for f in FIELDS}

# Recomputing these fills ``ctx.outputs`` with the runner's own "actual" tensors.
_RECOMPUTE_ORDER = (StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_KL, StageId.ADVANTAGE_ESTIMATE)


def field_for_divergence(stage: str, field_name: str) -> Optional[str]:
    """The viewable field a report divergence belongs to (loss sub-fields → ``loss``)."""
    if field_name in FIELD_BY_NAME and FIELD_BY_NAME[field_name].stage == stage:
        return field_name
    spec = FIELD_BY_STAGE.get(stage)
    return spec.name if spec else None


def element_mismatch(expected: torch.Tensor, actual: torch.Tensor, atol: float, rtol: float):
    """``(abs_error, bad)`` float64/bool tensors, with exactly ``compare_elements``' rule."""
    e = as_float64(expected)
    a = as_float64(actual)
    diff = (a - e).abs()
    finite = torch.isfinite(a) & torch.isfinite(e)
    bad = ~finite | (diff > atol + rtol * e.abs())
    err = torch.where(finite, diff, torch.full_like(diff, float("nan")))
    return err, bad


# --------------------------------------------------------------------------------- per-field diff


@dataclass
class FieldDiff:
    """Rows of one field for the diff viewer: a sample's tokens, every sample, or the loss fields.

    ``labels`` is empty for token rows (the row index *is* the token offset)."""

    field: str
    stage: str
    kind: str
    expected: list[float]
    actual: list[float]
    abs_error: list[float]
    bad: list[bool]
    mask: Optional[list[int]] = None
    sample_id: Optional[str] = None
    labels: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    atol: float = 0.0
    rtol: float = 0.0
    error_tensor: Optional[torch.Tensor] = None
    bad_tensor: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.bad_tensor is None:
            self.bad_tensor = torch.tensor(self.bad, dtype=torch.bool)
        if self.error_tensor is None:
            self.error_tensor = torch.tensor(self.abs_error, dtype=torch.float64)
        self.divergent: list[int] = torch.nonzero(self.bad_tensor).reshape(-1).tolist()

    def __len__(self) -> int:
        return len(self.expected)

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
        n = len(self)
        if n == 0 or bins <= 0:
            return []
        err = self.error_tensor.clone()
        err = torch.where(torch.isnan(err) & self.bad_tensor, torch.full_like(err, float("inf")), err)
        err = torch.nan_to_num(err, nan=0.0)
        finite = err[torch.isfinite(err)]
        top = float(finite.max()) if finite.numel() else 0.0
        err = torch.where(torch.isinf(err), torch.full_like(err, top if top > 0 else 1.0), err)
        scale = float(err.max()) if float(err.max()) > 0 else 1.0
        if bins >= n:
            rows = torch.arange(bins, dtype=torch.int64) * n // bins
            peak, flagged = err[rows], self.bad_tensor[rows]
        else:
            which = torch.arange(n, dtype=torch.int64) * bins // n
            peak = torch.zeros(bins, dtype=torch.float64).scatter_reduce(0, which, err, reduce="amax",
                                                                         include_self=True)
            flagged = torch.zeros(bins, dtype=torch.int64).index_add_(0, which, self.bad_tensor.to(torch.int64)) > 0
        return [(float(p) / scale, bool(f)) for p, f in zip(peak.tolist(), flagged.tolist())]

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
    """One rank shard recomputed over all its samples: per field ``(expected, actual)`` float64 tensors.

    Lazy per field (:meth:`ensure`): building the model computes only the fields whose stage failed
    (they mark the samples); a passing field is computed the first time it is viewed."""

    reader: BundleReader
    ctx: StageContext
    ran: set[str] = field(default_factory=set)
    values: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    tolerances: dict[str, tuple[float, float]] = field(default_factory=dict)
    errors: dict[str, torch.Tensor] = field(default_factory=dict)
    bad: dict[str, torch.Tensor] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    loss_names: list[str] = field(default_factory=list)

    @property
    def rank(self) -> Optional[int]:
        return self.reader.rank

    def ensure(self, name: str) -> bool:
        """Compute field ``name`` (and the stages it depends on) unless done; False if unavailable."""
        if name in self.values:
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
        return name in self.values

    def _run(self, stage: StageId) -> None:
        """Run a stage adapter once, so ``ctx.outputs`` holds exactly what the runner recomputed."""
        if stage.value in self.ran and stage.value not in self._done:
            self._done.add(stage.value)
            REGISTRY[stage].run(self.ctx)

    def _compute(self, name: str) -> None:
        ctx = self.ctx
        if name == "raw_reward":
            self._put(name, "reward.raw", ctx.expected_list("reward.raw", "raw_rewards"),
                      [s.raw_reward for s in ctx.samples])
        elif name == "reward":
            self._run(StageId.REWARD_POST_PROCESS)
            self._put(name, "reward.post_process", ctx.expected_list("reward.post_process", "rewards"),
                      ctx.outputs["rewards"])
        elif name == "kl":
            self._run(StageId.ADVANTAGE_KL)
            self._put(name, "advantage.kl", ctx.payload("kl"), ctx.outputs["kl"])
        elif name == "advantage":
            self._run(StageId.REWARD_POST_PROCESS)  # its normalized rewards feed the estimate when it ran
            self._run(StageId.ADVANTAGE_ESTIMATE)
            self._put(name, "advantage.estimate", ctx.payload("advantages"), ctx.outputs["advantages"])
        elif name == "loss":
            if "advantage.estimate" in self.ran:
                self._run(StageId.REWARD_POST_PROCESS)
                self._run(StageId.ADVANTAGE_ESTIMATE)
            _recompute_loss(self)

    def _put(self, name: str, stage: str, expected, actual) -> None:
        e, a = as_float64(expected), as_float64(actual)
        if e.numel() != a.numel():
            self.unavailable[name] = f"expected {e.numel()} value(s), recomputed {a.numel()}"
            return
        atol, rtol = tolerance_for(self.reader.manifest.comparison_policy, stage, name)
        self.values[name] = (e, a)
        self.tolerances[name] = (atol, rtol)
        self.errors[name], self.bad[name] = element_mismatch(e, a, atol, rtol)

    def __post_init__(self) -> None:
        self._done: set[str] = set()


def stages_that_ran(report: Optional[ReplayReport], shard: BundleReader) -> set[str]:
    """Stages the report compared (pass/fail); without a report, what a full replay would run."""
    if report is not None:
        return {s.stage for s in report.stages if s.status != STATUS_SKIPPED}
    return {s.value for s in plan_stages(shard, None, partial=False).run}


def recompute_shard(shard: BundleReader, ran: Iterable[str], fields: Iterable[str] = ()) -> ShardRecompute:
    """A lazily recomputed shard; ``fields`` are computed now."""
    ctx = StageContext(reader=shard, indices=list(range(len(shard.index.samples))), partial=False, keep=1)
    out = ShardRecompute(reader=shard, ctx=ctx, ran=set(ran))
    for name in fields:
        out.ensure(name)
    return out


def _recompute_loss(out: ShardRecompute) -> None:
    """The loss.policy fields, with the inputs ``run_loss_policy`` uses."""
    ctx = out.ctx
    cfg = ctx.config
    expected = ctx.reader.expected.get("loss.policy", {})
    names = [f for f in LOSS_FIELDS if f in expected]
    if not names:
        out.unavailable["loss"] = "expected.json $.loss.policy has no loss fields"
        return
    advantages = ctx.outputs.get("advantages")
    if advantages is None:
        advantages = ctx.payload("advantages")
    entropy = ctx.payload("entropy") if ctx.has("entropy") else None
    if entropy is None and cfg.entropy_coef != 0:
        raise StageInputError("payload 'entropy' is required when entropy_coef != 0", field="entropy")
    actual = policy_loss_fields(
        ctx.payload("log_probs"), ctx.payload("old_log_probs"), advantages, entropy, ctx.loss_mask, ctx.lengths,
        eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, entropy_coef=cfg.entropy_coef,
    )
    policy = ctx.reader.manifest.comparison_policy
    e_vals, a_vals, errs, bads = [], [], [], []
    for name in names:
        atol, rtol = tolerance_for(policy, "loss.policy", name)
        e = as_float64([expected[name]])
        a = as_float64([float(actual[name])])
        err, bad = element_mismatch(e, a, atol, rtol)
        e_vals.append(e)
        a_vals.append(a)
        errs.append(err)
        bads.append(bad)
    out.loss_names = names
    out.values["loss"] = (torch.cat(e_vals), torch.cat(a_vals))
    out.tolerances["loss"] = tolerance_for(policy, "loss.policy", "loss")
    out.errors["loss"] = torch.cat(errs)
    out.bad["loss"] = torch.cat(bads)


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


@dataclass(slots=True)
class GroupRow:
    label: str
    rank: Optional[int]
    group_index: Optional[int]
    samples: tuple[int, ...]  # indices into ReplayModel.samples
    diverging: int  # samples with at least one mismatch


@dataclass
class ReplayModel:
    report: ReplayReport
    name: str
    identity: list[tuple[str, str]]
    shards: list[ShardRecompute]
    samples: list[SampleRow]
    groups: list[GroupRow]
    fields: list[str]  # viewable fields, FIELDS order
    unavailable: dict[str, str]

    def __post_init__(self) -> None:
        self.by_id = {s.sample_id: i for i, s in enumerate(self.samples)}
        self._diffs: dict[tuple[Optional[str], str], FieldDiff] = {}

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
            return [i for i, s in enumerate(self.samples) if s.total_mismatches]
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
            rows = {i: torch.tensor([r.index for r in self.samples if r.shard == i], dtype=torch.int64)
                    for i, sh in enumerate(self.shards) if spec.name in sh.values}
            parts = [(i, self.shards[i]) for i in rows]
            e = torch.cat([sh.values[spec.name][0][rows[i]] for i, sh in parts])
            a = torch.cat([sh.values[spec.name][1][rows[i]] for i, sh in parts])
            err = torch.cat([sh.errors[spec.name][rows[i]] for i, sh in parts])
            bad = torch.cat([sh.bad[spec.name][rows[i]] for i, sh in parts])
            labels, groups = [], []
            for i, sh in parts:
                records = sh.reader.index.samples
                for j in rows[i].tolist():
                    labels.append(records[j].sample_id)
                    groups.append(group_label(records[j].group_index))
            atol, rtol = parts[0][1].tolerances[spec.name]
            return FieldDiff(field=spec.name, stage=spec.stage, kind=spec.kind, expected=e.tolist(), actual=a.tolist(),
                             abs_error=err.tolist(), bad=bad.tolist(), labels=labels, groups=groups, atol=atol,
                             rtol=rtol, error_tensor=err, bad_tensor=bad)
        parts = [sh for sh in self.shards if "loss" in sh.values]
        labels = []
        for sh in parts:
            suffix = f" [rank {sh.rank}]" if self.multi_rank and sh.rank is not None else ""
            labels += [f"{n}{suffix}" for n in sh.loss_names]
        e = torch.cat([sh.values["loss"][0] for sh in parts])
        a = torch.cat([sh.values["loss"][1] for sh in parts])
        err = torch.cat([sh.errors["loss"] for sh in parts])
        bad = torch.cat([sh.bad["loss"] for sh in parts])
        atol, rtol = parts[0].tolerances["loss"]
        return FieldDiff(field="loss", stage=spec.stage, kind=KIND_COHORT, expected=e.tolist(), actual=a.tolist(),
                         abs_error=err.tolist(), bad=bad.tolist(), labels=labels, atol=atol, rtol=rtol,
                         error_tensor=err, bad_tensor=bad)

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
    e, a = shard.values[field_name]
    err = shard.errors[field_name][start:start + n]
    bad = shard.bad[field_name][start:start + n]
    sample = shard.reader.index.samples[index]
    atol, rtol = shard.tolerances[field_name]
    mask = list(sample.loss_mask[:n]) + [0] * max(0, n - len(sample.loss_mask))
    return FieldDiff(field=field_name, stage=FIELD_BY_NAME[field_name].stage, kind=KIND_TOKEN,
                     expected=e[start:start + n].tolist(), actual=a[start:start + n].tolist(), abs_error=err.tolist(),
                     bad=bad.tolist(), mask=mask, sample_id=sample.sample_id, atol=atol, rtol=rtol,
                     error_tensor=err, bad_tensor=bad)


def token_diff(bundles: BundleSet, sample_id: str, field_name: str) -> FieldDiff:
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
            rec = recompute_shard(shard, stages_that_ran(None, shard), fields=[field_name])
            if field_name not in rec.values:
                raise KeyError(f"field {field_name!r} is not available: {rec.unavailable.get(field_name, 'stage not run')}")
            if spec.kind == KIND_TOKEN:
                return token_rows(rec, i, field_name)
            if spec.kind == KIND_SAMPLE:
                e, a = rec.values[field_name]
                err, bad = rec.errors[field_name][i:i + 1], rec.bad[field_name][i:i + 1]
                atol, rtol = rec.tolerances[field_name]
                return FieldDiff(field=field_name, stage=spec.stage, kind=KIND_SAMPLE, expected=e[i:i + 1].tolist(),
                                 actual=a[i:i + 1].tolist(), abs_error=err.tolist(), bad=bad.tolist(),
                                 labels=[sample_id], groups=[group_label(s.group_index)], atol=atol, rtol=rtol)
            raise KeyError(f"field {field_name!r} is cohort-level, not per sample")
    raise KeyError(f"no sample {sample_id!r} in bundle {bundles.bundle_id}")


def _listing(values: Sequence, limit: int = 4) -> str:
    if not values:
        return "—"
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f" … (+{len(values) - limit})" if len(values) > limit else "")


def identity_lines(bundles: BundleSet, report: ReplayReport) -> list[tuple[str, str]]:
    """``(label, value)`` rows of the identity pane: logical identity, physical provenance, producer."""
    first = bundles.shards[0]
    ident = first.index.identity
    manifest = first.manifest
    n_samples = sum(len(s.index.samples) for s in bundles.shards)
    n_tokens = sum(max(r.response_length, 0) for s in bundles.shards for r in s.index.samples)
    groups = sorted({g for s in bundles.shards for g in s.index.identity.semantic_group_ids},
                    key=lambda g: (isinstance(g, str), g if isinstance(g, int) else 0, str(g)))
    # a cohort's ranks each normalize their own groups: count (rank, group) pairs
    n_groups = sum(len({r.group_index for r in s.index.samples}) for s in bundles.shards)
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
        ("samples", f"{n_samples} in {n_groups} group{'s' if n_groups != 1 else ''}, {n_tokens} tokens"),
        ("groups", _listing([f"g-{g}" for g in groups])),
        ("cohorts", _listing(ident.normalization_cohort_ids)),
        ("partitions", _listing(ident.rollout_partition_ids)),
        ("consumer", _listing(ident.consumer_batch_ids)),
        ("micro-batch", _listing(ident.micro_batch_ids)),
        ("weights", f"rollout={wl.rollout_weight} actor={wl.actor_weight}"),
        ("ranks", ranks),
        ("redaction", redaction),
        ("config", f"{cfg.advantage_estimator} n={cfg.n_samples_per_prompt} "
                   f"std={'on' if cfg.grpo_std_normalization else 'off'} kl={cfg.kl_loss_type}×{cfg.kl_coef} "
                   f"clip={cfg.eps_clip}/{cfg.eps_clip_high} ent={cfg.entropy_coef}"),
    ]
    if report.selected_samples is not None:
        rows.append(("selection", f"{len(report.selected_samples)} sample(s) (semantic-group closure)"))
    return rows


def build_model(bundles: BundleSet, report: ReplayReport, name: Optional[str] = None) -> ReplayModel:
    """What the panes show, built in the replay worker (off the UI thread). The fields of the failing
    stages are recomputed now (they mark the diverging samples); the others on first view."""
    failing = [FIELD_BY_STAGE[s.stage].name for s in report.stages
               if s.status == STATUS_FAIL and s.stage in FIELD_BY_STAGE]
    shards: list[ShardRecompute] = []
    for shard in bundles.shards:
        shards.append(recompute_shard(shard, stages_that_ran(report, shard), fields=failing))
    selected = set(report.selected_samples) if report.selected_samples is not None else None
    per_sample_fields = [f.name for f in FIELDS if f.kind != KIND_COHORT]
    samples: list[SampleRow] = []
    groups: list[GroupRow] = []
    for si, rec in enumerate(shards):
        n = len(rec.reader.index.samples)
        counts: dict[str, torch.Tensor] = {}
        for fname in per_sample_fields:
            if fname not in rec.bad:
                continue
            bad = rec.bad[fname].to(torch.int64)
            if FIELD_BY_NAME[fname].kind == KIND_TOKEN:
                counts[fname] = torch.zeros(n, dtype=torch.int64).index_add_(0, rec.ctx.seg, bad)
            else:
                counts[fname] = bad
        # Only diverging samples get a per-field dict; the rest share one empty (never mutated) mapping.
        total = sum(counts.values()) if counts else torch.zeros(n, dtype=torch.int64)
        diverging = {i: {f: int(c[i]) for f, c in counts.items() if int(c[i])}
                     for i in torch.nonzero(total).reshape(-1).tolist()}
        totals = total.tolist()
        none: dict[str, int] = {}
        compared = any(FIELD_BY_STAGE[st].kind != KIND_COHORT for st in rec.ran if st in FIELD_BY_STAGE)
        order: dict[Optional[int], list[int]] = {}
        for i, s in enumerate(rec.reader.index.samples):
            if selected is not None and s.sample_id not in selected:
                continue
            order.setdefault(s.group_index, []).append(len(samples))
            samples.append(SampleRow(
                s.sample_id, si, i, rec.rank, s.group_index, s.micro_batch_id, s.raw_reward, s.reward,
                s.response_length, diverging.get(i, none), compared, totals[i],
            ))
        for gi, members in order.items():
            label = group_label(gi) if gi is not None else "(no group)"
            if len(shards) > 1 and rec.rank is not None:
                label = f"{label} · rank {rec.rank}"
            groups.append(GroupRow(label=label, rank=rec.rank, group_index=gi, samples=tuple(members),
                                   diverging=sum(1 for m in members if samples[m].total_mismatches)))
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
    return ReplayModel(
        report=report, name=name or Path(str(bundles.path)).name, identity=identity_lines(bundles, report),
        shards=shards, samples=samples, groups=groups, fields=fields, unavailable=unavailable,
    )


# ----------------------------------------------------------------------------------- formatting


def first_divergence_text(report: ReplayReport) -> str:
    """The report's first divergence line exactly as the CLI prints it (``reward s-0: expected=…``)."""
    if report.first_divergence is None:
        return ""
    return divergence_line(report.first_divergence, len(report.ranks) > 1)


def fmt_cell(x: Optional[float]) -> str:
    """A table cell: the CLI's shortest float32 form; NaN shows as ``nan``."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    return fmt_value(x)
