"""The loss-side knobs of SPEC §4.2, each worked by hand, through the kernels and through a real bundle.

The step every test uses (two samples; the third token of s-1 is masked out):

=======  =====  ==============  ======  ===================================================================
sample   token  Δ = logp − old  A       surrogate (eps_clip 0.2, eps_clip_high 0.28: clamp to [0.8, 1.28])
=======  =====  ==============  ======  ===================================================================
s-0      0      ln 2 (ratio 2)  1       l1 = −2, l2 = −1.28 → pg = −1.28, clipped
s-0      1      0    (ratio 1)  1       pg = −1
s-1      0      0    (ratio 1)  −0.5    pg = 0.5
s-1      1      ln 4 (ratio 4)  −0.5    l1 = 2, l2 = 0.64 → pg = 2 (dual-clip c = 3: min(2, 1.5) = 1.5, lower-clipped)
s-1      2      0               −0.5    masked out (mask 0)
=======  =====  ==============  ======  ===================================================================

Per sample: ``S_pg = [−2.28, 2.5]``, ``S_clip = [1, 0]``, ``S_ppo_kl = [−ln 2, −ln 4]``, ``n = [2, 2]``; the
recorded counts are those of a larger (all-reduced) mini-batch: ``T = 10``, ``N = 4``, ``L = 8``, and the
producer's scale 2.
"""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleReader, BundleWriter
from replay_lib.demo import producer
from replay_lib.kernels import compute_approx_kl
from replay_lib.kernels.loss import (LossKnobs, agg_weights, policy_loss_fields, value_loss_fields)
from replay_lib.bundle.loss_knobs import KL_TYPES
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, ComparisonPolicy, Identity, Manifest,
                               RecomputeConfig, SampleRecord, StageId, stage_contracts)

LN2, LN4 = math.log(2.0), math.log(4.0)
LENGTHS = [2, 3]
MASK = [[1, 1], [1, 1, 0]]
LOGP = [LN2, 0.0, 0.0, LN4, 0.0]
OLD = [0.0] * 5
ADV = [1.0, 1.0, -0.5, -0.5, -0.5]
COUNTS = dict(loss_token_count=10, loss_seq_count=4, loss_horizon=8, loss_scale=2.0)


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def fields(dtype=torch.float64, *, rollout=None, ref=None, logp=LOGP, **config) -> dict[str, float]:
    cfg = RecomputeConfig(eps_clip=0.2, eps_clip_high=0.28, **config)
    knobs = LossKnobs.of(cfg)
    mask = torch.tensor([m for row in MASK for m in row], dtype=torch.float32)
    out = policy_loss_fields(t64(logp), t64(OLD), t64(ADV), None, mask, torch.tensor(LENGTHS), eps_clip=0.2,
                             eps_clip_high=0.28, entropy_coef=0.0, dtype=dtype, knobs=knobs,
                             rollout_log_probs=None if rollout is None else t64(rollout),
                             ref_log_probs=None if ref is None else t64(ref))
    return {k: float(v) for k, v in out.items()}


# ----------------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("mode,pg_loss,clipfrac", [
    # scale·Σ_i S_i / n_i:        2·(−2.28/2 + 2.5/2) = 0.22;    clip 1/2 + 0/2 = 0.5
    ("sum_of_sample_means", 0.22, 0.5),
    # scale·Σ_i S_i/(N·n_i):      2·(−1.14 + 1.25)/4 = 0.055;    clip (0.5 + 0)/4 = 0.125
    ("seq_mean_token_mean", 0.055, 0.125),
    # scale·Σ_i S_i / T:          2·(0.22)/10 = 0.044;           clip 1/10 = 0.1
    ("token_mean", 0.044, 0.1),
    # scale·Σ_i S_i / N:          2·0.22/4 = 0.11;               clip 1/4 = 0.25
    ("seq_mean_token_sum", 0.11, 0.25),
    # scale·Σ_i S_i / (N·L):      2·0.22/32 = 0.01375;           clip 1/32 = 0.03125
    ("seq_mean_token_sum_norm", 0.01375, 0.03125),
])
def test_each_aggregation_mode_by_hand(mode, pg_loss, clipfrac):
    out = fields(loss_agg_mode=mode, **COUNTS)
    assert out["pg_loss"] == pytest.approx(pg_loss, rel=1e-12, abs=1e-15)
    assert out["loss"] == out["pg_loss"]  # entropy_coef 0, no KL term
    assert out["pg_clipfrac"] == pytest.approx(clipfrac, rel=1e-12)  # a metric: never scaled
    # ppo_kl = Σ_i w_i·S_kl_i with S_kl = [−ln 2, −ln 4]
    w = agg_weights(mode, t64([2.0, 2.0]), LossKnobs.of(RecomputeConfig(loss_agg_mode=mode, **COUNTS)))
    assert out["ppo_kl"] == pytest.approx(float(w[0]) * -LN2 + float(w[1]) * -LN4, rel=1e-12)


