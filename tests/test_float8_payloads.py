"""Payloads stored as float8 (``float8_e4m3fn``, ``float8_e5m2``, and the ``fnuz`` variants): torch does no
arithmetic on them, so a bundle that validated crashed every replay (exit 5, "Promotion for Float8 Types is not
supported"). The reader hands the stages an exact float32 copy that remembers the float8 dtype, and the error
model takes its storage rounding as it does bfloat16's: ``u = 2^-p``, ``p`` = stored mantissa bits + 1 (2⁻⁴ for
e4m3, 2⁻³ for e5m2), each value within ``u·max(|x|, normal_min)`` of what it rounds (a subnormal's rounding is
absolute)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from producers import Config, Size, bug_config, produce
from producers.stored_bf16 import StoredBF16

from replay_lib.bundle import BundleReader, BundleWriter
from replay_lib.bundle.dtypes import FLOAT8_DTYPES, stored_dtype, upcast_stored
from replay_lib.bundle.schema import UNPACKED_FORMAT_VERSION
from replay_lib.bundle.schema import (FORMAT_VERSION, ActorStepId, BundleIndex, Identity, Manifest, ProducerInfo,
                                      RecomputeConfig, SampleRecord, StageId, stage_contracts)
from replay_lib.judge.error_model import coarse_payloads, storage_error, storage_unit, unit_roundoff
from producers import comparison_policy

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U4, U3 = 2.0 ** -4, 2.0 ** -3


def test_the_unit_roundoff_of_a_float8_payload_follows_its_mantissa():
    assert len(FLOAT8_DTYPES) == 4
    assert [unit_roundoff(d) for d in FLOAT8_DTYPES] == [U4, U3, U4, U3]
    assert unit_roundoff("float8_e4m3fn") == U4
    # the float32 copy the reader hands out is judged by the dtype it was stored in
    copy = upcast_stored(torch.tensor([-1.0, 0.5]).to(E4M3))
    assert copy.dtype == torch.float32 and stored_dtype(copy) == E4M3
    assert unit_roundoff(copy) == U4
    assert storage_unit("float32", copy, torch.zeros(1, dtype=torch.bfloat16)) == U4
    assert storage_unit("bfloat16", upcast_stored(torch.zeros(1).to(E5M2))) == U3
    assert coarse_payloads("float32", {"log_probs": copy, "kl": "torch.float8_e5m2"}) == \
        "log_probs (float8_e4m3fn, u = 2^-4); kl (float8_e5m2, u = 2^-3)"


def test_a_subnormal_float8_value_rounds_by_half_its_spacing():
    """e4m3fn: normal from 2⁻⁶, subnormal spacing 2⁻⁹. −0.001 is stored as −2⁻⁹ (0.00095 off, 49% of it): the
    bound of a subnormal value is u·2⁻⁶ = 2⁻¹⁰, half the spacing, not u·|x| = 2⁻¹³; a normal one's stays u·|x|."""
    stored = torch.tensor([-0.001, -1.0, 0.0]).to(E4M3)
    assert stored.float().tolist() == [-2.0 ** -9, -1.0, 0.0]
    assert storage_error(U4, stored).tolist() == [2.0 ** -10, U4, 2.0 ** -10]
    assert abs(-0.001 - -2.0 ** -9) <= 2.0 ** -10
    # e5m2: normal from 2⁻¹⁴
    assert storage_error(U3, torch.tensor([2.0 ** -16, 4.0]).to(E5M2)).tolist() == [2.0 ** -17, 0.5]
    # bfloat16 keeps u·|x| (its normal range reaches 1e-38)
    assert storage_error(2.0 ** -8, torch.tensor([0.0, -2.0], dtype=torch.bfloat16)).tolist() == [0.0, 2.0 ** -7]


def _bundle(path, *, dtype: torch.dtype, logp: list[float], ppo_kl: float, format_version: str = FORMAT_VERSION):
    """One sample of two loss tokens, logp = old (exact in ``dtype``), A = 0.5: the float64 truth is ratio 1,
    ppo_kl 0, pg_loss = loss = −0.5, pg_clipfrac 0 (sum of per-sample means)."""
    samples = [SampleRecord(sample_id="s-0", group_index=0, response_length=2, total_length=10, loss_mask=[1, 1],
                            raw_reward=1.0, reward=0.5, micro_batch_id="mb-0")]
    index = BundleIndex(bundle_id="fp8", identity=Identity(actor_step_id=ActorStepId(rollout_id=1, step_id=0)),
                        samples=samples, config=RecomputeConfig(eps_clip=0.2, eps_clip_high=0.2))
    manifest = Manifest(format_version=format_version, bundle_id="fp8",
                        producer=ProducerInfo(commit="tests.test_float8_payloads", torch_version=torch.__version__),
                        stage_contracts=stage_contracts((StageId.SAMPLE, StageId.LOSS_POLICY)), payloads={},
                        comparison_policy=comparison_policy({"compute": "float32", "accumulate": "float32"}),
                        redaction={})
    fields = {"loss": -0.5, "pg_loss": -0.5, "entropy_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": ppo_kl}
    writer = BundleWriter(path, manifest, index, {"loss.policy": fields})
    writer.write_payload("log_probs", torch.tensor(logp).to(dtype))
    writer.write_payload("old_log_probs", torch.tensor(logp).to(dtype))
    writer.write_payload("advantages", torch.tensor([0.5, 0.5]))
    return writer.finalize(ranks=[0])


