"""Clip-Cov against verl 0.9.1's own ``compute_policy_loss_clip_cov`` (core_algos.py:1744-1845) as the producer,
driven per micro-batch as test_verl_families.py drives the other families. Its random draw (``torch.randperm``)
is recorded as the bundle's ``clip_cov_mask``: the ``corr`` tensor verl builds (``torch.ones_like(advantages)``,
core_algos.py:1808) is taken from the call itself, so the mask is verl's own selection, never ours. The bundle
mapped by ``from_verl`` replays with 0 divergences in float32 and bf16; without the mask the replay refuses
naming it; a mask selecting a token verl's rule cannot select, or a sign bug, diverges at loss.policy."""

from __future__ import annotations

import json

import pytest
import torch

from .conftest import import_verl
from .test_verl import B, MICRO, _ActorConfig, _advantages, _step
from . import test_verl_families as fam

core_algos, metric = import_verl()

CONFIGS = {
    # the yaml's upper bound 5, a lower one these steps' covariances reach, a ratio that selects a few tokens
    "clip-cov": ({"loss_agg_mode": "token-mean", "policy_loss": {"loss_mode": "clip_cov", "clip_cov_ratio": 0.05,
                                                                 "clip_cov_lb": 0.3}}, MICRO),
    # wide bounds: most loss tokens are candidates, the draw picks 10 % of each micro-batch
    "clip-cov-wide": ({"loss_agg_mode": "seq-mean-token-mean", "clip_ratio_high": 0.28,
                       "policy_loss": {"loss_mode": "clip_cov", "clip_cov_ratio": 0.1, "clip_cov_lb": 0.01,
                                       "clip_cov_ub": 8.0}}, MICRO),
}


def clip_cov_actor_config(actor: dict, pl: dict, mask) -> _ActorConfig:
    """The actor config verl's ``compute_policy_loss_clip_cov`` reads: ``actor``'s clip range, ``pl``'s Clip-Cov
    ratio and bounds, the global batch info of one rank whose step holds ``mask``'s loss tokens."""
    cfg = _ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=actor.get("clip_ratio_high", 0.2),
                       policy_loss=_ActorConfig(clip_cov_ratio=pl.get("clip_cov_ratio"),
                                                clip_cov_lb=pl.get("clip_cov_lb"), clip_cov_ub=pl.get("clip_cov_ub")))
    cfg["global_batch_info"] = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B,
                                    loss_scale_factor=None)
    return cfg


def _verl_clip_cov(actor: dict, micro, old, logp, adv, mask, bug: bool, seed: int, producer=None):
    """verl's loss and metrics per micro-batch, and the ``corr == 0`` tokens of each call ([B, width] bool);
    ``producer``: policy_loss values the producer ran with instead of the declared ones (a bug)."""
    pl = {**actor["policy_loss"], **(producer or {})}
    cfg = clip_cov_actor_config(actor, pl, mask)
    fn = core_algos.get_policy_loss_fn("clip_cov")
    selected = torch.zeros_like(mask, dtype=torch.bool)
    metrics: dict[str, metric.Metric] = {}
    pg = metric.Metric(aggregation=metric.AggregationType.SUM)
    torch.manual_seed(seed)
    ones_like = torch.ones_like
    for rows in micro:
        a = -adv[rows] if bug else adv[rows]
        made = []

        def capture(x, *args, **kwargs):  # verl's corr: the ones_like of the advantages it was handed
            out = ones_like(x, *args, **kwargs)
            if x is a:
                made.append(out)
            return out

        torch.ones_like = capture
        try:
            loss, pg_metrics = fn(old_log_prob=old[rows], log_prob=logp[rows], advantages=a,
                                  response_mask=mask[rows].bool(), loss_agg_mode=actor["loss_agg_mode"], config=cfg)
        finally:
            torch.ones_like = ones_like
        assert len(made) == 1
        selected[rows] = made[0] == 0
        pg.append(loss)
        for key, m in metric.Metric.from_dict(pg_metrics, aggregation=metric.AggregationType.MEAN).items():
            metrics.setdefault(key, metric.Metric(aggregation=metric.AggregationType.MEAN)).extend(m)
    out = {"loss": pg.aggregate(), "pg_loss": pg.aggregate()}
    for key in ("pg_clipfrac", "ppo_kl"):
        out[key] = metrics[f"actor/{key}"].aggregate()
    return {k: float(v) for k, v in out.items()}, selected