def test_metric_mode_differs_from_the_loss_mode():
    # verl: the loss a global token mean, the metrics per-sample means: pg 2·0.22/10, clip 1/2
    out = fields(loss_agg_mode="token_mean", metric_agg_mode="sum_of_sample_means", **COUNTS)
    assert out["pg_loss"] == pytest.approx(0.044, rel=1e-12)
    assert out["pg_clipfrac"] == pytest.approx(0.5, rel=1e-12)


def test_float32_producer_form_matches_the_float64_replay_to_rounding():
    f32, f64 = fields(torch.float32, loss_agg_mode="token_mean", **COUNTS), fields(loss_agg_mode="token_mean", **COUNTS)
    assert f32["pg_loss"] == pytest.approx(f64["pg_loss"], rel=1e-6) and f32["pg_loss"] != 0.044


# ----------------------------------------------------------------------------------- per-token knobs


def test_dual_clip_by_hand():
    out = fields(eps_clip_c=3.0)
    # s-1 token 1: min(2, −3·(−0.5) = 1.5) = 1.5 → S_pg = [−2.28, 2.0]: −1.14 + 1.0 = −0.14; lower 0 + 1/2
    assert out["pg_loss"] == pytest.approx(-0.14, rel=1e-12)
    assert out["pg_clipfrac_lower"] == pytest.approx(0.5, rel=1e-12)
    assert out["pg_clipfrac"] == pytest.approx(0.5, rel=1e-12)  # the upper clip is unchanged
    assert "pg_clipfrac_lower" not in fields()


def test_log_ratio_clamp_by_hand():
    out = fields(log_ratio_clamp=1.0)
    # ln 4 = 1.386 clamps to 1: ratio e, l1 = 0.5e, l2 = 0.64 → pg 0.5e; ln 2 = 0.693 is inside
    # S_pg = [−2.28, 0.5 + 0.5e] → −1.14 + (0.5 + 0.5e)/2; ppo_kl −ln2/2 + (−1)/2 (the clamped log-ratio)
    assert out["pg_loss"] == pytest.approx(-1.14 + (0.5 + 0.5 * math.e) / 2, rel=1e-12)
    assert out["ppo_kl"] == pytest.approx(-LN2 / 2 - 0.5, rel=1e-12)


def test_gspo_sequence_ratio_by_hand():
    out = fields(importance_level="sequence")
    # s-0: s = exp((ln2 + 0)/2) = √2 → l1 = −√2, l2 = −1.28 → pg −1.28 on both tokens, both clipped
    # s-1: s = exp((0 + ln4)/2) = 2 → l1 = 1, l2 = 0.64 → pg 1 on both loss tokens
    assert out["pg_loss"] == pytest.approx(-1.28 + 1.0, rel=1e-12)
    assert out["pg_clipfrac"] == pytest.approx(1.0, rel=1e-12)
    assert out["ppo_kl"] == pytest.approx(-LN2 / 2 - LN4 / 2, rel=1e-12)  # the token log-ratios, as verl's GSPO


