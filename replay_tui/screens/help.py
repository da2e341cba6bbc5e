"""``?`` / F1: every key, by pane, from the same bindings the key bar and the command palette use."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ..cells import FAIL, PASS, SKIP, WARN
from ..hazards import HAZARD_MARK
from ..keys import key_actions
from ..widgets.key_bar import KeyBar

INTRO = (
    "Panes: Stages (the DAG; enter opens a stage), Samples (groups → samples; ✗ = mismatches, ⚠ = carries a "
    "hazard), Diff (expected vs actual of the viewed field), Identity. Tab/shift+tab or 1–4 switch panes; the "
    "mouse works too (click a row, a stage, a key in the bottom line or a bin of the error plot); ctrl+p opens "
    "the command palette; m zooms the focused pane to the whole screen.\n"
    "Over the diff rows the error plot (|err| along the tokens, its max on top; L: log), under them the why "
    "strip: the inputs of the element under the cursor.\n"
    "expected = what the bundle recorded (the value the training step used); actual = what the replay "
    "recomputes from the stage's inputs: its recorded inputs (teacher-forced, the default: a wrong stage fails "
    "alone) or, under --chain, the recomputed outputs of the stages before it (chained); the line under the DAG "
    "says which. tol = the element's tolerance: the bundle's atol + rtol·|expected| plus a bound on the "
    "producer's floating-point rounding for that element; ×noise = |actual − expected| / tol. A value diverges "
    "when ×noise > 1 (--exact: when the two differ at all) or either side is NaN/Inf; the DAG shows each "
    "stage's largest ×noise. kl and advantage are compared on every response token (mask column shown for "
    "reference); the support log-probs only on loss-bearing ones (mask 1). The loss fields are sums of "
    "per-sample masked means (as the trainer reports them), so pg_clipfrac can exceed 1; enter on a loss row "
    "lists each sample's term (pg_contribution, by |err|) when the bundle records per-sample terms. Narrow "
    "panes drop the mask column first, then tol, ×noise, the group and the recorded value; actual and abs err "
    "stay.\n"
    "Hazards (⚠ N hazards on the verdict line, z lists them) are reported, never failed: values a legitimate "
    "producer's rounding dominates or that are mathematically undefined (a zero-std group under std "
    "normalization, a singleton group, clamps hit, extreme ratios). ⚠ in the sample tree marks the samples "
    "(and groups) they name."
)


# (mark, its style, what it means): every glyph and colour the panes draw, in the order a user meets them.
LEGEND = (
    ("✓", PASS, "compared, every element within its tolerance (green)"),
    ("✗", FAIL, "mismatches (red); the ✗ column counts the sample's mismatching elements, red text marks "
                "a diverging sample, value or |err|"),
    ("·", SKIP, "not compared: the stage did not run for it, the field has no element there, or the count is "
                "zero (dim)"),
    ("○", SKIP, "a skipped stage: not declared recompute (recorded-only, inspect-only, unsupported), not "
                "selected, or cohort-level under a partial selection; it never counts as the first divergence"),
    ("◀ first", None, "the first divergence (the stage a report names)"),
    (HAZARD_MARK, WARN, "a hazard: reported, never failed (z lists them)"),
    ("▾ ▸", None, "an open / folded group (space, ← →)"),
    ("reward", None, "the samples' reward column is the recorded value: the normalized reward when the "
                     "bundle records it, else the raw reward"),
)


def legend() -> Table:
    grid = Table.grid(padding=(0, 2), expand=True)
    grid.add_column(no_wrap=True, min_width=12)
    grid.add_column(ratio=1)
    grid.add_row(Text("Legend", style="bold underline"), "")
    for mark, style, meaning in LEGEND:
        grid.add_row(Text(mark, style=style or ""), Text(meaning))
    return grid


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen #help-box {
        width: 100; max-width: 96%; height: 90%; border: round $accent; background: $surface; padding: 0 1;
    }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Close", id="help.close", tooltip="Close the help screen"),
        Binding("q", "dismiss", "Close", show=False, id="help.close-q", tooltip="Close the help screen"),
        Binding("question_mark", "dismiss", "Close", show=False, id="help.close-question",
                tooltip="Close the help screen"),
        Binding("f1", "dismiss", "Close", show=False, id="help.close-f1", tooltip="Close the help screen"),
    ]

    def __init__(self, lead: str | None = None) -> None:
        """``lead``: the pane whose keys come first (the run view's, opened over it), before the legend."""
        super().__init__()
        self.lead = lead

    def compose(self):
        with VerticalScroll(id="help-box"):
            if self.lead is not None:
                yield Static(self._content(self.lead), id="help-lead")
            yield Static(legend(), id="help-legend")  # first: short, and what a new user asks about first
            yield Static(Text(INTRO, style="italic"), id="help-intro")
            yield Static(self._content(skip=self.lead), id="help-text")
        yield KeyBar()  # this screen's keys, not the pane's beneath it

    def on_mount(self) -> None:
        box = self.query_one("#help-box")
        box.border_title = "replay-tui — keys"
        box.border_subtitle = "esc / q / ? closes"
        box.focus()

    def _content(self, only: str | None = None, skip: str | None = None) -> Table:
        grid = Table.grid(padding=(0, 2), expand=True)
        grid.add_column(no_wrap=True, style="bold", min_width=12)
        grid.add_column(ratio=1)
        section = None
        for ka in key_actions():
            if (only is not None and ka.pane != only) or (skip is not None and ka.pane == skip):
                continue
            if ka.section != section:
                section = ka.section
                grid.add_row("", "")
                grid.add_row(Text(section, style="bold underline"), "")
            keys = " ".join(self.app.get_key_display(Binding(k, ka.action)) for k in ka.keys)
            grid.add_row(Text(keys), Text(ka.tooltip))
        return grid

    async def action_dismiss(self, result=None) -> None:
        self.dismiss(None)
