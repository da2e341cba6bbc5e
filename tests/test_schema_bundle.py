"""Schema and bundle I/O through the real msgspec encoder/decoder and the real filesystem."""

from __future__ import annotations

import hashlib
import json
import re
import math
import os
import threading

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleReader, BundleWriter, open_bundle
from replay_lib.demo import synthetic_parts, write_bundle
from replay_lib.errors import BundleError
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import FORMAT_VERSION, UNPACKED_FORMAT_VERSION
from replay_lib.bundle.schema import (
    BUNDLE_COMPLETE_DECODER,
    INDEX_DECODER,
    decode_index,
    MANIFEST_DECODER,
    RANK_COMPLETE_DECODER,
    ActorStepId,
    BundleComplete,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    ProducerInfo,
    RankComplete,
    RecomputeConfig,
    SampleRecord,
    StageCapability,
    StageContract,
    StageId,
    Tolerance,
    encode_json,
)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------ the seed's example


def test_seed_bundlewriter_example_runs_as_written(tmp_path):
    """The "Building a bundle programmatically" example, with its ``...`` filled in.

    Two groups of two (n_samples_per_prompt=2): raw [1, −1] → rewards [1, −1]; raw [0.5, 2.5] → [−1, 1].
    logp = 0.5, old = 0: ratio e^0.5 ≈ 1.6487 is clipped to 1.2 where A = +1 (pg = −1.2, clipped) and not
    where A = −1 (pg = e^0.5). Sum of per-sample masked means: pg_loss = 2·e^0.5 − 2.4, pg_clipfrac = 2,
    ppo_kl = 4 · (0 − 0.5) = −2, entropy_loss = 4 · 0.25 = 1, loss = pg_loss (entropy_coef = 0).
    """
    old_log_probs = torch.zeros(8)
    log_probs = torch.full((8,), 0.5)
    entropy = torch.full((8,), 0.25)
    kl = torch.zeros(8)  # kl_coef defaults to 0.0: the rollout KL is all zeros
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, -1.0, 1.0, 1.0])
    pg_loss = 2 * math.exp(0.5) - 2.4

    index = BundleIndex(
        bundle_id="b-00001",
        identity=Identity(actor_step_id=ActorStepId(rollout_id=120, step_id=0), rank={"cp": 1}),
        samples=[SampleRecord(sample_id="s-0", group_index=0, response_length=2, total_length=3,
                              loss_mask=[1, 1], raw_reward=1.0, reward=1.0),
                 SampleRecord(sample_id="s-1", group_index=0, response_length=3, total_length=5,
                              loss_mask=[1, 1, 0], raw_reward=-1.0, reward=-1.0, prompt="What is 2 + 2?"),
                 SampleRecord(sample_id="s-2", group_index=1, response_length=1, total_length=4,
                              loss_mask=[1], raw_reward=0.5, reward=-1.0),
                 SampleRecord(sample_id="s-3", group_index=1, response_length=2, total_length=6,
                              loss_mask=[0, 1], raw_reward=2.5, reward=1.0)],
        config=RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2),
    )
    manifest = Manifest(
        format_version="1.0.0", bundle_id="b-00001",
        producer=ProducerInfo(commit="4f1c2e9", torch_version=torch.__version__),
        stage_contracts={stage: StageContract(stage=stage, version="v1", capability=StageCapability.RECOMPUTE)
                         for stage in (StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS,
                                       StageId.ADVANTAGE_KL, StageId.ADVANTAGE_ESTIMATE, StageId.LOSS_POLICY)},
        payloads={}, comparison_policy=ComparisonPolicy(tolerances={"loss.policy": Tolerance(atol=1e-6, rtol=1e-5)}),
        redaction={"prompt": "hash"},
    )
    expected = {"reward.raw": {"raw_rewards": [1.0, -1.0, 0.5, 2.5]},
                "reward.post_process": {"rewards": [1.0, -1.0, -1.0, 1.0]},
                "loss.policy": {"loss": pg_loss, "pg_loss": pg_loss, "entropy_loss": 1.0, "pg_clipfrac": 2.0,
                                "ppo_kl": -2.0}}

    writer = BundleWriter(tmp_path / "b-00001", manifest, index, expected)
    writer.write_payload("old_log_probs", old_log_probs)
    writer.write_payload("log_probs", log_probs)
    writer.write_payload("entropy", entropy)
    writer.write_payload("kl", kl)
    writer.write_payload("advantages", advantages)
    path = writer.finalize(ranks=[0])

    assert path == tmp_path / "b-00001"
    assert sorted(os.listdir(tmp_path)) == ["b-00001"]  # the hidden staging dir is gone
    assert sorted(os.listdir(path)) == ["COMPLETE", "COMPLETE.0", "expected.json", "index.json", "manifest.json",
                                        "payloads"]
    stored = json.loads((path / "index.json").read_bytes())
    assert stored["samples"][1]["prompt"] == sha256("What is 2 + 2?".encode())
    assert stored["identity"]["rank"] == {"cp": 1, "dp": 1, "pp": 1, "tp": 1}
    assert stored["identity"]["actor_step_id"] == {"rollout_id": 120, "step_id": 0}

    report = replay(path)
    assert report.passed and report.first_divergent_stage is None
    assert [(s.stage, s.status) for s in report.stages] == [
        ("sample", "pass"), ("reward.raw", "pass"), ("reward.post_process", "pass"), ("advantage.kl", "pass"),
        ("advantage.estimate", "pass"), ("loss.policy", "pass"), ("loss.value", "skipped"),
    ]
    assert report.exit_code == 0


