"""Fault injection, one test per stage: a clean synthetic bundle with exactly one value corrupted that only
that stage consumes, written through BundleWriter (so it verifies), must be reported as exactly that first
divergence — stage, sample id, token offset, expected and actual."""

from __future__ import annotations

import msgspec
import pytest
from replay_lib.bundle.schema import FORMAT_VERSION, UNPACKED_FORMAT_VERSION
from replay_lib.demo import synthetic_parts, write_bundle
from replay_lib.judge.error_model import Rules
from replay_lib.judge.report import report_to_text
from replay_lib.run.runner import replay

# seed 0, 8 samples in 2 groups of 4, lengths [4, 3, 0, 2, 1, 2, 6, 3] (s-2 has no response tokens);
# token offsets of the samples in the concatenated axis: [0, 4, 7, 7, 9, 10, 12, 18]
PARTS = dict(samples=8, tokens=6, seed=0, group_size=4, vary_lengths=True, kl_coef=0.05, kl_loss_type="low_var_kl",
             std_normalization=True, entropy_coef=0.01)
LENGTHS = [4, 3, 0, 2, 1, 2, 6, 3]
OFFSETS = [0, 4, 7, 7, 9, 10, 12, 18]


def clean_parts(format_version=FORMAT_VERSION):
    manifest, index, expected, payloads = synthetic_parts(**PARTS, format_version=format_version)
    assert [s.response_length for s in index.samples] == LENGTHS
    return manifest, index, {k: dict(v) for k, v in expected.items()}, {k: v.clone() for k, v in payloads.items()}


def replay_written(tmp_path, manifest, index, expected, payloads):
    path = write_bundle(tmp_path / "bundle", manifest, index, expected, payloads)
    return replay(path)


def failing(report) -> list[str]:
    return [s.stage for s in report.stages if s.status == "fail"]


def where(report) -> tuple:
    d = report.first_divergence
    return report.first_divergent_stage, d.stage, d.rank, d.sample_id, d.group_index, d.field, d.token_offset


def test_clean_bundle_passes_every_stage(tmp_path):
    report = replay_written(tmp_path, *clean_parts())
    assert report.passed, report_to_text(report)
    assert [s.stage for s in report.stages if s.status == "pass"] == [
        "sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate", "loss.policy"]
    assert report.stage("advantage.kl").compared == sum(LENGTHS) == 21


def test_fault_in_sample_loss_mask_length(tmp_path):
    # a mask of the wrong length is the older form's fault (the masks in index.json): the default form packs the
    # masks on the token axis and its writer refuses one that does not fit
    manifest, index, expected, payloads = clean_parts(UNPACKED_FORMAT_VERSION)
    samples = list(index.samples)
    samples[3] = msgspec.structs.replace(samples[3], loss_mask=samples[3].loss_mask + [1])
    with pytest.raises(ValueError, match=r"^\$\.samples\[3\]\.loss_mask: 3 values, response_length is 2$"):
        write_bundle(tmp_path / "packed", msgspec.structs.replace(manifest, format_version=FORMAT_VERSION),
                     msgspec.structs.replace(index, samples=samples), expected, payloads)
    assert not (tmp_path / "packed").exists()
    report = replay_written(tmp_path, manifest, msgspec.structs.replace(index, samples=samples), expected, payloads)
    assert where(report) == ("sample", "sample", None, "s-3", 0, "loss_mask_length", None)
    d = report.first_divergence
    assert (d.expected, d.actual, d.abs_error) == (2.0, 3.0, 1.0)
    assert d.message == "len(loss_mask)=3 != response_length=2"
    # no value stage upstream of the loss consumes the mask; the loss cannot build one and says why
    assert failing(report) == ["sample", "loss.policy"]
    assert report.stage("loss.policy").reason == "loss_mask lengths sum to 22, Σ response_length is 21"


def test_fault_in_expected_raw_reward(tmp_path):
    manifest, index, expected, payloads = clean_parts()
    raw = list(expected["reward.raw"]["raw_rewards"])
    assert raw[5] == 4.0
    raw[5] = 4.5
    expected["reward.raw"]["raw_rewards"] = raw
    report = replay_written(tmp_path, manifest, index, expected, payloads)
    assert failing(report) == ["reward.raw"]
    assert where(report) == ("reward.raw", "reward.raw", None, "s-5", 1, "raw_reward", None)
    d = report.first_divergence
    assert (d.expected, d.actual, d.abs_error) == (4.5, 4.0, 0.5)


def test_fault_in_expected_normalized_reward(tmp_path):
    manifest, index, expected, payloads = clean_parts()
    rewards = list(expected["reward.post_process"]["rewards"])
    clean = rewards[2]
    rewards[2] = clean + 0.25
    expected["reward.post_process"]["rewards"] = rewards
    report = replay_written(tmp_path, manifest, index, expected, payloads)
    # advantage.estimate consumes the recomputed rewards, so only reward.post_process fails
    assert failing(report) == ["reward.post_process"]
    assert where(report) == ("reward.post_process", "reward.post_process", None, "s-2", 0, "reward", None)
    d = report.first_divergence
    assert d.expected == clean + 0.25 and d.actual == pytest.approx(clean, abs=1e-6)
    assert report.stage("reward.post_process").mismatches == 1


