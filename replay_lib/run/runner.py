"""The one runner behind ``trajectory-replay replay``, ``replay-tui --check`` and the TUI.

Order of work: resolve + verify the bundle (exit 3 on any problem) → plan the stages and refuse
unsupported topologies/knobs (exit 4) → resolve the selection (exit 3 when it can't be exact) → run the
stages on every rank shard → merge into one :class:`ReplayReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import msgspec
import torch

from ..bundle import BundleReader, BundleSet, config_knob_active, open_bundle
from ..judge.error_model import Rules, coarse_payloads, tolerance_warnings
from ..errors import BundleError, SelectionError, UnsupportedError
from ..explain import annotate
from ..bundle.gcpause import gc_paused
from .threads import cpu_window, pass_threads, replay_threads
from ..judge.report import STATUS_FAIL, STATUS_PASS, STATUS_SKIPPED, Divergence, Hazard, ReplayReport, StageReport
from ..safe_text import elided_listing, safe
from ..bundle.schema import FORMAT_2_REMOVED_STAGES, NOT_IN_FORMAT_2, ActorStepId, StageCapability, StageContract, StageId
from ..bundle.selection import Selection, resolve_selection, selection_keys
from ..stages import REGISTRY, STAGE_ORDER, UNSUPPORTED, StageContext, StageInputError
from ..kernels import grpo_std_scope
from ..stages.advantage import advantage_config_error, estimator_refusal, per_token_reward_refusal
from ..stages.mismatch import applies as mismatch_applies, merge_summaries

ProgressFn = Callable[[str, Optional[int], int, int], None]
# Replays the shards elsewhere (``run.ray_replay``): given ``[(k, shard, resolution, plan)]`` (the k-th shard of the
# set, what it selects, its plan), the keep count and the rules, yields per shard, in that order, the stage
# reports of ``_run_shard``, the shard's hazards and its selected sample ids.
ShardRunner = Callable[[list, int, Rules], Iterator[tuple[list, list, list]]]


@dataclass
class StagePlan:
    run: list[StageId] = field(default_factory=list)
    skipped: dict[StageId, str] = field(default_factory=dict)
    capability: dict[StageId, str] = field(default_factory=dict)


def parse_stage_names(names: Optional[Iterable[str]]) -> Optional[list[StageId]]:
    """``None`` / ``["all"]`` → every stage; unknown names raise ``ValueError`` (a usage error)."""
    if not names:
        return None
    out: list[StageId] = []
    for name in names:
        if name == "all":
            return None
        try:
            out.append(StageId(name))
        except ValueError:
            valid = ", ".join(s.value for s in STAGE_ORDER)
            raise ValueError(f"unknown stage {name!r} (expected one of: all, {valid})") from None
    return out


def stage_contracts(reader: BundleReader) -> dict:
    """The manifest's contracts, plus ``logprob.mismatch`` declared recompute where the bundle holds its inputs
    and declares nothing for it (SPEC §4.4: the stage runs whenever rollout log-probs are recorded)."""
    contracts = reader.manifest.stage_contracts
    if StageId.LOGPROB_MISMATCH not in contracts and mismatch_applies(reader):
        contracts = {**contracts, StageId.LOGPROB_MISMATCH: StageContract(
            stage=StageId.LOGPROB_MISMATCH, capability=StageCapability.RECOMPUTE, implementation="reimplemented")}
    return contracts


def _declared_recompute(reader: BundleReader, stage: StageId) -> bool:
    contract = stage_contracts(reader).get(stage)
    return contract is not None and contract.capability == StageCapability.RECOMPUTE


def plan_stages(reader: BundleReader, requested: Optional[Sequence[StageId]], partial: bool) -> StagePlan:
    """Which stages run, and why the others are skipped. Raises UnsupportedError (exit 4)."""
    plan = StagePlan()
    contracts = stage_contracts(reader)
    if requested is not None:
        for stage in requested:
            contract = contracts.get(stage)
            if stage.value in FORMAT_2_REMOVED_STAGES and reader.format_major == 2:
                raise UnsupportedError(f"stage {stage.value} is {NOT_IN_FORMAT_2} ({reader.path / 'manifest.json'} "
                                       f"is format {reader.manifest.format_version}: the recorded reward is "
                                       f"advantage.estimate's input)")
            if stage in UNSUPPORTED or stage not in REGISTRY:
                raise UnsupportedError(f"stage {stage.value} is unsupported: {UNSUPPORTED.get(stage, 'no adapter in this engine')}")
            if contract is None:
                raise UnsupportedError(f"stage {stage.value} is not declared in {reader.path / 'manifest.json'}; nothing to recompute")
            if contract.capability != StageCapability.RECOMPUTE:
                raise UnsupportedError(
                    f"stage {stage.value} is declared {contract.capability.value} in {reader.path / 'manifest.json'}; "
                    f"only recompute stages can be replayed"
                )
            if partial and REGISTRY[stage].cohort_level:  # asked for by name: never a pass that compared nothing
                raise UnsupportedError(
                    f"stage {stage.value} is cohort-level: it is not replayed under a partial selection "
                    f"(--sample/--group/--batch); drop the selection to replay it"
                )
        targets: set[StageId] = set()
        stack = list(requested)
        while stack:
            stage = stack.pop()
            if stage in targets:
                continue
            targets.add(stage)
            stack += [d for d in REGISTRY[stage].needs if _declared_recompute(reader, d)]
    else:
        targets = set(STAGE_ORDER)
    for stage in STAGE_ORDER:
        contract = contracts.get(stage)
        plan.capability[stage] = contract.capability.value if contract else (
            NOT_IN_FORMAT_2 if stage.value in FORMAT_2_REMOVED_STAGES and reader.format_major == 2 else "not declared")
        if stage not in targets:
            plan.skipped[stage] = "not requested (--stage)"
        elif contract is None and stage.value in FORMAT_2_REMOVED_STAGES and reader.format_major == 2:
            plan.skipped[stage] = NOT_IN_FORMAT_2
        elif contract is None:
            plan.skipped[stage] = "not declared in manifest"
        elif contract.capability != StageCapability.RECOMPUTE:
            plan.skipped[stage] = f"capability {contract.capability.value}"
        elif stage in UNSUPPORTED or stage not in REGISTRY:
            raise UnsupportedError(
                f"{reader.path / 'manifest.json'}: $.stage_contracts.{stage.value}: declared recompute, but "
                f"{UNSUPPORTED.get(stage, 'this engine has no adapter for it')}"
            )
        elif partial and REGISTRY[stage].cohort_level:
            plan.skipped[stage] = "cohort-level stage skipped under partial selection"
        else:
            plan.run.append(stage)
    check_topology(reader, plan.run)
    check_closure(reader, plan.run)
    return plan


def check_closure(reader: BundleReader, stages: Sequence[StageId]) -> None:
    """Refuse (exit 3, as ``validate`` does) a bundle that lacks an input or expected output of a stage about to
    run: nothing is recomputed from an incomplete bundle."""
    missing = [f"{stage.value} needs {need}" for stage in stages for need in REGISTRY[stage].requirements(reader)]
    if missing:
        raise BundleError(f"{reader.path / 'manifest.json'}: dependency closure incomplete: " + "; ".join(missing))


def check_topology(reader: BundleReader, stages: Sequence[StageId]) -> None:
    """Refuse (exit 4, naming the knob) what V1 cannot recompute, before any stage runs."""
    if not stages:
        return
    cfg = reader.index.config
    where = reader.path / "index.json"
    invalid = advantage_config_error(reader, stages)  # a value the format does not define: exit 3
    if invalid is not None:
        raise BundleError(f"{where}: {invalid}")
    refused = estimator_refusal(cfg)
    if refused is not None:
        raise UnsupportedError(f"{where}: {refused}")
    per_token = per_token_reward_refusal(reader) if StageId.ADVANTAGE_ESTIMATE in stages else None
    if per_token is not None:
        raise UnsupportedError(f"{where}: {per_token}")
    cp = reader.index.identity.rank.get("cp", 1)
    if cp != 1 and not all(REGISTRY[s].any_cp for s in stages):
        raise UnsupportedError(f"{where}: $.identity.rank.cp={cp}: V1 recomputes context-parallel size 1 only "
                               f"(at any CP size only the stages that read whole trajectories run: "
                               f"{', '.join(s.value for s in STAGE_ORDER if s in REGISTRY and REGISTRY[s].any_cp)})")
    dp = reader.index.identity.rank.get("dp", 1)
    if dp != 1 and grpo_std_scope(cfg) == "batch" and StageId.REWARD_POST_PROCESS in stages:
        raise UnsupportedError(f"{where}: $.config.grpo_std_scope='batch' with $.identity.rank.dp={dp}: the std of "
                               f"the whole generation batch spans every data-parallel rank; a bundle would need that "
                               f"batch std recorded (reward.post_process recomputes it from one rank's samples only)")
    for stage in stages:
        for knob, why in REGISTRY[stage].refuse(cfg):
            raise UnsupportedError(f"{where}: $.config.{knob}={why} (stage {stage.value})")
    for key, value in reader.unknown_config.items():
        if config_knob_active(value):
            raise UnsupportedError(
                f"{where}: $.config.{key}={value!r}: unknown config knob; refusing to guess what it changes"
            )


def _merge_stage(stage: StageId, per_rank: list[StageReport], keep: int, cohort: bool, capability: str) -> StageReport:
    failing = [r for r in per_rank if r.status == STATUS_FAIL]
    if failing:
        status = STATUS_FAIL
        reason = failing[0].reason
    elif any(r.status == STATUS_PASS for r in per_rank):
        status, reason = STATUS_PASS, per_rank[0].reason
    else:
        status, reason = STATUS_SKIPPED, per_rank[0].reason if per_rank else "no samples selected"
    if cohort and failing:
        ranks = sorted({d.rank for r in failing for d in r.divergences if d.rank is not None})
        if len(failing) > 1:  # each rank's own counts: the first rank's alone would understate them
            reason = "; ".join(
                f"rank {r.divergences[0].rank if r.divergences else '?'}: {r.reason}" for r in failing
            )
        elif ranks:
            reason = f"{reason} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
    errs = [r.max_abs_error for r in per_rank if r.max_abs_error is not None]
    ratios = [r.max_noise_ratio for r in per_rank if r.max_noise_ratio is not None]
    divergences: list[Divergence] = [d for r in per_rank for d in r.divergences]
    return StageReport(
        stage=stage.value,
        status=status,
        reason=reason if (status != STATUS_PASS or not cohort) else f"{reason} ×{len(per_rank)} ranks",
        mismatches=sum(r.mismatches for r in per_rank),
        max_abs_error=max(errs) if errs else None,
        divergences=divergences[:keep] if not failing else [d for r in failing for d in r.divergences][:keep],
        capability=capability,
        compared=sum(r.compared for r in per_rank),
        max_noise_ratio=max(ratios) if ratios else None,
        mismatch=merge_summaries(per_rank) or msgspec.UNSET,
    )


def run_replay(
    bundles: BundleSet,
    *,
    stages: Optional[Sequence[StageId]] = None,
    selection: Selection = Selection(),
    max_divergences: int = 5,
    progress: Optional[ProgressFn] = None,
    rules: Rules = Rules(),
    explain: bool = True,
    shard_runner: Optional[ShardRunner] = None,
) -> ReplayReport:
    """Replay every rank shard of a verified :class:`BundleSet`."""
    return replay_run(bundles, stages=stages, selection=selection, max_divergences=max_divergences,
                      progress=progress, rules=rules, explain=explain, shard_runner=shard_runner)[0]


def replay_run(
    bundles: BundleSet,
    *,
    stages: Optional[Sequence[StageId]] = None,
    selection: Selection = Selection(),
    max_divergences: int = 5,
    progress: Optional[ProgressFn] = None,
    rules: Rules = Rules(),
    explain: bool = True,
    shard_runner: Optional[ShardRunner] = None,
) -> tuple[ReplayReport, list[Optional[StageContext]]]:
    """:func:`run_replay`, plus each shard's :class:`StageContext` (``None`` for a shard the selection
    left out): its ``fields`` hold what each stage compared, its ``outputs`` what it recomputed, for a view
    that shows them. A bundle opened with deferred checksums is confirmed (:meth:`BundleSet.confirm`) once the
    stages ran, before the report is made, and ahead of any error raised meanwhile. ``rules``: teacher forcing or
    ``--chain``, ``--exact``, ``--tolerance-policy``. ``explain``:
    evaluate the known-bug hypotheses of each failing stage (``replay_lib.explain``; under ``--chain`` the
    downstream stages are marked either way).

    The stages run under ``torch.inference_mode`` (no autograd bookkeeping on the replay's thousands of torch
    calls): the tensors the contexts hold are inference tensors, read freely anywhere, never modified in place
    outside that mode (copy one first). They run on one intra-op thread (``run.threads``: thousands of small
    chunked ops, none worth a parallel region); the caller's thread count is restored afterwards.

    ``shard_runner`` (``replay --executor ray``): the shards are replayed by it, in parallel, and merged here into
    the report the local loop makes; no context is kept (each is ``None``). A failing report is made again by the
    local loop when its stages are to be explained or marked (``explain``, ``--chain``): the hypotheses read
    every shard's recomputed values, which stay where they were computed."""
    with gc_paused(), replay_threads(), torch.inference_mode(), bundles.checksums_first():
        if shard_runner is not None:
            report, contexts = _replay_run(bundles, stages, selection, max_divergences, progress, rules, explain,
                                           shard_runner)
            if report.passed or not (explain or rules.chain):
                return report, contexts
        return _replay_run(bundles, stages, selection, max_divergences, progress, rules, explain)


