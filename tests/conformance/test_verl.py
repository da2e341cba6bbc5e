"""verl 0.9.1's own code as the producer (verl/trainer/ppo/core_algos.py, verl/utils/metric/utils.py, installed):
random GRPO-family steps with trailing padding, interior masked spans (tool tokens inside a response), a fully
masked sample and three micro-batches below the mini-batch, in float32 and with bf16 inputs; each bundle is mapped
by ``from_verl`` and must replay with 0 divergences, and an injected bug must be named at its stage.

The actor's loss glue is verl/workers/utils/losses.py:55-140 ``ppo_loss`` (its TensorDict plumbing needs the
uninstalled ``tensordict``): per micro-batch, ``global_batch_info`` = dp_size, the all-reduced
``batch_num_tokens`` (fsdp/transformer_impl.py:730-734) and ``global_batch_size`` = ppo_mini_batch_size · n
(trainer/ppo/v1/trainer_base.py), the policy loss function (core_algos.py ``get_policy_loss_fn``), its metrics
aggregated ``AggregationType.MEAN`` over the micro-batches and the loss ``AggregationType.SUM`` (losses.py:72-79,
120-121) — reproduced here with verl's own ``Metric``."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest,
                                      SampleRecord, StageId, stage_contracts)
from replay_lib.demo import producer
from replay_lib.frameworks import from_verl

from .conftest import import_verl

core_algos, metric = import_verl()

N, GROUPS = 4, 2
B = N * GROUPS
MICRO = [[0, 1, 2], [3, 4, 5], [6, 7]]  # three micro-batches below the mini-batch of 8
STAGES = [StageId.SAMPLE, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_ESTIMATE, StageId.LOSS_POLICY]

# (verl config, policy loss mode): the sweep
CONFIGS = {
    "grpo-token-mean": ({"adv_estimator": "grpo"}, {"loss_agg_mode": "token-mean", "clip_ratio_high": 0.28}),
    "grpo-c10-seq-mean": ({"adv_estimator": "grpo"}, {"loss_agg_mode": "seq-mean-token-mean", "clip_ratio_c": 10.0}),
    "drgrpo-seq-sum-norm": ({"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": False},
                            {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 24}),
    "rloo-token-sum": ({"adv_estimator": "rloo"}, {"loss_agg_mode": "token-sum"}),
    "rloo-vectorized": ({"adv_estimator": "rloo_vectorized"}, {"loss_agg_mode": "token-mean"}),
    "gspo-token-mean": ({"adv_estimator": "grpo"}, {"loss_agg_mode": "token-mean",
                                                    "policy_loss": {"loss_mode": "gspo"}}),
    # PPO-clip against the rollout log-probs (the bundle's old_log_probs: ray_trainer.py:1575-1579 overwrites them)
    "bypass-token-mean": ({"adv_estimator": "grpo"}, {"loss_agg_mode": "token-mean", "clip_ratio_high": 0.28,
                                                      "policy_loss": {"loss_mode": "bypass_mode"}}),
}


def verl_config(name: str) -> dict:
    algo, actor = CONFIGS[name]
    return {"algorithm": algo, "actor_rollout_ref": {"rollout": {"n": N}, "actor": {
        "ppo_mini_batch_size": GROUPS, **actor}}}


class _ActorConfig(dict):
    """What the policy loss functions read of verl's ActorConfig: attributes, ``get`` and global_batch_info."""

    __getattr__ = dict.get


def _step(seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 24, (B,), generator=g)
    width = 24
    valid = torch.arange(width)[None, :] < lengths[:, None]
    mask = valid.clone()
    for i in range(B):  # an interior tool span in every other response
        if i % 2 == 0 and int(lengths[i]) > 8:
            start = int(torch.randint(1, int(lengths[i]) - 5, (1,), generator=g))
            mask[i, start:start + 3] = False
    mask[5] = False  # a fully masked sample (its score still counts in its group)
    old = (-torch.rand(B, width, generator=g) * 2).to(dtype).float()
    logp = (old + torch.randn(B, width, generator=g) * 0.3).to(dtype).float()
    logp[1, 2] = old[1, 2] + 1.6  # past the dual-clip bound where A < 0, and clipped elsewhere
    scores = torch.randint(0, 3, (B,), generator=g).float()
    return lengths, valid, mask.float(), old, logp, scores


