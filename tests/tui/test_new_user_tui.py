"""Rough edges a new user hit in the debugger: the legend, why a stage opens nothing, a cohort's identity."""

from __future__ import annotations

import re

from replay_tui.screens.help import LEGEND, HelpScreen
from replay_tui.widgets.identity_pane import IdentityPane

SIZE = (120, 40)


async def ready(pilot) -> None:
    await pilot.app.wait_settled(pilot)


def screen_text(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def test_question_mark_shows_the_legend_of_every_mark(make_app):
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        text = screen_text(app)
        assert "Legend" in text
        # each of the marks the issue names, with the words that explain it
        for mark, words in (("·", "not compared"), ("○", "a skipped stage"), ("✗", "mismatches (red)"),
                            ("reward", "the samples' reward column is the recorded value")):
            assert re.search(rf"│ {re.escape(mark)} +{re.escape(words)}", text), mark
        assert [m for m, _, _ in LEGEND] == ["✓", "✗", "·", "○", "◀ first", "⚠", "▾ ▸", "reward"]


async def test_enter_on_a_skipped_stage_says_why(make_app):
    app = make_app("step-loss")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        skipped = [i for i, s in enumerate(app.model.report.stages) if s.status == "skipped"]
        assert skipped
        await pilot.press("1", "home", *["down"] * skipped[0], "enter")
        await pilot.pause()
        stage = app.model.report.stages[skipped[0]]
        assert [n.message for n in app._notifications] == [
            f"{stage.stage}: skipped — {stage.reason}: nothing was compared"]


async def test_a_cohort_identity_lists_every_rank_s_batches(make_app):
    app = make_app("cohort-2rank")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        rows = dict(app.screen.query_one(IdentityPane).rows)
        # rank 0 consumes cb-0 / mb-0000, rank 1 cb-1 / mb-0001 (one rollout partition rp-0): the cohort's
        assert rows["partitions"] == "rp-0"
        assert rows["consumer"] == "cb-0, cb-1"
        assert rows["micro-batch"] == "mb-0000, mb-0001"


def test_the_loss_table_says_how_its_mode_aggregates(tmp_path):
    """verl-dapo records a token mean: the loss table must not call its values sums of per-sample means."""
    from replay_lib.bundle import open_bundle
    from replay_lib.demo import write_demos
    from replay_lib.runner import replay_run
    from replay_tui.model import build_model

    path = write_demos(tmp_path)["verl-dapo"]
    bundles = open_bundle(path)
    report, contexts = replay_run(bundles)
    note = build_model(bundles, report, contexts=contexts).field_diff("loss", None).note
    assert note.startswith("loss terms aggregated token_mean (× ") and "per-sample means" not in note
