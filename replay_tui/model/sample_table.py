"""The sample tree's rows: samples, their groups and mismatch marks (:class:`SampleRows`, :class:`TreeRows`).

Part of :mod:`replay_tui.model` (pure data, no Textual)."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from replay_lib.bundle.selection import group_label
from replay_lib.judge.compare import list_tensor

from .fields import TREE_GROUP, TREE_SAMPLE

if TYPE_CHECKING:  # the model owns these rows; they only read it back
    from .replay_model import ReplayModel


@dataclass(slots=True)
class SampleRow:
    sample_id: str
    shard: int  # index into ReplayModel.shards
    index: int  # index within the shard's samples
    rank: Optional[int]
    group_index: Optional[int]
    micro_batch_id: Optional[str]
    raw_reward: Optional[float]
    reward: Union[float, list[float], None]  # a list: per-token rewards
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
