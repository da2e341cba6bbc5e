"""verl 0.9.1's rollout correction with its own functions as the producer: ``rollout_is_batch_normalize`` (the
weights divided by the batch mean ``rollout_corr_helper.py:627-655`` logs as ``rollout_is_batch_norm_factor``) and
bypass mode's two loss types (``core_algos.py:2413-2552``): ``ppo_clip`` (the vanilla loss against the rollout
log-probs, rejection sampling from the *current* log-probs) and ``reinforce`` (``compute_policy_loss_reinforce``:
``−A·logp·w``, ``w`` the detached weight of the current log-probs against the rollout ones).

``compute_policy_loss_bypass_mode`` wraps the weights in a ``DataProto`` (its ``TensorDict`` is stubbed here), so
its steps are taken one by one exactly as it takes them (core_algos.py:2484-2552): ``log_ratio = log_prob −
rollout`` into ``compute_rollout_correction_weights`` and ``compute_rollout_rejection_mask`` (the original mask),
then the loss function on the rejected mask. Each bundle is mapped by ``from_verl`` and replays with 0
divergences; each injected bug is named at its stage."""

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
from replay_lib.kernels.mismatch import IS_NORM_METRIC

from .conftest import import_verl

core_algos, metric = import_verl()

from .test_verl import GROUPS, MICRO, N, B, _ActorConfig, _advantages, _step  # noqa: E402

STAGES = [StageId.SAMPLE, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_ESTIMATE, StageId.LOSS_POLICY]

# name → algorithm.rollout_correction (the verl presets of algorithm.py:280-540 and the decoupled TIS/IcePop with
# batch normalization)
CASES = {
    "decoupled-token-tis-norm": {"rollout_is": "token", "rollout_is_threshold": 2.0,
                                 "rollout_is_batch_normalize": True},
    "decoupled-seq-icepop-norm": {"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0",
                                  "rollout_is_batch_normalize": True},
    "bypass-pg-is": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence",
                     "rollout_is_threshold": 2.0},
    "bypass-pg-token-icepop": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token",
                               "rollout_is_threshold": "0.5_5.0"},
    "bypass-pg-rs": {"bypass_mode": True, "loss_type": "reinforce", "rollout_rs": "token_k1",
                     "rollout_rs_threshold": "0.8_1.25"},
    "bypass-ppo-clip-k3-rs": {"bypass_mode": True, "loss_type": "ppo_clip", "rollout_rs": "seq_mean_k3",
                              "rollout_rs_threshold": 0.06},
}


def verl_config(rc: dict) -> dict:
    return {"algorithm": {"adv_estimator": "grpo", "rollout_correction": rc},
            "actor_rollout_ref": {"rollout": {"n": N}, "actor": {"ppo_mini_batch_size": GROUPS,
                                                                 "loss_agg_mode": "token-mean"}}}


def _metrics_of(per_micro: list[dict]) -> dict:
    out: dict[str, metric.Metric] = {}
    for pg_metrics in per_micro:
        for key, m in metric.Metric.from_dict(pg_metrics, aggregation=metric.AggregationType.MEAN).items():
            out.setdefault(key, metric.Metric(aggregation=metric.AggregationType.MEAN)).extend(m)
    return {k: float(m.aggregate()) for k, m in out.items()}


