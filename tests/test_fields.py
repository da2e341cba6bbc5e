"""One field-result shape (``replay_lib.judge.fields``): the element rule, the sample map, the report built from the
fields, and every stage leaving its fields on the replay's context for the views to read."""

from __future__ import annotations

import math

import pytest
import torch

from replay_lib.bundle import open_bundle
from replay_lib.demo import write_pr65, write_synthetic
from replay_lib.judge.fields import (PER_SAMPLE, PER_SCALAR, PER_TOKEN, FieldResult, SampleRuns, compare_field, judge,
                               stage_report)
from replay_lib.run.runner import replay_run

NAN, INF = float("nan"), float("inf")


def token_field(expected, actual, tolerance, **kw) -> FieldResult:
    return FieldResult(stage="advantage.kl", name="kl", per=PER_TOKEN, expected=torch.tensor(expected, dtype=torch.float64),
                       actual=torch.tensor(actual, dtype=torch.float64), tolerance=tolerance,
                       sample_ids=["s-0", "s-1", "s-2"], group_indices=[0, 0, 1],
                       offsets=torch.tensor([0, 2, 2]), lengths=torch.tensor([2, 0, 3]), **kw)


def test_the_rule_nan_inf_and_the_bound_inclusive():
    e = torch.tensor([1.0, 1.0, NAN, 1.0, INF, NAN], dtype=torch.float64)
    a = torch.tensor([1.5, 1.6, NAN, INF, INF, 1.0], dtype=torch.float64)
    tol = torch.full((6,), 0.5, dtype=torch.float64)
    diff, finite, bad = judge(e, a, tol)
    assert bad.tolist() == [False, True, True, True, True, True]  # |a − e| = tol passes; NaN/Inf always fail
    assert finite.tolist() == [True, True, False, False, False, False]
    # a NaN tolerance admits nothing
    assert judge(e[:1], e[:1] + 0.1, torch.tensor([NAN], dtype=torch.float64))[2].tolist() == [True]


def test_exact_means_bitwise():
    e = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    a = torch.tensor([-0.0, 1.0, math.nextafter(2.0, 3.0)], dtype=torch.float64)
    assert judge(e, a, torch.full((3,), 1.0, dtype=torch.float64), exact=True)[2].tolist() == [True, False, True]


def test_token_divergences_name_sample_offset_tolerance_and_noise_ratio():
    f = token_field([0.0, 0.0, 1.0, 1.0, 1.0], [0.0, 0.3, 1.0, 1.0, 2.0], torch.full((5,), 0.1, dtype=torch.float64))
    cmp = compare_field(f, keep=5)
    assert (cmp.compared, cmp.mismatches, cmp.bad_samples) == (5, 2, 2)
    assert cmp.max_abs_error == pytest.approx(1.0) and cmp.max_noise_ratio == pytest.approx(10.0)
    # token 4 is offset 2 of s-2 (s-1 is empty and starts where s-2 does)
    assert [(d.sample_id, d.group_index, d.token_offset, d.tolerance) for d in cmp.divergences] == [
        ("s-0", 0, 1, 0.1), ("s-2", 1, 2, 0.1)]
    assert cmp.divergences[0].noise_ratio == pytest.approx(3.0)
    assert f.per_sample_counts().tolist() == [1, 0, 1]


def test_a_column_may_be_a_function_evaluated_a_chunk_at_a_time():
    n = 40_000  # more than one chunk
    e = torch.linspace(-1, 1, n, dtype=torch.float32)
    calls = []

    def actual(lo, hi):
        calls.append((lo, hi))
        out = e[lo:hi].to(torch.float64).clone()
        if lo <= 33_333 < hi:
            out[33_333 - lo] += 1.0
        return out

    f = FieldResult(stage="advantage.estimate", name="advantage", per=PER_TOKEN, expected=e, actual=actual,
                    tolerance=lambda lo, hi: torch.full((hi - lo,), 1e-3, dtype=torch.float64), size=n,
                    sample_ids=["s-0"], group_indices=[0], offsets=torch.tensor([0]), lengths=torch.tensor([n]))
    cmp = compare_field(f, keep=3)
    assert cmp.mismatches == 1 and cmp.divergences[0].token_offset == 33_333
    assert max(hi - lo for lo, hi in calls) <= 1 << 14
    assert f.bad.nonzero().reshape(-1).tolist() == [33_333] and f.expected.dtype == torch.float64


