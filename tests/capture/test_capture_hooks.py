"""The rollout- and step-level hooks write bundles the replay reads back exactly (hand-derived values)."""

from __future__ import annotations

import hashlib
import subprocess

import msgspec
import pytest
import torch

from capture import CaptureConfig, Provenance, ReplayCapture
from capture.bundles import DEFAULT_REDACTION
from capture.producer import _producer_info as producer_info_cache
from capture_helpers import ROOT, stick_writer_on_disk
from replay_lib.bundle import BundleReader, open_bundle
from replay_lib.errors import BundleError
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import INDEX_DECODER, ActorStepId, RecomputeConfig, encode_json

DEADLOCK_GUARD_S = 60.0

# The PR #65 fixture of SPEC §4: groups [0,0,1,1], raw [1,3,10,12], n=2, std off.
GROUPS = [0, 0, 1, 1]
RAW = [1.0, 3.0, 10.0, 12.0]
LENGTHS = [3, 2, 4, 3]
MASKS = [[1, 1, 1], [1, 1], [1, 1, 0, 1], [1, 1, 1]]
GROUP_NORMALIZED = [-1.0, 1.0, -1.0, 1.0]
BATCH_NORMALIZED = [-5.5, -3.5, 3.5, 5.5]
CFG = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2, grpo_std_normalization=False,
                      kl_loss_type="k1", kl_coef=0.1, eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.0)
PROMPTS = ["What is 0 + 0?", "What is 1 + 0?", "What is 2 + 1?", "What is 3 + 1?"]


def _capture(directory, **kwargs) -> ReplayCapture:
    kwargs.setdefault("register_atexit", False)
    return ReplayCapture(CaptureConfig(enabled=True, directory=directory), CFG, **kwargs)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _rollout_kwargs(rewards):
    total = sum(LENGTHS)
    old = -torch.arange(1, total + 1, dtype=torch.float32) / 10  # -0.1 … -1.2
    ref = old - 0.5
    return dict(
        sample_ids=[f"s-{i}" for i in range(4)], group_index=GROUPS, response_lengths=LENGTHS,
        total_lengths=[n + 5 for n in LENGTHS], loss_mask=MASKS, raw_rewards=RAW, rewards=rewards,
        old_log_probs=old, ref_log_probs=ref,
        kl=torch.full((total,), 0.5),  # k1 = old − ref = 0.5 on every token
        advantages=torch.repeat_interleave(torch.tensor(rewards), torch.tensor(LENGTHS)),
        prompts=PROMPTS, responses=[f"answer {i}" for i in range(4)], labels=["0", "1", "3", "4"],
        provenance=Provenance(rollout_weight=41, actor_weight=42, rollout_partition_ids=("rp-120-0",),
                              consumer_batch_ids=("cb-0", "cb-1"), normalization_cohort_ids=("g-0", "g-1")),
    )


def test_rollout_bundle_round_trips_and_replays_clean(tmp_path):
    cap = _capture(tmp_path)
    assert cap.capture_rollout(120, **_rollout_kwargs(GROUP_NORMALIZED)) is True
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    assert (cap.stats.written, cap.stats.errors) == (1, 0)
    reader = BundleReader(tmp_path / "rollout-120")
    index, manifest = reader.index, reader.manifest
    assert index.identity.rollout_id == 120 and index.identity.actor_step_id is None
    assert index.identity.weight_lineage.rollout_weight == 41 and index.identity.weight_lineage.actor_weight == 42
    assert index.identity.consumer_batch_ids == ["cb-0", "cb-1"]
    assert index.identity.semantic_group_ids == [0, 1]
    assert index.identity.rank == {"dp": 1, "tp": 1, "pp": 1, "cp": 1}
    assert index.config == CFG
    assert [s.raw_reward for s in index.samples] == RAW
    assert [s.reward for s in index.samples] == GROUP_NORMALIZED
    assert [reader.sample_mask(i) for i in range(len(index.samples))] == MASKS  # packed (format 1.3.0)
    assert [s.total_length for s in index.samples] == [8, 7, 9, 8]
    # redaction: prompts and responses as sha256, labels only as label_hash
    assert [s.prompt for s in index.samples] == [_sha(p) for p in PROMPTS]
    assert [s.response for s in index.samples] == [_sha(f"answer {i}") for i in range(4)]
    assert [s.label for s in index.samples] == [None] * 4
    assert [s.label_hash for s in index.samples] == [_sha(x) for x in ("0", "1", "3", "4")]
    assert manifest.redaction == DEFAULT_REDACTION
    assert reader.expected == {"reward.raw": {"raw_rewards": RAW}, "reward.post_process": {"rewards": GROUP_NORMALIZED}}
    assert reader.payload_names == ["advantages", "kl", "old_log_probs", "ref_log_probs"]
    assert reader.payload("kl").tolist() == [0.5] * 12
    assert manifest.producer.torch_version == torch.__version__
    report = replay(tmp_path / "rollout-120")
    assert report.passed and report.exit_code == 0
    assert [(s.stage, s.status) for s in report.stages if s.status != "skipped"] == [
        ("sample", "pass"), ("reward.raw", "pass"), ("reward.post_process", "pass"),
        ("advantage.kl", "pass"), ("advantage.estimate", "pass"),
    ]


