"""verl 0.9.1's own registered policy losses as the producer (``core_algos.get_policy_loss_fn``: cispo, sapo,
geo_mean, dppo_tv, dppo_kl, dro, gpg), driven as ``verl/workers/utils/losses.py`` ``ppo_loss`` drives them (per
micro-batch, ``global_batch_info``, the metrics ``AggregationType.MEAN`` over the micro-batches and the loss
``SUM``; see test_verl.py) on random GRPO steps with interior masked spans, a fully masked sample and several
micro-batches, in float32 and with bf16 inputs, under each aggregation mode the family honours. Each bundle is
mapped by ``from_verl`` and must replay with 0 divergences; an injected bug is named at loss.policy."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest,
                                      SampleRecord)
from replay_lib.demo import producer
from replay_lib.frameworks import from_verl
from replay_lib.bundle.schema import stage_contracts

from .conftest import import_verl
from .test_verl import B, GROUPS, MICRO, N, STAGES, _ActorConfig, _advantages, _step

core_algos, metric = import_verl()

EQUAL_MICRO = [[0, 1, 2, 3], [4, 5, 6, 7]]  # GMPO divides by the micro-batch's sequence count: equal ones

# name → (actor config, micro-batches)
CONFIGS = {
    "cispo-token-mean": ({"loss_agg_mode": "token-mean", "clip_ratio_high": 0.28,
                          "policy_loss": {"loss_mode": "cispo"}}, MICRO),
    "cispo-seq-mean": ({"loss_agg_mode": "seq-mean-token-mean", "policy_loss": {"loss_mode": "cispo"}}, MICRO),
    "sapo": ({"loss_agg_mode": "token-mean", "tau_pos": 1.0, "tau_neg": 1.05, "policy_loss": {"loss_mode": "sapo"}},
             MICRO),
    "sapo-steep": ({"loss_agg_mode": "token-mean", "tau_pos": 4.0, "tau_neg": 8.0,
                    "policy_loss": {"loss_mode": "sapo"}}, MICRO),
    "geo-mean": ({"loss_agg_mode": "token-mean", "ppo_micro_batch_size_per_gpu": 4,
                  "policy_loss": {"loss_mode": "geo_mean"}}, EQUAL_MICRO),
    "dppo-tv": ({"loss_agg_mode": "token-mean", "clip_ratio_low": 0.1, "clip_ratio_high": 0.1,
                 "clip_ratio_c": 1.5, "policy_loss": {"loss_mode": "dppo_tv"}}, MICRO),
    "dppo-kl-seq-sum": ({"loss_agg_mode": "seq-mean-token-sum", "clip_ratio_low": 0.02, "clip_ratio_high": 0.02,
                         "policy_loss": {"loss_mode": "dppo_kl"}}, MICRO),
    "dro": ({"loss_agg_mode": "token-mean", "policy_loss": {"loss_mode": "dro", "dro_beta": 0.3}}, MICRO),
    "gpg-token-sum": ({"loss_agg_mode": "token-sum", "policy_loss": {"loss_mode": "gpg"}}, MICRO),
    # KL-Cov: the top 10 % of each micro-batch's loss tokens by cov(A, logp)
    "kl-cov": ({"loss_agg_mode": "token-mean", "policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 0.1,
                                                               "ppo_kl_coef": 0.5}}, MICRO),
}


def verl_config(name: str) -> dict:
    actor, _ = CONFIGS[name]
    return {"algorithm": {"adv_estimator": "grpo"},
            "actor_rollout_ref": {"rollout": {"n": N}, "actor": {"ppo_mini_batch_size": GROUPS, **actor}}}


def verl_actor_config(actor: dict, mask) -> _ActorConfig:
    """The actor config verl's policy-loss functions read, from ``actor`` (the recipe's actor keys), with the global
    batch info of one data-parallel rank whose step holds ``mask``'s loss tokens."""
    cfg = _ActorConfig(clip_ratio=0.2, clip_ratio_low=actor.get("clip_ratio_low", 0.2),
                       clip_ratio_high=actor.get("clip_ratio_high", 0.2), clip_ratio_c=actor.get("clip_ratio_c", 3.0),
                       tau_pos=actor.get("tau_pos", 1.0), tau_neg=actor.get("tau_neg", 1.05),
                       policy_loss=_ActorConfig(dro_beta=actor["policy_loss"].get("dro_beta"),
                                                kl_cov_ratio=actor["policy_loss"].get("kl_cov_ratio"),
                                                ppo_kl_coef=actor["policy_loss"].get("ppo_kl_coef")))
    cfg["global_batch_info"] = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B,
                                    loss_scale_factor=None)
    return cfg


