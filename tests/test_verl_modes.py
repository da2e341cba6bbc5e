"""The verl slice's modes in the default suite, each worked by hand (the conformance tests that read verl's own
code skip without verl): ``micro_batch_token_mean`` (the mean of per-micro-batch token means), ``token_sum``, the
``abs`` KL, ``masked_token_value="zero"`` at an interior masked span, TRL's ratio-weighted KL
(``kl_loss_ratio_weighted``), and the refusal of
``micro_batch_token_mean`` without the samples' ``micro_batch_id``. Real writer, reader, runner and CLI.

The loss step (three samples, one per micro-batch, micro-batches of 1, 2 and 3 loss tokens; eps_clip 0.2 /
eps_clip_high 0.28 clamp the ratio to [0.8, 1.28]; A = 1 on every token):

=======  ===========  =====  ==============  ==================================================
sample   micro-batch  token  Δ = logp − old  surrogate −min(ρA, clamp(ρ)A)
=======  ===========  =====  ==============  ==================================================
s-0      mb-a         0      ln 2 (ρ = 2)    −1.28, clipped
s-1      mb-b         0, 1   0    (ρ = 1)    −1, −1
s-2      mb-c         0      ln 2 (ρ = 2)    −1.28, clipped
s-2      mb-c         1, 2   0    (ρ = 1)    −1, −1
=======  ===========  =====  ==============  ==================================================

Per sample: ``S_pg = [−1.28, −2, −3.28]``, ``S_clip = [1, 0, 1]``, ``S_ppo_kl = [−ln 2, 0, −ln 2]``
(ppo_kl = old − logp), ``n = [1, 2, 3]``, T = 6 loss tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from producers import advantage as advantage_producer
from replay_lib.bundle import BundleWriter
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest,
                                      RecomputeConfig, SampleRecord, StageId, stage_contracts)
from replay_lib.demo import producer
from replay_lib.judge.report import report_to_text
from replay_lib.kernels import compute_approx_kl
from replay_lib.kernels.loss import LossKnobs, policy_loss_fields
from replay_lib.run.runner import replay

LN2 = math.log(2.0)
LENGTHS = [1, 2, 3]
MICRO = ["mb-a", "mb-b", "mb-c"]
LOGP = [LN2, 0.0, 0.0, LN2, 0.0, 0.0]
OLD = [0.0] * 6
ADV = [1.0] * 6
# the mean over the 3 micro-batches of each one's token mean
MB_PG = (-1.28 / 1 + -2.0 / 2 + -3.28 / 3) / 3  # = −1.124444…
MB_CLIP = (1 / 1 + 0 / 2 + 1 / 3) / 3  # = 4/9
MB_PPO_KL = (-LN2 / 1 + 0 / 2 + -LN2 / 3) / 3  # = −(4/9)·ln 2
# one token mean over the 6 tokens
TOKEN_PG = -6.56 / 6  # = −1.093333…
TOKEN_CLIP = 2 / 6  # = 1/3
TOKEN_PPO_KL = -2 * LN2 / 6


def write_step(path, *, config: dict, policy: dict, payloads: dict | None = None, micro=MICRO):
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i, response_length=n, total_length=n + 4,
                            loss_mask=[1] * n, raw_reward=0.0, reward=0.0, micro_batch_id=micro[i])
               for i, n in enumerate(LENGTHS)]
    cfg = RecomputeConfig(eps_clip=0.2, eps_clip_high=0.28, **config)
    index = BundleIndex(bundle_id="modes", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=cfg)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id="modes", producer=producer(),
                        stage_contracts=stage_contracts([StageId.SAMPLE, StageId.LOSS_POLICY]), payloads={},
                        comparison_policy=ComparisonPolicy(), redaction={})
    writer = BundleWriter(path, manifest, index, {"loss.policy": policy})
    for name, values in {"log_probs": LOGP, "old_log_probs": OLD, "advantages": ADV, **(payloads or {})}.items():
        writer.write_payload(name, torch.tensor(values, dtype=torch.float32))
    return writer.finalize(ranks=[0])


def _replay(cli, path) -> tuple[int, dict]:
    code, out, err = cli("replay", path, "--format", "json")
    assert err == "", err
    return code, json.loads(out)


def _kernel(micro_batch=(0, 1, 2), ref=None, **config) -> dict[str, float]:
    cfg = RecomputeConfig(eps_clip=0.2, eps_clip_high=0.28, **config)
    knobs = dataclasses.replace(LossKnobs.of(cfg), micro_batch=micro_batch)
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in (("logp", LOGP), ("old", OLD), ("adv", ADV))}
    out = policy_loss_fields(t["logp"], t["old"], t["adv"], None, torch.ones(6), torch.tensor(LENGTHS), eps_clip=0.2,
                             eps_clip_high=0.28, entropy_coef=0.0, dtype=torch.float64, knobs=knobs,
                             ref_log_probs=None if ref is None else torch.tensor(ref, dtype=torch.float64))
    return {k: float(v) for k, v in out.items()}


# --------------------------------------------------------------------------- micro_batch_token_mean


MB_METRICS = dict(loss_agg_mode="token_mean", loss_token_count=6, metric_agg_mode="micro_batch_token_mean")


def test_micro_batch_token_mean_by_hand_differs_from_the_token_mean():
    out = _kernel(**MB_METRICS)
    assert out["pg_loss"] == pytest.approx(TOKEN_PG, rel=1e-12)  # the loss: one token mean over T = 6
    assert out["pg_clipfrac"] == pytest.approx(4 / 9, rel=1e-12)
    assert out["ppo_kl"] == pytest.approx(-4 / 9 * LN2, rel=1e-12)
    token = _kernel(loss_agg_mode="token_mean", loss_token_count=6, metric_agg_mode="token_mean")
    assert (token["pg_clipfrac"], token["ppo_kl"]) == (pytest.approx(1 / 3, rel=1e-12),
                                                      pytest.approx(-LN2 / 3, rel=1e-12))
    assert abs(MB_CLIP - TOKEN_CLIP) == pytest.approx(1 / 9, rel=1e-12)  # 4/9 vs 3/9: the two differ
    # as the loss's own mode: (−1.28/1 − 2/2 − 3.28/3)/3
    loss = _kernel(loss_agg_mode="micro_batch_token_mean")
    assert loss["pg_loss"] == pytest.approx(MB_PG, rel=1e-12) and MB_PG != pytest.approx(TOKEN_PG, rel=1e-3)
    # one micro-batch: the mean over it is the token mean
    assert _kernel((0, 0, 0), loss_agg_mode="micro_batch_token_mean")["pg_loss"] == pytest.approx(TOKEN_PG, rel=1e-12)


def test_micro_batch_metrics_replay_clean_and_the_global_token_mean_diverges(tmp_path, cli):
    good = {"loss": TOKEN_PG, "pg_loss": TOKEN_PG, "pg_clipfrac": MB_CLIP, "ppo_kl": MB_PPO_KL}
    code, report = _replay(cli, write_step(tmp_path / "good", config=MB_METRICS, policy=good))
    assert code == 0, report
    # a producer that reported the global token mean (1/3) where the config says micro-batch means (4/9)
    bad = dict(good, pg_clipfrac=TOKEN_CLIP)
    code, report = _replay(cli, write_step(tmp_path / "bad", config=MB_METRICS, policy=bad))
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy")
    first = report["first_divergence"]
    assert first["field"] == "pg_clipfrac"
    assert (first["expected"], first["actual"]) == (pytest.approx(1 / 3, rel=1e-6), pytest.approx(4 / 9, rel=1e-12))


def test_micro_batch_token_mean_without_micro_batch_ids_is_refused_in_one_line(tmp_path, cli):
    good = {"loss": TOKEN_PG, "pg_loss": TOKEN_PG, "pg_clipfrac": MB_CLIP, "ppo_kl": MB_PPO_KL}
    path = write_step(tmp_path / "b", config=MB_METRICS, policy=good, micro=["mb-a", None, "mb-c"])
    for command in ("validate", "replay"):
        code, out, err = cli(command, path)
        assert (code, out) == (3, ""), (command, out, err)
        assert err == (f"trajectory-replay: error: {path / 'manifest.json'}: dependency closure incomplete: "
                       "loss.policy needs index.json $.samples[*].micro_batch_id "
                       "(metric_agg_mode='micro_batch_token_mean' averages the token means of the producer's "
                       "micro-batches)\n"), err


# ------------------------------------------------------------------------------------------- token_sum


def test_token_sum_by_hand_replays_clean_and_a_token_mean_diverges(tmp_path, cli):
    # Σ_i S_pg,i = −1.28 − 2 − 3.28 = −6.56, no divisor; the metrics a token mean over T = 6
    config = dict(loss_agg_mode="token_sum", metric_agg_mode="token_mean", loss_token_count=6)
    out = _kernel(**config)
    assert (out["pg_loss"], out["pg_clipfrac"]) == (pytest.approx(-6.56, rel=1e-12), pytest.approx(1 / 3, rel=1e-12))
    good = {"loss": -6.56, "pg_loss": -6.56, "pg_clipfrac": TOKEN_CLIP, "ppo_kl": TOKEN_PPO_KL}
    code, report = _replay(cli, write_step(tmp_path / "good", config=config, policy=good))
    assert code == 0, report
    # the same step reported as a token mean, −6.56/6
    code, report = _replay(cli, write_step(tmp_path / "bad", config=config,
                                           policy=dict(good, loss=TOKEN_PG, pg_loss=TOKEN_PG)))
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy")
    assert report["first_divergence"]["field"] in ("loss", "pg_loss")
    assert (report["first_divergence"]["expected"], report["first_divergence"]["actual"]) == (
        pytest.approx(TOKEN_PG, rel=1e-6), pytest.approx(-6.56, rel=1e-12))


# ---------------------------------------------------------------------------------------------- abs KL


# r = logp − ref per token: the signed log-ratios sum to 0, their absolute values to 0.5+0.5+0.25+0.25 = 1.5
R = [0.5, -0.5, 0.0, 0.25, -0.25, 0.0]
REF = [lp - r for lp, r in zip(LOGP, R)]
ABS = dict(loss_agg_mode="token_mean", metric_agg_mode="token_mean", loss_token_count=6, use_kl_loss=True,
           kl_loss_coef=0.1, kl_loss_type="abs")


def test_abs_kl_by_hand():
    got = compute_approx_kl(torch.tensor(LOGP, dtype=torch.float64), torch.tensor(REF, dtype=torch.float64),
                            kl_loss_type="abs", dtype=torch.float64)
    assert got.tolist() == pytest.approx([0.5, 0.5, 0.0, 0.25, 0.25, 0.0], abs=1e-15)
    out = _kernel(ref=REF, **ABS)
    # kl_loss = 1.5/6 = 0.25; loss = −6.56/6 + 0.1·0.25
    assert out["kl_loss"] == pytest.approx(0.25, rel=1e-12)
    assert out["loss"] == pytest.approx(TOKEN_PG + 0.025, rel=1e-12)
    # k1 on the same log-ratios: Σ r = 0
    assert _kernel(ref=REF, **dict(ABS, kl_loss_type="k1"))["kl_loss"] == pytest.approx(0.0, abs=1e-15)


def test_abs_kl_replays_clean_and_a_signed_kl_diverges(tmp_path, cli):
    good = {"loss": TOKEN_PG + 0.025, "pg_loss": TOKEN_PG, "kl_loss": 0.25, "pg_clipfrac": TOKEN_CLIP,
            "ppo_kl": TOKEN_PPO_KL}
    code, report = _replay(cli, write_step(tmp_path / "good", config=ABS, policy=good, payloads={"ref_log_probs": REF}))
    assert code == 0, report
    # a producer that used the signed k1: kl_loss 0, loss −1.093333
    bad = dict(good, kl_loss=0.0, loss=TOKEN_PG)
    code, report = _replay(cli, write_step(tmp_path / "bad", config=ABS, policy=bad, payloads={"ref_log_probs": REF}))
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy")
    fields = [d["field"] for d in next(s for s in report["stages"] if s["stage"] == "loss.policy")["divergences"]]
    assert set(fields) == {"loss", "kl_loss"}, fields


# ------------------------------------------------------------------------------ masked_token_value=zero


# One group of two samples, raw rewards [1, 0], GRPO without the std: rewards [0.5, −0.5]. s-0 has an interior
# tool span (its tokens 1 and 2, loss mask 0); old = 0, ref = −0.1: the k1 KL old − ref = 0.1 on every token.
# The sequence KL in the reward takes 0.1·Σ_t kl over each sample's 2 loss tokens = 0.02 from both: the centred
# rewards are unchanged. Zero at mask-0 tokens: advantages [0.5, 0, 0, 0.5 | −0.5, −0.5], kl [0.1, 0, 0, 0.1 | 0.1,
# 0.1].
MASKED = dict(raw=[1.0, 0.0], groups=[0, 0], lengths=[4, 2], masks=[[1, 0, 0, 1], [1, 1]], rewards=[0.5, -0.5],
              old_log_probs=[0.0] * 6, ref_log_probs=[-0.1] * 6, grpo_std_normalization=False, n_samples_per_prompt=2,
              kl_in_reward="sequence", kl_coef=0.1)
ZERO_ADV = [0.5, 0.0, 0.0, 0.5, -0.5, -0.5]
ZERO_KL = [0.1, 0.0, 0.0, 0.1, 0.1, 0.1]
BROADCAST_ADV = [0.5, 0.5, 0.5, 0.5, -0.5, -0.5]
BROADCAST_KL = [0.1] * 6


def test_zero_at_an_interior_masked_span_replays_clean(tmp_path):
    report = replay(advantage_producer.write(tmp_path / "zero", advantages=ZERO_ADV, kl=ZERO_KL,
                                             masked_token_value="zero", **MASKED))
    assert report.passed, report_to_text(report)
    assert {s.stage: s.status for s in report.stages if s.status != "skipped"} == {
        "sample": "pass", "reward.raw": "pass", "reward.post_process": "pass", "advantage.kl": "pass",
        "advantage.estimate": "pass"}
    # the same values judged as computed at masked tokens: the span's 0s are divergences
    computed = replay(advantage_producer.write(tmp_path / "computed", advantages=ZERO_ADV, kl=ZERO_KL, **MASKED))
    assert computed.first_divergent_stage == "advantage.kl"
    assert computed.stage("advantage.estimate").reason == "advantage mismatch in 2 token(s) of 1 sample(s)"


@pytest.mark.parametrize("adv, kl, stage, field", [
    (BROADCAST_ADV, ZERO_KL, "advantage.estimate", "advantage"),  # 0.5 at s-0's tokens 1 and 2
    (ZERO_ADV, BROADCAST_KL, "advantage.kl", "kl"),  # 0.1 at s-0's tokens 1 and 2
])
def test_a_non_zero_value_in_the_span_is_a_divergence(tmp_path, adv, kl, stage, field):
    report = replay(advantage_producer.write(tmp_path / "b", advantages=adv, kl=kl, masked_token_value="zero",
                                             **MASKED))
    assert report.first_divergent_stage == stage, report_to_text(report)
    text = report_to_text(report)
    expected = 0.5 if field == "advantage" else 0.1
    for token in (1, 2):
        assert f"{field} s-0@{token}: expected={expected} actual=0.0 abs_err={expected}" in text, text
    assert f"{field} s-0@0:" not in text and f"{field} s-0@3:" not in text


# --------------------------------------------------- kl_masked_token_value=zero (SkyRL's use_kl_in_reward)


# SkyRL: the advantages × response_mask (computed at s-0's tool span), the in-reward KL × loss_mask (0 there).
# The same step as MASKED: advantages [0.5, 0.5, 0.5, 0.5 | −0.5, −0.5], kl [0.1, 0, 0, 0.1 | 0.1, 0.1].


def test_kl_zero_with_advantages_computed_at_an_interior_span_replays_clean(tmp_path):
    report = replay(advantage_producer.write(tmp_path / "skyrl", advantages=BROADCAST_ADV, kl=ZERO_KL,
                                             masked_token_value="computed", kl_masked_token_value="zero", **MASKED))
    assert report.passed, report_to_text(report)
    assert report.stage("advantage.kl").reason == "6 token(s) compared (k1, kl_coef=0.1)"
    # one rule for both (kl_masked_token_value unset): either the advantages or the KL diverge in the span
    for rule, stage in (("computed", "advantage.kl"), ("zero", "advantage.estimate")):
        one = replay(advantage_producer.write(tmp_path / rule, advantages=BROADCAST_ADV, kl=ZERO_KL,
                                              masked_token_value=rule, **MASKED))
        assert one.first_divergent_stage == stage, report_to_text(one)


def test_kl_masked_token_value_computed_with_advantages_zero_compares_the_kl_in_the_span(tmp_path):
    report = replay(advantage_producer.write(tmp_path / "b", advantages=ZERO_ADV, kl=ZERO_KL,
                                             masked_token_value="zero", kl_masked_token_value="computed", **MASKED))
    assert report.first_divergent_stage == "advantage.kl", report_to_text(report)
    text = report_to_text(report)
    for token in (1, 2):
        assert f"kl s-0@{token}: expected=0.0 actual=0.1" in text, text


def test_kl_masked_token_value_unset_is_not_written_and_a_bad_one_exits_3(tmp_path, cli):
    import msgspec
    assert b"kl_masked_token_value" not in msgspec.json.encode(RecomputeConfig())
    bundle = advantage_producer.write(tmp_path / "b", advantages=BROADCAST_ADV, kl=ZERO_KL,
                                      kl_masked_token_value="sometimes", **MASKED)
    code, out, err = cli("validate", str(bundle))
    assert code == 3, out + err
    assert "$.config.kl_masked_token_value='sometimes': expected one of computed, zero" in out + err


# --------------------------------------------------------------------- kl_loss_ratio_weighted (TRL's β-KL)


# TRL 1.16 use_bias_correction_kl: the k3 KL times the unclipped ratio ρ = exp(logp − old) (grpo_trainer.py
# :3104-3105). r = logp − ref = ln 2 where ρ = 2 (tokens 0 and 3), else 0: k3 = e^(−r) − 1 + r = ln 2 − 0.5 there,
# 0 elsewhere. Unweighted Σ = 2(ln 2 − 0.5); weighted Σ = 2·2(ln 2 − 0.5); token means over T = 6.
R_W = [LN2, 0.0, 0.0, LN2, 0.0, 0.0]
REF_W = [lp - r for lp, r in zip(LOGP, R_W)]
K3 = LN2 - 0.5
WEIGHTED = dict(loss_agg_mode="token_mean", metric_agg_mode="token_mean", loss_token_count=6, use_kl_loss=True,
                kl_loss_coef=0.1, kl_loss_type="k3", kl_loss_ratio_weighted=True)


def test_kl_loss_ratio_weighted_by_hand():
    out = _kernel(ref=REF_W, **WEIGHTED)
    assert out["kl_loss"] == pytest.approx(4 * K3 / 6, rel=1e-12)  # 0.128768…
    assert out["loss"] == pytest.approx(TOKEN_PG + 0.1 * 4 * K3 / 6, rel=1e-12)
    plain = _kernel(ref=REF_W, **dict(WEIGHTED, kl_loss_ratio_weighted=False))
    assert plain["kl_loss"] == pytest.approx(2 * K3 / 6, rel=1e-12)  # half: the weight is 2 where the KL is not 0


def test_kl_loss_ratio_weighted_replays_clean_and_the_unweighted_kl_diverges(tmp_path, cli):
    good = {"loss": TOKEN_PG + 0.1 * 4 * K3 / 6, "pg_loss": TOKEN_PG, "kl_loss": 4 * K3 / 6,
            "pg_clipfrac": TOKEN_CLIP, "ppo_kl": TOKEN_PPO_KL}
    path = write_step(tmp_path / "good", config=WEIGHTED, policy=good, payloads={"ref_log_probs": REF_W})
    code, report = _replay(cli, path)
    assert code == 0, report
    # a producer that forgot the weight: kl_loss 2(ln 2 − 0.5)/6
    bad = dict(good, kl_loss=2 * K3 / 6, loss=TOKEN_PG + 0.1 * 2 * K3 / 6)
    code, report = _replay(cli, write_step(tmp_path / "bad", config=WEIGHTED, policy=bad,
                                           payloads={"ref_log_probs": REF_W}))
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy")
    fields = [d["field"] for d in next(s for s in report["stages"] if s["stage"] == "loss.policy")["divergences"]]
    assert set(fields) == {"loss", "kl_loss"}, fields
    # the knob is written only when set: a bundle without it reads as unweighted
    assert "kl_loss_ratio_weighted" in json.loads((path / "index.json").read_text())["config"]
