"""The identity pane's lines: who produced the bundle, with which config, and what it declares.

Part of :mod:`replay_tui.model` (pure data, no Textual)."""

from __future__ import annotations

from typing import Optional, Sequence

from replay_lib.bundle import BundleSet
from replay_lib.bundle.schema import CORE_KNOBS, config_changes
from replay_lib.bundle.selection import group_label
from replay_lib.judge.report import ReplayReport
from replay_lib.safe_text import elided_listing
from replay_lib.stages import StageContext


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