def _did_you_mean(bundles: BundleSet, kind: str, value: str, limit: int = 4) -> str:
    """`` (did you mean r0-s-0, r1-s-0?)``: the cohort's sample ids that end with ``-value`` (ranks often prefix
    their ids), or "" when none does."""
    if kind != "sample":
        return ""
    near = [s.sample_id for shard in bundles.shards for s in shard.index.samples
            if s.sample_id.endswith("-" + value)]
    if not near:
        return ""
    return f" (did you mean {elided_listing([safe(n) for n in near], limit)}?)"


def _replay_run(bundles: BundleSet, stages: Optional[Sequence[StageId]], selection: Selection,
                max_divergences: int, progress: Optional[ProgressFn],
                rules: Rules, explain: bool = True, shard_runner: Optional[ShardRunner] = None,
                ) -> tuple[ReplayReport, list[Optional[StageContext]]]:
    keep = max(int(max_divergences), 1)
    resolutions = []
    matched: set[str] = set()
    for shard in bundles.shards:
        res = resolve_selection(shard.index, selection, where=str(shard.path), strict=not bundles.cohort)
        matched |= res.matched
        resolutions.append(res)
    if bundles.cohort and not selection.empty:
        missing = sorted(selection_keys(selection) - matched)
        if missing:
            kind, _, value = missing[0].partition(":")
            raise SelectionError(f"{bundles.path}: --{kind} {value}: not found in any rank shard"
                                 + _did_you_mean(bundles, kind, value))
    partial = any(r.partial for r in resolutions)
    plans = [plan_stages(shard, stages, partial) for shard in bundles.shards]
    bundles.verify_selected(resolutions)  # a deferred open (--sample/--group/--batch): what the stages will read

    per_stage: dict[StageId, list[StageReport]] = {s: [] for s in STAGE_ORDER}
    total = sum(len(p.run) for p in plans)
    done = 0
    selected: list[str] = []
    contexts: list[Optional[StageContext]] = []
    hazards: list[Hazard] = []
    jobs = [(k, shard, res, plan) for k, (shard, res, plan) in enumerate(zip(bundles.shards, resolutions, plans))
            if selection.empty or res.indices]
    remote = shard_runner(jobs, keep, rules) if shard_runner is not None else None
    for shard, res, plan in zip(bundles.shards, resolutions, plans):
        if not selection.empty and not res.indices:
            contexts.append(None)
            continue
        if remote is not None:  # a shard replayed elsewhere: its reports, hazards and sample ids
            stage_reports, shard_hazards, sample_ids = next(remote)
            contexts.append(None)
            done += len(plan.run)
        else:
            ctx = StageContext(reader=shard, indices=res.indices, partial=res.partial, keep=keep, rules=rules,
                               threads=pass_threads())
            contexts.append(ctx)
            stage_reports = _run_shard(ctx, shard, plan, progress, done, total)
            shard_hazards, sample_ids = ctx.hazards, ctx.sample_ids
            done += len(plan.run)
        hazards += shard_hazards
        if res.partial:
            selected += sample_ids
        for stage, result in stage_reports:
            per_stage[stage].append(result)
    # a bundle opened with deferred checksums (open_bundle(..., defer_checksums=True)): every payload's sha256
    # judged before anything the stages derived from the payloads makes a report (SPEC §11)
    bundles.confirm()
    if progress is not None:
        progress("done", None, total, total)

    capability = plans[0].capability
    reports = [
        _merge_stage(stage, per_stage[stage], keep, bundles.cohort, capability.get(stage, ""))
        for stage in STAGE_ORDER
        if per_stage[stage]
    ]
    first_stage = next((r for r in reports if r.status == STATUS_FAIL), None)
    first_div = first_stage.divergences[0] if first_stage and first_stage.divergences else None
    ident = bundles.shards[0].index.identity
    warnings = list(bundles.warnings)
    for key, value in bundles.shards[0].unknown_config.items():
        warnings.append(f"index.json $.config.{key}={value!r}: unknown knob with a neutral value (ignored)")
    for shard in bundles.shards:
        for w in tolerance_warnings(shard.manifest, str(shard.path / "manifest.json"), rules.tolerance_policy):
            if w not in warnings:
                warnings.append(w)
    if rules.exact:
        for shard in bundles.shards:
            p = shard.manifest.comparison_policy.producer_precision
            if (p.compute, p.accumulate) != ("float32", "float32"):
                w = (f"{shard.path / 'manifest.json'}: $.comparison_policy.producer_precision: --exact recomputes in "
                     f"float32; this producer declares {p.compute} compute and {p.accumulate} accumulation, so its "
                     f"values need not match bit for bit (the default mode judges them with its rounding bound)")
                if w not in warnings:
                    warnings.append(w)
            coarse = coarse_payloads(p.compute, {n: spec.dtype for n, spec in shard.manifest.payloads.items()})
            if coarse:
                w = (f"{shard.path / 'manifest.json'}: $.payloads: --exact recomputes from the stored payloads; "
                     f"{coarse} stored coarser than the declared {p.compute} compute hold one rounding of the "
                     "producer's values, so no recomputation need match bit for bit (the default mode admits it)")
                if w not in warnings:
                    warnings.append(w)
    report = ReplayReport(
        bundle_id=bundles.bundle_id,
        passed=first_stage is None,
        first_divergent_stage=first_stage.stage if first_stage else None,
        first_divergence=first_div,
        stages=reports,
        kind=ident.kind,
        anchor=ident.anchor,
        ranks=[s.rank if s.rank is not None else 0 for s in bundles.shards],
        selected_samples=selected if partial else None,
        warnings=warnings,
        mode=rules.mode,
        exact=rules.exact,
        tolerance_policy=rules.tolerance_policy,
        hazards=_hazards(hazards, keep),
        bitwise=True if rules.bitwise else msgspec.UNSET,
    )
    return annotate(report, contexts, rules, explain=explain), contexts