def _produce(rc: dict, old, rollout, logp, adv, mask, bug: str):
    """verl's loss of the step (summed over the micro-batches, metrics averaged), the batch-norm factor it logs
    (None without one)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights, compute_rollout_rejection_mask

    cfg = _ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    cfg["global_batch_info"] = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B)
    is_kwargs = dict(rollout_is=rc.get("rollout_is"), rollout_is_threshold=rc.get("rollout_is_threshold", 2.0),
                     rollout_is_batch_normalize=rc.get("rollout_is_batch_normalize", False))
    pg = metric.Metric(aggregation=metric.AggregationType.SUM)
    per_micro, factor = [], None
    if not rc.get("bypass_mode"):  # decoupled: the weights of the whole batch (ray_trainer.py:1649-1658)
        weights, is_metrics = compute_rollout_correction_weights(old - rollout, mask, **is_kwargs)
        factor = is_metrics.get("rollout_is_batch_norm_factor")
        if bug == "norm-local":  # the mean of the first micro-batch's weights logged as the batch's factor
            _, local = compute_rollout_correction_weights((old - rollout)[MICRO[0]], mask[MICRO[0]], **is_kwargs)
            weights = weights * factor / local["rollout_is_batch_norm_factor"]
            factor = local["rollout_is_batch_norm_factor"]
        for rows in MICRO:
            loss, m = core_algos.compute_policy_loss_vanilla(
                old_log_prob=old[rows], log_prob=logp[rows], advantages=adv[rows], response_mask=mask[rows].bool(),
                loss_agg_mode="token-mean", config=cfg, rollout_is_weights=weights[rows])
            pg.append(loss)
            per_micro.append(m)
    else:  # bypass: inside the loss, per micro-batch (core_algos.py:2484-2552), old_log_prob = rollout
        for rows in MICRO:
            anchor = rollout[rows] if bug == "anchor-old" else logp[rows]
            log_ratio = anchor - rollout[rows]
            weights = None
            if rc.get("rollout_is") is not None:
                weights, _ = compute_rollout_correction_weights(log_ratio, mask[rows], **is_kwargs)
            effective = mask[rows]
            if rc.get("rollout_rs") is not None:
                effective, _ = compute_rollout_rejection_mask(log_ratio, mask[rows], rollout_rs=rc["rollout_rs"],
                                                              rollout_rs_threshold=rc["rollout_rs_threshold"])
            if rc["loss_type"] == "reinforce":
                loss, m = core_algos.compute_policy_loss_reinforce(
                    rollout_log_prob=rollout[rows], log_prob=logp[rows], advantages=adv[rows],
                    response_mask=effective, loss_agg_mode="token-mean", config=cfg, rollout_is_weights=weights)
            else:
                loss, m = core_algos.compute_policy_loss_vanilla(
                    old_log_prob=rollout[rows], log_prob=logp[rows], advantages=adv[rows], response_mask=effective,
                    loss_agg_mode="token-mean", config=cfg, rollout_is_weights=None)
            pg.append(loss)
            per_micro.append(m)
    metrics = _metrics_of(per_micro)
    policy = {"loss": float(pg.aggregate()), "pg_loss": float(pg.aggregate())}
    if rc.get("loss_type", "ppo_clip") == "ppo_clip":
        policy.update(pg_clipfrac=metrics["actor/pg_clipfrac"], ppo_kl=metrics["actor/ppo_kl"],
                      pg_clipfrac_lower=metrics["actor/pg_clipfrac_lower"])
    return policy, factor


def write_bundle(path, name: str, seed: int, bug: str = "") -> str:
    rc = CASES[name]
    lengths, valid, mask, old, logp, scores = _step(seed, torch.float32)
    g = torch.Generator().manual_seed(seed + 1000)
    rollout = old + 0.15 * torch.randn(old.shape, generator=g)  # the engine's log-probs of the same tokens
    if rc.get("bypass_mode"):  # apply_bypass_mode: old_log_probs := rollout_log_probs (rollout_corr.py:1130-1139)
        old = rollout.clone()
    adv, normalized = _advantages("grpo", {}, scores, lengths, mask, valid.shape[1])
    policy, factor = _produce(rc, old, rollout, logp, adv, mask, bug)
    cfg = from_verl(verl_config(rc), version="0.9.1")
    extra = {"loss_token_count": int(mask.sum())}
    if factor is not None:
        extra["is_batch_norm_factor"] = float(factor)
    cfg = msgspec.structs.replace(cfg, **extra)
    mb_of = {i: f"mb-{k}" for k, rows in enumerate(MICRO) for i in rows}
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i // N, response_length=int(lengths[i]),
                            total_length=int(lengths[i]) + 7, loss_mask=[int(v) for v in mask[i, :lengths[i]]],
                            raw_reward=float(scores[i]), micro_batch_id=mb_of[i]) for i in range(B)]
    index = BundleIndex(bundle_id=f"verl-rc-{name}", identity=Identity(
        actor_step_id=ActorStepId(rollout_id=1, step_id=0), micro_batch_ids=sorted(set(mb_of.values()))),
        samples=samples, config=cfg)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id=f"verl-rc-{name}", producer=producer(),
                        stage_contracts=stage_contracts(STAGES), payloads={}, comparison_policy=ComparisonPolicy(),
                        redaction={})
    expected = {"reward.post_process": {"rewards": [float(v) for v in normalized]}, "loss.policy": policy}
    if factor is not None:
        expected["logprob.mismatch"] = {IS_NORM_METRIC: float(factor)}
    writer = BundleWriter(path, manifest, index, expected)
    for pname, values in (("log_probs", logp), ("old_log_probs", old), ("advantages", adv),
                          ("rollout_log_probs", rollout)):
        writer.write_payload(pname, values[valid])
    return writer.finalize(ranks=[0])


def test_the_mapping():
    norm = from_verl(verl_config(CASES["decoupled-token-tis-norm"]), version="0.9.1")
    assert (norm.is_level, norm.is_high, norm.is_batch_normalize, norm.rollout_correction_anchor) == (
        "token", 2.0, True, msgspec.UNSET)
    pg = from_verl(verl_config(CASES["bypass-pg-is"]), version="0.9.1")
    assert (pg.policy_loss, pg.is_level, pg.is_high, pg.is_log_clamp, pg.rollout_correction_anchor,
            pg.eps_clip_c, pg.log_ratio_clamp) == ("gpg", "sequence", 2.0, 20.0, "current", None, None)
    clip = from_verl(verl_config(CASES["bypass-ppo-clip-k3-rs"]), version="0.9.1")
    assert (clip.policy_loss, clip.is_level, clip.rollout_rs, clip.rollout_correction_anchor) == (
        "ppo", None, "seq_mean_k3", "current")


@pytest.mark.parametrize("name", list(CASES))
def test_verl_rollout_correction_replays_clean(tmp_path, cli, name):
    bundle = write_bundle(tmp_path / "b", name, seed=7)
    code, out, err = cli("replay", bundle, "--format", "json")
    report = json.loads(out)
    assert (code, err, report["first_divergent_stage"]) == (0, "", None), out
    stages = {s["stage"]: s for s in report["stages"]}
    assert stages["loss.policy"]["status"] == "pass"
    if "norm" in name:  # the logged factor recomputed and compared
        assert stages["logprob.mismatch"]["reason"].endswith("; 1 recorded metric(s) compared")


def test_rejection_sampling_in_bypass_mode_rejects_some_tokens(tmp_path):
    """The bypass rejection cases are not vacuous: verl's own mask drops some loss tokens and keeps others."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    for name in ("bypass-pg-rs", "bypass-ppo-clip-k3-rs"):
        rc = CASES[name]
        lengths, valid, mask, old, logp, scores = _step(7, torch.float32)
        rollout = old + 0.15 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1007))
        kept, _ = compute_rollout_rejection_mask(logp - rollout, mask, rollout_rs=rc["rollout_rs"],
                                                 rollout_rs_threshold=rc["rollout_rs_threshold"])
        assert 0 < int(kept.sum()) < int(mask.sum()), name