def test_a_wrong_loss_field_is_the_first_divergence(tmp_path):
    """Expected loss fields are really compared: logp = 0.5, old = 0, full masks ⇒ each sample's clip
    fraction is 1 where its advantage is > 0 (ratio e^0.5 clipped at 1.2) and 0 otherwise."""
    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=2, group_size=2, kl_coef=0.0,
                                                          entropy_coef=0.0)
    payloads["log_probs"] = torch.full((8,), 0.5)
    payloads["old_log_probs"] = torch.zeros(8)
    samples = [msgspec.structs.replace(s, loss_mask=[1, 1]) for s in index.samples]
    index = msgspec.structs.replace(index, samples=samples,
                                    config=msgspec.structs.replace(index.config, eps_clip_high=0.2))
    adv = payloads["advantages"]
    expected["loss.policy"] = {"pg_clipfrac": 3.0}  # wrong on purpose
    path = write_bundle(tmp_path / "b", manifest, index, expected, payloads)
    report = replay(path)
    clipped = sum(1 for s in range(4) if float(adv[2 * s]) > 0)  # A > 0 ⇒ ratio e^0.5 clipped at 1.2
    assert report.first_divergent_stage == "loss.policy"
    d = report.first_divergence
    assert (d.field, d.expected, d.actual) == ("pg_clipfrac", 3.0, float(clipped))


# ------------------------------------------------------------------------------- schema round-trips


def _sample_index() -> BundleIndex:
    return INDEX_DECODER.decode(json.dumps({
        "bundle_id": "b-7",
        "identity": {"rollout_id": 7, "micro_batch_ids": ["mb-0000"], "semantic_group_ids": [0],
                     "weight_lineage": {"rollout_weight": 3, "actor_weight": "v4"}, "rank": {"dp": 2}},
        "samples": [{"sample_id": "s-0", "group_index": 0, "response_length": 2, "total_length": 5,
                     "loss_mask": [1, 0], "raw_reward": 1.5, "reward": None, "label_hash": "ab12",
                     "micro_batch_id": "mb-0000"}],
        "config": {"n_samples_per_prompt": 1, "kl_coef": 0.25},
    }).encode())


def test_index_round_trip_writes_every_field_explicitly():
    index = _sample_index()
    assert index.identity.rank == {"dp": 2, "tp": 1, "pp": 1, "cp": 1}
    assert index.identity.kind == "rollout" and index.identity.anchor == "rollout_id=7"
    blob = encode_json(index)
    assert INDEX_DECODER.decode(blob) == index
    doc = json.loads(blob)
    # Defaults are written too: a reader never has to rely on its own defaults.
    assert doc["config"]["advantage_estimator"] == "grpo" and doc["config"]["eps_clip_high"] == 0.2
    assert doc["identity"]["actor_step_id"] is None
    assert doc["samples"][0]["reward"] is None and doc["samples"][0]["prompt"] is None
    assert doc["identity"]["weight_lineage"] == {"actor_weight": "v4", "rollout_weight": 3}


