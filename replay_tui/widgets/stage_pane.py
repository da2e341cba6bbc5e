"""The stage DAG: every stage with its status, capability, mismatch count, max |error| and max noise ratio
(the largest |a − e| / tolerance), drawn as the chain it is (sample → reward.raw → … → advantage.estimate,
forking into loss.policy / loss.value). The first divergent stage is marked in red."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from rich.style import Style
from rich.text import Text
from textual.binding import BindingType
from textual.containers import Vertical
from textual.strip import Strip
from textual.widgets import Static

from replay_lib.judge.report import STATUS_FAIL, STATUS_PASS, STATUS_SKIPPED, ReplayReport, StageReport
from replay_lib.safe_text import safe

from ..cells import DIM, FAIL, FIRST, PASS, SKIP, fit, fit_number, fit_ratio, strip_of
from .cursor_lines import CursorLines
from .header_line import HeaderLine
from ..keys import STAGES_BINDINGS

# Stages after which the DAG forks: the loss stages hang off the last advantage-side stage.
LEAVES = ("loss.policy", "loss.value", "loss.grad")
FIRST_MARK = " ◀ first"
SHORT_MARK = " ◀"  # the same mark where the pane is narrow (an 80-column terminal)
STATUS_GLYPH = {STATUS_PASS: ("✓", PASS), STATUS_FAIL: ("✗", FAIL)}
DOWNSTREAM_GLYPH = ("↓", DIM)  # a stage that fails (--chain) only because an upstream stage failed
NOISE_W = 6  # the max ×noise column ("×noise", "7.1e4")


@dataclass(frozen=True)
class StageColumns:
    """What a DAG row shows at a width: the name's cells, which columns, the reason's cells, the mark."""

    name: int
    status: bool
    err: bool
    noise: bool
    cap: bool
    reason: int
    mark: str


def dag_gutters(stages: list[str]) -> list[str]:
    """Box-drawing prefix of each stage: a staircase chain, the loss leaves as siblings."""
    out: list[str] = []
    depth = 0
    leaves = [s for s in stages if s in LEAVES]
    chain_len = len(stages) - len(leaves)
    for i, stage in enumerate(stages):
        if i == 0:
            out.append("")
            continue
        if stage in LEAVES and i >= chain_len:
            d = chain_len
            last = stage == leaves[-1]
            out.append(" " * (d - 1) + ("└" if last else "├"))
            continue
        depth = i
        out.append(" " * (depth - 1) + "└")
    return out


class StageList(CursorLines):
    PANE = "stages"
    BINDINGS: ClassVar[list[BindingType]] = STAGES_BINDINGS

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.report: Optional[ReplayReport] = None
        self.gutters: list[str] = []

    def set_report(self, report: ReplayReport) -> None:
        self.report = report
        self.gutters = dag_gutters([s.stage for s in report.stages])
        first = next((i for i, s in enumerate(report.stages) if s.stage == report.first_divergent_stage), 0)
        self.styles.height = len(report.stages)
        self.set_rows(len(report.stages), cursor=first)
        if self.parent is not None:
            for header in self.parent.query(HeaderLine):
                header.refresh()

    @property
    def stage(self) -> Optional[StageReport]:
        if self.report is None or not self.report.stages:
            return None
        return self.report.stages[self.cursor]

    def _columns(self, width: int) -> "StageColumns":
        """The row's columns at ``width``. Narrower panes shorten the first-divergence mark to ``◀``, then
        drop the reason, the capability and the status word (the glyph says it; the detail line below the
        DAG names the capability and the reason), then max |err| (max ×noise says more: how far beyond
        floating-point noise the stage is), then ×noise and the mark; the mismatch count stays (the names
        are cut first)."""
        name_w = max([len(g) + 2 + len(s.stage) for g, s in zip(self.gutters, self.report.stages)] + [10]) + 1
        # the mismatch count always has its 6 cells, and the first divergence its ◀ (names get cut)
        name_w = min(name_w, max(width - 6 - (len(SHORT_MARK) if self.report.first_divergent_stage else 0), 4))
        rest = width - name_w - 6
        mark = ""
        if self.report.first_divergent_stage and rest >= len(SHORT_MARK):
            mark = FIRST_MARK if rest >= len(FIRST_MARK) + NOISE_W + 1 + 9 + 8 + 13 else SHORT_MARK
            name_w += len(mark)
            rest -= len(mark)
        show_noise = rest >= NOISE_W  # "×noise" and its values (+ a space when there is one)
        rest -= NOISE_W + 1 if show_noise else 0
        show_err = rest >= 8  # "max|err|" and its values take 8 cells (+ a space when there is one)
        rest -= 9 if show_err else 0
        show_status = rest >= 8
        rest -= 8 if show_status else 0
        show_cap = rest >= 13
        rest -= 13 if show_cap else 0
        # a reason cut to a few letters is noise
        return StageColumns(name_w, show_status, show_err, show_noise, show_cap,
                            rest - 1 if rest - 1 >= 12 else 0, mark)

    def render_header(self, width: int, base: Style) -> Strip:
        if self.report is None:
            return strip_of([("stage", None)], width, base)
        cols = self._columns(width)
        parts = [(fit("stage", cols.name), None)]
        if cols.status:
            parts.append((fit("status", 8), None))
        parts.append((fit("mism", 5, ">") + " ", None))
        if cols.err:
            parts.append((fit("max|err|", 8, ">") + " ", None))
        if cols.noise:
            parts.append((fit("×noise", NOISE_W, ">") + " ", None))
        if cols.cap:
            parts.append((" " + fit("capability", 12), None))
        if cols.reason:
            parts.append((" " + fit("reason", cols.reason), None))
        return strip_of(parts, width, base)

    def render_row(self, row: int, width: int, base: Style) -> Strip:
        report = self.report
        s = report.stages[row]
        cols = self._columns(width)
        mark = cols.mark
        glyph, gstyle = STATUS_GLYPH.get(s.status, ("○", SKIP))
        if s.downstream_of:  # fails under --chain only because of an upstream stage: not a root cause
            glyph, gstyle = DOWNSTREAM_GLYPH
        first = s.stage == report.first_divergent_stage
        gutter = self.gutters[row]
        room = cols.name - len(gutter) - 2
        label = fit(s.stage + mark if first else s.stage, room)
        if first and len(s.stage) + len(mark) > room:  # a cut name keeps the first-divergence mark after it
            label = fit(s.stage, room - len(mark)) + mark
        parts: list[tuple[str, Optional[Style]]] = [
            (gutter, DIM), (glyph + " ", gstyle),
            (label, FIRST if first else (None if s.status != "skipped" else SKIP)),
        ]
        if cols.status:
            status = {"pass": "pass", "fail": "FAIL", "skipped": "skipped"}.get(s.status, s.status)
            status = "down" if s.downstream_of else status
            parts.append((fit(status, 8), gstyle if s.status != "skipped" else SKIP))
        mism = str(s.mismatches) if s.status != "skipped" else "—"
        parts.append((fit(mism, 5, ">") + " ", FAIL if s.mismatches else DIM))
        if cols.err:
            err = fit_number(s.max_abs_error, 8) if s.max_abs_error is not None else fit("—", 8, ">")
            parts.append((err + " ", FAIL if s.status == STATUS_FAIL else DIM))
        if cols.noise:
            ratio = s.max_noise_ratio if s.status != STATUS_SKIPPED else None
            parts.append((fit_ratio(ratio, NOISE_W) + " ", FAIL if s.status == STATUS_FAIL else DIM))
        if cols.cap:
            parts.append((" " + fit(safe(s.capability or "—"), 12), DIM))
        if cols.reason:  # a reason may name samples, groups and keys of the bundle
            parts.append((" " + fit(safe(s.reason), cols.reason), DIM if s.status != STATUS_FAIL else None))
        return strip_of(parts, width, base)


class StagesPanel(Vertical):
    """Header, DAG rows and the full reason of the highlighted stage."""

    DEFAULT_CSS = """
    StagesPanel {
        border: round $panel-lighten-2;
        height: auto;
        &:focus-within { border: round $accent; }
        #stage-detail { height: 1; color: $text-muted; text-wrap: nowrap; text-overflow: ellipsis; }
    }
    """

    def compose(self):
        stages = StageList(id="stage-list")
        yield HeaderLine(stages, id="stages-header")
        yield stages
        yield Static(id="stage-detail")

    def on_mount(self) -> None:
        self.border_title = "Stages"

    def on_cursor_lines_highlighted(self, event: CursorLines.Highlighted) -> None:
        if isinstance(event.view, StageList):
            self.show_detail(event.view.stage)

    def show_detail(self, stage: Optional[StageReport]) -> None:
        """The highlighted stage's capability, how the report judged it (per-stage teacher forcing or chained,
        ``exact``) and its whole reason, then its hazards' count."""
        detail = self.query_one("#stage-detail", Static)
        # one line of fixed height: repaint that line, never lay the screen out again (a full frame)
        if stage is None:
            detail.update("", layout=False)
            return
        report = self.query_one(StageList).report
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(stage.stage, style="bold")
        how = [safe(stage.capability or "—")]
        if report is not None and stage.status != STATUS_SKIPPED:
            how.append(MODE_NAMES.get(report.mode, safe(report.mode)))
            if report.exact:
                how.append("exact")
        text.append(f" [{' · '.join(how)}]", style="dim")
        if stage.reason:
            text.append(" — " + safe(stage.reason))
        if stage.downstream_of:
            text.append(f" — downstream of {safe(stage.downstream_of)}: passes on its recorded inputs")
        n = sum(1 for h in report.hazards if h.stage == stage.stage) if report is not None else 0
        if n:
            text.append(f"  ⚠ {n} hazard{'s' if n != 1 else ''}", style="bold yellow")
        detail.update(text, layout=False)


# How the report judged its stages (ReplayReport.mode), as the detail line names it: short, so the reason
# after it still shows on an 80-column terminal ("teacher-forced": per-stage teacher forcing, each stage on
# its recorded inputs; "chained": --chain, each on the recomputed outputs before it).
MODE_NAMES = {"per_stage": "teacher-forced", "chained": "chained"}