def _run_shard(ctx: StageContext, shard: BundleReader, plan: StagePlan, progress: Optional[ProgressFn] = None,
               done: int = 0, total: int = 0) -> list[tuple[StageId, StageReport]]:
    """Every stage of one shard in pipeline order: ``(stage, its report)``, a skipped stage's too (with its
    reason); an optional stage the shard does not declare is left out."""
    out: list[tuple[StageId, StageReport]] = []
    for stage in STAGE_ORDER:
        if stage in REGISTRY and REGISTRY[stage].optional and stage not in stage_contracts(shard):
            continue  # an optional stage a bundle doesn't declare is not worth a report line
        if stage not in plan.run:
            reason = plan.skipped.get(stage, "")
            out.append((stage, StageReport(stage=stage.value, status=STATUS_SKIPPED, reason=reason)))
            continue
        if progress is not None:
            progress(stage.value, shard.rank, done, total)
        try:
            result = REGISTRY[stage].run(ctx)
            ctx.completed.add(stage.value)
        except StageInputError as exc:
            result = StageReport(
                stage=stage.value, status=STATUS_FAIL, reason=str(exc), mismatches=1,
                divergences=[Divergence(stage=stage.value, rank=shard.rank, field=exc.field,
                                        expected=exc.expected, actual=exc.actual,
                                        abs_error=abs(exc.expected - exc.actual)
                                        if exc.expected is not None and exc.actual is not None else None,
                                        message=str(exc))],
            )
        out.append((stage, result))
        done += 1
        shard.release_pages()  # what the stage read of the mapped payloads: read again where a later one needs it
    return out


