"""Small terminals: the PR #65 reward table at 60×20 gets the width first and keeps expected, actual and abs err
(the low-value columns go first), → scrolls to the others, the DAG keeps its ◀; at 80×24 the DAG shows all 7 stages; zoom gives a pane
the whole screen. PR #65: recorded −5.5, −3.5, 3.5, 5.5; recomputed −1, 1, −1, 1; |err| 4.5 each."""

from __future__ import annotations

from rich.style import Style

from replay_tui.widgets.diff_view import DiffPanel


async def ready(pilot) -> None:
    await pilot.app.wait_settled(pilot)


def screen_lines(app) -> list[str]:
    return [strip.text for strip in app.screen._compositor.render_strips()]


def header(app) -> list[str]:
    return app.debugger.query_one("#diff-header").render_line(0).text.split()


async def test_60x20_gives_the_diff_the_width_first(make_app):
    """The first frame at 60×20 leaves the diff 38 cells: the recorded value (expected) beside the recomputed one
    and its error; the sample list and the DAG under it take the 22 left (their names cut, the ◀ kept)."""
    app = make_app("pr65-buggy")
    async with app.run_test(size=(60, 20)) as pilot:
        await ready(pilot)
        screen = app.debugger
        assert screen.query_one("#left").size.width == 22
        view = screen.diff_view
        assert view.row_width == 35  # 38 cells of pane: the borders and the scrollbar take 3
        assert header(app) == ["sample", "expected", "actual", "abs", "err"]
        cells = view.render_row(0, view.row_width, Style()).text.split()
        assert cells == ["✗", "s-0", "-5.5", "-1.0", "4.5"]
        # the DAG's name column is cut, not its first-divergence mark
        dag = [line for line in screen_lines(app) if "reward… ◀" in line]
        assert len(dag) == 1
        # → shows the columns left out, one further per press from the first (the group)
        await pilot.press("right")
        assert header(app) == ["←", "sample", "group", "expected", "actual"]
        assert view.render_row(0, view.row_width, Style()).text.split() == ["✗", "s-0", "g-0", "-5.5", "-1.0"]
        for _ in range(3):
            await pilot.press("right")
        assert header(app) == ["←", "sample", "abs", "err", "×noise", "tol"]
        await pilot.press("right")  # the last column is shown: nothing further
        assert header(app) == ["←", "sample", "abs", "err", "×noise", "tol"]
        for _ in range(5):
            await pilot.press("left")
        assert header(app) == ["sample", "expected", "actual", "abs", "err"] and view.col_offset == 0
        # wider again: the left column goes back to its usual 30 cells
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert screen.query_one("#left").size.width == 30


async def test_80x24_shows_the_loss_table_s_recorded_value(tmp_path):
    """verl-dapo's loss table at 80×24: its long row names (pg_clipfrac_from_terms, 22 cells) widen the key, so
    the left column gives up 4 cells and the diff keeps the recorded value (expected) beside the recomputed one
    and its error; on a table keyed by sample ids the left column has its 30 cells again."""
    from replay_lib.demo import write_demo
    from replay_tui.app import ReplayApp

    app = ReplayApp(write_demo("verl-dapo", tmp_path / "verl-dapo"))
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await pilot.press("3")
        await pilot.pause()
        assert app.debugger.query_one("#left").size.width == 26
        assert header(app) == ["field", "expected", "actual", "abs", "err"]
        row = app.debugger.diff_view.render_row(0, app.debugger.diff_view.row_width, Style()).text.split()
        assert row[:4] == ["✗", "loss_from_terms", "1.644468", "0.203022"]  # 1.6444676 in fewer digits
        app.debugger.select(field="pg_contribution")
        await pilot.pause()
        assert app.debugger.query_one("#left").size.width == 30
        assert header(app)[:3] == ["sample", "group", "expected"]


