"""Sample support in the debugger: the ``logprob.support`` per-token fields, the support row of one token
(model, without an App) and the support strip under the diff rows (Pilot)."""

from __future__ import annotations

import math

import pytest
import torch

from replay_lib.bundle import open_bundle
from replay_lib.run.runner import run_replay
from replay_tui.model import KIND_TOKEN, SupportRow, build_model, field_for_divergence
from replay_tui.widgets.diff_view import DiffView
from replay_tui.widgets.support_strip import SupportStrip, fmt_prob, members_parts, status_parts

from tui_bundles import (
    INVARIANT_TOKENS,
    LOGP_S00,
    LOGP_S01,
    LOGP_S11,
)

SIZE = (120, 40)
# Token s-0@0: logits [2, 1, 0] renormalized over the row, S = e² + e + 1
S = math.exp(2) + math.e + 1
P00 = (math.exp(2) / S, math.e / S, 1 / S)  # 0.66524096, 0.24472847, 0.09003057


def model_of(path):
    b = open_bundle(path)
    return build_model(b, run_replay(b))


def text_of(parts) -> str:
    return "".join(t for t, _ in parts)


# --------------------------------------------------------------------------------------- the model


def test_support_row_of_a_hand_derived_token(bundles):
    m = model_of(bundles / "support-hand")
    row = m.support_row("s-0", 0)
    assert (row.ids, row.logits, row.sampled_id, row.sampled_member) == ((5, 2, 7), (2.0, 1.0, 0.0), 2, 1)
    assert P00 == pytest.approx((0.6652409557748219, 0.24472847105479764, 0.09003057317038046), abs=1e-15)
    assert row.probs == pytest.approx(P00, abs=1e-7)  # float32 kernel
    assert row.logp_s == pytest.approx(LOGP_S00, abs=2e-7) and math.log(P00[1]) == pytest.approx(LOGP_S00, abs=1e-15)
    assert (row.k, row.padding, row.loss_mask, row.eos, row.issues) == (3, 0, 1, False, ())
    assert row.ranked() == [0, 1, 2] and row.rank_of_sampled() == 2
    assert row.full_log_prob == pytest.approx(-1.6, abs=1e-7)


def test_support_row_padding_eos_and_observation_tokens(bundles):
    m = model_of(bundles / "support-hand")
    padded = m.support_row("s-0", 1)  # ids [3, 0, −1]: the padding slot's logit (99) takes no part
    assert (padded.ids, padded.logits, padded.padding, padded.sampled_member) == ((3, 0), (0.5, 0.5), 1, 0)
    assert padded.probs == pytest.approx((0.5, 0.5), abs=1e-7)
    assert padded.logp_s == pytest.approx(LOGP_S01, abs=1e-7)
    eos = m.support_row("s-0", 2)
    assert eos.empty and eos.eos and eos.padding == 3 and eos.sampled_id == 7 and eos.sampled_member is None
    assert math.isnan(eos.logp_s) and eos.full_log_prob == -0.25 and eos.issues == ()
    observation = m.support_row("s-1", 0)
    assert observation.empty and not observation.eos and observation.loss_mask == 0 and observation.issues == ()
    last = m.support_row("s-1", 1)  # ids [1, 6, 4], logits [−1, 0, 1], sampled 4 = member 2, the top logit
    assert (last.sampled_member, last.rank_of_sampled(), last.ranked()) == (2, 1, [2, 1, 0])
    assert last.probs[2] == pytest.approx(math.exp(LOGP_S11), abs=1e-7)


def test_support_logprob_field_marks_only_compared_out_of_tolerance_tokens(bundles):
    m = model_of(bundles / "support-hand")
    assert m.has_support
    assert m.fields == ["support_logprob"]  # only log_probs is recorded
    assert m.unavailable["support_old_logprob"] == "old_log_probs is not scored over the support in this bundle"
    assert field_for_divergence("logprob.support", "sampled_not_in_support") == "support_logprob"
    assert field_for_divergence("logprob.support", "support_old_logprob") == "support_old_logprob"
    d0 = m.field_diff("support_logprob", "s-0")
    assert d0.kind == KIND_TOKEN and d0.stage == "logprob.support" and d0.divergent == []
    assert d0.actual == pytest.approx([LOGP_S00, LOGP_S01, -0.25], abs=2e-7)  # the EOS takes full_log_probs
    d1 = m.field_diff("support_logprob", "s-1")
    assert d1.expected == [-3.0, -0.5] and d1.mask == [0, 1]
    # no support row: actual is the recorded full-vocab value; loss mask 0, so not compared and not marked
    assert d1.actual[0] == -3.0 and d1.abs_error[0] == 0.0 and not d1.bad[0]
    assert d1.actual[1] == pytest.approx(LOGP_S11, abs=1e-7)
    assert d1.abs_error[1] == pytest.approx(0.5 + LOGP_S11, abs=1e-7) and d1.divergent == [1]
    assert m.report.stage("logprob.support").mismatches == 1
    assert {s.sample_id: s.mismatches for s in m.samples} == {"s-0": {}, "s-1": {"support_logprob": 1}}


