"""End to end: the example async GRPO trainer captures real bundles that the replay accepts.

Real processes (the trainer as a script, torchrun with gloo, a rank killed with SIGKILL), real files, and
the real ``trajectory-replay`` CLI. Sizes are tiny (see capture_helpers.TINY): a run takes a few seconds.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from capture import CaptureConfig, ReplayCapture
from capture_helpers import (
    TINY,
    TRAINER_PATH,
    all_files,
    bundle_dirs,
    capture_env,
    free_port,
    stick_writer_on_disk,
    subprocess_env,
)
from replay_lib import cli
from replay_lib.bundle import BundleReader, BundleWriter, open_bundle
from replay_lib.run.runner import replay

pytestmark = pytest.mark.slow

SECRET = "tr-secret-3f9a1c77-do-not-store"
PROMPT_MARK = "PLANTED-PROMPT-c0ffee"
ALL_BUNDLES = ["rollout-0", "rollout-1", "step-0-0", "step-0-1", "step-1-0", "step-1-1"]
RUN_TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["trajectory-replay", *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env=subprocess_env())


def _cli_in_process(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------------- single process, as a script


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("single")
    directory = work / "bundles"
    env = subprocess_env(REPLAY_TEST_SECRET=SECRET, **capture_env(directory))
    argv = [*TINY, "--prompt-template", PROMPT_MARK + " {digits}"]
    argv.remove("--quiet")
    proc = subprocess.run([sys.executable, str(TRAINER_PATH), *argv], cwd=work, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    return SimpleNamespace(dir=directory, proc=proc, env=env)


def test_single_process_run_captures_every_bundle_and_each_replays_clean(single_run, capsys):
    assert single_run.proc.returncode == 0, single_run.proc.stderr
    assert "rank 0 capture: written=6 dropped=0 errors=0 abandoned=0" in single_run.proc.stdout
    assert bundle_dirs(single_run.dir) == ALL_BUNDLES
    real = _cli("replay", str(single_run.dir / "rollout-1"))
    assert real.returncode == 0, real.stderr
    # the five rollout stages and logprob.mismatch (the trainer records its sampler's own log-probs)
    assert real.stdout.startswith("bundle rollout-1 — no divergence (6 stage(s) compared)")
    for name in ALL_BUNDLES:
        code, out, err = _cli_in_process(capsys, "replay", str(single_run.dir / name))
        assert code == 0, (name, out, err)
        assert "no divergence" in out


def test_captured_identity_follows_the_async_schedule(single_run):
    rollout = BundleReader(single_run.dir / "rollout-1").index
    ident = rollout.identity
    # 8 samples streamed in consumer batches of 3, 3, 2 — not aligned with the groups of 4
    assert ident.consumer_batch_ids == ["cb-1-0-0", "cb-1-0-1", "cb-1-0-2"]
    assert ident.normalization_cohort_ids == ["g-0", "g-1"]
    assert ident.semantic_group_ids == [0, 1]
    assert [s.group_index for s in rollout.samples] == [0, 0, 0, 0, 1, 1, 1, 1]
    # staleness 1, two actor steps per rollout: rollout 1 is sampled with the initial weights (version 0)
    # while the actor that trains on it has already taken 2 steps
    assert (ident.weight_lineage.rollout_weight, ident.weight_lineage.actor_weight) == (0, 2)
    step = BundleReader(single_run.dir / "step-1-1").index
    assert (step.identity.weight_lineage.rollout_weight, step.identity.weight_lineage.actor_weight) == (0, 3)
    assert [s.sample_id for s in step.samples] == ["s-4", "s-5", "s-6", "s-7"]
    assert [s.micro_batch_id for s in step.samples] == ["mb-0000", "mb-0000", "mb-0000", "mb-0001"]
    assert step.identity.micro_batch_ids == ["mb-0000", "mb-0001"]
    cfg = step.config
    assert (cfg.n_samples_per_prompt, cfg.grpo_std_normalization, cfg.kl_loss_type, cfg.kl_coef) == (
        4, True, "low_var_kl", 0.05)
    assert (cfg.eps_clip, cfg.eps_clip_high, cfg.entropy_coef, cfg.vocab_size) == (0.2, 0.28, 0.001, 14)
    # the sampler's top-k support rows ride along (one per response token, K = 8)
    reader = BundleReader(single_run.dir / "rollout-0")
    total = sum(s.response_length for s in reader.index.samples)
    assert list(reader.payload("support_ids").shape) == [total, 8]
    sampled = reader.payload("sampled_token_ids").to(torch.int64)
    assert bool((reader.payload("support_ids").to(torch.int64) == sampled[:, None]).any(1).all())


def test_no_environment_value_namespace_or_prompt_text_reaches_a_bundle(single_run):
    assert single_run.proc.returncode == 0
    files = all_files(single_run.dir)
    assert len(files) > 6 * 6
    needles = {SECRET, PROMPT_MARK, "Namespace(", str(single_run.dir), str(single_run.dir.parent)}
    # every longer environment value the job ran with (PATH, HOME-based paths, the capture dir …)
    needles |= {v for v in single_run.env.values() if len(v) >= 12}
    for path in files:
        blob = path.read_bytes()
        for needle in needles:
            assert needle.encode() not in blob, f"{needle!r} found in {path.relative_to(single_run.dir)}"
    samples = BundleReader(single_run.dir / "rollout-0").index.samples
    assert all(len(s.prompt) == 64 and int(s.prompt, 16) >= 0 for s in samples)  # sha256 hex, not text
    assert all(s.label is None and len(s.label_hash) == 64 for s in samples)


# ------------------------------------------------------------------------------------ the PR #65 bug


def _python_normalize(values: list[float], cohorts: list[int]) -> list[float]:
    """Reference: r − mean, divided by (unbiased std + 1e-6), per cohort — plain Python floats."""
    out = []
    for i, v in enumerate(values):
        members = [values[j] for j in range(len(values)) if cohorts[j] == cohorts[i]]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
        out.append((v - mean) / (std + 1e-6))
    return out


def test_pr65_bug_is_pinned_to_reward_post_process_with_the_right_samples(trainer, tmp_path, capsys):
    directory = tmp_path / "bundles"
    result = trainer.run([*TINY, "--pr65-bug"], env=capture_env(directory))
    assert result.capture_stats.written == 6 and result.capture_stats.errors == 0
    for rollout in ("rollout-0", "rollout-1"):
        index = BundleReader(directory / rollout).index
        raw = [s.raw_reward for s in index.samples]
        groups = [s.group_index for s in index.samples]
        batches = [i // 3 for i in range(len(raw))]  # consumer batches of 3, 3, 2
        by_batch = _python_normalize(raw, batches)
        by_group = _python_normalize(raw, groups)
        assert [s.reward for s in index.samples] == pytest.approx(by_batch, abs=1e-5)  # what the bug used
        wrong = [s.sample_id for s, e, a in zip(index.samples, by_batch, by_group)
                 if abs(a - e) > 1e-6 + 1e-5 * abs(e)]
        assert wrong, "the fixture must exercise the bug"
        report = replay(directory / rollout, max_divergences=100)
        assert report.exit_code == 1
        assert report.first_divergent_stage == "reward.post_process"
        post = next(s for s in report.stages if s.stage == "reward.post_process")
        assert [d.sample_id for d in post.divergences] == wrong
        assert post.mismatches == len(wrong)
        assert report.first_divergence.sample_id == wrong[0]
        assert [s.status for s in report.stages[:2]] == ["pass", "pass"]  # sample, reward.raw
    code, out, _ = _cli_in_process(capsys, "replay", str(directory / "rollout-0"))
    assert code == 1 and out.startswith("bundle rollout-0 — first divergent stage: reward.post_process")
    # the steps trained on exactly the advantages the bug produced: their loss replays clean
    for step in ("step-0-0", "step-0-1", "step-1-0", "step-1-1"):
        assert replay(directory / step).passed


# ------------------------------------------------------------------------ on vs off, filters, faults


def _params(result) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result.model.named_parameters()}


def test_capture_on_and_off_train_bitwise_identical_weights(trainer, tmp_path):
    off = trainer.run(TINY, env={})
    on = trainer.run(TINY, env=capture_env(tmp_path / "bundles"))
    assert on.capture_stats.written == 6 and off.capture_stats.written == 0
    p_off, p_on = _params(off), _params(on)
    assert p_off.keys() == p_on.keys() and len(p_off) == 11
    for name in p_off:
        assert torch.equal(p_off[name], p_on[name]), name
    assert on.mean_rewards == off.mean_rewards


def test_filters_capture_exactly_the_listed_step_and_rollout(trainer, tmp_path):
    directory = tmp_path / "bundles"
    env = capture_env(directory, RELAX_REPLAY_CAPTURE_STEPS="0:1", RELAX_REPLAY_CAPTURE_ROLLOUTS="2")
    result = trainer.run([*TINY, "--rollouts", "3"], env=env)
    assert bundle_dirs(directory) == ["rollout-2", "step-0-1"]
    assert result.capture_stats.written == 2
    assert BundleReader(directory / "rollout-2").index.identity.rollout_id == 2
    step = BundleReader(directory / "step-0-1").index.identity.actor_step_id
    assert (step.rollout_id, step.step_id) == (0, 1)


def test_a_full_disk_never_stops_training_and_is_counted(trainer, tmp_path, monkeypatch, caplog):
    baseline = _params(trainer.run(TINY, env={}))

    def no_space(self, name, tensor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(BundleWriter, "write_payload", no_space)
    directory = tmp_path / "bundles"
    with caplog.at_level(logging.ERROR, logger="capture"):
        result = trainer.run(TINY, env=capture_env(directory))
    assert result.steps == 4
    stats = result.capture_stats
    assert (stats.errors, stats.written, stats.dropped) == (6, 0, 0)
    assert caplog.text.count("No space left on device") == 4  # the first four, then only every power of two
    assert "writing rollout-0 failed: [Errno 28] No space left on device (1 error(s) so far)" in caplog.text
    assert "replay capture: 6 write error(s) in all, the last 2 not logged" in caplog.text
    assert not directory.exists() or list(directory.iterdir()) == []  # nothing half-written is left
    for name, value in _params(result).items():
        assert torch.equal(value, baseline[name]), name


def test_training_never_waits_for_a_writer_stuck_on_disk(trainer, tmp_path, monkeypatch):
    entered, gate = stick_writer_on_disk(monkeypatch, RUN_TIMEOUT_S)
    parser = trainer.build_parser()
    args = parser.parse_args(TINY)
    directory = tmp_path / "bundles"
    cap = ReplayCapture(CaptureConfig(enabled=True, directory=directory), trainer.recompute_config(args),
                        max_queue=2, register_atexit=False)
    outcome: dict = {}

    def training():
        outcome["result"] = trainer.train(args, cap)

    t = threading.Thread(target=training)
    t.start()
    t.join(RUN_TIMEOUT_S)
    try:
        assert not t.is_alive(), "training waited for the capture writer"
        assert entered.is_set() and not gate.is_set()  # the whole run happened while the writer was stuck
        assert outcome["result"].steps == 4
        during = cap.stats
        assert during.written == 0 and during.dropped > 0
    finally:
        gate.set()
        assert cap.close(timeout=RUN_TIMEOUT_S)
    after = cap.stats
    assert after.errors == 0 and after.written >= 1
    assert after.dropped == during.dropped
    # whatever was published is whole: a step that lost a micro-batch was abandoned, never written
    for name in bundle_dirs(directory):
        assert replay(directory / name).passed, name


# --------------------------------------------------------------------------------- two ranks, gloo


def test_torchrun_two_ranks_publish_one_cohort_per_bundle(tmp_path, capsys):
    directory = tmp_path / "bundles"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(TRAINER_PATH), *TINY, "--dist-timeout", "60"],
        cwd=tmp_path, env=subprocess_env(**capture_env(directory)), capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert bundle_dirs(directory) == ALL_BUNDLES
    for name in ALL_BUNDLES:
        cohort = directory / name
        assert sorted(p.name for p in cohort.iterdir()) == ["COMPLETE", "COMPLETE.0", "COMPLETE.1", "rank-0", "rank-1"]
        assert json.loads((cohort / "COMPLETE").read_bytes())["ranks"] == [0, 1]
        bundles = open_bundle(cohort)
        assert bundles.cohort and [s.rank for s in bundles.shards] == [0, 1]
        assert bundles.shards[0].index.identity.rank == {"dp": 2, "tp": 1, "pp": 1, "cp": 1}
        code, out, err = _cli_in_process(capsys, "replay", str(cohort))
        assert code == 0, (name, out, err)
        assert out.startswith(f"bundle {name} (2 ranks) — no divergence")
    shards = open_bundle(directory / "rollout-0").shards
    assert [s.sample_id for s in shards[1].index.samples][:2] == ["r1-s-0", "r1-s-1"]
    assert shards[0].index.identity.semantic_group_ids == [0, 1]
    assert shards[1].index.identity.semantic_group_ids == [2, 3]


def test_a_rank_killed_before_it_flushes_leaves_no_cohort_complete(tmp_path, capsys):
    directory = tmp_path / "bundles"
    port = str(free_port())
    common = capture_env(directory, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2")
    args = [*TINY, "--dist-timeout", "60"]
    rank0 = subprocess.Popen([sys.executable, str(TRAINER_PATH), *args], cwd=tmp_path,
                             env=subprocess_env(RANK="0", LOCAL_RANK="0", **common),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # rank 1 dies (SIGKILL) inside the publication of its last bundle, after all collectives are done
    rank1 = subprocess.Popen([sys.executable, str(Path(__file__).with_name("crash_rank.py")), "step-1-1", *args],
                             cwd=tmp_path, env=subprocess_env(RANK="1", LOCAL_RANK="1", **common),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out0, err0 = rank0.communicate(timeout=RUN_TIMEOUT_S)
    rank1.communicate(timeout=RUN_TIMEOUT_S)
    assert rank1.returncode == -9
    assert rank0.returncode == 0, err0[-3000:]
    cohort = directory / "step-1-1"
    visible = sorted(p.name for p in cohort.iterdir() if not p.name.startswith("."))
    assert visible == ["COMPLETE.0", "rank-0"]  # no rank-1/, no COMPLETE.1 and no cohort COMPLETE
    staged = [p.name for p in cohort.iterdir() if p.name.startswith(".rank-1.tmp-")]
    assert len(staged) == 1  # the dead rank's staging dir: never published
    refused = _cli("validate", str(cohort))
    assert refused.returncode == 3
    assert "cohort has no final COMPLETE (ranks published: COMPLETE.0)" in refused.stderr
    code, _, err = _cli_in_process(capsys, "validate", str(cohort / "rank-0"))  # passing the shard directly
    assert code == 3 and "a rank-local bundle is refused" in err
    # the cohorts both ranks had flushed before the kill are complete and replay
    for name in ALL_BUNDLES[:-1]:
        assert (directory / name / "COMPLETE").is_file(), name
        assert replay(directory / name).passed, name