async def test_60x20_zoom_shows_the_whole_row(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=(60, 20)) as pilot:
        await ready(pilot)
        await pilot.press("right")  # scrolled in the narrow pane …
        assert header(app)[0] == "←"
        await pilot.press("m")
        assert app.debugger.maximized is app.debugger.query_one(DiffPanel)
        # … and zoomed: 58 cells, still short of every column, so the group stays scrolled past and tol shows
        assert header(app) == ["←", "sample", "expected", "actual", "abs", "err", "×noise", "tol"]
        await pilot.press("left")  # unscrolled: by value, tol is the one left out
        assert header(app) == ["sample", "group", "expected", "actual", "abs", "err", "×noise"]
        await pilot.press("m")
        assert header(app) == ["sample", "expected", "actual", "abs", "err"]


async def test_80x24_shows_every_stage_under_the_samples(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        screen = app.debugger
        stages = screen.stage_list
        assert stages.parent.parent.id == "left"  # under the samples: the diff has the right column's height
        assert stages.size.height == 7 and stages.row_count == 7 and stages.max_scroll_y == 0
        names = [line.split("│")[1] for line in screen_lines(app)[stages.region.y:stages.region.bottom]]
        assert [n.split()[1] for n in names] == ["sample", "reward.raw", "reward.post_pro…", "advantage.kl",
                                                 "advantage.estim…", "loss.policy", "loss.value"]
        # all four samples of the reward table show beside the plot and the why strip
        assert screen.diff_view.size.height >= 4 and screen.diff_view.max_scroll_y == 0
        # taller again: the DAG goes back above the diff, its cursor where it was
        await pilot.press("1", "down")
        await pilot.resize_terminal(120, 40)
        await pilot.pause()
        assert screen.stage_list.parent.parent.id == "right" and screen.stage_list.cursor == 3
        assert screen.stage_list.has_focus
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert screen.stage_list.parent.parent.id == "left" and screen.stage_list.cursor == 3


async def test_a_scroll_is_dropped_where_every_column_fits(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        assert header(app) == ["offset", "expected", "actual", "abs", "err", "×noise"]  # 47 cells: tol, mask out
        await pilot.press("right")
        assert header(app) == ["←", "offset", "actual", "abs", "err", "×noise", "tol", "mask"]
        await pilot.press("m")  # 77 cells: every column fits, so nothing is scrolled past
        assert header(app) == ["offset", "expected", "actual", "abs", "err", "×noise", "tol", "mask"]
        await pilot.press("m")
        assert header(app)[0] == "←"


async def test_80x24_wraps_the_why_strip_s_second_line(make_app):
    """At 80×24 the why strip has two rows for the formula and two for its inputs: the group's std, eps and
    std-norm wrap onto a second row instead of being cut with …"""
    from replay_tui.widgets.why_strip import WhyStrip

    app = make_app("pr65-buggy")
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        strip = app.debugger.query_one(WhyStrip)
        assert strip.size == (48, 4)
        shown = [line[strip.region.x:strip.region.right].rstrip()
                 for line in screen_lines(app)[strip.region.y:strip.region.bottom]]
        assert shown == ["why s-0 r − mean = 1.0 − 2.0 = -1.0 (std",
                         "  normalization off)",
                         "group g-0  raw [1.0, 3.0]  mean 2.0  std",
                         "  1.41421356  eps 1e-06  std-norm off"]


async def test_m_on_identity_fills_the_screen(make_app):
    """Zoomed, the identity pane takes every row, as the other panes do: no hatched screen around its rows."""
    from replay_tui.widgets.identity_pane import IdentityPane

    app = make_app("pr65-buggy")
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await pilot.press("4", "m")
        pane = app.debugger.query_one(IdentityPane)
        assert app.debugger.maximized is pane
        assert pane.region.height == 40
        lines = screen_lines(app)
        assert lines[0].startswith("╭─ Identity ") and lines[-1].startswith("╰")
        assert not any("╱" in line for line in lines)
