"""Payloads stored coarser than the declared compute (SPEC §5.1, error model): a capture that keeps bfloat16
copies of float32 log-probs holds one rounding of the values the producer computed from, and every stage that
recomputes from them admits that rounding — found by a new user whose verl-like float32 step, stored as bf16,
failed ppo_kl and kl_loss at 246× the noise while every per-token check passed.

The independent producers (``producers.stored_bf16``, ``producers.loss_knobs`` with ``precision="stored_bf16"``)
replay clean and keep the bugs above that rounding caught (``test_producers_*``, ``test_loss_error_model``);
here the bounds are checked against hand-derived numbers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from producers import comparison_policy

from replay_lib.bundle import BundleWriter
from replay_lib.judge.error_model import coarse_payloads, kl_bound, kl_slope, storage_error, storage_unit
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, Identity, Manifest, ProducerInfo,
                               RecomputeConfig, SampleRecord, StageId, stage_contracts)

U8 = 2.0 ** -8


def test_storage_unit_is_the_coarsest_payload_below_the_compute_format():
    bf16 = torch.zeros(2, dtype=torch.bfloat16)
    f32 = torch.zeros(2)
    f16 = torch.zeros(2, dtype=torch.float16)
    assert storage_unit("float32", f32, bf16) == U8
    assert storage_unit("float32", f32, f16) == 2.0 ** -11
    assert storage_unit("float32", f16, bf16) == U8
    assert storage_unit("float32", f32, None) == 0.0
    # a bf16 payload of a bf16 compute holds the values themselves
    assert storage_unit("bfloat16", bf16, f32) == 0.0
    assert storage_unit("float64", f32) == 2.0 ** -24


def test_storage_error_is_u_times_the_half_spacings():
    """A stored value is the nearest of its format to what was computed: that lies within half its spacing,
    u·2^⌊log2|x|⌋ (3.0 is within 2⁻⁸·2 of what it rounds, not 2⁻⁸·3; 0 holds only what rounds to 0)."""
    a = torch.tensor([-1.0, 2.0], dtype=torch.bfloat16)
    b = torch.tensor([-0.5, -3.0])
    assert storage_error(U8, a, b).tolist() == [1.5 * U8, 4.0 * U8]
    assert storage_error(U8, torch.tensor([0.0, 1.9921875, -0.75])).tolist() == [0.0, U8, 0.5 * U8]
    # the computed values a bf16 copy rounds to each stored one lie within it (the spacing halves below 2^e)
    x = torch.linspace(-8, 8, 100_001, dtype=torch.float32)
    stored = x.to(torch.bfloat16)
    assert bool(((x.double() - stored.double()).abs() <= storage_error(U8, stored)).all())
    assert storage_error(U8, a, b).dtype == torch.float64


def test_kl_slope_is_the_largest_slope_over_the_reach():
    r = torch.tensor([0.0, 0.5, -0.5], dtype=torch.float64)
    reach = torch.tensor([0.01, 0.1, 0.1], dtype=torch.float64)
    assert kl_slope(r, "k1", reach).tolist() == [1.0, 1.0, 1.0]
    assert kl_slope(r, "k2", reach).tolist() == pytest.approx([0.01, 0.6, 0.6], rel=1e-15)
    # k3 = exp(−r) − 1 + r: slope 1 − exp(−r), 0 at r = 0, largest at the far end of the reach
    assert kl_slope(r, "k3", reach).tolist() == pytest.approx(
        [math.exp(0.01) - 1, 1 - math.exp(-0.6), math.exp(0.6) - 1], rel=1e-14)
    assert kl_slope(r, "low_var_kl", reach).tolist() == kl_slope(r, "k3", reach).tolist()


def test_kl_bound_admits_what_a_bf16_copy_of_a_float32_log_prob_moves():
    """A float32 producer's k3 at r = 0.0037 stored from old/ref whose bf16 copies are equal (r = 0): the
    recorded kl (6.85e-6) is no bug; the bound without the inputs' storage (0 + u·|T| = 0) refused it."""
    old32, ref32 = torch.tensor([-0.7402464151382446]), torch.tensor([-0.7439492344856262])
    old, ref = old32.to(torch.bfloat16), ref32.to(torch.bfloat16)
    assert old.item() == ref.item() == -0.7421875
    r32 = (old32 - ref32).double()
    recorded = float(torch.exp(-r32) - 1 + r32)
    r = old.double() - ref.double()
    e_r = storage_error(U8, old, ref)
    without = kl_bound(r, torch.zeros(1, dtype=torch.float64), "k3", 2.0 ** -24, U8)
    with_inputs = kl_bound(r, torch.zeros(1, dtype=torch.float64), "k3", 2.0 ** -24, U8, input_error=e_r)
    assert recorded > float(without[0])
    # 2·(exp(e_r) − 1)·e_r, e_r = 2⁻⁸·(2 × 0.5): the half spacing of a bf16 value in [0.5, 1)
    e = 2 * 0.5 * U8
    assert float(with_inputs[0]) == pytest.approx(8 * 2.0 ** -24 * 2 + 2 * (math.exp(e) - 1) * e, rel=1e-12)
    assert recorded < float(with_inputs[0])