def test_full_vocab_demo_counts_equal_the_report(bundles):
    m = model_of(bundles / "support-fullvocab")
    stage = m.report.stage("logprob.support")
    assert m.fields == ["raw_reward", "reward", "kl", "advantage", "support_logprob", "support_old_logprob", "loss"]
    bad = {f: int(m.shards[0].bad[f].sum()) for f in ("support_logprob", "support_old_logprob")}
    assert bad == {"support_logprob": 157, "support_old_logprob": 157}
    assert stage.mismatches == sum(bad.values()) == 314
    first = m.report.first_divergence
    d = m.field_diff("support_logprob", "s-0")
    assert (first.sample_id, first.token_offset) == ("s-0", 0) and d.divergent[0] == 0
    assert d.expected[0] == pytest.approx(first.expected, abs=1e-6) and d.actual[0] == pytest.approx(first.actual,
                                                                                                     abs=1e-6)


def test_invariant_breaks_are_divergent_rows_with_the_reports_message(bundles):
    m = model_of(bundles / "support-invariants")
    found = {(s.sample_id, off) for s in m.samples for off in m.field_diff("support_logprob", s.sample_id).divergent}
    assert found == set(INVARIANT_TOKENS)
    messages = {(d.sample_id, d.token_offset): d.message for d in m.report.stage("logprob.support").divergences}
    for (sid, off), field in INVARIANT_TOKENS.items():
        row = m.support_row(sid, off)
        assert row.issues == ((field, messages[(sid, off)]),)
    missing = m.support_row("s-1", 3)
    assert missing.sampled_member is None and len(missing.ids) == 4
    assert f"sampled token {missing.sampled_id} is not in its support row" in missing.issues[0][1]
    dup = m.support_row("s-2", 5)
    assert dup.ids[0] == dup.ids[3] and dup.issues[0][1].startswith(f"member id {dup.ids[0]} appears 2 times")
    empty = m.support_row("s-3", 2)
    assert empty.empty and not empty.eos and "2 loss-bearing token(s) of trajectory s-3" in empty.issues[0][1]
    assert m.support_row("s-3", 7).eos  # the trajectory's appended EOS itself is allowed


def test_support_row_refuses_unknown_samples_offsets_and_bundles_without_support(bundles):
    m = model_of(bundles / "support-hand")
    with pytest.raises(KeyError, match="no sample 's-9'"):
        m.support_row("s-9", 0)
    with pytest.raises(IndexError, match=r"token offset 3 outside sample s-0 \(3 token\(s\)\)"):
        m.support_row("s-0", 3)
    plain = model_of(bundles / "pr65-buggy")
    assert not plain.has_support
    with pytest.raises(KeyError, match="logprob.support did not run on this bundle"):
        plain.support_row("s-0", 0)


# ------------------------------------------------------------------------------------- strip text


def hand_row(**kw) -> SupportRow:
    base = dict(sample_id="s-0", token_offset=17, k=6, ids=(42, 7, 9, 11, 13), logits=(2.0, 1.0, 0.5, 0.0, -1.0),
                probs=(0.61, 0.2, 0.12, 0.06, 0.0004), sampled_id=42, sampled_member=0, padding=1, loss_mask=1,
                logp_s=math.log(0.61), full_log_prob=None, eos=False)
    base.update(kw)
    return SupportRow(**base)


def test_members_line_sorted_by_logit_and_truncated_keeping_the_sampled_member():
    row = hand_row()
    assert text_of(members_parts(row, 200)) == "42 0.610 ◀ · 7 0.200 · 9 0.120 · 11 0.060 · 13 <.001"
    assert text_of(members_parts(row, 30)) == "42 0.610 ◀ · 7 0.200 … +3"
    low = hand_row(sampled_id=13, sampled_member=4)  # the lowest logit: shown after the ellipsis, with its rank
    assert text_of(members_parts(low, 40)) == "42 0.610 · 7 0.200 … #5 13 <.001 ◀ +2"
    gone = hand_row(sampled_id=3, sampled_member=None)
    assert text_of(members_parts(gone, 60)).endswith("  ✗ sampled 3 not in row")
    assert text_of(members_parts(hand_row(ids=(), logits=(), probs=(), sampled_member=None), 60)) == \
        "no members: 6 slot(s), all padding"
    assert (fmt_prob(1.0), fmt_prob(0.24472847), fmt_prob(0.0)) == ("1.000", "0.245", "0.000")


def test_status_line_says_what_the_row_is():
    assert text_of(status_parts(hand_row())) == "sampled 42 · rank 1/5 · p=0.610 · logp_S=-0.494296 · 1 padding"
    eos = hand_row(ids=(), logits=(), probs=(), sampled_member=None, eos=True, full_log_prob=-0.25, sampled_id=99)
    assert text_of(status_parts(eos)) == \
        "∅ no support row: appended EOS (sampled 99), scored with full_log_probs=-0.25"
    broken = hand_row(issues=(("support_duplicate", "member id 7 appears 2 times"), ("cp_shard", "x")))
    assert text_of(status_parts(broken)) == "✗ support_duplicate: member id 7 appears 2 times (+1 more)"


