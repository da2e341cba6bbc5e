"""One table of every key binding, by pane: the app, the debugger screen and the panes take their ``BINDINGS``
from here; the help screen and the command palette read the same table."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding
from textual.keys import format_key


@dataclass(frozen=True)
class KeyAction:
    pane: str  # "main" for screen-wide actions, else a pane name
    section: str
    action: str
    description: str
    tooltip: str
    keys: tuple[str, ...]
    ids: tuple[str, ...]


# ------------------------------------------------------------------------------- the bindings
# Each pane's class reads its BINDINGS from here, so this module imports none of them.


def navigation_bindings( pane: str, noun: str, open_tooltip: str) -> list[Binding]:
    """Arrow/page keys with vim aliases (hidden from the key bar), each with an id and a tooltip."""
    return [
        Binding("up", "cursor(-1)", "Up", show=False, id=f"{pane}.up", tooltip=f"Previous {noun}"),
        Binding("down", "cursor(1)", "Down", show=False, id=f"{pane}.down", tooltip=f"Next {noun}"),
        Binding("k", "cursor(-1)", "Up", show=False, id=f"{pane}.up-vim", tooltip=f"Previous {noun} (vim)"),
        Binding("j", "cursor(1)", "Down", show=False, id=f"{pane}.down-vim", tooltip=f"Next {noun} (vim)"),
        Binding("pageup", "page(-1)", "Page up", show=False, id=f"{pane}.page-up", tooltip="One screen up"),
        Binding("pagedown", "page(1)", "Page down", show=False, id=f"{pane}.page-down",
                tooltip="One screen down"),
        # no ctrl+b (vim's page up): it is tmux's prefix key, which a debugger over SSH must leave alone
        Binding("ctrl+f", "page(1)", "Page down", show=False, id=f"{pane}.page-down-vim",
                tooltip="One screen down (vim)"),
        Binding("home", "edge(0)", "First", show=False, id=f"{pane}.first", tooltip=f"First {noun}"),
        Binding("end", "edge(1)", "Last", show=False, id=f"{pane}.last", tooltip=f"Last {noun}"),
        Binding("g", "edge(0)", "First", show=False, id=f"{pane}.first-vim", tooltip=f"First {noun} (vim)"),
        Binding("G", "edge(1)", "Last", show=False, id=f"{pane}.last-vim", tooltip=f"Last {noun} (vim)"),
        Binding("enter", "activate", "Open", id=f"{pane}.open", tooltip=open_tooltip),
    ]


# ReplayApp.BINDINGS (replay_tui/app.py)
APP_BINDINGS: list[Binding] = [
    Binding("ctrl+q", "quit", "Quit", show=False, priority=True, id="app.quit",
            tooltip="Quit (exit code: 0 pass, 1 divergence, else the error's)"),
    Binding("ctrl+c", "help_quit", show=False, system=True, id="app.help-quit", tooltip="How to quit"),
]


# DebuggerScreen.BINDINGS (replay_tui/screens/main.py)
MAIN_BINDINGS: list[Binding] = [
    Binding("tab", "focus_pane(1)", "Pane", id="main.next-pane", tooltip="Focus the next pane"),
    Binding("shift+tab", "focus_pane(-1)", "Prev pane", show=False, id="main.prev-pane",
            tooltip="Focus the previous pane"),
    Binding("1", "focus_named('stages')", "Stages", show=False, id="main.focus-stages",
            tooltip="Focus the stage DAG"),
    Binding("2", "focus_named('samples')", "Samples", show=False, id="main.focus-samples",
            tooltip="Focus the sample tree"),
    Binding("3", "focus_named('diff')", "Diff", show=False, id="main.focus-diff", tooltip="Focus the diff viewer"),
    Binding("4", "focus_named('identity')", "Identity", show=False, id="main.focus-identity",
            tooltip="Focus the identity pane (shows it if hidden)"),
    Binding("n", "divergence(1)", "Next div", id="main.next-divergence",
            tooltip="Next divergence of the viewed field (continues into the next diverging sample)"),
    Binding("N", "divergence(-1)", "Prev div", show=False, id="main.prev-divergence",
            tooltip="Previous divergence of the viewed field"),
    Binding("f", "cycle_field(1)", "Field", id="main.next-field",
            tooltip="View the next field (raw_reward, reward, kl, advantage, loss)"),
    Binding("F", "cycle_field(-1)", "Prev field", show=False, id="main.prev-field",
            tooltip="View the previous field"),
    Binding("e", "first_divergence", "First div", show=False, id="main.first-divergence",
            tooltip="Go to the report's first divergence"),
    Binding("slash", "jump", "Jump", id="main.jump",
            tooltip="Jump to a sample by id; in the diff, @17 to token offset (row) 17, a number to the next row "
                    "whose expected or actual value matches it to the digits typed"),
    Binding("z", "hazards", "Hazards", id="main.hazards",
            tooltip="List the report's hazards (reported, never failed; ⏎ shows a hazard's sample)"),
    Binding("i", "toggle_identity", "Identity", show=False, id="main.toggle-identity",
            tooltip="Show or hide the identity pane"),
    Binding("r", "rerun", "Re-run", show=False, id="main.rerun", tooltip="Verify and replay the bundle again"),
    Binding("m", "zoom", "Zoom", show=False, id="main.zoom",
            tooltip="Maximize the focused pane to the whole screen, or restore the layout (toggle)"),
    Binding("question_mark", "app.help", "Help", id="main.help", tooltip="Show the help screen (keys and panes)"),
    Binding("f1", "app.help", "Help", show=False, id="main.help-f1",
            tooltip="Show the help screen (keys and panes)"),
    Binding("q", "app.quit", "Quit", id="main.quit", tooltip="Quit (exit code: 0 pass, 1 divergence, else the error's)"),
]


# StageList.BINDINGS (replay_tui/widgets/stage_pane.py)
STAGES_BINDINGS: list[Binding] = navigation_bindings(
    "stages", "stage", "Open the stage: view its field at its first divergence")


# SampleTree.BINDINGS (replay_tui/widgets/sample_tree.py)
SAMPLES_BINDINGS: list[Binding] = navigation_bindings(
    "samples", "row", "Open the sample in the diff viewer, or fold/unfold the group") + [
    Binding("d", "toggle_filter", "Diverging", id="samples.filter",
            tooltip="Show only samples with a mismatch (toggle)"),
    Binding("space", "toggle_group", "Fold", id="samples.fold", tooltip="Fold or unfold the group under the cursor"),
    Binding("left", "fold(True)", "Fold", show=False, id="samples.collapse", tooltip="Fold the group"),
    Binding("right", "fold(False)", "Unfold", show=False, id="samples.expand", tooltip="Unfold the group"),
    Binding("h", "fold(True)", "Fold", show=False, id="samples.collapse-vim", tooltip="Fold the group (vim)"),
    Binding("l", "fold(False)", "Unfold", show=False, id="samples.expand-vim", tooltip="Unfold the group (vim)"),
]


# DiffView.BINDINGS (replay_tui/widgets/diff_view.py)
DIFF_BINDINGS: list[Binding] = navigation_bindings(
    "diff", "row", "Open the sample's per-token diff (from a per-sample table; from the loss table, each "
                   "sample's term)") + [
    # s, w, x in the key bar while the diff has the focus (the bar keeps ? and q when it is short)
    Binding("s", "toggle_sort", "Sort", id="diff.sort",
            tooltip="Sort the rows by |err|, largest first (toggle; n/N still follow the offsets)"),
    Binding("D", "toggle_divergent", "Divergent", show=False, id="diff.divergent-only",
            tooltip="Show only the divergent rows (toggle)"),
    Binding("w", "worst", "Max |err|", id="diff.worst", tooltip="Go to the row with the largest |err|"),
    Binding("right", "scroll_columns(1)", "Columns →", show=False, id="diff.columns-right",
            tooltip="Scroll the columns right (shows the ones a narrow pane leaves out)"),
    Binding("left", "scroll_columns(-1)", "Columns ←", show=False, id="diff.columns-left",
            tooltip="Scroll the columns back left"),
    Binding("L", "toggle_log", "Log |err|", show=False, id="diff.log-scale",
            tooltip="Error plot on a log scale (toggle)"),
    Binding("x", "export(False)", "Export", id="diff.export",
            tooltip="Export the viewed rows (expected, actual, abs err, tolerance) to CSV or JSON"),
    Binding("X", "export(True)", "Export stage", show=False, id="diff.export-stage",
            tooltip="Export the field over every sample of the stage (to CSV or JSON)"),
    Binding("y", "copy(False)", "Copy", show=False, id="diff.copy-value",
            tooltip="Copy the cursor row's recomputed value to the clipboard (in full; OSC 52, works over SSH)"),
    Binding("Y", "copy(True)", "Copy row", show=False, id="diff.copy-row",
            tooltip="Copy the cursor row (key, expected, actual, abs err, tolerance) to the clipboard (OSC 52)"),
]


# RunScreen.BINDINGS (replay_tui/screens/run.py): the run view of ``replay-tui DIR``
RUN_BINDINGS: list[Binding] = [
    Binding("d", "toggle_bad", "Bad only", id="run.bad-only",
            tooltip="Show only the bundles that did not pass (diverged, invalid, unsupported, error); d again: all"),
    Binding("e", "first_bad", "First bad", id="run.first-bad",
            tooltip="Go to the first bad step (the first diverged bundle in rollout/step order; the cursor starts "
                    "there)"),
    Binding("c", "toggle_grouped", "Collapse", id="run.group",
            tooltip="Group identical failures (same stage, field and likely cause) into one row with a count, or "
                    "list every bundle (toggle)"),
    Binding("q", "app.quit", "Quit", id="run.quit",
            tooltip="Quit (exit code: the scan's, SPEC §9; 130 while it runs)"),
    Binding("question_mark", "app.help", "Help", id="run.help", tooltip="Show the help screen (keys and panes)"),
]


def sections() -> list[tuple[str, str, list[Binding]]]:
    """(pane, section title, bindings) for every pane, in the help's order."""
    return [
        ("main", "Everywhere", list(MAIN_BINDINGS) + list(APP_BINDINGS)),
        ("stages", "Stages pane", list(STAGES_BINDINGS)),
        ("samples", "Samples pane", list(SAMPLES_BINDINGS)),
        ("diff", "Diff pane", list(DIFF_BINDINGS)),
        ("runs", "Run view", list(RUN_BINDINGS)),
    ]


def key_actions() -> list[KeyAction]:
    """Bindings merged by (pane, action): ``up`` and ``k`` are one action with two keys."""
    out: list[KeyAction] = []
    for pane, section, bindings in sections():
        merged: dict[str, KeyAction] = {}
        for b in bindings:
            if b.system:
                continue
            prev = merged.get(b.action)
            if prev is None:
                merged[b.action] = KeyAction(pane, section, b.action, b.description, b.tooltip, (b.key,), (b.id or "",))
            else:
                merged[b.action] = KeyAction(pane, section, b.action, prev.description, prev.tooltip,
                                             prev.keys + (b.key,), prev.ids + (b.id or "",))
        out.extend(merged.values())
    return out


def key_display(key: str) -> str:
    """A key as the key bar and the help show it (Textual's default ``App.get_key_display``): ``/`` for
    ``slash``, ``^p`` for ``ctrl+p``, ``shift+tab`` as written."""
    *modifiers, name = key.split("+")
    name = format_key(name)
    if "ctrl" in modifiers:
        modifiers.remove("ctrl")
        name = f"^{name}"
    return "+".join([*modifiers, name])
