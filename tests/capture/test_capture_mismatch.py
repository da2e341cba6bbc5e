"""Capture records the engine's log-probs (``rollout_log_probs``) and the sampling policy versions
(``policy_versions``) on rollout and step bundles, and those bundles run stage logprob.mismatch (SPEC §4.4)."""

from __future__ import annotations

import torch

from capture import CaptureConfig, ReplayCapture
from replay_lib.bundle import BundleReader
from replay_lib.bundle.schema import RecomputeConfig
from replay_lib.run.runner import replay

DEADLOCK_GUARD_S = 60.0
CFG = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=1, policy_version=7, max_policy_lag=1)
OLD = [-1.0, -2.0, -0.5, -0.25, -3.0]
ROLLOUT = [-1.0, -2.0, -0.5, -0.375, -3.0]  # one token 0.125 off (sample s-1, token 0)


def test_rollout_and_step_bundles_carry_rollout_log_probs_and_versions(tmp_path):
    cap = ReplayCapture(CaptureConfig(enabled=True, directory=tmp_path), CFG, register_atexit=False)
    common = dict(sample_ids=["s-0", "s-1"], group_index=[0, 1], response_lengths=[3, 2], total_lengths=[5, 4],
                  loss_mask=torch.ones(5))
    assert cap.capture_rollout(2, raw_rewards=[1.0, 0.0], rewards=[0.0, 0.0], old_log_probs=torch.tensor(OLD),
                               kl=torch.zeros(5), advantages=torch.zeros(5), rollout_log_probs=torch.tensor(ROLLOUT),
                               policy_versions=torch.tensor([7, 7, 7, 5, 5]), **common)
    step = cap.begin_step(2, 0)
    assert step.add_micro_batch(log_probs=torch.tensor(OLD), old_log_probs=torch.tensor(OLD),
                                advantages=torch.zeros(5), rollout_log_probs=torch.tensor(ROLLOUT),
                                policy_versions=torch.tensor([7, 7, 7, 5, 5]), loss_fields={"loss": torch.tensor(0.0)},
                                **common)
    step.finish()
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    for name in ("rollout-2", "step-2-0"):
        reader = BundleReader(tmp_path / name)
        assert reader.payload("rollout_log_probs").tolist() == ROLLOUT
        assert reader.payload("policy_versions").tolist() == [7, 7, 7, 5, 5]
        report = replay(tmp_path / name)
        stage = report.stage("logprob.mismatch")
        assert stage is not None and stage.status == "pass", (name, stage)
        ro = stage.mismatch["rollout_vs_old"]
        assert (ro["count"], ro["max_abs_diff"], ro["first_sample"], ro["first_token"]) == (1, 0.125, "s-1", 0)
        assert [h.kind for h in report.hazards if h.stage == "logprob.mismatch"] == ["policy_lag", "stale_anchor"]
