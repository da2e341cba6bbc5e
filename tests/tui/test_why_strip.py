"""The why strip (the inputs of the element under the cursor, ``replay_lib.explain.inputs``) and the loss-term fields:
a loss divergence located to its sample and token, and the table of each sample's term of pg_loss.

The loss bundle is the PR #65 step (``demo.write_step_loss``: lengths [3, 2, 4, 3], every token in the mask,
advantages −1, +1, −1, +1 broadcast, old = 0, logp = 0.5, eps_clip = eps_clip_high = 0.2) with its per-token
surrogate ``pg_losses`` and per-sample terms recorded (the hand table of ``tests/test_loss_terms.py``) and one
bug: token s-2@1 of ``pg_losses`` and s-2's ``pg_sum`` are +0.5 off. Per token ``ratio = exp(logp − old) =
e^0.5 = 1.6487212707``; for A = −1, ``pg = max(−r·A, −clamp(r, 0.8, 1.2)·A) = max(r, 1.2) = r`` (unclipped),
for A = +1 ``pg = max(−r, −1.2) = −1.2`` (clipped)."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleReader, open_bundle
from replay_lib.demo import PR65_RAW, write_pr65, write_step_loss
from replay_lib.explain.inputs import consumer_batch_labels, element_inputs
from replay_lib.judge.report import fmt_value
from replay_lib.stages import StageContext
from replay_tui.app import ReplayApp
from replay_tui.widgets.why_strip import WhyStrip

from tui_bundles import fixed_producer

SIZE = (120, 40)
RATIO = math.exp(0.5)  # float64, what the strip recomputes from the float32 inputs 0.5 and 0 (both exact)
CLIP = float(torch.tensor(1.2))  # 1 + eps_clip_high held in float32, as the producer's clamp
BUMP = 0.5
LENGTHS = [3, 2, 4, 3]


async def ready(pilot) -> None:
    await pilot.app.wait_settled(pilot)


def why_lines(app) -> list[str]:
    return app.debugger.query_one(WhyStrip).text_lines()


def write_loss_terms_bug(path, *, per_token: bool = True):
    """The step bundle of the module docstring, written again through the real writer with the terms added
    (``per_token=False``: the per-sample terms only, no ``pg_losses`` payload)."""
    from replay_lib.bundle import BundleReader
    from replay_lib.demo import write_bundle

    base = BundleReader(write_step_loss(path.with_name(path.name + "-base")))
    r32 = float(torch.tensor(RATIO, dtype=torch.float32))
    surrogate = [r32] * 3 + [-CLIP] * 2 + [r32] * 4 + [-CLIP] * 3  # the producer's float32 surrogate
    surrogate[5 + 1] += BUMP  # s-2@1
    expected = {stage: dict(values) for stage, values in base.expected.items()}
    expected["loss.policy"]["per_sample"] = {"pg_sum": [3 * r32, 2 * -CLIP, 4 * r32 + BUMP, 3 * -CLIP],
                                             "clip_count": [0.0, 2.0, 0.0, 3.0], "mask_count": [3.0, 2.0, 4.0, 3.0]}
    tensors = {name: base.payload(name).clone() for name in base.payload_names}
    if per_token:
        tensors["pg_losses"] = torch.tensor(surrogate, dtype=torch.float32)
    manifest = msgspec.structs.replace(base.manifest, producer=fixed_producer())  # no torch version on screen
    return write_bundle(path, manifest, base.index_with_masks(), expected, tensors)


@pytest.fixture
def loss_bug(tmp_path):
    return write_loss_terms_bug(tmp_path / "loss-terms")


# ----------------------------------------------------------------------------------- the library


def test_reward_inputs_are_the_group_its_stats_and_its_members(tmp_path):
    # PR #65: g-0 = s-0, s-1 with raw 1 and 3: mean 2, unbiased std √2 = 1.41421356; std off → r − mean = −1
    shard = open_bundle(write_pr65(tmp_path / "p")).shards[0]
    ctx = StageContext(reader=shard, indices=list(range(4)), partial=False)
    got = element_inputs(ctx, "reward", 0)
    assert PR65_RAW[:2] == [1.0, 3.0]
    assert got.formula == "r − mean = 1.0 − 2.0 = -1.0 (std normalization off)"
    assert dict(got.items) == {"group": "g-0", "raw": "[1.0, 3.0]", "mean": "2.0", "std": fmt_value(math.sqrt(2)),
                               "eps": "1e-06", "std-norm": "off"}
    # the bundle lists consumer batches cb-0, cb-1 but records none per sample: the stream layout (4 samples in
    # 2 batches of ⌈4/2⌉ = 2, in index order) places s-0, s-1 in cb-0 — marked ~, a layout and not a record
    assert got.members == (("s-0", "mb-0000", "~cb-0"), ("s-1", "mb-0000", "~cb-0"))
    assert list(consumer_batch_labels(ctx)) == ["~cb-0", "~cb-0", "~cb-1", "~cb-1"]
    # g-1 = s-2, s-3 (raw 10, 12): s-3 is 12 − 11 = 1
    assert element_inputs(ctx, "reward", 3).formula == "r − mean = 12.0 − 11.0 = 1.0 (std normalization off)"
    with pytest.raises(IndexError):
        element_inputs(ctx, "kl", 0, 3)  # s-0 has 3 tokens: offsets 0..2


def test_std_normalized_reward_inputs_show_std_and_eps(tmp_path):
    from replay_lib.demo import synthetic_parts, write_bundle

    # a std-normalized synthetic step: the formula is (r − mean) / (std + eps) with the group's own numbers
    shard = open_bundle(write_bundle(tmp_path / "s", *synthetic_parts(samples=4, tokens=4, seed=1))).shards[0]
    ctx = StageContext(reader=shard, indices=list(range(4)), partial=False)
    raw = [s.raw_reward for s in shard.index.samples]
    mean = sum(raw) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in raw) / 3)
    got = element_inputs(ctx, "reward", 2)
    value = (raw[2] - mean) / (std + 1e-6)
    assert got.formula == (f"(r − mean) / (std + eps) = ({fmt_value(raw[2])} − {fmt_value(mean)}) / "
                           f"({fmt_value(std)} + 1e-06) = {fmt_value(value)}")
    assert dict(got.items)["std-norm"] == "on"


# ------------------------------------------------------------------------------------ in the app


async def test_the_why_strip_follows_the_cursor_over_the_reward_table(tmp_path):
    app = ReplayApp(write_pr65(tmp_path / "p"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert (app.debugger.field, app.debugger.diff_view.data_row) == ("reward", 0)
        assert why_lines(app) == [
            "why s-0 r − mean = 1.0 − 2.0 = -1.0 (std normalization off)",
            f"group g-0  raw [1.0, 3.0]  mean 2.0  std {fmt_value(math.sqrt(2))}  eps 1e-06  std-norm off",
            "mb/cb (~: stream order)  s-0 mb-0000/~cb-0  s-1 mb-0000/~cb-0",
        ]
        await pilot.press("down", "down")  # s-2, group g-1: raw 10, 12
        assert why_lines(app)[0] == "why s-2 r − mean = 10.0 − 11.0 = -1.0 (std normalization off)"
        assert why_lines(app)[2] == "mb/cb (~: stream order)  s-2 mb-0001/~cb-1  s-3 mb-0001/~cb-1"
        # the advantages (teacher-forced) broadcast the *recorded* normalized reward: s-2's is 3.5, its 4 tokens
        app.debugger.select(sample_id="s-2", field="advantage", row=1)
        await pilot.pause()
        assert why_lines(app)[0] == "why s-2@1 A = the sample's normalized reward, broadcast over its 4 token(s) " \
                                    "= 3.5 (recorded)"
        assert why_lines(app)[1] == "reward 3.5  group g-1  mask 1"


async def test_a_kl_token_shows_r_and_the_formula(make_app, bundles):
    # kl-bug opens on s-5@3 (its recorded kl is +0.25 off); the strip recomputes low_var_kl from the payloads
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert (app.debugger.sample_id, app.debugger.diff_view.data_row) == ("s-5", 3)
        reader = BundleReader(bundles / "kl-bug")
        old, ref = (reader.payload(n).to(torch.float64) for n in ("old_log_probs", "ref_log_probs"))
        t = 5 * 16 + 3
        r = float(old[t] - ref[t])
        k3 = math.exp(-r) - 1 + r  # inside the ±10 clamp
        assert why_lines(app)[0] == f"why s-5@3 low_var_kl: kl = clamp(exp(−r) − 1 + r, ±10) = {fmt_value(k3)}"
        assert why_lines(app)[1].startswith(f"old {fmt_value(float(old[t]))}  ref {fmt_value(float(ref[t]))}  "
                                            f"r = old − ref {fmt_value(r)}  kl_coef 0.05  mask ")
        await pilot.press("n")  # s-5@7: the strip is that token's
        assert why_lines(app)[0].startswith("why s-5@7 low_var_kl")


async def test_a_loss_divergence_opens_on_its_sample_and_token_with_its_inputs(loss_bug):
    app = ReplayApp(loss_bug)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = app.debugger
        assert (screen.field, screen.sample_id, screen.diff_view.data_row) == ("pg_losses", "s-2", 1)
        diff = screen.diff_view.diff
        assert diff.divergent == [1] and float(diff.error_tensor[1]) == pytest.approx(BUMP, abs=1e-6)
        # s-2 (A = −1): unclipped, pg = r; its share of pg_loss is pg·mask / Σmask = r / 4
        assert why_lines(app) == [
            f"why s-2@1 pg = max(−r·A, −clamp(r, 0.8, 1.2)·A) = {fmt_value(RATIO)} (unclipped: −r·A)",
            f"ratio r {fmt_value(RATIO)}  clip above 1.2  mask 1  A -1.0",
            f"adds pg·mask = {fmt_value(RATIO)} to s-2's pg_sum, {fmt_value(RATIO / 4)} to its pg_loss term (÷ 4 mask "
            "tokens)",
        ]
        await pilot.press("1")  # the DAG: enter on loss.policy opens the same place
        await pilot.press("f")  # (away first: kl of s-2)
        await pilot.press("1", "enter")
        assert (screen.field, screen.sample_id, screen.diff_view.data_row) == ("pg_losses", "s-2", 1)


async def test_a_clipped_loss_token_says_so(loss_bug):
    app = ReplayApp(loss_bug)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.debugger.select(sample_id="s-1", field="pg_losses", row=0)
        await pilot.pause()
        # s-1 (A = +1): −r < −1.2, so the clipped branch −clamp(r)·A = −1.2; Σmask = 2
        assert why_lines(app)[0] == "why s-1@0 pg = max(−r·A, −clamp(r, 0.8, 1.2)·A) = -1.2 (clipped: −clamp(r)·A)"
        assert why_lines(app)[1].endswith("mask 1  A 1.0")
        assert why_lines(app)[2] == "adds pg·mask = -1.2 to s-1's pg_sum, -0.6 to its pg_loss term (÷ 2 mask tokens)"


async def test_the_loss_table_opens_each_sample_s_term_sorted_by_err(loss_bug):
    app = ReplayApp(loss_bug)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = app.debugger
        screen.select(field="loss")
        await pilot.pause()
        await pilot.press("enter")  # a loss row: its per-sample terms
        view = screen.diff_view
        assert screen.field == "pg_contribution" and view.sort == "err"
        diff = view.diff
        # s-2's recorded pg_sum is 4r + 0.5 over 4 mask tokens: its term is off by 0.5 / 4 = 0.125, the others
        # by float32 rounding only; the worst is shown first, then offset order among the rest
        assert [diff.labels[view.row_at(i)] for i in range(4)][0] == "s-2"
        assert view.data_row == diff.labels.index("s-2")
        expected, actual, err, bad = diff.row(view.data_row)
        assert bad and expected == pytest.approx((4 * RATIO + BUMP) / 4, abs=1e-6)
        assert actual == pytest.approx(RATIO, rel=1e-12) and err == pytest.approx(BUMP / 4, abs=1e-6)
        assert sorted(float(e) for e in diff.error_tensor)[:3] == [float(diff.error_tensor[view.row_at(i)])
                                                                   for i in (3, 2, 1)]
        assert why_lines(app)[0] == f"why s-2 pg_loss term = pg_sum / max(Σmask, 1) = {fmt_value(4 * RATIO)} / 4 " \
                                    f"= {fmt_value(RATIO)}"
        # the per-sample term is a divergence of its own, marked in the tree (pg_sum and pg_losses: 2)
        assert screen.model.sample("s-2").mismatches == {"pg_losses": 1, "pg_sum": 1}
        # every sample is compared by its loss terms (✓/✗ in the tree, not the · of a cohort-only loss stage)
        assert all(screen.model.sample(f"s-{i}").compared for i in range(4))


async def test_a_loss_table_without_per_sample_terms_says_why(make_app):
    app = make_app("loss-bug")  # pg_loss off by 0.5, no per-sample terms recorded
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.debugger.field == "loss"
        assert "pg_losses" not in app.debugger.model.fields and "pg_contribution" not in app.debugger.model.fields
        await pilot.press("enter")
        await pilot.pause()
        assert app.debugger.field == "loss"
        assert any("records no per-sample loss terms" in str(n.message) for n in app._notifications)


async def test_the_sample_tree_shows_the_consumer_batch_beside_the_micro_batch(tmp_path, loss_bug):
    from rich.style import Style

    app = ReplayApp(write_pr65(tmp_path / "p"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tree = app.debugger.tree
        width = tree.row_width
        # each column named as its values are (mb-…, ~cb-…), not "batch" beside the consumer batches
        assert tree.render_header(width, Style()).text.split() == ["id", "mb", "cb", "reward", "✗"]
        rows = [tree.render_row(r, width, Style()).text.split() for r in range(tree.row_count)]
        assert rows[1] == ["✗", "s-0", "mb-0000", "~cb-0", "-5.5", "1"]
        assert rows[5] == ["✗", "s-3", "mb-0001", "~cb-1", "5.5", "1"]
    # the step bundle lists no consumer batches: no column, "—" in the why strip
    app = ReplayApp(loss_bug)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tree = app.debugger.tree
        assert "cb" not in tree.render_header(tree.row_width, Style()).text.split()
        assert list(consumer_batch_labels(app.debugger.model.shards[0].ctx)) == ["—"] * 4


async def test_a_per_sample_loss_divergence_opens_its_sample_s_row(tmp_path):
    # the same bug recorded in the per-sample terms only: the first divergence is pg_sum of s-2 (a table row)
    app = ReplayApp(write_loss_terms_bug(tmp_path / "terms-only", per_token=False))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = app.debugger
        assert "pg_losses" not in screen.model.fields
        assert screen.field == "pg_sum" and screen.diff_view.diff.labels[screen.diff_view.data_row] == "s-2"
        assert screen.tree.selected_sample == "s-2"
        # 4 tokens at r each (A = −1, unclipped): pg_sum 4r recomputed against 4r + 0.5 recorded
        expected, actual, err, bad = screen.diff_view.diff.row(screen.diff_view.data_row)
        assert bad and actual == pytest.approx(4 * RATIO, rel=1e-12) and err == pytest.approx(BUMP, abs=1e-6)
        assert why_lines(app)[1] == f"tokens 4  mask 4  clipped 0  pg_sum {fmt_value(4 * RATIO)}  kl_sum -2.0"


def test_reward_inputs_follow_the_configured_rule(tmp_path, bundle_tools):
    """The why strip shows the formula the bundle's config chose, not V1's. PR #65 groups g-0 = raw [1, 3],
    g-1 = [10, 12] with std on: unbiased std √2 = 1.41421356, biased std 1.

    - leave-one-out (NeMo-RL), std on, eps 1e-6: s-0's baseline is the other reward, 3; its LOO std is taken
      by the kernel (the value printed is the stage's own); the formula names b and the rule.
    - TRL's eps 1e-4 with a biased std: s-3 = (12 − 11) / (1 + 1e-4) = 0.99990001, shown at float32's
      shortest digits (0.9999, as every value of the strip)."""
    from replay_lib.demo import write_pr65

    b = write_pr65(tmp_path / "trl")
    bundle_tools.edit_json(b, "index.json", lambda d: d["config"].update(
        grpo_std_normalization=True, grpo_std_eps=1e-4, grpo_std_unbiased=False))
    ctx = StageContext(reader=open_bundle(b).shards[0], indices=list(range(4)), partial=False)
    got = element_inputs(ctx, "reward", 3)
    assert got.formula == "(r − mean) / (std + eps) = (12.0 − 11.0) / (1.0 + 0.0001) = 0.9999 (biased std)"
    assert dict(got.items)["eps"] == "0.0001"

    b = write_pr65(tmp_path / "loo")
    bundle_tools.edit_json(b, "index.json", lambda d: d["config"].update(group_baseline="leave_one_out"))
    ctx = StageContext(reader=open_bundle(b).shards[0], indices=list(range(4)), partial=False)
    # std off: s-0 = 1 − 3 = −2, s-3 = 12 − 10 = 2
    assert element_inputs(ctx, "reward", 0).formula == (
        "r − b = 1.0 − 3.0 = -2.0 (std normalization off); b = the mean of the group's other rewards "
        "(leave-one-out)")
    assert element_inputs(ctx, "reward", 3).formula.startswith("r − b = 12.0 − 10.0 = 2.0")


def test_loss_token_inputs_say_which_knobs_they_leave_out(tmp_path, bundle_tools):
    b = write_step_loss(tmp_path / "s")
    bundle_tools.edit_json(b, "index.json", lambda d: d["config"].update(eps_clip_c=3.0))
    ctx = StageContext(reader=open_bundle(b).shards[0], indices=list(range(4)), partial=False)
    got = element_inputs(ctx, "pg_losses", 0, 0)
    assert got.note == "the plain clipped surrogate; this step also applies dual-clip c=3 (the stage's values " \
                       "include them)"


def test_a_leave_one_out_std_is_the_std_of_the_other_rewards(tmp_path, bundle_tools):
    """NeMo-RL's leave-one-out under std: sample 0's baseline b is the mean of the group's three other raw
    rewards and its std their unbiased std (not the group's): the strip shows the numbers the stage divided by."""
    from replay_lib.demo import synthetic_parts, write_bundle

    b = write_bundle(tmp_path / "s", *synthetic_parts(samples=4, tokens=4, seed=1))
    bundle_tools.edit_json(b, "index.json", lambda d: d["config"].update(group_baseline="leave_one_out"))
    ctx = StageContext(reader=open_bundle(b).shards[0], indices=list(range(4)), partial=False)
    raw = [s.raw_reward for s in ctx.samples]
    others = raw[1:]
    base = sum(others) / 3
    std = math.sqrt(sum((x - base) ** 2 for x in others) / 2)
    assert std != math.sqrt(sum((x - sum(raw) / 4) ** 2 for x in raw) / 3)  # the group's std is another number
    got = element_inputs(ctx, "reward", 0)
    assert got.formula.startswith(f"(r − b) / (std + eps) = ({fmt_value(raw[0])} − {fmt_value(base)}) / "
                                  f"({fmt_value(std)} + 1e-06) = ")
    # the inputs name them as what they are: the others' mean and std, not the group's
    assert dict(got.items)["others' std"] == fmt_value(std) and dict(got.items)["b (others' mean)"] == fmt_value(base)
    assert "mean" not in dict(got.items) and "std" not in dict(got.items)


def _text(rows) -> list[str]:
    return ["".join(t for t, _ in row) for row in rows]


def test_a_long_line_wraps_and_the_formula_keeps_its_value():
    """kl-bug's KL token at the widths a new user hit: the items line wraps instead of losing `mask 1`; a
    formula longer than its rows is elided in its middle, never at its value; the last row shown ends in `…`
    only when its own line goes on."""
    from replay_tui.cells import fit_rows

    formula = [("why ", None), ("s-5@3 ", None), ("low_var_kl: kl = clamp(exp(−r) − 1 + r, ±10) = 0.00077855656", None)]
    items = [("old -1.9 ref -1.7 r = old − ref -0.03920245 kl_coef 0.05 mask 1", None)]
    assert _text(fit_rows([formula, items], 120, 3)) == [
        "why s-5@3 low_var_kl: kl = clamp(exp(−r) − 1 + r, ±10) = 0.00077855656",
        "old -1.9 ref -1.7 r = old − ref -0.03920245 kl_coef 0.05 mask 1"]
    assert _text(fit_rows([formula, items], 48, 3)) == [
        "why s-5@3 low_var_kl: kl = clamp(exp(−r) − 1 + ",
        "  r, ±10) = 0.00077855656",
        "old -1.9 ref -1.7 r = old − ref -0.03920245 …"]  # broken after a space: its line goes on
    # 48 × 2 (a short terminal): the formula gets one row, cut in its middle, its value whole
    assert _text(fit_rows([formula, items], 48, 2)) == [
        "why s-5@3 low_var_…− 1 + r, ±10) = 0.00077855656",
        "old -1.9 ref -1.7 r = old − ref -0.03920245 …"]
    assert _text(fit_rows([formula], 48, 1)) == ["why s-5@3 low_var_…− 1 + r, ±10) = 0.00077855656"]
    # nemo-loo's reward: the value sits between the arithmetic and a note ("b = the mean …" is no value): the
    # arithmetic's middle goes first, the note next, the value never
    reward = [("why ", None), ("s-8 ", None), ("(r − b) / (std + eps) = (0.25 − 0.75) / (0.25 + 1e-06) = -1.999992 "
                                               "(divided only where std > 0); b = the mean of the group's other "
                                               "rewards (leave-one-out)", None)]
    group = [("group g-2  raw [0.25, 1.0, 0.5, 0.75]  mean 0.625", None)]
    assert _text(fit_rows([reward, group], 57, 2)) == [
        "why s-8 (r − b) / (std…0.75) / (0.25 + 1e-06) = -1.999992", "group g-2  raw [0.25, 1.0, 0.5, 0.75]  mean 0.625"]
    # at 120×40's 78 cells: cut a little shorter, it still breaks at spaces (no "(di" / "vided")
    assert _text(fit_rows([reward, group], 78, 3))[:2] == [
        "why s-8 (r − b) / (std + eps) = (0.25 − 0.75) / (0.25 + 1e-06) = -1.999992 ",
        "  (divided only where std > 0); b = the mean of the group's other re…"]
    assert _text(fit_rows([reward, group], 40, 3)) == [
        "why s-8 (r − b) / (std + eps) = (0.25 − ", "  0.75) / (0.25 + 1e-06) = -1.999992 (d…",
        "group g-2  raw [0.25, 1.0, 0.5, 0.75]  …"]
    # a line that fits is never marked; a line left out entirely is not either
    assert _text(fit_rows([items, formula], 120, 1)) == [
        "old -1.9 ref -1.7 r = old − ref -0.03920245 kl_coef 0.05 mask 1"]


def test_wide_characters_never_stall_the_wrap():
    """A sample id of 2-cell characters in a strip 1 cell wide: every row still takes a character."""
    from replay_tui.cells import fit_rows, wrap_parts

    assert _text(wrap_parts([("样本名称", None)], 1, hard=True)) == ["样", "本", "名", "称"]
    assert _text(wrap_parts([("样本名称", None)], 1)) == ["样", "本", "名", "称"]
    assert len(fit_rows([[("why 样本 = 1.0 样本样本", None)], [("x", None)]], 1, 2)) == 2
