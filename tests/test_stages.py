"""Stages end to end through the runner, on bundles written by the real BundleWriter and read back by the
verifying reader. Expected outputs are written by hand from the formulas in SPEC §4, not by the kernels."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from replay_lib.errors import BundleError
from replay_lib.demo import ALL_STAGES, ROLLOUT_STAGES, STEP_STAGES, contracts, producer, write_bundle, write_pr65
from replay_lib.judge.error_model import Rules
from replay_lib.judge.report import report_to_text
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import (
    FORMAT_VERSION,
    ActorStepId,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    Tolerance,
)

E05 = math.exp(0.5)
INV_SQRT2 = 1.0 / (math.sqrt(2.0) + 1e-6)


def write(
    path: Path,
    *,
    groups,
    lengths,
    raw,
    expected,
    payloads,
    masks=None,
    stages=ALL_STAGES,
    policy: ComparisonPolicy = ComparisonPolicy(),
    step_level: bool = True,
    **config,
) -> Path:
    """A bundle with samples s-0, s-1, … written by BundleWriter (payload lists become float32 tensors)."""
    masks = masks if masks is not None else [[1] * n for n in lengths]
    cfg = dict(advantage_estimator="grpo", n_samples_per_prompt=Counter(groups)[groups[0]],
               grpo_std_normalization=False, kl_loss_type="k1", kl_coef=0.0, eps_clip=0.2, eps_clip_high=0.2,
               entropy_coef=0.0)
    cfg.update(config)
    samples = [
        SampleRecord(sample_id=f"s-{i}", group_index=g, response_length=n, total_length=n + 4, loss_mask=m,
                     raw_reward=r, micro_batch_id="mb-0000")
        for i, (g, n, m, r) in enumerate(zip(groups, lengths, masks, raw))
    ]
    identity = Identity(actor_step_id=ActorStepId(rollout_id=3, step_id=1)) if step_level else Identity(rollout_id=3)
    index = BundleIndex(bundle_id=path.name, identity=identity, samples=samples, config=RecomputeConfig(**cfg))
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=path.name, producer=producer(),
                        stage_contracts=contracts(stages), payloads={}, comparison_policy=policy, redaction={})
    tensors = {k: v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float32) for k, v in payloads.items()}
    return write_bundle(path, manifest, index, expected, tensors)


def statuses(report) -> dict[str, str]:
    return {s.stage: s.status for s in report.stages}


def broadcast(values, lengths) -> list[float]:
    return [v for v, n in zip(values, lengths) for _ in range(n)]


PR65 = dict(groups=[0, 0, 1, 1], lengths=[3, 2, 4, 3], raw=[1.0, 3.0, 10.0, 12.0])


# ------------------------------------------------------------------------------------------ PR #65


def test_pr65_buggy_bundle_first_diverges_at_reward_post_process(tmp_path):
    report = replay(write_pr65(tmp_path / "b", buggy=True))
    assert not report.passed and report.exit_code == 1
    assert statuses(report) == {
        "sample": "pass", "reward.raw": "pass", "reward.post_process": "fail", "advantage.kl": "pass",
        "advantage.estimate": "pass", "loss.policy": "skipped", "loss.value": "skipped",
    }
    post = report.stage("reward.post_process")
    assert post.reason == "normalized reward mismatch in 4 sample(s)"
    assert post.mismatches == 4 and post.max_abs_error == 4.5
    assert [(d.sample_id, d.group_index, d.expected, d.actual, d.abs_error) for d in post.divergences] == [
        ("s-0", 0, -5.5, -1.0, 4.5), ("s-1", 0, -3.5, 1.0, 4.5), ("s-2", 1, 3.5, -1.0, 4.5), ("s-3", 1, 5.5, 1.0, 4.5),
    ]
    first = report.first_divergence
    assert report.first_divergent_stage == "reward.post_process"
    assert (first.stage, first.sample_id, first.group_index, first.field, first.token_offset) == (
        "reward.post_process", "s-0", 0, "reward", None)
    # teacher forcing: advantage.estimate is judged on the recorded (batch-normalized) rewards, which the
    # recorded advantages faithfully broadcast — only the wrong stage fails
    est = report.stage("advantage.estimate")
    assert (est.reason, est.mismatches) == ("12 token(s) compared", 0)
    assert report.mode == "per_stage"
    assert report.stage("loss.policy").reason == "not declared in manifest"
    assert report.stage("loss.value").reason == "capability unsupported"


def test_pr65_buggy_bundle_chained_fails_every_stage_after_the_wrong_one(tmp_path):
    report = replay(write_pr65(tmp_path / "b", buggy=True), rules=Rules(chain=True))
    assert report.mode == "chained" and report.first_divergent_stage == "reward.post_process"
    assert statuses(report)["advantage.estimate"] == "fail"
    # the correct pipeline broadcasts the group-normalized rewards: 3 + 2 + 4 + 3 tokens, each off by 4.5
    est = report.stage("advantage.estimate")
    assert est.reason == "advantage mismatch in 12 token(s) of 4 sample(s)"
    assert (est.mismatches, est.max_abs_error) == (12, 4.5)
    assert [(d.sample_id, d.token_offset, d.expected, d.actual) for d in est.divergences[:4]] == [
        ("s-0", 0, -5.5, -1.0), ("s-0", 1, -5.5, -1.0), ("s-0", 2, -5.5, -1.0), ("s-1", 0, -3.5, 1.0),
    ]


def test_pr65_fixed_bundle_passes(tmp_path):
    report = replay(write_pr65(tmp_path / "b", buggy=False))
    assert report.passed and report.first_divergence is None and report.first_divergent_stage is None
    assert [s.stage for s in report.stages if s.status == "pass"] == [s.value for s in ROLLOUT_STAGES]


def test_hand_written_rollout_expectations_replay_clean(tmp_path):
    # k3 with r = old − ref: r = [0, 0.5, −0.5, 0.25, …]; k3(r) = e^{−r} − 1 + r
    r = [0.0, 0.5, -0.5, 0.25, -0.25, 1.0, -1.0, 0.1, -0.1, 0.0, 2.0, -2.0]
    old = [-1.0 - 0.05 * i for i in range(12)]
    ref = [o - x for o, x in zip(old, r)]
    old32 = torch.tensor(old, dtype=torch.float32)
    ref32 = torch.tensor(ref, dtype=torch.float32)
    r32 = (old32.double() - ref32.double()).tolist()  # the stored (rounded) inputs' log ratio
    kl = [math.exp(-x) - 1 + x for x in r32]
    path = write(
        tmp_path / "b", **PR65, stages=ROLLOUT_STAGES, step_level=False, kl_coef=0.1, kl_loss_type="k3",
        expected={"reward.raw": {"raw_rewards": [1.0, 3.0, 10.0, 12.0]},
                  "reward.post_process": {"rewards": [-1.0, 1.0, -1.0, 1.0]}},
        payloads={"old_log_probs": old32, "ref_log_probs": ref32, "kl": kl,
                  "advantages": broadcast([-1.0, 1.0, -1.0, 1.0], PR65["lengths"])},
    )
    report = replay(path)
    assert report.passed, report_to_text(report)
    assert report.stage("advantage.kl").reason == "12 token(s) compared (k3, kl_coef=0.1)"
    assert report.stage("reward.post_process").reason == "4 sample(s) in 2 group(s) compared"


def test_std_normalized_rewards_match_hand_values(tmp_path):
    rewards = [-INV_SQRT2, INV_SQRT2, -INV_SQRT2, INV_SQRT2]  # ±1 / (√2 + 1e-6)
    path = write(
        tmp_path / "b", **PR65, stages=ROLLOUT_STAGES, grpo_std_normalization=True,
        expected={"reward.raw": {"raw_rewards": PR65["raw"]}, "reward.post_process": {"rewards": rewards}},
        payloads={"kl": [0.0] * 12, "advantages": broadcast(rewards, PR65["lengths"])},
    )
    assert replay(path).passed


def loss_bundle(path, *, log_prob, expected, entropy=None, masks=None, lengths=(3, 2, 4, 3), policy=ComparisonPolicy(),
                entropy_coef=0.0):
    lengths = list(lengths)
    total = sum(lengths)
    payloads = {"log_probs": [log_prob] * total, "old_log_probs": [0.0] * total,
                "advantages": broadcast([-1.0, 1.0, -1.0, 1.0], lengths)}
    if entropy is not None:
        payloads["entropy"] = entropy
    return write(path, groups=[0, 0, 1, 1], lengths=lengths, raw=[1.0, 3.0, 10.0, 12.0], masks=masks,
                 stages=STEP_STAGES, expected={"loss.policy": expected}, payloads=payloads, policy=policy,
                 entropy_coef=entropy_coef)


def test_pr65_step_loss_logp_half_matches_hand_values(tmp_path):
    pg = 2 * (E05 - 1.2)  # 0.8974425414
    expected = {"loss": pg, "pg_loss": pg, "entropy_loss": 0.0, "pg_clipfrac": 2.0, "ppo_kl": -2.0}
    report = replay(loss_bundle(tmp_path / "b", log_prob=0.5, expected=expected))
    assert report.passed, report_to_text(report)
    assert report.stage("loss.policy").reason == "5 field(s) over 4 sample(s) compared"
    # the seed's rounded figure is within the default tolerance (1e-6 + 1e-5·|e|) too
    expected = dict(expected, loss=0.8974426, pg_loss=0.8974426)
    assert replay(loss_bundle(tmp_path / "c", log_prob=0.5, expected=expected)).passed


def test_pr65_step_loss_logp_zero_is_exactly_zero(tmp_path):
    # ratio 1 → pg = −A per token; Σ per-sample means = 1 − 1 + 1 − 1 = 0; nothing clipped; ppo_kl 0
    zeros = {"loss": 0.0, "pg_loss": 0.0, "entropy_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0}
    exact = ComparisonPolicy(exact_fields=list(zeros))
    assert replay(loss_bundle(tmp_path / "b", log_prob=0.0, expected=zeros, policy=exact)).passed


def test_loss_divergence_names_the_field(tmp_path):
    pg = 2 * (E05 - 1.2)
    expected = {"loss": pg, "pg_loss": pg, "entropy_loss": 0.0, "pg_clipfrac": 1.0, "ppo_kl": -2.0}
    report = replay(loss_bundle(tmp_path / "b", log_prob=0.5, expected=expected))
    stage = report.stage("loss.policy")
    assert stage.status == "fail" and stage.reason == "loss field mismatch: pg_clipfrac"
    d = report.first_divergence
    assert (d.stage, d.field, d.sample_id, d.token_offset, d.expected, d.actual, d.abs_error) == (
        "loss.policy", "pg_clipfrac", None, None, 1.0, 2.0, 1.0)
    # a stage's scalar is named by its field alone (the stage is not a sample)
    assert "          pg_clipfrac: expected=1.0 actual=2.0 abs_err=1.0" in report_to_text(report).splitlines()


def test_entropy_coef_enters_the_loss(tmp_path):
    entropy = torch.linspace(0.5, 1.5, 12)
    pg = 2 * (E05 - 1.2)
    ent = 2 + 21 / 11  # Σ per-sample means of 0.5 + k/11
    expected = {"loss": pg - 0.01 * ent, "pg_loss": pg, "entropy_loss": ent, "pg_clipfrac": 2.0, "ppo_kl": -2.0}
    assert replay(loss_bundle(tmp_path / "b", log_prob=0.5, expected=expected, entropy=entropy,
                              entropy_coef=0.01)).passed
    # the same expectations without the entropy term are a divergence of 0.01·3.909 in `loss` only
    report = replay(loss_bundle(tmp_path / "c", log_prob=0.5, expected=dict(expected, loss=pg), entropy=entropy,
                                entropy_coef=0.01))
    assert report.stage("loss.policy").reason == "loss field mismatch: loss"
    assert report.first_divergence.abs_error == pytest.approx(0.01 * ent, rel=1e-5)


def test_missing_entropy_with_entropy_coef_is_refused_before_any_stage_runs(tmp_path):
    """An input a stage about to run needs is missing: the bundle is incomplete (exit 3, validate's line), not a
    divergence (exit 1)."""
    pg = 2 * (E05 - 1.2)
    expected = {"loss": pg, "pg_loss": pg, "entropy_loss": 0.0, "pg_clipfrac": 2.0, "ppo_kl": -2.0}
    path = loss_bundle(tmp_path / "b", log_prob=0.5, expected=expected, entropy_coef=0.01)
    with pytest.raises(BundleError, match=r"/b/manifest\.json: dependency closure incomplete: loss\.policy needs "
                                          r"payloads/entropy\.safetensors$") as refused:
        replay(path)
    assert refused.value.exit_code == 3


def test_fully_masked_sample_and_zero_length_response(tmp_path):
    # s-1 has no response tokens; s-2 is fully masked. Rewards [−1, 1, −1, 1].
    # loss: s-0 e^0.5 (A = −1, unclipped), s-1 0, s-2 0, s-3 −1.2 (A = +1, clipped)
    lengths = [3, 0, 4, 3]
    masks = [[1, 1, 1], [], [0, 0, 0, 0], [1, 1, 1]]
    rewards = [-1.0, 1.0, -1.0, 1.0]
    path = write(
        tmp_path / "b", groups=[0, 0, 1, 1], lengths=lengths, raw=[1.0, 3.0, 10.0, 12.0], masks=masks,
        expected={"reward.raw": {"raw_rewards": [1.0, 3.0, 10.0, 12.0]},
                  "reward.post_process": {"rewards": rewards},
                  "loss.policy": {"loss": E05 - 1.2, "pg_loss": E05 - 1.2, "entropy_loss": 0.0,
                                  "pg_clipfrac": 1.0, "ppo_kl": -1.0}},
        payloads={"log_probs": [0.5] * 10, "old_log_probs": [0.0] * 10, "kl": [0.0] * 10,
                  "advantages": broadcast(rewards, lengths)},
    )
    report = replay(path)
    assert report.passed, report_to_text(report)
    assert report.stage("sample").reason == "4 sample(s), 10 token(s) consistent"
    assert report.stage("advantage.estimate").reason == "10 token(s) compared"


def test_singleton_group_with_std_normalization_diverges_with_nan(tmp_path):
    path = write(
        tmp_path / "b", groups=[0, 1], lengths=[2, 1], raw=[1.0, 5.0], stages=ROLLOUT_STAGES,
        n_samples_per_prompt=1, grpo_std_normalization=True,
        expected={"reward.raw": {"raw_rewards": [1.0, 5.0]}, "reward.post_process": {"rewards": [0.0, 0.0]}},
        payloads={"kl": [0.0] * 3, "advantages": [0.0] * 3},
    )
    report = replay(path)
    assert report.first_divergent_stage == "reward.post_process"
    post = report.stage("reward.post_process")
    assert post.mismatches == 2 and post.max_abs_error == math.inf
    d = report.first_divergence
    assert (d.sample_id, d.field, d.expected, d.abs_error) == ("s-0", "reward", 0.0, None)
    assert math.isnan(d.actual)
    assert "reward s-0: expected=0.0 actual=nan abs_err=nan" in report_to_text(report)


def test_group_size_other_than_n_samples_per_prompt_names_the_group(tmp_path):
    path = write(
        tmp_path / "b", groups=[0, 0, 1], lengths=[1, 1, 1], raw=[1.0, 3.0, 7.0], stages=ROLLOUT_STAGES,
        n_samples_per_prompt=2,
        expected={"reward.raw": {"raw_rewards": [1.0, 3.0, 7.0]}, "reward.post_process": {"rewards": [-1.0, 1.0, 0.0]}},
        payloads={"kl": [0.0] * 3, "advantages": [-1.0, 1.0, 0.0]},
    )
    report = replay(path)
    post = report.stage("reward.post_process")
    assert post.status == "fail" and post.reason == "group g-1 has 1 sample(s), n_samples_per_prompt=2"
    d = report.first_divergence
    assert (d.sample_id, d.group_index, d.field, d.expected, d.actual) == ("s-2", 1, "group_size", 2.0, 1.0)


@pytest.mark.parametrize("std", [False, True])
def test_all_equal_rewards_normalize_to_exactly_zero(tmp_path, std):
    raw = [0.1, 0.1, 0.1, 7.3, 7.3, 7.3]
    path = write(
        tmp_path / "b", groups=[0, 0, 0, 1, 1, 1], lengths=[1] * 6, raw=raw, stages=ROLLOUT_STAGES,
        grpo_std_normalization=std, policy=ComparisonPolicy(exact_fields=["reward", "advantage"]),
        expected={"reward.raw": {"raw_rewards": raw}, "reward.post_process": {"rewards": [0.0] * 6}},
        payloads={"kl": [0.0] * 6, "advantages": [0.0] * 6},
    )
    report = replay(path)
    assert report.passed, report_to_text(report)
    assert report.stage("reward.post_process").max_abs_error == 0.0


# ---------------------------------------------------------------------------------- NaN, Inf, shapes


def kl_bundle(path, *, old=None, kl=None, rows=None, policy=ComparisonPolicy(), kl_type="k1"):
    """Rollout bundle with k1 KL: old = −1 − 0.1·i, ref = old − 0.5 → kl = 0.5 everywhere."""
    old = old if old is not None else [-1.0 - 0.1 * i for i in range(6)]
    ref = [-1.5 - 0.1 * i for i in range(6)]
    kl = kl if kl is not None else [0.5] * 6
    return write(
        path, groups=[0, 0], lengths=[4, 2], raw=[1.0, 2.0], stages=ROLLOUT_STAGES, step_level=False,
        kl_coef=0.05, kl_loss_type=kl_type, policy=policy,
        expected={"reward.raw": {"raw_rewards": [1.0, 2.0]}, "reward.post_process": {"rewards": [-0.5, 0.5]}},
        payloads={"old_log_probs": old, "ref_log_probs": ref, "kl": kl,
                  "advantages": [-0.5, -0.5, -0.5, -0.5, 0.5, 0.5]},
    )


def only_failure(report) -> str:
    failing = [s.stage for s in report.stages if s.status == "fail"]
    assert len(failing) == 1, report_to_text(report)
    return failing[0]


def test_kl_bundle_control_passes(tmp_path):
    assert replay(kl_bundle(tmp_path / "b")).passed


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_value_in_an_expected_tensor_payload_diverges(tmp_path, bad):
    kl = [0.5] * 6
    kl[5] = bad
    report = replay(kl_bundle(tmp_path / "b", kl=kl))
    assert only_failure(report) == "advantage.kl"
    d = report.first_divergence
    assert (d.sample_id, d.token_offset, d.actual, d.abs_error) == ("s-1", 1, 0.5, None)
    assert (math.isnan(d.expected) if math.isnan(bad) else d.expected == bad)
    assert report.stage("advantage.kl").max_abs_error == math.inf


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_recomputed_value_diverges(tmp_path, bad):
    old = [-1.0 - 0.1 * i for i in range(6)]
    old[2] = bad  # k1 = old − ref → nan / inf at s-0@2
    report = replay(kl_bundle(tmp_path / "b", old=old))
    assert only_failure(report) == "advantage.kl"
    d = report.first_divergence
    assert (d.sample_id, d.token_offset, d.expected, d.abs_error) == ("s-0", 2, 0.5, None)
    assert (math.isnan(d.actual) if math.isnan(bad) else d.actual == math.inf)


def test_nan_on_both_sides_still_diverges(tmp_path):
    old = [-1.0 - 0.1 * i for i in range(6)]
    kl = [0.5] * 6
    old[3] = kl[3] = math.nan
    report = replay(kl_bundle(tmp_path / "b", old=old, kl=kl))
    assert only_failure(report) == "advantage.kl"
    assert (report.first_divergence.sample_id, report.first_divergence.token_offset) == ("s-0", 3)


def test_nan_in_an_expected_json_list_diverges(tmp_path):
    # msgspec writes NaN as null; the reader turns null back into "no value", which never matches
    path = write(
        tmp_path / "b", groups=[0, 0], lengths=[1, 1], raw=[1.0, 2.0], stages=ROLLOUT_STAGES, step_level=False,
        expected={"reward.raw": {"raw_rewards": [1.0, math.nan]}, "reward.post_process": {"rewards": [-0.5, 0.5]}},
        payloads={"kl": [0.0, 0.0], "advantages": [-0.5, 0.5]},
    )
    report = replay(path)
    assert only_failure(report) == "reward.raw"
    d = report.first_divergence
    assert (d.sample_id, d.field, d.actual) == ("s-1", "raw_reward", 2.0) and math.isnan(d.expected)


def test_a_per_token_payload_with_an_extra_dimension_is_refused_before_any_stage(tmp_path):
    # [6, 2] has the right number of rows but would broadcast against the [6] recomputed values (SPEC §11)
    from replay_lib.errors import BundleError

    b = kl_bundle(tmp_path / "b", kl=torch.full((6, 2), 0.5))
    with pytest.raises(BundleError) as err:
        replay(b)
    assert str(err.value) == (f"{b / 'payloads' / 'kl.safetensors'}: manifest $.payloads.kl.shape: [6, 2], "
                              f"expected 1-D [Σ response_length]")


def test_payload_row_count_mismatch_fails_sample_first(tmp_path):
    report = replay(kl_bundle(tmp_path / "b", kl=[0.5] * 5))
    assert report.first_divergent_stage == "sample"
    assert report.first_divergence.message == "payload 'kl' has 5 row(s), Σ response_length is 6"
    assert report.stage("advantage.kl").reason == "payload 'kl' has 5 row(s), Σ response_length is 6"


def test_expected_list_length_mismatch_fails_with_its_own_message(tmp_path):
    path = write(
        tmp_path / "b", groups=[0, 0], lengths=[1, 1], raw=[1.0, 2.0], stages=ROLLOUT_STAGES, step_level=False,
        expected={"reward.raw": {"raw_rewards": [1.0, 2.0]}, "reward.post_process": {"rewards": [-0.5]}},
        payloads={"kl": [0.0, 0.0], "advantages": [-0.5, 0.5]},
    )
    report = replay(path)
    assert report.first_divergent_stage == "reward.post_process"
    assert report.first_divergence.message == (
        "expected.json $.reward.post_process.rewards has 1 value(s) for 2 sample(s)")


# ------------------------------------------------------------------------------------- tolerances


def reward_bundle(path, expected_rewards, policy):
    # groups of 2 with raw [0, 20] → [−10, 10]; the recorded advantages broadcast the recorded rewards
    return write(
        path, groups=[0, 0], lengths=[1, 1], raw=[0.0, 20.0], stages=ROLLOUT_STAGES, step_level=False, policy=policy,
        expected={"reward.raw": {"raw_rewards": [0.0, 20.0]}, "reward.post_process": {"rewards": expected_rewards}},
        payloads={"kl": [0.0, 0.0], "advantages": torch.tensor(expected_rewards, dtype=torch.float64).float()},
    )


def test_stage_atol_just_inside_passes_just_outside_fails(tmp_path):
    policy = ComparisonPolicy(tolerances={"reward.post_process": Tolerance(atol=0.01, rtol=0.0)})
    assert replay(reward_bundle(tmp_path / "in", [-10.0, 10.009], policy)).passed
    report = replay(reward_bundle(tmp_path / "out", [-10.0, 10.011], policy))
    assert only_failure(report) == "reward.post_process"
    assert report.first_divergence.sample_id == "s-1"
    assert report.first_divergence.abs_error == pytest.approx(0.011)


def test_stage_rtol_just_inside_passes_just_outside_fails(tmp_path):
    # bad iff |a − e| > rtol·|e|: e = 11.1 → 1.1 ≤ 1.11 passes; e = 11.12 → 1.12 > 1.112 fails
    policy = ComparisonPolicy(tolerances={"reward.post_process": Tolerance(atol=0.0, rtol=0.1)})
    assert replay(reward_bundle(tmp_path / "in", [-10.0, 11.1], policy)).passed
    report = replay(reward_bundle(tmp_path / "out", [-10.0, 11.12], policy))
    assert only_failure(report) == "reward.post_process"


def test_default_tolerance_applies_to_stages_without_one(tmp_path):
    # default atol 1e-6 + rtol 1e-5·|e| = 1.01e-4 at e = 10, plus the rounding bound of a float32 producer's
    # normalization of raw [0, 20] (no std): 8u·(|r| + √2·max|r|) = 8·2⁻²⁴·(20 + 20√2) = 2.3e-5
    bound = 1e-6 + 1e-5 * 10 + 8 * 2.0 ** -24 * (20 + 20 * math.sqrt(2))
    assert bound == pytest.approx(1.2403e-4, rel=1e-4)
    policy = ComparisonPolicy(tolerances={"advantage.kl": Tolerance(atol=1.0, rtol=0.0)})
    assert replay(reward_bundle(tmp_path / "in", [-10.0, 10.0 + bound * 0.99], policy)).passed
    report = replay(reward_bundle(tmp_path / "out", [-10.0, 10.0 + bound * 1.01], policy))
    assert only_failure(report) == "reward.post_process"
    e = 10.0 + bound * 1.01
    assert report.first_divergence.tolerance == pytest.approx(1e-6 + 1e-5 * e + 8 * 2.0 ** -24 * (20 + 20 * math.sqrt(2)),
                                                              rel=1e-12)
    assert report.first_divergence.noise_ratio == pytest.approx(1.01, rel=1e-4)


def test_per_token_stage_tolerance(tmp_path):
    kl = [0.5] * 6
    kl[4] = 0.5 + 0.04
    loose = ComparisonPolicy(tolerances={"advantage.kl": Tolerance(atol=0.05, rtol=0.0)})
    tight = ComparisonPolicy(tolerances={"advantage.kl": Tolerance(atol=0.03, rtol=0.0)})
    assert replay(kl_bundle(tmp_path / "loose", kl=kl, policy=loose)).passed
    report = replay(kl_bundle(tmp_path / "tight", kl=kl, policy=tight))
    assert only_failure(report) == "advantage.kl"
    assert (report.first_divergence.sample_id, report.first_divergence.token_offset) == ("s-1", 0)


@pytest.mark.parametrize("name", ["reward", "reward.post_process.reward"])
def test_exact_fields_override_the_tolerance(tmp_path, name):
    near = [-10.0, 10.0 + 1e-6]  # inside the default tolerance, not exact
    assert replay(reward_bundle(tmp_path / "default", near, ComparisonPolicy())).passed
    report = replay(reward_bundle(tmp_path / "exact", near, ComparisonPolicy(exact_fields=[name])))
    assert only_failure(report) == "reward.post_process"
    assert report.first_divergence.abs_error == pytest.approx(1e-6, rel=1e-6)


def test_a_non_finite_comparison_prints_the_ieee_difference():
    """JSON has no infinity, so a non-finite comparison's abs_error is null; the text prints |a − e| as IEEE has it:
    inf against a finite value (it printed nan), nan with a NaN."""
    from replay_lib.judge.report import Divergence, divergence_line

    inf = Divergence(stage="reward.raw", sample_id="s-3", field="raw_reward", expected=math.inf, actual=12.0)
    nan = Divergence(stage="reward.raw", sample_id="s-3", field="raw_reward", expected=0.0, actual=math.nan)
    assert divergence_line(inf) == "raw_reward s-3: expected=inf actual=12.0 abs_err=inf"
    assert divergence_line(nan) == "raw_reward s-3: expected=0.0 actual=nan abs_err=nan"
