"""The debugger shows the likely cause under the verdict, and under ``--chain`` marks a stage that fails only
because of an upstream one as downstream (``↓ down`` in the stage pane, said in its detail line)."""

from __future__ import annotations

from replay_lib.judge.error_model import Rules
from replay_tui.widgets.stage_pane import StageList, StagesPanel
from replay_tui.widgets.status_bar import VerdictBar

SIZE = (120, 40)
# PR #65 (SPEC §4): raw rewards [1, 3, 10, 12] centered over the whole batch (mean 6.5) → [−5.5, −3.5, 3.5, 5.5]
# 118 cells of text (padding 0 1), 116 after the indent: the line is cut at the last space that fits
CAUSE = ["  likely cause: the recorded rewards equal group normalization over the whole batch of 4 samples (not semantic "
         "groups)", "  — 4/4 samples"]


def bar_lines(app) -> list[str]:
    return str(app.screen.query_one(VerdictBar).render()).splitlines()


async def test_the_likely_cause_is_under_the_verdict(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await app.wait_settled(pilot)
        assert bar_lines(app) == [
            "✗ first divergence in reward.post_process — reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5", *CAUSE]


async def test_a_narrow_bar_cuts_the_cause_into_two_lines(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=(60, 24)) as pilot:
        await app.wait_settled(pilot)
        lines = bar_lines(app)
        assert lines[0] == "✗ first divergence in reward.post_process"
        # 58 cells of text (padding 0 1), 56 after the indent: the second line ends with an ellipsis
        assert lines[-2:] == ["  likely cause: the recorded rewards equal group",
                              "  normalization over the whole batch of 4 samples (not …"]


async def test_no_cause_line_when_none_matches(make_app):
    app = make_app("kl-bug")  # +0.25 on four tokens: no known bug does that
    async with app.run_test(size=SIZE) as pilot:
        await app.wait_settled(pilot)
        lines = bar_lines(app)
        assert lines[0].startswith("✗ first divergence in advantage.kl")
        assert not any("likely cause" in line for line in lines)


async def test_chain_marks_the_downstream_stage(make_app):
    app = make_app("pr65-buggy", rules=Rules(chain=True))
    async with app.run_test(size=SIZE) as pilot:
        await app.wait_settled(pilot)
        stages = app.screen.query_one(StageList)
        row = [s.stage for s in stages.report.stages].index("advantage.estimate")
        text = stages.render_row(row, 100, stages.rich_style).text
        assert text.startswith("   └↓ advantage.estimate         down       12      4.5  1.1e5  recompute    ")
        root = stages.render_row(row - 2, 100, stages.rich_style).text  # reward.post_process: the root cause
        assert root.startswith(" └✗ reward.post_process ◀ first  FAIL        4      4.5  1.1e5  recompute    ")
        panel = app.screen.query_one(StagesPanel)
        panel.show_detail(stages.report.stages[row])
        detail = str(panel.query_one("#stage-detail").render())
        assert detail.endswith("— downstream of reward.post_process: passes on its recorded inputs")