def test_kl_in_the_loss_with_both_clamps_by_hand():
    # r = logp − ref = [1, 0 | 0, 30]: k3 = e^−r − 1 + r → [e^−1, 0 | 0, ·]; r = 30 clamps to 20 (e^−20 + 19),
    # then the value to 10
    ref = [LN2 - 1.0, 0.0, 0.0, LN4 - 30.0, 0.0]
    out = fields(ref=ref, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", kl_loss_input_clamp=20.0,
                 kl_loss_output_clamp=10.0)
    kl = math.exp(-1.0) / 2 + 10.0 / 2
    assert out["kl_loss"] == pytest.approx(kl, rel=1e-12)
    assert out["loss"] == pytest.approx(0.11 + 0.1 * kl, rel=1e-12)
    unclamped = fields(ref=ref, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
    assert unclamped["kl_loss"] == pytest.approx(math.exp(-1.0) / 2 + (math.exp(-30.0) + 29.0) / 2, rel=1e-12)
    # kl_loss_coef == 0 is neutral: no KL term, no field, no reference needed
    assert "kl_loss" not in fields(use_kl_loss=True, kl_loss_coef=0.0)


def test_importance_correction_token_truncate_and_icepop_by_hand():
    # Δ_is = old − rollout = [ln 3, 0 | 0, −ln 2]
    rollout = [-math.log(3.0), 0.0, 0.0, LN2, 0.0]
    tis = fields(rollout=rollout, is_level="token", is_high=2.0)
    # w = [min(3, 2), 1 | 1, 0.5] → S_pg = [−2.56 − 1, 0.5 + 1] → −1.78 + 0.75
    assert tis["pg_loss"] == pytest.approx(-1.78 + 0.75, rel=1e-12)
    icepop = fields(rollout=rollout, is_level="token", is_mode="mask", is_low=0.6, is_high=2.0)
    # w = [0 (3 > 2), 1 | 1, 0 (0.5 < 0.6)] → S_pg = [−1, 0.5] → −0.5 + 0.25
    assert icepop["pg_loss"] == pytest.approx(-0.25, rel=1e-12)
    assert icepop["pg_clipfrac"] == tis["pg_clipfrac"] == pytest.approx(0.5)  # weights never change the metrics
    # slime's names: use_tis + tis_clip / tis_clip_low are token-level truncation
    assert fields(rollout=rollout, use_tis=True, tis_clip=2.0, tis_clip_low=0.0)["pg_loss"] == tis["pg_loss"]


def test_importance_correction_sequence_and_geometric_by_hand():
    rollout = [-math.log(3.0), 0.0, 0.0, LN2, 0.0]
    seq = fields(rollout=rollout, is_level="sequence", is_high=2.0)
    # D = Σ_t Δ_is·mask = [ln 3, −ln 2] → w = [min(3, 2), 0.5]: S_pg = [−4.56, 1.25] → −2.28 + 0.625
    assert seq["pg_loss"] == pytest.approx(-2.28 + 0.625, rel=1e-12)
    geo = fields(rollout=rollout, is_level="geometric")
    # D / n = [ln3/2, −ln2/2] → w = [√3, 1/√2]: √3·(−2.28)/2 + 2.5/(2√2)
    assert geo["pg_loss"] == pytest.approx(math.sqrt(3) * -1.14 + 1.25 / math.sqrt(2), rel=1e-12)
    clamped = fields(rollout=rollout, is_level="sequence", is_log_clamp=0.5)
    # the log weight clamps to ±0.5 before exp: w = [e^0.5, e^−0.5]
    assert clamped["pg_loss"] == pytest.approx(math.exp(0.5) * -1.14 + math.exp(-0.5) * 1.25, rel=1e-12)


def test_value_loss_by_hand():
    # v, v_old, R per token; value_clip 0.2
    #   (1.0, 0.5, 0.0): (v−R)² = 1, clamp(v) = 0.7 → 0.49: max 1 → vf 0.5, not clipped
    #   (0.0, 0.5, 0.1): 0.01; clamp(v) = 0.3 → 0.04: max 0.04 → vf 0.02, clipped
    #   (2.0, 2.0, 1.0): 1 either way → vf 0.5, not clipped (one sample of 2 tokens + the first alone)
    values, old, returns = t64([1.0, 0.0, 2.0]), t64([0.5, 0.5, 2.0]), t64([0.0, 0.1, 1.0])
    knobs = LossKnobs.of(RecomputeConfig(value_clip=0.2))
    out = value_loss_fields(values, old, returns, torch.ones(3), torch.tensor([1, 2]), knobs, dtype=torch.float64)
    assert float(out["vf_loss"]) == pytest.approx(0.5 / 1 + (0.02 + 0.5) / 2, rel=1e-12)
    assert float(out["vf_clipfrac"]) == pytest.approx(0 + 1 / 2, rel=1e-12)
    unclipped = value_loss_fields(values, old, returns, torch.ones(3), torch.tensor([1, 2]), LossKnobs(),
                                  dtype=torch.float64)
    assert float(unclipped["vf_loss"]) == pytest.approx(0.5 + (0.005 + 0.5) / 2, rel=1e-12)


def test_kl_types_of_the_schema_are_the_kernels():
    from replay_lib.kernels import KL_TYPES as KERNEL_KL_TYPES

    assert KL_TYPES == KERNEL_KL_TYPES
    assert float(compute_approx_kl(t64([1.0]), t64([0.0]), "k3", dtype=torch.float64)[0]) == pytest.approx(
        math.exp(-1.0))


# ---------------------------------------------------------------------------------- real bundles


def write_step(path, *, config: dict, policy: dict, payloads: dict, value: dict | None = None,
               format_version: str = FORMAT_VERSION):
    """A step bundle of the table's step, with ``policy`` (and ``value``) as its expected fields."""
    samples = [SampleRecord(sample_id=f"s-{i}", group_index=i, response_length=n, total_length=n + 4,
                            loss_mask=MASK[i], raw_reward=float(i), reward=float(i), micro_batch_id="mb-0")
               for i, n in enumerate(LENGTHS)]
    cfg = RecomputeConfig(eps_clip=0.2, eps_clip_high=0.28, **config)
    stages = [StageId.SAMPLE, StageId.LOSS_POLICY] + ([StageId.LOSS_VALUE] if value is not None else [])
    index = BundleIndex(bundle_id="knobs", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=cfg)
    manifest = Manifest(format_version=format_version, bundle_id="knobs", producer=producer(),
                        stage_contracts=stage_contracts(stages, declare_value=value is None), payloads={},
                        comparison_policy=ComparisonPolicy(), redaction={})
    expected = {"loss.policy": policy} | ({"loss.value": value} if value is not None else {})
    writer = BundleWriter(path, manifest, index, expected)
    base = {"log_probs": LOGP, "old_log_probs": OLD, "advantages": ADV}
    for name, values in {**base, **payloads}.items():
        writer.write_payload(name, torch.tensor(values, dtype=torch.float32))
    return writer.finalize(ranks=[0])


def f32_fields(**kwargs) -> dict[str, float]:
    """What a float32 producer reports: the kernels' float32 form on the float32 payloads."""
    return fields(torch.float32, **kwargs)


VERL_DAPO = dict(loss_agg_mode="token_mean", eps_clip_c=3.0, **COUNTS)


def test_a_verl_dapo_step_replays_clean_and_a_wrong_denominator_diverges(tmp_path, cli):
    good = write_step(tmp_path / "good", config=VERL_DAPO, policy=f32_fields(**VERL_DAPO), payloads={})
    code, out, err = cli("replay", good, "--format", "json")
    assert (code, err) == (0, ""), out
    # the same step with the micro-batch's own 4 tokens as the denominator: 2·(−2.28 + 2.0)/4 = −0.14
    # instead of 2·(−0.28)/10 = −0.056
    wrong = dict(f32_fields(**VERL_DAPO))
    wrong["pg_loss"] = wrong["loss"] = float(torch.tensor(-0.14, dtype=torch.float32))
    bad = write_step(tmp_path / "bad", config=VERL_DAPO, policy=wrong, payloads={})
    code, out, err = cli("replay", bad, "--format", "json")
    assert code == 1, out + err
    report = json.loads(out)
    assert report["first_divergent_stage"] == "loss.policy"
    assert {d["field"] for d in report["first_divergence"] and [report["first_divergence"]]} <= {"loss", "pg_loss"}
    assert report["first_divergence"]["expected"] == pytest.approx(-0.14, rel=1e-6)
    assert report["first_divergence"]["actual"] == pytest.approx(-0.056, rel=1e-9)


@pytest.mark.parametrize("config,payloads", [
    (dict(is_level="token", is_mode="mask", is_low=0.6, is_high=2.0), {"rollout_log_probs": [-math.log(3.0), 0, 0,
                                                                                              LN2, 0]}),
    (dict(importance_level="sequence", loss_agg_mode="seq_mean_token_mean", **COUNTS), {}),
    (dict(use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl", kl_loss_input_clamp=20.0,
          kl_loss_output_clamp=10.0), {"ref_log_probs": [0.5, -0.2, 0.1, 0.3, 0.0]}),
    (dict(log_ratio_clamp=1.0, is_level="geometric", is_high=2.0), {"rollout_log_probs": [-0.1, 0.2, 0.0, 0.1, 0]}),
], ids=["icepop", "gspo", "kl-loss", "clamp-geometric"])
def test_each_knob_replays_clean_and_a_changed_field_diverges(tmp_path, cli, config, payloads):
    kw = {"rollout": payloads.get("rollout_log_probs"), "ref": payloads.get("ref_log_probs")}
    policy = f32_fields(**kw, **config)
    good = write_step(tmp_path / "good", config=config, policy=policy, payloads=payloads)
    code, out, err = cli("replay", good)
    assert (code, err) == (0, ""), out
    name = "kl_loss" if "kl_loss" in policy else "pg_loss"
    bad = write_step(tmp_path / "bad", config=config, policy=dict(policy, **{name: policy[name] * 1.01 + 1e-3}),
                     payloads=payloads)
    code, out, err = cli("replay", bad, "--format", "json")
    assert code == 1, out + err
    first = json.loads(out)["first_divergence"]
    assert (first["stage"], first["field"]) == ("loss.policy", name)


def test_loss_value_replays_clean_and_a_wrong_value_loss_diverges(tmp_path, cli):
    payloads = {"values": [1.0, 0.2, 0.0, 2.0, 5.0], "old_values": [0.5, 0.2, 0.5, 2.0, 0.0],
                "returns": [0.0, 0.2, 0.1, 1.0, 0.0]}
    knobs = LossKnobs.of(RecomputeConfig(value_clip=0.2))
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    vf = value_loss_fields(*(torch.tensor(payloads[k]) for k in ("values", "old_values", "returns")), mask,
                           torch.tensor(LENGTHS), knobs)
    value = {k: float(v) for k, v in vf.items()}
    # s-0: 0.5 + 0 over 2; s-1: 0.02 (clipped) + 0.5 over 2 (its 5.0 is masked out) → 0.25 + 0.26
    assert value["vf_loss"] == pytest.approx(0.51, rel=1e-6)
    good = write_step(tmp_path / "good", config=dict(value_clip=0.2), policy=f32_fields(), payloads=payloads,
                      value=value)
    code, out, err = cli("replay", good, "--format", "json")
    assert (code, err) == (0, ""), out
    assert next(s for s in json.loads(out)["stages"] if s["stage"] == "loss.value")["status"] == "pass"
    bad = write_step(tmp_path / "bad", config=dict(value_clip=0.2), policy=f32_fields(), payloads=payloads,
                     value=dict(value, vf_loss=0.5 * value["vf_loss"]))
    code, out, err = cli("replay", bad, "--format", "json")
    report = json.loads(out)
    assert code == 1 and report["first_divergent_stage"] == "loss.value"
    assert report["first_divergence"]["field"] == "vf_loss"


# ---------------------------------------------------------------------------- validate and schema


@pytest.mark.parametrize("config,payloads,value,message", [
    (dict(loss_agg_mode="token_mean"), {}, None,
     "loss.policy needs index.json $.config.loss_token_count (loss_agg_mode='token_mean' aggregates over the "
     "producer's recorded loss_token_count)"),
    (dict(loss_agg_mode="seq_mean_token_sum_norm", loss_seq_count=4), {}, None,
     "loss.policy needs index.json $.config.loss_horizon"),
    (dict(is_level="token", is_high=2.0), {}, None, "loss.policy needs payloads/rollout_log_probs.safetensors (for is_level)"),
    (dict(use_tis=True), {}, None, "loss.policy needs payloads/rollout_log_probs.safetensors (for use_tis)"),
    (dict(use_kl_loss=True, kl_loss_coef=0.01), {}, None,
     "loss.policy needs payloads/ref_log_probs.safetensors (for use_kl_loss)"),
    (dict(value_clip=0.2), {"values": [0.0] * 5, "old_values": [0.0] * 5}, {"vf_loss": 0.0},
     "loss.value needs payloads/returns.safetensors"),
])
def test_validate_and_replay_name_the_knob_and_the_missing_input(tmp_path, cli, config, payloads, value, message):
    """validate refuses the bundle, and so do replay and replay-tui --check, with the same line and exit 3, before
    any stage runs (a token mean without its recorded count was an internal error, exit 5)."""
    policy = {"loss": 0.0}
    path = write_step(tmp_path / "b", config=config, policy=policy, payloads=payloads, value=value)
    code, out, err = cli("validate", path)
    assert code == 3 and out == "" and err.count("\n") == 1, out + err
    assert "dependency closure incomplete" in err and message in err
    for args in (("replay", path), ("replay", path, "--format", "json")):
        assert cli(*args) == (3, "", err), args
    from replay_tui.__main__ import main as tui_main

    assert tui_main([str(path), "--check"]) == 3


def test_a_missing_payload_is_named_by_its_file_in_the_bundles_form(tmp_path, cli):
    """A requirement names the file the bundle's format would hold: ``.safetensors`` in format 1.3 (above), the
    weights-only ``.pt`` in the older form."""
    from replay_lib.bundle.schema import UNPACKED_FORMAT_VERSION

    path = write_step(tmp_path / "b", config=dict(use_tis=True), policy={"loss": 0.0}, payloads={},
                      format_version=UNPACKED_FORMAT_VERSION)
    code, out, err = cli("validate", path)
    assert (code, out) == (3, "") and err.endswith(
        "dependency closure incomplete: loss.policy needs payloads/rollout_log_probs.pt (for use_tis)\n"), err


def test_a_missing_count_shared_by_two_modes_is_named_once(tmp_path, cli):
    path = write_step(tmp_path / "b", config=dict(loss_agg_mode="token_mean", metric_agg_mode="token_mean"),
                      policy={"loss": 0.0}, payloads={})
    code, _, err = cli("replay", path)
    assert code == 3 and err.endswith(
        "dependency closure incomplete: loss.policy needs index.json $.config.loss_token_count (loss_agg_mode="
        "'token_mean' and metric_agg_mode='token_mean' aggregate over the producer's recorded loss_token_count)\n"), err


def test_kl_loss_with_a_zero_coefficient_needs_no_reference(tmp_path, cli):
    path = write_step(tmp_path / "b", config=dict(use_kl_loss=True, kl_loss_coef=0.0), policy=f32_fields(),
                      payloads={})
    assert cli("validate", path)[0] == 0
    assert cli("replay", path)[0] == 0


@pytest.mark.parametrize("key,value,message", [
    ("loss_agg_mode", "token-mean", "loss_agg_mode: expected one of sum_of_sample_means, seq_mean_token_mean, "
                                    "token_mean, seq_mean_token_sum, seq_mean_token_sum_norm, token_sum, micro_batch_token_mean, prompt_mean, got 'token-mean'"),
    ("is_mode", "reject", "is_mode: expected one of truncate, mask, got 'reject'"),
    ("kl_loss_type", "k4", "kl_loss_type: expected one of k1, k2, k3, low_var_kl, abs, got 'k4'"),
    ("loss_token_count", -3, "$.config.loss_token_count: expected `int` >= 0"),
    ("eps_clip_c", 1.0, "eps_clip_c: dual-clip needs c > 1, got 1.0"),
    ("is_level", "batch", "is_level: expected null or one of token, sequence, geometric, got 'batch'"),
    ("opd_base", "mean", "opd_base: expected one of returns, zero, got 'mean'"),
    ("is_keep", {"tv": [0.0, -1.0]}, "is_keep.tv: expected finite bounds >= 0 (null for none), got [0.0, -1.0]"),
])
def test_a_bad_knob_value_is_a_one_line_schema_error(tmp_path, cli, bundle_tools, key, value, message):
    path = write_step(tmp_path / "b", config={}, policy=f32_fields(), payloads={})
    bundle_tools.edit_json(path, "index.json", lambda doc: doc["config"].update({key: value}))
    for command in ("validate", "replay"):
        code, out, err = cli(command, path)
        assert (code, out) == (3, ""), err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert str(path / "index.json") in err and message in err, err


def test_knob_values_round_trip_through_the_schema():
    cfg = RecomputeConfig(loss_agg_mode="token_mean", loss_token_count=10, eps_clip_c=3.0, is_level="geometric",
                          is_mode="mask", is_low=0.5, is_high=2.0)
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=RecomputeConfig) == cfg