def _counted_field():
    """A 40,000-token field (three chunks) whose actual column is a function that records each call; token
    33,333 is off by 1.0 against a tolerance of 1e-3. ``(field, expected, actual function, calls)``."""
    n = 40_000
    e = torch.linspace(-1, 1, n, dtype=torch.float32)
    calls = []

    def actual(lo, hi):
        calls.append((lo, hi))
        out = e[lo:hi].to(torch.float64).clone()
        out[(33_333 - lo) if lo <= 33_333 < hi else slice(0, 0)] += 1.0
        return out

    f = FieldResult(stage="advantage.estimate", name="advantage", per=PER_TOKEN, expected=e, actual=actual,
                    tolerance=lambda lo, hi: torch.full((hi - lo,), 1e-3, dtype=torch.float64), size=n,
                    sample_ids=["s-0"], group_indices=[0], offsets=torch.tensor([0]), lengths=torch.tensor([n]))
    return f, e, actual, calls


def test_reading_every_column_evaluates_a_function_column_once_per_chunk():
    """The debugger reads expected, actual, tolerance, abs error, bad mask and noise ratio of a failing field:
    one pass over the chunks serves every float64 column (a function column is a stage kernel, not re-run per
    column), and a window sliced afterwards reads the same values without evaluating it again. The bad mask read
    first is a pass of its own that keeps one byte an element (a view counts a whole step's divergences per
    sample; keeping every float64 column of a 16M-token field for it took ≈ 34 bytes an element)."""
    f, e, actual, calls = _counted_field()
    assert f.bad.nonzero().reshape(-1).tolist() == [33_333]
    assert calls == [(0, 16_384), (16_384, 32_768), (32_768, 40_000)] and f._full is None
    assert f.actual[33_333] == float(e[33_333]) + 1.0 and f.abs_error[33_333] == 1.0
    assert f.tolerance[0] == 1e-3 and f.noise_ratio[33_333] == 1.0 / 1e-3 and f.expected.dtype == torch.float64
    assert calls == [(0, 16_384), (16_384, 32_768), (32_768, 40_000)] * 2
    calls.clear()
    w = f.window(33_000, 34_000)
    assert w.bad.nonzero().reshape(-1).tolist() == [333] and w.lo == 33_000 and calls == []
    assert torch.equal(w.actual, actual(33_000, 34_000))


def test_a_pass_over_a_whole_field_lets_the_rows_it_read_go_behind_it(monkeypatch):
    """A holder that keeps a field past its stage (the debugger's model) sets ``release``: the bad mask's pass
    over the step calls it behind the chunks it judged, in blocks of RELEASE_ROWS rows, every row once and never
    one it has not read yet — the payload pages of a 16M-token field stayed resident for the model's lifetime
    before (+193 MiB at 1,024 × 16,384)."""
    import replay_lib.judge.fields as fields

    monkeypatch.setattr(fields, "RELEASE_ROWS", 20_000)
    f, e, actual, calls = _counted_field()
    released = []
    f.release = lambda lo, hi: released.append((lo, hi, len(calls)))
    assert f.bad.nonzero().reshape(-1).tolist() == [33_333]
    # (rows let go, chunks judged by then): 2 chunks = 32,768 rows ≥ 20,000, then the rest at the end
    assert released == [(0, 32_768, 2), (32_768, 40_000, 3)]
    g, *_ = _counted_field()
    assert g.bad.nonzero().reshape(-1).tolist() == [33_333]  # no hook: nothing to call, the same mask


def test_the_stage_s_judging_pass_lets_the_rows_it_read_go_behind_it(monkeypatch, tmp_path):
    """compare_field (the report's pass over a field) lets the payload rows go behind it too: a per-token field of
    a step longer than KEEP_COLUMNS gets its context's ``release``, so a stage whose fields read three payloads
    (advantage.kl: kl, old and reference log-probs) no longer holds all their pages until the stage ends (the
    replay's peak at 1,024 × 16,384 with kl on: 452 → 349 MiB)."""
    import replay_lib.judge.fields as fields

    monkeypatch.setattr(fields, "RELEASE_ROWS", 20_000)
    f, e, actual, calls = _counted_field()
    released = []
    f.release = lambda lo, hi: released.append((lo, hi, len(calls)))
    assert compare_field(f, keep=3).mismatches == 1
    assert released == [(0, 32_768, 2), (32_768, 40_000, 3)]
    bundles = open_bundle(write_synthetic(tmp_path / "b", samples=40, tokens=8192, format_version="1.3.0"))
    _, contexts = replay_run(bundles)
    ctx = contexts[0]
    assert ctx.full_total == 40 * 8192 > fields.KEEP_COLUMNS
    token_fields = [r for rs in ctx.fields.values() for r in rs if r.per == PER_TOKEN]
    assert token_fields and all(r.release == ctx.release for r in token_fields)
    assert all(r.release is None for rs in ctx.fields.values() for r in rs if r.per != PER_TOKEN)