def test_coarse_payloads_names_them_by_dtype():
    named = {"log_probs": torch.zeros(1, dtype=torch.bfloat16), "old_log_probs": torch.zeros(1, dtype=torch.bfloat16),
             "entropy": torch.zeros(1, dtype=torch.float16), "advantages": torch.zeros(1), "ref_log_probs": None}
    assert coarse_payloads("float32", named) == "log_probs, old_log_probs (bfloat16, u = 2^-8); entropy (float16, u = 2^-11)"
    assert coarse_payloads("bfloat16", named) == ""


# One sample of two loss tokens, logp = old = (−1, −2) (exact in bf16), A = 0.5, no entropy: the float64 truth is
# ratio 1, pg = −0.5 per token, pg_loss = loss = −0.5, ppo_kl = 0, pg_clipfrac = 0 (sum of per-sample means).
LOGP = [-1.0, -2.0]
# The storage rounding of bf16 copies of float32 log-probs: e_t = 2⁻⁸·(|logp| + |old|) = (2, 4)·2⁻⁸, weighted by
# 1/n = 1/2 and doubled (C_STORE): ppo_kl admits 2·(6/2)·2⁻⁸, pg_loss 2·(0.5·6/2)·2⁻⁸ (|pg|·e per token).
PPO_KL_STORE = 6 * U8
PG_STORE = 3 * U8
ATOL, RTOL = 1e-6, 1e-5


def _bundle(path, *, dtype: torch.dtype, compute: str, ppo_kl: float, pg_loss: float = -0.5,
            pg_losses: "torch.dtype | None" = None):
    samples = [SampleRecord(sample_id="s-0", group_index=0, response_length=2, total_length=10, loss_mask=[1, 1],
                            raw_reward=1.0, reward=0.5, micro_batch_id="mb-0")]
    index = BundleIndex(bundle_id="stored", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=RecomputeConfig(eps_clip=0.2, eps_clip_high=0.2))
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id="stored",
                        producer=ProducerInfo(commit="tests.test_storage_rounding", torch_version=torch.__version__),
                        stage_contracts=stage_contracts((StageId.SAMPLE, StageId.LOSS_POLICY)), payloads={},
                        comparison_policy=comparison_policy({"compute": compute, "accumulate": "float32"}),
                        redaction={})
    fields = {"loss": pg_loss, "pg_loss": pg_loss, "entropy_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": ppo_kl}
    writer = BundleWriter(path, manifest, index, {"loss.policy": fields})
    writer.write_payload("log_probs", torch.tensor(LOGP, dtype=dtype))
    writer.write_payload("old_log_probs", torch.tensor(LOGP, dtype=dtype))
    writer.write_payload("advantages", torch.tensor([0.5, 0.5]))
    if pg_losses is not None:
        writer.write_payload("pg_losses", torch.tensor([-0.5, -0.5], dtype=pg_losses))
    return writer.finalize(ranks=[0])


def _replay(cli, bundle, *flags):
    code, out, err = cli("replay", bundle, "--format", "json", *flags)
    assert err == "", err
    return code, json.loads(out)