def test_the_verl_dapo_demo_fails_at_the_aggregation_of_right_per_sample_terms(tmp_path, cli):
    code, out, err = cli("demo", "write", "verl-dapo", tmp_path / "d")
    assert (code, err) == (0, ""), out
    cfg = BundleReader(tmp_path / "d").index.config
    assert (cfg.loss_agg_mode, cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c, cfg.loss_scale) == (
        "token_mean", 0.2, 0.28, 3.0, 4.0)
    code, out, err = cli("replay", tmp_path / "d", "--format", "json")
    report = json.loads(out)
    assert code == 1 and report["first_divergent_stage"] == "loss.policy", out + err
    loss = next(s for s in report["stages"] if s["stage"] == "loss.policy")
    # the per-sample terms (pg_sum, kl_sum, clip_count, mask_count) all pass; the metrics too: only the loss
    # terms the buggy denominator wrote diverge, against the terms' aggregate and against the recompute
    assert {d["field"] for d in loss["divergences"]} == {"loss_from_terms", "pg_loss_from_terms", "loss", "pg_loss"}
    first = report["first_divergence"]
    # two micro-batches of about half the shard's tokens each, over T = 4× the shard's tokens, × dp 4: the
    # recorded value is ≈ 2·4 = 8× the right one
    assert 7.0 < first["expected"] / first["actual"] < 9.0


