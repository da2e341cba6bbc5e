"""Format 2.0.0 (the original tool's second major) both ways (SPEC §2.2): its bundles, written field by field from
its documented schema (``tests/format2_original.py``), open in inspect/validate/replay/scan; per-token rewards in
either major; our writer, the converter and capture write it; non-finite values are written as Python's json
writes them (the original reads nothing else)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import msgspec
import pytest
import torch

from format2_original import BATCH_REWARDS, LENGTHS, write_v2_bundle
from replay_lib.bundle import BundleReader, BundleWriter, open_bundle
from replay_lib.bundle.schema import (BundleIndex, ComparisonPolicy, Identity, Manifest, ProducerInfo,
                                      RecomputeConfig, SampleRecord, StageId, stage_contracts)
from replay_lib.demo import write_cohort, write_pr65
from test_wire_compat import FIXED_REWARDS, write_original_bundle

ROLLOUT_STAGES_2 = [("sample", "skipped"), ("reward.raw", "skipped"), ("reward.post_process", "skipped"),
                    ("advantage.kl", "pass"), ("advantage.estimate", "pass"), ("loss.policy", "skipped"),
                    ("loss.value", "skipped")]


def _report(cli, *args):
    rc, out, err = cli("replay", *args, "--format", "json")
    return rc, json.loads(out) if out else None, err


# ------------------------------------------------------------------------------- 1. reading 2.0.0


def test_a_2_0_rollout_bundle_validates_and_replays_with_the_reward_stages_skipped(tmp_path, cli):
    b = write_v2_bundle(tmp_path / "v2")
    rc, out, err = cli("validate", b)
    assert (rc, err) == (0, "")
    assert out.splitlines()[0] == ("bundle v2-rollout — valid (format 2.0.0, rollout-level, rollout_id=120, "
                                   "4 sample(s), 12 token(s))")
    rc, report, err = _report(cli, b)
    assert (rc, err, report["passed"]) == (0, "", True)
    assert [(s["stage"], s["status"]) for s in report["stages"]] == ROLLOUT_STAGES_2
    reasons = {s["stage"]: s["reason"] for s in report["stages"]}
    assert reasons["reward.raw"] == reasons["reward.post_process"] == "not in format 2.0"
    rc, out, _ = cli("replay", b)
    assert "[skipped] reward.post_process — not in format 2.0" in out.splitlines()


def test_the_pr65_fixture_mapped_to_2_0_diverges_at_advantage_estimate(tmp_path, cli):
    """2.0 records each sample's post-processed reward (its semantic group's, [−1, 1, −1, 1]); the streamed trainer's
    advantages came from the batch-normalized rewards: with no reward stage, advantage.estimate is the first to see
    it. The same bug in 1.x (raw rewards and normalized rewards recorded) is pinned at reward.post_process."""
    b = write_v2_bundle(tmp_path / "v2", advantages_from=BATCH_REWARDS)
    rc, report, err = _report(cli, b)
    assert (rc, err) == (1, "")
    d = report["first_divergence"]
    assert report["first_divergent_stage"] == "advantage.estimate"
    assert (d["sample_id"], d["field"], d["expected"], d["actual"]) == ("s-0", "advantage", -5.5, -1.0)
    rc, out, _ = cli("replay", b)
    assert "[   fail] advantage.estimate — advantage mismatch in 12 token(s) of 4 sample(s)" in out.splitlines()
    one_x = write_original_bundle(tmp_path / "v1", rewards=BATCH_REWARDS)
    assert _report(cli, one_x)[1]["first_divergent_stage"] == "reward.post_process"


def test_a_2_0_step_bundle_replays_loss_policy(tmp_path, cli):
    b = write_v2_bundle(tmp_path / "step", kind="step")
    rc, report, err = _report(cli, b)
    assert (rc, err, report["passed"]) == (0, "", True)
    assert [(s["stage"], s["status"]) for s in report["stages"]] == [
        ("sample", "pass"), ("reward.raw", "skipped"), ("reward.post_process", "skipped"),
        ("advantage.kl", "skipped"), ("advantage.estimate", "skipped"), ("loss.policy", "pass"),
        ("loss.value", "skipped")]


def test_a_reward_stage_asked_for_by_name_in_a_2_0_bundle_is_refused(tmp_path, cli):
    b = write_v2_bundle(tmp_path / "v2")
    rc, out, err = cli("replay", b, "--stage", "reward.post_process")
    assert (rc, out) == (4, "")
    assert err == (f"trajectory-replay: error: stage reward.post_process is not in format 2.0 ({b / 'manifest.json'} "
                   f"is format 2.0.0: the recorded reward is advantage.estimate's input)\n")


def test_a_2_0_manifest_that_declares_a_reward_stage_is_invalid(tmp_path, cli):
    b = write_v2_bundle(tmp_path / "v2", stages=["reward.raw", "advantage.kl", "advantage.estimate"])
    rc, out, err = cli("validate", b)
    assert (rc, out) == (3, "")
    assert err == (f"trajectory-replay: error: {b / 'manifest.json'}: $.stage_contracts.reward.raw: not a stage of "
                   f"format 2.0 (its reward stages were removed: the recorded reward is advantage.estimate's input)\n")


def test_a_2_0_sample_without_the_reward_advantage_estimate_consumes_is_invalid(tmp_path, cli):
    b = write_v2_bundle(tmp_path / "v2", rewards=[-1.0, None, -1.0, 1.0])
    rc, out, err = cli("validate", b)
    assert (rc, out) == (3, "")
    assert err == (f"trajectory-replay: error: {b / 'index.json'}: $.samples[1].reward: null, but advantage.estimate "
                   f"(declared recompute) consumes it: format 2.0 records no other reward\n")


def test_scan_reads_2_0_bundles(tmp_path, cli):
    write_v2_bundle(tmp_path / "cap" / "rollout-120", advantages_from=BATCH_REWARDS)
    write_v2_bundle(tmp_path / "cap" / "step-120-0", kind="step")
    rc, out, err = cli("scan", tmp_path / "cap")
    assert rc == 1 and "Traceback" not in err
    assert "first bad step: rollout 120 (v2-rollout) — advantage.estimate" in out
    # the step's advantages are the rollout's recorded ones, linked: the step diverges from its rollout too
    assert "2 bundle(s) scanned: 2 diverged; link: 1 step(s) checked against their rollout bundle, 1 diverged" in out


def test_the_tui_model_opens_a_2_0_bundle(tmp_path):
    from replay_lib.run.runner import replay
    from replay_tui.model import build_model

    b = write_v2_bundle(tmp_path / "v2", advantages_from=BATCH_REWARDS)
    report = replay(b)
    assert report.first_divergent_stage == "advantage.estimate"
    model = build_model(open_bundle(b), report)
    assert "advantage" in model.fields


# ------------------------------------------------------------------------------- 2. per-token rewards


def _token_rewards():
    return [[0.25 * i + 0.125 * t for t in range(n)] for i, n in enumerate(LENGTHS)]


def test_per_token_rewards_are_the_advantages_token_by_token(tmp_path, cli):
    rewards = _token_rewards()
    flat = [x for r in rewards for x in r]
    b = write_v2_bundle(tmp_path / "ok", rewards=rewards, advantages_from=flat)
    rc, report, _ = _report(cli, b)
    assert (rc, report["passed"]) == (0, True)
    assert next(s for s in report["stages"] if s["stage"] == "advantage.estimate")["reason"] == \
        "12 token(s) compared (per-token rewards)"
    bad = list(flat)
    bad[6] += 1.0  # s-2, its 2nd token
    b = write_v2_bundle(tmp_path / "bad", rewards=rewards, advantages_from=bad)
    rc, report, _ = _report(cli, b)
    d = report["first_divergence"]
    assert (rc, d["sample_id"], d["token_offset"], d["expected"], d["actual"]) == (1, "s-2", 1, 1.625, 0.625)


def test_a_per_token_reward_of_the_wrong_length_is_invalid(tmp_path, cli):
    rewards = _token_rewards()
    rewards[1] = rewards[1][:1]
    b = write_v2_bundle(tmp_path / "v2", rewards=rewards)
    rc, out, err = cli("validate", b)
    assert (rc, out) == (3, "")
    assert err == (f"trajectory-replay: error: {b / 'index.json'}: $.samples[1].reward: 1 per-token value(s) for "
                   f"response_length 2 (a per-token reward has one value per response token)\n")


def test_a_nan_literal_in_a_per_token_reward_is_read_and_diverges(tmp_path, cli):
    rewards = _token_rewards()
    flat = [x for r in rewards for x in r]
    rewards[2][1] = math.nan
    b = write_v2_bundle(tmp_path / "v2", rewards=rewards, advantages_from=flat)
    assert b"      NaN,\n" in (b / "index.json").read_bytes()
    assert cli("validate", b)[0] == 0
    rc, report, err = _report(cli, b)
    d = report["first_divergence"]
    assert (rc, err, d["sample_id"], d["token_offset"], d["expected"], d["actual"]) == (1, "", "s-2", 1, 0.625, None)


def test_per_token_rewards_under_an_estimator_that_does_not_broadcast_are_refused(tmp_path, cli, bundle_tools):
    b = write_v2_bundle(tmp_path / "v2", rewards=_token_rewards())
    bundle_tools.edit_json(b, "index.json", lambda d: d["config"].update(advantage_estimator="reinforce_plus_plus"))
    rc, out, err = cli("replay", b)
    assert (rc, out) == (4, "")
    assert err == (f"trajectory-replay: error: {b / 'index.json'}: $.samples[0].reward: a per-token reward is "
                   f"replayed under a broadcast estimator without whitening only (grpo, as the original's format "
                   f"2.0), not advantage_estimator='reinforce_plus_plus'\n")


def test_reward_post_process_judges_a_1_x_per_token_reward(tmp_path, cli, bundle_tools):
    """Format 1.2: a sample's reward may be per-token; reward.post_process compares each token with the sample's
    recomputed normalized reward (what a broadcast estimator consumes token by token)."""
    def per_token(edit_sample=None):
        def edit(doc):
            for s, r in zip(doc["samples"], FIXED_REWARDS):
                s["reward"] = [r] * s["response_length"]
            if edit_sample:
                edit_sample(doc["samples"])
        return edit

    b = write_original_bundle(tmp_path / "ok")
    bundle_tools.edit_json(b, "index.json", per_token())
    rc, report, _ = _report(cli, b)
    assert (rc, report["passed"]) == (0, True)
    b = write_original_bundle(tmp_path / "bad")
    bundle_tools.edit_json(b, "index.json", per_token(lambda s: s[3]["reward"].__setitem__(2, 0.5)))
    rc, report, _ = _report(cli, b)
    d = report["first_divergence"]
    assert (rc, report["first_divergent_stage"], d["sample_id"], d["field"], d["token_offset"], d["expected"],
            d["actual"]) == (1, "reward.post_process", "s-3", "token_reward", 2, 0.5, 1.0)
    rc, out, _ = cli("replay", b)
    assert "[   fail] reward.post_process — per-token reward mismatch in 1 token(s) of 1 sample(s)" in out


# ------------------------------------------------------------------------------- 3. writing 2.0.0


def _parts(reward=FIXED_REWARDS, stages=("sample", "advantage.kl", "advantage.estimate")):
    n = len(LENGTHS)
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i // 2, response_length=LENGTHS[i],
                            total_length=LENGTHS[i] + 5, loss_mask=[1] * LENGTHS[i], reward=reward[i])
               for i in range(n)]
    index = BundleIndex(bundle_id="w2", identity=Identity(rollout_id=7, normalization_cohort_ids=[]),
                        samples=samples, config=RecomputeConfig(kl_loss_type="k3", kl_coef=0.1))
    manifest = Manifest(format_version="1.1.0", bundle_id="w2", producer=ProducerInfo(commit="c"),
                        stage_contracts=stage_contracts([StageId(s) for s in stages]), payloads={},
                        comparison_policy=ComparisonPolicy())
    return manifest, index


def _write(path, manifest, index, expected, reward_tokens=None, **kw):
    total = sum(LENGTHS)
    with BundleWriter(path, manifest, index, expected, **kw) as w:
        w.write_payload("old_log_probs", torch.full((total,), -0.5))
        w.write_payload("ref_log_probs", torch.full((total,), -0.75))
        w.write_payload("kl", torch.full((total,), math.exp(-0.25) - 1 + 0.25))
        adv = torch.repeat_interleave(torch.tensor(FIXED_REWARDS), torch.tensor(LENGTHS))
        w.write_payload("advantages", adv if reward_tokens is None else torch.tensor(reward_tokens))
        return w.finalize()


def _original_2_0_reads(path: Path) -> dict:
    """The original 2.0 reader's view (Relax schema.py @ 78973a59 manifest_from_dict / index_from_dict): the major
    must be 2, every key it indexes directly present, every stage id one of its enum's; Python's json."""
    manifest = json.loads((path / "manifest.json").read_text())
    index = json.loads((path / "index.json").read_text())
    assert manifest["format_version"].split(".")[0] == "2"
    assert set(manifest["stage_contracts"]) <= {"sample", "advantage.kl", "advantage.estimate", "loss.policy",
                                                "loss.value"}
    for contract in manifest["stage_contracts"].values():
        assert contract["version"] == "v2" and {"version", "capability"} <= set(contract)
    for s in index["samples"]:
        assert {"sample_id", "group_index", "response_length", "total_length", "loss_mask", "reward"} <= set(s)
        torch.as_tensor(s["reward"], dtype=torch.float32)  # its advantage.estimate's read of the reward
    return {"manifest": manifest, "index": index, "expected": json.loads((path / "expected.json").read_text())}


def test_the_writer_writes_2_0_0_that_the_original_reads(tmp_path, cli):
    manifest, index = _parts()
    b = _write(tmp_path / "w2", manifest, index, {}, format_version="2.0.0")
    doc = _original_2_0_reads(b)
    assert doc["manifest"]["format_version"] == "2.0.0"
    # only the top-level keys its validate knows (MANIFEST_KEYS, INDEX_KEYS of its schema.py): no unknown-field flag
    assert set(doc["manifest"]) == {"format_version", "bundle_id", "producer", "stage_contracts", "payloads",
                                    "comparison_policy", "redaction"}
    assert set(doc["index"]) == {"bundle_id", "identity", "samples", "config"}
    sample = doc["index"]["samples"][0]
    assert "raw_reward" not in sample and sample["reward"] == -1.0
    assert not {"n_samples_per_prompt", "grpo_std_normalization"} & set(doc["index"]["config"])
    assert "normalization_cohort_ids" not in doc["index"]["identity"]
    assert BundleReader(b).format_major == 2
    rc, report, _ = _report(cli, b)
    assert (rc, report["passed"]) == (0, True)


def test_the_writer_refuses_what_2_0_cannot_hold(tmp_path):
    manifest, index = _parts(stages=("sample", "reward.raw", "advantage.kl", "advantage.estimate"))
    with pytest.raises(ValueError) as exc:
        BundleWriter(tmp_path / "w2", manifest, index, {"reward.raw": {"raw_rewards": [1.0] * 4}},
                     format_version="2.0.0")
    assert str(exc.value) == ("format 2.0 cannot hold: stage reward.raw (recompute): not in format 2.0, dropped; "
                              "expected.json $.reward.raw.raw_rewards: not in format 2.0, dropped")
    assert not any(tmp_path.iterdir())


def test_non_finite_values_are_written_as_python_json_writes_them(tmp_path):
    manifest, index = _parts(reward=[-1.0, math.nan, math.inf, 1.0])
    index = msgspec.structs.replace(index, samples=[msgspec.structs.replace(s, raw_reward=-math.inf if i == 0 else 1.0)
                                                    for i, s in enumerate(index.samples)])
    b = _write(tmp_path / "w1", manifest, index, {"advantage.estimate": {"note": math.nan}})
    blob = (b / "index.json").read_bytes()
    assert b'"raw_reward": -Infinity' in blob and b'"reward": NaN' in blob and b'"reward": Infinity' in blob
    assert b'"note": NaN' in (b / "expected.json").read_bytes()
    back = json.loads(blob)  # the original's json.load
    assert math.isnan(back["samples"][1]["reward"]) and back["samples"][2]["reward"] == math.inf
    reader = BundleReader(b)
    assert math.isnan(reader.index.samples[1].reward) and reader.index.samples[0].raw_reward == -math.inf
    b2 = _write(tmp_path / "w2", manifest, msgspec.structs.replace(
        index, samples=[msgspec.structs.replace(s, raw_reward=None) for s in index.samples]), {},
        format_version="2.0.0")
    assert b'"reward": NaN' in (b2 / "index.json").read_bytes()
    _original_2_0_reads(b2)


def test_a_1_x_bundle_with_a_per_token_reward_is_written_as_1_2_0(tmp_path):
    manifest, index = _parts(reward=[[r] * n for r, n in zip(FIXED_REWARDS, LENGTHS)])
    b = _write(tmp_path / "w", manifest, index, {})
    assert json.loads((b / "manifest.json").read_text())["format_version"] == "1.2.0"
    manifest, index = _parts()
    b = _write(tmp_path / "s", manifest, index, {})
    assert json.loads((b / "manifest.json").read_text())["format_version"] == "1.1.0"


# ------------------------------------------------------------------------------- convert


def test_convert_pr65_to_2_0_names_what_is_dropped_and_verifies(tmp_path, cli):
    src = write_pr65(tmp_path / "pr65", buggy=True)
    rc, out, err = cli("convert", src, tmp_path / "v2", "--to", "2.0.0")
    assert (rc, err) == (0, "")
    assert out.splitlines() == [
        f"converted {src} (format 1.3.0) → {tmp_path / 'v2'} (format 2.0.0): bundle b-00001, 4 sample(s); verified",
        "note: index.json $.samples[].reward: expected.json $.reward.post_process.rewards (the normalized rewards "
        "advantage.estimate consumes)",
        "note: stage reward.raw (recompute): not in format 2.0, dropped",
        "note: stage reward.post_process (recompute): not in format 2.0, dropped",
        "note: expected.json $.reward.raw.raw_rewards: not in format 2.0, dropped",
        "note: expected.json $.reward.post_process.rewards: not in format 2.0, dropped",
        "note: index.json $.samples[].raw_reward (4 sample(s)): not in format 2.0, dropped",
        "note: index.json $.config.n_samples_per_prompt=2: not in format 2.0, dropped",
        "note: index.json $.config.grpo_std_normalization=False: not in format 2.0, dropped",
        "note: index.json $.identity.normalization_cohort_ids (1): not in format 2.0, dropped",
    ]
    doc = _original_2_0_reads(tmp_path / "v2")
    assert [s["reward"] for s in doc["index"]["samples"]] == [-5.5, -3.5, 3.5, 5.5]
    assert [e.name for e in tmp_path.iterdir() if e.name.startswith(".")] == []
    rc, report, _ = _report(cli, tmp_path / "v2")
    assert (rc, report["passed"]) == (0, True)  # the raw rewards that showed the bug are gone: said above

    rc, out, err = cli("convert", tmp_path / "v2", tmp_path / "back", "--to", "1.0.0")
    assert (rc, err) == (0, "")
    assert out.splitlines()[1:] == [
        "note: stages reward.raw, reward.post_process: declared recorded-only (format 2.0 records no raw reward to "
        "recompute them from; each sample's reward stays advantage.estimate's input)",
        "note: index.json $.config.n_samples_per_prompt, $.config.grpo_std_normalization: not in format 2.0, "
        "written at their defaults (1, False; only reward.post_process reads them, and it is recorded-only)"]
    reader = BundleReader(tmp_path / "back")
    assert reader.manifest.format_version == "1.0.0"
    assert reader.manifest.stage_contracts[StageId.REWARD_RAW].capability.value == "recorded-only"
    rc, report, _ = _report(cli, tmp_path / "back")
    assert (rc, report["passed"]) == (0, True)


def test_convert_a_cohort_and_the_refusals(tmp_path, cli):
    src = write_cohort(tmp_path / "co")
    rc, out, err = cli("convert", src, tmp_path / "co2", "--to", "2.0.0", "--format", "json")
    assert (rc, err) == (0, "")
    result = json.loads(out)
    assert (result["format_version"], result["ranks"]) == ("2.0.0", [0, 1])
    assert sorted(p.name for p in (tmp_path / "co2").iterdir()) == ["COMPLETE", "COMPLETE.0", "COMPLETE.1",
                                                                     "rank-0", "rank-1"]
    assert len(open_bundle(tmp_path / "co2").shards) == 2
    rc, out, err = cli("convert", src, tmp_path / "co2", "--to", "2.0.0")
    assert (rc, out, err) == (2, "", f"trajectory-replay: error: {tmp_path / 'co2'}: already exists; refusing to "
                                     f"overwrite\n")
    rc, out, err = cli("convert", tmp_path / "co2", tmp_path / "co3", "--to", "2.0.0")
    assert (rc, out, err) == (2, "", f"trajectory-replay: error: {tmp_path / 'co2'}: already format 2.0.0 (major 2); "
                                     f"nothing to convert\n")


def test_convert_to_2_0_without_a_post_processed_reward_is_refused_and_leaves_nothing(tmp_path, cli, bundle_tools):
    src = write_pr65(tmp_path / "pr65")  # valid (a null expected value is), but sample 2 has no reward 2.0 can hold
    bundle_tools.edit_json(src, "expected.json", lambda d: d["reward.post_process"]["rewards"].__setitem__(2, None))
    bundle_tools.edit_json(src, "index.json", lambda d: d["samples"][2].__setitem__("reward", None))
    assert cli("validate", src)[0] == 0
    rc, out, err = cli("convert", src, tmp_path / "v2", "--to", "2.0.0")
    assert (rc, out) == (4, "")
    assert err == (f"trajectory-replay: error: {src / 'index.json'}: $.samples[2].reward: null, and format 2.0 "
                   f"requires each sample's post-processed reward (sample 's-2'); it has no recorded post-processed "
                   f"reward (expected.json $.reward.post_process.rewards) either\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pr65"]


# ------------------------------------------------------------------------------- 4. inspect


def test_inspect_shows_only_what_a_2_0_bundle_records(tmp_path, cli):
    b = write_v2_bundle(tmp_path / "v2")
    rc, out, err = cli("inspect", b)
    assert (rc, err) == (0, "")
    config = next(x for x in out.splitlines() if x.strip().startswith("config"))
    n = len(RecomputeConfig.__struct_fields__)
    assert config == ("  config    advantage_estimator=grpo, kl_loss_type=k3, kl_coef=0.1, eps_clip=0.2, "
                      f"eps_clip_high=0.2, entropy_coef=0.0 ({n - 6} not recorded)")
    assert "n_samples_per_prompt" not in out and "normalization_cohort_ids" not in out
    assert "  stage     reward.post_process  not in format 2.0" in out.splitlines()
    rc, out, _ = cli("inspect", b, "--format", "json")
    info = json.loads(out)["bundles"][0]
    assert set(info["config"]) == {"advantage_estimator", "kl_loss_type", "kl_coef", "eps_clip", "eps_clip_high",
                                   "entropy_coef"}
    assert "normalization_cohort_ids" not in info["identity"]


def test_an_unknown_major_is_said_plainly(tmp_path, cli, bundle_tools):
    b = write_v2_bundle(tmp_path / "v3")
    bundle_tools.edit_json(b, "manifest.json", lambda d: d.__setitem__("format_version", "3.0.0"))
    rc, out, err = cli("inspect", b)
    assert (rc, err) == (0, "")
    assert ("problem: manifest.json: $.format_version '3.0.0': major version 3 is unknown to this reader (it reads "
            "1.x and 2.x); its stages, config and identity fields are not shown (what they mean is that format's)"
            ) in out.splitlines()
    assert not [x for x in out.splitlines() if x.startswith(("  config", "  stage", "  rank", "  weights"))]
    rc, out, err = cli("validate", b)
    assert (rc, out) == (3, "")
    assert err == (f"trajectory-replay: error: {b / 'manifest.json'}: $.format_version: unsupported major version "
                   f"'3.0.0' (this reader reads 1.x and 2.x)\n")


# ------------------------------------------------------------------------------- capture


def test_capture_format_variable():
    from capture.config import ENV_FORMAT, config_from_env

    base = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": "/tmp/x"}
    assert config_from_env(base).format_major == 1
    assert config_from_env({**base, ENV_FORMAT: "2"}).format_major == 2
    with pytest.raises(ValueError) as exc:
        config_from_env({**base, ENV_FORMAT: "3"})
    assert str(exc.value) == "RELAX_REPLAY_CAPTURE_FORMAT='3': expected 1 (format 1.x) or 2 (format 2.0.0)"


def test_capture_writes_2_0_bundles_that_replay_clean(tmp_path, cli, example_trainer):
    threads = torch.get_num_threads()
    try:
        result = example_trainer.run(
            ["--prompts-per-rollout", "2", "--n-samples", "4", "--consumer-batch", "3", "--steps-per-rollout", "1",
             "--micro-batch", "4", "--hidden", "16", "--embed", "8", "--quiet", "--rollouts", "1"],
            env={"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path / "cap"),
                 "RELAX_REPLAY_CAPTURE_FORMAT": "2"})
    finally:
        torch.set_num_threads(threads)
    assert result.capture_stats.errors == 0 and result.capture_flushed
    for name in ("rollout-0", "step-0-0"):
        doc = _original_2_0_reads(tmp_path / "cap" / name)
        assert not {"reward.raw", "reward.post_process"} & set(doc["expected"])
        assert doc["manifest"]["comparison_policy"]["exact_fields"] == []
        assert "raw_reward" not in doc["index"]["samples"][0]
    rc, out, _ = cli("scan", tmp_path / "cap")
    assert rc == 0 and "2 bundle(s) scanned: 2 pass" in out


def test_diff_compares_per_token_rewards_token_by_token(tmp_path, cli):
    rewards = _token_rewards()
    flat = [x for r in rewards for x in r]
    a = write_v2_bundle(tmp_path / "a", rewards=rewards, advantages_from=flat)
    changed = [list(r) for r in rewards]
    changed[2][1] = 7.0
    b = write_v2_bundle(tmp_path / "b", rewards=changed, advantages_from=flat)
    rc, out, err = cli("diff", a, b)
    assert (rc, err) == (1, "")
    assert out.splitlines()[1:3] == ["[   fail] reward — 1 of 12 value(s) differ (max abs_err 6.38)",
                                     "          reward s-2@1: A=0.625 B=7.0 abs_err=6.375"]


def test_the_tui_shows_a_per_token_reward_and_its_token_in_the_why_strip(tmp_path):
    from replay_lib.run.runner import replay
    from replay_tui.model import build_model
    from replay_tui.widgets.sample_tree import _short

    rewards = _token_rewards()
    flat = [x for r in rewards for x in r]
    flat[6] += 1.0
    b = write_v2_bundle(tmp_path / "v2", rewards=rewards, advantages_from=flat)
    report = replay(b)
    model = build_model(open_bundle(b), report)
    row = next(r for r in model.samples if r.sample_id == "s-2")
    assert row.reward == [0.5, 0.625, 0.75, 0.875] and _short(row.reward) == "4tok"
    inputs = model.element_inputs("advantage", "s-2", 1)
    assert inputs.formula == "A = the token's recorded reward = 0.625 (per-token rewards)"


def test_the_original_s_2_0_bundle_converts_to_1_0_0_its_1_x_reader_takes(tmp_path, cli):
    from test_wire_compat import original_reads

    src = write_v2_bundle(tmp_path / "v2", advantages_from=BATCH_REWARDS)
    rc, out, err = cli("convert", src, tmp_path / "v1", "--to", "1.0.0")
    assert (rc, err) == (0, "")
    manifest = original_reads(tmp_path / "v1")
    assert manifest.format_version == "1.0.0"
    assert {s: c.capability for s, c in manifest.stage_contracts.items()} == {
        "advantage.kl": "recompute", "advantage.estimate": "recompute", "loss.value": "unsupported",
        "reward.raw": "recorded-only", "reward.post_process": "recorded-only"}
    # the verdict survives the conversion: the same first divergence, at the same stage
    rc, report, _ = _report(cli, tmp_path / "v1")
    d = report["first_divergence"]
    assert (rc, report["first_divergent_stage"], d["sample_id"], d["expected"], d["actual"]) == (
        1, "advantage.estimate", "s-0", -5.5, -1.0)


def test_the_original_s_1_0_0_bundle_converts_to_2_0_0(tmp_path, cli):
    src = write_original_bundle(tmp_path / "v1", rewards=BATCH_REWARDS)
    rc, out, err = cli("convert", src, tmp_path / "v2", "--to", "2.0.0")
    assert (rc, err) == (0, "")
    doc = _original_2_0_reads(tmp_path / "v2")
    # 2.0 records the normalized rewards the trainer produced (its reward.post_process output) as each reward
    assert [s["reward"] for s in doc["index"]["samples"]] == BATCH_REWARDS
    assert doc["expected"] == {}


def test_the_tui_lists_the_token_reward_field_only_for_a_bundle_with_per_token_rewards(tmp_path, bundle_tools):
    from replay_lib.run.runner import replay
    from replay_tui.model import build_model

    b = write_original_bundle(tmp_path / "pt")
    bundle_tools.edit_json(b, "index.json", lambda d: [s.__setitem__("reward", [r] * s["response_length"])
                                                        for s, r in zip(d["samples"], FIXED_REWARDS)])
    bundle_tools.edit_json(b, "index.json", lambda d: d["samples"][3]["reward"].__setitem__(2, 0.5))
    model = build_model(open_bundle(b), replay(b))
    assert "token_reward" in model.fields
    diff = model.field_diff("token_reward", "s-3")
    assert (diff.expected, diff.actual) == ([1.0, 1.0, 0.5], [1.0, 1.0, 1.0])
    plain = write_original_bundle(tmp_path / "plain")
    model = build_model(open_bundle(plain), replay(plain))
    assert "token_reward" not in model.fields
    assert model.unavailable["token_reward"] == "no per-token reward recorded"


def test_convert_that_cannot_publish_is_one_line_and_leaves_nothing(tmp_path, cli, monkeypatch):
    import errno

    import replay_lib.run.convert as convert_module

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    src = write_v2_bundle(tmp_path / "v2")
    monkeypatch.setattr(convert_module.os, "rename", full)
    rc, out, err = cli("convert", src, tmp_path / "v1", "--to", "1.0.0")
    assert (rc, out) == (2, "")
    assert err == (f"trajectory-replay: error: {tmp_path / 'v1'}: cannot write the converted bundle: "
                   f"No space left on device\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2"]


def test_the_why_strip_of_a_per_token_reward_names_the_token_and_its_group(tmp_path, bundle_tools):
    from replay_lib.run.runner import replay
    from replay_tui.model import build_model

    b = write_original_bundle(tmp_path / "pt")
    bundle_tools.edit_json(b, "index.json", lambda d: [s.__setitem__("reward", [r] * s["response_length"])
                                                        for s, r in zip(d["samples"], FIXED_REWARDS)])
    bundle_tools.edit_json(b, "index.json", lambda d: d["samples"][3]["reward"].__setitem__(2, 0.5))
    model = build_model(open_bundle(b), replay(b))
    inputs = model.element_inputs("token_reward", "s-3", 2)
    group = model.element_inputs("reward", None, 3)  # the per-sample table's row of s-3
    assert (inputs.field, inputs.offset, inputs.items[0]) == ("token_reward", 2, ("token", "0.5"))
    assert inputs.items[1:] == group.items and inputs.members == group.members
    assert inputs.formula == "each token of a per-token reward = the sample's normalized reward: " + group.formula


def test_what_2_0_removed_is_ignored_with_a_warning_when_a_2_0_bundle_holds_it(tmp_path, cli, bundle_tools):
    b = write_v2_bundle(tmp_path / "v2", expected={"reward.raw": {"raw_rewards": [1.0, 3.0, 10.0, 12.0]}})
    bundle_tools.edit_json(b, "index.json", lambda d: [s.__setitem__("raw_reward", 9.0) for s in d["samples"]])
    rc, out, err = cli("validate", b)
    assert (rc, err) == (0, "")
    assert [x for x in out.splitlines() if x.startswith("warning")] == [
        f"warning: {b / 'index.json'}: $.samples[0].raw_reward: not a field of format 2.0 (ignored; 4 sample(s) "
        f"hold one)",
        f"warning: {b / 'expected.json'}: $.reward.raw: not a stage of format 2.0 (ignored)"]
    reader = BundleReader(b)
    assert [s.raw_reward for s in reader.index.samples] == [None] * 4 and "reward.raw" not in reader.expected