# safetensors has no fnuz float8 types: those payloads are stored in the older form's .pt files (format 1.1.0).
@pytest.mark.parametrize("dtype,version", [(E4M3, FORMAT_VERSION), (E5M2, FORMAT_VERSION),
                                           (E4M3, UNPACKED_FORMAT_VERSION), (E5M2, UNPACKED_FORMAT_VERSION),
                                           (torch.float8_e4m3fnuz, UNPACKED_FORMAT_VERSION),
                                           (torch.float8_e5m2fnuz, UNPACKED_FORMAT_VERSION)], ids=str)
def test_the_writer_and_the_reader_round_trip_a_float8_payload(tmp_path, cli, dtype, version):
    path = _bundle(tmp_path / "b", dtype=dtype, logp=[-1.0, -2.0], ppo_kl=0.0, format_version=version)
    suffix = ".safetensors" if version == FORMAT_VERSION else ".pt"
    stored = ["advantages", "log_probs", "old_log_probs"] + (["loss_mask"] if version == FORMAT_VERSION else [])
    assert sorted(p.name for p in (path / "payloads").iterdir()) == sorted(f"{n}{suffix}" for n in stored)
    reader = BundleReader(path)
    assert reader.manifest.payloads["log_probs"].dtype == str(dtype)
    t = reader.payload("log_probs")
    assert (t.dtype, stored_dtype(t), t.tolist()) == (torch.float32, dtype, [-1.0, -2.0])
    assert stored_dtype(reader.payload("advantages")) == torch.float32
    code, out, err = cli("validate", path)
    assert (code, err) == (0, ""), out
    code, out, err = cli("replay", path, "--format", "json")
    assert (code, err) == (0, ""), out


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz], ids=str)
def test_a_fnuz_float8_payload_in_the_default_form_is_refused_by_the_writer(tmp_path, dtype):
    with pytest.raises(ValueError) as info:
        _bundle(tmp_path / "b", dtype=dtype, logp=[-1.0, -2.0], ppo_kl=0.0)
    assert str(info.value) == (
        f"log_probs.safetensors: dtype {dtype} cannot be stored as safetensors (expected one of torch.float64, "
        "torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int64, "
        "torch.int32, torch.int16, torch.int8, torch.uint8)")
    assert not (tmp_path / "b").exists()


# The storage rounding of float8 copies of float32 log-probs: e_t = u·(|logp| + |old|) per token, weighted by 1/n =
# 1/2 and doubled (C_STORE): ppo_kl admits u·Σ_t (|logp_t| + |old_t|). logp = (−1, −2): 6u, 0.375 for e4m3 (u = 2⁻⁴).
# logp = (−2⁻⁹, −1), e4m3: the subnormal token counts 2⁻⁶ for each of its two magnitudes: u·(2·2⁻⁶ + 2) = 2⁻⁹ + 2⁻³
# (u·|x| would give 2⁻¹² + 2⁻³, which the same value 2⁻³ + 2⁻¹⁰ exceeds).
@pytest.mark.parametrize("dtype,logp,admitted", [(E4M3, [-1.0, -2.0], 6 * U4), (E5M2, [-1.0, -2.0], 6 * U3),
                                                 (E4M3, [-2.0 ** -9, -1.0], 2.0 ** -9 + 2.0 ** -3)],
                         ids=["e4m3", "e5m2", "e4m3-subnormal"])
def test_ppo_kl_admits_the_float8_rounding_and_not_more(tmp_path, cli, dtype, logp, admitted):
    code, out, err = cli("replay", _bundle(tmp_path / "in", dtype=dtype, logp=logp, ppo_kl=admitted - 2.0 ** -12),
                         "--format", "json")
    report = json.loads(out)
    assert (code, err) == (0, ""), report["stages"]
    u = "2^-4" if dtype == E4M3 else "2^-3"
    assert [h["message"].split(":")[0] for h in report["hazards"] if h["kind"] == "coarse_payload"] == [
        f"log_probs, old_log_probs ({str(dtype).removeprefix('torch.')}, u = {u}) stored coarser than the declared "
        "float32 compute"]
    code, out, _ = cli("replay", _bundle(tmp_path / "out", dtype=dtype, logp=logp, ppo_kl=admitted + 2.0 ** -12),
                       "--format", "json")
    d = json.loads(out)["first_divergence"]
    assert (code, d["stage"], d["field"]) == (1, "loss.policy", "ppo_kl")
    # atol + rtol·|e| + the storage term (the scalar's own float32 bound is 0 at T = 0 with every term 0)
    assert d["tolerance"] == pytest.approx(1e-6 + 1e-5 * (admitted + 2.0 ** -12) + admitted, rel=1e-9)


class StoredFloat8(StoredBF16):
    """``producers.stored_bf16`` (a float32 trainer) whose capture keeps float8 copies of the per-token values."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.name, self.dtype = f"stored_{str(dtype).removeprefix('torch.')}", dtype

    def payload(self, values):
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(self.dtype)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_a_float8_stored_step_replays_clean_and_a_bug_is_still_caught(tmp_path, cli, dtype):
    """Log-probs near 0 are e4m3 subnormals (below 2⁻⁶): without their absolute rounding the clean step's KL
    diverged. The KL payload being k1 where k3 is declared stays far above the float8 noise."""
    for chain in ((), ("--chain",)):
        clean = produce(tmp_path / f"clean{len(chain)}", StoredFloat8(dtype), 3, Size(32, 256, 8))
        code, out, err = cli("replay", clean, "--format", "json", *chain)
        assert (code, err) == (0, ""), [s for s in json.loads(out)["stages"] if s["status"] != "pass"]
    bug = produce(tmp_path / "bug", StoredFloat8(dtype), 3, Size(32, 256, 8), bug_config("k1_for_k3", Config()),
                  bug="k1_for_k3")
    code, out, _ = cli("replay", bug, "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergence"]["stage"], report["first_divergence"]["field"]) == (1, "advantage.kl", "kl")