def test_the_per_sample_kl_term_and_loss_weight_by_hand(tmp_path, cli):
    """``kl_loss_sum`` and ``loss_weight`` (SPEC §4.2's per-sample terms) on the table's step with the KL test's
    reference: kl_loss_sum = [e^−1 + 0, 0 + 10] (the 30 clamped to 20, its k3 to 10), and under token_mean with
    T = 10 and scale 2 every sample's weight is 2/10 = 0.2. The same step with the micro-batch's own 4 tokens as
    T records 2/4 = 0.5: named at the first sample."""
    ref = [LN2 - 1.0, 0.0, 0.0, LN4 - 30.0, 0.0]
    config = dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", kl_loss_input_clamp=20.0,
                  kl_loss_output_clamp=10.0, loss_agg_mode="token_mean", **COUNTS)
    policy = f32_fields(ref=ref, **config)
    terms = {"kl_loss_sum": [math.exp(-1.0), 10.0], "loss_weight": [0.2, 0.2], "mask_count": [2.0, 2.0]}
    good = write_step(tmp_path / "good", config=config, policy=dict(policy, per_sample=terms),
                      payloads={"ref_log_probs": ref})
    code, out, err = cli("replay", good, "--format", "json")
    assert (code, err) == (0, ""), out
    loss = next(s for s in json.loads(out)["stages"] if s["stage"] == "loss.policy")
    # loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl, kl_loss; the three recorded terms
    assert loss["reason"] == "6 field(s) and 3 loss term(s) over 2 sample(s) compared"
    bad = write_step(tmp_path / "bad", config=config, payloads={"ref_log_probs": ref},
                     policy=dict(policy, per_sample=dict(terms, loss_weight=[0.5, 0.5])))
    code, out, err = cli("replay", bad, "--format", "json")
    first = json.loads(out)["first_divergence"]
    assert code == 1 and (first["field"], first["sample_id"], first["expected"], first["actual"]) == (
        "loss_weight", "s-0", 0.5, pytest.approx(0.2, rel=1e-15))
    wrong_kl = write_step(tmp_path / "kl", config=config, payloads={"ref_log_probs": ref},
                          policy=dict(policy, per_sample=dict(terms, kl_loss_sum=[math.exp(-1.0), 5.0])))
    first = json.loads(cli("replay", wrong_kl, "--format", "json")[1])["first_divergence"]
    assert (first["field"], first["sample_id"]) == ("kl_loss_sum", "s-1")


