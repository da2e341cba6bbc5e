"""Diff navigation: sort by |err| (s), divergent rows only (D), the largest |err| (w), ``/@17`` and a value
(/), the error plot's scale (L: log), zoom (m).

kl-bug: 8 samples × 16 tokens; the recorded kl is +0.25 off at s-5@3, 7, 11 and s-6@0 (every other token's
|err| is float rounding, below 1e-6). loose-kl: s-1@2 is 0.25 off, s-1@5 0.05 (within atol 0.1)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from replay_lib.judge.report import fmt_value
from replay_tui.cells import fmt_tolerance
from replay_tui.widgets.diff_view import DiffPanel
from replay_tui.widgets.error_plot import LABEL_W, ErrorStrip, bar_levels

SIZE = (120, 40)


async def ready(pilot) -> None:
    await pilot.app.wait_settled(pilot)


def shown_rows(view) -> list[int]:
    return [view.row_at(i) for i in range(view.row_count)]


async def test_s_sorts_by_err_and_keeps_the_cursor_on_its_token(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        view = app.debugger.diff_view
        assert (app.debugger.sample_id, view.data_row) == ("s-5", 3)
        await pilot.press("s")
        rows = shown_rows(view)
        # the three ≈0.25 errors first (each 0.25 plus its own rounding), then the rounding-level ones
        assert sorted(rows[:3]) == [3, 7, 11] and sorted(rows) == list(range(16))
        errs = [float(view.diff.error_tensor[r]) for r in rows]
        assert errs == sorted(errs, reverse=True)
        assert view.data_row == 3 and view.cursor == rows.index(3)
        # n still follows the offsets: 3 → 7, wherever the sort shows it
        await pilot.press("n")
        assert (view.data_row, view.cursor) == (7, rows.index(7))
        assert "by |err|" in str(app.debugger.query_one("#diff-info").render())
        await pilot.press("s")
        assert shown_rows(view) == list(range(16)) and view.data_row == 7


async def test_D_shows_only_divergent_rows_and_lifts_when_a_hidden_row_is_asked_for(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        view = app.debugger.diff_view
        await pilot.press("D")
        assert shown_rows(view) == [3, 7, 11] and view.data_row == 3
        await pilot.press("down")
        assert view.data_row == 7
        # the error plot clicks through to any token: a hidden one lifts the filter
        view.show_row(0)
        assert not view.divergent_only and view.row_count == 16 and view.data_row == 0
        # a diff without a divergence has nothing to filter to: it says so and stays
        app.debugger.select(sample_id="s-0")
        await pilot.pause()
        await pilot.press("D")
        assert not view.divergent_only and view.row_count == 16


async def test_w_goes_to_the_largest_err(make_app):
    app = make_app("loose-kl")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        view = app.debugger.diff_view
        await pilot.press("home")
        assert view.data_row == 0
        await pilot.press("w")
        assert view.data_row == 2  # 0.25 off, more than s-1@5's 0.05


async def test_slash_at_offset_and_its_errors(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        view = app.debugger.diff_view
        await pilot.press("slash", *"@12", "enter")
        assert view.data_row == 12 and app.screen is app.debugger and app.debugger.sample_id == "s-5"
        await pilot.press("slash", *"@16", "enter")  # s-5 has 16 tokens: 0…15
        error = str(app.screen.query_one("#jump-error").render())
        assert error == "@16 is outside the token offsets of s-5 (0…15)"
        await pilot.press("escape")
        await pilot.press("slash", *"@x", "enter")
        assert "an offset is @ and a whole number" in str(app.screen.query_one("#jump-error").render())
        await pilot.press("escape")
        # a sample id still jumps to the sample
        await pilot.press("slash", *"s-6", "enter")
        assert app.debugger.sample_id == "s-6"


async def test_slash_a_value_finds_the_next_row_that_matches_it_to_the_digits_typed(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        view = app.debugger.diff_view
        diff = view.diff
        # a value of row 9, typed with 4 significant digits: it matches within half a unit of the 4th digit
        target = float(diff.actual_tensor[9])
        typed = f"{target:.4g}"
        half = float(Decimal(5).scaleb(Decimal(typed).as_tuple().exponent - 1))
        hits = [r for r in range(16) if abs(float(diff.expected_tensor[r]) - float(typed)) <= half
                or abs(float(diff.actual_tensor[r]) - float(typed)) <= half]
        assert 9 in hits
        await pilot.press("slash", *typed, "enter")
        assert view.data_row == next(r for r in hits if r > 3)
        await pilot.press("slash", *"123456", "enter")
        assert str(app.screen.query_one("#jump-error").render()) == \
            "no expected or actual value matches 123456 to the digits typed"


def test_log_levels_by_hand():
    # peaks 0, 1e-6, 1e-3, 1 with top 1: linear 0, 1e-6, 1e-3, 1; log from 1e-6: 0, ε, 0.5, 1
    levels, low = bar_levels([0.0, 1e-6, 1e-3, 1.0], 1.0, log=False)
    assert (levels, low) == ([0.0, 1e-6, 1e-3, 1.0], 0.0)
    levels, low = bar_levels([0.0, 1e-6, 1e-3, 1.0], 1.0, log=True)
    assert low == 1e-6 and levels[0] == 0.0 and levels[1] == 1e-9 and levels[3] == 1.0
    assert levels[2] == pytest.approx(0.5, abs=1e-12)  # log(1e-3 / 1e-6) / log(1 / 1e-6) = 3 / 6


async def test_the_error_plot_has_its_scale_and_L_makes_it_log(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        plot = app.debugger.query_one(ErrorStrip)
        assert plot.size.height == 3
        lines = [plot.render_line(y).text for y in range(3)]
        # top: the largest |err| (0.25), bottom: the linear axis' 0
        assert lines[0][:LABEL_W] == fit_label(fmt_tolerance(0.25)) + " ┤"
        assert lines[2][:LABEL_W] == fit_label("0") + " ┤" and lines[1][:LABEL_W] == fit_label("|err|") + " │"
        # 16 tokens over the bins: every bin of token 3 is full height (red); token 0's only the floor
        bins = plot.size.width - LABEL_W
        b3 = plot.view.diff.bins_of_row(3, bins)
        b0 = plot.view.diff.bins_of_row(0, bins)
        assert all(lines[0][LABEL_W + b] == "█" for b in b3)
        assert all(lines[0][LABEL_W + b] == " " and lines[2][LABEL_W + b] in "▁▂" for b in b0)
        await pilot.press("L")
        low, top = plot.scale
        diff = plot.view.diff
        finite = [float(e) for e in diff.error_tensor if float(e) > 0]
        assert top == 0.25 + 0.0 or top == pytest.approx(max(finite))
        assert low == min(finite)  # every token is its own bin here (more bins than tokens)
        assert plot.render_line(2).text[:LABEL_W] == fit_label(fmt_tolerance(low)) + " ┤"
        assert plot.render_line(1).text[:LABEL_W] == fit_label("log") + " │"
        assert "log |err|" in str(app.debugger.query_one("#diff-info").render())


def fit_label(text: str) -> str:
    return text.rjust(LABEL_W - 2)


async def test_m_zooms_the_focused_pane_and_restores_it(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = app.debugger
        await pilot.press("m")
        assert screen.maximized is screen.query_one(DiffPanel) and screen.diff_view.has_focus
        # the pane takes the screen: its rows are the terminal's width (less the border) and 30 of its 40 lines
        assert screen.diff_view.size == (118, 30)
        await pilot.press("m")
        assert screen.maximized is None
        await pilot.press("2", "m")
        assert screen.maximized is screen.tree.parent and screen.tree.has_focus
        await pilot.press("m")
        assert screen.maximized is None


async def test_y_and_Y_copy_over_osc52_the_exact_bytes(make_app):
    import base64

    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        written: list[str] = []
        app._driver.write = written.append  # what reaches the terminal
        diff = app.debugger.diff_view.diff
        e, a, err, _ = diff.row(3)
        await pilot.press("y")
        value = repr(a)  # in full (the float64's shortest repr, as the export writes it), not the shown digits
        assert len(value) > len(fmt_value(a)) and float(value) == a
        assert written == ["\x1b]52;c;" + base64.b64encode(value.encode()).decode() + "\a"]
        await pilot.press("Y")
        tol = float(diff.tolerance_tensor[3])
        row = f"kl s-5@3: expected={fmt_value(e)} actual={fmt_value(a)} abs_err={fmt_value(err)} " \
              f"tol={fmt_value(tol)} divergent"
        assert written[1] == "\x1b]52;c;" + base64.b64encode(row.encode()).decode() + "\a"
        assert app.clipboard == row


async def test_the_plot_s_cursor_column_follows_the_cursor(make_app):
    from replay_tui.widgets.error_plot import CURSOR_MARK

    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        plot = app.debugger.query_one(ErrorStrip)
        diff = plot.view.diff
        bins = plot.size.width - LABEL_W

        def marked() -> set[int]:
            """The bins drawn in the cursor's colour on the bottom line."""
            line = plot.render_line(plot.size.height - 1).crop(LABEL_W, plot.size.width)
            out, x = set(), 0
            for seg in line:
                if seg.style is not None and seg.style.color is not None and \
                        seg.style.color.name == CURSOR_MARK.color.name:
                    out |= set(range(x, x + len(seg.text)))
                x += len(seg.text)
            return out

        def pointer() -> set[int]:
            """Where the screen shows ▾ on the plot's top line (over an empty bar: the cursor's column)."""
            strips = app.screen._compositor.render_strips()
            top = strips[plot.region.y].crop(plot.region.x + LABEL_W, plot.region.right).text
            return {i for i, ch in enumerate(top) if ch == "▾"}

        assert marked() == set(diff.bins_of_row(3, bins)) and pointer() == set()  # token 3: a full bar
        await pilot.press("down")
        await pilot.pause()
        # token 4's |err| is rounding-level: its top cells are empty, so the screen shows the ▾ there
        assert marked() == set(diff.bins_of_row(4, bins)) == pointer()


async def test_Y_copies_a_hostile_sample_id_escaped(tmp_path, bundle_tools):
    import base64

    from injection_bundles import SEQUENCES, shown, write_hostile

    from replay_tui.app import ReplayApp

    seq = SEQUENCES["osc52"]  # an OSC 52 of its own in the sample ids: it must not reach the terminal raw
    app = ReplayApp(write_hostile(tmp_path / "hostile", seq, bundle_tools.reseal))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        written: list[str] = []
        app._driver.write = written.append
        diff = app.debugger.diff_view.diff
        tol = float(diff.tolerance_tensor[0])
        await pilot.press("Y")
        # PR #65's s-0: recorded −5.5, recomputed −1.0; its id s<OSC 52>0 shown (and copied) escaped
        row = f"reward s{shown(seq)}0: expected=-5.5 actual=-1.0 abs_err=4.5 tol={fmt_value(tol)} divergent"
        assert "\x1b" not in row and "\\x1b" in row
        assert written == ["\x1b]52;c;" + base64.b64encode(row.encode()).decode() + "\a"]
