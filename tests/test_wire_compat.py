"""Wire compatibility with the original tool's format 1.0.0 (SPEC §2.1), both directions.

``write_original_bundle`` writes a bundle field by field the way the original writer does: ``torch.save``
payloads, ``json.dumps(indent=2, sort_keys=True) + "\\n"``, only the original's keys, its two sentinels.
The other direction decodes bundles we write with the original's field list, every field required.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import math
import shutil
from pathlib import Path
from typing import Optional, Union

import msgspec
import pytest
import torch

from replay_lib.bundle import open_bundle, try_finalize_cohort
from replay_lib.bundle.writer import wire_manifest
from replay_lib.cli import main
from replay_lib.demo import (synthetic_parts, write_bundle, write_cohort, write_pr65, write_step_loss,
                             write_support_bundle)
from replay_lib.bundle.schema import UNPACKED_FORMAT_VERSION
from replay_lib.bundle.schema import (INDEX_DECODER, MANIFEST_DECODER, RecomputeConfig, StageCapability, StageContract,
                               StageId)

GROUPS = [0, 0, 1, 1]
RAW = [1.0, 3.0, 10.0, 12.0]
LENGTHS = [3, 2, 4, 3]
# The original's reader reads the older form (the masks in index.json, .pt payloads): the bundles of ours it is
# given here are written as 1.1.0 explicitly (a 1.3.0 bundle reaches it through ``convert --to 1.0.0``).
OLD = UNPACKED_FORMAT_VERSION
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


def write_original_bundle(path: Path, *, kind: str = "rollout", rewards=FIXED_REWARDS, kl_nan_at=None,
                          rank: int = 0, early: bool = False, early_rank_metadata: bool = False,
                          expected_edit=None) -> Path:
    """A format-1.0.0 bundle exactly as the original writer lays it out (no field of ours anywhere).

    ``rank``: the rank whose ``COMPLETE.<rank>`` it holds. ``early``: as its early writer (93902db) wrote it,
    a ``COMPLETE`` of ``ranks`` only and a ``COMPLETE.<rank>`` without ``metadata`` (with it when
    ``early_rank_metadata``). ``expected_edit(expected)`` changes expected.json before it is written
    (Python's json writes a non-finite float as ``NaN`` / ``Infinity``)."""
    total = sum(LENGTHS)
    (path / "payloads").mkdir(parents=True)
    if kind == "rollout":
        kl = torch.full((total,), K3_AT_QUARTER)
        if kl_nan_at is not None:
            kl[kl_nan_at] = float("nan")
        tensors = {"old_log_probs": torch.full((total,), -0.5), "ref_log_probs": torch.full((total,), -0.75),
                   "kl": kl, "advantages": torch.repeat_interleave(torch.tensor(rewards), torch.tensor(LENGTHS))}
        stages = ["sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate"]
        expected = {"reward.raw": {"raw_rewards": list(RAW)}, "reward.post_process": {"rewards": list(rewards)}}
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
    if expected_edit is not None:
        expected_edit(expected)
    blobs = {"manifest.json": _dump(manifest), "index.json": _dump(index), "expected.json": _dump(expected)}
    for name, blob in blobs.items():
        (path / name).write_bytes(blob)
    metadata = {name: _sha(blob) for name, blob in blobs.items()}
    shard = {**anchor, "payloads": {n: p["sha256"] for n, p in payloads.items()}}
    if not early or early_rank_metadata:
        shard["metadata"] = metadata
    (path / f"COMPLETE.{rank}").write_bytes(_dump(shard))
    (path / "COMPLETE").write_bytes(_dump({"ranks": [rank]} if early else {"ranks": [rank], "metadata": metadata}))
    return path


def write_original_shard(cohort: Path, rank: int, ranks=(0, 1), **kwargs) -> Path:
    """Rank ``rank`` of a cohort as the original writer publishes it: ``rank-<r>/`` a bundle directory of
    its own, then the shard sentinel ``COMPLETE.<r>`` (anchor, payloads, metadata, expected_ranks, relpath;
    no ``bundle_id``) in the cohort directory. Its finalizer would then find the other ranks missing."""
    shard_dir = write_original_bundle(cohort / f"rank-{rank}", rank=rank, **kwargs)
    own = json.loads((shard_dir / f"COMPLETE.{rank}").read_bytes())
    (cohort / f"COMPLETE.{rank}").write_bytes(_dump({**own, "expected_ranks": list(ranks),
                                                      "relpath": f"rank-{rank}"}))
    return shard_dir


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


class OStageId(str, enum.Enum):
    """The original's stage ids: its reader parses every key of stage_contracts as this enum."""

    SAMPLE = "sample"
    REWARD_RAW = "reward.raw"
    REWARD_POST_PROCESS = "reward.post_process"
    ADVANTAGE_KL = "advantage.kl"
    ADVANTAGE_ESTIMATE = "advantage.estimate"
    LOSS_POLICY = "loss.policy"
    LOSS_VALUE = "loss.value"


class OContract(_O):
    stage: OStageId
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
    stage_contracts: dict[OStageId, OContract]
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


def _check_ours(b: Path, rank: int = 0) -> None:
    blobs = {n: (b / n).read_bytes() for n in ("manifest.json", "index.json", "expected.json", "COMPLETE",
                                                 f"COMPLETE.{rank}")}
    for name, blob in blobs.items():
        # UTF-8, 2-space indent, sorted keys, one trailing newline: the original writer's bytes, but for the
        # spelling of an exponent (Python writes 1e-06, we write 1e-6; both parse to the same float)
        assert blob == re.sub(rb"e([-+])0(\d)", rb"e\1\2", _dump(json.loads(blob.decode("utf-8")))), name
    manifest = msgspec.json.decode(blobs["manifest.json"], type=OManifest)
    index = msgspec.json.decode(blobs["index.json"], type=OIndex)
    complete = msgspec.json.decode(blobs["COMPLETE"], type=OComplete)
    rank0 = msgspec.json.decode(blobs[f"COMPLETE.{rank}"], type=ORankComplete)
    assert manifest.format_version.startswith("1.")
    assert manifest.bundle_id == index.bundle_id
    assert set(manifest.stage_contracts) <= STAGE_IDS
    for key, contract in manifest.stage_contracts.items():
        assert contract.stage == key and contract.capability in CAPABILITIES
        assert key != OStageId.LOSS_VALUE or contract.capability == "unsupported"  # it never recomputes it
        assert contract.implementation in ("reuse", "reimplemented")
    assert set(index.identity.rank) == {"dp", "tp", "pp", "cp"}
    for name, spec in manifest.payloads.items():
        data = (b / "payloads" / f"{name}.pt").read_bytes()
        assert (spec.name, spec.bytes, spec.sha256) == (name, len(data), _sha(data))
        assert spec.dtype.startswith("torch.") and rank0.payloads[name] == spec.sha256
    meta = {n: _sha(blobs[n]) for n in ("manifest.json", "index.json", "expected.json")}
    assert complete.metadata == meta and rank0.metadata == meta and complete.ranks == [rank]
    expected = json.loads(blobs["expected.json"])
    assert set(expected) <= {"reward.raw", "reward.post_process", "loss.policy"}
    if "reward.raw" in expected:
        assert set(expected["reward.raw"]) == {"raw_rewards"}
        assert set(expected["reward.post_process"]) == {"rewards"}
    if "loss.policy" in expected:
        assert set(expected["loss.policy"]) == {"loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"}


def test_our_bundles_carry_every_field_of_format_1_0_0(tmp_path):
    _check_ours(write_pr65(tmp_path / "rollout", format_version=OLD))
    _check_ours(write_step_loss(tmp_path / "step", format_version=OLD))
    rollout = json.loads((tmp_path / "rollout" / "index.json").read_bytes())
    assert set(rollout["samples"][0]) >= {"sample_id", "group_index", "response_length", "total_length",
                                          "loss_mask", "raw_reward", "reward", "label_hash", "micro_batch_id"}
    assert json.loads((tmp_path / "step" / "COMPLETE.0").read_bytes())["actor_step_id"] == {
        "rollout_id": 120, "step_id": 0}


def test_our_cohort_carries_the_shard_sentinels(tmp_path):
    c = write_cohort(tmp_path / "cohort", samples=4, tokens=3, format_version=OLD)
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


def original_reads(b: Path) -> OManifest:
    """What the original's reader requires of a bundle directory (SPEC §2.1), modelled from its field list:
    ``COMPLETE`` = {ranks, metadata} and each listed ``COMPLETE.<r>`` = {anchor, payloads, metadata}, every
    checksum equal to its file, stage ids of its own enum; raises where it would refuse the bundle."""
    if not (b / "COMPLETE").is_file():
        raise FileNotFoundError(f"missing COMPLETE sentinel in {b}")
    complete = msgspec.json.decode((b / "COMPLETE").read_bytes(), type=OComplete)
    blobs = {n: (b / n).read_bytes() for n in ("manifest.json", "index.json", "expected.json")}
    assert complete.metadata == {n: _sha(blob) for n, blob in blobs.items()}
    manifest = msgspec.json.decode(blobs["manifest.json"], type=OManifest)
    msgspec.json.decode(blobs["index.json"], type=OIndex)
    for r in complete.ranks:
        shard = msgspec.json.decode((b / f"COMPLETE.{r}").read_bytes(), type=ORankComplete)
        assert shard.metadata == complete.metadata
        for name, spec in manifest.payloads.items():
            assert shard.payloads[name] == spec.sha256 == _sha((b / "payloads" / f"{name}.pt").read_bytes())
    return manifest


def original_reads_cohort(c: Path) -> list[OManifest]:
    """The original's cohort reader: the cohort COMPLETE, then each shard's ``relpath`` as a bundle directory."""
    cohort = msgspec.json.decode((c / "COMPLETE").read_bytes(), type=OCohortComplete)
    return [original_reads(c / cohort.shards[str(r)].relpath) for r in cohort.ranks]


# ------------------------------------------------------------------------------- I1: the early writer


def test_a_bundle_of_the_early_writer_opens_with_a_warning(tmp_path, cli):
    b = write_original_bundle(tmp_path / "early", early=True)
    assert json.loads((b / "COMPLETE").read_bytes()) == {"ranks": [0]}
    assert "metadata" not in json.loads((b / "COMPLETE.0").read_bytes())
    warning = (f"warning: {b / 'COMPLETE'}: $.metadata: absent (written by an early 1.0.0 writer): the JSON "
               f"files' checksums were not verified")
    rc, out, err = cli("validate", b)
    assert (rc, err) == (0, "")
    assert out.splitlines()[0].startswith("bundle orig-rollout — valid (format 1.0.0")
    assert out.splitlines()[-1] == warning
    rc, out, err = cli("validate", b, "--format", "json")
    assert rc == 0 and json.loads(out)["warnings"] == [warning[len("warning: "):]]
    rc, out, err = cli("inspect", b)
    assert (rc, err) == (0, "") and warning in out.splitlines()
    assert out.splitlines()[0] == f"{b} — bundle, complete"  # a warning, not a problem
    rc, out, err = cli("replay", b, "--format", "json")
    assert (rc, err) == (0, "") and json.loads(out)["passed"] is True


def test_the_early_writer_s_bundle_is_verified_everywhere_else(tmp_path, cli):
    # its payloads: against the manifest and COMPLETE.0
    b = write_original_bundle(tmp_path / "payload", early=True)
    kl = b / "payloads" / "kl.pt"
    recorded = _sha(kl.read_bytes())
    data = bytearray(kl.read_bytes())
    data[-30] ^= 0xFF  # same size, other bytes
    kl.write_bytes(bytes(data))
    rc, out, err = cli("validate", b)
    assert (rc, out) == (3, "") and "Traceback" not in err
    assert err == (f"trajectory-replay: error: {kl}: sha256 mismatch (manifest {recorded[:12]}…, COMPLETE.0 "
                   f"{recorded[:12]}…, file {_sha(bytes(data))[:12]}…)\n")
    # its JSON files, against a COMPLETE.0 that records their checksums (then no warning is due)
    b = write_original_bundle(tmp_path / "rank-metadata", early=True, early_rank_metadata=True)
    rc, out, err = cli("validate", b)
    assert (rc, err) == (0, "") and "warning" not in out
    index = json.loads((b / "index.json").read_bytes())
    index["samples"][0]["raw_reward"] = 2.0
    (b / "index.json").write_bytes(_dump(index))
    rc, out, err = cli("validate", b)
    assert rc == 3 and "Traceback" not in err
    assert f"{b / 'index.json'}: sha256 mismatch (COMPLETE.0 " in err  # the sentinel that disagrees, named


def test_a_bundle_of_ours_cannot_shed_its_checksums(tmp_path, cli, bundle_tools):
    """Deleting $.metadata from a bundle we wrote (format 1.3.0, the default) does not skip the check: refused."""
    b = write_pr65(tmp_path / "ours")
    for name in ("COMPLETE", "COMPLETE.0"):
        doc = json.loads((b / name).read_bytes())
        del doc["metadata"]
        (b / name).write_bytes(bundle_tools.dump_json(doc))
    rc, out, err = cli("validate", b)
    assert (rc, out) == (3, "") and "Traceback" not in err
    assert err == (f"trajectory-replay: error: {b / 'COMPLETE'}: $.metadata: missing (a bundle of format '1.3.0' "
                   f"records the JSON files' checksums there; only an early 1.0.0 writer omitted them)\n")
    rc, out, err = cli("inspect", b)
    assert rc == 0 and "problem: COMPLETE: $.metadata: missing (format '1.3.0' records the checksums)" in out


def test_a_cohort_complete_in_a_bundle_directory_is_named_as_such(tmp_path, cli):
    c = write_cohort(tmp_path / "cohort", samples=4, tokens=3)
    b = write_pr65(tmp_path / "b")
    (b / "COMPLETE").write_bytes((c / "COMPLETE").read_bytes())
    rc, out, err = cli("validate", b)
    assert (rc, out) == (3, "") and "Traceback" not in err
    assert err == (f"trajectory-replay: error: {b / 'COMPLETE'}: $.shards: a cohort COMPLETE in a bundle directory "
                   f"(a bundle's COMPLETE holds $.ranks and $.metadata)\n")


# ------------------------------------------------------------------------------- I2, I3: cohorts


def test_each_rank_shard_we_write_is_a_bundle_directory_the_original_reads(tmp_path):
    c = write_cohort(tmp_path / "cohort", samples=4, tokens=3, format_version=OLD)
    manifests = original_reads_cohort(c)
    assert [m.bundle_id for m in manifests] == ["cohort-7-0", "cohort-7-0"]
    for r in (0, 1):
        _check_ours(c / f"rank-{r}", rank=r)  # the original's bytes and fields, COMPLETE = {ranks: [r], metadata}
        assert sorted(p.name for p in (c / f"rank-{r}").glob("COMPLETE*")) == ["COMPLETE", f"COMPLETE.{r}"]


def test_a_rank_shard_with_its_own_complete_is_still_refused_until_the_cohort_is_final(tmp_path, cli):
    c = tmp_path / "cohort"
    write_bundle(c, *synthetic_parts(samples=4, tokens=3, bundle_id="c", format_version=OLD), rank=0, ranks=[0, 1])
    shard = c / "rank-0"
    assert (shard / "COMPLETE").is_file() and not (c / "COMPLETE").exists()
    original_reads(shard)  # the original opens a rank shard directly; ours waits for the cohort
    line = (f"trajectory-replay: error: {c / 'COMPLETE'}: cohort has no final COMPLETE (ranks published: "
            f"COMPLETE.0); a rank-local bundle is refused until every expected rank has flushed\n")
    for path in (c, shard):
        assert cli("validate", path) == (3, "", line)
        assert cli("replay", path) == (3, "", line)
    rc, out, err = cli("inspect", shard, "--format", "json")
    doc = json.loads(out)
    assert (rc, err, doc["complete"], doc["bundles"][0]["rank"]) == (0, "", False, 0)
    assert doc["problems"] == [f"no cohort COMPLETE in {c} (a rank shard is read once its cohort is final)"]


def _our_rank_of(original_shard: Path, cohort: Path, rank: int, ranks=(0, 1)) -> Path:
    """Rank ``rank`` written by our writer with the data of an original shard (other sample ids)."""
    from replay_lib.bundle import BundleWriter
    from replay_lib.bundle.schema import MANIFEST_DECODER, decode_expected, decode_index

    manifest = MANIFEST_DECODER.decode((original_shard / "manifest.json").read_bytes())
    index, _ = decode_index((original_shard / "index.json").read_bytes())
    expected = decode_expected((original_shard / "expected.json").read_bytes())
    samples = [msgspec.structs.replace(s, sample_id=f"r{rank}-{s.sample_id}") for s in index.samples]
    writer = BundleWriter(cohort, manifest, msgspec.structs.replace(index, samples=samples), expected, rank=rank)
    for name in manifest.payloads:
        writer.write_payload(name, torch.load(original_shard / "payloads" / f"{name}.pt", weights_only=True))
    return writer.finalize(ranks=list(ranks))


def test_a_cohort_the_original_began_and_we_completed_is_finalized(tmp_path, cli):
    c = tmp_path / "orig-rollout"
    write_original_shard(c, 0)  # the original published rank 0 first: its finalizer found rank 1 missing
    assert "bundle_id" not in json.loads((c / "COMPLETE.0").read_bytes())
    _our_rank_of(c / "rank-0", c, 1)  # ours publishes last and finalizes
    cohort = json.loads((c / "COMPLETE").read_bytes())
    assert cohort["ranks"] == [0, 1] and cohort["shards"]["1"]["bundle_id"] == "orig-rollout"
    assert cohort["shards"]["0"]["bundle_id"] is None
    _validates_and_replays_clean(cli, c)
    assert len(original_reads_cohort(c)) == 2  # and the original reads the cohort it began


def test_a_cohort_whose_shards_disagree_is_not_finalized(tmp_path):
    c = tmp_path / "orig-rollout"
    write_original_shard(c, 0)
    shard = json.loads((c / "COMPLETE.0").read_bytes())
    shard["rollout_id"] = 121  # another rollout's shard: anchors differ
    (c / "COMPLETE.0").write_bytes(_dump(shard))
    _our_rank_of(c / "rank-0", c, 1)
    assert not (c / "COMPLETE").exists()
    shard["rollout_id"], shard["bundle_id"] = 120, "another-bundle"  # anchors agree, recorded bundle ids do not
    (c / "COMPLETE.0").write_bytes(_dump(shard))
    assert try_finalize_cohort(c) is False and not (c / "COMPLETE").exists()
    del shard["bundle_id"]
    (c / "COMPLETE.0").write_bytes(_dump(shard))
    assert try_finalize_cohort(c) is True


# ------------------------------------------------------------------------------- I4: extension stages


def test_our_extension_stages_are_declared_where_the_original_ignores_them(tmp_path, cli):
    b = write_support_bundle(tmp_path / "support", samples=4, tokens=3, k=4, vocab_size=64, format_version=OLD)
    doc = json.loads((b / "manifest.json").read_bytes())
    assert "logprob.support" not in doc["stage_contracts"]
    assert list(doc["extension_stage_contracts"]) == ["logprob.support"]
    assert doc["extension_stage_contracts"]["logprob.support"]["capability"] == "recompute"
    # the original parses every stage_contracts key as its StageId and still finds its V1 stages to run
    theirs = original_reads(b)
    assert sorted(s.value for s, c in theirs.stage_contracts.items() if c.capability == "recompute") == [
        "advantage.estimate", "advantage.kl", "loss.policy", "reward.post_process", "reward.raw", "sample"]
    _check_ours(b)
    # ours sees the one map, and replays it
    reader = open_bundle(b).shards[0]
    assert reader.manifest.stage_contracts[StageId.LOGPROB_SUPPORT].capability == StageCapability.RECOMPUTE
    assert reader.manifest.extension_stage_contracts == {} and reader.warnings == []
    rc, out, err = cli("replay", b, "--format", "json")
    assert (rc, err) == (0, "")
    assert ("logprob.support", "pass") in [(s["stage"], s["status"]) for s in json.loads(out)["stages"]]


def test_the_placement_our_earlier_versions_wrote_reads_the_same(tmp_path, cli, bundle_tools):
    new = write_support_bundle(tmp_path / "new", samples=4, tokens=3, k=4, vocab_size=64, full_vocab_bug=True)
    old = tmp_path / "old"
    shutil.copytree(new, old)

    def earlier(doc):  # logprob.support inside stage_contracts, no extension field
        doc["stage_contracts"].update(doc.pop("extension_stage_contracts"))

    bundle_tools.edit_json(old, "manifest.json", earlier)
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'logprob.support'"):
        original_reads(old)  # what the original could not even inspect
    a, b = open_bundle(new).shards[0], open_bundle(old).shards[0]
    assert list(a.manifest.stage_contracts.items()) == list(b.manifest.stage_contracts.items())
    assert a.manifest == b.manifest and a.warnings == b.warnings == []
    reports = []
    for path in (new, old):
        rc, out, err = cli("replay", path, "--format", "json")
        assert (rc, err) == (1, "")
        reports.append(json.loads(out))
    assert reports[0]["first_divergent_stage"] == "logprob.support"
    assert json.dumps(reports[0]).replace(str(new), "B") == json.dumps(reports[1]).replace(str(old), "B")
    assert cli("validate", new)[1] == cli("validate", old)[1].replace(str(old), str(new))


def test_a_stage_the_original_declares_unsupported_keeps_that_in_its_view(tmp_path):
    """loss.value declared recompute (an extension of ours): the original's view says unsupported, as it
    writes itself; ours reads the real contract from the extension field."""
    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=3, bundle_id="v", format_version=OLD)
    contracts = dict(manifest.stage_contracts)
    contracts[StageId.LOSS_VALUE] = StageContract(stage=StageId.LOSS_VALUE, capability=StageCapability.RECOMPUTE)
    manifest = msgspec.structs.replace(manifest, stage_contracts=contracts)
    doc = wire_manifest(manifest)
    assert doc["stage_contracts"]["loss.value"]["capability"] == "unsupported"
    assert doc["extension_stage_contracts"] == {"loss.value": msgspec.to_builtins(contracts[StageId.LOSS_VALUE])}
    b = write_bundle(tmp_path / "v", manifest, index, expected, payloads)
    assert original_reads(b).stage_contracts[OStageId.LOSS_VALUE].capability == "unsupported"
    assert MANIFEST_DECODER.decode((b / "manifest.json").read_bytes()).stage_contracts == contracts


