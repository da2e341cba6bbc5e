"""The capture hooks the TRL integration relies on, without TRL: a step's own config (the counts its loss
divided by), ``ref_log_probs`` in a step bundle, ``advantage.estimate`` declared on a step against the samples'
rewards, and a rollout's scorer rewards apart from the rewards that entered the normalization. Values derived by
hand; the bundles go through the real writer thread, reader and runner."""

from __future__ import annotations

import math

import pytest
import torch
from msgspec.structs import replace

from capture import CaptureConfig, ReplayCapture
from replay_lib.bundle import BundleReader
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import RecomputeConfig

# Two samples of one group, n = 2; lengths 2 and 3, every token in the loss.
LENGTHS = [2, 3]
MASK = [[1, 1], [1, 1, 1]]
# TRL-style dapo: a token mean over T = 5 recorded tokens.
CFG = RecomputeConfig(n_samples_per_prompt=2, grpo_std_normalization=True, grpo_std_eps=1e-4,
                      loss_agg_mode="token_mean", eps_clip=0.2, eps_clip_high=0.28)


def _capture(directory) -> ReplayCapture:
    return ReplayCapture(CaptureConfig(enabled=True, directory=directory), CFG, register_atexit=False)


def _step(capture, advantages, loss, config, ref=None):
    step = capture.begin_step(0, 0, advantage_estimate=True)
    zeros = torch.zeros(5)
    step.add_micro_batch(sample_ids=["s-0", "s-1"], group_index=[0, 0], response_lengths=LENGTHS,
                         total_lengths=[4, 5], loss_mask=MASK, log_probs=zeros, old_log_probs=zeros,
                         advantages=advantages, rewards=[1.0, -1.0], ref_log_probs=ref,
                         loss_fields={"loss": loss})
    assert step.finish(config=config)


def test_step_config_ref_log_probs_and_advantage_estimate(tmp_path):
    # ratio = exp(0 − 0) = 1 (never clipped): pg_t = −A_t; A = [1, 1, −1, −1, −1] (the rewards broadcast),
    # Σ pg·m = −1 − 1 + 1 + 1 + 1 = 1; token_mean over T = 5 → loss = 1/5 = 0.2
    capture = _capture(tmp_path)
    ref = torch.tensor([0.0, 0.1, -0.2, 0.3, 0.0])
    _step(capture, [1.0, 1.0, -1.0, -1.0, -1.0], 0.2, replace(CFG, loss_token_count=5), ref=ref)
    assert capture.close(timeout=30)
    reader = BundleReader(tmp_path / "step-0-0")
    assert reader.index.config.loss_token_count == 5  # the step's own config, not the capture's (None)
    assert torch.equal(reader.payload("ref_log_probs"), ref)
    assert [s.reward for s in reader.index.samples] == [1.0, -1.0]
    report = replay(tmp_path / "step-0-0")
    assert {s.stage: s.status for s in report.stages if s.status != "skipped"} == {
        "sample": "pass", "advantage.estimate": "pass", "loss.policy": "pass"}


def test_advantages_of_the_wrong_sample_fail_advantage_estimate_first(tmp_path):
    # the loss consumed s-1's advantage for s-0 and s-0's for s-1: A = [−1, −1, 1, 1, 1];
    # Σ pg·m = 1 + 1 − 1 − 1 − 1 = −1 → loss −1/5 = −0.2, which loss.policy recomputes from what was consumed
    capture = _capture(tmp_path)
    _step(capture, [-1.0, -1.0, 1.0, 1.0, 1.0], -0.2, replace(CFG, loss_token_count=5))
    assert capture.close(timeout=30)
    report = replay(tmp_path / "step-0-0")
    assert report.first_divergent_stage == "advantage.estimate"
    first = report.first_divergence
    assert (first.sample_id, first.token_offset, first.expected, first.actual) == ("s-0", 0, -1.0, 1.0)
    assert {s.stage: s.status for s in report.stages}["loss.policy"] == "pass"


def test_advantage_estimate_needs_every_samples_reward(tmp_path):
    capture = _capture(tmp_path)
    step = capture.begin_step(0, 0, advantage_estimate=True)
    step.add_micro_batch(sample_ids=["s-0"], group_index=[0], response_lengths=[1], total_lengths=[2],
                         loss_mask=[[1]], log_probs=[0.0], old_log_probs=[0.0], advantages=[0.0],
                         loss_fields={"loss": 0.0})
    step.finish(config=replace(CFG, loss_token_count=1))
    assert capture.close(timeout=30)
    assert capture.stats.errors == 1 and capture.stats.written == 0
    assert not (tmp_path / "step-0-0").exists()


def test_finish_refuses_a_config_that_is_not_one(tmp_path):
    capture = _capture(tmp_path)
    step = capture.begin_step(0, 0)
    with pytest.raises(TypeError, match=r"^step-0-0: finish\(\) config must be a RecomputeConfig, got dict$"):
        step.finish({"loss": 0.0}, config={"loss_token_count": 5})
    capture.close(timeout=30)


def test_scored_rewards_are_reward_raws_expected_values(tmp_path):
    # the scorer returned [3, 1]; what the trainer normalized was [1, −1] (batch-normalized upstream).
    # Group normalization of [1, −1]: mean 0, unbiased std √2 → ±1/(√2 + 1e-4) = ±0.70705…
    capture = _capture(tmp_path)
    g = 1 / (math.sqrt(2) + 1e-4)
    capture.capture_rollout(
        0, sample_ids=["s-0", "s-1"], group_index=[0, 0], response_lengths=LENGTHS, total_lengths=[4, 5],
        loss_mask=MASK, raw_rewards=[1.0, -1.0], scored_rewards=[3.0, 1.0], rewards=[g, -g],
        old_log_probs=torch.zeros(5), kl=torch.zeros(5), advantages=[g, g, -g, -g, -g],
        reward_terms={"rewards_per_func": [3.0, 1.0], "reward_weights": [1.0]},
        config=replace(CFG, loss_token_count=5))
    with pytest.raises(ValueError, match=r"^rollout-1: reward_terms may not be named 'raw_rewards'"):
        capture.capture_rollout(1, sample_ids=["s-0"], group_index=[0], response_lengths=[1], total_lengths=[1],
                                loss_mask=[[1]], raw_rewards=[0.0], rewards=[0.0], old_log_probs=[0.0], kl=[0.0],
                                advantages=[0.0], reward_terms={"raw_rewards": [0.0]})
    assert capture.close(timeout=30)
    reader = BundleReader(tmp_path / "rollout-0")
    assert reader.expected["reward.raw"] == {"raw_rewards": [3.0, 1.0], "rewards_per_func": [3.0, 1.0],
                                             "reward_weights": [1.0]}
    assert [s.raw_reward for s in reader.index.samples] == [1.0, -1.0]
    assert reader.index.config.loss_token_count == 5
    report = replay(tmp_path / "rollout-0")
    status = {s.stage: s.status for s in report.stages}
    assert report.first_divergent_stage == "reward.raw"
    assert (status["reward.post_process"], status["advantage.estimate"]) == ("pass", "pass")
    first = report.first_divergence
    assert (first.sample_id, first.expected, first.actual, first.abs_error) == ("s-0", 3.0, 1.0, 2.0)

