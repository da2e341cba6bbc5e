"""The debugger screen: verdict, identity, stage DAG, sample tree and diff viewer.

State lives here (``sample_id``, ``field``); the panes get model objects and post messages up."""

from __future__ import annotations

from typing import ClassVar, Optional

from textual import events
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical
from textual.reactive import Reactive
from textual.screen import Screen
from textual.widget import Widget

from replay_lib.judge.report import STATUS_SKIPPED
from replay_lib.safe_text import safe

from ..hazards import NO_HAZARDS, HazardMarks, hazard_marks
from ..model import KIND_SAMPLE, KIND_TOKEN, ReplayModel, field_for_divergence, FIELD_BY_NAME, FIELD_BY_STAGE
from ..export import ExportRequest, default_export_path, export_field
from ..widgets.cursor_lines import CursorLines
from ..widgets.diff_view import DiffPanel, DiffView, worst_row
from ..widgets.header_line import ForensicLabel
from ..widgets.identity_pane import IdentityPane
from ..widgets.key_bar import KeyBar
from ..widgets.sample_tree import SamplesPanel, SampleTree
from ..widgets.stage_pane import StageList, StagesPanel
from ..widgets.status_bar import TitleBar, VerdictBar
from .export import ExportScreen
from .find import FindScreen, is_number
from .hazards import HazardsScreen
from ..keys import MAIN_BINDINGS

PANES = ("stages", "samples", "diff", "identity")
# The identity pane is shown by default only when the terminal is tall enough for it.
IDENTITY_MIN_HEIGHT = 32
# The diff gets the width first: its borders and scrollbar (3), the mark and the key (2 + the key's cells: 6 for a
# sample id or an offset, up to 28 for a table of loss fields) and the three numbers with 8 cells each, the width
# of the header "expected" (3 × (1 + 8)) — the recorded value beside the recomputed one and its error. The left
# column takes what is left, up to its usual width (30 narrow, 40 wide) and down to LEFT_MIN.
DIFF_MIN_WIDTH = 3 + 2 + 6 + 3 * 9
LEFT_MIN = 20