def test_an_extension_contract_naming_another_stage_is_refused_where_it_is(tmp_path, cli, bundle_tools):
    b = write_support_bundle(tmp_path / "support", samples=4, tokens=3, k=4, vocab_size=64)
    bundle_tools.edit_json(b, "manifest.json",
                           lambda doc: doc["extension_stage_contracts"]["logprob.support"].update(stage="sample"))
    rc, out, err = cli("validate", b)
    assert (rc, out) == (3, "")
    assert err == (f"trajectory-replay: error: {b / 'manifest.json'}: $.extension_stage_contracts.logprob.support.stage: "
                   f"'sample' does not match its key\n")


# ------------------------------------------------------------------------------- I6: NaN / Infinity literals


def test_nan_literal_in_the_original_s_expected_json_is_read_and_diverges(tmp_path, cli):
    b = write_original_bundle(tmp_path / "nan",
                              expected_edit=lambda e: e["reward.raw"]["raw_rewards"].__setitem__(1, math.nan))
    assert b'"raw_rewards": [\n      1.0,\n      NaN,\n' in (b / "expected.json").read_bytes()
    assert cli("validate", b)[0] == 0  # validate never compares numbers
    rc, out, err = cli("inspect", b)
    assert (rc, err) == (0, "") and "problem" not in out
    rc, out, err = cli("replay", b, "--format", "json")
    assert (rc, err) == (1, "")
    report = json.loads(out)
    d = report["first_divergence"]
    assert (report["first_divergent_stage"], d["sample_id"], d["field"], d["expected"], d["actual"]) == (
        "reward.raw", "s-1", "raw_reward", None, 3.0)
    assert [s["status"] for s in report["stages"]][:3] == ["pass", "fail", "pass"]
    rc, out, err = cli("replay", b)
    assert rc == 1 and "expected=nan actual=3.0" in out and "Traceback" not in err


