"""verl 0.9.1's own advantage estimators as the producer (verl/trainer/ppo/core_algos.py, installed): OPO, GPG,
pass@k GRPO, ReMax and GDPO on random steps with trailing padding, interior masked spans (tool tokens inside a
response) and a fully masked sample, float32 and bf16-stored advantages; each bundle is mapped by ``from_verl`` and
must replay with 0 divergences, and an injected bug must be named at its stage.

The recorded normalized rewards (what a capture writes as ``reward.post_process.rewards``) are read off verl's own
output too: the advantage at a token of an unmasked response (``response_mask`` all ones), except OPO, whose
baseline weights by the response mask: there each sample's value is ``r_i − b`` with the group's baseline
``b = r_j − A_j`` read from a sample ``j`` of the group with a loss token."""

from __future__ import annotations

import json

import pytest
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest,
                                      SampleRecord, StageId, stage_contracts)
from replay_lib.demo import producer
from replay_lib.frameworks import from_verl

from .conftest import import_verl

core_algos, metric = import_verl()

N, GROUPS = 4, 3
B = N * GROUPS
WIDTH = 20
STAGES = [StageId.SAMPLE, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_ESTIMATE]
KEYS = ["accuracy_reward", "format_reward"]

CONFIGS = {
    "opo": {"adv_estimator": "opo"},
    "gpg": {"adv_estimator": "gpg"},
    "grpo_passk": {"adv_estimator": "grpo_passk"},
    "grpo_passk-no-std": {"adv_estimator": "grpo_passk", "norm_adv_by_std_in_grpo": False},
    "remax": {"adv_estimator": "remax"},
    "gdpo": {"adv_estimator": "gdpo", "gdpo_reward_keys": KEYS},
    "gdpo-weighted": {"adv_estimator": "gdpo", "gdpo_reward_keys": KEYS, "gdpo_reward_weights": [1.0, 0.5]},
    # the KL in the reward (apply_kl_penalty: token_level_rewards = scores − β·kld·mask, ray_trainer.py:78-112)
    "remax-kl-in-reward": {"adv_estimator": "remax", "use_kl_in_reward": True, "kl_penalty": "kl",
                           "kl_ctrl": {"kl_coef": 0.05}},
    "reinforce_plus_plus-kl-in-reward": {"adv_estimator": "reinforce_plus_plus", "use_kl_in_reward": True,
                                         "kl_penalty": "kl", "kl_ctrl": {"kl_coef": 0.05}},
}


class _Algo(dict):
    """What the estimators read of verl's AlgoConfig: attributes and ``get``."""

    __getattr__ = dict.get


def verl_config(name: str) -> dict:
    return {"algorithm": CONFIGS[name], "actor_rollout_ref": {"rollout": {"n": N}, "actor": {
        "ppo_mini_batch_size": GROUPS}}}


def _step(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, WIDTH, (B,), generator=g)
    valid = torch.arange(WIDTH)[None, :] < lengths[:, None]
    mask = valid.clone()
    for i in range(B):  # an interior tool span in every other response
        if i % 2 == 0 and int(lengths[i]) > 8:
            start = int(torch.randint(1, int(lengths[i]) - 5, (1,), generator=g))
            mask[i, start:start + 3] = False
    mask[5] = False  # a fully masked sample (its score still counts in its group)
    scores = torch.randint(0, 3, (B,), generator=g).float()
    scores[:N] = torch.tensor([2.0, 0.0, 1.0, 1.0])  # a unique best
    scores[N:2 * N] = torch.tensor([2.0, 0.0, 2.0, 1.0])  # a tie at the top: pass@k gives 0 to all
    baselines = torch.randint(0, 3, (B,), generator=g).float() * 0.5
    kld = (torch.randn(B, WIDTH, generator=g) * 0.3).abs() * valid  # a k1 estimate per token
    comps = torch.stack([torch.randint(0, 3, (B,), generator=g).float(),
                         torch.randint(0, 2, (B,), generator=g).float() * 0.25], dim=1)
    return lengths, valid, mask.float(), scores, baselines, comps, kld


def _call(algo: dict, lengths, scores, baselines, comps, mask, kld=None):
    token_scores = torch.zeros(B, WIDTH)
    token_scores[torch.arange(B), lengths - 1] = scores  # the score on the last response token
    if algo.get("use_kl_in_reward"):  # apply_kl_penalty: scores − β·(kld · response_mask)
        token_scores = token_scores - algo["kl_ctrl"]["kl_coef"] * (kld * mask)
    index = [f"uid-{i // N}" for i in range(B)]
    est = algo["adv_estimator"]
    fn = core_algos.get_adv_estimator_fn(est)
    config = _Algo(algo, gamma=1.0)
    kwargs = dict(token_level_rewards=token_scores, response_mask=mask, index=index, config=config)
    if est == "remax":
        kwargs["reward_baselines"] = baselines
    if est == "gdpo":  # compute_advantage's extra arguments (ray_trainer.py:260-263)
        prompt = 5
        kwargs["non_tensor_batch"] = {k: comps[:, j].numpy() for j, k in enumerate(KEYS)}
        attention = torch.cat([torch.ones(B, prompt), (torch.arange(WIDTH)[None, :] < lengths[:, None]).long()], 1).long()
        kwargs["batch"] = {"prompts": torch.zeros(B, prompt), "attention_mask": attention}
    adv, _ = fn(**kwargs)
    return adv


