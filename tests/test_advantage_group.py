"""reward.post_process knobs of SPEC §4.2, one hand-derived test each: ``grpo_std_eps``, ``grpo_std_unbiased``,
``group_baseline`` (mean | leave_one_out), ``std_zero`` (eps | skip), ``singleton_group`` (nan | zero | raw),
``kl_in_reward="sequence"``, the estimators' post-processing (dr_grpo, rloo, REINFORCE++-baseline, REINFORCE++ and
GAE pass the score through) — on the kernel (float32 producer form and float64 replay) and through the real
bundle writer, reader and runner. Expected numbers are derived by hand in the comments."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from producers import advantage as producer
from replay_lib.kernels import GroupRule, group_normalize, group_rule, post_process, sequence_kl_score
from replay_lib.judge.report import report_to_text
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import RecomputeConfig

F64 = torch.float64


def norm(raw, groups, std=True, **kw):
    return group_normalize(torch.tensor(raw, dtype=F64), torch.tensor(groups), std, dtype=F64, **kw).tolist()


# ------------------------------------------------------------------------------------------- kernels


def test_std_eps_is_the_configured_constant():
    # [1, 3]: mean 2, unbiased std √2 = 1.41421356…; TRL's eps 1e-4: ±1/1.41431356 = ±0.70705678
    got = norm([1.0, 3.0], [0, 0], eps=1e-4)
    assert got == pytest.approx([-1 / (math.sqrt(2) + 1e-4), 1 / (math.sqrt(2) + 1e-4)], rel=1e-15)
    assert got[1] == pytest.approx(0.70705678, abs=1e-8)
    # float32 producer form: the same up to float32 rounding
    f32 = group_normalize(torch.tensor([1.0, 3.0]), torch.tensor([0, 0]), True, 1e-4)
    assert f32.dtype == torch.float32 and f32.tolist() == pytest.approx(got, rel=1e-6)


def test_biased_std_divides_by_n():
    # [1, 3]: biased std √(((−1)² + 1²)/2) = 1: ±1/(1 + 1e-6)
    assert norm([1.0, 3.0], [0, 0], unbiased=False) == pytest.approx([-1 / (1 + 1e-6), 1 / (1 + 1e-6)], rel=1e-15)


def test_leave_one_out_baseline_without_std():
    # [1, 2, 4]: b_i = (7 − r_i)/2 = [3, 2.5, 1.5]: A = [−2, −0.5, 2.5]
    assert norm([1.0, 2.0, 4.0], [0, 0, 0], std=False, baseline="leave_one_out") == pytest.approx([-2, -0.5, 2.5])


def test_leave_one_out_with_std_divides_by_the_others_std():
    # NeMo-RL: the std is over the other samples too (Bessel, m = 2 others):
    # s-0: others [2, 4] std √2  → −2/(√2 + 1e-6); s-1: others [1, 4] std √4.5 → −0.5/(√4.5 + 1e-6);
    # s-2: others [1, 2] std √0.5 → 2.5/(√0.5 + 1e-6)
    got = norm([1.0, 2.0, 4.0], [0, 0, 0], baseline="leave_one_out")
    want = [-2 / (math.sqrt(2) + 1e-6), -0.5 / (math.sqrt(4.5) + 1e-6), 2.5 / (math.sqrt(0.5) + 1e-6)]
    assert got == pytest.approx(want, rel=1e-14)


def test_std_zero_skip_leaves_the_centered_value_where_the_std_is_zero():
    # [1, 1, 1, 0] leave-one-out: s-3's others [1, 1, 1] have std 0, its centred value 0 − 1 = −1:
    # skip → −1; eps → −1/1e-6 = −1e6. s-0..2: others [1, 1, 0]: b = 2/3, std √((1/9 + 1/9 + 4/9)/2) = √(1/3),
    # centred 1/3 → (1/3)/(√(1/3) + 1e-6) = 0.57735…
    skip = norm([1.0, 1.0, 1.0, 0.0], [0] * 4, baseline="leave_one_out", std_zero="skip")
    eps = norm([1.0, 1.0, 1.0, 0.0], [0] * 4, baseline="leave_one_out", std_zero="eps")
    third = (1 / 3) / (math.sqrt(1 / 3) + 1e-6)
    assert skip == pytest.approx([third, third, third, -1.0], rel=1e-12)
    assert eps[3] == pytest.approx(-1e6, rel=1e-12) and eps[:3] == pytest.approx(skip[:3], rel=1e-15)


@pytest.mark.parametrize("rule,want", [("zero", 0.0), ("raw", 5.0 / (1 + 1e-6))])
def test_singleton_rules(rule, want):
    # a one-sample group [5] beside [1, 3] (±1/(√2 + 1e-6)): zero → 0 (TRL, NeMo-RL); raw → verl's mean 0, std 1:
    # 5/(1 + 1e-6)
    got = norm([1.0, 3.0, 5.0], [0, 0, 1], singleton=rule)
    assert got[2] == want and got[1] == pytest.approx(1 / (math.sqrt(2) + 1e-6), rel=1e-15)


def test_singleton_nan_rule_and_the_arithmetic():
    # slime: NaN; without a rule an unbiased std of one sample is 0/0 = NaN as well, a biased one 0 (0/(0 + eps))
    assert math.isnan(norm([5.0], [0], singleton="nan")[0])
    assert math.isnan(norm([5.0], [0])[0]) and norm([5.0], [0], unbiased=False) == [0.0]
    # raw without std: the reward itself (verl's rloo / REINFORCE++-baseline keep a singleton's score)
    assert norm([5.0], [0], std=False, singleton="raw") == [5.0]


def test_sequence_kl_score_subtracts_the_masked_kl_sum():
    # raw [1, 0], kl [0.1, 0.3 | 0.2], mask [1, 1 | 1], kl_coef 0.5 → [1 − 0.5·0.4, 0 − 0.5·0.2] = [0.8, −0.1];
    # a masked token does not count: mask [1, 0 | 1] → [1 − 0.05, −0.1]
    kl, lengths = torch.tensor([0.1, 0.3, 0.2], dtype=F64), torch.tensor([2, 1])
    got = sequence_kl_score(torch.tensor([1.0, 0.0], dtype=F64), kl, torch.tensor([1, 1, 1]), lengths, 0.5, dtype=F64)
    assert got.tolist() == pytest.approx([0.8, -0.1], rel=1e-15)
    got = sequence_kl_score(torch.tensor([1.0, 0.0], dtype=F64), kl, torch.tensor([1, 0, 1]), lengths, 0.5, dtype=F64)
    assert got.tolist() == pytest.approx([0.95, -0.1], rel=1e-15)


@pytest.mark.parametrize("estimator,want", [
    # [1, 3, 8]: mean 4, unbiased std √13 = 3.6055513
    ("grpo", [-3 / (math.sqrt(13) + 1e-6), -1 / (math.sqrt(13) + 1e-6), 4 / (math.sqrt(13) + 1e-6)]),
    ("dr_grpo", [-3.0, -1.0, 4.0]),                      # centred, never divided
    ("rloo", [-4.5, -1.5, 6.0]),                         # r − (12 − r)/2: 1 − 5.5, 3 − 4.5, 8 − 2
    ("reinforce_plus_plus_baseline", [-3.0, -1.0, 4.0]),  # the group mean subtracted (whitened later)
    ("reinforce_plus_plus", [1.0, 3.0, 8.0]),            # the score itself
    ("gae", [1.0, 3.0, 8.0]),
])
def test_each_estimators_post_processing(estimator, want):
    cfg = RecomputeConfig(advantage_estimator=estimator, grpo_std_normalization=True)
    got = post_process(torch.tensor([1.0, 3.0, 8.0], dtype=F64), torch.tensor([0, 0, 0]), group_rule(cfg), dtype=F64)
    assert got.tolist() == pytest.approx(want, rel=1e-14)


def test_rewards_normalization_off_passes_the_score_through():
    assert group_rule(RecomputeConfig(rewards_normalization=False)) == GroupRule(center=False)


# ------------------------------------------------------------------------- through the real replay


def knob_bundle(tmp_path, name, raw, groups, **config):
    """A bundle whose recorded rewards (and their broadcast advantages) come from the float32 producer."""
    lengths = [2] * len(raw)
    rule = group_rule(RecomputeConfig(**config))
    rewards = producer.group_post_process(raw, groups, std=rule.std, eps=rule.eps, unbiased=rule.unbiased,
                                          baseline=rule.baseline, std_zero=rule.std_zero, singleton=rule.singleton)
    advantages = np.repeat(rewards, 2)
    return producer.write(tmp_path / name, raw=raw, groups=groups, lengths=lengths, rewards=rewards,
                          advantages=advantages, **config)


# knob → (its config, what a producer that missed it computes instead)
KNOBS = {
    "std_eps_trl": (dict(grpo_std_normalization=True, grpo_std_eps=1e-4), dict(grpo_std_normalization=True)),
    "std_eps_openrlhf": (dict(grpo_std_normalization=True, grpo_std_eps=1e-9), dict(grpo_std_normalization=True)),
    "biased_std": (dict(grpo_std_normalization=True, grpo_std_unbiased=False), dict(grpo_std_normalization=True)),
    "leave_one_out": (dict(group_baseline="leave_one_out"), dict()),
    "nemo_loo_std_skip": (dict(grpo_std_normalization=True, group_baseline="leave_one_out", std_zero="skip",
                               singleton_group="zero"),
                          dict(grpo_std_normalization=True, group_baseline="leave_one_out", singleton_group="zero")),
    "singleton_raw": (dict(grpo_std_normalization=True, singleton_group="raw"),
                      dict(grpo_std_normalization=True, singleton_group="zero")),
    "singleton_nan": (dict(grpo_std_normalization=True, singleton_group="nan"),
                      dict(grpo_std_normalization=True, singleton_group="zero")),
    "dr_grpo": (dict(advantage_estimator="dr_grpo", grpo_std_normalization=True), dict(grpo_std_normalization=True)),
    "rloo": (dict(advantage_estimator="rloo"), dict()),
}
# group 3 is a singleton; group 4's std (1e-4) is small enough for the eps to matter beyond rounding
RAW = [0.0, 1.0, 1.0, 0.25, 0.75, 0.5, 2.0, 2.0, 2.0, 3.0, 4.0, 0.0, 0.0001, 0.0002]
GROUPS = [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 4, 4, 4]


def rewards_of(config):
    rule = group_rule(RecomputeConfig(**config))
    return producer.group_post_process(RAW, GROUPS, std=rule.std, eps=rule.eps, unbiased=rule.unbiased,
                                       baseline=rule.baseline, std_zero=rule.std_zero, singleton=rule.singleton)


@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_a_float32_producer_of_each_knob_replays_clean_and_one_that_missed_it_fails(tmp_path, knob):
    config, missed = KNOBS[knob]
    if "singleton_group" not in config:  # the singleton group 3 needs a rule (its arithmetic is NaN: a divergence)
        config, missed = dict(config, singleton_group="zero"), dict(missed, singleton_group="zero")
    clean = replay(knob_bundle(tmp_path, "clean", RAW, GROUPS, **config))
    assert clean.passed, report_to_text(clean)
    kinds = {(h.kind, h.group_index) for h in clean.hazards}
    assert ("singleton_group", 3) in kinds  # reported whatever rule the bundle chose for it
    # a producer that computed the V1 formula (or another rule) where the bundle declares this knob: a real
    # divergence, and the first one is reward.post_process
    rewards = rewards_of(missed)
    bad = replay(producer.write(tmp_path / "bad", raw=RAW, groups=GROUPS, lengths=[2] * len(RAW), rewards=rewards,
                                advantages=np.repeat(rewards, 2), **config))
    assert bad.first_divergent_stage == "reward.post_process", report_to_text(bad)


def test_singleton_nan_rule_is_not_a_divergence_but_a_nan_elsewhere_is(tmp_path):
    # slime's rule: the singleton's recorded NaN reward (and its NaN advantages) is the rule, never a divergence
    config = KNOBS["singleton_nan"][0]
    report = replay(knob_bundle(tmp_path, "b", RAW, GROUPS, **config))
    assert report.passed and report.stage("reward.post_process").mismatches == 0
    assert [h.message for h in report.hazards if h.kind == "singleton_group"] == [
        "group g-3 has a single sample: singleton_group=nan gives it NaN"]
    # a NaN recorded for a sample of a larger group still diverges
    rewards = producer.group_post_process(RAW, GROUPS, std=True, singleton="nan")
    rewards[0] = np.nan
    bad = replay(producer.write(tmp_path / "bad", raw=RAW, groups=GROUPS, lengths=[2] * len(RAW), rewards=rewards,
                                advantages=np.repeat(rewards, 2), **config))
    post = bad.stage("reward.post_process")
    assert (post.status, post.mismatches, bad.first_divergence.sample_id) == ("fail", 1, "s-0")


def test_variable_group_sizes_are_declared_by_n_samples_per_prompt_zero(tmp_path):
    # groups of 3, 3, 4 and 1 normalize over the samples they have; with n_samples_per_prompt=3 the two groups
    # whose size is not 3 are named as before
    path = knob_bundle(tmp_path, "b", RAW, GROUPS, grpo_std_normalization=True, singleton_group="zero")
    assert replay(path).passed
    strict = knob_bundle(tmp_path, "strict", RAW, GROUPS, grpo_std_normalization=True, singleton_group="zero",
                         n_samples_per_prompt=3)
    post = replay(strict).stage("reward.post_process")
    assert post.reason == "group g-2 has 4 sample(s), n_samples_per_prompt=3"


def test_the_pass_reason_names_the_rule(tmp_path):
    report = replay(knob_bundle(tmp_path, "b", RAW, GROUPS, **KNOBS["nemo_loo_std_skip"][0]))
    assert report.stage("reward.post_process").reason == (
        "14 sample(s) in 5 group(s) compared (grpo, leave_one_out baseline, unbiased std + 1e-06, skipped where 0, "
        "singleton → zero)")


def test_leave_one_out_zero_std_hazards_are_reported_and_never_fail(tmp_path):
    # NeMo-RL's rule on a group of four 0.3s (not exact in float32: its std, E[r²] − b², may come out at rounding
    # level) and on [0.3, 0.3, 0.3, 0.9], whose s-7's others are three 0.3s: both pass, each reported as a hazard.
    # The all-0.3 group's bound is 8u·(|r| + √4·max|r|)·(4/3)/1e-6 = 8·2⁻²⁴·0.9·(4/3)/1e-6 ≈ 0.572 (not NaN: its
    # centred values are 0).
    raw, groups = [0.3] * 4 + [0.3, 0.3, 0.3, 0.9], [0] * 4 + [1] * 4
    config = dict(grpo_std_normalization=True, group_baseline="leave_one_out", std_zero="skip")
    report = replay(knob_bundle(tmp_path, "b", raw, groups, **config))
    assert report.passed, report_to_text(report)
    hazards = [(h.kind, h.group_index, h.sample_id) for h in report.hazards]
    assert hazards == [("near_zero_std", 0, None), ("zero_advantage_group", 0, None), ("near_zero_std", 1, "s-7")]
    assert "admitted up to ±0.572" in report.hazards[0].message
    assert report.hazards[2].message.startswith(
        "group g-1: s-7's leave-one-out std over the other 3 rewards is 0, at the rounding level of E[r²] − b²")


@pytest.mark.parametrize("std_zero", ["skip", "eps"])
def test_the_lone_success_over_others_of_exactly_zero_is_checked_like_any_reward(tmp_path, std_zero):
    """Binary-style group [0, 0, 0, 1/3] under a leave-one-out std: s-3's others are exactly 0, so every float32
    producer's std over them is exactly 0 too (a masked sum adds only zeros, as NeMo-RL's (1 − I)·r; a total less
    s-3's reward is 0 again, for r and r²), whatever s-3's reward. Its value is then r − 0 (skip) or r/(0 + 1e-6)
    (eps), checked with the ordinary rounding bound: a recorded 1000 diverges (it passed, admitted up to ±|c|/eps
    = ±3.3e5, with a near_zero_std hazard in place of a check)."""
    raw, groups = [0.0, 0.0, 0.0, 1.0 / 3.0, 1.0, 0.0, 1.0, 1.0], [0] * 4 + [1] * 4
    config = dict(grpo_std_normalization=True, group_baseline="leave_one_out", std_zero=std_zero,
                  singleton_group="zero")
    rule = group_rule(RecomputeConfig(**config))
    recorded = producer.group_post_process(raw, groups, std=rule.std, eps=rule.eps, unbiased=rule.unbiased,
                                           baseline=rule.baseline, std_zero=rule.std_zero, singleton=rule.singleton)
    clean = replay(knob_bundle(tmp_path, "clean", raw, groups, **config))
    assert clean.passed, report_to_text(clean)
    assert not [h for h in clean.hazards if h.kind == "near_zero_std" and h.sample_id == "s-3"], clean.hazards
    # an independent float32 reference of s-3's value: the others' mean and std are 0, c = r
    r = np.float32(1.0 / 3.0)
    expected = float(r) if std_zero == "skip" else float(r / (np.float32(0.0) + np.float32(1e-6)))
    assert recorded[3] == pytest.approx(expected, rel=1e-6)
    rewards = recorded.copy()
    rewards[3] = 1000.0
    bad = replay(producer.write(tmp_path / "bad", raw=raw, groups=groups, lengths=[2] * len(raw), rewards=rewards,
                                advantages=np.repeat(recorded, 2), **config))
    post = bad.stage("reward.post_process")
    assert (post.status, post.mismatches, bad.first_divergence.sample_id) == ("fail", 1, "s-3"), report_to_text(bad)
