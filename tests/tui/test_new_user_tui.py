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
    from replay_lib.run.runner import replay_run
    from replay_tui.model import build_model

    path = write_demos(tmp_path)["verl-dapo"]
    bundles = open_bundle(path)
    report, contexts = replay_run(bundles)
    note = build_model(bundles, report, contexts=contexts).field_diff("loss", None).note
    assert note.startswith("loss terms aggregated token_mean (× ") and "per-sample means" not in note


# -------------------------------------------------------------------- a second new user's round (verl-dapo, …)


def _dapo_model(tmp_path):
    from replay_lib.bundle import open_bundle
    from replay_lib.demo import write_demo
    from replay_lib.run.runner import replay_run
    from replay_tui.model import build_model

    bundles = open_bundle(write_demo("verl-dapo", tmp_path / "verl-dapo"))
    report, contexts = replay_run(bundles)
    return build_model(bundles, report, contexts=contexts), contexts[0]


def test_the_loss_table_holds_the_aggregation_check_the_report_names(tmp_path):
    """verl-dapo fails on 4 scalars: the recorded loss and pg_loss against the recorded per-sample terms
    aggregated (loss_from_terms, pg_loss_from_terms, the report's first divergence) and against the recompute
    (loss, pg_loss). The table shows all of them, the check's rows first, as the stage compared them."""
    model, _ = _dapo_model(tmp_path)
    diff = model.field_diff("loss")
    assert diff.labels == ["loss_from_terms", "pg_loss_from_terms", "pg_clipfrac_from_terms", "ppo_kl_from_terms",
                           "loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"]
    assert diff.divergent == [0, 1, 4, 5]
    assert model.report.first_divergence.field == "loss_from_terms"
    stage = next(s for s in model.report.stages if s.stage == "loss.policy")
    assert stage.mismatches == len(diff.divergent) == 4
    # each row's why: the sums it aggregates, their weights and its value — the recorded terms for the check's
    # rows, the recompute's for the others (loss = pg_loss: entropy_coef 0, no KL term)
    check = model.element_inputs("loss", None, 0)
    assert check.formula == "loss_from_terms = pg_loss_from_terms = 0.20302161"
    assert check.items == (("from", "the recorded per-sample terms"), ("over", "16 sample(s), 206 loss token(s)"))
    assert model.element_inputs("loss", None, 5).formula == \
        "pg_loss = 4·Σ_i pg_sum_i / loss_token_count = 0.20302161 (token_mean)"
    assert model.element_inputs("loss", None, 5).items[0] == ("from", "the recompute's per-sample sums")
    recorded = model.shards[0].results["pg_sum"].expected
    assert abs(4 * float(recorded.sum()) / 824 - diff.row(1)[1]) < 1e-12  # pg_loss_from_terms, by hand


