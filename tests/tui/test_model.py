"""The debugger's model and row rendering, without an App: exact values against hand-derived numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.style import Style

from replay_lib.bundle import open_bundle
from replay_lib.judge.error_model import Rules
from replay_lib.run.runner import replay_run, run_replay
from replay_lib.stages import REGISTRY
from replay_lib.bundle.selection import Selection
from replay_tui.model import (
    KIND_COHORT,
    KIND_SAMPLE,
    KIND_TOKEN,
    FieldDiff,
    build_model,
    field_for_divergence,
    first_divergence_text,
    group_rows,
    token_diff,
)
from replay_tui.cells import fit_number, fmt_ratio, fmt_tolerance
from replay_tui.widgets.diff_view import DiffView
from replay_tui.widgets.stage_pane import dag_gutters

from tui_bundles import KL_BUG_DELTA, KL_BUG_TOKENS, LOSS_BUG_DELTA


def model_of(path, **kwargs):
    b = open_bundle(path)
    return b, build_model(b, run_replay(b, **kwargs))


def test_pr65_reward_table_is_the_seed_numbers(bundles):
    _, m = model_of(bundles / "pr65-buggy")
    diff = m.field_diff("reward")
    assert diff.kind == KIND_SAMPLE
    assert diff.labels == ["s-0", "s-1", "s-2", "s-3"]
    assert diff.groups == ["g-0", "g-0", "g-1", "g-1"]
    assert diff.expected == [-5.5, -3.5, 3.5, 5.5]
    assert diff.actual == [-1.0, 1.0, -1.0, 1.0]
    assert diff.abs_error == [4.5, 4.5, 4.5, 4.5]
    assert diff.divergent == [0, 1, 2, 3]
    assert first_divergence_text(m.report) == "reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5"


def test_pr65_token_diff_of_advantage(bundles):
    b = open_bundle(bundles / "pr65-buggy")
    # teacher forcing: the advantages broadcast the recorded (buggy) rewards, as the stage does
    diff = token_diff(b, "s-2", "advantage")
    assert diff.kind == KIND_TOKEN and diff.sample_id == "s-2"
    assert diff.expected == diff.actual == [3.5, 3.5, 3.5, 3.5]
    assert diff.divergent == [] and diff.mask == [1, 1, 0, 1]
    # --chain: the recomputed rewards
    diff = token_diff(b, "s-2", "advantage", rules=Rules(chain=True))
    assert diff.expected == [3.5, 3.5, 3.5, 3.5]
    assert diff.actual == [-1.0, -1.0, -1.0, -1.0]
    assert diff.abs_error == [4.5, 4.5, 4.5, 4.5]
    assert diff.mask == [1, 1, 0, 1]
    assert diff.divergent == [0, 1, 2, 3]
    clean = token_diff(b, "s-0", "kl")
    # the float64 recompute of the recorded float32 KL: within its tolerance, not bit for bit
    assert clean.divergent == [] and len(clean) == 3
    assert all(err <= tol for err, tol in zip(clean.abs_error, clean.tolerance_tensor.tolist()))
    assert clean.expected == pytest.approx(clean.actual, abs=1e-6)
    assert token_diff(b, "s-1", "reward").expected == [-3.5]


def test_token_diff_refuses_unknown_sample_and_field(bundles):
    b = open_bundle(bundles / "pr65-buggy")
    with pytest.raises(KeyError, match="no sample 's-9' in bundle b-00001"):
        token_diff(b, "s-9", "kl")
    with pytest.raises(KeyError, match="unknown field 'logits'"):
        token_diff(b, "s-0", "logits")
    with pytest.raises(KeyError, match="field 'loss' is not available"):
        token_diff(b, "s-0", "loss")


def test_kl_bug_rows_and_per_sample_counts(bundles):
    _, m = model_of(bundles / "kl-bug")
    # only the failing stage's field is recomputed up front; a passing one waits for its first view
    assert set(m.shards[0].values) == {"kl"}
    assert m.field_diff("advantage", "s-5").divergent == [] and "advantage" in m.shards[0].values
    d5 = m.field_diff("kl", "s-5")
    assert len(d5) == 16
    assert d5.divergent == list(KL_BUG_TOKENS["s-5"]) == [3, 7, 11]
    for off in KL_BUG_TOKENS["s-5"]:
        assert d5.abs_error[off] == pytest.approx(KL_BUG_DELTA, abs=1e-6)
        assert d5.expected[off] - d5.actual[off] == pytest.approx(KL_BUG_DELTA, abs=1e-6)
    assert m.field_diff("kl", "s-6").divergent == [0]
    counts = {s.sample_id: s.mismatches for s in m.samples}
    assert counts["s-5"] == {"kl": 3} and counts["s-6"] == {"kl": 1} and counts["s-0"] == {}
    assert [g.diverging for g in m.groups] == [0, 2]
    first = m.report.first_divergence
    assert (first.sample_id, first.token_offset, first.field) == ("s-5", 3, "kl")


@pytest.mark.parametrize("name", ["pr65-buggy", "pr65-fixed", "step-loss", "cohort-2rank", "kl-bug", "loss-bug"])
def test_model_mismatch_totals_equal_the_report(bundles, name):
    _, m = model_of(bundles / name)
    for stage in m.report.stages:
        field = field_for_divergence(stage.stage, "")
        if field is None or field not in m.fields:
            continue
        assert all(sh.ensure(field) for sh in m.shards)  # passing fields are computed on first view
        total = sum(int(sh.bad[field].sum()) for sh in m.shards)
        assert total == stage.mismatches, stage.stage


def test_loss_table_of_a_wrong_pg_loss(bundles):
    _, m = model_of(bundles / "loss-bug")
    diff = m.field_diff("loss")
    assert diff.kind == KIND_COHORT
    assert diff.labels == ["loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"]
    assert diff.divergent == [0, 1]
    assert diff.abs_error[1] == pytest.approx(LOSS_BUG_DELTA, abs=1e-6)
    # the others: the float64 recompute within their tolerance (float32 noise, not 0)
    assert all(err <= tol for err, tol in zip(diff.abs_error[2:], diff.tolerance_tensor[2:].tolist()))
    assert m.fields == ["loss"]


def test_step_loss_seed_value(bundles):
    _, m = model_of(bundles / "step-loss")
    diff = m.field_diff("loss")
    assert diff.labels[1] == "pg_loss"
    assert diff.actual[1] == pytest.approx(0.8974426, abs=1e-6)
    assert diff.actual[3] == 2.0 and diff.actual[4] == -2.0
    assert diff.divergent == []
    assert all(not s.compared for s in m.samples)  # no per-sample stage ran


def test_cohort_loss_rows_name_their_rank(bundles):
    _, m = model_of(bundles / "cohort-2rank")
    labels = m.field_diff("loss").labels
    assert labels[0] == "loss [rank 0]" and labels[5] == "loss [rank 1]"
    assert [g.label for g in m.groups] == ["g-0 · rank 0", "g-1 · rank 0", "g-0 · rank 1", "g-1 · rank 1"]
    # each rank normalizes its own groups: 4 (rank, group) pairs over 2 ids
    assert ("samples", "16 in 4 groups (2 ids × 2 ranks), 256 tokens") in m.identity
    assert ("samples", "4 in 2 groups, 12 tokens") in model_of(bundles / "pr65-buggy")[1].identity


def test_partial_selection_shows_the_group_closure_only(bundles):
    _, m = model_of(bundles / "pr65-buggy", selection=Selection(samples=("s-3",)))
    assert [s.sample_id for s in m.samples] == ["s-2", "s-3"]
    assert [g.label for g in m.groups] == ["g-1"]
    assert ("selection", "2 sample(s) (semantic-group closure)") in m.identity


def test_identity_rows(bundles):
    _, m = model_of(bundles / "pr65-buggy")
    rows = dict(m.identity)
    assert rows["bundle"] == "b-00001"
    assert rows["kind"] == "rollout-level"
    assert rows["anchor"] == "rollout_id=120"
    assert rows["micro-batch"] == "mb-0000, mb-0001"
    assert rows["weights"] == "rollout=41 actor=42"
    assert rows["ranks"] == "dp=1 tp=1 pp=1 cp=1"
    assert rows["redaction"] == "prompt:hash, response:truncate:8"
    assert rows["torch"] == "test"


def test_next_divergence_and_error_profile():
    bad = [False, False, True, False, False, True, False, False, False, True]
    err = [0.0, 0.0, 2.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 4.0]
    diff = FieldDiff(field="kl", stage="advantage.kl", kind=KIND_TOKEN, expected=err, actual=[0.0] * 10,
                     abs_error=err, bad=bad, mask=[1] * 10)
    assert diff.next_divergence(0) == 2
    assert diff.next_divergence(2) == 5
    assert diff.next_divergence(9) is None
    assert diff.next_divergence(5, -1) == 2
    assert diff.next_divergence(2, -1) is None
    assert diff.error_profile(5) == [(0.0, False), (0.5, True), (0.25, True), (0.0, False), (1.0, True)]
    assert diff.row_of_bin(1, 5) == 2
    assert list(diff.bins_of_row(5, 5)) == [2]
    # more bins than rows: every row spans 2 bins, the strip fills its width
    assert diff.error_profile(20)[4:6] == [(0.5, True), (0.5, True)]
    assert diff.row_of_bin(19, 20) == 9 and list(diff.bins_of_row(9, 20)) == [18, 19]
    # a NaN on either side counts as the largest error
    nan = FieldDiff(field="kl", stage="advantage.kl", kind=KIND_TOKEN, expected=[0.0, float("nan")],
                    actual=[0.0, 1.0], abs_error=[0.0, float("nan")], bad=[False, True], mask=[1, 1])
    assert nan.error_profile(2) == [(0.0, False), (1.0, True)]


def test_diff_rows_render_without_an_app(bundles):
    _, m = model_of(bundles / "pr65-buggy", rules=Rules(chain=True))
    view = DiffView()
    view.diff = m.field_diff("advantage", "s-2")
    view._rows = len(view.diff)
    view._label_width = 6
    assert view.render_header(60, Style()).text.split() == ["offset", "expected", "actual", "abs", "err", "×noise",
                                                             "tol", "mask"]
    tol = float(view.diff.tolerance_tensor[2])
    assert view.render_row(2, 60, Style()).text.split() == ["✗", "2", "3.5", "-1.0", "4.5", fmt_ratio(4.5 / tol),
                                                            fmt_tolerance(tol), "0"]
    assert view.render_row(2, 60, Style()).cell_length == 60
    # narrower: the mask goes first, then tol, then ×noise
    assert view.render_header(46, Style()).text.split() == ["offset", "expected", "actual", "abs", "err", "×noise"]
    assert view.render_row(2, 46, Style()).cell_length == 46


def test_fit_number_keeps_digits_not_ellipses():
    assert fit_number(0.8974426, 12) == "   0.8974426"
    assert fit_number(-0.083920896, 8) == "-0.08392"
    assert fit_number(float("nan"), 5) == "  nan"


def test_dag_gutters_fork_the_loss_stages():
    stages = ["sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate",
              "loss.policy", "loss.value"]
    assert dag_gutters(stages) == ["", "└", " └", "  └", "   └", "    ├", "    └"]


def test_demo_cleanup_removes_only_its_own_temporary_directory(tmp_path):
    import tempfile

    from replay_lib.demo import materialize_demo
    from replay_tui.app import remove_materialized_demo

    bundle = materialize_demo("pr65-fixed")
    assert bundle.parent.name.startswith("replay-demo-") and (bundle / "COMPLETE").is_file()
    remove_materialized_demo(bundle)
    assert not bundle.parent.exists()
    elsewhere = tmp_path / "replay-demo-x" / "pr65-fixed"  # the right name, outside the temporary directory
    elsewhere.mkdir(parents=True)
    assert elsewhere.parent.parent != Path(tempfile.gettempdir())
    remove_materialized_demo(elsewhere)
    assert elsewhere.is_dir()


@pytest.mark.parametrize("name", ["pr65-buggy", "kl-bug", "support-fullvocab"])
def test_the_replay_contexts_give_the_same_model_without_running_a_stage_again(bundles, name, monkeypatch):
    b = open_bundle(bundles / name)
    report, contexts = replay_run(b)
    runs: list[str] = []
    for stage_id, stage in list(REGISTRY.items()):
        def counted(ctx, _run=stage.run, _id=stage_id):
            runs.append(_id.value)
            return _run(ctx)
        monkeypatch.setitem(REGISTRY, stage_id, type(stage)(**{**stage.__dict__, "run": counted}))
    reused = build_model(b, report, contexts=contexts)
    assert runs == []  # the failing fields were compared on the replay's own outputs
    fresh = build_model(b, run_replay(b))
    assert runs  # without the contexts the failing stages run again
    assert reused.fields == fresh.fields
    assert [(r.sample_id, r.mismatches, r.total_mismatches) for r in reused.samples] == \
        [(r.sample_id, r.mismatches, r.total_mismatches) for r in fresh.samples]
    for field_name in reused.fields:
        for sample in reused.samples[:3]:
            a, f = reused.field_diff(field_name, sample.sample_id), fresh.field_diff(field_name, sample.sample_id)
            assert (a.expected, a.actual, a.divergent) == (f.expected, f.actual, f.divergent)


def test_a_partial_selection_context_is_not_reused(bundles):
    b = open_bundle(bundles / "pr65-buggy")
    report, contexts = replay_run(b, selection=Selection(samples=("s-3",)))
    assert contexts[0].partial
    m = build_model(b, report, contexts=contexts)
    assert m.field_diff("reward").expected == [3.5, 5.5]  # rows of the selected group, from a full recompute


@pytest.mark.parametrize("name", ["kl-bug", "cohort-2rank"])
def test_tree_rows_equal_the_rows_written_out(bundles, name):
    _, m = model_of(bundles / name)
    totals = m.samples.totals

    def written_out(diverging_only, folded):
        rows = []
        for gi, g in enumerate(m.groups):
            members = [s for s in g.samples if totals[s]] if diverging_only else list(g.samples)
            if diverging_only and not members:
                continue
            rows.append(("group", gi))
            if gi not in folded:
                rows += [("sample", s) for s in members]
        return rows

    for diverging_only in (False, True):
        for folded in (frozenset(), frozenset({0}), frozenset(range(len(m.groups)))):
            rows = m.tree_rows(diverging_only, folded)
            expect = written_out(diverging_only, folded)
            assert list(rows) == expect and len(rows) == len(expect)
            assert [rows[k] for k in range(-len(expect), 0)] == expect  # negative indices too
            for k, row in enumerate(expect):
                assert row in rows and rows.index(row) == k
            shown = {s for kind, s in expect if kind == "sample"}
            for s in range(len(m.samples)):
                if s not in shown:
                    assert ("sample", s) not in rows
                    with pytest.raises(ValueError):
                        rows.index(("sample", s))
            with pytest.raises(IndexError):
                rows[len(expect)]
    assert ("group", len(m.groups)) not in m.tree_rows(False, frozenset())


def test_identity_values_wrap_at_spaces_and_cut_long_words_after_a_separator():
    from replay_tui.widgets.identity_pane import wrap_rows

    lines = wrap_rows([("redaction", "prompt:hash, response:truncate:8"), ("kind", "step-level")], 24)
    assert [(k.rstrip(), v) for k, _, v, _ in lines] == [
        ("redaction", "prompt:hash,"), ("", "response:"), ("", "truncate:8"), ("kind", "step-level")]
    # no separator within the column: cut hard, nothing lost
    lines = wrap_rows([("id", "abcdefghijklmnopqrstuvwxyz")], 12)
    assert "".join(v for _, _, v, _ in lines) == "abcdefghijklmnopqrstuvwxyz"
    assert all(len(v) <= 12 - 2 - 1 for _, _, v, _ in lines)


def test_group_rows_are_ranges_when_groups_sit_together():
    assert group_rows([0, 0, 1, 1, 2], 0) == {0: range(0, 2), 1: range(2, 4), 2: range(4, 5)}
    assert group_rows([7, 7, 3], 10) == {7: range(10, 12), 3: range(12, 13)}  # rows from the shard's first
    # a group that comes back later, or a sample without a group: lists, groups in order of first appearance
    assert group_rows([0, 1, 0], 5) == {0: [5, 7], 1: [6]}
    assert group_rows([None, None, 1], 0) == {None: [0, 1], 1: [2]}
    assert group_rows([], 0) == {}


@pytest.mark.parametrize("n,bins", [(1000, 7), (1000, 104), (999, 1000), (5, 9)])
def test_error_peaks_of_a_finite_sample_are_each_bins_max(n, bins):
    gen = torch.Generator().manual_seed(n + bins)
    err = torch.rand(n, generator=gen, dtype=torch.float64)
    bad = err > 0.97
    diff = FieldDiff(field="kl", stage="advantage.kl", kind=KIND_TOKEN, expected=err, actual=torch.zeros(n),
                     abs_error=err, bad=bad, mask=[1] * n)
    peaks, flagged, top = diff.error_peaks(bins)
    values, marks = err.tolist(), bad.tolist()
    # row i is drawn in bin i·bins // n (fewer rows than bins: bin b shows row b·n // bins)
    if bins >= n:
        want = [values[b * n // bins] for b in range(bins)]
        want_flags = [marks[b * n // bins] for b in range(bins)]
    else:
        want = [max(v for i, v in enumerate(values) if i * bins // n == b) for b in range(bins)]
        want_flags = [any(m for i, m in enumerate(marks) if i * bins // n == b) for b in range(bins)]
    assert peaks == want and flagged == want_flags and top == max(values)
