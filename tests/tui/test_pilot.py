"""Behaviour of every key binding, the mouse, the worker and the error path, driven with Pilot.

Each test waits for the replay worker (``app.wait_settled``: ``app.workers.wait_for_complete()``, then
``pilot.pause()`` until the result is on screen); none sleeps. State is asserted on the screen object: selected sample, field, diff cursor, focus."""

from __future__ import annotations

import pytest
from textual.binding import Binding

from replay_tui.app import ReplayApp
from replay_tui.commands import ReplayCommands, command_title
from replay_tui.keys import key_actions, sections
from replay_tui.screens.error import ErrorScreen
from replay_tui.screens.help import HelpScreen
from replay_tui.screens.jump import JumpScreen
from replay_tui.widgets.diff_view import DiffView, ErrorStrip
from replay_tui.widgets.identity_pane import IdentityPane
from replay_tui.widgets.key_bar import KeyBar
from replay_tui.widgets.sample_tree import SampleTree
from replay_tui.widgets.stage_pane import StageList
from replay_tui.widgets.status_bar import VerdictBar

from tui_bundles import BRACKET_PREFIX

SIZE = (120, 40)


async def ready(pilot) -> None:
    await pilot.app.wait_settled(pilot)


def screen_text(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def record_writes(app, monkeypatch) -> list:
    """Every update the app writes to the terminal from now on (``None`` for an empty one)."""
    written = []
    real = type(app)._display
    monkeypatch.setattr(type(app), "_display", lambda self, screen, update: (written.append(update),
                                                                                real(self, screen, update)))
    return written


def state(app: ReplayApp) -> tuple:
    d = app.debugger
    return d.sample_id, d.field, d.diff_cursor


# ------------------------------------------------------------------------------------ first screen


async def test_first_screen_shows_the_first_divergence(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert state(app) == ("s-0", "reward", 0)
        assert isinstance(app.focused, DiffView)
        assert app.debugger.stage_list.stage.stage == "reward.post_process"
        text = screen_text(app)
        assert "✗ first divergence in reward.post_process — reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5" in text
        assert "reward.post_process ◀ first" in text


async def test_narrow_terminal_keeps_the_divergence_line_whole(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        lines = [line.rstrip() for line in screen_text(app).splitlines()]
        assert "   reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5" in lines
        assert not app.debugger.query_one(IdentityPane).display  # hidden below 32 rows
        await pilot.press("i")
        assert app.debugger.query_one(IdentityPane).display
        await pilot.press("i")
        assert not app.debugger.query_one(IdentityPane).display


async def test_a_divergence_line_wider_than_the_terminal_continues_under_its_indent(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=(46, 24)) as pilot:
        await ready(pilot)
        lines = [line.rstrip() for line in screen_text(app).splitlines()]
        # 44 cells of text in the bar, 42 after the indent: cut at the space before abs_err
        assert lines[1:4] == [" ✗ first divergence in reward.post_process",
                              "   reward s-0: expected=-5.5 actual=-1.0",
                              "   abs_err=4.5"]
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        lines = [line.rstrip() for line in screen_text(app).splitlines()]
        assert lines[2:4] == ["   reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5", lines[3]]
        assert "abs_err" not in lines[3]


async def test_on_a_very_narrow_terminal_the_verdict_bar_keeps_to_its_four_lines(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=(30, 24)) as pilot:
        await ready(pilot)
        bar = app.debugger.query_one(VerdictBar)
        lines = [line.rstrip() for line in screen_text(app).splitlines()[1:1 + bar.size.height]]
        assert bar.size.height == 4
        assert lines[0] == " ✗ first divergence in advan…"  # its own line, cut, never wrapped
        # the hazard count (its group g-1 has all-zero advantages) after the last line: the stage keeps its cells
        assert lines[1:] == ["   kl s-5@3:", "   expected=0.25077856", "   actual=0.00077855656 …  ⚠1"]


async def test_an_app_that_exited_leaves_its_model_to_the_collector(make_app):
    """The replay freezes its model out of the collector's way; the app gives it back when it exits, so a process
    that runs app after app (this test suite, the bench) does not keep every model it ever showed. (Textual's
    ``active_app`` holds the last app run until the next one starts: the first app's model is the one freed.)"""
    import gc
    import weakref

    models = []
    for _ in range(2):
        app = make_app("pr65-buggy")
        async with app.run_test(size=(120, 40)) as pilot:
            await ready(pilot)
            models.append(weakref.ref(app.model))
            await pilot.press("q")
        del app, pilot
    gc.collect()
    assert models[0]() is None and gc.get_freeze_count() == 0


async def test_an_app_that_exited_leaves_its_widgets_rendered_lines_to_the_collector(make_app):
    """Textual's ``StylesCache.get_inner_outer`` memoizes on the instance (Textualize/textual#6665): each exited
    app left its widgets' styles caches, and the rendered lines in them, alive until 1,024 had piled up (about
    24 caches and 15,000 objects an app of this demo, 1.8 MB). The app empties that cache when it exits: three
    apps in a row leave as many styles caches alive as one."""
    import gc

    from textual._styles_cache import StylesCache

    def alive() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is StylesCache)

    counts = []
    for _ in range(3):
        app = make_app("pr65-buggy")
        async with app.run_test(size=(120, 40)) as pilot:
            await ready(pilot)
            shown = sum(1 for w in app.screen.walk_children() if w.display)
            await pilot.press("q")
        del app, pilot
        counts.append(alive())
    assert shown >= 10  # the screen had its widgets, each with its styles cache
    assert counts[2] == counts[0], counts


def test_run_app_freezes_what_is_alive_before_the_process_ends(monkeypatch):
    """The app unfreezes what its replays froze when it exits; run_app freezes everything again before the
    process ends, or the interpreter's final collection walks it all (`q` took ≈ 0.55 s instead of ≈ 0.32 s to
    end replay-tui on a 4,096-sample step)."""
    import gc
    from types import SimpleNamespace

    import replay_tui.app as app_module

    ran = []

    class Stub:
        error = None
        return_code = 1

        def run(self):
            ran.append(True)
            gc.unfreeze()  # what ReplayApp.on_unmount does

    monkeypatch.setattr(app_module.sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(app_module.sys.stdout, "isatty", lambda: True, raising=False)
    try:
        assert app_module.run_app(SimpleNamespace(demo=None), build=lambda args: Stub()) == 1
        assert ran and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_hang_cuts_at_spaces_keeps_long_words_and_ends_with_an_ellipsis():
    from replay_tui.widgets.status_bar import hang

    assert hang("kl s-1@3: expected=1.0 actual=2.0 abs_err=1.0", 24) == [
        "kl s-1@3: expected=1.0", "actual=2.0 abs_err=1.0"]
    assert hang("short", 24) == ["short"] and hang("", 24) == [""]
    assert hang("a" * 20 + " b", 8) == ["aaaaaaaa", "aaaaaaaa", "aaaa b"]
    assert hang("one two three four five six", 8, limit=2) == ["one two", "three …"]
    assert hang("abcdefghi jk", 9, limit=1) == ["abcdefgh…"]  # a full last line gives its last cell
    # widths in terminal cells: a wide character takes two
    assert hang("样本 中文中文中文中文 x", 6) == ["样本", "中文中", "文中…"]


async def test_worker_reports_progress_through_every_stage(bundles, monkeypatch):
    import replay_tui.app as app_module

    monkeypatch.setattr(app_module, "PROGRESS_INTERVAL_S", 0.0)  # report every stage, however fast
    seen: list[str] = []
    totals: list[tuple[int, int]] = []

    class Recording(ReplayApp):
        def on_replay_progress(self, message) -> None:
            seen.append(message.stage)
            totals.append((message.done, message.total))
            super().on_replay_progress(message)

    app = Recording(bundles / "pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
    assert seen == ["sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate", "model"]
    assert totals[-1] == (5, 5)  # "replayed 5 stage(s)": the two skipped loss stages are not counted


async def test_fast_stages_cost_no_progress_frames(bundles):
    # Progress frames compete with the replay for the GIL: a stage that is done before the throttle
    # interval has passed is not reported.
    seen: list[str] = []

    class Recording(ReplayApp):
        def on_replay_progress(self, message) -> None:
            seen.append(message.stage)
            super().on_replay_progress(message)

    app = Recording(bundles / "pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
    assert len(seen) < 6


async def test_a_quick_replay_is_on_the_very_first_frame(bundles):
    # The app gives the replay a short head start before its first frame (STARTUP_GRACE_S): a small
    # bundle never flashes a progress screen, and the first frame written already holds the result.
    frames: list[str] = []

    class Recording(ReplayApp):
        def _display(self, screen, renderable) -> None:
            frames.append(screen_text(self))
            super()._display(screen, renderable)

    app = Recording(bundles / "pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
    assert frames and "reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5" in frames[0]
    assert not any("verifying bundle" in f or "replaying" in f for f in frames)
    # the diff's keys first (it has the focus), then the screen's
    assert frames[0].splitlines()[-1].startswith("⏎ Open s Sort w Max |err| x Export tab Pane n Next div")


async def test_markup_in_sample_ids_is_shown_literally(make_app):
    app = make_app("brackets")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        text = screen_text(app)
        assert f"reward {BRACKET_PREFIX}0: expected=" in text
        assert f"✗ {BRACKET_PREFIX}0" in text
        assert "[b]brackets" in text


async def test_selection_flags_show_the_group_closure(bundles):
    from replay_tui.__main__ import build_parser
    from replay_tui.app import app_from_args

    args = build_parser().parse_args([str(bundles / "pr65-buggy"), "--sample", "s-3"])
    app = app_from_args(args)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tree = app.debugger.tree
        assert [app.model.samples[i].sample_id for kind, i in tree.rows if kind == "sample"] == ["s-2", "s-3"]
        assert state(app) == ("s-2", "reward", 0)  # the first divergence inside the selection
        assert ("selection", "2 sample(s) (semantic-group closure)") in app.model.identity


async def test_validation_warnings_reach_the_identity_pane(bundles, tmp_path):
    import shutil

    bundle = tmp_path / "pr65-extra"
    shutil.copytree(bundles / "pr65-buggy", bundle)
    (bundle / "payloads" / "notes.txt").write_text("not a payload\n")
    app = ReplayApp(bundle)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        warnings = [value for key, value in app.model.identity if key == "warning"]
        assert len(warnings) == 1 and warnings[0].endswith("notes.txt: file not listed in manifest.json (ignored)")
        text = screen_text(app)  # first in the pane (which may be short), counted in its border
        assert "manifest.json (ignored)" in text and "⚠ 1 warning" in text


# ------------------------------------------------------------------------------------- screen keys


async def test_tab_and_digits_move_between_panes(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        order = []
        for _ in range(4):
            await pilot.press("tab")
            order.append(app.debugger.focused_pane())
        assert order == ["identity", "stages", "samples", "diff"]
        await pilot.press("shift+tab")
        assert app.debugger.focused_pane() == "samples"
        for key, pane in (("1", "stages"), ("2", "samples"), ("3", "diff"), ("4", "identity")):
            await pilot.press(key)
            assert app.debugger.focused_pane() == pane


async def test_a_focus_change_repaints_the_two_panes_not_the_screen(make_app, monkeypatch):
    # Over SSH every repainted cell is sent: Textual's Screen.focused repaints the whole screen (≈ 22 kB at
    # 120×40) on top of the panes whose focus style changes; the debugger repaints only those.
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.pause()
        written = record_writes(app, monkeypatch)
        await pilot.press("tab")
        await pilot.pause()
        assert app.debugger.focused_pane() == "identity"
        kinds = [type(u).__name__ for u in written if u is not None]
        assert kinds and "LayoutUpdate" not in kinds, kinds  # a LayoutUpdate rewrites every cell


async def test_a_cursor_move_in_a_token_diff_is_one_write(make_app, monkeypatch):
    # the rows, the |err| strip's cursor mark and the support row change in the same frame
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.pause()
        assert app.debugger.diff_view.diff.kind == "token"
        written = record_writes(app, monkeypatch)
        await pilot.press("down")
        await pilot.pause()
        await pilot.pause()
        assert [type(u).__name__ for u in written if u is not None] == ["ChopsUpdate"]
        assert app.debugger.diff_cursor == 4


async def test_field_keys_cycle_the_viewed_field(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        seen = []
        for _ in range(4):
            await pilot.press("f")
            seen.append(app.debugger.field)
        assert seen == ["kl", "advantage", "raw_reward", "reward"]
        await pilot.press("F")
        assert app.debugger.field == "raw_reward"
        await pilot.press("F", "F")
        assert state(app) == ("s-0", "kl", 0)


async def test_the_field_keys_say_when_there_is_no_other_field(make_app):
    app = make_app("step-loss")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.debugger.field == "loss" and app.model.fields == ["loss"]
        await pilot.press("f")
        await pilot.press("F")
        assert app.debugger.field == "loss"
        assert [n.message for n in app._notifications] == ["loss is this bundle's only field"]


async def test_n_and_N_walk_divergences_across_samples(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert state(app) == ("s-5", "kl", 3)
        walk = []
        for _ in range(3):
            await pilot.press("n")
            walk.append(state(app))
        assert walk == [("s-5", "kl", 7), ("s-5", "kl", 11), ("s-6", "kl", 0)]
        await pilot.press("n")  # none further: stays, says so
        assert state(app) == ("s-6", "kl", 0)
        assert any("no further divergence in kl" in n.message for n in app._notifications)
        await pilot.press("n", "n", "n")  # one toast, not a stack of copies over the diff rows
        assert [n.message for n in app._notifications] == ["no further divergence in kl"]
        await pilot.press("N")
        assert state(app) == ("s-5", "kl", 11)
        await pilot.press("N")
        assert state(app) == ("s-5", "kl", 7)
        await pilot.press("f", "f", "e")  # elsewhere, then back to the report's first divergence
        assert state(app) == ("s-5", "kl", 3)
        assert app.debugger.stage_list.stage.stage == "advantage.kl"


async def test_slash_jumps_to_a_sample(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("slash")
        assert isinstance(app.screen, JumpScreen)
        await pilot.press(*"nope", "enter")
        assert isinstance(app.screen, JumpScreen)
        assert "no sample 'nope' in this bundle" in screen_text(app)
        await pilot.press("backspace")  # typing again clears the old error
        await pilot.pause()
        assert "no sample" not in screen_text(app)
        await pilot.press("escape")
        assert not isinstance(app.screen, JumpScreen)
        assert app.debugger.sample_id == "s-5"
        await pilot.press("slash", "s", "-", "2", "enter")
        await pilot.pause()
        assert state(app) == ("s-2", "kl", 0)
        assert isinstance(app.focused, SampleTree) and app.debugger.tree.selected_sample == "s-2"


async def test_jump_lifts_the_filter_when_it_hides_the_sample(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("2", "d")
        assert app.debugger.tree.diverging_only
        await pilot.press("slash", *"s-1", "enter")
        await pilot.pause()
        assert not app.debugger.tree.diverging_only
        assert app.debugger.tree.selected_sample == "s-1"


async def test_help_opens_and_every_close_key_closes_it(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        for opener, closer in (("question_mark", "escape"), ("f1", "q"), ("question_mark", "question_mark"),
                               ("f1", "f1")):
            await pilot.press(opener)
            assert isinstance(app.screen, HelpScreen)
            text = screen_text(app)
            assert "Legend" in text  # first; the keys below it, reached by scrolling
            box = app.screen.query_one("#help-box")
            box.scroll_to_widget(app.screen.query_one("#help-text"), top=True, animate=False)
            await pilot.pause()
            text = screen_text(app)
            assert "Everywhere" in text and "Next divergence of the viewed field" in text
            await pilot.press(closer)
            assert not isinstance(app.screen, HelpScreen), (opener, closer)


async def test_rerun_replays_again_in_the_worker(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        first = app.model
        await pilot.press("n", "n")
        await pilot.press("r")
        await ready(pilot)
        assert app.model is not first
        assert state(app) == ("s-5", "kl", 3)


@pytest.mark.parametrize(("name", "key", "code"), [("pr65-buggy", "q", 1), ("pr65-fixed", "q", 0),
                                                     ("pr65-buggy", "ctrl+q", 1)])
async def test_quit_returns_the_replay_exit_code(make_app, name, key, code):
    app = make_app(name)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press(key)
    assert app.return_code == code


async def test_ctrl_c_explains_how_to_quit(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+c")
        assert app.return_code is None and app.is_running
        assert any("Press [b]q[/b] to quit the app" in n.message for n in app._notifications)


# ----------------------------------------------------------------------------------- list panes


async def _walk(pilot, view, rows: int) -> None:
    """Every navigation key of a list pane, with the cursor position it must reach."""
    page = view.scrollable_content_region.height
    steps = [("home", 0), ("down", 1), ("j", 2), ("up", 1), ("k", 0), ("end", rows - 1), ("g", 0),
             ("G", rows - 1), ("home", 0), ("pagedown", min(page, rows - 1)), ("pageup", 0),
             ("ctrl+f", min(page, rows - 1)), ("ctrl+b", min(page, rows - 1)), ("pageup", 0)]  # ctrl+b: tmux's
    for key, expected in steps:
        await pilot.press(key)
        assert view.cursor == expected, key


async def test_stage_pane_keys(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("1")
        stages = app.debugger.stage_list
        await _walk(pilot, stages, 7)
        await pilot.press("home", "down")  # reward.raw
        await pilot.press("enter")
        assert state(app) == ("s-5", "raw_reward", 5)  # per-sample table: cursor on the selected sample
        assert isinstance(app.focused, DiffView)
        await pilot.press("1", "down", "down")  # advantage.kl
        await pilot.press("enter")
        assert state(app) == ("s-5", "kl", 3)
        await pilot.press("1", "G", "enter")  # loss.value: unsupported, nothing to open
        assert state(app) == ("s-5", "kl", 3)
        said = [n.message for n in app._notifications]
        reason = next(s.reason for s in app.model.report.stages if s.stage == "loss.value")
        assert said == [f"loss.value: skipped — {reason}: nothing was compared"] and reason


async def test_sample_tree_keys(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("2")
        tree = app.debugger.tree
        assert tree.rows[tree.cursor] == ("sample", 5)  # opened on the first divergence
        await _walk(pilot, tree, 10)
        await pilot.press("home", "down", "down")
        assert state(app) == ("s-1", "kl", 0)
        await pilot.press("space")  # fold g-0 from a sample row: cursor lands on the group
        assert tree.row_count == 6 and tree.cursor == 0
        await pilot.press("space")
        assert tree.row_count == 10
        await pilot.press("left")
        assert tree.row_count == 6
        await pilot.press("right")
        assert tree.row_count == 10
        await pilot.press("h")
        assert tree.row_count == 6
        await pilot.press("l")
        assert tree.row_count == 10
        await pilot.press("enter")  # on a group: folds it
        assert tree.row_count == 6
        await pilot.press("enter")
        await pilot.press("d")
        assert tree.diverging_only and list(tree.rows) == [("group", 1), ("sample", 5), ("sample", 6)]
        assert tree.selected_sample == "s-5" and app.debugger.sample_id == "s-5"
        assert app.debugger.query_one("SamplesPanel").border_title == "Samples · diverging only"
        await pilot.press("down")
        assert state(app) == ("s-6", "kl", 0)
        await pilot.press("enter")  # on a sample: the diff viewer takes the focus
        assert isinstance(app.focused, DiffView)
        await pilot.press("2", "d")
        assert not tree.diverging_only and tree.row_count == 10 and tree.selected_sample == "s-6"


async def test_diff_view_keys(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("3")
        view = app.debugger.diff_view
        await _walk(pilot, view, 16)
        await pilot.press("f", "f", "f", "f")  # kl → advantage → loss → raw_reward → reward
        assert app.debugger.field == "reward" and view.diff.kind == "sample"
        await pilot.press("down")  # a per-sample table moves the selected sample
        assert app.debugger.sample_id == "s-6"
        await pilot.press("enter")  # opens that sample's first diverging per-token field
        assert state(app) == ("s-6", "kl", 0)


async def test_key_bar_bindings_follow_the_focused_pane(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("2")
        assert "d" in app.active_bindings and app.active_bindings["d"].binding.description == "Diverging"
        await pilot.press("3")
        assert "d" not in app.active_bindings
        assert app.active_bindings["n"].binding.id == "main.next-divergence"


async def test_key_bar_follows_focus_and_its_keys_click(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        bar = app.debugger.query_one(KeyBar)
        # the first frame already lists the diff viewer's keys (no later recompose); on the per-sample reward
        # table, enter opens a sample's per-token diff
        assert [(i.display, i.description) for i in bar.items] == [
            ("⏎", "Open"), ("s", "Sort"), ("w", "Max |err|"), ("x", "Export"), ("tab", "Pane"), ("n", "Next div"),
            ("f", "Field"), ("/", "Jump"), ("?", "Help"), ("q", "Quit"), ("^p", "palette")]
        assert screen_text(app).splitlines()[-1].rstrip() == (
            "⏎ Open s Sort w Max |err| x Export tab Pane n Next div f Field / Jump ? Help q Quit ^p palette")
        await pilot.press("2")
        assert [i.description for i in bar.items][:3] == ["Open", "Diverging", "Fold"]
        # a click on "d Diverging" presses d in the focused sample tree
        diverging = bar.items[1]
        assert (diverging.start, diverging.end) == (7, 18)
        assert await pilot.click(KeyBar, offset=(12, 0))
        await pilot.pause()
        assert app.debugger.tree.diverging_only is True
        # hovering shows the binding's tooltip; a click between keys does nothing
        await pilot.hover(KeyBar, offset=(8, 0))
        assert bar.tooltip == "Show only samples with a mismatch (toggle)"
        assert bar.item_at(18) is None
        await pilot.press("3")
        assert "Diverging" not in [i.description for i in bar.items]
        # s-0's per-token diff: its first token field (teacher forcing: the advantages, judged on the recorded
        # rewards, do not diverge); nothing further to open, so no "Open" key
        await pilot.press("enter")
        assert app.debugger.field == "kl"
        assert "Open" not in [i.description for i in bar.items]


async def test_modal_screens_show_their_own_keys(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("slash")
        assert isinstance(app.screen, JumpScreen)
        assert [(i.display, i.description) for i in app.screen.query_one(KeyBar).items][0] == ("esc", "Cancel")
        assert screen_text(app).splitlines()[-1].startswith("esc Cancel")
        await pilot.press("escape", "question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert screen_text(app).splitlines()[-1].startswith("esc Close")


async def test_key_bar_shows_only_whole_keys_on_a_narrow_terminal(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        bar = app.debugger.query_one(KeyBar)
        # the diff's keys, then the screen's while they fit (80 cells), and always ? and q
        last = screen_text(app).splitlines()[-1].rstrip()
        assert last == "⏎ Open s Sort w Max |err| x Export tab Pane n Next div f Field ? Help q Quit"
        await pilot.press("2")
        last = screen_text(app).splitlines()[-1].rstrip()
        assert last == "⏎ Open d Diverging space Fold tab Pane n Next div f Field / Jump ? Help q Quit"
        assert [i.display for i in bar.items][-2:] == ["?", "q"] and max(i.end for i in bar.items) <= 80
        assert "^p" not in [i.display for i in bar.items]  # only whole keys, laid out for the width


async def test_the_diverging_filter_on_a_passing_bundle_says_why_the_tree_is_empty(make_app):
    app = make_app("pr65-fixed")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("2", "d")
        assert app.debugger.tree.diverging_only and list(app.debugger.tree.rows) == []
        assert "no diverging sample (d shows all)" in screen_text(app)
        await pilot.press("d")
        assert "no diverging sample" not in screen_text(app) and app.debugger.tree.rows


# ------------------------------------------------------------------------------------------ mouse


async def test_mouse_selects_samples_opens_stages_and_scrubs_the_strip(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tree = app.debugger.tree
        assert await pilot.click(SampleTree, offset=(6, tree.rows.index(("sample", 2))))
        await pilot.pause()
        assert app.debugger.sample_id == "s-2"
        assert await pilot.click(StageList, offset=(8, 3))  # advantage.kl
        await pilot.pause()
        assert state(app) == ("s-5", "kl", 3)
        strip = app.debugger.query_one(ErrorStrip)
        assert await pilot.click(ErrorStrip, offset=(strip.size.width - 1, 0))  # the last cell: token 15
        await pilot.pause()
        assert app.debugger.diff_cursor == 15
        assert isinstance(app.focused, DiffView)


# --------------------------------------------------------------------------------- command palette


def test_palette_lists_the_same_actions_as_the_bindings():
    commands = ReplayCommands._commands(None)
    provider_titles = {title for title, _, _ in commands}
    # the debugger's actions: the run view's keys act on its table (the palette is the debugger's)
    assert provider_titles == {command_title(ka) for ka in key_actions() if ka.pane != "runs"}
    assert len(provider_titles) == len(commands)  # each once
    # the help line under a title names the keys and adds only what the title does not already say
    assert [h for t, h, _ in commands if t == "Quit"] == [
        "key q, ^q · exit code: 0 pass, 1 divergence, else the error's"]
    # keys as the key bar shows them, not by their binding names ("slash", "ctrl+q")
    assert [h.split(" · ")[0] for t, h, _ in commands if t == "Jump to a sample by id"] == ["key /"]
    # titles are the tooltip's first clause, as short as their neighbours' (the file formats go under them)
    assert {"Diff: Export the viewed rows", "Diff: Export the field over every sample of the stage"} <= provider_titles
    assert [h for t, h, _ in commands if t == "Focus the next pane"] == ["key tab"]
    assert "Next divergence of the viewed field" in provider_titles
    assert "Samples: Show only samples with a mismatch" in provider_titles


def test_every_binding_has_an_id_and_a_tooltip():
    ids = []
    screens = [HelpScreen, ErrorScreen, JumpScreen]
    bindings = [b for _, _, bs in sections() for b in bs] + [b for s in screens for b in s.BINDINGS]
    for b in bindings:
        assert isinstance(b, Binding)
        assert b.id and b.tooltip, b
        ids.append(b.id)
    assert len(ids) == len(set(ids))
    vim = {b.key for b in bindings if b.id.endswith("-vim")}
    assert vim == {"j", "k", "g", "G", "h", "l", "ctrl+f"}  # not ctrl+b: tmux's prefix
    assert all(not b.show for b in bindings if b.id.endswith("-vim"))


async def test_the_palette_holds_the_debugger_s_commands_only(make_app):
    from textual.command import CommandPalette

    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+p", *"quit")
        await app.workers.wait_for_complete()
        await pilot.pause()
        palette = app.screen
        assert isinstance(palette, CommandPalette)
        shown = [str(o.prompt) for o in palette.query_one("CommandList")._options]
        assert [line.splitlines()[0] for line in shown] == ["Quit"]  # not Textual's own Quit as well
        assert str(palette.query_one("SearchIcon").render()) == ">"  # not 🔎: a missing glyph in many fonts
        await pilot.press("ctrl+u", *"theme")  # nor its themes, keys panel, screenshots
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert not [o for o in palette.query_one("CommandList")._options if "heme" in str(o.prompt)]


async def test_palette_runs_a_pane_action(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+p")
        await pilot.press(*"View the next")
        await app.workers.wait_for_complete()  # the palette searches in a worker
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        assert app.debugger.field == "advantage"
        await pilot.press("ctrl+p", *"Show only")
        await app.workers.wait_for_complete()
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        assert app.debugger.tree.diverging_only and isinstance(app.focused, SampleTree)


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(("name", "key", "code", "words"), [
    ("broken", "q", 3, "broken/COMPLETE: missing COMPLETE sentinel (bundle incomplete or still being written)"),
    ("refused", "escape", 4, "refused/index.json: $.config.use_rollout_logprobs=True: rollout log-probs as the PPO "
                             "anchor are not implemented"),
    ("broken", "enter", 3, "missing COMPLETE sentinel"),
])
async def test_error_screen_shows_the_cli_line_and_exits_with_its_code(make_app, name, key, code, words):
    app = make_app(name)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert isinstance(app.screen, ErrorScreen)
        assert app.screen.code == code
        assert app.screen.line.startswith("replay-tui: error: ") and words in app.screen.line
        assert f"exit code {code}" in screen_text(app)
        await pilot.press(key)
    assert app.return_code == code


@pytest.fixture
def verify_gate(monkeypatch):
    """An Event that holds the replay worker inside open_bundle (never a sleep) until it is set."""
    import threading

    import replay_tui.app as app_module

    gate = threading.Event()
    real_open = app_module.open_bundle

    def held_open(*args, **kwargs):
        assert gate.wait(timeout=30)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(app_module, "open_bundle", held_open)
    yield gate
    gate.set()  # never leave a worker thread waiting


async def test_quitting_before_the_verdict_exits_130_never_0(make_app, verify_gate):
    """The worker is held inside open_bundle: q before any result is not a pass (nor a divergence)."""
    import replay_tui.app as app_module

    gate = verify_gate
    app = make_app("pr65-fixed")  # a passing bundle: 0 would be a lie before its replay ends
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.model is None and app.exit_code == app_module.EXIT_NO_VERDICT == 130
        await pilot.press("q")
        gate.set()
    assert app.return_code == 130


async def test_ui_stays_live_while_the_worker_verifies(make_app, verify_gate):
    """The worker is held inside open_bundle (on an Event, not a sleep): the progress line shows and
    keys still work; releasing it finishes the replay."""
    gate = verify_gate
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        verdict = app.debugger.query_one(VerdictBar)
        assert "verifying bundle (checksums, schema, anchors)" in screen_text(app)
        assert verdict.report is None
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        gate.set()
        await ready(pilot)
        assert verdict.report is app.model.report
        assert state(app) == ("s-0", "reward", 0)
