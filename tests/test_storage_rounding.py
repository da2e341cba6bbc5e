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
from replay_lib.error_model import coarse_payloads, kl_bound, kl_slope, storage_error, storage_unit
from replay_lib.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, Identity, Manifest, ProducerInfo,
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


def test_storage_error_is_u_times_the_magnitudes():
    a = torch.tensor([-1.0, 2.0], dtype=torch.bfloat16)
    b = torch.tensor([-0.5, -3.0])
    assert storage_error(U8, a, b).tolist() == [1.5 * U8, 5.0 * U8]
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
    # 2·(exp(e_r) − 1)·e_r, e_r = 2⁻⁸·(2 × 0.7421875)
    e = 2 * 0.7421875 * U8
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


def _bundle(path, *, dtype: torch.dtype, compute: str, ppo_kl: float, pg_loss: float = -0.5):
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
    return writer.finalize(ranks=[0])


def _replay(cli, bundle):
    code, out, err = cli("replay", bundle, "--format", "json")
    assert err == "", err
    return code, json.loads(out)


def test_ppo_kl_admits_the_storage_rounding_and_not_more(tmp_path, cli):
    inside = _bundle(tmp_path / "in", dtype=torch.bfloat16, compute="float32", ppo_kl=PPO_KL_STORE - 1e-4)
    code, report = _replay(cli, inside)
    assert code == 0, report["stages"]
    hazard = [h for h in report["hazards"] if h["kind"] == "coarse_payload"]
    assert [h["message"] for h in hazard] == [
        "log_probs, old_log_probs (bfloat16, u = 2^-8) stored coarser than the declared float32 compute: every loss field "
        "admits their rounding; it exceeds the value in ppo_kl ±0.023 (value 0), which cannot tell a change that "
        "size: record the per-sample loss terms (loss_terms=, pg_losses=) to locate it"]

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