# ------------------------------------------------------------------------------------------- Pilot


async def ready(pilot) -> None:
    await pilot.app.wait_settled(pilot)


def state(app) -> tuple:
    d = app.debugger
    return d.sample_id, d.field, d.diff_cursor


def screen_text(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def payload_row(bundle, sample_index: int, tokens: int, offset: int) -> tuple[list[int], list[float]]:
    """Member ids and their renormalized probabilities straight from the payloads (float64 softmax)."""
    reader = open_bundle(bundle).shards[0]
    t = sample_index * tokens + offset
    ids = reader.payload("support_ids")[t]
    logits = reader.payload("support_logits")[t].to(torch.float64)
    keep = ids >= 0
    return ids[keep].tolist(), torch.softmax(logits[keep], 0).tolist()


async def test_support_demo_opens_on_logprob_support_and_the_strip_follows_the_cursor(bundles):
    from replay_lib.demo import SUPPORT_DEMO, materialize_demo
    from replay_tui.__main__ import build_parser
    from replay_tui.app import app_from_args, remove_materialized_demo

    args = build_parser().parse_args(["--demo", "support-fullvocab"])
    args.bundle = materialize_demo(args.demo)
    try:
        app = app_from_args(args)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            assert app.model.report.first_divergent_stage == "logprob.support"
            assert state(app) == ("s-0", "support_logprob", 0)
            assert app.debugger.stage_list.stage.stage == "logprob.support"
            strip = app.debugger.query_one(SupportStrip)
            view = app.debugger.query_one(DiffView)
            assert strip.display and strip.size.height == 2
            generation = view._generation
            for keys, offset in (((), 0), (("down",), 1), (("down", "down", "down"), 4), (("end",), 23)):
                await pilot.press(*keys)
                await pilot.pause()
                row = strip.row
                assert isinstance(row, SupportRow) and (row.sample_id, row.token_offset) == ("s-0", offset)
                ids, probs = payload_row(args.bundle, 0, SUPPORT_DEMO["tokens"], offset)
                assert list(row.ids) == ids and row.probs == pytest.approx(probs, abs=1e-6)
                if offset < 23:
                    assert len(ids) == SUPPORT_DEMO["k"] and row.ids[row.sampled_member] == row.sampled_id
                    assert f"support s-0@{offset}: sampled {row.sampled_id} · rank {row.rank_of_sampled()}/16" \
                        in screen_text(app)
            assert row.eos and "appended EOS" in screen_text(app)  # the last token: synthetic EOS, no row
            assert view._generation == generation  # cursor moves never rebuilt the diff rows
    finally:
        remove_materialized_demo(args.bundle)


async def test_strip_shows_only_under_per_token_fields(make_app):
    app = make_app("support-fullvocab")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        strip = app.debugger.query_one(SupportStrip)
        seen = []
        for _ in range(7):
            await pilot.press("f")
            seen.append((app.debugger.field, strip.display))
        assert seen == [("support_old_logprob", True), ("loss", False), ("raw_reward", False), ("reward", False),
                        ("kl", True), ("advantage", True), ("support_logprob", True)]


async def test_n_and_the_stage_reach_every_invariant_break(make_app):
    app = make_app("support-invariants")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        strip = app.debugger.query_one(SupportStrip)
        walk = [state(app)]
        for _ in range(2):
            await pilot.press("n")
            walk.append(state(app))
        assert [(sid, off) for sid, _, off in walk] == list(INVARIANT_TOKENS)
        assert {f for _, f, _ in walk} == {"support_logprob"}
        assert strip.row.issues[0][0] == "unsupported_token" and strip.row.empty
        assert "support s-3@2: ✗ unsupported_token: 2 loss-bearing token(s) of trajectory s-3" in screen_text(app)
        await pilot.press("1", "home", *["down"] * 5, "enter")  # the logprob.support stage
        await pilot.pause()
        assert app.debugger.stage_list.stage.stage == "logprob.support"
        assert state(app) == ("s-1", "support_logprob", 3)
        assert isinstance(app.focused, DiffView)
        assert strip.row.issues[0][0] == "sampled_not_in_support" and strip.row.sampled_member is None
        lines = screen_text(app).splitlines()
        # the report's message, cut with an ellipsis at the pane's edge; the members line says it again
        assert any(f"support s-1@3: ✗ sampled_not_in_support: sampled token {strip.row.sampled_id} is not in its "
                   f"suppor…│" in line for line in lines)
        assert any(line.endswith(f"  ✗ sampled {strip.row.sampled_id} not in row │") for line in lines)


async def test_strip_takes_one_line_at_80x24(make_app):
    app = make_app("support-hand")
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        assert state(app) == ("s-1", "support_logprob", 1)
        strip = app.debugger.query_one(SupportStrip)
        assert strip.display and strip.size.height == 1
        lines = screen_text(app).splitlines()
        assert any("@1 4 0.665 ◀ · 6 0.245 · 1 0.090" in line for line in lines)
        await pilot.press("up")
        assert "@0 ∅ no support row (sampled 4; loss mask 0" in screen_text(app)
