"""Stage ``logprob.mismatch`` (SPEC §4.4): the ulp distance, the frameworks' metrics by hand, the true-on-policy
oracle at one ulp (``--bitwise`` and ``config.true_on_policy``), its explanations (an FP8-like lattice, a flat
offset, the first generated token, a bf16-rounded rollout) and the async lints."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from replay_lib.bundle.schema import RecomputeConfig
from replay_lib.kernels.mismatch import METRICS, mismatch_metrics, ulp_distance

from producers.mismatch import make_logprobs, produce_mismatch_bundle

LN2 = math.log(2.0)


def test_ulp_distance_by_hand():
    one = torch.tensor([1.0], dtype=torch.float32)
    up = torch.nextafter(one, torch.tensor([2.0]))
    assert ulp_distance(one, up).tolist() == [1.0]
    assert ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0])).tolist() == [0.0]
    # across zero: the two magnitudes' keys add up (1.0 is 0x3f800000 steps from 0)
    assert ulp_distance(torch.tensor([1.0]), torch.tensor([-1.0])).tolist() == [2.0 * 0x3F800000]
    assert ulp_distance(torch.tensor([-1.5]), torch.nextafter(torch.tensor([-1.5]), torch.tensor([0.0]))).tolist() == [1.0]
    d64 = torch.tensor([1.0], dtype=torch.float64)
    assert ulp_distance(d64, torch.nextafter(d64, torch.tensor([2.0], dtype=torch.float64))).tolist() == [1.0]
    assert ulp_distance(torch.tensor([math.nan]), torch.tensor([1.0])).tolist() == [math.inf]


def _hand_inputs():
    # sample A: old = ln(.5), ln(.25), rollout = ln(.25), ln(.25); sample B: old = rollout = ln(.5); all loss tokens
    old = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.5)], dtype=torch.float64)
    rollout = torch.tensor([math.log(0.25), math.log(0.25), math.log(0.5)], dtype=torch.float64)
    return rollout, old, torch.ones(3), torch.tensor([0, 0, 1])


def test_metrics_by_hand():
    rollout, old, mask, seg = _hand_inputs()
    m = mismatch_metrics(rollout, old, mask, seg, 2, kl_type="k3", is_level="sequence", is_mode="mask", is_high=3.0)
    assert set(m) == set(METRICS)
    want = {
        # verl debug: |p_old − p_roll| = .25, 0, 0
        "training/rollout_probs_diff_max": 0.25, "training/rollout_probs_diff_mean": 0.25 / 3,
        "training/rollout_probs_diff_std": math.sqrt(1 / 48),
        # verl off-policy: log ratio old − rollout = ln2, 0, 0
        "rollout_corr/kl": -LN2 / 3, "rollout_corr/k3_kl": (1 - LN2) / 3,
        "rollout_corr/training_ppl": (2 ** 1.5 + 2) / 2, "rollout_corr/training_log_ppl": (1.5 * LN2 + LN2) / 2,
        "rollout_corr/rollout_ppl": (4 + 2) / 2, "rollout_corr/rollout_log_ppl": (2 * LN2 + LN2) / 2,
        "rollout_corr/log_ppl_diff": -0.25 * LN2, "rollout_corr/log_ppl_abs_diff": 0.25 * LN2,
        "rollout_corr/log_ppl_diff_max": 0.0, "rollout_corr/log_ppl_diff_min": -0.5 * LN2,
        "rollout_corr/ppl_ratio": (2 ** -0.5 + 1) / 2, "rollout_corr/chi2_token": (4 + 1 + 1) / 3 - 1,
        "rollout_corr/chi2_seq": (4 + 1) / 2 - 1,
        # NeMo-RL: exp(|Δ|) = 2, 1, 1; k3 of (prev − gen) = ln2 and of (gen − prev) = −ln2
        "token_mult_prob_error": 4 / 3, "gen_kl_error": (1 - LN2) / 3, "policy_kl_error": (LN2 - 0.5) / 3,
        # TRL sequence_mask, cap 3: sequence ratios 2 and 1
        "sampling/sampling_logp_difference/mean": LN2 / 3, "sampling/sampling_logp_difference/max": LN2,
        "sampling/importance_sampling_ratio/min": 1.0, "sampling/importance_sampling_ratio/mean": 1.5,
        "sampling/importance_sampling_ratio/max": 2.0,
    }
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=1e-7, abs=1e-12), k


def test_trl_ratio_statistics_by_mode():
    rollout, old, mask, seg = _hand_inputs()
    masked = mismatch_metrics(rollout, old, mask, seg, 2, is_level="sequence", is_mode="mask", is_high=1.5)
    assert [masked[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")] == [0.0, 0.5, 1.0]
    truncated = mismatch_metrics(rollout, old, mask, seg, 2, is_level="token", is_mode="truncate", is_high=1.5)
    assert [truncated[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")] == \
        pytest.approx([1.0, (1.5 + 1 + 1) / 3, 1.5])
    # a non-loss token never counts
    partial = mismatch_metrics(rollout, old, torch.tensor([0.0, 1.0, 1.0]), seg, 2, is_level="token")
    assert partial["token_mult_prob_error"] == 1.0 and partial["training/rollout_probs_diff_max"] == 0.0


def _replay(cli, path, *flags):
    code, out, err = cli("replay", path, "--format", "json", *flags)
    report = json.loads(out)
    stage = next(s for s in report["stages"] if s["stage"] == "logprob.mismatch")
    return code, report, stage


def test_oracle_one_ulp_is_a_divergence_under_bitwise(cli, tmp_path):
    data = make_logprobs(3, 6, 32, "one_bad", bad=(2, 5), ulps=1)
    path = produce_mismatch_bundle(tmp_path / "b", data)
    code, report, stage = _replay(cli, path)
    assert code == 0 and stage["status"] == "pass"  # without the oracle the stage reports and passes
    assert stage["mismatch"]["rollout_vs_old"]["count"] == 1
    code, report, stage = _replay(cli, path, "--bitwise")
    assert code == 1 and report["first_divergent_stage"] == "logprob.mismatch"
    ro = stage["mismatch"]["rollout_vs_old"]
    assert (ro["count"], ro["max_ulp"], ro["first_sample"], ro["first_token"]) == (1, 1.0, "s-2", 5)
    assert ro["compared"] == int(data["mask"].sum())
    first = report["first_divergence"]
    assert (first["sample_id"], first["token_offset"], first["field"]) == ("s-2", 5, "rollout_log_probs")
    assert stage["reason"].startswith("true on-policy: 1 loss token(s) where rollout_log_probs ≠ old_log_probs "
                                      "(tolerance 0), max 1 ulp, max |Δ| ")
    assert stage["reason"].endswith("first at sample s-2 token 5")
    code, out, err = cli("replay", path, "--bitwise")
    assert code == 1 and "[   fail] logprob.mismatch — true on-policy: 1 loss token(s)" in out


def test_true_on_policy_config_is_the_oracle(cli, tmp_path):
    data = make_logprobs(4, 5, 24, "one_bad", bad=(1, 0), ulps=3)
    path = produce_mismatch_bundle(tmp_path / "b", data, config=RecomputeConfig(true_on_policy=True))
    code, report, stage = _replay(cli, path)
    assert code == 1
    ro = stage["mismatch"]["rollout_vs_old"]
    assert (ro["count"], ro["max_ulp"], ro["first_sample"], ro["first_token"]) == (1, 3.0, "s-1", 0)
    assert stage["mismatch"]["bitwise"] is True
    exact = produce_mismatch_bundle(tmp_path / "e", make_logprobs(4, 5, 24, "exact"),
                                    config=RecomputeConfig(true_on_policy=True))
    code, report, stage = _replay(cli, exact)
    assert code == 0 and stage["status"] == "pass" and stage["mismatch"]["rollout_vs_old"]["count"] == 0


@pytest.mark.parametrize("kind,hypothesis,detail", [
    ("fp8_lattice", "quantization_lattice", "constant 0.125 grid"),
    ("flat", "flat_offset", "rollout = old +0.271"),
    ("first_token", "first_token", "first generated token"),
    ("bf16", "bf16_rollout", "rounded to bfloat16"),
])
def test_oracle_explanations(cli, tmp_path, kind, hypothesis, detail):
    data = make_logprobs(7, 8, 40, kind)
    path = produce_mismatch_bundle(tmp_path / kind, data)
    code, report, stage = _replay(cli, path, "--bitwise")
    assert code == 1
    found = {e["hypothesis"]: e for e in report["explanations"]}
    assert list(found)[0] == hypothesis, report["explanations"]
    assert detail in found[hypothesis]["detail"]
    assert found[hypothesis]["matched"] == found[hypothesis]["of"] == stage["mismatch"]["rollout_vs_old"]["count"]


def test_one_bad_token_has_no_explanation(cli, tmp_path):
    path = produce_mismatch_bundle(tmp_path / "b", make_logprobs(3, 6, 32, "one_bad", bad=(2, 5), ulps=1))
    code, report, stage = _replay(cli, path, "--bitwise")
    # one token: neither a lattice (one multiple), nor the first token, nor bf16; a "flat offset" of one value
    # is all there is
    assert [e["hypothesis"] for e in report["explanations"]] == ["flat_offset"]


def test_old_vs_current_is_reported(cli, tmp_path):
    data = make_logprobs(5, 4, 16, "exact")
    current = data["old"].copy()
    current[data["offsets"][3] + 1] = np.nextafter(current[data["offsets"][3] + 1], np.float32(0), dtype=np.float32)
    data["mask"][data["offsets"][3] + 1] = 1
    path = produce_mismatch_bundle(tmp_path / "b", data, log_probs=current)
    code, report, stage = _replay(cli, path)
    oc = stage["mismatch"]["old_vs_current"]
    assert (code, oc["count"], oc["max_ulp"], oc["first_sample"], oc["first_token"]) == (0, 1, 1.0, "s-3", 1)


def test_recorded_metric_compared_and_named(cli, tmp_path):
    data = make_logprobs(6, 4, 16, "flat")
    m = mismatch_metrics(torch.from_numpy(data["rollout"]), torch.from_numpy(data["old"]),
                         torch.from_numpy(data["mask"]), torch.repeat_interleave(torch.arange(4),
                                                                                  torch.from_numpy(data["lengths"])), 4)
    good = produce_mismatch_bundle(tmp_path / "g", data, expected={"token_mult_prob_error": m["token_mult_prob_error"],
                                                                   "vendor/other": 1.0})
    code, report, stage = _replay(cli, good)
    assert code == 0 and stage["mismatch"]["unknown_metrics"] == ["vendor/other"]
    assert stage["reason"].endswith("; 1 recorded metric(s) compared")
    bad = produce_mismatch_bundle(tmp_path / "b", data, expected={"token_mult_prob_error": m["token_mult_prob_error"]
                                                                  + 1e-3})
    code, report, stage = _replay(cli, bad)
    assert code == 1 and stage["reason"].startswith("mismatch metric(s) differ: token_mult_prob_error")


def test_async_lints(cli, tmp_path):
    data = make_logprobs(8, 4, 16, "exact")
    versions = np.full(int(data["lengths"].sum()), 5)
    o, n = int(data["offsets"][1]), int(data["lengths"][1])
    versions[o:o + n] = 3
    stale_loss = int(data["mask"][o:o + n].sum())
    path = produce_mismatch_bundle(tmp_path / "b", data, policy_versions=versions,
                                   config=RecomputeConfig(policy_version=5, max_policy_lag=1))
    code, report, stage = _replay(cli, path)
    kinds = {h["kind"]: h for h in report["hazards"]}
    assert code == 0 and set(kinds) == {"policy_lag", "stale_anchor"}
    assert kinds["policy_lag"]["message"] == (
        f"{stale_loss} loss token(s) sampled more than max_policy_lag=1 version(s) behind the trainer's "
        f"policy_version=5 (max lag 2); first at sample s-1 token 0")
    assert kinds["policy_lag"]["sample_id"] == "s-1"
    corrected = produce_mismatch_bundle(tmp_path / "c", data, policy_versions=versions,
                                        config=RecomputeConfig(policy_version=5, max_policy_lag=2, is_level="token"))
    code, report, stage = _replay(cli, corrected)
    assert [h["kind"] for h in report["hazards"] if h["stage"] == "logprob.mismatch"] == []


def test_a_recorded_metric_that_is_not_a_number_is_one_line(cli, tmp_path):
    path = produce_mismatch_bundle(tmp_path / "b", make_logprobs(2, 3, 8, "flat"),
                                   expected={"rollout_corr/k3_kl": [0.1, 0.2]})
    code, report, stage = _replay(cli, path)
    assert code == 1 and stage["reason"] == ("expected.json $.logprob.mismatch.rollout_corr/k3_kl: expected a number "
                                             "or null, got list")


def test_bitwise_is_recorded_in_the_report_and_the_debugger_judges_alike(tmp_path):
    from replay_lib.bundle import open_bundle
    from replay_lib.judge.error_model import Rules
    from replay_lib.run.runner import replay_run
    from replay_tui.model import build_model, rules_of

    path = produce_mismatch_bundle(tmp_path / "b", make_logprobs(3, 6, 32, "one_bad", bad=(2, 5), ulps=1))
    bundles = open_bundle(path)
    report, contexts = replay_run(bundles, rules=Rules(bitwise=True))
    assert report.bitwise is True and rules_of(report).bitwise
    plain, _ = replay_run(bundles)
    assert "bitwise" not in json.loads(__import__("msgspec").json.encode(plain))  # written only when on
    shard = build_model(bundles, report, contexts=contexts).shards[0]
    assert shard.ensure("rollout_log_probs")
    bad = shard.bad["rollout_log_probs"].nonzero().reshape(-1).tolist()
    assert bad == [int(shard.ctx.offsets[2]) + 5]


def test_scan_and_check_take_bitwise(cli, tmp_path):
    from replay_tui.__main__ import main as tui_main

    root = tmp_path / "run"
    root.mkdir()
    path = produce_mismatch_bundle(root / "step-1-0", make_logprobs(3, 6, 32, "one_bad", bad=(2, 5), ulps=1))
    code, out, err = cli("scan", root, "--jobs", "1")
    assert code == 0, out + err
    code, out, err = cli("scan", root, "--jobs", "1", "--bitwise")
    assert code == 1 and "logprob.mismatch" in out, out + err
    assert tui_main([str(path), "--check"]) == 0
    assert tui_main([str(path), "--check", "--bitwise"]) == 1


def test_cohort_summary_sums_counts_and_keeps_the_first_ranks_first():
    from replay_lib.judge.report import StageReport
    from replay_lib.stages.mismatch import merge_summaries

    a = {"rollout_vs_old": {"compared": 10, "count": 0, "max_abs_diff": 0.0, "max_ulp": 0.0}, "bitwise": True,
         "metrics": {"token_mult_prob_error": 1.0}}
    b = {"rollout_vs_old": {"compared": 7, "count": 2, "max_abs_diff": 0.5, "max_ulp": 9.0, "first_sample": "r1-s-3",
                            "first_token": 4}, "bitwise": True, "metrics": {"token_mult_prob_error": 1.2}}
    merged = merge_summaries([StageReport(stage="logprob.mismatch", status="pass", mismatch=a),
                              StageReport(stage="logprob.mismatch", status="fail", mismatch=b)])
    assert merged == {"rollout_vs_old": {"compared": 17, "count": 2, "max_abs_diff": 0.5, "max_ulp": 9.0,
                                         "first_sample": "r1-s-3", "first_token": 4}, "bitwise": True}
    assert merge_summaries([StageReport(stage="sample", status="pass")]) is None