def test_fault_in_kl_payload_token(tmp_path):
    manifest, index, expected, payloads = clean_parts()
    t = OFFSETS[6] + 4  # s-6, token 4
    clean = float(payloads["kl"][t])
    payloads["kl"][t] += 0.125
    report = replay_written(tmp_path, manifest, index, expected, payloads)
    assert failing(report) == ["advantage.kl"]
    assert where(report) == ("advantage.kl", "advantage.kl", None, "s-6", 1, "kl", 4)
    d = report.first_divergence
    assert d.actual == pytest.approx(clean, abs=1e-7)
    assert d.abs_error == pytest.approx(0.125, abs=1e-6)
    assert report.stage("advantage.kl").mismatches == 1
    assert "kl s-6@4: expected=" in report_to_text(report)


def test_fault_in_advantages_payload_token(tmp_path):
    manifest, index, expected, payloads = clean_parts()
    t = OFFSETS[1] + 2  # s-1, token 2
    clean = float(payloads["advantages"][t])
    payloads["advantages"][t] = clean - 1.0
    report = replay_written(tmp_path, manifest, index, expected, payloads)
    # teacher forcing: loss.policy consumes the recorded (corrupted) advantages and fails too; the first
    # divergence is still the stage whose record is wrong
    assert failing(report) == ["advantage.estimate", "loss.policy"]
    assert where(report) == ("advantage.estimate", "advantage.estimate", None, "s-1", 0, "advantage", 2)
    d = report.first_divergence
    assert (d.expected, d.actual) == (pytest.approx(clean - 1.0), pytest.approx(clean, abs=1e-6))
    # --chain: loss.policy consumes the recomputed advantages, so it passes
    chained = replay(tmp_path / "bundle", rules=Rules(chain=True))
    assert failing(chained) == ["advantage.estimate"] and chained.stage("loss.policy").status == "pass"


def test_fault_in_expected_loss(tmp_path):
    manifest, index, expected, payloads = clean_parts()
    clean = expected["loss.policy"]["ppo_kl"]
    expected["loss.policy"]["ppo_kl"] = clean + 0.01
    report = replay_written(tmp_path, manifest, index, expected, payloads)
    assert failing(report) == ["loss.policy"]
    assert where(report) == ("loss.policy", "loss.policy", None, None, None, "ppo_kl", None)
    assert report.stage("loss.policy").reason == "loss field mismatch: ppo_kl"
    assert report.first_divergence.abs_error == pytest.approx(0.01, abs=1e-6)


def test_earliest_stage_wins_when_two_stages_are_corrupted(tmp_path):
    manifest, index, expected, payloads = clean_parts()
    payloads["advantages"][OFFSETS[0]] += 1.0
    payloads["kl"][OFFSETS[7] + 2] += 1.0
    report = replay_written(tmp_path, manifest, index, expected, payloads)
    assert failing(report) == ["advantage.kl", "advantage.estimate", "loss.policy"]  # the loss reads the payload
    assert where(report) == ("advantage.kl", "advantage.kl", None, "s-7", 1, "kl", 2)
    chained = replay(tmp_path / "bundle", rules=Rules(chain=True))
    assert failing(chained) == ["advantage.kl", "advantage.estimate"]


def test_divergences_are_reported_in_token_order_within_a_stage(tmp_path):
    manifest, index, expected, payloads = clean_parts()
    for sample, offset in ((7, 1), (0, 3), (4, 0)):
        payloads["kl"][OFFSETS[sample] + offset] += 1.0
    report = replay_written(tmp_path, manifest, index, expected, payloads)
    kl = report.stage("advantage.kl")
    assert [(d.sample_id, d.token_offset) for d in kl.divergences] == [("s-0", 3), ("s-4", 0), ("s-7", 1)]
    assert kl.reason == "kl mismatch in 3 token(s) of 3 sample(s)"
    assert where(report)[3:] == ("s-0", 0, "kl", 3)


def test_tampered_payload_bytes_are_refused_before_any_stage(tmp_path):
    # the counterpart of the faults above: editing bytes after publication is an integrity error, not a
    # divergence (a checksum mismatch, exit 3)
    from replay_lib.errors import BundleError

    path = write_bundle(tmp_path / "bundle", *clean_parts())
    target = path / "payloads" / "kl.safetensors"
    data = bytearray(target.read_bytes())
    data[-30] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"kl\.safetensors: sha256 mismatch"):
        replay(path)


def test_fault_magnitude_below_tolerance_is_not_reported(tmp_path):
    manifest, index, expected, payloads = clean_parts()
    payloads["kl"][OFFSETS[6] + 4] += 5e-7  # < default atol 1e-6 (+ rtol·|e|)
    assert replay_written(tmp_path, manifest, index, expected, payloads).passed