async def test_e_opens_the_loss_table_on_the_first_divergence_s_row(tmp_path):
    from replay_lib.demo import write_demo
    from replay_tui.app import ReplayApp

    app = ReplayApp(write_demo("verl-dapo", tmp_path / "verl-dapo"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        view = app.debugger.diff_view
        assert (view.diff.field, view.diff.label(view.data_row)) == ("loss", "loss_from_terms")
        await pilot.press("down", "down", "e")
        await pilot.pause()
        assert view.diff.label(view.data_row) == "loss_from_terms"


def test_the_pg_loss_terms_follow_the_loss_mode(tmp_path):
    """verl-dapo: token_mean over loss_token_count = 824, loss_scale 4 (dp). s-0's recorded pg_sum 9.851029…
    enters pg_loss as 4 · 9.851029 / 824 = 0.0478205…, and the 16 terms add up to the recomputed pg_loss."""
    model, ctx = _dapo_model(tmp_path)
    pg_sum = float(model.shards[0].results["pg_sum"].expected[0])
    assert abs(pg_sum - 9.851029) < 1e-6
    terms = model.field_diff("pg_contribution")
    assert abs(terms.row(terms.labels.index("s-0"))[0] - pg_sum * 4 / 824) < 1e-15
    pg_loss = model.field_diff("loss").row(5)[1]
    assert abs(float(terms.actual_tensor.sum()) - pg_loss) < 1e-12
    formula = model.element_inputs("pg_contribution", "s-0", terms.labels.index("s-0")).formula
    assert formula == "pg_loss term = pg_sum × 4 / loss_token_count = 9.851029 × 4 / 824 = 0.04782053"


def test_the_default_mode_s_terms_read_as_before(make_app, bundles):
    """sum_of_sample_means, loss_scale 1: a term is pg_sum / max(Σmask, 1), worded as it always was."""
    from replay_lib.bundle import open_bundle
    from replay_lib.explain.inputs import pg_term
    from replay_lib.run.runner import replay_run

    bundle = open_bundle(bundles / "loss-bug")
    _, contexts = replay_run(bundle)
    assert pg_term(contexts[0], 8.0) == ("max(Σmask, 1)", 1 / 8, 8.0)
    assert pg_term(contexts[0], 0.0) == ("max(Σmask, 1)", 1.0, 1.0)


async def test_a_forensic_debugger_on_a_complete_bundle_says_so(make_app):
    from replay_tui.widgets.header_line import ForensicLabel

    app = make_app("pr65-fixed", forensic=True)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert screen_text(app).splitlines()[0].strip() == (
            "FORENSIC — --forensic on a complete, verified bundle (not needed): still never exits 0")
        assert app.screen.query_one(ForensicLabel).render().plain == ForensicLabel.COMPLETE_TEXT
        await pilot.press("q")
    assert app.return_code == 3


def test_the_tree_gives_consumer_batch_ids_their_width():
    """``~cb-0-0-0`` (9 cells) fits a 38-cell tree without micro-batches (a column of "—" is not shown); with
    them, the ids keep 6 cells and the batch ids get what is left (at least 5)."""
    from types import SimpleNamespace

    from replay_tui.widgets.sample_tree import SampleTree

    tree = SampleTree()
    tree.model = SimpleNamespace(has_consumer_batches=True, consumer_batch_width=9, has_micro_batches=False)
    assert tree._columns(38) == (38 - 4 - 8 - 5 - 10, False, 9, True)
    tree.model = SimpleNamespace(has_consumer_batches=True, consumer_batch_width=9, has_micro_batches=True)
    assert tree._columns(38) == (6, True, 5, True)
    assert tree._columns(60) == (60 - 4 - 9 - 8 - 5 - 10, True, 9, True)


def test_a_loss_row_s_why_adds_its_terms_up(bundles):
    """loss-bug (sum_of_sample_means, entropy_coef 0.01): loss = pg_loss − 0.01·entropy_loss, by hand
    −0.2210408 − 0.0422964 = −0.2633372, the value the table's row shows; under --exact the stage keeps no
    per-sample sums, and the row says what its field compares instead."""
    from replay_lib.bundle import open_bundle
    from replay_lib.judge.error_model import Rules
    from replay_lib.run.runner import replay_run
    from replay_tui.model import build_model

    bundle = open_bundle(bundles / "loss-bug")
    report, contexts = replay_run(bundle)
    model = build_model(bundle, report, contexts=contexts)
    assert model.element_inputs("loss", None, 0).formula == \
        "loss = pg_loss − 0.01·entropy_loss = -0.2210408 − 0.01·4.22964 = -0.2633372"
    assert abs(model.field_diff("loss").row(0)[1] - (-0.2210408 - 0.01 * 4.22964)) < 1e-7
    assert model.element_inputs("loss", None, 1).formula == \
        "pg_loss = Σ_i pg_sum_i / max(Σmask, 1) = -0.2210408 (sum_of_sample_means)"
    report, contexts = replay_run(bundle, rules=Rules(exact=True))
    exact = build_model(bundle, report, contexts=contexts)
    assert exact.element_inputs("loss", None, 0).formula == "loss: each a sum over 4 samples of per-sample means"


def test_a_per_sample_sum_s_why_is_that_sum(tmp_path):
    """verl-dapo's s-0: each per-sample field's strip says what that field sums (not pg_loss's term for all)."""
    model, ctx = _dapo_model(tmp_path)
    from replay_lib.explain.inputs import element_inputs

    assert element_inputs(ctx, "pg_sum", 0).formula == "pg_sum = Σ_t pg·mask = 9.851029; its pg_loss term 0.04782053"
    assert element_inputs(ctx, "mask_count", 0).formula == "mask_count = Σ_t mask = 17"
    assert element_inputs(ctx, "clip_count", 0).formula == "clip_count = Σ_t clipped·mask = 3"
    assert element_inputs(ctx, "kl_sum", 0).formula.startswith("kl_sum = Σ_t (old − logp)·mask = ")


async def test_opening_a_sample_of_the_loss_terms_names_the_token_terms_switch(tmp_path):
    """verl-dapo records per-sample loss terms but no per-token pg_losses: ⏎ on a sample of its loss terms opens
    the sample's tokens and says why the loss divergence stops at the sample, naming the capture variable."""
    from replay_lib.demo import write_demo
    from replay_tui.app import ReplayApp

    app = ReplayApp(write_demo("verl-dapo", tmp_path / "verl-dapo"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = app.screen
        assert "pg_losses" not in app.model.fields and "pg_contribution" in app.model.fields
        screen.select(field="pg_contribution")
        await pilot.pause()
        await pilot.press("3", "enter")
        await pilot.pause()
        [note] = [n.message for n in app._notifications]
        assert note.endswith(": this bundle records no per-token loss terms (pg_losses), so a loss divergence "
                             "stops at the sample; capture with RELAX_REPLAY_CAPTURE_TOKEN_TERMS=1 to see its tokens")