def _advantages(est: str, algo: dict, scores, lengths, mask, width):
    token_scores = torch.zeros(B, width)
    token_scores[torch.arange(B), lengths - 1] = scores  # the score on the last response token
    index = [i // N for i in range(B)]
    fn = core_algos.get_adv_estimator_fn(est)
    kwargs = dict(token_level_rewards=token_scores, response_mask=mask, index=index, config=None)
    if est == "grpo":
        kwargs["norm_adv_by_std_in_grpo"] = algo.get("norm_adv_by_std_in_grpo", True)
    adv, _ = fn(**kwargs)
    # each sample's normalized score (its advantage on an unmasked response) for the bundle's rewards
    whole, _ = fn(**dict(kwargs, response_mask=torch.ones(B, width)))
    return adv, whole[:, 0]


def _loss(actor: dict, old, logp, adv, mask, bug: bool):
    mode = (actor.get("policy_loss") or {}).get("loss_mode", "vanilla")
    cfg = _ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=actor.get("clip_ratio_high", 0.2),
                       clip_ratio_c=actor.get("clip_ratio_c", 3.0))
    cfg["global_batch_info"] = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B,
                                    loss_scale_factor=actor.get("loss_scale_factor"))
    if mode == "bypass_mode":  # what apply_bypass_mode hands the actor (rollout_corr.py:1141-1144)
        cfg["policy_loss"] = {"rollout_correction": {"loss_type": "ppo_clip", "rollout_is": None}}  # bypass_ppo_clip()
    fn = core_algos.get_policy_loss_fn(mode)
    if mode == "gspo":  # compute_policy_loss_gspo asserts an ActorConfig; its reads are the same attributes
        fn = getattr(fn, "__wrapped__", fn)
        core_algos.ActorConfig = _ActorConfig  # noqa: the isinstance check of core_algos.py:1570
    metrics: dict[str, metric.Metric] = {}
    pg = metric.Metric(aggregation=metric.AggregationType.SUM)
    for rows in MICRO:
        a = -adv[rows] if bug else adv[rows]
        loss, pg_metrics = fn(old_log_prob=old[rows], log_prob=logp[rows], advantages=a,
                              response_mask=mask[rows].bool(), loss_agg_mode=actor["loss_agg_mode"], config=cfg)
        pg.append(loss)
        for key, m in metric.Metric.from_dict(pg_metrics, aggregation=metric.AggregationType.MEAN).items():
            metrics.setdefault(key, metric.Metric(aggregation=metric.AggregationType.MEAN)).extend(m)
    out = {"loss": pg.aggregate(), "pg_loss": pg.aggregate(), "pg_clipfrac": metrics["actor/pg_clipfrac"].aggregate(),
           "ppo_kl": metrics["actor/ppo_kl"].aggregate()}
    if mode in ("vanilla", "bypass_mode"):
        out["pg_clipfrac_lower"] = metrics["actor/pg_clipfrac_lower"].aggregate()
    return {k: float(v) for k, v in out.items()}


def write_verl_bundle(path, name: str, seed: int, dtype: torch.dtype, bug: str = "") -> str:
    algo, actor = CONFIGS[name]
    lengths, valid, mask, old, logp, scores = _step(seed, dtype)
    adv, normalized = _advantages(algo["adv_estimator"], algo, scores, lengths, mask, valid.shape[1])
    policy = _loss(actor, old, logp, adv, mask, bug == "loss-sign")
    if bug == "advantage-shift":  # the advantages one token late
        adv = torch.roll(adv, 1, dims=1)
    cfg = from_verl(verl_config(name), version="0.9.1")
    cfg = msgspec.structs.replace(cfg, loss_token_count=int(mask.sum()))
    mb_of = {i: f"mb-{k}" for k, rows in enumerate(MICRO) for i in rows}
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i // N, response_length=int(lengths[i]),
                            total_length=int(lengths[i]) + 7, loss_mask=[int(v) for v in mask[i, :lengths[i]]],
                            raw_reward=float(scores[i]), micro_batch_id=mb_of[i]) for i in range(B)]
    index = BundleIndex(bundle_id=f"verl-{name}", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0),
                                                                    micro_batch_ids=sorted(set(mb_of.values()))),
                        samples=samples, config=cfg)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=f"verl-{name}", producer=producer(),
                        stage_contracts=stage_contracts(STAGES), payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    expected = {"reward.post_process": {"rewards": [float(v) for v in normalized]}, "loss.policy": policy}
    writer = BundleWriter(path, manifest, index, expected)
    v = valid
    for pname, values in (("log_probs", logp), ("old_log_probs", old), ("advantages", adv)):
        writer.write_payload(pname, values[v].to(dtype) if dtype != torch.float32 else values[v])
    return writer.finalize(ranks=[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_verl_step_replays_clean(tmp_path, cli, name, dtype):
    bundle = write_verl_bundle(tmp_path / "b", name, seed=7, dtype=dtype)
    code, out, err = cli("replay", bundle, "--format", "json")
    report = json.loads(out)
    assert (code, err, report["first_divergent_stage"]) == (0, "", None), out


@pytest.mark.parametrize("name, bug, stage", [("grpo-token-mean", "loss-sign", "loss.policy"),
                                             ("grpo-token-mean", "advantage-shift", "advantage.estimate"),
                                             ("bypass-token-mean", "loss-sign", "loss.policy")])
def test_verl_injected_bug_is_named_at_its_stage(tmp_path, cli, name, bug, stage):
    bundle = write_verl_bundle(tmp_path / "b", name, seed=7, dtype=torch.float32, bug=bug)
    code, out, err = cli("replay", bundle, "--format", "json")
    assert (code, json.loads(out)["first_divergent_stage"]) == (1, stage), out + err
