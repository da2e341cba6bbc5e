"""``reward.post_process`` hypotheses: normalization over the wrong sets, and the std / eps variants.

Partitions (PR #65 and its cousins), each normalized as the config says (std on or off, its eps):

* **consumer batches** — the transfer batches that delivered the samples. A sample's batch is its
  ``consumer_batch_id`` when the records carry one; else the identity's ``consumer_batch_ids`` taken as
  consecutive batches of the index, in order, each ``⌈n / k⌉`` samples but the last (the way a consumer takes
  a stream: ``k`` ids for ``n`` samples; no such layout, no hypothesis);
* **micro-batches** — the samples' ``micro_batch_id``;
* **the whole batch** — one mean over every sample (slime#2230's fallback for uneven groups);
* **consecutive chunks of c samples** — a fixed stride instead of the groups (AReaL#1419), for ``c`` the
  config's ``n_samples_per_prompt``, each group size found, 1.5 and 2…8 times ``n``, and the powers of two.

A partition equal to another one earlier in this list is tried once, and one equal to the semantic groups not
at all; at most :data:`MAX_PARTITIONS` are tried (of :data:`MAX_LAYOUTS` consumer-batch placements and
:data:`MAX_CHUNK_SIZES` chunk sizes listed). Each is made with its sets numbered in order of first appearance, so
telling two apart, and normalizing over one, takes linear passes over the samples and no sort: the work is linear
in the samples per partition, and the sorts are the semantic groups' own (two, whatever the number of partitions). Then, on the semantic groups: std normalization switched (on ↔ off), the biased (ddof = 0) std, another
eps (1e-4 TRL, 1e-5 AReaL, 1e-8, 1e-9 OpenRLHF, 0), and the raw rewards passed through unnormalized. Positions
are those of the bundle's whole index and every hypothesis is evaluated over all of it, so a partial selection
keeps each sample's batch and each batch's statistics.

Each is evaluated in float64 with its own rounding bound (``error_model.reward_bound`` of its sets).

And under any group-centred rule (leave-one-out, NeMo-RL's zero-std and singleton rules included): the other
baseline, the rest of the rule as declared, over every group and over the diverging groups alone
(:func:`baseline_hypotheses`), judged with the stage's own tolerance.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterator, Optional

import torch

from ..judge.compare import as_float64
from ..judge.error_model import GroupStats, group_stats, reward_bound
from ..judge.fields import FieldResult
from ..kernels import grpo_std_scope
from ..bundle.selection import group_label
from ..stages import StageContext
from .base import Hypothesis, fmt_number, listing, micro_batches

STAGE = "reward.post_process"
OTHER_EPS = (1e-6, 1e-4, 1e-5, 1e-8, 1e-9, 0.0)
MAX_CHUNK_SIZES = 64  # chunk sizes listed
MAX_LAYOUTS = 16  # placements of the identity's consumer batch ids (batch sizes) listed
MAX_PARTITIONS = 48  # distinct partitions tried, in the order listed (module doc)


def normalize(raw: torch.Tensor, labels: torch.Tensor, std: bool, eps: float, unbiased: bool = True,
              stats: Optional[GroupStats] = None) -> torch.Tensor:
    """float64 group normalization of ``raw`` over the sets ``labels``: ``r − mean``, divided by ``std + eps``
    (unbiased or population std) when ``std``. ``stats``: ``group_stats(raw, labels)`` when the caller has it
    (its sets are then not found a second time)."""
    if stats is None:
        _, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
        size = counts.to(torch.float64)
    else:
        inverse, size = stats.inverse, stats.size
    k = size.numel()
    mean = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, raw) / size
    centered = raw - mean[inverse]
    if not std:
        return centered
    var = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, centered * centered) / (size - (1 if unbiased else 0))
    return centered / (var.sqrt()[inverse] + eps)


def first_seen(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` renumbered ``0, 1, …`` in the order each set first appears: the canonical form of a
    partition (two labelings of the same samples put them into the same sets exactly when their canonical
    forms are equal). One sort of the labels."""
    n = labels.numel()
    if n == 0:
        return labels.to(torch.int64)
    _, inverse = torch.unique(labels, return_inverse=True)
    k = int(inverse.max()) + 1
    first = torch.full((k,), n, dtype=torch.int64).scatter_reduce_(0, inverse, torch.arange(n), reduce="amin")
    rank = torch.empty(k, dtype=torch.int64)
    rank[torch.argsort(first)] = torch.arange(k)
    return rank[inverse]