@pytest.mark.parametrize("name, bug, stage, reason", [
    # the factor of one micro-batch logged as the batch's: the loss used it consistently, the mean differs
    ("decoupled-token-tis-norm", "norm-local", "logprob.mismatch",
     "mismatch metric(s) differ: rollout_corr/rollout_is_batch_norm_factor"),
    # bypass weights anchored on old_log_probs (= rollout: every weight 1) instead of the current log-probs
    ("bypass-pg-is", "anchor-old", "loss.policy", None),
    ("bypass-ppo-clip-k3-rs", "anchor-old", "loss.policy", None),
])
def test_verl_injected_bug_is_named_at_its_stage(tmp_path, cli, name, bug, stage, reason):
    bundle = write_bundle(tmp_path / "b", name, seed=7, bug=bug)
    code, out, err = cli("replay", bundle, "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergent_stage"]) == (1, stage), out + err
    if reason is not None:
        got = next(s for s in report["stages"] if s["stage"] == stage)["reason"]
        assert got.startswith(reason), got
    if bug == "norm-local":  # the explanation names the micro-batch whose mean was logged
        why = [e for e in report["explanations"] if e["stage"] == stage]
        assert [(e["hypothesis"], e["matched"], e["of"]) for e in why] == [("batch_norm_partial", 1, 3)], why
        assert why[0]["detail"].startswith("the recorded rollout_corr/rollout_is_batch_norm_factor ")
        assert " is the mean over micro-batch mb-0 alone (" in why[0]["detail"]


def test_normalize_without_the_recorded_factor_names_it(tmp_path, cli):
    """The same step recorded without the factor: the dependency closure names what to record (exit 3, one
    line), as for any recorded count a stage needs."""
    from replay_lib.bundle import BundleReader
    from replay_lib.bundle.loss_knobs import LossKnobs

    reader = BundleReader(write_bundle(tmp_path / "b", "decoupled-token-tis-norm", seed=7))
    cfg = msgspec.structs.replace(reader.index.config, is_batch_norm_factor=msgspec.UNSET)
    assert LossKnobs.of(cfg).is_norm is None
    code, out, err = cli("replay", _rewritten(tmp_path / "c", reader, cfg), "--stage", "loss.policy")
    assert code == 3, out + err
    assert err.endswith("manifest.json: dependency closure incomplete: loss.policy needs index.json "
                        "$.config.is_batch_norm_factor (is_batch_normalize divides the importance weights by the "
                        "step's recorded batch mean: verl's rollout_corr/rollout_is_batch_norm_factor)\n"), err
    assert err.count("\n") == 1


def _rewritten(path, reader, cfg) -> str:
    """``reader``'s bundle written again with ``cfg`` (a new bundle: the writer never overwrites)."""
    index = msgspec.structs.replace(reader.index_with_masks(), config=cfg)
    writer = BundleWriter(path, reader.manifest, index, reader.expected)
    for name in ("log_probs", "old_log_probs", "advantages", "rollout_log_probs"):
        writer.write_payload(name, reader.payload(name))
    return writer.finalize(ranks=[0])
