"""Sample-support channels through the capture hooks: what the bundles hold, and what the replay makes of it.

The fixture is small enough to derive by hand. Vocabulary 8, K = 2 support slots, ln 3 written ``L3``:

    sample  token  support ids  member logits  sampled  logp_S (over the support)
    s-0     0      [1, 4]       [0, L3]        4        ln(3/4) = −0.2876821
    s-0     1      [4, 1]       [L3, 0]        1        ln(1/4) = −1.3862944
    s-0     2      [7, 0]       [2, 2]         0        ln(1/2) = −0.6931472
    s-1     0      [3, 2]       [1, 1]         3        ln(1/2)
    s-1     1      [−1, −1]     [0, 0]         7        none: the appended EOS, full_log_probs = −2.0
    s-2     0      [5, 6]       [0, 0]         5        ln(1/2)
    s-2     1      [6, −1]      [5, 0]         6        ln(1) = 0 (a single member)

Micro-batch mb-0000 holds s-0 and s-1, mb-0001 holds s-2. Advantages are 0 and old = logp, so the loss
of the step is exactly 0 and ``loss.policy`` passes whatever the log-probs are.
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from capture import SUPPORT_CHANNELS, CaptureConfig, ReplayCapture
from replay_lib.bundle import BundleReader
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import RecomputeConfig, StageCapability

DEADLOCK_GUARD_S = 60.0
L3 = math.log(3.0)
HALF = math.log(0.5)
CFG = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=1, grpo_std_normalization=False,
                      kl_loss_type="k1", kl_coef=0.0, eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.0,
                      vocab_size=8, num_experts=4)

MB = [  # (sample ids, response lengths, ids, logits, sampled, log-probs, full log-probs, routed experts)
    (["s-0", "s-1"], [3, 2],
     [[1, 4], [4, 1], [7, 0], [3, 2], [-1, -1]],
     [[0.0, L3], [L3, 0.0], [2.0, 2.0], [1.0, 1.0], [0.0, 0.0]],
     [4, 1, 0, 3, 7],
     [math.log(0.75), math.log(0.25), HALF, HALF, -2.0],
     [-1.0, -2.5, -1.5, -1.25, -2.0],
     [[[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]], [[0, 2]]]),
    (["s-2"], [2],
     [[5, 6], [6, -1]],
     [[0.0, 0.0], [5.0, 0.0]],
     [5, 6],
     [HALF, 0.0],
     [-1.5, -0.75],
     [[[1, 3]], [[2, 0]]]),
]


def _capture(directory, config=CFG) -> ReplayCapture:
    return ReplayCapture(CaptureConfig(enabled=True, directory=directory), config, register_atexit=False)


def _channels(ids, logits, sampled, full, routes, **extra):
    out = {
        "support_ids": torch.tensor(ids, dtype=torch.int64),  # written as int32
        "support_logits": torch.tensor(logits, dtype=torch.bfloat16 if extra.pop("bf16", False) else torch.float32),
        "sampled_token_ids": torch.tensor(sampled, dtype=torch.int64),
        "full_log_probs": torch.tensor(full),
        "routed_experts": torch.tensor(routes, dtype=torch.int64),
    }
    out.update(extra)
    return out


def _add(step, mb, log_probs=None, drop=(), **channel_kw) -> bool:
    sample_ids, lengths, ids, logits, sampled, logp, full, routes = mb
    n = sum(lengths)
    logp = torch.tensor(logp if log_probs is None else log_probs)
    channels = _channels(ids, logits, sampled, full, routes, **channel_kw)
    for name in drop:
        channels.pop(name)
    return step.add_micro_batch(
        sample_ids=sample_ids, group_index=[int(s[2:]) for s in sample_ids], response_lengths=lengths,
        total_lengths=[x + 4 for x in lengths], loss_mask=torch.ones(n), log_probs=logp, old_log_probs=logp.clone(),
        advantages=torch.zeros(n), side_channels=channels,
    )


def _write_step(directory, first_log_probs=None, drop=()):
    cap = _capture(directory)
    step = cap.begin_step(2, 1, support_scored=("log_probs",))
    assert _add(step, MB[0], log_probs=first_log_probs, drop=drop)
    assert _add(step, MB[1], drop=drop)
    assert step.finish(loss=torch.tensor(0.0))
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    assert (cap.stats.written, cap.stats.errors) == (1, 0)
    return directory / "step-2-1"


def test_step_bundle_carries_the_support_rows_and_replays_logprob_support_clean(tmp_path):
    path = _write_step(tmp_path)
    reader = BundleReader(path)
    contract = reader.manifest.stage_contracts["logprob.support"]
    assert (contract.capability, contract.version, contract.implementation) == (
        StageCapability.RECOMPUTE, "v1", "reuse")
    assert "logprob.support" in reader.manifest.comparison_policy.tolerances
    assert reader.index.config.support_scored == ["log_probs"]
    assert reader.index.config == msgspec.structs.replace(CFG, support_scored=["log_probs"])
    # the micro-batches' rows, concatenated in data-iterator order, in the format's dtypes
    ids = reader.payload("support_ids")
    assert ids.dtype == torch.int32
    assert ids.tolist() == [[1, 4], [4, 1], [7, 0], [3, 2], [-1, -1], [5, 6], [6, -1]]
    assert reader.payload("support_logits").dtype == torch.float32
    assert reader.payload("sampled_token_ids").tolist() == [4, 1, 0, 3, 7, 5, 6]
    assert reader.payload("full_log_probs").tolist() == [-1.0, -2.5, -1.5, -1.25, -2.0, -1.5, -0.75]
    assert list(reader.payload("routed_experts").shape) == [7, 1, 2]
    assert sorted(reader.payload_names) == sorted(
        ["log_probs", "old_log_probs", "advantages", *[c for c in SUPPORT_CHANNELS if c != "cp_shard"]])
    report = replay(path)
    assert report.passed and report.exit_code == 0
    assert [(s.stage, s.status) for s in report.stages if s.status != "skipped"] == [
        ("sample", "pass"), ("logprob.support", "pass"), ("loss.policy", "pass")]
    support = next(s for s in report.stages if s.stage == "logprob.support")
    assert support.reason == ("6 loss-bearing token(s) rescored over the support against log_probs; "
                              "1 unsupported last token(s) use full_log_probs")
    assert support.max_abs_error <= 1e-6


def test_log_probs_scored_over_the_full_vocabulary_are_caught_at_the_token(tmp_path):
    # s-0's first token as a full-vocabulary scorer sees it: the two members hold half the softmax mass,
    # so ln(3/4) + ln(1/2) = ln(3/8) instead of ln(3/4).
    first = [math.log(0.375), math.log(0.25), HALF, HALF, -2.0]
    report = replay(_write_step(tmp_path, first_log_probs=first))
    assert report.exit_code == 1
    assert report.first_divergent_stage == "logprob.support"
    div = report.first_divergence
    assert (div.stage, div.sample_id, div.field, div.token_offset) == ("logprob.support", "s-0", "support_logprob", 0)
    assert div.expected == pytest.approx(math.log(0.375), abs=1e-6)
    assert div.actual == pytest.approx(math.log(0.75), abs=1e-6)
    assert div.abs_error == pytest.approx(math.log(2.0), abs=1e-6)
    support = next(s for s in report.stages if s.stage == "logprob.support")
    assert support.mismatches == 1
    assert next(s for s in report.stages if s.stage == "loss.policy").status == "pass"


def test_support_ids_without_member_logits_declare_inspect_only(tmp_path):
    path = _write_step(tmp_path, drop=("support_logits",))
    reader = BundleReader(path)
    assert reader.manifest.stage_contracts["logprob.support"].capability == StageCapability.INSPECT_ONLY
    assert not reader.has_payload("support_logits")
    report = replay(path)
    assert report.passed
    support = next(s for s in report.stages if s.stage == "logprob.support")
    assert (support.status, support.reason) == ("skipped", "capability inspect-only")


def test_bf16_member_logits_are_written_as_float32(tmp_path):
    cap = _capture(tmp_path)
    step = cap.begin_step(0, 0, support_scored=("log_probs",))
    assert _add(step, MB[1], bf16=True)
    assert step.finish(loss=torch.tensor(0.0))
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    logits = BundleReader(tmp_path / "step-0-0").payload("support_logits")
    assert logits.dtype == torch.float32 and logits.tolist() == [[0.0, 0.0], [5.0, 0.0]]  # exact in bf16
    assert replay(tmp_path / "step-0-0").passed


def _rollout(cap, support_scored=None, **overrides):
    sample_ids, lengths, ids, logits, sampled, logp, full, routes = MB[0]
    n = sum(lengths)
    kwargs = dict(
        sample_ids=sample_ids, group_index=[0, 1], response_lengths=lengths, total_lengths=[7, 6],
        loss_mask=torch.ones(n), raw_rewards=[1.0, 0.0], rewards=[0.0, 0.0], old_log_probs=torch.tensor(logp),
        kl=torch.zeros(n), advantages=torch.zeros(n),
        side_channels=_channels(ids, logits, sampled, full, routes, cp_shard=torch.zeros(n, dtype=torch.int8)),
        support_scored=support_scored,
    )
    kwargs.update(overrides)
    return cap.capture_rollout(4, **kwargs)


def test_rollout_bundle_declares_logprob_support_only_when_the_trainer_scored_over_it(tmp_path):
    cap = _capture(tmp_path / "scored")
    assert _rollout(cap, support_scored=["old_log_probs"])
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    reader = BundleReader(tmp_path / "scored" / "rollout-4")
    assert reader.index.config.support_scored == ["old_log_probs"]
    assert reader.payload("cp_shard").dtype == torch.int8  # integer channels keep their dtype
    report = replay(tmp_path / "scored" / "rollout-4")
    assert report.passed
    assert [s.stage for s in report.stages if s.status == "pass"] == [
        "sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate", "logprob.support"]

    cap = _capture(tmp_path / "plain")
    assert _rollout(cap)  # support rows recorded for inspection, log-probs not support-scored
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    reader = BundleReader(tmp_path / "plain" / "rollout-4")
    assert "logprob.support" not in reader.manifest.stage_contracts
    assert reader.index.config.support_scored is None
    assert reader.has_payload("support_logits")
    assert all(s.stage != "logprob.support" for s in replay(tmp_path / "plain" / "rollout-4").stages)


BAD_ROLLOUT = [
    (dict(side_channels={"logits": torch.zeros(5, 2)}), "rollout-4: unknown side channel 'logits' (expected one of"),
    (dict(side_channels={"support_ids": torch.zeros(4, 2, dtype=torch.int32)}),
     "rollout-4: side channel 'support_ids' has 4 row(s) for Σ response_length 5"),
    (dict(side_channels={"support_ids": torch.zeros(5, 2)}),
     "rollout-4: side channel 'support_ids' must hold integers, got torch.float32"),
    (dict(side_channels={"support_ids": torch.zeros(5, dtype=torch.int32)}),
     "rollout-4: side channel 'support_ids' must have 2 dimension(s), got shape [5]"),
    (dict(side_channels={"full_log_probs": torch.zeros(5, dtype=torch.int64)}),
     "rollout-4: side channel 'full_log_probs' must be floating point, got torch.int64"),
    (dict(side_channels={"support_ids": torch.zeros(5, 2, dtype=torch.int32), "support_logits": torch.zeros(5, 3)}),
     "rollout-4: support_logits shape [5, 3] != support_ids shape [5, 2]"),
    (dict(side_channels={"support_logits": torch.zeros(5, 2)}),
     "rollout-4: side channel 'support_logits' needs 'support_ids'"),
    (dict(support_scored=["log_probs"]),
     "rollout-4: support_scored entry 'log_probs' is not recorded in this bundle (it records old_log_probs)"),
    (dict(support_scored=["entropy"]),
     "rollout-4: support_scored entry 'entropy' is not one of log_probs, old_log_probs, ref_log_probs"),
    (dict(support_scored=[]), "rollout-4: support_scored names no recorded log-probs"),
    (dict(support_scored=["old_log_probs"], side_channels={"sampled_token_ids": torch.zeros(5, dtype=torch.int64)}),
     "rollout-4: support_scored needs the side channel(s) support_ids"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_ROLLOUT)
def test_malformed_rollout_side_channels_are_refused_before_anything_is_queued(tmp_path, overrides, message):
    cap = _capture(tmp_path)
    try:
        with pytest.raises(ValueError) as err:
            _rollout(cap, **overrides)
        assert str(err.value).startswith(message)
        assert cap.stats.submitted == 0
    finally:
        cap.close(timeout=DEADLOCK_GUARD_S)


def test_config_knobs_the_support_channels_need_are_required(tmp_path):
    cap = _capture(tmp_path, msgspec.structs.replace(CFG, vocab_size=None, num_experts=None))
    try:
        with pytest.raises(ValueError, match=r"^step-0-0: support_scored needs RecomputeConfig.vocab_size"):
            cap.begin_step(0, 0, support_scored=["log_probs"])
        with pytest.raises(ValueError,
                           match=r"^rollout-4: side channel 'routed_experts' needs RecomputeConfig.num_experts"):
            _rollout(cap)
        assert cap.stats.submitted == 0
    finally:
        cap.close(timeout=DEADLOCK_GUARD_S)


def test_every_micro_batch_of_a_step_gives_the_same_side_channels(tmp_path):
    cap = _capture(tmp_path)
    try:
        step = cap.begin_step(0, 1)
        assert _add(step, MB[0])
        first = ["full_log_probs", "routed_experts", "sampled_token_ids", "support_ids", "support_logits"]
        with pytest.raises(ValueError) as err:
            _add(step, MB[1], cp_shard=torch.zeros(2, dtype=torch.int64))
        assert str(err.value) == (f"step-0-1 mb-0001: side channels {sorted(['cp_shard', *first])} differ from the "
                                  f"step's first micro-batch {first}")
        assert cap.stats.submitted == 1
    finally:
        cap.close(timeout=DEADLOCK_GUARD_S)