def test_validate_counts_the_rows_of_the_knobs_per_token_payloads(tmp_path, cli):
    # the table's step has 5 tokens; a rollout_log_probs of 4 rows lacks s-1's last one
    path = write_step(tmp_path / "b", config=dict(is_level="token", is_high=2.0), policy={"loss": 0.0},
                      payloads={"rollout_log_probs": [0.0] * 4})
    code, out, err = cli("validate", path)
    assert (code, out) == (3, "") and err.count("\n") == 1, err
    assert "payloads/rollout_log_probs.safetensors: 4 row(s), index.json Σ $.samples[*].response_length is 5" in err
    assert "sample 's-1' ($.samples[1]) has none from its token 2 on" in err


# The table's per-sample terms, as a producer records them: Σ_t x·mask per sample, whatever the mode.
TABLE_TERMS = {"pg_sum": [-2.28, 2.5], "kl_sum": [-LN2, -LN4], "clip_count": [1.0, 0.0], "mask_count": [2.0, 2.0]}
MODE_PG_LOSS = {"sum_of_sample_means": 0.22, "seq_mean_token_mean": 0.055, "token_mean": 0.044,
                "seq_mean_token_sum": 0.11, "seq_mean_token_sum_norm": 0.01375}  # as test_each_aggregation_mode