def test_batch_normalized_rewards_are_caught_at_reward_post_process(tmp_path):
    cap = _capture(tmp_path)
    cap.capture_rollout(120, **_rollout_kwargs(BATCH_NORMALIZED))
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    report = replay(tmp_path / "rollout-120")
    assert report.exit_code == 1
    assert report.first_divergent_stage == "reward.post_process"
    post = next(s for s in report.stages if s.stage == "reward.post_process")
    assert [(d.sample_id, d.expected, d.actual, d.abs_error) for d in post.divergences] == [
        ("s-0", -5.5, -1.0, 4.5), ("s-1", -3.5, 1.0, 4.5), ("s-2", 3.5, -1.0, 4.5), ("s-3", 5.5, 1.0, 4.5),
    ]


def _micro_batch(step, ids, lengths, first_token, last_token):
    n = last_token - first_token
    advantages = torch.repeat_interleave(torch.tensor([GROUP_NORMALIZED[int(i[2:])] for i in ids]),
                                         torch.tensor(lengths))
    return step.add_micro_batch(
        sample_ids=ids, group_index=[GROUPS[int(i[2:])] for i in ids], response_lengths=lengths,
        total_lengths=[x + 5 for x in lengths], loss_mask=torch.ones(n), log_probs=torch.full((n,), 0.5),
        old_log_probs=torch.zeros(n), advantages=advantages, entropy=torch.linspace(0.0, 1.0, n),
        raw_rewards=[RAW[int(i[2:])] for i in ids], rewards=[GROUP_NORMALIZED[int(i[2:])] for i in ids],
    )


def test_step_bundle_accumulates_micro_batches_and_replays_the_reported_loss(tmp_path):
    # logp = 0.5, old = 0 → ratio e^0.5 ≈ 1.6487; A = −1 samples: max(1.6487, 1.2) = 1.6487;
    # A = +1 samples: max(−1.6487, −1.2) = −1.2 (clipped). Each micro-batch holds one of each:
    # pg = 0.4487213 per micro-batch, 0.8974426 for the step; clipfrac 1 + 1; ppo_kl −1 + −1.
    # entropy linspace(0, 1, 5) then linspace(0, 1, 7): per-sample means 0.25, 0.875 | 0.25, 5/6.
    cap = _capture(tmp_path)
    step = cap.begin_step(120, 3, provenance=Provenance(rollout_weight=41, actor_weight=45))
    assert _micro_batch(step, ["s-0", "s-1"], [3, 2], 0, 5)
    assert _micro_batch(step, ["s-2", "s-3"], [4, 3], 5, 12)
    ratio = torch.tensor(0.5).exp()
    per_mb = -ratio * -1 + -1.2  # one unclipped A=−1 sample + one clipped A=+1 sample
    reported = {"loss": per_mb * 2, "pg_loss": per_mb * 2, "entropy_loss": torch.tensor(0.25 + 0.875 + 0.25 + 5 / 6),
                "pg_clipfrac": torch.tensor(2.0), "ppo_kl": torch.tensor(-2.0)}
    assert step.finish(reported)
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    reader = BundleReader(tmp_path / "step-120-3")
    assert reader.index.identity.actor_step_id == ActorStepId(rollout_id=120, step_id=3)
    assert reader.index.identity.rollout_id is None
    assert reader.index.identity.micro_batch_ids == ["mb-0000", "mb-0001"]
    assert [s.micro_batch_id for s in reader.index.samples] == ["mb-0000", "mb-0000", "mb-0001", "mb-0001"]
    assert [s.sample_id for s in reader.index.samples] == ["s-0", "s-1", "s-2", "s-3"]
    assert reader.index.identity.weight_lineage.actor_weight == 45
    loss = reader.expected["loss.policy"]
    assert loss["pg_loss"] == pytest.approx(0.8974426, abs=1e-6)
    assert (loss["pg_clipfrac"], loss["ppo_kl"]) == (2.0, -2.0)
    assert loss["entropy_loss"] == pytest.approx(2.2083333, abs=1e-6)
    assert reader.payload("log_probs").tolist() == [0.5] * 12
    assert reader.payload("advantages").tolist() == [-1.0] * 3 + [1.0] * 2 + [-1.0] * 4 + [1.0] * 3
    # entropy of each micro-batch as given, concatenated in data-iterator order
    assert torch.equal(reader.payload("entropy"), torch.cat([torch.linspace(0, 1, 5), torch.linspace(0, 1, 7)]))
    report = replay(tmp_path / "step-120-3")
    assert report.passed
    assert [s.stage for s in report.stages if s.status == "pass"] == ["sample", "loss.policy"]


