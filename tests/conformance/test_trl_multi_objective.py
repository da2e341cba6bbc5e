"""TRL 1.16's ``multi_objective_aggregation="normalize_then_sum"`` as the producer: a reference written from
``trl/trainer/grpo_trainer.py:2790-2799`` (the aggregation is inline in ``_generate_and_score_completions``) that calls
TRL's own ``nanstd`` (``trl/trainer/utils.py``): each reward function's output normalized per group,
``(r − mean)/(nanstd + 1e-4)``, the weighted sum (``reward_weights``), then ``(A − mean)/(nanstd + 1e-4)`` over the
whole generation batch. Random steps with two and three reward functions, an interior masked span and a fully masked
completion; the bundle is mapped by ``from_trl`` and must replay clean; a bug must be named at its stage."""

from __future__ import annotations

import json

import pytest
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest,
                                      SampleRecord, StageId, stage_contracts)
from replay_lib.demo import producer
from replay_lib.errors import UnsupportedFrameworkConfig
from replay_lib.frameworks import from_trl

nanstd = pytest.importorskip("trl.trainer.utils").nanstd

G, GROUPS = 4, 3
B = G * GROUPS
STAGES = [StageId.SAMPLE, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_ESTIMATE]


def _config(weights, **kw) -> dict:
    return {"loss_type": "dapo", "num_generations": G, "per_device_train_batch_size": B,
            "gradient_accumulation_steps": 1, "steps_per_generation": None, "generation_batch_size": None,
            "num_iterations": 1, "epsilon": 0.2, "epsilon_high": None, "beta": 0.0, "scale_rewards": "none",
            "importance_sampling_level": "token", "max_completion_length": 16,
            "multi_objective_aggregation": "normalize_then_sum", "top_entropy_quantile": 1.0, "entropy_coef": 0.0,
            "use_vllm": False, "reward_weights": weights, **kw}


def normalize_then_sum(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """grpo_trainer.py:2790-2799, float32 as TRL computes it."""
    grouped = rewards_per_func.view(-1, G, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    std = nanstd(rewards).expand_as(rewards)
    return (rewards - torch.nanmean(rewards)) / (std + 1e-4)


def write_bundle(path, weights, seed: int, bug: str = "") -> str:
    g = torch.Generator().manual_seed(seed)
    k = len(weights)
    comps = torch.randint(0, 3, (B, k), generator=g).float() * torch.tensor([1.0, 0.5, 0.25][:k])
    comps[G:2 * G, 0] = 1.0  # a group where one function's rewards are equal (std 0: divided by 1e-4)
    adv = normalize_then_sum(comps, torch.tensor(weights))
    lengths = torch.randint(3, 9, (B,), generator=g)
    masks = [[1] * int(n) for n in lengths]
    masks[2][1] = 0  # an interior span
    masks[7] = [0] * int(lengths[7])  # a fully masked completion
    if bug == "sum-then-normalize":  # the default aggregation's group normalization of the weighted sum
        s = comps @ torch.tensor(weights)
        m = s.view(-1, G).mean(1, keepdim=True)
        adv = ((s.view(-1, G) - m) / (nanstd(s.view(-1, G), dim=1, keepdim=True) + 1e-4)).view(-1)
    cfg = from_trl(_config(weights))
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i // G, response_length=int(lengths[i]),
                            total_length=int(lengths[i]) + 5, loss_mask=masks[i],
                            raw_reward=float((comps[i] * torch.tensor(weights)).sum()),
                            reward_components=[float(v) for v in comps[i]]) for i in range(B)]
    index = BundleIndex(bundle_id="trl-nts", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=cfg)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id="trl-nts", producer=producer(),
                        stage_contracts=stage_contracts(STAGES), payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    writer = BundleWriter(path, manifest, index, {"reward.post_process": {"rewards": [float(v) for v in adv]}})
    writer.write_payload("advantages", torch.repeat_interleave(adv, lengths))  # each completion's value, broadcast
    return writer.finalize(ranks=[0])


@pytest.mark.parametrize("weights", [[1.0, 0.5], [1.0, 1.0, 2.0]], ids=["two", "three"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_normalize_then_sum_replays_clean(tmp_path, cli, weights, seed):
    code, out, err = cli("replay", write_bundle(tmp_path / "b", weights, seed), "--format", "json")
    assert (code, json.loads(out)["first_divergent_stage"]) == (0, None), out


def test_the_default_aggregation_is_named_at_reward_post_process(tmp_path, cli):
    code, out, err = cli("replay", write_bundle(tmp_path / "b", [1.0, 0.5], 0, bug="sum-then-normalize"),
                         "--format", "json")
    assert (code, json.loads(out)["first_divergent_stage"]) == (1, "reward.post_process"), out


def test_normalize_then_sum_over_several_processes_is_refused_naming_the_record():
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        from_trl(_config([1.0, 0.5], per_device_train_batch_size=B // 2), num_processes=2)
    assert "a bundle would need that batch's mean and std recorded" in str(err.value)