def _normalized(algo: dict, lengths, scores, baselines, comps, mask, adv) -> list[float]:
    """Each sample's value before the broadcast, read off verl's output (module doc)."""
    est = algo["adv_estimator"]
    if algo.get("use_kl_in_reward"):  # the KL stays per token: what post_process passes on is the score (− b)
        return [float(scores[i]) - (float(baselines[i]) if est == "remax" else 0.0) for i in range(B)]
    if est == "gdpo":  # the weighted sum of the per-component GRPO values, before masked_whiten
        seen = {}
        whiten = core_algos.verl_F.masked_whiten
        core_algos.verl_F.masked_whiten = lambda values, m, *a, **k: seen.setdefault("sum", values.clone())
        try:
            _call(algo, lengths, scores, baselines, comps, torch.ones(B, WIDTH))
        finally:
            core_algos.verl_F.masked_whiten = whiten
        return [float(v) for v in seen["sum"][:, 0]]
    if est != "opo":
        whole = _call(algo, lengths, scores, baselines, comps, torch.ones(B, WIDTH))
        return [float(v) for v in whole[:, 0]]
    out = []
    for i in range(B):
        j = next(j for j in range(i // N * N, i // N * N + N) if mask[j].any())
        t = int(torch.nonzero(mask[j])[0])
        out.append(float(scores[i]) - (float(scores[j]) - float(adv[j, t])))
    return out


def write_bundle(path, name: str, seed: int, dtype: torch.dtype = torch.float32, bug: str = "") -> str:
    algo = CONFIGS[name]
    lengths, valid, mask, scores, baselines, comps, kld = _step(seed)
    adv = _call(algo, lengths, scores, baselines, comps, mask, kld)
    normalized = _normalized(algo, lengths, scores, baselines, comps, mask, adv)
    if bug == "advantage-shift":  # the advantages one token late
        adv = torch.roll(adv, 1, dims=1)
    if bug == "reward-shift":  # one sample's normalized reward a quarter off
        normalized[0] += 0.25
    cfg = from_verl(verl_config(name), version="0.9.1")
    extra = {}
    samples = []
    for i in range(B):
        if algo["adv_estimator"] == "remax":
            extra = {"reward_baseline": float(baselines[i])}
        if algo["adv_estimator"] == "gdpo":
            extra = {"reward_components": [float(v) for v in comps[i]]}
        samples.append(SampleRecord(sample_id=f"s-{i}", group_index=i // N, response_length=int(lengths[i]),
                                    total_length=int(lengths[i]) + 7,
                                    loss_mask=[int(v) for v in mask[i, :lengths[i]]], raw_reward=float(scores[i]),
                                    **extra))
    index = BundleIndex(bundle_id=f"verl-{name}", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=cfg)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=f"verl-{name}", producer=producer(),
                        stage_contracts=stage_contracts(STAGES), payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    expected = {"reward.post_process": {"rewards": normalized}}
    writer = BundleWriter(path, manifest, index, expected)
    writer.write_payload("advantages", adv[valid].to(dtype) if dtype != torch.float32 else adv[valid])
    if algo.get("use_kl_in_reward"):  # the in-reward KL as verl stores it: kld · response_mask
        writer.write_payload("kl", (kld * mask)[valid])
    return writer.finalize(ranks=[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_verl_estimator_replays_clean(tmp_path, cli, name, dtype):
    bundle = write_bundle(tmp_path / "b", name, seed=11, dtype=dtype)
    code, out, err = cli("replay", bundle, "--format", "json")
    report = json.loads(out)
    assert (code, err, report["first_divergent_stage"]) == (0, "", None), out


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("bug, stage", [("advantage-shift", "advantage.estimate"),
                                        ("reward-shift", "reward.post_process")])
def test_verl_estimator_bug_is_named_at_its_stage(tmp_path, cli, name, bug, stage):
    bundle = write_bundle(tmp_path / "b", name, seed=11, bug=bug)
    code, out, err = cli("replay", bundle, "--format", "json")
    assert (code, json.loads(out)["first_divergent_stage"]) == (1, stage), out + err


def test_verl_estimator_seeds_replay_clean(tmp_path, cli):
    """More random steps of every estimator (their groups, ties and masks differ)."""
    for seed in range(3):
        for name in CONFIGS:
            bundle = write_bundle(tmp_path / f"{name}-{seed}", name, seed=seed)
            code, out, err = cli("replay", bundle, "--format", "json")
            assert (code, json.loads(out)["first_divergent_stage"]) == (0, None), (name, seed, out)