def test_a_judged_field_keeps_its_columns_for_the_debugger():
    """compare_field (the stage's report) evaluates a function column once per chunk, and what the debugger
    reads afterwards — every column, any window — comes from what it kept, not from the kernel again."""
    f, e, actual, calls = _counted_field()
    cmp = compare_field(f, keep=3)
    assert cmp.mismatches == 1 and cmp.divergences[0].token_offset == 33_333
    assert cmp.divergences[0].actual == float(e[33_333]) + 1.0 and cmp.divergences[0].tolerance == 1e-3
    assert calls == [(0, 16_384), (16_384, 32_768), (32_768, 40_000)]
    assert f.bad.nonzero().reshape(-1).tolist() == [33_333] and f.abs_error[33_333] == 1.0
    assert f.window(33_000, 34_000).bad.nonzero().reshape(-1).tolist() == [333] and len(calls) == 3


def test_a_failing_field_keeps_its_judged_chunks_and_copies_a_whole_column_only_when_read():
    """The kept columns are the chunk windows as judged: a window of rows is a slice of the chunks it overlaps
    (a sample of a million-token field costs its rows, not the field), the same values as a fresh judgement."""
    f, e, actual, calls = _counted_field()
    compare_field(f, keep=3)
    assert f._full is not None and f._full._whole == {}  # nothing concatenated by the judgement itself
    w = f.window(16_000, 17_000)  # across the chunk boundary at 16,384
    assert torch.equal(w.expected, e[16_000:17_000].to(torch.float64)) and torch.equal(w.actual, actual(16_000, 17_000))
    inside = f.window(20_000, 20_010)
    assert inside.expected.data_ptr() == f._full.parts[1].expected[20_000 - 16_384:].data_ptr()  # a slice, no copy
    assert f._full._whole == {} and len(calls) == 4  # (the one call above is the test's own)
    assert f.bad.nonzero().reshape(-1).tolist() == [33_333] and set(f._full._whole) == {"bad"}
    assert torch.equal(f.expected, e.to(torch.float64)) and f.window(39_990, 40_000).lo == 39_990


def test_scalar_rows_are_named_by_their_labels_and_a_length_mismatch_is_one_divergence():
    f = FieldResult(stage="loss.policy", name="loss", per=PER_SCALAR, expected=[1.0, 2.0], actual=[1.0, 2.5],
                    tolerance=lambda lo, hi: torch.zeros(hi - lo, dtype=torch.float64), labels=["loss", "pg_loss"])
    cmp = compare_field(f, keep=5)
    assert [(d.field, d.sample_id, d.expected, d.actual) for d in cmp.divergences] == [("pg_loss", None, 2.0, 2.5)]
    short = FieldResult(stage="reward.raw", name="raw_reward", per=PER_SAMPLE, expected=[1.0, 2.0], actual=[1.0],
                        tolerance=lambda lo, hi: torch.zeros(hi - lo, dtype=torch.float64), sample_ids=["s-0", "s-1"],
                        group_indices=[0, 0])
    cmp = compare_field(short, keep=5)
    assert cmp.mismatches == 1
    assert cmp.divergences[0].message == "length mismatch: expected 2 element(s), recomputed 1"


def test_stage_report_is_built_from_the_fields():
    f = token_field([0.0, 0.0, 1.0, 1.0, 1.0], [0.0, 0.3, 1.0, 1.0, 2.0], torch.full((5,), 0.1, dtype=torch.float64))
    report = stage_report("advantage.kl", [f], 1, fail_reason=lambda total, per: f"{per['kl'].mismatches} bad",
                          pass_reason="fine")
    assert (report.status, report.reason, report.mismatches, len(report.divergences)) == ("fail", "2 bad", 2, 1)
    assert report.max_noise_ratio == pytest.approx(10.0) and report.compared == 5


def test_every_compared_stage_leaves_its_fields_on_the_context(tmp_path):
    b = open_bundle(write_synthetic(tmp_path / "s", samples=8, tokens=16, seed=3))
    report, contexts = replay_run(b)
    ctx = contexts[0]
    assert {stage: [(f.name, f.per) for f in fields] for stage, fields in ctx.fields.items()} == {
        "sample": [], "reward.raw": [("raw_reward", "sample")], "reward.post_process": [("reward", "sample")],
        "advantage.kl": [("kl", "token")], "advantage.estimate": [("advantage", "token")],
        "loss.policy": [("loss", "scalar")],
    }
    loss = ctx.fields["loss.policy"][0]
    assert loss.labels == ["loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"]
    for stage in report.stages:
        if stage.status == "pass" and stage.stage in ctx.fields:
            assert sum(int(f.bad.sum()) for f in ctx.fields[stage.stage]) == stage.mismatches == 0