def test_ppo_kl_admits_the_storage_rounding_and_not_more(tmp_path, cli):
    inside = _bundle(tmp_path / "in", dtype=torch.bfloat16, compute="float32", ppo_kl=PPO_KL_STORE - 1e-4)
    code, report = _replay(cli, inside)
    assert code == 0, report["stages"]
    hazard = [h for h in report["hazards"] if h["kind"] == "coarse_payload"]
    assert [h["message"] for h in hazard] == [
        "log_probs, old_log_probs (bfloat16, u = 2^-8) stored coarser than the declared float32 compute: every loss field "
        "admits their rounding; it exceeds the value in ppo_kl ±0.023 (value 0), where a change that size goes "
        "unseen: record the per-sample loss terms (loss_terms=, pg_losses=) to locate it"]

    outside = _bundle(tmp_path / "out", dtype=torch.bfloat16, compute="float32", ppo_kl=PPO_KL_STORE + 1e-4)
    code, report = _replay(cli, outside)
    assert code == 1
    d = report["first_divergence"]
    assert (d["stage"], d["field"]) == ("loss.policy", "ppo_kl")
    # atol + rtol·|e| + the scalar's own rounding bound (0 at T = 0 with every ppo_kl term 0) + the storage
    assert d["tolerance"] == pytest.approx(ATOL + RTOL * (PPO_KL_STORE + 1e-4) + PPO_KL_STORE, rel=1e-9)


def test_pg_loss_admits_the_storage_rounding_and_not_more(tmp_path, cli):
    code, _ = _replay(cli, _bundle(tmp_path / "in", dtype=torch.bfloat16, compute="float32", ppo_kl=0.0,
                                   pg_loss=-0.5 + PG_STORE - 1e-5))
    assert code == 0
    code, report = _replay(cli, _bundle(tmp_path / "out", dtype=torch.bfloat16, compute="float32", ppo_kl=0.0,
                                        pg_loss=-0.5 + PG_STORE + 1e-4))
    assert code == 1
    assert report["first_divergence"]["field"] == "loss"


@pytest.mark.parametrize("dtype,compute", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")],
                         ids=["float32-payloads", "bf16-compute"])
def test_payloads_as_fine_as_the_compute_admit_no_storage_rounding(tmp_path, cli, dtype, compute):
    """float32 payloads, or bf16 payloads of a declared bf16 compute (the values the loss consumed): the same
    ppo_kl of 0.0233 is a divergence, and no coarse_payload hazard is raised."""
    code, report = _replay(cli, _bundle(tmp_path / "b", dtype=dtype, compute=compute, ppo_kl=PPO_KL_STORE - 1e-4))
    assert code == 1
    assert report["first_divergence"]["field"] == "ppo_kl"
    assert not [h for h in report["hazards"] if h["kind"] == "coarse_payload"]


def _value_bundle(path, *, dtype: torch.dtype, vf_loss: float):
    """One sample of two loss tokens, v = v_old = (1, 2), R = (0.5, 1) (exact in bf16), no value clip:
    vf = d²/2 with d = (0.5, 1), vf_loss = (0.125 + 0.5)/2 = 0.3125 (sum of per-sample means)."""
    samples = [SampleRecord(sample_id="s-0", group_index=0, response_length=2, total_length=10, loss_mask=[1, 1],
                            raw_reward=1.0, reward=0.5, micro_batch_id="mb-0")]
    index = BundleIndex(bundle_id="value", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=RecomputeConfig(value_clip=None))
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id="value",
                        producer=ProducerInfo(commit="tests.test_storage_rounding", torch_version=torch.__version__),
                        stage_contracts=stage_contracts((StageId.SAMPLE, StageId.LOSS_VALUE)), payloads={},
                        comparison_policy=comparison_policy({"compute": "float32", "accumulate": "float32"}),
                        redaction={})
    writer = BundleWriter(path, manifest, index, {"loss.value": {"vf_loss": vf_loss, "vf_clipfrac": 0.0}})
    writer.write_payload("values", torch.tensor([1.0, 2.0], dtype=dtype))
    writer.write_payload("old_values", torch.tensor([1.0, 2.0], dtype=dtype))
    writer.write_payload("returns", torch.tensor([0.5, 1.0], dtype=dtype))
    return writer.finalize(ranks=[0])


# e = 2⁻⁸·(|v| + |v_old| + |R|) = (2.5, 5)·2⁻⁸ per token; vf_loss admits 2·(1/2)·Σ_t (|d| + e)·e.
E_VALUE = (2.5 * U8, 5.0 * U8)
VF_STORE = (0.5 + E_VALUE[0]) * E_VALUE[0] + (1.0 + E_VALUE[1]) * E_VALUE[1]


