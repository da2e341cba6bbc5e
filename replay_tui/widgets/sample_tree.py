"""Groups → samples, with status marks, mismatch counts, micro-batch, consumer batch and reward; a diverging-only
filter. A sample (or group) carrying a hazard has ``⚠`` in the tree's first column. Line API: thousands of
samples cost only the visible rows."""

from __future__ import annotations

from typing import ClassVar, Optional, Sequence

from rich.style import Style
from textual.binding import BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.strip import Strip

from replay_lib.safe_text import safe

from ..cells import DIM, FAIL, FAIL_SOFT, PASS, SKIP, WARN, fit, strip_of
from ..hazards import HAZARD_MARK, NO_HAZARDS, HazardMarks
from ..model import TREE_GROUP, TREE_SAMPLE, ReplayModel
from .cursor_lines import CursorLines
from .header_line import HeaderLine
from ..keys import SAMPLES_BINDINGS

GROUP, SAMPLE = TREE_GROUP, TREE_SAMPLE
CB_W = 5  # "~cb-0": the consumer batch column's least width
CB_MAX = 12  # and its most: a longer id is cut (the why strip shows it whole)


class SampleTree(CursorLines):
    DEFAULT_CSS = """
    SampleTree { overflow-y: scroll; }
    """
    PANE = "samples"
    ROW_NOUN = "row"
    BINDINGS: ClassVar[list[BindingType]] = SAMPLES_BINDINGS

    diverging_only: reactive[bool] = reactive(False, init=False)

    class SampleHighlighted(Message):
        def __init__(self, tree: "SampleTree", sample_id: str) -> None:
            super().__init__()
            self.tree = tree
            self.sample_id = sample_id

        @property
        def control(self) -> "SampleTree":
            return self.tree

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.model: Optional[ReplayModel] = None
        self.hazards: HazardMarks = NO_HAZARDS
        self.folded: set[int] = set()
        self.rows: Sequence[tuple[str, int]] = []

    # -- content ----------------------------------------------------------------------------------
    def set_model(self, model: ReplayModel, hazards: HazardMarks = NO_HAZARDS) -> None:
        self.model = model
        self.hazards = hazards
        self.folded = set()
        self._rebuild()

    def _rebuild(self, keep: Optional[tuple[str, int]] = None) -> None:
        model = self.model
        rows = model.tree_rows(self.diverging_only, self.folded) if model is not None else []
        self.rows = rows
        cursor = None
        if keep is not None and keep in rows:
            cursor = rows.index(keep)
        self.set_rows(len(rows), cursor=cursor)

    @property
    def selected_sample(self) -> Optional[str]:
        if self.model is None or not self.rows:
            return None
        kind, i = self.rows[self.cursor]
        return self.model.samples[i].sample_id if kind == SAMPLE else None

    def show_sample(self, sample_id: str) -> bool:
        """Move the cursor to ``sample_id``, unfolding its group (and lifting the filter if it hides it)."""
        model = self.model
        if model is None or sample_id not in model.by_id:
            return False
        si = model.by_id[sample_id]
        if self.diverging_only and not model.samples[si].total_mismatches:
            self.diverging_only = False
        gi = model.group_row_of(si)
        if gi is not None and gi in self.folded:
            self.folded.discard(gi)
            self._rebuild()
        if (SAMPLE, si) in self.rows:
            row = self.rows.index((SAMPLE, si))
            if row != self.cursor:
                self.cursor = row
            return True
        return False

    # -- drawing ----------------------------------------------------------------------------------
    def _columns(self, width: int) -> tuple[int, bool, int, bool]:
        """(id width, show micro-batch, consumer batch width (0: hidden), show reward). The micro-batch shows
        when a sample records one (not a column of "—"). The consumer batch (the PR #65 case is about it) stands
        beside it when the bundle places its samples in consumer batches and the ids keep 5 cells ("s-123"); it
        takes the width its longest id needs (up to ``CB_MAX``) while the ids keep 6, else at least ``CB_W`` (a
        longer id is cut: the why strip shows it whole)."""
        show_mb = width >= 34 and (self.model is None or self.model.has_micro_batches)
        show_reward = width >= 24
        fixed = 4 + (9 if show_mb else 0) + (8 if show_reward else 0) + 5
        cb_w = 0
        if width >= 34 and self.model is not None and self.model.has_consumer_batches and \
                width - fixed - CB_W - 1 >= 5:
            need = min(max(self.model.consumer_batch_width, CB_W), CB_MAX)
            cb_w = max(CB_W, min(need, width - fixed - 1 - 6))
            fixed += cb_w + 1
        return max(4, width - fixed), show_mb, cb_w, show_reward

    def render_header(self, width: int, base: Style) -> Strip:
        idw, show_mb, cb_w, show_reward = self._columns(width)
        parts = [("    " + fit("sample" if idw >= 6 else "id", idw), None)]
        if show_mb:
            parts.append((" " + fit("mb", 8), None))  # the micro-batch; "cb" beside it, the consumer batch
        if cb_w:
            parts.append((" " + fit("cb", cb_w), None))
        if show_reward:
            parts.append((" " + fit("reward", 7, ">"), None))
        parts.append((" " + fit("✗", 4, ">"), None))
        return strip_of(parts, width, base)

    def render_row(self, row: int, width: int, base: Style) -> Strip:
        model = self.model
        kind, i = self.rows[row]
        if kind == GROUP:
            group = model.groups[i]
            arrow = "▸" if i in self.folded else "▾"
            mark, style = ("✗", FAIL) if group.diverging else ("✓", PASS)
            if not any(model.samples[m].compared for m in group.samples):
                mark, style = "·", SKIP
            tail = f"{group.diverging}/{len(group.samples)} diverging" if group.diverging else f"{len(group.samples)} samples"
            hazard = f"{HAZARD_MARK} " if i in self.hazards.groups else ""
            label_w = max(4, width - 4 - len(hazard) - len(tail) - 1)
            parts = [(f"{arrow} ", None), (mark + " ", style), (fit(safe(group.label), label_w), Style(bold=True))]
            if hazard:
                parts += [(" " + hazard, WARN), (tail, FAIL_SOFT if group.diverging else DIM)]
            else:
                parts.append((" " + tail, FAIL_SOFT if group.diverging else DIM))
            return strip_of(parts, width, base)
        s = model.samples[i]
        idw, show_mb, cb_w, show_reward = self._columns(width)
        n = s.total_mismatches
        if not s.compared:
            mark, style = "·", SKIP
        elif n:
            mark, style = "✗", FAIL
        else:
            mark, style = "✓", PASS
        # ids come from the bundle: escaped before they are cut to their column
        hazard = (f"{HAZARD_MARK} ", WARN) if i in self.hazards.samples else ("  ", None)
        parts = [hazard, (mark + " ", style), (fit(safe(s.sample_id), idw), FAIL_SOFT if n else None)]
        if show_mb:
            parts.append((" " + fit(safe(s.micro_batch_id or "—"), 8), DIM))
        if cb_w:
            parts.append((" " + fit(safe(model.consumer_batch(s)), cb_w), DIM))
        if show_reward:
            reward = s.reward if s.reward is not None else s.raw_reward
            parts.append((" " + fit(_short(reward), 7, ">"), None))
        parts.append((" " + fit(str(n) if n else "·", 4, ">"), FAIL_SOFT if n else DIM))
        return strip_of(parts, width, base)

    # -- events and actions -----------------------------------------------------------------------
    def watch_cursor(self, old: int, new: int) -> None:
        super().watch_cursor(old, new)
        sid = self.selected_sample
        if sid is not None:
            self.post_message(self.SampleHighlighted(self, sid))

    def render_line(self, y: int) -> Strip:
        if not self.rows and self.diverging_only and self.model is not None and y == 0:
            # the filter hid every sample: say so rather than show an empty pane
            return strip_of([("  no diverging sample (d shows all)", DIM)], self.row_width,
                            self._base_style or self.rich_style)
        return super().render_line(y)

    def watch_diverging_only(self) -> None:
        keep = self.rows[self.cursor] if self.rows else None
        self._rebuild(keep)
        if self.rows and keep not in self.rows:
            # the highlighted sample was filtered out: go to the first diverging one
            first = next((r for r, (k, _) in enumerate(self.rows) if k == SAMPLE), 0)
            self.cursor = first
        self.post_message(self.FilterChanged(self, self.diverging_only))

    class FilterChanged(Message):
        def __init__(self, tree: "SampleTree", diverging_only: bool) -> None:
            super().__init__()
            self.tree = tree
            self.diverging_only = diverging_only

    def action_toggle_filter(self) -> None:
        self.diverging_only = not self.diverging_only

    def _group_under_cursor(self) -> Optional[int]:
        if not self.rows:
            return None
        kind, i = self.rows[self.cursor]
        if kind == GROUP:
            return i
        return next((g for g, grp in enumerate(self.model.groups) if i in grp.samples), None)

    def action_toggle_group(self) -> None:
        gi = self._group_under_cursor()
        if gi is not None:
            self.action_fold(gi not in self.folded)

    def action_fold(self, fold: bool) -> None:
        gi = self._group_under_cursor()
        if gi is None:
            return
        if fold:
            self.folded.add(gi)
        else:
            self.folded.discard(gi)
        self._rebuild(keep=(GROUP, gi) if fold else self.rows[self.cursor])

    def action_activate(self) -> None:
        if self.rows and self.rows[self.cursor][0] == GROUP:
            self.action_toggle_group()
        else:
            super().action_activate()


def _short(x) -> str:
    if x is None:
        return "—"
    if type(x) is list:  # a per-token reward (format 1.2 / 2.0): its token count
        return f"{len(x)}tok"
    text = f"{x:.4g}"
    return text


class SamplesPanel(Vertical):
    """Column header + tree, in one bordered pane."""

    DEFAULT_CSS = """
    SamplesPanel {
        border: round $panel-lighten-2;
        border-title-color: $text;
        height: 1fr;
        &:focus-within { border: round $accent; }
    }
    """

    def compose(self):
        tree = SampleTree(id="sample-tree")
        yield HeaderLine(tree, id="samples-header")
        yield tree

    def on_mount(self) -> None:
        self.border_title = "Samples"

    def on_sample_tree_filter_changed(self, event: SampleTree.FilterChanged) -> None:
        self.border_title = "Samples · diverging only" if event.diverging_only else "Samples"