def test_encode_json_is_the_original_wire_form():
    index = _sample_index()
    blob = encode_json(index)
    assert blob.endswith(b"}\n") and not blob.endswith(b"\n\n")
    assert blob.startswith(b'{\n  "bundle_id": "b-7",\n  "config": {\n    "advantage_estimator"')
    # byte-identical to what json.dumps(indent=2, sort_keys=True) + "\n" writes for the same document, but for
    # the exponent's spelling (1e-6 here, 1e-06 there: the same float)
    assert b'"grpo_std_eps": 1e-6,' in blob
    python = (json.dumps(json.loads(blob), indent=2, sort_keys=True) + "\n").encode()
    assert blob == re.sub(rb"e([-+])0(\d)", rb"e\1\2", python)


def test_manifest_and_sentinels_round_trip():
    manifest = Manifest(
        format_version="1.1.0", bundle_id="b-1",
        producer=ProducerInfo(commit="c0ffee", dirty_patch_digest=None, torch_version=torch.__version__),
        stage_contracts={StageId.LOSS_POLICY: StageContract(stage=StageId.LOSS_POLICY,
                                                            capability=StageCapability.RECORDED_ONLY)},
        payloads={}, comparison_policy=ComparisonPolicy(exact_fields=["pg_clipfrac"],
                                                        tolerances={"loss.policy": Tolerance(atol=0.5, rtol=0.0)}),
        redaction={"prompt": "truncate:4"},
    )
    again = MANIFEST_DECODER.decode(encode_json(manifest))
    assert again == manifest
    assert type(again.producer.torch_version) is str
    assert again.comparison_policy.tolerance("loss.policy") == Tolerance(atol=0.5, rtol=0.0)
    assert again.comparison_policy.tolerance("reward.raw") == Tolerance(atol=1e-6, rtol=1e-5)
    doc = json.loads(encode_json(manifest))
    assert doc["stage_contracts"]["loss.policy"] == {
        "capability": "recorded-only", "expected_outputs": [], "implementation": "reuse", "inputs": [],
        "stage": "loss.policy", "version": "v1"}

    shard = RankComplete(actor_step_id=ActorStepId(rollout_id=3, step_id=1), payloads={"kl": "aa"},
                         metadata={"index.json": "bb"}, expected_ranks=[0, 1], relpath="rank-1", bundle_id="b-1")
    assert RANK_COMPLETE_DECODER.decode(encode_json(shard)) == shard
    cohort = BundleComplete(ranks=[0, 1], shards={"0": shard, "1": shard})
    assert BUNDLE_COMPLETE_DECODER.decode(encode_json(cohort)) == cohort
    assert json.loads(encode_json(shard))["actor_step_id"] == {"rollout_id": 3, "step_id": 1}


