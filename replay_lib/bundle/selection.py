"""Selection by sample / semantic group / micro-batch, expanded to whole semantic groups (fail closed)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from ..errors import SelectionError, UsageError
from .schema import ActorStepId, BundleIndex


@dataclass(frozen=True)
class Selection:
    samples: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    batches: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.samples or self.groups or self.batches)


def parse_step(text: str) -> ActorStepId:
    m = re.match(r"^\s*(-?\d+):(-?\d+)\s*$", text or "")
    if not m:
        raise UsageError(f"--step expects ROLLOUT_ID:STEP_ID (e.g. 120:0), got {text!r}")
    return ActorStepId(rollout_id=int(m.group(1)), step_id=int(m.group(2)))


def parse_rollout(text: str) -> int:
    if not re.match(r"^\s*-?\d+\s*$", text or ""):
        raise UsageError(f"--rollout expects an integer rollout id, got {text!r}")
    return int(text)


def parse_group(text: str) -> int:
    """``g-1``, ``1``, or a negative index as :func:`group_label` writes it (``g(-1)``) or bare (``-1``)."""
    m = re.match(r"^(?:g-)?(\d+)$|^(?:g\((-\d+)\)|(-\d+))$", text.strip())
    if not m:
        raise SelectionError(f"--group expects a semantic group like g-1 (or 1), got {text!r}")
    return int(next(g for g in m.groups() if g is not None))


def group_label(group_index: Optional[int]) -> str:
    """``g-3``; a negative index (the schema allows one) ``g(-1)``, never ``g--1``; ``-`` for none."""
    if group_index is None:
        return "-"
    if isinstance(group_index, str):  # an identity's semantic group id may be a string (format 2.0 writes them so)
        return f"g-{group_index}"
    return f"g-{group_index}" if group_index >= 0 else f"g({group_index})"


@dataclass
class Resolution:
    indices: list[int]
    partial: bool
    matched: set[str] = field(default_factory=set)


def resolve_selection(index: BundleIndex, selection: Selection, where: str = "", strict: bool = True) -> Resolution:
    """Indices (index order) of the semantic-group closure of ``selection``.

    A selected sample without ``group_index`` fails closed: its group can't be known, and a group is
    never inferred from a batch. With ``strict`` an unknown id or an empty batch is an error too; a
    cohort caller passes ``strict=False`` per rank and checks the union (``matched``) itself.
    """
    samples = index.samples
    if selection.empty:
        return Resolution(list(range(len(samples))), partial=False)
    prefix = f"{where}: " if where else ""
    by_id = {s.sample_id: i for i, s in enumerate(samples)}
    chosen: list[int] = []
    matched: set[str] = set()
    for sid in selection.samples:
        if sid in by_id:
            chosen.append(by_id[sid])
            matched.add(f"sample:{sid}")
        elif strict:
            raise SelectionError(f"{prefix}--sample {sid}: no such sample in the bundle")
    groups: set[int] = set()
    for g in selection.groups:
        gi = parse_group(g)
        if any(s.group_index == gi for s in samples):
            groups.add(gi)
            matched.add(f"group:{g}")
        elif strict:
            raise SelectionError(f"{prefix}--group {g}: no sample belongs to semantic group {gi}")
    for b in selection.batches:
        members = [i for i, s in enumerate(samples) if s.micro_batch_id == b]
        if members:
            chosen.extend(members)
            matched.add(f"batch:{b}")
        elif strict:
            raise SelectionError(f"{prefix}--batch {b}: empty or unknown micro-batch (no sample has micro_batch_id={b!r})")
    for i in chosen:
        gi = samples[i].group_index
        if gi is None:
            raise SelectionError(
                f"{prefix}$.samples[{i}].group_index: sample {samples[i].sample_id!r} has no semantic group; "
                f"refusing to infer one (selection fails closed)"
            )
        groups.add(gi)
    closure = [i for i, s in enumerate(samples) if s.group_index is not None and s.group_index in groups]
    partial = len(closure) != len(samples)
    return Resolution(closure, partial=partial, matched=matched)


def selection_keys(selection: Selection) -> set[str]:
    return (
        {f"sample:{s}" for s in selection.samples}
        | {f"group:{g}" for g in selection.groups}
        | {f"batch:{b}" for b in selection.batches}
    )