def _loss(actor: dict, micro, old, logp, adv, mask, bug: bool) -> dict[str, float]:
    mode = actor["policy_loss"]["loss_mode"]
    cfg = verl_actor_config(actor, mask)
    core_algos.ActorConfig = _ActorConfig  # noqa: cispo's and sapo's isinstance checks read the same attributes
    fn = core_algos.get_policy_loss_fn(mode)
    metrics: dict[str, metric.Metric] = {}
    pg = metric.Metric(aggregation=metric.AggregationType.SUM)
    for rows in micro:
        a = -adv[rows] if bug else adv[rows]
        loss, pg_metrics = fn(old_log_prob=old[rows], log_prob=logp[rows], advantages=a,
                              response_mask=mask[rows].bool(), loss_agg_mode=actor["loss_agg_mode"], config=cfg)
        pg.append(loss)
        for key, m in metric.Metric.from_dict(pg_metrics, aggregation=metric.AggregationType.MEAN).items():
            metrics.setdefault(key, metric.Metric(aggregation=metric.AggregationType.MEAN)).extend(m)
    out = {"loss": pg.aggregate(), "pg_loss": pg.aggregate()}
    for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        if f"actor/{key}" in metrics:
            out[key] = metrics[f"actor/{key}"].aggregate()
    return {k: float(v) for k, v in out.items()}


def write_family_bundle(path, name: str, seed: int, dtype: torch.dtype, bug: bool = False) -> str:
    actor, micro = CONFIGS[name]
    lengths, valid, mask, old, logp, scores = _step(seed, dtype)
    adv, normalized = _advantages("grpo", {}, scores, lengths, mask, valid.shape[1])
    return write_bundle_with(path, name, seed, dtype, _loss(actor, micro, old, logp, adv, mask, bug))


def write_bundle_with(path, name: str, seed: int, dtype: torch.dtype, policy: dict, extra=None) -> str:
    """The bundle of the step of ``seed`` under ``CONFIGS[name]`` mapped by ``from_verl``, its loss fields
    ``policy`` as verl reported them, and ``extra`` payloads (name → tensor over the response tokens)."""
    actor, micro = CONFIGS[name]
    lengths, valid, mask, old, logp, scores = _step(seed, dtype)
    adv, normalized = _advantages("grpo", {}, scores, lengths, mask, valid.shape[1])
    cfg = from_verl(verl_config(name), version="0.9.1")
    cfg = msgspec.structs.replace(cfg, loss_token_count=int(mask.sum()))
    mb_of = {i: f"mb-{k}" for k, rows in enumerate(micro) for i in rows}
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
    for pname, values in (("log_probs", logp), ("old_log_probs", old), ("advantages", adv)):
        writer.write_payload(pname, values[valid].to(dtype) if dtype != torch.float32 else values[valid])
    for pname, values in (extra or {}).items():
        writer.write_payload(pname, values)
    return writer.finalize(ranks=[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [7, 8])
def test_verl_family_step_replays_clean(tmp_path, cli, name, dtype, seed):
    bundle = write_family_bundle(tmp_path / "b", name, seed=seed, dtype=dtype)
    code, out, err = cli("replay", bundle, "--format", "json")
    report = json.loads(out)
    loss = next(s for s in report["stages"] if s["stage"] == "loss.policy")
    assert (code, err, report["first_divergent_stage"]) == (0, "", None), loss
    assert loss["compared"] == len(json.load(open(f"{bundle}/expected.json"))["loss.policy"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verl_family_sign_bug_is_named_at_loss_policy(tmp_path, cli, name):
    bundle = write_family_bundle(tmp_path / "b", name, seed=7, dtype=torch.float32, bug=True)
    code, out, err = cli("replay", bundle, "--format", "json")
    assert (code, json.loads(out)["first_divergent_stage"]) == (1, "loss.policy"), out + err
