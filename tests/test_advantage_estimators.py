"""The estimators with a reward.post_process rule of their own (SPEC §4.2: opo, gpg, grpo_passk, maxrl, remax, gdpo),
each derived by hand on a small step, through the kernels and through a replay of a bundle; the per-sample inputs
they need (remax's reward_baseline, gdpo's reward_components) checked before any stage runs (exit 3)."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest,
                                      RecomputeConfig, SampleRecord, StageId, stage_contracts)
from replay_lib.demo import producer
from replay_lib.kernels.reward import (GroupRule, gdpo_rewards, gpg_rewards, maxrl_rewards, opo_rewards,
                                       passk_rewards)

F64 = torch.float64
GROUPS = torch.tensor([0, 0, 0, 1])
R = torch.tensor([1.0, 0.0, 2.0, 3.0], dtype=F64)


def test_opo_weights_the_baseline_by_loss_tokens():
    # group 0: (2·1 + 1·0 + 1·2)/(2 + 1 + 1) = 1; the one-sample group keeps its reward
    out = opo_rewards(R, GROUPS, torch.tensor([2.0, 1.0, 1.0, 5.0]), dtype=F64)
    assert out.tolist() == [0.0, -1.0, 1.0, 3.0]


def test_gpg_scales_by_the_share_of_non_zero_scores():
    # α = 4 samples / 3 non-zero = 4/3; group 0 centred on 1; the one-sample group α·r
    out = gpg_rewards(R, GROUPS, dtype=F64)
    assert torch.allclose(out, torch.tensor([0.0, -4 / 3, 4 / 3, 4.0], dtype=F64), rtol=0, atol=1e-15)
    assert gpg_rewards(R, GROUPS, dtype=F64, alpha=2.0).tolist() == [0.0, -2.0, 2.0, 6.0]


def test_passk_gives_the_gap_to_the_best_only():
    r = torch.tensor([1.0, 0.0, 2.0, 2.0, 2.0, 0.0], dtype=F64)
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    # group 0: std of (1, 0, 2) is 1, best 2, second 1: (2 − 1)/(1 + 1e-6); group 1: a tie at the top → all 0
    assert passk_rewards(r, g, True, 1e-6, dtype=F64).tolist() == [0.0, 0.0, 1 / (1 + 1e-6), 0.0, 0.0, 0.0]
    assert passk_rewards(r, g, False, dtype=F64).tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert math.isnan(passk_rewards(R, GROUPS, False, dtype=F64)[3])  # a one-sample group: verl raises


def test_maxrl_divides_by_the_group_mean():
    out = maxrl_rewards(R, GROUPS, 1e-6, dtype=F64)
    assert out.tolist() == [0.0, -1 / (1 + 1e-6), 1 / (1 + 1e-6), 3.0]


def test_gdpo_normalizes_each_component_then_sums():
    comps = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 1.0]], dtype=F64)
    g = torch.tensor([0, 0, 0])
    rule = GroupRule(std=True, eps=0.0)
    # component 0: (r − 1)/1; component 1: mean 1/3, unbiased std √(1/3)
    s1 = math.sqrt(1 / 3)
    a1 = [(-1 / 3) / s1, (-1 / 3) / s1, (2 / 3) / s1]
    want = [0 + 2 * a1[0], -1 + 2 * a1[1], 1 + 2 * a1[2]]
    out = gdpo_rewards(comps, g, rule, torch.tensor([1.0, 2.0], dtype=F64), dtype=F64)
    assert torch.allclose(out, torch.tensor(want, dtype=F64), rtol=0, atol=1e-14)
    # NeMo-RL standardizes the sum over the samples: (A − mean)/std (unbiased)
    mean = sum(want) / 3
    std = math.sqrt(sum((v - mean) ** 2 for v in want) / 2)
    out = gdpo_rewards(comps, g, rule, torch.tensor([1.0, 2.0], dtype=F64), standardize=True, dtype=F64)
    assert torch.allclose(out, torch.tensor([(v - mean) / std for v in want], dtype=F64), rtol=0, atol=1e-14)


# ------------------------------------------------------------------------------------------- through a replay

STAGES = [StageId.SAMPLE, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_ESTIMATE]


def _bundle(path, cfg: RecomputeConfig, samples: list[SampleRecord], rewards: list[float], adv: list[float]) -> str:
    index = BundleIndex(bundle_id="est", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=cfg)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id="est", producer=producer(),
                        stage_contracts=stage_contracts(STAGES), payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    writer = BundleWriter(path, manifest, index, {"reward.post_process": {"rewards": rewards}})
    writer.write_payload("advantages", torch.tensor(adv, dtype=torch.float32))
    return writer.finalize(ranks=[0])


def _remax_samples(baselines):
    return [SampleRecord(sample_id=f"s-{i}", group_index=i, response_length=3, total_length=5, loss_mask=mask,
                         raw_reward=score, **({} if b is None else {"reward_baseline": b}))
            for i, (score, mask, b) in enumerate(zip([2.0, 1.0], [[1, 0, 1], [1, 1, 1]], baselines))]


REMAX = RecomputeConfig(advantage_estimator="remax", masked_token_value="zero")


def test_remax_replays_the_score_minus_the_greedy_baseline(tmp_path, cli):
    # sample 0: 2 − 0.5 at its loss tokens (verl: returns − b·mask, the return there is the score: γ = 1);
    # sample 1: 1 − 1.5
    bundle = _bundle(tmp_path / "b", REMAX, _remax_samples([0.5, 1.5]), [1.5, -0.5],
                     [1.5, 2.0, 1.5, -0.5, -0.5, -0.5])
    code, out, err = cli("replay", bundle, "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergent_stage"]) == (0, None), out
    stages = {s["stage"]: s for s in report["stages"]}
    assert "r − the recorded greedy reward_baseline" in stages["reward.post_process"]["reason"]
    # the baseline not subtracted: named at reward.post_process
    bad = _bundle(tmp_path / "bad", REMAX, _remax_samples([0.5, 1.5]), [2.0, -0.5], [2.0, 2.0, 2.0, -0.5, -0.5, -0.5])
    code, out, _ = cli("replay", bad, "--format", "json")
    assert (code, json.loads(out)["first_divergent_stage"]) == (1, "reward.post_process")


def test_remax_without_its_baseline_is_an_invalid_bundle(tmp_path, cli):
    bundle = _bundle(tmp_path / "b", REMAX, _remax_samples([0.5, None]), [1.5, -0.5], [1.5] * 3 + [-0.5] * 3)
    for command in ("validate", "replay"):
        code, out, err = cli(command, bundle)
        assert code == 3, (out, err)
        assert ("$.samples[1].reward_baseline (missing): expected a finite number (the greedy rollout's reward that "
                "advantage_estimator='remax' subtracts)") in out + err


@pytest.mark.parametrize("components, weights, message", [
    ([[1.0, 0.0], None], None, "$.samples[1].reward_components: expected a non-empty list of numbers (each reward "
                               "component advantage_estimator='gdpo' normalizes apart)"),
    ([[1.0, 0.0], [1.0]], None, "$.samples[1].reward_components: expected 2 components (as samples[0]), got 1"),
    ([[1.0, 0.0], [0.0, 1.0]], [1.0], "$.config.reward_component_weights: expected 2 finite numbers (one per reward "
                                      "component), got 1"),
])
def test_gdpo_inputs_are_checked(tmp_path, cli, components, weights, message):
    cfg = RecomputeConfig(advantage_estimator="gdpo", n_samples_per_prompt=2, grpo_std_normalization=True,
                          **({} if weights is None else {"reward_component_weights": weights}))
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=0, response_length=2, total_length=3, loss_mask=[1, 1],
                            raw_reward=0.0, **({} if c is None else {"reward_components": c}))
               for i, c in enumerate(components)]
    bundle = _bundle(tmp_path / "b", cfg, samples, [0.0, 0.0], [0.0] * 4)
    code, out, err = cli("validate", bundle)
    assert code == 3 and message in out + err, (out, err)


def test_an_unset_estimator_input_is_not_written():
    """A sample without reward_baseline / reward_components encodes as before (the fields are optional)."""
    s = SampleRecord(sample_id="s", response_length=1, total_length=1, loss_mask=[1])
    assert b"reward_baseline" not in msgspec.json.encode(s) and b"reward_components" not in msgspec.json.encode(s)
    assert b"reward_component" not in msgspec.json.encode(RecomputeConfig())


def _shaped_bundle(tmp_path, truncated, **knobs):
    cfg = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2, grpo_std_normalization=False, **knobs)
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=0, response_length=4, total_length=5, loss_mask=m,
                            raw_reward=1.0, **({} if t is None else {"truncated": t}))
               for i, (m, t) in enumerate(zip([[1, 1, 1, 1], [0, 1, 1, 0]], truncated))]
    return cfg, samples


def test_length_shaping_by_hand(tmp_path, cli):
    # overlong: max 4 tokens, buffer 3 → expected 1; sample 0 spans 4 loss tokens (exceed min(3, 3) = 3: −3/3·0.5),
    # sample 1 spans 2 (exceed 1: −1/3·0.5); then the truncated sample 1 replaced by −1: rewards 0.5 and −1, mean −0.25
    cfg, samples = _shaped_bundle(tmp_path, [False, True], overlong_buffer_len=3.0, overlong_penalty_factor=0.5,
                                  overlong_max_tokens=4, truncated_reward_coef=-1.0)
    bundle = _bundle(tmp_path / "b", cfg, samples, [0.75, -0.75], [0.75] * 4 + [-0.75] * 4)
    code, out, err = cli("replay", bundle, "--format", "json")
    assert (code, json.loads(out)["first_divergent_stage"]) == (0, None), out
    # as a factor (0.5): 0.5 and (1 − 1/6)·0.5, centred
    cfg = msgspec.structs.replace(cfg, truncated_reward_coef=0.5)
    b, c = 0.5, (1 - 1 / 6) * 0.5
    bundle = _bundle(tmp_path / "c", cfg, samples, [(b - c) / 2, (c - b) / 2], [(b - c) / 2] * 4 + [(c - b) / 2] * 4)
    code, out, err = cli("replay", bundle, "--format", "json")
    assert (code, json.loads(out)["first_divergent_stage"]) == (0, None), out


def test_length_shaping_needs_each_samples_truncated_flag(tmp_path, cli):
    cfg, samples = _shaped_bundle(tmp_path, [False, None], truncated_reward_coef=0.5)
    bundle = _bundle(tmp_path / "b", cfg, samples, [0.0, 0.0], [0.0] * 8)
    code, out, err = cli("validate", bundle)
    assert code == 3 and ("$.samples[1].truncated: expected true or false (whether the generation stopped at the "
                          "token limit; truncated_reward_coef is set)") in out + err, (out, err)
    cfg, samples = _shaped_bundle(tmp_path, [None, None], overlong_buffer_len=8.0, overlong_max_tokens=4)
    bundle = _bundle(tmp_path / "c", cfg, samples, [0.0, 0.0], [0.0] * 8)
    code, out, err = cli("validate", bundle)
    assert code == 3 and ("$.config.overlong_buffer_len=8.0: expected a finite number > 0 with overlong_max_tokens an "
                          "integer >= it (got 4)") in out + err, (out, err)


def test_the_why_line_of_an_own_rule_reward_names_its_rule(tmp_path):
    """The inputs of a normalized reward (the TUI's why strip) under remax: its own rule and the stage's value, not
    "the score passes through unchanged" beside the raw reward."""
    from replay_lib.bundle import open_bundle
    from replay_lib.explain.inputs import element_inputs
    from replay_lib.stages import REGISTRY, StageContext

    bundle = _bundle(tmp_path / "b", REMAX, _remax_samples([0.5, 1.5]), [1.5, -0.5], [1.5, 2.0, 1.5] + [-0.5] * 3)
    reader = open_bundle(bundle).shards[0]
    ctx = StageContext(reader=reader, indices=[0, 1], partial=False)
    REGISTRY[StageId.REWARD_POST_PROCESS].run(ctx)
    assert element_inputs(ctx, "reward", 1).formula == "remax: r − the recorded greedy reward_baseline = -0.5"