def test_decoder_rejects_wrong_types_with_the_field_path():
    doc = json.loads(encode_json(_sample_index()))
    doc["samples"][0]["loss_mask"] = [1, "0"]
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int`, got `str` - at `\$\.samples\[0\]\.loss_mask\[1\]`"):
        INDEX_DECODER.decode(json.dumps(doc).encode())
    doc = json.loads(encode_json(_sample_index()))
    del doc["samples"][0]["response_length"]
    with pytest.raises(msgspec.ValidationError, match=r"missing required field `response_length` - at `\$\.samples\[0\]`"):
        INDEX_DECODER.decode(json.dumps(doc).encode())


def test_decode_index_proves_no_unknown_field_in_one_pass_and_drops_them_otherwise():
    index = _sample_index()
    clean = encode_json(index)
    assert decode_index(clean) == (index, False)
    doc = json.loads(clean)
    doc["samples"][0]["tokens_per_second"] = 9.5
    doc["identity"]["weight_lineage"]["optimizer_step"] = 12
    again, unknown = decode_index(json.dumps(doc).encode())
    # the same types and values as the clean document: the unknown fields are gone, nothing else
    assert unknown is True and again == index and type(again.samples[0]) is type(index.samples[0])
    # an unknown field does not hide another problem: the lenient decode reports it
    doc["samples"][0]["loss_mask"] = [1, "0"]
    with pytest.raises(msgspec.ValidationError, match=r"\$\.samples\[0\]\.loss_mask\[1\]"):
        decode_index(json.dumps(doc).encode())


# --------------------------------------------------------------------------- writer / reader, disk


@pytest.mark.parametrize("version", [FORMAT_VERSION, UNPACKED_FORMAT_VERSION])
def test_write_read_round_trip_is_exact(tmp_path, version):
    manifest, index, expected, payloads = synthetic_parts(samples=8, tokens=6, vary_lengths=True, seed=3,
                                                          format_version=version)
    packed = version == FORMAT_VERSION  # the masks a payload of their own, every payload a safetensors file
    suffix = ".safetensors" if packed else ".pt"
    total = sum(s.response_length for s in index.samples)
    payloads["support_ids"] = torch.arange(total * 3, dtype=torch.int32).reshape(total, 3)
    path = write_bundle(tmp_path / "b", manifest, index, expected, payloads)

    reader = BundleReader(path)
    assert reader.warnings == []
    assert reader.manifest.format_version == version
    assert (reader.index_with_masks() if packed else reader.index) == index
    if packed:
        assert [s.loss_mask for s in reader.index.samples] == [msgspec.UNSET] * len(index.samples)
    assert reader.expected == expected
    assert reader.payload_names == sorted(payloads)
    assert sorted(reader.manifest.payloads) == sorted([*payloads, "loss_mask"] if packed else payloads)
    for name, tensor in payloads.items():
        got = reader.payload(name)
        assert type(got) is torch.Tensor and got.dtype == tensor.dtype and torch.equal(got, tensor)
        spec = reader.manifest.payloads[name]
        data = (path / "payloads" / f"{name}{suffix}").read_bytes()
        assert (spec.name, spec.dtype, spec.shape) == (name, str(tensor.dtype), list(tensor.shape))
        assert (spec.bytes, spec.sha256) == (len(data), sha256(data))
    assert reader.manifest.payloads["support_ids"].shape == [total, 3]

    meta = {n: sha256((path / n).read_bytes()) for n in ("manifest.json", "index.json", "expected.json")}
    complete = json.loads((path / "COMPLETE").read_bytes())
    assert complete["ranks"] == [0] and complete["metadata"] == meta
    rank0 = json.loads((path / "COMPLETE.0").read_bytes())
    assert rank0["metadata"] == meta
    assert rank0["payloads"] == {n: spec.sha256 for n, spec in reader.manifest.payloads.items()}
    assert rank0["actor_step_id"] == {"rollout_id": 7, "step_id": 0} and rank0["rollout_id"] is None

    bundles = open_bundle(path, step=ActorStepId(rollout_id=7, step_id=0))
    assert not bundles.cohort and [s.path for s in bundles.shards] == [path]
    assert replay(path).passed


def test_writer_refuses_to_overwrite_and_leaves_the_bundle_untouched(tmp_path):
    parts = synthetic_parts(samples=4, tokens=2)
    path = write_bundle(tmp_path / "b", *parts)
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError, match="bundle already exists; refusing to overwrite"):
        write_bundle(tmp_path / "b", *parts)
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    assert sorted(os.listdir(tmp_path)) == ["b"]


def test_writer_refuses_inconsistent_input(tmp_path):
    manifest, index, expected, _ = synthetic_parts(samples=4, tokens=2)
    with pytest.raises(ValueError, match="bundle_id mismatch: manifest 'other' vs index 'synthetic'"):
        BundleWriter(tmp_path / "a", msgspec.structs.replace(manifest, bundle_id="other"), index, expected)
    dup = msgspec.structs.replace(index, samples=[index.samples[0], index.samples[1], index.samples[0]])
    with pytest.raises(ValueError, match=r"\$\.samples\[2\]\.sample_id: duplicate sample id 's-0'"):
        BundleWriter(tmp_path / "a", manifest, dup, expected)
    with pytest.raises(ValueError, match="redaction rule for 'prompt' must be 'hash', 'drop' or 'truncate:N'"):
        BundleWriter(tmp_path / "a", msgspec.structs.replace(manifest, redaction={"prompt": "keep"}), index, expected)
    assert not (tmp_path / "a").exists()

    writer = BundleWriter(tmp_path / "a", manifest, index, expected)
    for bad in ("../x", "/abs", "a/b", ".hidden", ""):
        with pytest.raises(BundleError, match="unsafe payload name"):
            writer.write_payload(bad, torch.zeros(1))
    with pytest.raises(TypeError, match="payload 'kl' must be a torch.Tensor, got list"):
        writer.write_payload("kl", [0.0])
    writer.write_payload("kl", torch.zeros(8))
    with pytest.raises(ValueError, match="payload 'kl' written twice"):
        writer.write_payload("kl", torch.zeros(8))
    writer.abort()
    assert os.listdir(tmp_path) == []


def test_failed_write_publishes_nothing(tmp_path):
    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=2)
    with pytest.raises(RuntimeError, match="producer crashed"):
        with BundleWriter(tmp_path / "b", manifest, index, expected) as writer:
            writer.write_payload("kl", payloads["kl"])
            raise RuntimeError("producer crashed")
    assert os.listdir(tmp_path) == []


def test_writer_stores_plain_compact_tensors(tmp_path):
    """A Parameter is stored as a plain tensor; a view never drags its whole base storage to disk."""
    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=2, kl_coef=0.0)
    base = torch.arange(100_000, dtype=torch.float32)
    payloads["log_probs"] = torch.nn.Parameter(payloads["log_probs"].clone())
    payloads["entropy"] = base[10:18]
    path = write_bundle(tmp_path / "b", manifest, index, expected, payloads)
    reader = BundleReader(path)
    assert type(reader.payload("log_probs")) is torch.Tensor
    assert torch.equal(reader.payload("entropy"), torch.arange(10, 18, dtype=torch.float32))
    # 8 floats plus the archive's fixed overhead, not the base's 400 000 bytes
    assert reader.manifest.payloads["entropy"].bytes < 4096


# ----------------------------------------------------------------------------------------- redaction

SECRET = "sk-live-7Hq2ZfW9xTpL4vNc"


@pytest.mark.parametrize("rule", ["hash", "drop", "truncate:6"])
def test_secret_in_environment_and_prompt_never_reaches_disk(rule, tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAY_TEST_API_KEY", SECRET)
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=3)
    text = {"prompt": f"{SECRET} What is 2 + 2?", "response": f"{SECRET}: it is 4", "label": f"{SECRET}4",
            "tool_output": f"{SECRET} exit=0"}
    samples = [msgspec.structs.replace(s, **text) for s in index.samples]
    index = msgspec.structs.replace(index, samples=samples)
    manifest = msgspec.structs.replace(manifest, redaction={"prompt": rule, "response": rule, "label": rule})
    path = write_bundle(tmp_path / "b", manifest, index, expected, payloads)

    files = [p for p in path.rglob("*") if p.is_file()]
    assert len(files) == 5 + len(payloads) + 1  # the JSON and sentinels, the payloads and the packed masks
    assert (path / "payloads" / "loss_mask.safetensors").is_file()
    for file in files:
        data = file.read_bytes()
        assert SECRET.encode() not in data, file
        assert SECRET.encode("utf-16-le") not in data, file
    if rule.startswith("truncate"):
        # exactly N characters survive, never N + 1
        assert sum(f.read_bytes().count(SECRET[:7].encode()) for f in files) == 0
        assert sum(f.read_bytes().count(SECRET[:6].encode()) for f in files) == 3 * 4

    stored = json.loads((path / "index.json").read_bytes())["samples"]
    want = {"hash": lambda v: sha256(v.encode()), "drop": lambda v: None, "truncate:6": lambda v: v[:6]}[rule]
    for s in stored:
        assert s["prompt"] == want(text["prompt"])
        assert s["response"] == want(text["response"])
        assert s["label"] == want(text["label"])
        assert s["tool_output"] is None  # no rule for it: never written
    assert json.loads((path / "manifest.json").read_bytes())["redaction"] == {
        "label": rule, "prompt": rule, "response": rule}
    assert BundleReader(path).index.samples[0].prompt == want(text["prompt"])


def test_sha256_file_equals_hashlib_for_empty_small_and_multi_chunk_files(tmp_path):
    from replay_lib.bundle import sha256_file

    for size in (0, 1, 4096, (1 << 20) * 3 + 17):
        f = tmp_path / f"f{size}"
        data = os.urandom(size)
        f.write_bytes(data)
        assert sha256_file(f) == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("version", [FORMAT_VERSION, UNPACKED_FORMAT_VERSION])
@pytest.mark.parametrize("limit", [None, 0], ids=["reader-hashes-ahead", "thread-hashes"])
def test_a_payload_altered_after_the_reader_hashed_it_ahead_is_still_caught(tmp_path, monkeypatch, limit, version):
    # Usual payloads are loaded and hashed by the reader before the JSON decodes, larger ones (above
    # HASH_AHEAD_BYTES; 0 here) by the background thread; the reader compares each digest where it always did.
    # A payload whose bytes differ from its checksum is refused whichever thread hashed it.
    import replay_lib.bundle.reader as bundle_mod

    if limit is not None:
        monkeypatch.setattr(bundle_mod, "HASH_AHEAD_BYTES", limit)

    b = write_bundle(tmp_path / "b", *synthetic_parts(samples=4, tokens=3, bundle_id="ahead", format_version=version))
    kl = b / "payloads" / ("kl.safetensors" if version == FORMAT_VERSION else "kl.pt")
    data = bytearray(kl.read_bytes())
    data[len(data) // 2] ^= 0x01
    kl.write_bytes(bytes(data))
    ahead, inline = [], []
    real_ahead, real_inline = bundle_mod._sha256_regular, bundle_mod._sha256_payload
    monkeypatch.setattr(bundle_mod, "_sha256_regular", lambda p, stop: ahead.append(p.name) or real_ahead(p, stop))
    monkeypatch.setattr(bundle_mod, "_sha256_payload", lambda p: inline.append(p.name) or real_inline(p))
    with pytest.raises(BundleError, match=re.escape(kl.name) + r": sha256 mismatch .* file " + hashlib.sha256(bytes(data)).hexdigest()[:12]):
        BundleReader(b)
    assert ahead.count(kl.name) == 1 and kl.name not in inline  # hashed once, ahead of the check
    assert not [t for t in threading.enumerate() if t.name == "bundle-sha256"]  # and nothing left running
    kl.write_bytes(bytes(data[: len(data) // 2]) + bytes([data[len(data) // 2] ^ 0x01]) + bytes(data[len(data) // 2 + 1:]))
    assert BundleReader(b).has_payload("kl")  # restored: the same path opens it


def test_the_reader_never_waits_on_a_hashing_thread_that_failed(tmp_path, monkeypatch):
    import replay_lib.bundle.reader as bundle_mod

    b = write_bundle(tmp_path / "b", *synthetic_parts(samples=4, tokens=3, bundle_id="fails"))

    def broken(path, stop):
        raise ValueError("not an OSError")  # whatever goes wrong on the thread

    monkeypatch.setattr(bundle_mod, "_sha256_regular", broken)
    monkeypatch.setattr(bundle_mod, "sha256_bytes", lambda data: (_ for _ in ()).throw(MemoryError())
                        if threading.current_thread().name == "bundle-sha256" else hashlib.sha256(data).hexdigest())
    reader = BundleReader(b)  # the reader hashes what the thread did not: same verdict, no hang
    assert reader.has_payload("kl")


def test_a_refused_bundle_stops_the_hashing_thread(tmp_path, monkeypatch):
    import replay_lib.bundle.reader as bundle_mod

    b = write_bundle(tmp_path / "b", *synthetic_parts(samples=64, tokens=64, bundle_id="stop"))
    (b / "COMPLETE").unlink()
    import replay_lib.bundle.files as files_mod

    monkeypatch.setattr(files_mod, "HASH_CHUNK", 64)  # many chunks: the stop is seen between two of them
    seen = []
    real = bundle_mod._sha256_stream

    def stream(fh, stop):
        seen.append(stop)
        return real(fh, stop)

    monkeypatch.setattr(bundle_mod, "_sha256_stream", stream)
    with pytest.raises(BundleError, match="missing COMPLETE sentinel"):
        BundleReader(b)
    # the refusal stopped the thread and waited for it: nothing is left hashing
    assert not [t for t in threading.enumerate() if t.name == "bundle-sha256"]
    assert all(stop.is_set() for stop in seen)


def test_a_linked_payload_directory_is_never_read_ahead(tmp_path, monkeypatch):
    import replay_lib.bundle.reader as bundle_mod

    b = write_bundle(tmp_path / "b", *synthetic_parts(samples=4, tokens=3, bundle_id="linked"))
    elsewhere = tmp_path / "elsewhere"
    (b / "payloads").rename(elsewhere)
    (b / "payloads").symlink_to(elsewhere)
    ahead = []
    monkeypatch.setattr(bundle_mod, "_sha256_regular", lambda p, stop: ahead.append(p) or None)
    with pytest.raises(BundleError, match="payload directory must not be a symlink"):
        BundleReader(b)
    assert ahead == []


def test_stage_contracts_declares_loss_value_unsupported_only_where_not_asked_for():
    from replay_lib.bundle.schema import StageCapability, StageId, stage_contracts

    assert stage_contracts((StageId.SAMPLE,))[StageId.LOSS_VALUE].capability == StageCapability.UNSUPPORTED
    asked = stage_contracts((StageId.SAMPLE, StageId.LOSS_VALUE))
    assert asked[StageId.LOSS_VALUE].capability == StageCapability.RECOMPUTE
    assert StageId.LOSS_VALUE not in stage_contracts((StageId.SAMPLE,), declare_value=False)
