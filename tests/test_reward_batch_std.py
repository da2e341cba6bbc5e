"""``grpo_std_scope="batch"`` (TRL ``scale_rewards="batch"``): each reward centred on its group mean and divided
by the std of the whole generation batch — by hand, against TRL's own ``nanstd`` as the producer, and the
multi-process refusal."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from trl.trainer.utils import nanstd

from producers import advantage as producer
from replay_lib.bundle.schema import ComparisonPolicy, ProducerPrecision
from replay_lib.errors import UnsupportedError
from replay_lib.judge.report import report_to_text
from replay_lib.kernels import group_normalize
from replay_lib.run.runner import replay

# two groups of two: [1, 3] (mean 2) and [2, 6] (mean 4); the whole batch [1, 3, 2, 6] has mean 3, squared
# deviations 4 + 0 + 1 + 9 = 14, unbiased std √(14/3) = 2.16024689…; group stds √2 and √8
RAW = [1.0, 3.0, 2.0, 6.0]
GROUPS = [0, 0, 1, 1]
BATCH_STD = math.sqrt(14 / 3)
BY_HAND = [c / (BATCH_STD + 1e-4) for c in (-1.0, 1.0, -2.0, 2.0)]
CONFIG = dict(n_samples_per_prompt=2, grpo_std_normalization=True, grpo_std_eps=1e-4, grpo_std_scope="batch")


def trl_batch_scaled(raw, num_generations=2):
    """grpo_trainer.py:2765-2787 with scale_rewards="batch", in float32, TRL's own nanstd (utils.py:1021)."""
    rewards = torch.tensor(raw, dtype=torch.float32)
    mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    std_rewards = nanstd(rewards).expand_as(rewards)
    return ((rewards - mean_grouped) / (std_rewards + 1e-4)).tolist()


def trl_group_scaled(raw, num_generations=2):
    rewards = torch.tensor(raw, dtype=torch.float32).view(-1, num_generations)
    std = nanstd(rewards, dim=1).repeat_interleave(num_generations)
    mean = torch.nanmean(rewards, dim=1).repeat_interleave(num_generations)
    return ((rewards.reshape(-1) - mean) / (std + 1e-4)).tolist()


def bundle(tmp_path, name, rewards, precision="float32", rank=None):
    policy = ComparisonPolicy(producer_precision=ProducerPrecision(compute=precision))
    return producer.write(tmp_path / name, raw=RAW, groups=GROUPS, lengths=[2] * 4, rewards=rewards,
                          advantages=np.repeat(rewards, 2), policy=policy, rank=rank, **CONFIG)


def test_the_kernel_by_hand():
    got = group_normalize(torch.tensor(RAW, dtype=torch.float64), torch.tensor(GROUPS), True, 1e-4,
                          dtype=torch.float64, std_scope="batch").tolist()
    assert got == pytest.approx(BY_HAND, rel=1e-15)
    assert got[3] == pytest.approx(0.92577724, abs=1e-8)
    # TRL's own code computes the same values
    assert trl_batch_scaled(RAW) == pytest.approx(BY_HAND, rel=1e-6)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_trl_batch_std_replays_clean_and_the_group_std_producer_diverges(tmp_path, precision):
    clean = replay(bundle(tmp_path, "clean", trl_batch_scaled(RAW), precision))
    assert clean.passed, report_to_text(clean)
    post = clean.stage("reward.post_process")
    assert (post.mismatches, post.reason) == (0, "4 sample(s) in 2 group(s) compared (grpo, mean baseline, "
                                                 "unbiased batch std + 0.0001)")
    # the injected bug: a producer that divided by each group's std where the bundle declares the batch's
    bad = replay(bundle(tmp_path, "bad", trl_group_scaled(RAW), precision))
    assert bad.first_divergent_stage == "reward.post_process", report_to_text(bad)
    assert bad.stage("reward.post_process").mismatches == 4


def test_a_multi_rank_bundle_is_refused_naming_the_batch_std(tmp_path):
    path = bundle(tmp_path, "dp2", trl_batch_scaled(RAW), rank={"dp": 2})
    with pytest.raises(UnsupportedError) as err:
        replay(path)
    assert str(err.value) == (
        f"{path / 'index.json'}: $.config.grpo_std_scope='batch' with $.identity.rank.dp=2: the std of the whole "
        "generation batch spans every data-parallel rank; a bundle would need that batch std recorded "
        "(reward.post_process recomputes it from one rank's samples only)")
    cli = subprocess.run([sys.executable, "-c", "import sys; from replay_lib.cli import main; sys.exit(main())", "replay", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 4, cli.stderr
    assert "Traceback" not in cli.stderr


def test_an_unknown_scope_is_invalid_input(tmp_path):
    path = producer.write(tmp_path / "b", raw=RAW, groups=GROUPS, lengths=[2] * 4, rewards=BY_HAND,
                          advantages=np.repeat(BY_HAND, 2), **dict(CONFIG, grpo_std_scope="world"))
    cli = subprocess.run([sys.executable, "-c", "import sys; from replay_lib.cli import main; sys.exit(main())", "replay", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 3
    assert "$.config.grpo_std_scope='world': expected one of group, batch" in cli.stderr + cli.stdout


def test_the_group_std_hypotheses_are_not_offered_under_a_batch_std(tmp_path):
    # explain's reward hypotheses vary the group-std formula; under grpo_std_scope=batch they would be built on
    # the wrong formula, so none is offered (the divergence is still named at reward.post_process)
    from replay_lib.explain.reward import modelled
    from replay_lib.bundle.schema import RecomputeConfig
    assert modelled(RecomputeConfig(grpo_std_normalization=True)) is True
    assert modelled(RecomputeConfig(**CONFIG)) is False


@pytest.mark.parametrize("selection", [dict(groups=("0",)), dict(samples=("s-3",))])
def test_a_partial_selection_divides_by_the_whole_batch_std(tmp_path, selection):
    # --group 0 / --sample s-3: the selected rewards are still divided by the std of all four (√(14/3)), not of the
    # selection's
    from replay_lib.bundle.selection import Selection
    report = replay(bundle(tmp_path, "b", trl_batch_scaled(RAW)), selection=Selection(**selection),
                    stages=None)
    post = report.stage("reward.post_process")
    assert (report.passed, post.mismatches) == (True, 0), report_to_text(report)


@pytest.mark.parametrize("selection", [dict(), dict(groups=("1",))])
def test_exact_mode_recomputes_trls_float32_values(tmp_path, selection):
    from replay_lib.bundle.selection import Selection
    from replay_lib.judge.error_model import Rules
    report = replay(bundle(tmp_path, "b", trl_batch_scaled(RAW)), selection=Selection(**selection),
                    stages=None, rules=Rules(exact=True))
    assert report.stage("reward.post_process").status == "pass", report_to_text(report)


def test_the_why_line_of_a_reward_names_the_batch_std(tmp_path):
    from replay_lib.bundle import open_bundle
    from replay_lib.explain.inputs import element_inputs
    from replay_lib.stages import StageContext
    reader = open_bundle(bundle(tmp_path, "b", trl_batch_scaled(RAW))).shards[0]
    ctx = StageContext(reader=reader, indices=[2, 3], partial=True)  # --group 1: s-2, s-3
    why = element_inputs(ctx, "reward", 1)
    assert why.formula == ("(r − mean) / (std + eps) = (6.0 − 4.0) / (2.1602469 + 0.0001) = 0.92577724 "
                           "(the whole batch's std)"), why.formula