def test_the_value_loss_admits_the_storage_rounding_and_not_more(tmp_path, cli):
    assert VF_STORE == 0.024890899658203125  # (0.5 + 0.009765625)·0.009765625 + (1 + 0.01953125)·0.01953125
    code, _ = _replay(cli, _value_bundle(tmp_path / "in", dtype=torch.bfloat16, vf_loss=0.3125 + VF_STORE - 1e-4))
    assert code == 0
    code, report = _replay(cli, _value_bundle(tmp_path / "out", dtype=torch.bfloat16,
                                              vf_loss=0.3125 + VF_STORE + 1e-4))
    assert code == 1
    d = report["first_divergence"]
    assert (d["stage"], d["field"]) == ("loss.value", "vf_loss")
    # atol + rtol·|e| + the float32 evaluation's own bound + the storage term. Its own: 2u·|T| + 2u·(K_sum + K_outer)
    # + 2u·K_tok with u = 2⁻²⁴, K_sum = K_outer = 0.3125 and K_tok = 2·Σ_t w·(|d|·(|v| + |R| + |v_old|) + vf) =
    # 2·(1.375 + 5.5)/2 = 6.875 (stages.value)
    own = 2 * 2.0 ** -24 * (0.3125 + 0.625 + 6.875)
    assert d["tolerance"] == pytest.approx(ATOL + RTOL * d["expected"] + own + VF_STORE, rel=1e-12)
    # float32 payloads hold the values the producer used: the same vf_loss is a divergence
    code, _ = _replay(cli, _value_bundle(tmp_path / "f32", dtype=torch.float32, vf_loss=0.3125 + VF_STORE - 1e-4))
    assert code == 1


# One sample of two loss tokens under kl_in_reward="sequence", kl_coef 0.5, k1, rewards_normalization off (the
# score passed through): old = (−1, −2), ref = (−1.5, −2.5) (exact in bf16), kl = r = (0.5, 0.5), raw 1 →
# score 1 − 0.5·1.0 = 0.5. Under --chain the KL is recomputed from the bf16 log-probs: k1's slope is 1, e_r =
# 2⁻⁸·(|old| + |ref|) = (2.5, 4.5)·2⁻⁸, each kl admits 2·e_r, and the score |kl_coef|·Σ of them = 0.5·14·2⁻⁸.
SCORE = 0.5
# |kl_coef|·Σ 2·|dKL/dr|·u·(half spacings of old and ref): 0.5·2·(1 + 1 + 2 + 2)·2⁻⁸ for (−1, −2), (−1.5, −2.5)
SCORE_STORE = 6 * U8


def _score_bundle(path, *, reward: float, dtype: torch.dtype = torch.bfloat16):
    samples = [SampleRecord(sample_id="s-0", group_index=0, response_length=2, total_length=10, loss_mask=[1, 1],
                            raw_reward=1.0, reward=reward, micro_batch_id="mb-0")]
    config = RecomputeConfig(kl_in_reward="sequence", kl_coef=0.5, kl_loss_type="k1", rewards_normalization=False,
                             n_samples_per_prompt=1)
    index = BundleIndex(bundle_id="score", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=config)
    stages = (StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS)
    manifest = Manifest(format_version=FORMAT_VERSION, bundle_id="score",
                        producer=ProducerInfo(commit="tests.test_storage_rounding", torch_version=torch.__version__),
                        stage_contracts=stage_contracts(stages), payloads={},
                        comparison_policy=comparison_policy({"compute": "float32", "accumulate": "float32"}),
                        redaction={})
    writer = BundleWriter(path, manifest, index, {"reward.raw": {"raw_rewards": [1.0]},
                                                  "reward.post_process": {"rewards": [reward]}})
    writer.write_payload("old_log_probs", torch.tensor([-1.0, -2.0], dtype=dtype))
    writer.write_payload("ref_log_probs", torch.tensor([-1.5, -2.5], dtype=dtype))
    writer.write_payload("kl", torch.tensor([0.5, 0.5]))  # float32: the producer's own, exact
    if not writer.packed:  # format 1.3's writer stores the samples' masks as the payload loss_mask itself
        writer.write_payload("loss_mask", torch.tensor([1, 1]))
    return writer.finalize(ranks=[0])