def test_the_report_counts_are_the_fields_counts(tmp_path):
    b = open_bundle(write_pr65(tmp_path / "b", buggy=True))
    report, contexts = replay_run(b)
    post = contexts[0].fields["reward.post_process"][0]
    assert post.bad.tolist() == [True] * 4 and report.stage("reward.post_process").mismatches == 4
    assert post.expected.tolist() == [-5.5, -3.5, 3.5, 5.5] and post.actual.tolist() == [-1.0, 1.0, -1.0, 1.0]


def test_the_debugger_model_reads_the_stages_fields_not_its_own_recompute(tmp_path):
    from replay_tui.model import build_model

    b = open_bundle(write_synthetic(tmp_path / "s", samples=8, tokens=16, seed=5))
    report, contexts = replay_run(b)
    model = build_model(b, report, contexts=contexts)
    shard = model.shards[0]
    for name, stage in (("reward", "reward.post_process"), ("kl", "advantage.kl"), ("advantage", "advantage.estimate"),
                        ("loss", "loss.policy")):
        assert shard.ensure(name)
        result = contexts[0].fields[stage][-1]
        assert shard.results[name] is result  # the very object the report was built from
        assert torch.equal(shard.values[name][1], result.actual) and torch.equal(shard.bad[name], result.divergent)
    diff = model.field_diff("kl", "s-3")
    start, n = int(contexts[0].offsets[3]), int(contexts[0].lengths[3])
    assert diff.tolerance_tensor.tolist() == contexts[0].fields["advantage.kl"][0].tolerance[start:start + n].tolist()