class DebuggerScreen(Screen, inherit_bindings=False):
    DEFAULT_CSS = """
    DebuggerScreen { layout: vertical; }
    DebuggerScreen #body { height: 1fr; }
    DebuggerScreen #left { width: 40; }
    DebuggerScreen.-narrow #left { width: 30; }
    DebuggerScreen #right { width: 1fr; }
    DebuggerScreen.-short #left StagesPanel, DebuggerScreen.-tiny #left StagesPanel { height: auto; }
    /* the identity pane shown on a short terminal (4) leaves the samples a few rows */
    DebuggerScreen.-short #left IdentityPane, DebuggerScreen.-tiny #left IdentityPane { max-height: 30%; }
    DebuggerScreen.-short SamplesPanel, DebuggerScreen.-tiny SamplesPanel { min-height: 5; }
    DebuggerScreen.-short SupportStrip { height: 1; }
    DebuggerScreen.-short ErrorStrip { height: 1; }
    /* two rows each for the formula and its inputs: the second line wraps, not cut (80×24) */
    DebuggerScreen.-short WhyStrip { height: 4; }
    DebuggerScreen.-short #stage-detail { display: none; }
    DebuggerScreen.-tiny SupportStrip { height: 1; }
    DebuggerScreen.-tiny ErrorStrip { height: 1; }
    DebuggerScreen.-tiny WhyStrip { height: 1; }
    DebuggerScreen.-tiny #stage-detail { display: none; }
    DebuggerScreen.-tiny StageList { max-height: 4; }
    """
    # A focus change repaints the panes whose focus style changes (their borders), not the whole screen:
    # Textual's own ``Screen.focused`` repaints every cell (≈ 22 kB at 120×40 over an SSH link per Tab).
    focused: Reactive[Optional[Widget]] = Reactive(None, repaint=False)
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    # Below 32 rows the DAG moves under the samples (compose, _place_stages), the strips under and over the
    # diff rows take fewer lines and the line under the DAG goes (every stage row stays: the verdict names the
    # first divergence); below 22 the DAG scrolls, its cursor on the first divergence.
    VERTICAL_BREAKPOINTS = [(0, "-tiny"), (22, "-short"), (32, "-tall")]

    BINDINGS: ClassVar[list[BindingType]] = MAIN_BINDINGS

    def __init__(self, name: str) -> None:
        super().__init__()
        self.bundle_name = name
        self.model: Optional[ReplayModel] = None
        self.hazards: HazardMarks = NO_HAZARDS
        self.sample_id: Optional[str] = None
        self.field: Optional[str] = None
        self.identity_pref: Optional[bool] = None
        self.ready = False

    def compose(self):
        yield TitleBar(id="title")
        yield VerdictBar(id="verdict")
        with Horizontal(id="body"):
            # a short terminal puts the DAG under the samples (whose pane would keep empty rows) and gives the
            # diff the right column's whole height (see _place_stages)
            short = self.app.size.height < IDENTITY_MIN_HEIGHT
            with Vertical(id="left"):
                yield IdentityPane(id="identity")
                yield SamplesPanel(id="samples")
                if short:
                    yield StagesPanel(id="stages")
            with Vertical(id="right"):
                if not short:
                    yield StagesPanel(id="stages")
                yield DiffPanel(id="diff")
        yield KeyBar()

    def on_mount(self) -> None:
        self._fit_identity(self.app.size.height)  # before the first layout, not after it
        self._fit_left(self.app.size.width)
        self.query_one(TitleBar).show(self.bundle_name)
        self.query_one(DiffPanel).show(None, message="replaying…")
        self.set_focus(self.query_one(DiffView))
        if self.app.model is not None:
            # The replay finished before the first frame (the app's start-up grace): the first
            # layout is already the result's.
            self.ready = True
            self.load(self.app.model)
            return
        self.show_progress(*self.app.progress)
        self.call_after_refresh(self._ready)

    def _ready(self) -> None:
        self.ready = True
        if self.app.model is not None:
            with self.app.batch_update():
                self.load(self.app.model)
        elif self.app.progress is not None:
            self.show_progress(*self.app.progress)

    # -- panes ------------------------------------------------------------------------------------
    @property
    def stage_list(self) -> StageList:
        return self.query_one(StageList)

    @property
    def tree(self) -> SampleTree:
        return self.query_one(SampleTree)

    @property
    def diff_view(self) -> DiffView:
        return self.query_one(DiffView)

    @property
    def diff_panel(self) -> DiffPanel:
        return self.query_one(DiffPanel)

    # Panes take the focus with Screen.set_focus (at once), not Widget.focus (deferred): a key typed
    # right after "2" must reach the pane "2" selected.
    def pane_widget(self, name: str) -> Widget:
        return {"stages": self.stage_list, "samples": self.tree, "diff": self.diff_view,
                "identity": self.query_one(IdentityPane)}[name]

    def focused_pane(self) -> Optional[str]:
        for name in PANES:
            if self.pane_widget(name).has_focus:
                return name
        return None

    def _visible_panes(self) -> list[str]:
        return [p for p in PANES if p != "identity" or self.query_one(IdentityPane).display]

    # -- loading ----------------------------------------------------------------------------------
    def show_progress(self, stage: str, done: int, total: int) -> None:
        self.query_one(VerdictBar).show_progress(stage, done, total)

    def load(self, model: ReplayModel) -> None:
        self.model = model
        had_hazards = bool(self.hazards)
        self.hazards = hazard_marks(model)
        if bool(self.hazards) != had_hazards:
            self.refresh_bindings()  # the key bar shows or drops "z Hazards"
        report = model.report
        if self.app.forensic:
            self.query_one(ForensicLabel).show_complete(model.forensic is None)
        self.query_one(TitleBar).show(model.name, report)
        self.query_one(VerdictBar).show_report(report)
        self.query_one(IdentityPane).set_rows(model.identity)
        self.stage_list.set_report(report)
        self.query_one(StagesPanel).show_detail(self.stage_list.stage)
        self.tree.set_model(model, self.hazards)
        self.diff_panel.set_model(model)
        self.sample_id = None
        self.field = None
        self.action_first_divergence(focus=False)

    # -- selection --------------------------------------------------------------------------------
    def select(self, *, sample_id: Optional[str] = None, field: Optional[str] = None, row: Optional[int] = None) -> None:
        """Show ``field`` of ``sample_id`` in the diff viewer with the cursor on ``row`` (default: the
        first divergent row, or the sample's row in a per-sample table)."""
        model = self.model
        if model is None:
            return
        if sample_id is not None and sample_id in model.by_id:
            self.sample_id = sample_id
        if self.sample_id is None and model.samples:
            self.sample_id = model.samples[0].sample_id
        if field is not None and field in model.fields:
            self.field = field
        if self.field is None and model.fields:
            self.field = model.fields[0]
        if self.sample_id is not None:
            self.tree.show_sample(self.sample_id)
        if self.field is None:
            reason = "; ".join(f"{k}: {v}" for k, v in model.unavailable.items())
            self.diff_panel.show(None, message=f"no field to compare ({reason})" if reason else "no field to compare")
            return
        kind = FIELD_BY_NAME[self.field].kind
        if kind == KIND_TOKEN and self.sample_id is None:
            self.diff_panel.show(None, message="no sample selected")
            return
        try:
            diff = model.field_diff(self.field, self.sample_id)
        except KeyError as exc:  # a field whose inputs are unusable (computed lazily, on first view)
            self.diff_panel.show(None, message=str(exc.args[0]))
            return
        sort = FIELD_BY_NAME[self.field].sort
        if row is None:
            if kind == KIND_SAMPLE and sort:
                row = worst_row(diff)
            elif kind == KIND_SAMPLE:
                row = model.sample_row_index(self.field, self.sample_id) if self.sample_id else 0
            else:
                row = diff.divergent[0] if diff.divergent else 0
        # a field's own order when the viewer changes field (pg_contribution: by |err|); the user's across samples
        changed = self.diff_view.diff is None or self.diff_view.diff.field != self.field
        self.diff_panel.show(diff, cursor=row or 0, sort=sort if changed else None)
        self._fit_left(self.app.size.width)  # a table of long row names (loss fields) needs a wider key

    @property
    def diff_cursor(self) -> int:
        return self.diff_view.cursor

    # -- messages from the panes ------------------------------------------------------------------
    def on_sample_tree_sample_highlighted(self, event: SampleTree.SampleHighlighted) -> None:
        if event.sample_id == self.sample_id:
            return
        kind = FIELD_BY_NAME[self.field].kind if self.field else None
        if kind == KIND_TOKEN:
            self.select(sample_id=event.sample_id)
        else:
            self.sample_id = event.sample_id
            if kind == KIND_SAMPLE and self.model is not None:
                row = self.model.sample_row_index(self.field, event.sample_id)
                if row is not None:
                    self.diff_view.show_row(row)

    def on_cursor_lines_highlighted(self, event: CursorLines.Highlighted) -> None:
        view = event.view
        if isinstance(view, DiffView) and view.diff is not None and view.diff.kind == KIND_SAMPLE:
            row = view.row_at(event.row)
            label = view.diff.labels[row] if row < len(view.diff.labels) else None
            if label is not None and label != self.sample_id:
                self.sample_id = label
                self.tree.show_sample(label)

    def on_cursor_lines_activated(self, event: CursorLines.Activated) -> None:
        view = event.view
        if isinstance(view, StageList):
            self.open_stage(view.cursor)
        elif isinstance(view, SampleTree):
            self.set_focus(self.diff_view)
        elif isinstance(view, DiffView) and view.diff is not None and view.diff.kind == KIND_SAMPLE:
            self.open_sample_tokens(view.diff.labels[view.row_at(event.row)])
        elif isinstance(view, DiffView) and view.diff is not None:  # a loss row: its per-sample terms
            if "pg_contribution" in self.model.fields:
                self.select(field="pg_contribution")
            else:
                self.say("this bundle records no per-sample loss terms (expected.json $.loss.policy.per_sample): "
                         "the loss fields are cohort sums only", severity="warning", timeout=4)

    def open_sample_tokens(self, sample_id: str) -> None:
        """From a per-sample table to that sample's per-token diff (its first diverging token field)."""
        model = self.model
        token_fields = [f for f in model.fields if FIELD_BY_NAME[f].kind == KIND_TOKEN]
        viewed = FIELD_BY_NAME.get(self.field) if self.field else None
        if viewed is not None and viewed.stage == "loss.policy" and "pg_losses" not in model.fields:
            # a loss term located to the sample: its tokens need the per-token surrogate the job did not record
            self.say(f"{sample_id}: this bundle records no per-token loss terms (pg_losses), so a loss divergence "
                     f"stops at the sample; capture with RELAX_REPLAY_CAPTURE_TOKEN_TERMS=1 to see its tokens",
                     severity="warning", timeout=8)
        elif not token_fields:
            self.say("this bundle has no per-token field to open", severity="warning", timeout=3)
        if not token_fields:
            return
        row = model.sample(sample_id)
        field = next((f for f in token_fields if row is not None and row.mismatches.get(f)), token_fields[0])
        self.select(sample_id=sample_id, field=field)

    def open_stage(self, index: int) -> None:
        model = self.model
        if model is None:
            return
        stage = model.report.stages[index]
        spec = FIELD_BY_STAGE.get(stage.stage)
        if stage.status == STATUS_SKIPPED and (spec is None or spec.name not in model.fields):
            self.say(f"{stage.stage}: skipped — {safe(stage.reason or 'not run')}: nothing was compared",
                     severity="warning", timeout=4)
            return
        if spec is None or spec.name not in model.fields:
            why = model.unavailable.get(spec.name) if spec else None
            self.say(f"{stage.stage}: nothing to show" + (f" ({why})" if why else " (no per-element values)"),
                        severity="warning", timeout=4)
            return
        first = next((d for d in stage.divergences if d.sample_id is not None), None)
        sample = first.sample_id if first is not None and first.sample_id in model.by_id else None
        # a stage with several fields (logprob.support, loss.policy's terms) opens the one its first divergence
        # is in, at its token
        field = field_for_divergence(stage.stage, first.field) if first is not None else None
        field = field if field in model.fields else spec.name
        row = first.token_offset if first is not None and FIELD_BY_NAME[field].kind == KIND_TOKEN else None
        self.select(sample_id=sample, field=field, row=row)
        self.set_focus(self.diff_view)

    def say(self, message: str, **kwargs) -> None:
        """A toast, replacing the one before (pressing ``n`` at the last divergence again and again would
        stack copies over the diff rows). It may quote the bundle: escaped, and never read as markup."""
        self.app.clear_notifications()
        self.notify(safe(message), markup=False, **kwargs)

    # -- actions ----------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # "z Hazards" is in the key bar only when the report has some (the palette's command says when not)
        if action == "hazards":
            return bool(self.hazards)
        return True

    def action_focus_pane(self, step: int) -> None:
        panes = self._visible_panes()
        current = self.focused_pane()
        i = panes.index(current) if current in panes else -1
        self.set_focus(self.pane_widget(panes[(i + step) % len(panes)]))

    def action_focus_named(self, name: str) -> None:
        if name == "identity":
            self._set_identity(True)
        self.set_focus(self.pane_widget(name))

    def action_cycle_field(self, step: int) -> None:
        model = self.model
        if model is None or not model.fields:
            return
        if len(model.fields) == 1 and self.field == model.fields[0]:
            self.say(f"{self.field} is this bundle's only field", timeout=2)
            return
        i = model.fields.index(self.field) if self.field in model.fields else -1
        self.select(field=model.fields[(i + step) % len(model.fields)])

    def action_first_divergence(self, focus: bool = True) -> None:
        model = self.model
        if model is None:
            return
        first = model.report.first_divergence
        field = field_for_divergence(first.stage, first.field) if first is not None else None
        if first is None or field not in model.fields:
            fallback = next((f for f in model.fields if FIELD_BY_NAME[f].kind == KIND_TOKEN), None)
            self.select(field=fallback or (model.fields[0] if model.fields else None))
        else:
            row = first.token_offset if FIELD_BY_NAME[field].kind == KIND_TOKEN else None
            if FIELD_BY_NAME[field].kind == "cohort":
                diff = model.field_diff(field)
                # the divergence's own row (the table holds every scalar the stage compared), else its first
                label = first.field + (f" [rank {first.rank}]" if model.multi_rank and first.rank is not None else "")
                row = diff.labels.index(label) if label in diff.labels else diff.divergent[0] if diff.divergent else 0
            self.select(sample_id=first.sample_id, field=field, row=row)
        if first is not None:
            self.stage_list.cursor = next(
                (i for i, s in enumerate(model.report.stages) if s.stage == first.stage), self.stage_list.cursor)
        if focus:
            self.set_focus(self.diff_view)

    def action_divergence(self, direction: int) -> None:
        model = self.model
        view = self.diff_view
        if model is None or view.diff is None:
            return
        if view.jump(direction):
            return
        if view.diff.kind == KIND_TOKEN:
            order = [s.sample_id for s in model.samples]
            here = order.index(self.sample_id) if self.sample_id in order else -1
            candidates = order[here + 1:] if direction > 0 else list(reversed(order[:max(here, 0)]))
            for sid in candidates:
                if model.sample(sid).mismatches.get(self.field, 0):
                    diff = model.field_diff(self.field, sid)
                    self.select(sample_id=sid, row=diff.divergent[0] if direction > 0 else diff.divergent[-1])
                    return
        self.say(f"no {'further' if direction > 0 else 'earlier'} divergence in {self.field}", timeout=2)
        self.app.bell()

    def action_jump(self) -> None:
        if self.model is None:
            return

        def done(sample_id: Optional[str]) -> None:
            if sample_id:
                self.select(sample_id=sample_id)
                self.set_focus(self.tree)

        self.app.push_screen(FindScreen([s.sample_id for s in self.model.samples], self.find_in_diff), done)

    def action_hazards(self) -> None:
        if self.model is None:
            return
        if not self.hazards:
            self.say("no hazards in this report", timeout=2)
            return

        def done(row: Optional[int]) -> None:
            if row is not None and self.model is not None and 0 <= row < len(self.model.samples):
                self.select(sample_id=self.model.samples[row].sample_id)
                self.set_focus(self.tree)

        self.app.push_screen(HazardsScreen(self.hazards.rows), done)

    def action_toggle_identity(self) -> None:
        self._set_identity(not self.query_one(IdentityPane).display)

    def _set_identity(self, show: bool) -> None:
        self.identity_pref = show
        pane = self.query_one(IdentityPane)
        if not show and pane.has_focus:
            self.set_focus(self.diff_view)
        pane.display = show

    def action_rerun(self) -> None:
        self.app.start_replay()

    # -- zoom, find, export, copy -----------------------------------------------------------------
    def panel_of(self, pane: str) -> Widget:
        """The bordered panel a pane sits in (what zoom maximizes)."""
        widget = self.pane_widget(pane)
        return widget if pane == "identity" else widget.parent

    def action_zoom(self) -> None:
        if self.maximized is not None:
            self.minimize()
            return
        pane = self.focused_pane() or "diff"
        self.maximized = self.panel_of(pane)
        self.set_focus(self.pane_widget(pane))

    def find_in_diff(self, query: str) -> Optional[str]:
        """Run a find query (``@17``, a number, a sample id); the error to show in the dialog, else None."""
        view = self.diff_view
        diff = view.diff
        query = query.strip()
        if not query:
            return "type a sample id, @offset or a value"
        if query.startswith("@"):
            if diff is None:
                return "no diff to move in"
            try:
                row = int(query[1:])
            except ValueError:
                return f"'{safe(query)}': an offset is @ and a whole number (e.g. @17)"
            if not 0 <= row < len(diff):
                what = f"token offsets of {safe(diff.sample_id)}" if diff.kind == KIND_TOKEN else "rows"
                return f"@{row} is outside the {what} (0…{len(diff) - 1})"
            view.show_row(row)
            self.set_focus(view)
            return None
        if is_number(query):
            if diff is None:
                return "no diff to search"
            row = view.find_value(query)
            if row is None:
                return f"no expected or actual value matches {safe(query)} to the digits typed"
            view.show_row(row)
            self.set_focus(view)
            return None
        return f"'{safe(query)}' is no @offset or number"

    def on_diff_view_export(self, event: DiffView.Export) -> None:
        event.stop()
        view = self.diff_view
        if self.model is None or view.diff is None:
            return
        request = ExportRequest(field=view.diff.field, sample_id=view.diff.sample_id,
                                whole_stage=event.whole_stage or view.diff.kind != KIND_TOKEN)

        def write(path: str, overwrite: bool, **watch) -> str:  # (on the dialog's worker thread)
            return export_field(self.model, request, path, overwrite=overwrite, **watch)

        self.app.push_screen(ExportScreen(request, default_export_path(request, self.bundle_name), write),
                             lambda message: self.say(message, timeout=4) if message else None)

    def on_diff_view_copy(self, event: DiffView.Copy) -> None:
        event.stop()
        text = safe(event.text)  # a bundle string reaches the terminal inside the OSC 52 payload
        self.app.copy_to_clipboard(text)
        self.say(f"copied (OSC 52): {text}", timeout=3)

    async def on_resize(self, event: events.Resize) -> None:
        self._fit_identity(event.size.height)
        self._fit_left(event.size.width)
        await self._place_stages(event.size.height)

    async def _place_stages(self, height: int) -> None:
        """The DAG's column for ``height``: under the samples when short, above the diff when tall. Moving
        it mounts a new pane (Textual moves a widget only among its siblings) with the same report and cursor."""
        panel = self.query_one(StagesPanel)
        column = self.query_one("#left" if height < IDENTITY_MIN_HEIGHT else "#right", Vertical)
        if panel.parent is column:
            return
        focused = self.stage_list.has_focus
        cursor = self.stage_list.cursor
        await panel.remove()
        fresh = StagesPanel(id="stages")
        if column.id == "right":
            await column.mount(fresh, before=0)
        else:
            await column.mount(fresh)
        if self.model is not None:
            self.stage_list.set_report(self.model.report)
            self.stage_list.cursor = cursor
            fresh.show_detail(self.stage_list.stage)
        if focused:
            self.set_focus(self.stage_list)

    def _fit_left(self, width: int) -> None:
        """The left column's width at a terminal ``width``: what the diff leaves (:data:`DIFF_MIN_WIDTH`), at most
        its usual width, at least :data:`LEFT_MIN`."""
        usual = 40 if width >= self.HORIZONTAL_BREAKPOINTS[-1][0] else 30
        view = self.query_one(DiffView)
        key = view.key_width() if view.diff is not None else 6
        cells = max(LEFT_MIN, min(usual, width - DIFF_MIN_WIDTH - (key - 6)))
        left = self.query_one("#left", Vertical)
        if left.styles.width is None or left.styles.width.cells != cells:  # a relayout only when it changes
            left.styles.width = cells

    def _fit_identity(self, height: int) -> None:
        pane = self.query_one(IdentityPane)
        show = height >= IDENTITY_MIN_HEIGHT
        if self.identity_pref is None and pane.display != show:  # a relayout only when it changes
            pane.display = show
