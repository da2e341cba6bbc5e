"""Stage ``link`` (SPEC §9): a step bundle against the rollout bundle of its rollout.

The trainer must consume what the rollout produced: for every sample id of the step bundle, its
``advantages`` and ``old_log_probs`` tokens must equal the ones the rollout bundle recorded for the same
sample id. Equal means bit for bit when both payloads have the same dtype (the values were handed over,
not recomputed); when the dtypes differ (a bf16 step payload of a float32 rollout) each token may differ by
the rounding of the coarser one, ``u·|rollout value|``. A sample id the rollout bundle does not hold, or one
whose response length differs, is a structural divergence. The stage is judged with the error model's
:class:`~replay_lib.judge.fields.FieldResult` and :func:`~replay_lib.judge.fields.stage_report`, so its report has the
shape of every other stage; its reason and the row's first divergence name both bundles.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..bundle import BundleSet
from ..bundle.dtypes import keep_stored, stored_dtype
from ..judge.compare import Comparison
from ..judge.error_model import unit_roundoff
from ..judge.fields import PER_TOKEN, FieldResult, stage_report
from ..kernels import segment_offsets
from ..judge.report import Divergence, divergence_line
from ..safe_text import safe

LINK_STAGE = "link"
LINK_FIELDS = ("advantages", "old_log_probs")


def _token_rows(shard) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([max(int(s.response_length), 0) for s in shard.index.samples], dtype=torch.int64)
    return segment_offsets(lengths), lengths


def _flat_payload(shard, name: str) -> Optional[torch.Tensor]:
    if not shard.has_payload(name):
        return None
    t = shard.payload(name)
    return keep_stored(t.reshape(-1), t)


class _RolloutTokens:
    """Where each sample id's tokens are in the rollout bundle's payloads (every rank shard)."""

    def __init__(self, bundles: BundleSet) -> None:
        self.where: dict[str, tuple[int, int, int]] = {}
        self.shards = bundles.shards
        for k, shard in enumerate(bundles.shards):
            offsets, lengths = _token_rows(shard)
            for s, off, n in zip(shard.index.samples, offsets.tolist(), lengths.tolist()):
                self.where.setdefault(s.sample_id, (k, off, n))

    def payload(self, k: int, name: str) -> Optional[torch.Tensor]:
        return _flat_payload(self.shards[k], name)


def link_report(step: BundleSet, rollout: BundleSet, *, step_name: str, rollout_name: str, keep: int = 5):
    """The link :class:`~replay_lib.judge.report.StageReport` of ``step`` against ``rollout``, or ``None`` when
    neither field is recorded on both sides (nothing to compare)."""
    source = _RolloutTokens(rollout)
    fields: list[FieldResult] = []
    structural = Comparison()
    compared_names: list[str] = []
    for shard in step.shards:
        offsets, lengths = _token_rows(shard)
        total = int(lengths.sum())
        samples = shard.index.samples
        sample_ids = [s.sample_id for s in samples]
        ok = torch.ones(len(samples), dtype=torch.bool)
        for i, s in enumerate(samples):
            found = source.where.get(s.sample_id)
            if found is None or found[2] != int(lengths[i]):
                ok[i] = False
                message = (f"sample not in rollout bundle {rollout_name}" if found is None else
                           f"response_length {int(lengths[i])} here, {found[2]} in rollout bundle {rollout_name}")
                structural.mismatches += 1
                structural.bad_samples += 1
                structural.divergences.append(Divergence(stage=LINK_STAGE, rank=shard.rank, sample_id=s.sample_id,
                                                         group_index=s.group_index, field="sample_id",
                                                         message=message))
        for name in LINK_FIELDS:
            actual = _flat_payload(shard, name)
            sources = {source.where[s.sample_id][0] for s in samples if s.sample_id in source.where}
            recorded = {k: source.payload(k, name) for k in sources}
            if actual is None or not recorded or any(v is None for v in recorded.values()):
                continue
            if actual.numel() != total:
                structural.mismatches += 1
                structural.divergences.append(Divergence(
                    stage=LINK_STAGE, rank=shard.rank, field=name, expected=float(total),
                    actual=float(actual.numel()), message=f"payload has {actual.numel()} value(s), "
                                                          f"Σ response_length is {total}"))
                continue
            expected = torch.full((total,), float("nan"), dtype=torch.float64)
            compared = torch.zeros(total, dtype=torch.bool)
            coarse = 0.0
            for i, s in enumerate(samples):
                if not ok[i]:
                    continue
                k, off, n = source.where[s.sample_id]
                src = recorded[k]
                if off + n > src.numel():
                    continue  # the rollout bundle's own replay reports its short payload
                lo = int(offsets[i])
                expected[lo:lo + n] = src[off:off + n].to(torch.float64)
                compared[lo:lo + n] = True
                if stored_dtype(src) != stored_dtype(actual):
                    coarse = max(coarse, unit_roundoff(src), unit_roundoff(actual))
            tolerance = expected.abs() * coarse if coarse else torch.zeros(total, dtype=torch.float64)
            tolerance = torch.nan_to_num(tolerance, nan=0.0)
            fields.append(FieldResult(stage=LINK_STAGE, name=name, per=PER_TOKEN, expected=expected,
                                      actual=actual.to(torch.float64), tolerance=tolerance, sample_ids=sample_ids,
                                      group_indices=[s.group_index for s in samples], offsets=offsets,
                                      lengths=lengths, rank=shard.rank, compared=compared,
                                      note=f"expected: rollout bundle {rollout_name}; actual: step bundle "
                                           f"{step_name}"))
            if name not in compared_names:
                compared_names.append(name)
    if not fields and not structural.mismatches:
        return None
    what = ", ".join(compared_names) or "samples"
    n = sum(len(s.index.samples) for s in step.shards)

    def fail(total: Comparison, per: dict) -> str:
        return (f"{what} of step bundle {step_name} differ from rollout bundle {rollout_name} in "
                f"{total.mismatches} place(s) ({total.bad_samples} sample(s))")

    return stage_report(LINK_STAGE, fields, keep, fail_reason=fail,
                        pass_reason=f"{what} of {n} sample(s) equal rollout bundle {rollout_name}",
                        structural=structural if structural.mismatches else None)


# Other rollout bundles a diverged link looks through for the one whose values the step consumed (nearest first).
MAX_STALE_CANDIDATES = 8


def consumed_from(step: BundleSet, rollout: BundleSet, name: str = "advantages") -> Optional[int]:
    """How many of ``step``'s samples consumed ``rollout``'s ``name`` for the same sample id — every sample the
    rollout holds, each one's values over its loss tokens equal to the rollout's for that sample id (token for
    token where the two responses have the same length; else the one value both broadcast over the sample, as
    GRPO's advantages are) within the rounding of the coarser payload — or ``None`` when not every one does (or
    none is compared)."""
    source = _RolloutTokens(rollout)
    matched = 0
    for shard in step.shards:
        actual = _flat_payload(shard, name)
        if actual is None:
            return None
        offsets, lengths = _token_rows(shard)
        if actual.numel() != int(lengths.sum()):
            return None
        for i, s in enumerate(shard.index.samples):
            found = source.where.get(s.sample_id)
            n = int(lengths[i])
            if found is None or n == 0:
                continue
            k, off, m = found
            src = source.payload(k, name)
            if src is None or off + m > src.numel() or m == 0:
                return None
            lo = int(offsets[i])
            mine = actual[lo:lo + n].to(torch.float64)
            theirs = src[off:off + m].to(torch.float64)
            if m != n:
                if not (bool((mine == mine[0]).all()) and bool((theirs == theirs[0]).all())):
                    return None
                mine, theirs = mine[:1], theirs[:1]
            u = max(unit_roundoff(src), unit_roundoff(actual)) if stored_dtype(src) != stored_dtype(actual) else 0.0
            if not bool(((mine - theirs).abs() <= theirs.abs() * u).all()):
                return None
            matched += 1
    return matched or None


def stale_cause(step: BundleSet, candidates, own_rollout_id: Optional[int]) -> Optional[str]:
    """The cause of a diverged link when the step's advantages are another rollout's (:func:`consumed_from`):
    ``"the consumed advantages are rollout 0's (rollout bundle rollout-0): …"``, or ``None``. ``candidates``:
    scan targets of other rollout bundles, nearest first."""
    from ..bundle import open_bundle
    from ..errors import ReplayError

    for target in list(candidates)[:MAX_STALE_CANDIDATES]:
        try:
            other = open_bundle(target.path)
        except (ReplayError, OSError):
            continue
        n = consumed_from(step, other)
        if n is not None:
            when = "an earlier" if own_rollout_id is not None and target.rollout_id is not None and \
                target.rollout_id < own_rollout_id else "another"
            return safe(f"the consumed advantages are rollout {target.rollout_id}'s (rollout bundle "
                        f"{target.relpath}): each of {n} sample(s) trained on rollout {target.rollout_id}'s "
                        f"advantages for the same sample id, not rollout {own_rollout_id}'s — a stale cache of "
                        f"{when} rollout")
    return None


def link_line(d: Divergence, step_name: str, rollout_name: str) -> str:
    """The row's first-divergence line: the element, then which bundle holds which value (expected: what the
    rollout recorded; actual: what the step consumed)."""
    return safe(f"{divergence_line(d)} (expected: rollout bundle {rollout_name}; actual: step bundle {step_name})")


def check_link(target, step: BundleSet, partner, options):
    """The :class:`~replay_lib.run.scan.LinkResult` of the step bundle ``step`` (already opened and
    verified) against ``partner``, the rollout target of its rollout (a string: why there is none to use)."""
    import msgspec

    from ..errors import ReplayError
    from .rows import STATUS_DIVERGED, STATUS_PASS, LinkResult

    if isinstance(partner, str):
        return LinkResult(target=target, rollout=target, status="skipped", message=safe(partner),
                          step_bundle_id=step.bundle_id)
    from ..bundle import open_bundle

    try:
        rollout = open_bundle(partner.path)
    except (ReplayError, OSError) as exc:
        return LinkResult(target=target, rollout=partner, status="skipped", step_bundle_id=step.bundle_id,
                          message=" ".join(safe(f"rollout bundle {partner.relpath} unusable: {exc}").split()))
    step_name, rollout_name = f"{step.bundle_id} ({target.relpath})", f"{rollout.bundle_id} ({partner.relpath})"
    report = link_report(step, rollout, step_name=step_name, rollout_name=rollout_name,
                         keep=options.max_divergences)
    if report is None:
        return LinkResult(target=target, rollout=partner, status="skipped", step_bundle_id=step.bundle_id,
                          rollout_bundle_id=rollout.bundle_id,
                          message=safe(f"no {' or '.join(LINK_FIELDS)} recorded in both bundles"))
    first = report.divergences[0] if report.divergences else None
    cause = None
    if report.status == "fail":
        cause = stale_cause(step, getattr(partner, "siblings", ()), target.rollout_id)
    return LinkResult(
        target=target, rollout=partner, status=STATUS_DIVERGED if report.status == "fail" else STATUS_PASS,
        first_divergence=link_line(first, step.bundle_id, rollout.bundle_id) if first is not None else None,
        noise_ratio=first.noise_ratio if first is not None else None, message=safe(report.reason),
        stage=msgspec.to_builtins(report), step_bundle_id=step.bundle_id, rollout_bundle_id=rollout.bundle_id,
        cause=cause)