def test_a_misreported_step_loss_field_is_caught(tmp_path):
    cap = _capture(tmp_path)
    step = cap.begin_step(1, 0)
    _micro_batch(step, ["s-0", "s-1"], [3, 2], 0, 5)
    # pg_loss of this micro-batch is 0.4487213 (see above); the trainer reports something else
    step.finish(loss=torch.tensor(0.4487213), pg_loss=torch.tensor(0.5))
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    report = replay(tmp_path / "step-1-0")
    assert report.first_divergent_stage == "loss.policy"
    div = report.first_divergence
    assert (div.field, div.expected) == ("pg_loss", 0.5)
    assert div.actual == pytest.approx(0.4487213, abs=1e-6)


def test_step_with_a_dropped_micro_batch_is_abandoned_not_published(tmp_path, monkeypatch):
    entered, gate = stick_writer_on_disk(monkeypatch, DEADLOCK_GUARD_S)
    cap = _capture(tmp_path, max_queue=1)
    assert cap.capture_rollout(120, **_rollout_kwargs(GROUP_NORMALIZED))
    assert entered.wait(DEADLOCK_GUARD_S)  # the writer is stuck on the rollout bundle
    step = cap.begin_step(120, 0)
    assert _micro_batch(step, ["s-0", "s-1"], [3, 2], 0, 5) is True  # fills the queue
    assert _micro_batch(step, ["s-2", "s-3"], [4, 3], 5, 12) is False  # dropped
    assert _micro_batch(step, ["s-2", "s-3"], [4, 3], 5, 12) is False  # the step is broken: not even tried
    gate.set()
    assert cap.flush(DEADLOCK_GUARD_S)
    assert step.finish(loss=torch.tensor(0.0)) is True  # accepted, and abandoned by the writer
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    stats = cap.stats
    assert (stats.written, stats.dropped, stats.abandoned, stats.errors) == (1, 1, 1, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout-120"]


def test_step_whose_end_never_arrives_is_abandoned_at_close(tmp_path):
    cap = _capture(tmp_path)
    step = cap.begin_step(5, 1)
    assert _micro_batch(step, ["s-0", "s-1"], [3, 2], 0, 5)
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    assert (cap.stats.written, cap.stats.abandoned) == (0, 1)
    assert list(tmp_path.iterdir()) == []


def test_finish_refuses_unknown_fields_and_a_missing_loss(tmp_path):
    cap = _capture(tmp_path)
    try:
        with pytest.raises(ValueError, match=r"step-1-0: unknown loss field\(s\) \['grad_norm'\]"):
            cap.begin_step(1, 0).finish({"loss": torch.tensor(1.0), "grad_norm": torch.tensor(2.0)})
        with pytest.raises(ValueError, match="step-1-1: finish\\(\\) needs at least the 'loss' field"):
            cap.begin_step(1, 1).finish(pg_loss=torch.tensor(1.0))
    finally:
        cap.close(timeout=DEADLOCK_GUARD_S)


def test_two_producers_publish_shards_and_the_last_one_finalizes_the_cohort(tmp_path):
    caps = [_capture(tmp_path, producer_rank=r, producer_world=2,
                     rank_sizes={"dp": 2, "tp": 1, "pp": 1, "cp": 1}) for r in range(2)]
    kwargs = _rollout_kwargs(GROUP_NORMALIZED)
    caps[0].capture_rollout(7, **kwargs)
    assert caps[0].close(timeout=DEADLOCK_GUARD_S)
    cohort = tmp_path / "rollout-7"
    assert sorted(p.name for p in cohort.iterdir()) == ["COMPLETE.0", "rank-0"]
    with pytest.raises(BundleError, match="cohort has no final COMPLETE"):
        open_bundle(cohort)
    caps[1].capture_rollout(7, **dict(kwargs, sample_ids=[f"r1-s-{i}" for i in range(4)]))
    assert caps[1].close(timeout=DEADLOCK_GUARD_S)
    assert sorted(p.name for p in cohort.iterdir()) == ["COMPLETE", "COMPLETE.0", "COMPLETE.1", "rank-0", "rank-1"]
    bundles = open_bundle(cohort)
    assert bundles.cohort and [s.rank for s in bundles.shards] == [0, 1]
    assert bundles.shards[1].index.identity.rank == {"dp": 2, "tp": 1, "pp": 1, "cp": 1}
    assert msgspec.json.decode((cohort / "COMPLETE").read_bytes())["ranks"] == [0, 1]
    report = replay(cohort)
    assert report.passed and report.ranks == [0, 1]


def test_an_existing_bundle_is_never_overwritten(tmp_path, caplog):
    first = _capture(tmp_path)
    first.capture_rollout(1, **_rollout_kwargs(GROUP_NORMALIZED))
    assert first.close(timeout=DEADLOCK_GUARD_S)
    before = (tmp_path / "rollout-1" / "index.json").read_bytes()
    again = _capture(tmp_path)
    again.capture_rollout(1, **_rollout_kwargs(BATCH_NORMALIZED))
    assert again.close(timeout=DEADLOCK_GUARD_S)
    assert (again.stats.errors, again.stats.written) == (1, 0)
    assert "bundle already exists; refusing to overwrite" in caplog.text
    assert (tmp_path / "rollout-1" / "index.json").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["rollout-1"]  # no staging directory left behind


def test_producer_records_this_checkout_commit(tmp_path):
    def head() -> str:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    producer_info_cache.cache_clear()  # looked up once per process: start from a fresh lookup
    before = head()
    cap = _capture(tmp_path, source_dir=ROOT)
    cap.capture_rollout(3, **_rollout_kwargs(GROUP_NORMALIZED))
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    after = head()  # others may commit to this checkout meanwhile
    producer = BundleReader(tmp_path / "rollout-3").manifest.producer
    assert producer.commit in {before, after} and len(producer.commit) == 40
    assert producer.dirty_patch_digest is None or len(producer.dirty_patch_digest) == 64
    assert producer.torch_version == torch.__version__


def test_index_written_by_capture_decodes_with_the_real_decoder(tmp_path):
    cap = _capture(tmp_path)
    cap.capture_rollout(9, **_rollout_kwargs(GROUP_NORMALIZED))
    assert cap.close(timeout=DEADLOCK_GUARD_S)
    blob = (tmp_path / "rollout-9" / "index.json").read_bytes()
    assert encode_json(INDEX_DECODER.decode(blob)) == blob  # canonical form: sorted keys, 2-space indent


def test_an_id_the_reader_would_refuse_is_refused_where_it_comes_from(tmp_path):
    """A sample id over the schema's ID_MAX_CHARS: capture_rollout raises at once (the job's own call, its own
    stack), rather than writing a bundle that every reader refuses."""
    from replay_lib.bundle.schema import ID_MAX_CHARS

    cap = _capture(tmp_path)
    try:
        kwargs = _rollout_kwargs(GROUP_NORMALIZED)
        ids = list(kwargs["sample_ids"])
        ids[2] = "s" * (ID_MAX_CHARS + 1)
        with pytest.raises(ValueError, match=rf"^sample_ids\[2\] has {ID_MAX_CHARS + 1} characters; an id has 1 "
                                             rf"to {ID_MAX_CHARS}$"):
            cap.capture_rollout(7, **dict(kwargs, sample_ids=ids))
        with pytest.raises(ValueError, match=r"^sample_ids\[1\] has 0 characters"):
            cap.capture_rollout(7, **dict(kwargs, sample_ids=["s-0", "", "s-2", "s-3"]))
        ids[2] = "s" * ID_MAX_CHARS  # the longest id is fine
        cap.capture_rollout(8, **dict(kwargs, sample_ids=ids))
    finally:
        assert cap.close(timeout=DEADLOCK_GUARD_S)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout-8"]
    from replay_lib.bundle import open_bundle

    assert open_bundle(tmp_path / "rollout-8").shards[0].index.samples[2].sample_id == ids[2]
