"""``trajectory-replay diff A B`` (SPEC §9): two captures of the same step compared field by field with the
error model — the first differences of each field, samples matched by id, a one-line error (exit 3) for two
bundles of different samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import torch

from replay_lib.bundle import BundleReader
from replay_lib.demo import synthetic_parts, write_bundle
from replay_lib.judge.report import fmt_value
from replay_lib.run.diff import diff_bundles

SAMPLES, TOKENS = 8, 16  # s-k's tokens are k*16 … k*16+15 of the flat token axis


def _parts(**kw):
    return synthetic_parts(samples=SAMPLES, tokens=TOKENS, kl_coef=0.0, bundle_id="b-7-0", **kw)


def _write(path: Path, parts) -> Path:
    return write_bundle(path, *parts)


def _with_reward(parts, i: int, value: float):
    manifest, index, expected, payloads = parts
    samples = list(index.samples)
    samples[i] = msgspec.structs.replace(samples[i], reward=value)
    expected = {**expected, "reward.post_process": {"rewards": [value if k == i else r for k, r in
                                                               enumerate(expected["reward.post_process"]["rewards"])]}}
    return manifest, msgspec.structs.replace(index, samples=samples), expected, payloads


def _stages(report) -> dict:
    return {s.stage: s for s in report.stages}


def test_the_first_differences_of_each_field_are_named_with_sample_and_token(tmp_path):
    a = _write(tmp_path / "a", _parts())
    manifest, index, expected, payloads = _with_reward(_parts(), 2, 9.0)
    payloads = dict(payloads, advantages=payloads["advantages"].clone())
    payloads["advantages"][5] = 3.0  # s-0, token 5
    payloads["advantages"][16 * 6 + 15] = -3.0  # s-6, token 15
    b = _write(tmp_path / "b", (manifest, index, expected, payloads))
    report = diff_bundles(a, b)
    recorded = BundleReader(a).payload("advantages")  # as stored, whichever form the writer took
    rewards = json.loads((a / "index.json").read_text())["samples"]
    stages = _stages(report)
    assert not report.passed and report.first_divergent_stage == "reward"  # index fields come first
    assert [s.stage for s in report.stages if s.status == "fail"] == [
        "reward", "advantages", "expected.reward.post_process.rewards"]
    adv = stages["advantages"]
    assert (adv.mismatches, adv.compared) == (2, SAMPLES * TOKENS)
    first, second = adv.divergences
    assert (first.sample_id, first.token_offset, first.expected, first.actual) == ("s-0", 5, float(recorded[5]), 3.0)
    assert (second.sample_id, second.token_offset, second.expected, second.actual) == (
        "s-6", 15, float(recorded[111]), -3.0)
    rew = stages["reward"].divergences
    assert [(d.sample_id, d.expected, d.actual) for d in rew] == [("s-2", rewards[2]["reward"], 9.0)]
    # the bundle's default tolerance: atol 1e-6 + rtol 1e-5·|a| (same float32 dtype: no rounding term)
    assert rew[0].tolerance == 1e-6 + 1e-5 * abs(rewards[2]["reward"])
    assert stages["old_log_probs"].status == "pass" and stages["old_log_probs"].max_abs_error == 0.0


def test_samples_are_matched_by_id_whatever_their_order(tmp_path):
    """B holds A's samples in reverse order (and their tokens with them): nothing differs."""
    a = _write(tmp_path / "a", _parts())
    manifest, index, expected, payloads = _parts()
    order = list(reversed(range(SAMPLES)))

    def per_token(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(SAMPLES, TOKENS)[order].reshape(-1)

    index = msgspec.structs.replace(index, samples=[index.samples[i] for i in order])
    expected = {stage: {k: [v[i] for i in order] if isinstance(v, list) else v for k, v in fields.items()}
                for stage, fields in expected.items()}
    b = _write(tmp_path / "b", (manifest, index, expected, {k: per_token(v) for k, v in payloads.items()}))
    report = diff_bundles(a, b)
    assert report.passed and report.exit_code == 0
    assert _stages(report)["advantages"].compared == SAMPLES * TOKENS


def test_a_difference_within_the_tolerance_is_not_one(tmp_path):
    """|b − a| = 2^-20 ≈ 9.5e-7 < atol 1e-6 passes; 2^-10 fails (values of old_log_probs lie in [-3, 0])."""
    a = _write(tmp_path / "a", _parts())
    manifest, index, expected, payloads = _parts()
    old = payloads["old_log_probs"].to(torch.float64)
    old[0] += 2.0 ** -20
    old[1] += 2.0 ** -10
    b = _write(tmp_path / "b", (manifest, index, expected, dict(payloads, old_log_probs=old)))  # float64 now
    stage = _stages(diff_bundles(a, b))["old_log_probs"]
    assert stage.mismatches == 1 and stage.divergences[0].token_offset == 1
    d = stage.divergences[0]
    # float32 A vs float64 B: the rounding of the coarser dtype, 2^-24·|a|, joins the bound
    assert d.tolerance == 1e-6 + (1e-5 + 2.0 ** -24) * abs(d.expected)


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay_lib", "diff", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_cli_text_and_exit_1_and_different_samples_are_one_line_exit_3(tmp_path):
    a = _write(tmp_path / "a", _parts())
    b = _write(tmp_path / "b", _with_reward(_parts(), 1, 0.25))
    c = _write(tmp_path / "c", _parts(sample_prefix="t-"))
    reward = json.loads((a / "index.json").read_text())["samples"][1]["reward"]
    proc = _cli(a, b)
    assert proc.returncode == 1 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0] == f"bundle b-7-0 (A {a} vs B {b}) — first divergent stage: reward"  # one id: the paths
    assert lines[2] == "[   fail] reward — 1 of 8 value(s) differ (max abs_err " + f"{abs(0.25 - reward):.3g})"
    # the two sides named by capture (A, B), not a replay's expected/actual
    assert lines[3] == (f"          reward s-1: A={fmt_value(reward)} B=0.25 "
                        f"abs_err={fmt_value(abs(0.25 - reward))}")
    proc = _cli(a, c)
    assert (proc.returncode, proc.stdout) == (3, "")
    assert proc.stderr == (f"trajectory-replay: error: A b-7-0 ({a}) vs B b-7-0 ({c}): different sample ids "
                           f"('s-0' only in A); diff compares two captures of the same step\n")