def test_the_chained_kl_in_the_score_admits_its_log_probs_rounding_and_not_more(tmp_path, cli):
    """The --chain wrong verdict a new user found (rollout-1 diverging at up to 9.7e3× with bf16 log-probs):
    the KL recomputed from them is 2·|dKL/dr|·e_r off the producer's, and the score carries that sum."""
    inside = _score_bundle(tmp_path / "in", reward=SCORE + SCORE_STORE - 1e-4)
    code, report = _replay(cli, inside)  # teacher forcing: the recorded float32 kl, no allowance
    assert code == 1 and report["first_divergence"]["stage"] == "reward.post_process"
    code, report = _replay(cli, inside, "--chain")
    assert code == 0, report["stages"]
    hazard = {h["stage"]: h["message"] for h in report["hazards"] if h["kind"] == "coarse_payload"}
    assert hazard["reward.post_process"] == (
        "old_log_probs, ref_log_probs (bfloat16, u = 2^-8) stored coarser than the declared float32 compute: each "
        "score r − kl_coef·Σ kl admits their rounding, |kl_coef|·Σ 2·|dKL/dr|·u·(2^⌊log2|old|⌋ + 2^⌊log2|ref|⌋) "
        "(the KL recomputed from them, --chain)")  # 0.5·14·2⁻⁸ over a KL of 1: under a tenth, the penalty resolved

    code, report = _replay(cli, _score_bundle(tmp_path / "out", reward=SCORE + SCORE_STORE + 1e-4), "--chain")
    assert code == 1
    d = report["first_divergence"]
    assert (d["stage"], d["field"]) == ("reward.post_process", "reward")
    # atol + rtol·|e| + 2u32·|r| + |kl_coef|·(2·2⁻²⁴·... the float32 roundings) + the storage: within 1e-6 of it
    assert d["tolerance"] == pytest.approx(ATOL + RTOL * (SCORE + SCORE_STORE + 1e-4) + SCORE_STORE, abs=1e-6)


def test_float32_log_probs_give_the_chained_score_no_storage_allowance(tmp_path, cli):
    code, report = _replay(cli, _score_bundle(tmp_path / "b", reward=SCORE + SCORE_STORE - 1e-4,
                                              dtype=torch.float32), "--chain")
    assert code == 1
    assert not [h for h in report["hazards"] if h["kind"] == "coarse_payload"]


def test_a_recorded_output_stored_coarser_than_the_compute_is_named(tmp_path, cli):
    """float32 log-probs, a bf16 copy of the per-token surrogate (pg = −0.5 on both tokens, exact in bf16): its
    own rounding is in the field's bound, and the hazard says a change smaller than that is not seen there."""
    code, report = _replay(cli, _bundle(tmp_path / "b", dtype=torch.float32, compute="float32", ppo_kl=0.0,
                                        pg_losses=torch.bfloat16))
    assert code == 0, report["stages"]
    assert [h["message"] for h in report["hazards"] if h["kind"] == "coarse_payload"] == [
        "pg_losses (bfloat16, u = 2^-8) stored coarser than the declared float32 compute: compared within its own "
        "rounding (about u·|value|): a change smaller than that is not seen there"]


def test_exact_warns_that_coarse_payloads_cannot_match_bit_for_bit(tmp_path, cli):
    """--exact recomputes in float32 from the stored bf16 copies: a clean bundle fails everywhere, and the
    report says why before the user reads it as a bug."""
    bundle = _score_bundle(tmp_path / "b", reward=SCORE)
    _, report = _replay(cli, bundle, "--exact")
    assert f"{bundle / 'manifest.json'}: $.payloads: --exact recomputes from the stored payloads; old_log_probs, " \
           "ref_log_probs (bfloat16, u = 2^-8) stored coarser than the declared float32 compute hold one rounding " \
           "of the producer's values, so no recomputation need match bit for bit (the default mode admits it)" \
           in report["warnings"]
    _, report = _replay(cli, _score_bundle(tmp_path / "c", reward=SCORE, dtype=torch.float32), "--exact")
    assert not [w for w in report["warnings"] if "$.payloads" in w]