def write_clip_cov_bundle(path, name: str, seed: int, dtype: torch.dtype, bug: bool = False, mask_edit=None,
                          with_mask: bool = True, producer=None) -> str:
    actor, micro = CONFIGS[name]
    lengths, valid, mask, old, logp, scores = _step(seed, dtype)
    adv, normalized = _advantages("grpo", {}, scores, lengths, mask, valid.shape[1])
    policy, selected = _verl_clip_cov(actor, micro, old, logp, adv, mask, bug, seed, producer)
    assert int(selected.sum()) >= 1  # the draw selected tokens (a micro-batch without candidates selects none)
    if mask_edit is not None:
        selected = mask_edit(selected, mask)
    fam.CONFIGS[name] = (actor, micro)  # the shared writer reads the config by name
    try:
        drawn = selected[valid] if selected.dim() == 2 else selected  # an edit may hand the token axis itself
        extra = {"clip_cov_mask": drawn.to(torch.int8)} if with_mask else {}
        return fam.write_bundle_with(path, name, seed, dtype, policy, extra)
    finally:
        del fam.CONFIGS[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [7, 8, 9])
def test_verl_clip_cov_step_replays_clean(tmp_path, cli, name, dtype, seed):
    bundle = write_clip_cov_bundle(tmp_path / "b", name, seed=seed, dtype=dtype)
    code, out, err = cli("replay", bundle, "--format", "json")
    report = json.loads(out)
    loss = next(s for s in report["stages"] if s["stage"] == "loss.policy")
    assert (code, err, report["first_divergent_stage"]) == (0, "", None), loss
    assert loss["compared"] == 4 + 3  # loss, pg_loss, pg_clipfrac, ppo_kl; the draw's size in each micro-batch


def test_verl_clip_cov_sign_bug_is_named_at_loss_policy(tmp_path, cli):
    bundle = write_clip_cov_bundle(tmp_path / "b", "clip-cov-wide", seed=7, dtype=torch.float32, bug=True)
    code, out, err = cli("replay", bundle, "--format", "json")
    assert (code, json.loads(out)["first_divergent_stage"]) == (1, "loss.policy"), out + err


def test_a_producer_selecting_tokens_outside_the_bounds_diverges(tmp_path, cli):
    """verl's function run with the lower bound dropped (clip_cov_lb −1e9) while the bundle declares 0.01: its
    draw zeroes tokens whose covariance is below the bound, which verl's rule at 0.01 never selects. The replay
    keeps those terms and diverges at loss.policy (a mapping that trusted the mask alone would pass)."""
    bundle = write_clip_cov_bundle(tmp_path / "b", "clip-cov-wide", seed=7, dtype=torch.float32,
                                   producer={"clip_cov_lb": -1e9})
    code, out, err = cli("replay", bundle, "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy"), out + err
    assert report["first_divergence"]["field"] in {"loss", "pg_loss", "pg_clipfrac"}


def test_a_draw_of_another_size_diverges_at_its_micro_batch(tmp_path, cli):
    """verl's function run with clip_cov_ratio 0.3 where the bundle declares 0.1: every token it zeroes is a
    candidate and the loss recomputed with the recorded mask agrees, but the draw is larger than verl's rule
    allows at 0.1: clip_cov_draw diverges."""
    bundle = write_clip_cov_bundle(tmp_path / "b", "clip-cov-wide", seed=7, dtype=torch.float32,
                                   producer={"clip_cov_ratio": 0.3})
    code, out, err = cli("replay", bundle, "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy"), out + err
    first = report["first_divergence"]
    assert (first["field"], first["expected"], first["actual"]) == ("clip_cov_draw[mb-0]", 15.0, 5.0), first


def test_without_the_mask_the_replay_refuses_naming_it(tmp_path, cli):
    bundle = write_clip_cov_bundle(tmp_path / "b", "clip-cov", seed=7, dtype=torch.float32, with_mask=False)
    code, out, err = cli("replay", bundle)
    assert code == 3, out + err
    assert "payloads/clip_cov_mask.safetensors (for policy_loss)" in out + err


def test_a_mask_with_a_value_other_than_0_and_1_is_refused(tmp_path, cli):
    def two(selected, mask_):
        return selected.to(torch.int8) * 2

    bundle = write_clip_cov_bundle(tmp_path / "b", "clip-cov", seed=7, dtype=torch.float32, mask_edit=two)
    code, out, err = cli("replay", bundle)
    assert code == 3, out + err
    assert "$.payloads.clip_cov_mask: 4 value(s) other than 0 and 1, the first 2 at token" in out + err


def test_a_mask_of_the_wrong_length_is_refused_by_validate(tmp_path, cli):
    lengths, valid, *_ = _step(7, torch.float32)
    bundle = write_clip_cov_bundle(tmp_path / "b", "clip-cov", seed=7, dtype=torch.float32,
                                   mask_edit=lambda s, m: torch.zeros(int(valid.sum()) - 1, dtype=torch.int8))
    code, out, err = cli("validate", bundle)
    assert code == 3, out + err
    assert "clip_cov_mask" in out + err and f"{int(valid.sum()) - 1}" in out + err