def _broadcast_pair(seed: int, samples: int, keep_bad: float):
    """The same broadcast field twice — judged token by token, and a sample at a time (``SampleRuns``) — with
    empty samples, NaN and ±Inf on either side, samples beyond their tolerance and a zero tolerance."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 7, (samples,), generator=gen)
    lengths[0] = 0
    offsets = torch.cumsum(lengths, 0) - lengths
    e_s = torch.randn(samples, generator=gen).to(torch.float32)
    a_s = e_s.to(torch.float64) + torch.randn(samples, generator=gen, dtype=torch.float64) * 1e-7
    wrong = torch.rand(samples, generator=gen) < keep_bad
    a_s[wrong] += torch.rand(int(wrong.sum()), generator=gen, dtype=torch.float64) + 1e-3
    for k, (ev, av) in enumerate([(NAN, 0.0), (1.0, INF), (INF, INF), (-INF, 0.0), (0.0, NAN)]):
        e_s[3 + 5 * k], a_s[5 + 5 * k] = ev, av
    bound_s = torch.rand(samples, generator=gen, dtype=torch.float64) * 1e-6
    bound_s[7] = 0.0
    atol, rtol = 1e-8, 1e-6
    e_tok = e_s.repeat_interleave(lengths)

    def tolerance(lo, hi):
        b = bound_s.repeat_interleave(lengths)[lo:hi]
        return e_tok[lo:hi].to(torch.float64).abs().mul_(rtol).add_(atol) + b

    def field(runs):
        return FieldResult(stage="advantage.estimate", name="advantage", per=PER_TOKEN, expected=e_tok,
                           actual=a_s.repeat_interleave(lengths), tolerance=tolerance,
                           sample_ids=[f"s-{i}" for i in range(samples)], group_indices=[i // 4 for i in range(samples)],
                           offsets=offsets, lengths=lengths, runs=runs)

    runs = SampleRuns(expected=e_s.to(torch.float64), actual=a_s,
                      tolerance=e_s.to(torch.float64).abs().mul_(rtol).add_(atol) + bound_s)
    return field(None), field(runs)


def _same_comparison(a, b) -> None:
    def num(x):
        return "nan" if isinstance(x, float) and math.isnan(x) else x
    assert (a.compared, a.mismatches, a.bad_samples) == (b.compared, b.mismatches, b.bad_samples)
    assert num(a.max_abs_error) == num(b.max_abs_error) and num(a.max_noise_ratio) == num(b.max_noise_ratio)
    assert [repr(d) for d in a.divergences] == [repr(d) for d in b.divergences]  # (repr: NaN reads "nan")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("keep", [1, 4, 50])
def test_a_broadcast_field_judged_a_sample_at_a_time_is_judged_as_token_by_token(seed, keep):
    tokens, runs = _broadcast_pair(seed, samples=64, keep_bad=0.2 if seed % 2 else 0.0)
    assert runs.runs is not None and tokens.runs is None
    _same_comparison(compare_field(tokens, keep), compare_field(runs, keep))
    # what a view reads afterwards is the same too
    assert torch.equal(tokens.bad, runs.bad)
    torch.testing.assert_close(tokens.tolerance, runs.tolerance, rtol=0, atol=0, equal_nan=True)


def test_a_clean_broadcast_field_reads_no_token_column():
    _, runs = _broadcast_pair(0, samples=64, keep_bad=0.0)
    runs.runs = SampleRuns(expected=torch.zeros(64, dtype=torch.float64), actual=torch.zeros(64, dtype=torch.float64),
                           tolerance=torch.ones(64, dtype=torch.float64))
    cmp = compare_field(runs, keep=5)
    assert (cmp.mismatches, cmp.max_abs_error, cmp.max_noise_ratio) == (0, 0.0, 0.0) and runs._full is None


def test_the_estimate_stage_reports_the_same_with_and_without_sample_runs(tmp_path, monkeypatch):
    # A GRPO step whose advantages are off by 1e-3 on two samples and NaN on one token of a third (not constant
    # within its sample: that field is judged token by token), then one whose only fault is per sample: the
    # report — verdict, counts, divergences, JSON — is the same whether the stage judges a sample at a time.
    from replay_lib.demo import synthetic_parts, write_bundle
    from replay_lib.judge.report import report_to_json
    from replay_lib.stages.base import StageContext

    def build(name, nan_token):
        manifest, index, expected, payloads = synthetic_parts(samples=32, tokens=9, seed=3, bundle_id=name)
        adv = payloads["advantages"].clone()
        adv[9 * 5: 9 * 6] += 1e-3
        adv[9 * 20: 9 * 21] -= 1e-3
        if nan_token:
            adv[9 * 7 + 4] = NAN
        payloads["advantages"] = adv
        return write_bundle(tmp_path / name, manifest, index, expected, payloads)

    for name, nan_token in (("nan", True), ("plain", False)):
        path = build(name, nan_token)
        report, contexts = replay_run(open_bundle(path))
        field = contexts[0].fields["advantage.estimate"][0]
        assert (field.runs is None) == nan_token
        with monkeypatch.context() as m:
            m.setattr(StageContext, "_runs", lambda self, *a, **k: None)
            token_report, token_contexts = replay_run(open_bundle(path))
        assert token_contexts[0].fields["advantage.estimate"][0].runs is None
        assert report_to_json(report) == report_to_json(token_report)
        assert report.first_divergent_stage == "advantage.estimate"
        stage = report.stage("advantage.estimate")
        assert stage.mismatches == 18 + nan_token and [d.sample_id for d in stage.divergences][:2] == ["s-5", "s-5"]


def test_a_zero_error_against_a_zero_tolerance_has_noise_ratio_zero():
    # |a − e| = 0 with tolerance 0: the quotient is 0/0, the ratio 0 (the max falls back to the masked quotient)
    f = token_field([1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 2.0, 3.0, 4.0, 5.25],
                    torch.tensor([0.0, 0.0, 1.0, 1.0, 0.5], dtype=torch.float64))
    cmp = compare_field(f, keep=5)
    assert (cmp.mismatches, cmp.max_abs_error, cmp.max_noise_ratio) == (0, 0.25, 0.5)
    # and a nonzero error against a zero tolerance is an infinite ratio, a divergence
    g = token_field([1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 2.5, 3.0, 4.0, 5.0],
                    torch.tensor([0.0, 0.0, 1.0, 1.0, 0.5], dtype=torch.float64))
    cmp = compare_field(g, keep=5)
    assert (cmp.mismatches, cmp.max_abs_error, cmp.max_noise_ratio) == (1, 0.5, INF)


def test_two_finite_values_further_apart_than_the_largest_double_are_finite_and_divergent():
    big = 1.7e308
    diff, finite, bad = judge(torch.tensor([-big, 0.0], dtype=torch.float64), torch.tensor([big, 0.0], dtype=torch.float64),
                              torch.full((2,), 1.0, dtype=torch.float64))
    assert diff.tolist() == [INF, 0.0] and finite.tolist() == [True, True] and bad.tolist() == [True, False]
    cmp = compare_field(token_field([-big, 0.0, 0.0, 0.0, 0.0], [big, 0.0, 0.0, 0.0, 0.0],
                                    torch.full((5,), 1.0, dtype=torch.float64)), keep=5)
    assert cmp.mismatches == 1 and cmp.max_abs_error == INF
