"""``replay --executor ray``: a cohort's rank shards replayed as Ray tasks on a local ``ray.init()``, merged into
the report the local loop makes (the same JSON, byte for byte).

Marked ``ray`` like tests/test_scan_ray.py (``.ci/run`` installs ``.[ray]`` and selects ``-m ray``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray", reason="needs the optional extra [ray]")

from test_cohort_replay import kl_fault, write_ranks

from replay_lib.bundle.selection import Selection
from replay_lib.demo import write_cohort
from replay_lib.judge.report import report_to_json
from replay_lib.run import ray_replay
from replay_lib.run.runner import replay

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def local_ray():
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture
def shard_tasks(local_ray, monkeypatch):
    """The Ray runner, counting the shards it submitted (in this process: the tasks run in Ray's workers)."""
    submitted: list = []
    make = ray_replay.ray_shard_runner

    def runner():
        run = make()

        def counting(jobs, keep, rules):
            submitted.extend(shard.rank for _, shard, _, _ in jobs)
            return run(jobs, keep, rules)
        return counting
    return runner, submitted


def test_a_clean_cohort_replayed_as_ray_tasks_is_the_local_report(tmp_path, shard_tasks):
    runner, submitted = shard_tasks
    cohort = write_cohort(tmp_path / "cohort", ranks=3)
    local = replay(cohort)
    remote = replay(cohort, shard_runner=runner())
    assert submitted == [0, 1, 2]
    assert remote.passed and remote.ranks == [0, 1, 2]
    assert report_to_json(remote) == report_to_json(local)


def test_a_divergence_on_rank_1_merges_as_the_local_one(tmp_path, shard_tasks):
    """Unexplained (``explain=False``), the merged report is the tasks' own; explained, the runner makes it
    again here (the hypotheses read the shards' tensors) — the same JSON either way."""
    runner, submitted = shard_tasks
    root = write_ranks(tmp_path / "cohort-7-0", {1: kl_fault(5, 2)})
    local = replay(root, explain=False)
    remote = replay(root, explain=False, shard_runner=runner())
    assert submitted == [0, 1]
    assert remote.first_divergent_stage == "advantage.kl" and remote.first_divergence.rank == 1
    assert remote.stage("advantage.kl").reason == "kl mismatch in 1 token(s) of 1 sample(s) (rank 1)"
    assert report_to_json(remote) == report_to_json(local)
    assert report_to_json(replay(root, shard_runner=runner())) == report_to_json(replay(root))


def test_a_selection_is_replayed_on_the_rank_that_holds_it(tmp_path, shard_tasks):
    runner, submitted = shard_tasks
    root = write_ranks(tmp_path / "cohort-7-0")
    sel = Selection(samples=("r1-s-5",))
    remote = replay(root, selection=sel, shard_runner=runner())
    assert submitted == [1]  # rank 0 holds nothing selected: no task
    assert remote.selected_samples == ["r1-s-4", "r1-s-5", "r1-s-6", "r1-s-7"]  # its group
    assert report_to_json(remote) == report_to_json(replay(root, selection=sel))


def test_the_cli_replays_a_cohort_with_executor_ray(tmp_path, local_ray):
    """A real process starting its own local Ray: exit 1 and the local process's JSON."""
    root = write_ranks(tmp_path / "cohort-7-0", {1: kl_fault(5, 2)})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "replay_lib", "replay", str(root), "--format", "json"]
    local = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    remote = subprocess.run(cmd + ["--executor", "ray"], capture_output=True, text=True, env=env, timeout=300)
    assert (local.returncode, remote.returncode) == (1, 1), remote.stderr
    assert json.loads(remote.stdout) == json.loads(local.stdout)