def test_infinity_literals_in_a_slot_no_stage_compares_pass(tmp_path, cli):
    """A rollout bundle that also holds loss.policy values (the stage is not declared, so never compared)."""
    def edit(e):
        e["loss.policy"] = {"loss": math.inf, "pg_loss": -math.inf, "entropy_loss": 0.0, "pg_clipfrac": 0.0,
                            "ppo_kl": math.nan}

    b = write_original_bundle(tmp_path / "inf", expected_edit=edit)
    blob = (b / "expected.json").read_bytes()
    assert b'"loss": Infinity' in blob and b'"pg_loss": -Infinity' in blob and b'"ppo_kl": NaN' in blob
    expected = open_bundle(b).shards[0].expected
    assert expected["loss.policy"]["loss"] == math.inf and expected["loss.policy"]["pg_loss"] == -math.inf
    rc, out, err = cli("replay", b, "--format", "json")
    assert (rc, err) == (0, "")
    assert ("loss.policy", "skipped") in [(s["stage"], s["status"]) for s in json.loads(out)["stages"]]


def test_malformed_json_that_holds_a_nan_keeps_its_error(tmp_path, cli, bundle_tools):
    b = write_original_bundle(tmp_path / "bad")
    (b / "expected.json").write_bytes(b'{"reward.raw": {"raw_rewards": [1.0, NaN, 10.0, 12.0,]}}\n')
    bundle_tools.reseal(b)
    rc, out, err = cli("validate", b)
    assert (rc, out) == (3, "") and "Traceback" not in err
    # where the document really breaks (the trailing comma), not at the NaN it may hold
    assert err == (f"trajectory-replay: error: {b / 'expected.json'}: invalid JSON: JSON is malformed: expecting "
                   f"value (byte 53)\n")
    (b / "expected.json").write_bytes(b'{"reward.raw": {"raw_rewards": [1.0, NaN, "x", 12.0]}}\n')
    bundle_tools.reseal(b)
    rc, out, err = cli("validate", b)
    assert (rc, out) == (3, "") and "Traceback" not in err
    assert err.startswith(f"trajectory-replay: error: {b / 'expected.json'}: $") and "got `str`" in err


def _validates_and_replays_clean(cli, c) -> None:
    """The two-rank original-layout cohort ``c`` validates as format 1.0.0 and replays with no divergence."""
    rc, out, err = cli("validate", c)
    assert (rc, err) == (0, "")
    assert out.splitlines()[0] == ("bundle orig-rollout — valid (format 1.0.0, rollout-level, rollout_id=120, "
                                   "8 sample(s), 24 token(s), 2 ranks)")
    rc, out, err = cli("replay", c, "--format", "json")
    assert (rc, err) == (0, "") and json.loads(out)["passed"] is True


def test_a_cohort_the_original_wrote_whole_opens_and_replays(tmp_path, cli):
    c = tmp_path / "orig-rollout"
    for r in (0, 1):
        write_original_shard(c, r)
    shards = {str(r): json.loads((c / f"COMPLETE.{r}").read_bytes()) for r in (0, 1)}
    (c / "COMPLETE").write_bytes(_dump({"ranks": [0, 1], "shards": shards}))  # its finalizer's cohort COMPLETE
    _validates_and_replays_clean(cli, c)
