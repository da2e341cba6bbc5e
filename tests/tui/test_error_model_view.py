"""The error model in the debugger (SPEC §5.1): the diff's ``tol`` and ``×noise`` columns, the DAG's largest
noise ratio per stage, the judging mode under the DAG, and hazards — counted on the verdict line, marked in
the sample tree, listed with ``z`` — which never fail a bundle. Real bundles, the real replay, Pilot."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from rich.style import Style

from replay_lib.bundle import BundleReader
from replay_lib.judge.error_model import Rules
from replay_lib.judge.report import hazard_line
from replay_lib.run.runner import replay
from replay_tui.cells import fmt_ratio, fmt_tolerance
from replay_tui.commands import ReplayCommands
from replay_tui.keys import key_actions
from replay_tui.screens.hazards import HazardList, HazardsScreen
from replay_tui.widgets.diff_view import DiffView
from replay_tui.widgets.key_bar import KeyBar
from replay_tui.widgets.sample_tree import SampleTree

from injection_bundles import SEQUENCES, is_clean, shown
from tui_bundles import LOOSE_KL_ATOL, LOOSE_KL_DELTAS, LOOSE_KL_TOKENS

SIZE = (120, 40)


async def ready(pilot) -> None:
    await pilot.app.wait_settled(pilot)


def screen_lines(app) -> list[str]:
    return [strip.text for strip in app.screen._compositor.render_strips()]


def widget_lines(app, widget) -> list[str]:
    """The rows of ``widget``'s content region, as the terminal shows them."""
    r = widget.scrollable_content_region if hasattr(widget, "scrollable_content_region") else widget.content_region
    strips = app.screen._compositor.render_strips()
    return [strip.crop(r.x, r.right).text.rstrip() for strip in strips[r.y:r.bottom]]


def diff_cells(app) -> tuple[list[str], dict[str, list[str]]]:
    """The diff header's words and each drawn row's cells by its offset (the ``✗`` marker dropped)."""
    screen = app.debugger
    header = screen.query_one("#diff-header").render_line(0).text.split()
    rows = {}
    for line in widget_lines(app, screen.diff_view):
        cells = line.split()
        if cells and cells[0] == "✗":
            cells = cells[1:]
        if cells:
            rows[cells[0]] = cells[1:]
    return header, rows


# ------------------------------------------------------------------------------------ tol and ×noise


async def test_tol_and_noise_columns_are_the_error_model_of_each_row(make_app, bundles):
    app = make_app("loose-kl")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = app.debugger
        assert (screen.sample_id, screen.field, screen.diff_cursor) == ("s-1", "kl", 2)
        header, rows = diff_cells(app)
        assert header == ["offset", "expected", "actual", "abs", "err", "×noise", "tol", "mask"]
        # hand-check of s-1@2 from the bundle's own payloads: recorded kl vs low_var_kl of (old − ref)
        reader = BundleReader(bundles / "loose-kl")
        old, ref, kl = (reader.payload(n).to(torch.float64) for n in ("old_log_probs", "ref_log_probs", "kl"))
        t = 1 * LOOSE_KL_TOKENS + 2
        r = float(old[t] - ref[t])
        actual = math.exp(-r) - 1 + r
        expected = float(kl[t])
        diff = screen.diff_view.diff
        tol = float(diff.tolerance_tensor[2])
        # the bundle's atol (rtol 0) plus the producer's rounding bound, a few ulp of a value below 1
        assert LOOSE_KL_ATOL <= tol <= LOOSE_KL_ATOL + 1e-5
        assert float(diff.noise_tensor[2]) == pytest.approx(abs(actual - expected) / tol, rel=1e-12)
        assert round(abs(actual - expected) / LOOSE_KL_ATOL, 6) == LOOSE_KL_DELTAS[("s-1", 2)] / LOOSE_KL_ATOL
        assert rows["2"] == ["0.25891614", "0.0089161401", "0.25", "2.5", "0.1", "0"]
        assert rows["2"][3] == fmt_ratio(abs(actual - expected) / tol) and rows["2"][4] == fmt_tolerance(tol)
        # s-1@5 is 0.05 off: half the tolerance, no divergence
        assert rows["5"][2:5] == ["0.05", "0.5", "0.1"]
        assert not bool(diff.bad_tensor[5])
        # every other row is floating-point noise of the float32 payload: far below 1
        for offset in ("0", "1", "3", "4", "6", "7"):
            assert float(diff.noise_tensor[int(offset)]) < 1e-6
            assert rows[offset][4] == "0.1"