def _hazards(found: Sequence[Hazard], keep: int) -> list[Hazard]:
    """Every shard's hazards in pipeline order, at most ``keep`` of each (stage, kind), then one line saying
    how many more there are."""
    order = {stage.value: i for i, stage in enumerate(STAGE_ORDER)}
    found = sorted(found, key=lambda h: order.get(h.stage, len(order)))
    out: list[Hazard] = []
    counts: dict[tuple[str, str], int] = {}
    for h in found:
        key = (h.stage, h.kind)
        counts[key] = counts.get(key, 0) + 1
        if counts[key] <= keep:
            out.append(h)
    for (stage, kind), n in counts.items():
        if n > keep:
            at = max(i for i, h in enumerate(out) if (h.stage, h.kind) == (stage, kind))
            out.insert(at + 1, Hazard(stage=stage, kind=kind, message=f"{n - keep} more place(s) of this kind"))
    return out


def replay(
    path: str | Path,
    *,
    stages: Optional[Sequence[StageId]] = None,
    selection: Selection = Selection(),
    step: Optional[ActorStepId] = None,
    rollout: Optional[int] = None,
    max_divergences: int = 5,
    progress: Optional[ProgressFn] = None,
    rules: Rules = Rules(),
    explain: bool = True,
    shard_runner: Optional[ShardRunner] = None,
) -> ReplayReport:
    """Open (verify) and replay a bundle, cohort or capture directory. The stages start while the reader still
    hashes the safetensors payloads; every checksum is judged before the report is made (SPEC §11)."""
    cpu_window()  # (run.threads.pass_threads) the window opened before the bundle's hashing
    with replay_threads():  # the payloads' loads and upcasts too (run.threads)
        bundles = open_bundle(path, step=step, rollout=rollout, defer_payloads=not selection.empty,
                              defer_checksums=True)
        return run_replay(bundles, stages=stages, selection=selection, max_divergences=max_divergences,
                          progress=progress, rules=rules, explain=explain, shard_runner=shard_runner)
