"""Where the report's hazards (SPEC §5.1) sit in the debugger's model: which sample rows and group rows carry
one (the sample tree marks them) and the line each hazard is shown as. Pure data, no Textual.

A hazard names a sample (``sample_id``) or a semantic group (``group_index``, on its ``rank`` in a cohort:
each rank normalizes its own groups); a group's hazard marks the group row and every sample in it. A hazard
naming neither (a summary of further places) marks nothing and is only listed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from replay_lib.judge.report import Hazard, hazard_line

from .model import ReplayModel

HAZARD_MARK = "⚠"


@dataclass(frozen=True)
class HazardRow:
    """One hazard as the hazard list shows it: its escaped line (the text report's, ``reward.post_process
    near_zero_std g-1: …``) and where it points."""

    line: str
    hazard: Hazard
    sample: Optional[int]  # the sample row to open: the hazard's sample, or its group's first sample
    group: Optional[int]  # the group row of a group hazard


@dataclass(frozen=True)
class HazardMarks:
    rows: tuple[HazardRow, ...]
    samples: frozenset[int]  # sample rows (ReplayModel.samples) carrying a hazard
    groups: frozenset[int]  # group rows (ReplayModel.groups) carrying one

    def __len__(self) -> int:
        return len(self.rows)

    def stage_count(self, stage: str) -> int:
        return sum(1 for r in self.rows if r.hazard.stage == stage)


NO_HAZARDS = HazardMarks(rows=(), samples=frozenset(), groups=frozenset())


def hazard_marks(model: ReplayModel) -> HazardMarks:
    """The report's hazards placed on the model's rows: O(samples + groups + hazards), so a step with
    thousands of zero-std groups costs its first frame one dictionary, not a scan per hazard."""
    hazards = model.report.hazards
    if not hazards:
        return NO_HAZARDS
    multi = model.multi_rank
    group_rows: dict[tuple[Optional[int], Optional[int]], list[int]] = {}
    # the rows of the groups a hazard names (a few of a step's thousands)
    named = {h.group_index for h in hazards if h.sample_id is None and h.group_index is not None}
    for gi, group in enumerate(model.groups if named else ()):
        if group.group_index in named:
            group_rows.setdefault((group.rank, group.group_index), []).append(gi)
            group_rows.setdefault((None, group.group_index), []).append(gi)  # a hazard without a rank: every rank's
    rows: list[HazardRow] = []
    samples: set[int] = set()
    groups: set[int] = set()
    for h in hazards:
        sample = group = None
        if h.sample_id is not None:
            sample = model.by_id.get(h.sample_id)
            if sample is not None:
                samples.add(sample)
        elif h.group_index is not None:
            found = group_rows.get((h.rank if multi else None, h.group_index), [])
            for gi in found:
                groups.add(gi)
                samples.update(model.groups[gi].samples)
            if found:
                group = found[0]
                members = model.groups[group].samples
                sample = members[0] if members else None
        # the text report's line (escaped there), without its "hazard: " (the list is titled Hazards)
        line = hazard_line(h, multi).removeprefix("hazard: ")
        rows.append(HazardRow(line=line, hazard=h, sample=sample, group=group))
    return HazardMarks(rows=tuple(rows), samples=frozenset(samples), groups=frozenset(groups))