def test_different_sizes_are_one_line_exit_3(tmp_path):
    a = _write(tmp_path / "a", _parts())
    b = _write(tmp_path / "b", synthetic_parts(samples=4, tokens=TOKENS, kl_coef=0.0, bundle_id="b-small"))
    try:
        diff_bundles(a, b)
    except Exception as exc:
        assert type(exc).__name__ == "BundleError" and getattr(exc, "exit_code") == 3
        assert str(exc) == (f"A b-7-0 ({a}) vs B b-small ({b}): different sizes: 8 sample(s) vs 4; diff "
                            f"compares two captures of the same step")
    else:
        raise AssertionError("diff of 8 against 4 samples did not refuse")


def test_json_has_the_replay_report_shape(tmp_path, capsys):
    from replay_lib.cli import main

    a = _write(tmp_path / "a", _parts())
    b = _write(tmp_path / "b", _with_reward(_parts(), 3, 0.5))
    reward = json.loads((a / "index.json").read_text())["samples"][3]["reward"]
    assert main(["diff", str(a), str(b), "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["passed"], doc["first_divergent_stage"], doc["mode"]) == (False, "reward", "diff")
    d = doc["first_divergence"]
    assert (d["stage"], d["field"], d["sample_id"], d["expected"], d["actual"]) == ("reward", "reward", "s-3",
                                                                                  reward, 0.5)
    assert [s["stage"] for s in doc["stages"] if s["status"] == "fail"] == ["reward",
                                                                          "expected.reward.post_process.rewards"]


def test_the_recorded_per_sample_loss_terms_are_compared_too(tmp_path, bundle_tools):
    """expected.json $.loss.policy.per_sample (pg_sum, …, loss_weight): every term both bundles record is a field,
    named by sample; a term neither records is not listed (they were left out, the README says every number)."""
    edit_json = bundle_tools.edit_json
    a = _write(tmp_path / "a", _parts())
    b = _write(tmp_path / "b", _parts())
    terms = {"pg_sum": [0.5] * 8, "mask_count": [3.0] * 8}
    for path in (a, b):
        edit_json(path, "expected.json", lambda doc: doc.setdefault("loss.policy", {"loss": 0.0}).update(
            per_sample=dict(terms)))
    edit_json(b, "expected.json", lambda doc: doc["loss.policy"]["per_sample"]["pg_sum"].__setitem__(2, 0.75))
    stages = _stages(diff_bundles(a, b))
    assert stages["expected.loss.policy.per_sample.mask_count"].status == "pass"
    pg = stages["expected.loss.policy.per_sample.pg_sum"]
    assert (pg.status, pg.mismatches) == ("fail", 1)
    d = pg.divergences[0]
    assert (d.sample_id, d.expected, d.actual) == ("s-2", 0.5, 0.75)
    assert not [name for name in stages if name.endswith("per_sample.entropy_sum")]
