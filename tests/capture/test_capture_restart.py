"""A restarted job, killed writers' staging and a failing disk: what a capture directory already holds.

Real files and real processes: the example trainer run twice into one directory, writers killed with
SIGKILL mid-write beside a live one, a capture directory below a regular file (every write fails).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from capture import CaptureConfig, CaptureDirectoryError, ReplayCapture, config_from_env, maybe_enable_for_actor
from capture.directory import earlier_bundles, process_start_time
from capture_helpers import ROOT, TINY, TRAINER_PATH, all_files, bundle_dirs, capture_env, subprocess_env
from replay_lib.bundle import BundleReader
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import RecomputeConfig

GUARD_S = 60.0  # only ever reached when the code under test is broken
RUN_TIMEOUT_S = 300
WRITER = Path(__file__).with_name("staging_writer.py")
ALL_BUNDLES = ["rollout-0", "rollout-1", "step-0-0", "step-0-1", "step-1-0", "step-1-1"]
CFG = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2, grpo_std_normalization=False,
                      kl_coef=0.0)
AN_HOUR = 3600.0


def _enable(env, **ranks):
    return maybe_enable_for_actor(CFG, env=env, register_atexit=False, **ranks)


def _rollout(cap, rollout_id: int, prefix: str = "s-") -> bool:
    """One clean rollout of two groups of two (the PR #65 rewards, normalized per group)."""
    rewards = [-1.0, 1.0, -1.0, 1.0]
    return cap.capture_rollout(
        rollout_id, sample_ids=[f"{prefix}{i}" for i in range(4)], group_index=[0, 0, 1, 1],
        response_lengths=[2] * 4, total_lengths=[5] * 4, loss_mask=[[1, 1]] * 4,
        raw_rewards=[1.0, 3.0, 10.0, 12.0], rewards=rewards, old_log_probs=torch.full((8,), -0.5),
        kl=torch.zeros(8), advantages=torch.tensor(rewards).repeat_interleave(2),
    )


def _step(cap, rollout_id: int, step_id: int) -> bool:
    step = cap.begin_step(rollout_id, step_id)
    step.add_micro_batch(sample_ids=["s-0", "s-1"], group_index=[0, 0], response_lengths=[2, 2],
                         total_lengths=[5, 5], loss_mask=[[1, 1], [1, 1]], log_probs=torch.full((4,), -0.5),
                         old_log_probs=torch.full((4,), -0.5), advantages=torch.zeros(4))
    return step.finish(loss=torch.tensor(0.0), pg_loss=torch.tensor(0.0))


def _earlier_single_run(directory: Path, rollouts=(0, 1), steps=((0, 0), (0, 1))) -> None:
    cap = _enable(capture_env(directory))
    for r in rollouts:
        assert _rollout(cap, r)
    for r, s in steps:
        assert _step(cap, r, s)
    assert cap.close(timeout=GUARD_S) and cap.stats.written == len(rollouts) + len(steps)


def _refusal(directory: Path, names: str, count: int, rank: str = "") -> str:
    return (f"RELAX_REPLAY_CAPTURE_DIR={str(directory)!r}: already holds {count} bundle(s) this job would "
            f"write{rank} ({names}), left by an earlier run; use a fresh directory, or set "
            f"RELAX_REPLAY_CAPTURE_RUN_ID=<id> to write under {directory}/<id>/")


def _age(*paths: Path, by: float = AN_HOUR) -> None:
    """Date entries this process wrote to before it started: what an earlier run's files look like."""
    when = process_start_time() - by
    for path in paths:
        os.utime(path, (when, when), follow_symlinks=False)


# --------------------------------------------------------------------------------- a restarted job


def _train(cwd: Path, env: dict) -> subprocess.CompletedProcess:
    argv = [a for a in TINY if a != "--quiet"]
    return subprocess.run([sys.executable, str(TRAINER_PATH), *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)


@pytest.mark.slow
def test_a_restarted_training_job_stops_at_enable_in_one_line_and_a_run_id_lets_it_capture(trainer, tmp_path):
    directory = tmp_path / "bundles"
    env = subprocess_env(**capture_env(directory))
    first = _train(tmp_path, env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert bundle_dirs(directory) == ALL_BUNDLES
    before = {p: p.read_bytes() for p in all_files(directory)}

    again = _train(tmp_path, env)  # the same job started again on the same directory
    assert again.returncode == 2  # not 0 with nothing captured
    assert again.stderr.strip().splitlines() == ["grpo_trainer: error: " + _refusal(
        directory, "rollout-0, rollout-1, step-0-0, …", 6)]  # one line, no traceback
    assert "failed" not in again.stderr and "capture:" not in again.stdout  # it stopped before training
    assert {p: p.read_bytes() for p in all_files(directory)} == before

    result = trainer.run(TINY, env=capture_env(directory, RELAX_REPLAY_CAPTURE_RUN_ID="restart-1"))
    stats = result.capture_stats
    assert (stats.written, stats.errors, stats.dropped) == (6, 0, 0)
    assert bundle_dirs(directory) == sorted(ALL_BUNDLES + ["restart-1"])
    assert bundle_dirs(directory / "restart-1") == ALL_BUNDLES
    assert {p: p.read_bytes() for p in all_files(directory) if "restart-1" not in p.parts} == before
    for name in ("rollout-1", "step-1-1"):
        assert replay(directory / "restart-1" / name).passed, name
    with pytest.raises(trainer.CaptureRefused) as info:  # the run id used a second time
        trainer.run(TINY, env=capture_env(directory, RELAX_REPLAY_CAPTURE_RUN_ID="restart-1"))
    assert str(info.value) == (
        f"RELAX_REPLAY_CAPTURE_RUN_ID='restart-1': {directory / 'restart-1'} already holds 6 bundle(s) this "
        "job would write (rollout-0, rollout-1, step-0-0, …), left by an earlier run; use a fresh directory, "
        "or set another RELAX_REPLAY_CAPTURE_RUN_ID")


def test_only_the_bundles_the_filters_select_count(tmp_path):
    _earlier_single_run(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "rollout-01").mkdir()  # not a name capture writes (it would write rollout-1)
    cap = _enable(capture_env(tmp_path, RELAX_REPLAY_CAPTURE_ROLLOUTS="5", RELAX_REPLAY_CAPTURE_STEPS="5:0"))
    assert cap.enabled  # resumes at rollout 5 into the same directory: nothing of its own is there
    assert cap.close(timeout=GUARD_S)
    with pytest.raises(CaptureDirectoryError) as info:  # STEPS alone leaves every rollout selected
        _enable(capture_env(tmp_path, RELAX_REPLAY_CAPTURE_STEPS="0:1"))
    assert str(info.value) == _refusal(tmp_path, "rollout-0, rollout-1, step-0-1", 3)
    with pytest.raises(CaptureDirectoryError) as info:
        _enable(capture_env(tmp_path, RELAX_REPLAY_CAPTURE_ROLLOUTS="1", RELAX_REPLAY_CAPTURE_STEPS="9:9"))
    assert str(info.value) == _refusal(tmp_path, "rollout-1", 1)


def test_a_run_id_writes_under_a_directory_of_its_own(tmp_path):
    _earlier_single_run(tmp_path, rollouts=(0,), steps=())
    cap = _enable(capture_env(tmp_path, RELAX_REPLAY_CAPTURE_RUN_ID=" r-2 "))
    assert (cap.config.run_id, cap.config.directory, cap.config.root) == ("r-2", tmp_path / "r-2", tmp_path)
    assert _rollout(cap, 0) and cap.close(timeout=GUARD_S) and cap.stats.written == 1
    assert replay(tmp_path / "r-2" / "rollout-0").passed
    with pytest.raises(CaptureDirectoryError) as info:
        _enable(capture_env(tmp_path, RELAX_REPLAY_CAPTURE_RUN_ID="r-2"))
    assert str(info.value) == (
        f"RELAX_REPLAY_CAPTURE_RUN_ID='r-2': {tmp_path / 'r-2'} already holds 1 bundle(s) this job would write "
        "(rollout-0), left by an earlier run; use a fresh directory, or set another RELAX_REPLAY_CAPTURE_RUN_ID")
    fresh = _enable(capture_env(tmp_path, RELAX_REPLAY_CAPTURE_RUN_ID="r-3"))
    assert fresh.close(timeout=GUARD_S)


BAD_STEM = "expected a plain file stem (letters, digits, '_', '.', '-'; at most 128, not starting with '.' or '-', no '..')"
RESERVED = "reads as a bundle, rank or sentinel name of the capture directory (expected another name)"


@pytest.mark.parametrize("value, why", [
    ("../elsewhere", BAD_STEM), ("a/b", BAD_STEM), ("/abs", BAD_STEM), (".hidden", BAD_STEM), ("-x", BAD_STEM),
    ("a..b", BAD_STEM), ("run 1", BAD_STEM), ("a\nb", BAD_STEM), ("r\x1b[2J", BAD_STEM), ("x" * 129, BAD_STEM),
    ("rollout-3", RESERVED), ("step-1-2", RESERVED), ("rank-0", RESERVED), ("COMPLETE.1", RESERVED),
])
def test_a_bad_run_id_is_refused_at_enable_time(tmp_path, value, why):
    with pytest.raises(ValueError) as info:
        _enable(capture_env(tmp_path / "bundles", RELAX_REPLAY_CAPTURE_RUN_ID=value))
    assert str(info.value) == f"RELAX_REPLAY_CAPTURE_RUN_ID={value!r}: {why}"
    assert "\x1b" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_a_capture_directory_that_is_a_file_is_refused_at_enable_time(tmp_path):
    path = tmp_path / "bundles"
    path.write_text("not a directory")
    with pytest.raises(CaptureDirectoryError) as info:
        _enable(capture_env(path))
    assert str(info.value) == (f"RELAX_REPLAY_CAPTURE_DIR={str(path)!r}: cannot be listed (Not a directory); "
                               "expected a directory this job can write to")


# ------------------------------------------------------------------------------ ranks of one cohort


def test_a_rank_enabling_after_its_peer_published_is_not_refused_and_a_restart_is(tmp_path):
    env = capture_env(tmp_path)
    rank0 = _enable(env, dp_rank=0, dp_size=2)
    assert _rollout(rank0, 7) and rank0.flush(GUARD_S)
    cohort = tmp_path / "rollout-7"
    assert sorted(p.name for p in cohort.iterdir()) == ["COMPLETE.0", "rank-0"]
    rank1 = _enable(env, dp_rank=1, dp_size=2)  # the slower rank of the same job
    assert _rollout(rank1, 7, prefix="r1-s-")
    assert rank0.close(timeout=GUARD_S) and rank1.close(timeout=GUARD_S)
    assert (rank0.stats.written, rank1.stats.written, rank1.stats.errors) == (1, 1, 0)
    assert replay(cohort).passed
    # the job restarted: each rank finds its own shard; a bigger job's new rank, a finished cohort
    for rank, world in ((0, 2), (1, 2), (2, 3)):
        with pytest.raises(CaptureDirectoryError) as info:
            _enable(env, dp_rank=rank, dp_size=world)
        assert str(info.value) == _refusal(tmp_path, "rollout-7", 1, f" as rank {rank}")
    with pytest.raises(CaptureDirectoryError) as info:  # a single producer cannot write that name at all
        _enable(env)
    assert str(info.value) == _refusal(tmp_path, "rollout-7", 1)


def test_a_rank_that_would_complete_an_earlier_runs_cohort_is_refused(tmp_path):
    env = capture_env(tmp_path)
    rank0 = _enable(env, dp_rank=0, dp_size=2)
    assert _rollout(rank0, 3) and rank0.close(timeout=GUARD_S)
    cohort = tmp_path / "rollout-3"
    _age(cohort / "rank-0", cohort / "COMPLETE.0")  # published by a run whose rank 1 then died
    with pytest.raises(CaptureDirectoryError) as info:
        _enable(env, dp_rank=1, dp_size=2)
    assert str(info.value) == _refusal(tmp_path, "rollout-3", 1, " as rank 1")
    assert sorted(p.name for p in cohort.iterdir()) == ["COMPLETE.0", "rank-0"]  # nothing joined it


def test_a_peer_shard_counts_as_earlier_only_beyond_the_clock_allowance(tmp_path):
    env = capture_env(tmp_path)
    rank0 = _enable(env, dp_rank=0, dp_size=2)
    assert _rollout(rank0, 3) and rank0.close(timeout=GUARD_S)
    shard = tmp_path / "rollout-3" / "COMPLETE.0"
    published = min(shard.stat().st_mtime, (tmp_path / "rollout-3" / "rank-0").stat().st_mtime)  # the older
    config = config_from_env(env)
    assert earlier_bundles(config, 1, started=published + 1.9) == []
    assert earlier_bundles(config, 1, started=published + 2.1) == ["rollout-3"]
    assert earlier_bundles(config, 0, started=published - AN_HOUR) == ["rollout-3"]  # its own shard: always


def test_process_start_time_is_when_the_process_started():
    code = ("from capture.directory import _IMPORTED_AT, process_start_time;"
            "print(repr(process_start_time()), repr(_IMPORTED_AT))")
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True,
                         text=True, timeout=RUN_TIMEOUT_S, check=True)
    started, imported = (float(x) for x in out.stdout.split())
    assert before - 0.05 <= started < imported  # the exec, not the (later) import of capture
    assert started - before < 1.0


# --------------------------------------------------------------------------- killed writers' staging


def _staging(parent: Path, pid: int) -> list[Path]:
    return sorted(p for p in parent.iterdir() if f".tmp-{pid}-" in p.name)


def test_staging_of_killed_writers_is_removed_and_a_live_writers_is_kept(tmp_path, caplog):
    root = tmp_path / "bundles"
    (root / "r-2").mkdir(parents=True)
    killed = subprocess.Popen([sys.executable, str(WRITER), str(root), "die", "rollout-0", "rollout-1:1",
                               "rollout-3", "r-2/rollout-4"], cwd=tmp_path, env=subprocess_env())
    assert killed.wait(RUN_TIMEOUT_S) == -9  # SIGKILL mid-write, and reaped: its pid is gone
    live = subprocess.Popen([sys.executable, str(WRITER), str(root), "wait", "rollout-2"], cwd=tmp_path,
                            env=subprocess_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        live_staging = Path(live.stdout.readline().strip())
        assert live.stdout.readline() == "staged\n"
        dead_top = _staging(root, killed.pid)
        assert [p.name.split(".tmp-")[0] for p in dead_top] == [".rollout-0", ".rollout-3"]
        [dead_rank] = _staging(root / "rollout-1", killed.pid)
        assert dead_rank.name.startswith(".rank-1.tmp-")
        [dead_run] = _staging(root / "r-2", killed.pid)
        sentinel = root / "rollout-1" / f".COMPLETE.1.tmp-{killed.pid}-0123abcd"  # an atomic write cut short
        sentinel.write_bytes(b"{")
        _age(dead_top[0], dead_rank, dead_run, sentinel, live_staging)
        future = time.time() + AN_HOUR  # a dead pid, but newer than this writer: left alone
        os.utime(dead_top[1], (future, future))

        with caplog.at_level(logging.WARNING, logger="capture"):
            cap = _enable(capture_env(root, RELAX_REPLAY_CAPTURE_RUN_ID="r-2"))
            assert cap.flush(GUARD_S)  # the clean-up runs on the writer thread, before any record
        assert [r.getMessage() for r in caplog.records] == [
            f"replay capture: removed 4 stale staging item(s) left by killed writers under {root}"]
        assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == sorted(
            [live_staging.name, dead_top[1].name])
        assert list((root / "rollout-1").iterdir()) == []
        assert sorted(p.name for p in (root / "r-2").iterdir()) == [".capture.lock", ".capture.lock.guard"]
        assert _rollout(cap, 0) and cap.close(timeout=GUARD_S) and cap.stats.written == 1
        assert [p.name for p in (root / "r-2").iterdir()] == ["rollout-0"]  # the lock went with the capture

        out, _ = live.communicate("\n", timeout=RUN_TIMEOUT_S)  # the live writer publishes what it staged
        assert live.returncode == 0, out
    finally:
        if live.poll() is None:
            live.kill()
            live.wait(GUARD_S)
    assert not live_staging.exists()
    assert BundleReader(root / "rollout-2").index.bundle_id == "rollout-2"  # verified: whole
    assert replay(root / "r-2" / "rollout-0").passed


def test_nothing_stale_removes_nothing_and_says_nothing(tmp_path, caplog):
    mine = tmp_path / f".rollout-0.tmp-{os.getpid()}-0123abcd"  # this process's own: alive
    mine.mkdir()
    _age(mine)
    with caplog.at_level(logging.WARNING, logger="capture"):
        cap = _enable(capture_env(tmp_path))
        assert cap.flush(GUARD_S) and cap.close(timeout=GUARD_S)
    assert caplog.records == [] and mine.is_dir()


# ------------------------------------------------------------------------------ a failing write path


def test_failed_writes_are_logged_rate_limited_and_all_counted(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    directory = blocker / "bundles"  # every write fails: its parent is a regular file
    cap = ReplayCapture(CaptureConfig(enabled=True, directory=directory), CFG, register_atexit=False)
    with caplog.at_level(logging.ERROR, logger="capture"):
        for r in range(20):
            assert _rollout(cap, r)
        assert cap.close(timeout=GUARD_S)
    assert (cap.stats.errors, cap.stats.written, cap.stats.dropped) == (20, 0, 0)
    why = f"[Errno 20] Not a directory: {str(directory)!r}"
    assert [r.getMessage() for r in caplog.records] == [
        f"replay capture: writing rollout-0 failed: {why} (1 error(s) so far)",
        f"replay capture: writing rollout-1 failed: {why} (2 error(s) so far)",
        f"replay capture: writing rollout-2 failed: {why} (3 error(s) so far)",
        f"replay capture: writing rollout-3 failed: {why} (4 error(s) so far; from now on only the 8th, 16th … "
        "are logged)",
        f"replay capture: writing rollout-7 failed: {why} (8 error(s) so far, 3 not logged since error 4)",
        f"replay capture: writing rollout-15 failed: {why} (16 error(s) so far, 7 not logged since error 8)",
        "replay capture: 20 write error(s) in all, the last 4 not logged",
    ]