@pytest.mark.parametrize("mode", list(MODE_PG_LOSS))
def test_the_recorded_scalars_are_checked_against_the_recorded_terms_under_every_mode(tmp_path, cli, mode):
    config = dict(loss_agg_mode=mode, **COUNTS)
    policy = f32_fields(**config)
    good = write_step(tmp_path / "good", config=config, policy=dict(policy, per_sample=TABLE_TERMS), payloads={})
    code, out, err = cli("replay", good, "--format", "json")
    assert (code, err) == (0, ""), out
    # a producer that aggregated with another mode's weights: 0.22 for seq_mean_token_sum_norm's 0.01375, …
    other = "seq_mean_token_sum_norm" if mode == "sum_of_sample_means" else "sum_of_sample_means"
    wrong = dict(policy, pg_loss=MODE_PG_LOSS[other], loss=MODE_PG_LOSS[other], per_sample=TABLE_TERMS)
    bad = write_step(tmp_path / "bad", config=config, policy=wrong, payloads={})
    report = json.loads(cli("replay", bad, "--format", "json")[1])
    loss = next(s for s in report["stages"] if s["stage"] == "loss.policy")
    fields = [d["field"] for d in loss["divergences"]]
    # the per-sample terms pass; the aggregate rows fail before the recompute's
    assert fields == ["loss_from_terms", "pg_loss_from_terms", "loss", "pg_loss"], fields
    assert "loss aggregation mismatch" in loss["reason"] and mode in loss["reason"]
    assert loss["divergences"][1]["actual"] == pytest.approx(MODE_PG_LOSS[mode], rel=1e-12)