def is_first_seen(labels: torch.Tensor) -> bool:
    """Whether ``labels`` are already in :func:`first_seen` form (each label at most one more than every label
    before it, the first 0): one linear pass, no sort."""
    if labels.numel() == 0:
        return True
    before = torch.cummax(labels, 0).values[:-1] + 1
    return int(labels[0]) == 0 and bool((labels[1:] <= before).all())


def same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two labelings of the same samples put them into the same sets."""
    return bool(torch.equal(first_seen(a), first_seen(b)))


def recorded_consumer_batch(sample) -> Optional[str]:
    """A sample record's own ``consumer_batch_id`` (SPEC §3), ``None`` when it records none."""
    b = getattr(sample, "consumer_batch_id", None)
    return b if isinstance(b, str) else None


def consumer_batches(ctx: StageContext) -> Optional[tuple[list[str], torch.Tensor]]:
    """``(batch ids, the batch of every sample of the index)`` (module doc), ``None`` when it cannot be placed."""
    placed = consumer_batch_layouts(ctx, first_only=True)
    return (placed[0][0], placed[0][1]) if placed else None


def consumer_batch_layouts(ctx: StageContext, first_only: bool = False
                           ) -> list[tuple[list[str], torch.Tensor, Optional[int]]]:
    """Every placement of the samples in the recorded consumer batches: ``(batch ids, the batch of every sample,
    batch size)`` — the samples' own ``consumer_batch_id`` (size ``None``; the ids in order of first appearance),
    else the identity's k batch ids over consecutive batches of each size ``c`` that makes k of them, the last one
    shorter (12 samples in 3 batches: 4 + 4 + 4, or 5 + 5 + 2), the even split first, at most
    :data:`MAX_LAYOUTS` of them (``first_only``: that one alone). Every label is numbered in order of first
    appearance (:func:`first_seen`'s canonical form); linear in the samples."""
    samples = ctx.reader.index.samples
    own = [recorded_consumer_batch(s) for s in samples]
    if samples and None not in own:
        where: dict[str, int] = {}
        labels = [where.setdefault(b, len(where)) for b in own]
        return [(list(where), torch.tensor(labels, dtype=torch.int64), None)]
    ids = [str(b) for b in ctx.reader.index.identity.consumer_batch_ids]
    n, k = len(samples), len(ids)
    if k < 2 or k > n:
        return []
    first = math.ceil(n / k)
    if math.ceil(n / first) != k:  # no size makes k batches (each larger one makes fewer)
        return []
    # (the views' consumer-batch column reads the even split alone: no other size is made for it)
    if first_only:
        sizes = [first]
    else:  # the sizes c with ⌈n / c⌉ = k: from ⌈n / k⌉ up to the last c with (k − 1)·c < n
        last = (n - 1) // (k - 1)
        sizes = list(range(first, min(last, first + MAX_LAYOUTS - 1) + 1))
    return [(ids, torch.arange(n, dtype=torch.int64) // c, c) for c in sizes]


def _chunk_sizes(ctx: StageContext, n_total: int, groups: torch.Tensor) -> list[int]:
    """The chunk sizes tried (module doc), smallest first, at most :data:`MAX_CHUNK_SIZES`; ``groups`` in
    :func:`first_seen` form."""
    n = max(int(ctx.config.n_samples_per_prompt), 1)
    sizes = {n, n + n // 2, *(k * n for k in range(2, 9))}
    if groups.numel():
        sizes |= set(torch.bincount(groups).unique().tolist())
    p = 2
    while p < n_total:
        sizes.add(p)
        p *= 2
    return sorted(c for c in sizes if 2 <= c < n_total)[:MAX_CHUNK_SIZES]


def partitions(ctx: StageContext, groups: torch.Tensor,
               aliases: Optional[dict[str, list[str]]] = None) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(id, what the sets are, labels)`` of each partition of the whole index worth trying, each distinct one
    once and none equal to the semantic groups, at most :data:`MAX_PARTITIONS` (``groups``: the semantic group
    of every sample of the index). Each labeling is in :func:`first_seen` form, so two are the same partition
    exactly when they are equal: a candidate is compared (``torch.equal``, linear) only with those of the same
    digest — the work is linear in the samples per candidate, whatever the number already found. ``aliases``:
    when given, ``aliases[id]`` says when the partition yielded as ``id`` is also the chunks of the config's
    ``n_samples_per_prompt`` (or of the mean group size when the groups are uneven) (groups recovered by a fixed stride, AReaL#1419's class: an inferred consumer-batch
    layout can have the same sets, and both names are then true)."""
    n_total = len(ctx.reader.index.samples)
    positions = torch.arange(n_total)
    found: dict[bytes, list[tuple[torch.Tensor, Optional[str]]]] = {}
    stride: Optional[str] = None  # the one alias worth saying (below)

    def new(labels: torch.Tensor, pid: Optional[str] = None, what: str = "") -> Optional[torch.Tensor]:
        """``labels`` in :func:`first_seen` form when no partition found so far has the same sets, else ``None``
        (and ``what`` noted as an alias of the earlier one)."""
        if not is_first_seen(labels):  # each listed below is made in that form: a sort only if one is not
            labels = first_seen(labels)
        key = hashlib.blake2b(labels.contiguous().numpy().tobytes(), digest_size=16).digest()
        same = found.setdefault(key, [])
        for seen, seen_pid in same:
            if torch.equal(labels, seen):
                if aliases is not None and seen_pid is not None and pid == stride:
                    aliases.setdefault(seen_pid, []).append(f"groups recovered by a fixed stride of "
                                                            f"{per_what}{n_per}")
                return None
        same.append((labels, pid))
        return labels

    semantic = new(groups)
    # AReaL#1419's class: chunks of n_samples_per_prompt, or with uneven groups (n = 0) of the mean group size when
    # it is whole (the groups counted on their first-seen numbering: no sort)
    n_groups = int(semantic.max()) + 1 if semantic is not None and semantic.numel() else 0
    n_per = ctx.config.n_samples_per_prompt or (n_total // n_groups if n_groups and n_total % n_groups == 0 else 0)
    per_what = "n_samples_per_prompt=" if ctx.config.n_samples_per_prompt else "the mean group size, "
    stride = f"reward.chunks_of_{n_per}"

    def listed() -> Iterator[tuple[str, str, torch.Tensor]]:  # each made when its turn comes
        for i, (ids, labels, size) in enumerate(consumer_batch_layouts(ctx)):
            if i == 0:
                yield "reward.consumer_batches", f"consumer batches {listing(ids)}", labels
            else:  # a batch size that does not divide the samples
                last = n_total - size * (len(ids) - 1)
                yield (f"reward.consumer_batches_of_{size}", f"consumer batches {listing(ids)} of {size} samples "
                       f"(the last of {last})", labels)
        mb = micro_batches(ctx.reader.index.samples)  # numbered in order of first appearance
        if mb is not None:
            yield "reward.micro_batches", f"micro-batches {listing(mb[0])}", mb[1]
        yield "reward.whole_batch", f"the whole batch of {n_total} samples", torch.zeros_like(positions)
        for c in _chunk_sizes(ctx, n_total, semantic):
            yield f"reward.chunks_of_{c}", f"consecutive chunks of {c} samples", positions // c

    tried = 0
    for pid, what, labels in listed():
        if tried == MAX_PARTITIONS:
            return
        labels = new(labels, pid, what)
        if labels is not None:
            tried += 1
            yield pid, what, labels


def modelled(cfg) -> bool:
    """Whether the declared normalization is the one these hypotheses vary: GRPO's group mean (and std + eps),
    no leave-one-out baseline, zero-std or singleton rule, batch std, nor KL in the reward (those configurations get no
    reward hypotheses rather than ones built on the wrong formula)."""
    return (cfg.advantage_estimator == "grpo" and cfg.rewards_normalization and cfg.group_baseline == "mean"
            and cfg.std_zero == "eps" and cfg.singleton_group is None and cfg.kl_in_reward is None
            and grpo_std_scope(cfg) == "group")


BASELINE_WORDS = {"mean": "the group mean", "leave_one_out": "the leave-one-out mean of the other samples"}


def baseline_hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    """The other group baseline (the mean ↔ leave-one-out), the rest of the declared rule kept (std, eps, the
    zero-std and singleton rules: ``kernels.group_rule``): over every group, and — when only some groups diverge —
    over those groups alone, the others as declared (a trainer that took another code path for some prompts).
    Any configuration that centers its rewards on a group, KL in the reward excepted (its score is not the raw
    reward)."""
    from dataclasses import replace

    from ..kernels.reward import group_rule, post_process

    cfg = ctx.config
    rule = group_rule(cfg)
    field = next((f for f in fields if f.name == "reward"), None)
    samples = ctx.reader.index.samples
    if field is None or not rule.center or cfg.kl_in_reward is not None or any(s.group_index is None for s in samples):
        return []
    raw = as_float64([s.raw_reward for s in samples])
    if not bool(torch.isfinite(raw).all()):
        return []
    groups = torch.tensor([s.group_index for s in samples], dtype=torch.int64)
    other = "mean" if rule.baseline == "leave_one_out" else "leave_one_out"
    values = post_process(raw, groups, replace(rule, baseline=other), dtype=torch.float64)
    if ctx.partial:
        pick = torch.tensor(ctx.indices, dtype=torch.int64)
        values, groups = values[pick], groups[pick]
    declared = f"config: {rule.baseline} baseline"
    out = [Hypothesis(stage=STAGE, id=f"reward.baseline_{other}", values={"reward": values}, detail=(
        f"the recorded rewards equal group normalization around {BASELINE_WORDS[other]} ({declared})"))]
    if rule.baseline == "leave_one_out" and not rule.std:
        # the leave-one-out mean with the sample itself left in the sum: r − Σ_group r / (n − 1)
        mine = raw[pick] if ctx.partial else raw  # (a selection is closed under groups: its groups are whole)
        _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
        total = torch.zeros(counts.numel(), dtype=torch.float64).index_add_(0, inverse, mine)
        out.append(Hypothesis(stage=STAGE, id="reward.loo_self_included", values={"reward": torch.where(
            counts[inverse] > 1, mine - total[inverse] / (counts[inverse] - 1).clamp(min=1), mine)}, detail=(
            "the recorded rewards equal a leave-one-out baseline that divides the whole group's sum by n − 1 (the "
            "sample itself left in the sum: r − Σ_group r / (n − 1))")))
    bad = field.bad
    wrong = sorted({int(g) for g in groups[bad].tolist()})
    if wrong and len(wrong) < len(set(groups.tolist())):
        inside = torch.isin(groups, torch.tensor(wrong, dtype=torch.int64))
        mixed = torch.where(inside, values, field.actual)
        names = listing([group_label(g) for g in wrong])
        out.append(Hypothesis(stage=STAGE, id=f"reward.baseline_{other}_in_groups", values={"reward": mixed}, detail=(
            f"the recorded rewards of {names} equal group normalization around {BASELINE_WORDS[other]} ({declared}; "
            f"the other groups as declared)")))
    return out


def kl_sign_hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    """With the KL in the score (``kl_in_reward="sequence"``): the penalty added instead of subtracted — the
    declared rule applied to ``r + kl_coef·Σ kl`` (the stage's own KL: the recorded payload, or under ``--chain``
    the recomputed one), judged within the field's tolerance."""
    from ..kernels import group_rule, post_process, sequence_kl_score
    from ..stages.reward import _reward_kl, score_groups

    cfg = ctx.config
    if cfg.kl_in_reward != "sequence" or cfg.kl_coef == 0 or not any(f.name == "reward" for f in fields):
        return []
    rule = group_rule(cfg)
    if rule.center and None in ctx.group_indices:
        return []
    flipped = sequence_kl_score(ctx.raw_rewards, _reward_kl(ctx).kl, ctx.loss_mask, ctx.lengths, -cfg.kl_coef,
                                dtype=torch.float64)
    values = post_process(flipped, score_groups(ctx), rule, dtype=torch.float64)
    return [Hypothesis(stage=STAGE, id="reward.kl_sign", values={"reward": values}, detail=(
        f"the recorded rewards equal the KL penalty added to the score, r + {fmt_number(cfg.kl_coef)}·Σ kl "
        f"(config: r − {fmt_number(cfg.kl_coef)}·Σ kl)"))]


def hypotheses(ctx: StageContext, fields: list[FieldResult]) -> list[Hypothesis]:
    """Each evaluated over the bundle's whole index (a partition may span samples outside a selection; the
    selection is closed under semantic groups, so the group variants are the same either way), then read at
    the selected samples."""
    samples = ctx.reader.index.samples
    cfg = ctx.config
    if not modelled(cfg) or not any(f.name == "reward" for f in fields) or any(s.group_index is None for s in samples):
        return baseline_hypotheses(ctx, fields) + kl_sign_hypotheses(ctx, fields)
    raw = as_float64([s.raw_reward for s in samples])
    if not bool(torch.isfinite(raw).all()):
        return []
    groups = torch.tensor([s.group_index for s in samples], dtype=torch.int64)
    pick = torch.tensor(ctx.indices, dtype=torch.int64) if ctx.partial else None
    std, eps = cfg.grpo_std_normalization, float(cfg.grpo_std_eps)
    unbiased = bool(cfg.grpo_std_unbiased)
    out: list[Hypothesis] = []

    semantic = group_stats(raw, groups)  # the sets of a partition are found once (one sort), not per hypothesis

    def add(hid: str, detail: str, labels: torch.Tensor, h_std: bool, h_eps: float, h_unbiased: bool) -> None:
        stats = semantic if labels is groups else group_stats(raw, labels, dense=True)  # partitions() numbers them
        values = normalize(raw, labels, h_std, h_eps, h_unbiased, stats=stats)
        bound = reward_bound(raw, stats, values, h_std, h_eps)
        if pick is not None:
            values, bound = values[pick], bound[pick]
        out.append(Hypothesis(stage=STAGE, id=hid, detail=detail, values={"reward": values}, bounds={"reward": bound}))

    aliases: dict[str, list[str]] = {}
    for pid, what, labels in partitions(ctx, groups, aliases):
        add(pid, f"the recorded rewards equal group normalization over {what} (not semantic groups)", labels,
            std, eps, unbiased)
    for h in out:  # a partition listed twice under two names (partitions() tries it once): both are said
        if aliases.get(h.id):
            h.detail = h.detail.removesuffix(" (not semantic groups)") + (
                f" — the same sets as {' and as '.join(aliases[h.id])} (not semantic groups)")
    config_std = f"config: grpo_std_normalization={'true' if std else 'false'}"
    if std:
        add("reward.std_off", f"the recorded rewards equal group normalization without the std division ({config_std})",
            groups, False, eps, unbiased)
        kind = "biased (population, ddof=0)" if unbiased else "unbiased (ddof=1)"
        add("reward.biased_std" if unbiased else "reward.unbiased_std",
            f"the recorded rewards equal group normalization with the {kind} std", groups, True, eps, not unbiased)
        for other in OTHER_EPS:
            if other != eps:
                add(f"reward.eps_{fmt_number(other)}", f"the recorded rewards equal group normalization with eps "
                    f"{fmt_number(other)} (config: {fmt_number(eps)})", groups, True, other, unbiased)
    else:
        add("reward.std_on", f"the recorded rewards equal group normalization with the std division ({config_std})",
            groups, True, eps, unbiased)
    selected = raw[pick] if pick is not None else raw
    out.append(Hypothesis(stage=STAGE, id="reward.unnormalized",
                          detail="the recorded rewards are the raw rewards, not normalized",
                          values={"reward": selected}, bounds={"reward": torch.zeros_like(selected)}))
    return out + baseline_hypotheses(ctx, fields)
