"""Wire compatibility with the original tool's format 1.0.0 (SPEC §2.1), both directions.

``write_original_bundle`` writes a bundle field by field the way the original writer does: ``torch.save``
payloads, ``json.dumps(indent=2, sort_keys=True) + "\\n"``, only the original's keys, its two sentinels.
The other direction decodes bundles we write with the original's field list, every field required.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Optional, Union

import msgspec
import pytest
import torch

from replay_lib.bundle import open_bundle
from replay_lib.cli import main
from replay_lib.demo import write_cohort, write_pr65, write_step_loss
from replay_lib.schema import INDEX_DECODER, RecomputeConfig

GROUPS = [0, 0, 1, 1]
RAW = [1.0, 3.0, 10.0, 12.0]
LENGTHS = [3, 2, 4, 3]
FIXED_REWARDS = [-1.0, 1.0, -1.0, 1.0]  # r − mean(semantic group), n=2, std off
BUGGY_REWARDS = [-5.5, -3.5, 3.5, 5.5]  # r − mean(physical batch of 4)
K3_AT_QUARTER = math.exp(-0.25) - 1 + 0.25  # old − ref = 0.25 for every token


def _dump(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _contract(stage: str, capability: str = "recompute") -> dict:
    impl = "reimplemented" if stage == "reward.post_process" else "reuse"
    return {"stage": stage, "version": "v1", "capability": capability, "implementation": impl,
            "inputs": [], "expected_outputs": []}


def write_original_bundle(path: Path, *, kind: str = "rollout", rewards=FIXED_REWARDS, kl_nan_at=None) -> Path:
    """A format-1.0.0 bundle exactly as the original writer lays it out (no field of ours anywhere)."""
    total = sum(LENGTHS)
    (path / "payloads").mkdir(parents=True)
    if kind == "rollout":
        kl = torch.full((total,), K3_AT_QUARTER)
        if kl_nan_at is not None:
            kl[kl_nan_at] = float("nan")
        tensors = {"old_log_probs": torch.full((total,), -0.5), "ref_log_probs": torch.full((total,), -0.75),
                   "kl": kl, "advantages": torch.repeat_interleave(torch.tensor(rewards), torch.tensor(LENGTHS))}
        stages = ["sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate"]
        expected = {"reward.raw": {"raw_rewards": RAW}, "reward.post_process": {"rewards": list(rewards)}}
        anchor = {"actor_step_id": None, "rollout_id": 120}
        config = {"advantage_estimator": "grpo", "n_samples_per_prompt": 2, "grpo_std_normalization": False,
                  "kl_loss_type": "k3", "kl_coef": 0.1, "eps_clip": 0.2, "eps_clip_high": 0.2, "entropy_coef": 0.0}
    else:
        tensors = {"log_probs": torch.full((total,), 0.5), "old_log_probs": torch.zeros(total),
                   "entropy": torch.full((total,), 0.5),
                   "advantages": torch.repeat_interleave(torch.tensor(FIXED_REWARDS), torch.tensor(LENGTHS))}
        stages = ["sample", "loss.policy"]
        pg_loss = 2 * math.exp(0.5) - 2.4  # A=+1: ratio e^0.5 clipped to 1.2; A=−1: e^0.5; sum of sample means
        expected = {"loss.policy": {"loss": pg_loss, "pg_loss": pg_loss, "entropy_loss": 2.0, "pg_clipfrac": 2.0,
                                    "ppo_kl": -2.0}}
        anchor = {"actor_step_id": {"rollout_id": 120, "step_id": 0}, "rollout_id": None}
        config = {"advantage_estimator": "grpo", "n_samples_per_prompt": 2}  # the rest: the original's defaults

    payloads = {}
    for name, tensor in tensors.items():
        file = path / "payloads" / f"{name}.pt"
        torch.save(tensor, file)
        data = file.read_bytes()
        payloads[name] = {"name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape),
                          "bytes": len(data), "sha256": _sha(data)}
    contracts = {s: _contract(s) for s in stages}
    contracts["loss.value"] = _contract("loss.value", "unsupported")
    manifest = {
        "format_version": "1.0.0", "bundle_id": f"orig-{kind}",
        "producer": {"commit": "9e8d7c6", "dirty_patch_digest": None, "torch_version": "2.5.1+cu124"},
        "stage_contracts": contracts, "payloads": payloads,
        "comparison_policy": {"exact_fields": [], "tolerances": {"advantage.kl": {"atol": 1e-6, "rtol": 1e-5}}},
        "redaction": {"prompt": "hash"},
    }
    samples = [{"sample_id": f"s-{i}", "group_index": g, "response_length": n, "total_length": n + 5,
                "loss_mask": [1] * n, "raw_reward": r, "reward": rw, "label_hash": None,
                "micro_batch_id": f"mb-{i // 2:04d}"}
               for i, (g, n, r, rw) in enumerate(zip(GROUPS, LENGTHS, RAW, FIXED_REWARDS))]
    index = {
        "bundle_id": f"orig-{kind}",
        "identity": {**anchor, "rollout_partition_ids": ["rp-120-0"], "consumer_batch_ids": ["cb-0", "cb-1"],
                     "micro_batch_ids": ["mb-0000", "mb-0001"], "semantic_group_ids": [0, 1],
                     "normalization_cohort_ids": ["nc-120"],
                     "weight_lineage": {"rollout_weight": 41, "actor_weight": 42},
                     "rank": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}},
        "samples": samples,
        "config": config,
    }
    blobs = {"manifest.json": _dump(manifest), "index.json": _dump(index), "expected.json": _dump(expected)}
    for name, blob in blobs.items():
        (path / name).write_bytes(blob)
    metadata = {name: _sha(blob) for name, blob in blobs.items()}
    (path / "COMPLETE.0").write_bytes(_dump({**anchor, "payloads": {n: p["sha256"] for n, p in payloads.items()},
                                             "metadata": metadata}))
    (path / "COMPLETE").write_bytes(_dump({"ranks": [0], "metadata": metadata}))
    return path


# ------------------------------------------------------------------------------- theirs in ours


def test_original_rollout_bundle_opens_validates_and_replays(tmp_path, capsys):
    b = write_original_bundle(tmp_path / "orig")
    bundles = open_bundle(b)
    reader = bundles.shards[0]
    assert reader.warnings == [] and reader.unknown_config == {}
    assert reader.manifest.format_version == "1.0.0"
    assert reader.index.config.kl_loss_type == "k3" and reader.index.identity.rollout_id == 120

    assert main(["validate", str(b)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "warning" not in out
    assert out.splitlines()[0] == ("bundle orig-rollout — valid (format 1.0.0, rollout-level, rollout_id=120, "
                                   "4 sample(s), 12 token(s))")

    assert main(["replay", str(b), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and report["first_divergence"] is None
    assert [(s["stage"], s["status"]) for s in report["stages"]] == [
        ("sample", "pass"), ("reward.raw", "pass"), ("reward.post_process", "pass"), ("advantage.kl", "pass"),
        ("advantage.estimate", "pass"), ("loss.policy", "skipped"), ("loss.value", "skipped"),
    ]


def test_original_buggy_bundle_points_at_reward_post_process(tmp_path, capsys):
    b = write_original_bundle(tmp_path / "orig", rewards=BUGGY_REWARDS)
    assert main(["replay", str(b)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[:5] == [
        "bundle orig-rollout — first divergent stage: reward.post_process",
        "[   pass] sample",
        "[   pass] reward.raw",
        "[   fail] reward.post_process — normalized reward mismatch in 4 sample(s)",
        "          reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5",
    ]


def test_original_step_bundle_replays_loss_with_original_config_defaults(tmp_path, capsys):
    b = write_original_bundle(tmp_path / "orig", kind="step")
    cfg = open_bundle(b).shards[0].index.config
    # absent keys take the original's defaults: "grpo", 1, false, "k1", 0.0, 0.2, 0.2, 0.0
    assert (cfg.grpo_std_normalization, cfg.kl_loss_type, cfg.kl_coef, cfg.eps_clip, cfg.eps_clip_high,
            cfg.entropy_coef) == (False, "k1", 0.0, 0.2, 0.2, 0.0)
    assert main(["validate", str(b), "--step", "120:0"]) == 0
    capsys.readouterr()
    assert main(["replay", str(b), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    loss = next(s for s in report["stages"] if s["stage"] == "loss.policy")
    assert loss["status"] == "pass" and loss["mismatches"] == 0
    assert loss["max_abs_error"] < 1e-6


def test_config_defaults_are_the_originals():
    index = INDEX_DECODER.decode(b'{"bundle_id": "x", "identity": {"rollout_id": 1}, "samples": [], "config": {}}')
    assert msgspec.structs.astuple(index.config)[:8] == ("grpo", 1, False, "k1", 0.0, 0.2, 0.2, 0.0)
    assert [f.name for f in msgspec.structs.fields(RecomputeConfig)][:8] == [
        "advantage_estimator", "n_samples_per_prompt", "grpo_std_normalization", "kl_loss_type", "kl_coef",
        "eps_clip", "eps_clip_high", "entropy_coef"]


def test_nan_in_an_expected_tensor_is_a_divergence(tmp_path, capsys):
    """The original passes a NaN in an expected tensor; here it is the first divergence (token 5 = s-2@0)."""
    b = write_original_bundle(tmp_path / "orig", kl_nan_at=5)
    assert main(["replay", str(b), "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["first_divergent_stage"] == "advantage.kl"
    d = report["first_divergence"]
    assert (d["sample_id"], d["token_offset"], d["field"], d["expected"]) == ("s-2", 0, "kl", None)
    assert d["actual"] == pytest.approx(K3_AT_QUARTER, abs=1e-7)
    kl = next(s for s in report["stages"] if s["stage"] == "advantage.kl")
    assert kl["mismatches"] == 1


# ------------------------------------------------------------------------------- ours in theirs
# The original's field list (SPEC §2.1), every field required: decoding our files with these Structs fails
# on any field the original format needs and we did not write.

Scalar = Union[int, str]


class _O(msgspec.Struct, forbid_unknown_fields=False):
    pass


class OActorStepId(_O):
    rollout_id: int
    step_id: int


class OWeightLineage(_O):
    rollout_weight: Optional[Scalar]
    actor_weight: Optional[Scalar]


class OIdentity(_O):
    actor_step_id: Optional[OActorStepId]
    rollout_id: Optional[int]
    rollout_partition_ids: list[Scalar]
    consumer_batch_ids: list[Scalar]
    micro_batch_ids: list[Scalar]
    semantic_group_ids: list[Scalar]
    normalization_cohort_ids: list[Scalar]
    weight_lineage: OWeightLineage
    rank: dict[str, int]


class OSample(_O):
    sample_id: str
    group_index: Optional[int]
    response_length: int
    total_length: int
    loss_mask: list[int]
    raw_reward: Optional[float]
    reward: Optional[float]
    label_hash: Optional[str]
    micro_batch_id: Optional[str]


class OConfig(_O):
    advantage_estimator: str
    n_samples_per_prompt: int
    grpo_std_normalization: bool
    kl_loss_type: str
    kl_coef: float
    eps_clip: float
    eps_clip_high: float
    entropy_coef: float


class OIndex(_O):
    bundle_id: str
    identity: OIdentity
    samples: list[OSample]
    config: OConfig


class OProducer(_O):
    commit: str
    dirty_patch_digest: Optional[str]
    torch_version: str


class OContract(_O):
    stage: str
    version: str
    capability: str
    implementation: str
    inputs: list[str]
    expected_outputs: list[str]


class OPayload(_O):
    name: str
    dtype: str
    shape: list[int]
    bytes: int
    sha256: str


class OTolerance(_O):
    atol: float
    rtol: float


class OPolicy(_O):
    exact_fields: list[str]
    tolerances: dict[str, OTolerance]


class OManifest(_O):
    format_version: str
    bundle_id: str
    producer: OProducer
    stage_contracts: dict[str, OContract]
    payloads: dict[str, OPayload]
    comparison_policy: OPolicy
    redaction: dict[str, str]


class ORankComplete(_O):
    actor_step_id: Optional[OActorStepId]
    rollout_id: Optional[int]
    payloads: dict[str, str]
    metadata: dict[str, str]


class OComplete(_O):
    ranks: list[int]
    metadata: dict[str, str]


class OShard(ORankComplete):
    expected_ranks: list[int]
    relpath: str


class OCohortComplete(_O):
    ranks: list[int]
    shards: dict[str, OShard]


STAGE_IDS = {"sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate", "loss.policy",
             "loss.value"}
CAPABILITIES = {"recompute", "recorded-only", "inspect-only", "unsupported"}


def _check_ours(b: Path) -> None:
    blobs = {n: (b / n).read_bytes() for n in ("manifest.json", "index.json", "expected.json", "COMPLETE",
                                                 "COMPLETE.0")}
    for name, blob in blobs.items():
        # UTF-8, 2-space indent, sorted keys, one trailing newline: the original writer's exact bytes
        assert blob == _dump(json.loads(blob.decode("utf-8"))), name
    manifest = msgspec.json.decode(blobs["manifest.json"], type=OManifest)
    index = msgspec.json.decode(blobs["index.json"], type=OIndex)
    complete = msgspec.json.decode(blobs["COMPLETE"], type=OComplete)
    rank0 = msgspec.json.decode(blobs["COMPLETE.0"], type=ORankComplete)
    assert manifest.format_version.startswith("1.")
    assert manifest.bundle_id == index.bundle_id
    assert set(manifest.stage_contracts) <= STAGE_IDS
    for key, contract in manifest.stage_contracts.items():
        assert contract.stage == key and contract.capability in CAPABILITIES
        assert contract.implementation in ("reuse", "reimplemented")
    assert set(index.identity.rank) == {"dp", "tp", "pp", "cp"}
    for name, spec in manifest.payloads.items():
        data = (b / "payloads" / f"{name}.pt").read_bytes()
        assert (spec.name, spec.bytes, spec.sha256) == (name, len(data), _sha(data))
        assert spec.dtype.startswith("torch.") and rank0.payloads[name] == spec.sha256
    meta = {n: _sha(blobs[n]) for n in ("manifest.json", "index.json", "expected.json")}
    assert complete.metadata == meta and rank0.metadata == meta and complete.ranks == [0]
    expected = json.loads(blobs["expected.json"])
    assert set(expected) <= {"reward.raw", "reward.post_process", "loss.policy"}
    if "reward.raw" in expected:
        assert set(expected["reward.raw"]) == {"raw_rewards"}
        assert set(expected["reward.post_process"]) == {"rewards"}
    if "loss.policy" in expected:
        assert set(expected["loss.policy"]) == {"loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"}


def test_our_bundles_carry_every_field_of_format_1_0_0(tmp_path):
    _check_ours(write_pr65(tmp_path / "rollout"))
    _check_ours(write_step_loss(tmp_path / "step"))
    rollout = json.loads((tmp_path / "rollout" / "index.json").read_bytes())
    assert set(rollout["samples"][0]) >= {"sample_id", "group_index", "response_length", "total_length",
                                          "loss_mask", "raw_reward", "reward", "label_hash", "micro_batch_id"}
    assert json.loads((tmp_path / "step" / "COMPLETE.0").read_bytes())["actor_step_id"] == {
        "rollout_id": 120, "step_id": 0}


def test_our_cohort_carries_the_shard_sentinels(tmp_path):
    c = write_cohort(tmp_path / "cohort", samples=4, tokens=3)
    cohort = msgspec.json.decode((c / "COMPLETE").read_bytes(), type=OCohortComplete)
    assert cohort.ranks == [0, 1] and sorted(cohort.shards) == ["0", "1"]
    for r in (0, 1):
        shard = msgspec.json.decode((c / f"COMPLETE.{r}").read_bytes(), type=OShard)
        assert shard == cohort.shards[str(r)]
        assert shard.expected_ranks == [0, 1] and shard.relpath == f"rank-{r}"
        meta = {n: _sha((c / f"rank-{r}" / n).read_bytes()) for n in ("manifest.json", "index.json", "expected.json")}
        assert shard.metadata == meta
        msgspec.json.decode((c / f"rank-{r}" / "index.json").read_bytes(), type=OIndex)
        msgspec.json.decode((c / f"rank-{r}" / "manifest.json").read_bytes(), type=OManifest)


def test_the_original_field_list_really_is_required():
    """The Structs above do fail on a missing field, so the two tests before them can fail."""
    doc = {"ranks": [0]}
    with pytest.raises(msgspec.ValidationError, match="missing required field `metadata`"):
        msgspec.json.decode(json.dumps(doc).encode(), type=OComplete)