async def test_the_noise_cell_is_red_beyond_the_tolerance_and_dim_deep_inside_it(make_app):
    app = make_app("loose-kl")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        view = app.debugger.diff_view

        def style_of(row: int, cell: str) -> Style:
            """The style of the segment holding ``cell`` (neighbours of one style are one segment)."""
            strip = view.render_row(row, view.row_width, Style())
            return next(seg.style for seg in strip if cell in seg.text.split())

        assert style_of(2, "2.5").color.name == "red" and style_of(2, "2.5").bold
        assert style_of(0, fmt_ratio(float(view.diff.noise_tensor[0]))).dim


async def test_the_per_sample_table_and_the_loss_fields_have_the_columns_too(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        header, rows = diff_cells(app)
        assert header == ["sample", "group", "expected", "actual", "abs", "err", "×noise", "tol"]
        diff = app.debugger.diff_view.diff
        tol = float(diff.tolerance_tensor[0])
        # s-0: expected -5.5, actual -1.0; no mask column in a table of samples
        assert rows["s-0"][:4] == ["g-0", "-5.5", "-1.0", "4.5"]
        assert rows["s-0"][4:] == [fmt_ratio(4.5 / tol), fmt_tolerance(tol)]
    app = make_app("loss-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        header, rows = diff_cells(app)
        assert header == ["field", "expected", "actual", "abs", "err", "×noise", "tol"]
        diff = app.debugger.diff_view.diff
        i = diff.labels.index("pg_loss")
        err, tol = float(diff.error_tensor[i]), float(diff.tolerance_tensor[i])
        assert err == pytest.approx(0.5, abs=1e-6)
        assert rows["pg_loss"][-2:] == [fmt_ratio(err / tol), fmt_tolerance(tol)]


# ---------------------------------------------------------------------------------- narrow terminals


@pytest.mark.parametrize("width, columns", [
    (59, ["×noise", "tol", "mask"]),  # 6-cell offsets: every column fits
    (58, ["×noise", "tol"]),  # the mask goes first
    (54, ["×noise", "tol"]),
    (53, ["×noise"]),  # then tol
    (46, ["×noise"]),
    (45, []),  # then ×noise: offset, expected, actual and abs err always stay
    (40, []),
])
async def test_narrow_rows_drop_mask_then_tol_then_noise(make_app, width, columns):
    app = make_app("loose-kl")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        view = app.debugger.diff_view
        header = view.render_header(width, Style()).text.split()
        assert header == ["offset", "expected", "actual", "abs", "err"] + columns
        row = view.render_row(2, width, Style())
        assert row.cell_length == width
        cells = row.text.split()
        assert cells[:2] == ["✗", "2"] and cells[4] == "0.25"  # the abs err is whole
        assert len(cells) == 5 + len(columns)


async def test_an_80_column_terminal_keeps_the_essentials_and_the_noise_ratio(make_app):
    app = make_app("loose-kl")
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        header, rows = diff_cells(app)
        assert header == ["offset", "expected", "actual", "abs", "err", "×noise"]
        assert rows["2"] == ["0.2589161", "0.0089161", "0.25", "2.5"]
        # the DAG (under the samples at this height): ×noise instead of max|err| at 47 cells, its old width here
        stages = app.debugger.stage_list.render_header(47, Style()).text.split()
        assert stages == ["stage", "mism", "×noise"]


# ------------------------------------------------------------------------------------ the stage pane


async def test_the_dag_shows_each_stage_s_largest_noise_ratio(make_app):
    app = make_app("loose-kl")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        report = app.model.report
        kl = report.stage("advantage.kl")
        assert kl.max_noise_ratio == pytest.approx(2.5, rel=1e-4)
        lines = widget_lines(app, app.debugger.stage_list)
        header = app.debugger.query_one("#stages-header").render_line(0).text.split()
        assert header == ["stage", "status", "mism", "max|err|", "×noise", "capability"]
        row = next(line for line in lines if "advantage.kl" in line).split()
        assert row[-4:] == ["1", "0.25", "2.5", "recompute"]
        skipped = next(line for line in lines if "loss.value" in line).split()
        assert skipped[-4:] == ["—", "—", "—", "unsupported"]


async def test_the_line_under_the_dag_names_the_mode(make_app):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        detail = str(app.debugger.query_one("#stage-detail").render())
        assert detail.startswith("advantage.kl [recompute · teacher-forced] — kl mismatch in 4 token(s)")
    app = make_app("kl-bug", rules=Rules(chain=True))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.model.report.mode == "chained"
        detail = str(app.debugger.query_one("#stage-detail").render())
        assert detail.startswith("advantage.kl [recompute · chained] — kl mismatch in 4 token(s)")
        await pilot.press("1", "home")  # a skipped stage was not judged at all: no mode
        await pilot.press("end")
        detail = str(app.debugger.query_one("#stage-detail").render())
        assert detail.startswith("loss.value [unsupported]")


# ------------------------------------------------------------------------------------------ hazards


def test_a_bundle_with_a_hazard_passes_headless(bundles):
    """``replay-tui --check``: exit 0, the hazard listed after the stages, nothing on stderr."""
    proc = subprocess.run([sys.executable, "-m", "replay_tui", str(bundles / "hazard-clean"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0] == "bundle hazard-clean — no divergence (6 stage(s) compared)"
    assert [line for line in lines if line.startswith("hazard:")] == [
        hazard_line(h) for h in replay(bundles / "hazard-clean").hazards]


async def test_a_hazard_is_counted_marked_and_listed_and_the_bundle_still_passes(make_app, bundles):
    report = replay(bundles / "hazard-clean")
    assert report.passed and [(h.stage, h.kind, h.group_index) for h in report.hazards] == [
        ("reward.post_process", "zero_advantage_group", 1)]
    app = make_app("hazard-clean")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        lines = screen_lines(app)
        assert lines[1].rstrip() == " ✓ no divergence — 6 stage(s) compared  ⚠ 1 hazard"
        # the tree: group g-1 and its four samples carry the mark, g-0's do not
        tree = [line for line in widget_lines(app, app.debugger.tree) if line]
        assert tree[0].startswith("▾ ✓ g-0") and "⚠" not in tree[0]
        assert [line[:8] for line in tree[1:5]] == ["  ✓ s-0 ", "  ✓ s-1 ", "  ✓ s-2 ", "  ✓ s-3 "]
        assert tree[5].startswith("▾ ✓ g-1") and tree[5].endswith("⚠ 4 samples")
        assert [line[:8] for line in tree[6:10]] == ["⚠ ✓ s-4 ", "⚠ ✓ s-5 ", "⚠ ✓ s-6 ", "⚠ ✓ s-7 "]
        assert "z Hazards" in lines[-1]
        # the stage that found it says so under the DAG
        await pilot.press("1")
        app.debugger.stage_list.cursor = 2
        await pilot.pause()
        assert str(app.debugger.query_one("#stage-detail").render()).endswith("⚠ 1 hazard")
        # z lists it, as the text report words it; enter shows its group's first sample in the tree
        await pilot.press("z")
        assert isinstance(app.screen, HazardsScreen)
        listed = app.screen.query_one(HazardList)
        assert [r.line for r in listed.rows] == [hazard_line(report.hazards[0]).removeprefix("hazard: ")]
        assert any(line.strip("│ ").startswith("⚠ reward.post_process zero_advantage_group g-1: group g-1")
                   for line in screen_lines(app))
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, HazardsScreen)
        assert app.debugger.sample_id == "s-4" and isinstance(app.focused, SampleTree)
        assert app.debugger.tree.selected_sample == "s-4"
        await pilot.press("z", "escape")
        assert not isinstance(app.screen, HazardsScreen)
        await pilot.press("q")
    assert app.return_code == 0


async def test_a_cohort_s_group_hazard_marks_that_rank_s_group_only(tmp_path):
    """Each rank normalizes its own groups: a hazard on group 9 of rank 1 marks rank 1's g-9, not rank 0's."""
    from replay_lib.demo import bundles as demo
    from replay_tui.app import ReplayApp

    cohort = demo.write_cohort(tmp_path / "cohort", samples=20, tokens=4, group_size=2)
    hazards = [(h.group_index, h.rank) for h in replay(cohort).hazards]
    assert (9, 1) in hazards and (9, 0) not in hazards
    app = ReplayApp(cohort)
    async with app.run_test(size=(120, 80)) as pilot:
        await ready(pilot)
        model = app.debugger.model
        marks = app.debugger.hazards
        by_label = {g.label: gi for gi, g in enumerate(model.groups)}
        assert by_label["g-9 · rank 1"] in marks.groups and by_label["g-9 · rank 0"] not in marks.groups
        marked = {model.samples[i].sample_id for i in marks.samples}
        assert {"r1-s-18", "r1-s-19"} <= marked and not {"r0-s-18", "r0-s-19"} & marked
        rows = [r.line for r in marks.rows if r.hazard.group_index == 9]
        assert rows == [hazard_line(h, True).removeprefix("hazard: ") for h in replay(cohort).hazards
                        if h.group_index == 9]
        assert rows[0].startswith("reward.post_process zero_advantage_group g-9 [rank 1]: ")


async def test_without_hazards_there_is_no_mark_and_no_hazard_key(make_app):
    app = make_app("pr65-fixed")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.model.report.hazards == []
        lines = screen_lines(app)
        assert "⚠" not in "\n".join(lines[1:-1])
        assert "Hazards" not in [i.description for i in app.debugger.query_one(KeyBar).items]
        await pilot.press("z")
        assert not isinstance(app.screen, HazardsScreen)
    # the help and the palette list the key all the same (they read the same bindings)
    assert [ka.keys for ka in key_actions() if ka.action == "hazards"] == [("z",)]
    assert "List the report's hazards" in {title for title, _, _ in ReplayCommands._commands(None)}


async def test_a_narrow_verdict_keeps_the_stage_and_moves_the_hazard_count(make_app):
    app = make_app("kl-bug")  # fails in advantage.kl; its group g-1 has all-zero advantages
    async with app.run_test(size=(30, 24)) as pilot:
        await ready(pilot)
        lines = [line.rstrip() for line in screen_lines(app)[1:5]]
        assert lines[0] == " ✗ first divergence in advan…"
        assert lines[3].endswith(" …  ⚠1")
    async with make_app("kl-bug").run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        lines = [line.rstrip() for line in screen_lines(pilot.app)[1:3]]
        assert lines[0] == " ✗ first divergence in advantage.kl  ⚠ 1 hazard"
        assert lines[1].startswith("   kl s-5@3: expected=0.25077856 actual=")


# ------------------------------------------------------------------------------------------ injection


def write_hostile_hazard(path, seq: str):
    """Sample ids carrying ``seq``; token 3 of the second sample has a reference log-prob 15 nats below its old
    one, so its k3 is beyond low_var_kl's ±10 clamp: a ``kl_clamp`` hazard naming that sample."""
    from replay_lib.demo import bundles as demo

    manifest, index, expected, payloads = demo.synthetic_parts(samples=4, tokens=8, seed=4, bundle_id="hostile-hz",
                                                               sample_prefix=f"s{seq}")
    t = 1 * 8 + 3
    ref = payloads["ref_log_probs"].clone()
    ref[t] = payloads["old_log_probs"][t] + 15.0
    kl = payloads["kl"].clone()
    kl[t] = 10.0  # the clamp, as the producer recorded it
    payloads = dict(payloads, ref_log_probs=ref, kl=kl)
    return demo.write_bundle(path, manifest, index, expected, payloads)


@pytest.mark.parametrize("name", list(SEQUENCES))
async def test_hazard_lines_show_bundle_strings_escaped(tmp_path, name):
    from replay_tui.app import ReplayApp

    seq = SEQUENCES[name]
    bundle = write_hostile_hazard(tmp_path / "hostile", seq)
    report = replay(bundle)
    clamp = [h for h in report.hazards if h.kind == "kl_clamp"]
    assert [h.sample_id for h in clamp] == [f"s{seq}1"]
    app = ReplayApp(bundle)
    async with app.run_test(size=(160, 40)) as pilot:
        await ready(pilot)
        tree = [line for line in widget_lines(app, app.debugger.tree) if line]
        assert is_clean("\n".join(tree))
        assert [line[:1] for line in tree[1:5]] == [" ", "⚠", " ", " "]  # the second sample's row only
        assert tree[2][4:].startswith(shown(f"s{seq}")[:6])
        await pilot.press("z")
        assert isinstance(app.screen, HazardsScreen)
        text = "\n".join(screen_lines(app))
        assert is_clean(text)
        assert f"advantage.kl kl_clamp {shown(f's{seq}1')}: {shown(f's{seq}1')}: 1 token(s)" in text
        await pilot.press("enter")
        await pilot.pause()
        assert app.debugger.sample_id == f"s{seq}1"
        assert is_clean("\n".join(screen_lines(app)))


async def test_a_long_hazard_is_shown_whole_under_the_list_at_80x24():
    """A coarse_payload hazard under --chain runs to ~400 characters (payloads, u, what each value admits, the
    way out): highlighted, it is shown whole, wrapped under the list, at 80×24 too (it was cut after 4 lines)."""
    from textual.app import App

    from replay_lib.judge.report import Hazard
    from replay_tui.hazards import HazardRow

    words = " ".join(f"w{i:03d}" for i in range(90))  # 449 characters, the last word w089
    hazard = Hazard(stage="reward.post_process", kind="coarse_payload", message=words)
    rows = [HazardRow(line=f"reward.post_process coarse_payload: {words}", hazard=hazard, sample=None, group=None)]

    class Host(App):
        def on_mount(self) -> None:
            self.push_screen(HazardsScreen(rows))

    app = Host()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.pause()
        lines = [strip.text for strip in app.screen._compositor.render_strips()]
        start = next(i for i, line in enumerate(lines) if "↳ in full:" in line)
        shown = " ".join(line.strip("│ ╭╮╰╯─") for line in lines[start:])
        assert shown.startswith("↳ in full: reward.post_process coarse_payload: w000")
        assert "w088 w089" in shown, shown  # on the screen, not only in the widget's text