def test_a_binding_kl_clamp_is_a_hazard_not_a_failure(tmp_path, cli):
    # s-1's token 1 has r = logp − ref = 30: the ±20 input clamp and the ±10 output clamp bind there (only there)
    ref = [LN2 - 1.0, 0.0, 0.0, LN4 - 30.0, 0.0]
    config = dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", kl_loss_input_clamp=20.0,
                  kl_loss_output_clamp=10.0)
    path = write_step(tmp_path / "b", config=config, policy=f32_fields(ref=ref, **config),
                      payloads={"ref_log_probs": ref})
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    assert (code, err) == (0, ""), out
    assert [(h["stage"], h["kind"], h["sample_id"]) for h in report["hazards"]] == [
        ("loss.policy", "clamp_hit", "s-1")]
    assert report["hazards"][0]["message"].startswith("s-1: 1 loss token(s) at a log-ratio or KL clamp")


def test_one_kl_weight_at_most_is_a_schema_error(tmp_path, cli, bundle_tools):
    """kl_loss_ratio_weighted (TRL: × the ratio) and kl_loss_rollout_weighted (NeMo-RL: × exp(logp − rollout)) are
    two weights of the same term: both set is invalid input, one line (exit 3)."""
    path = write_step(tmp_path / "b", config={}, policy=f32_fields(), payloads={})
    bundle_tools.edit_json(path, "index.json", lambda doc: doc["config"].update(
        {"kl_loss_ratio_weighted": True, "kl_loss_rollout_weighted": True}))
    code, out, err = cli("validate", path)
    assert (code, out) == (3, "")
    assert err.count("\n") == 1 and ("kl_loss_rollout_weighted: expected kl_loss_ratio_weighted false with it (one "
                                      "KL weight)") in err, err
