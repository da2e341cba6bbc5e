"""The replay's intra-op threads (``replay_lib.run.threads``): every stage runs on one torch thread whatever the
caller's setting, which comes back after the replay; a replay nested in another, or one raising, keeps that."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from replay_lib.demo import write_synthetic
from replay_lib.run import runner
from replay_lib.run.threads import replay_threads
from replay_lib.stages import REGISTRY


@pytest.fixture
def caller_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def _recording(monkeypatch, seen: list):
    """Every registered stage records torch's thread count when it runs."""
    for stage, d in list(REGISTRY.items()):
        def run(ctx, _run=d.run, _stage=stage):
            seen.append((_stage.value, torch.get_num_threads()))
            return _run(ctx)
        monkeypatch.setitem(REGISTRY, stage, dataclasses.replace(d, run=run))


def test_every_stage_runs_on_one_thread_and_the_callers_count_comes_back(tmp_path, monkeypatch, caller_threads):
    bundle = tmp_path / "b"
    write_synthetic(bundle, samples=8, tokens=64, kl_coef=0.0)
    seen: list = []
    _recording(monkeypatch, seen)
    report = runner.replay(bundle)
    assert report.passed
    assert [s for s, _ in seen] == ["sample", "reward.raw", "reward.post_process", "advantage.kl",
                                    "advantage.estimate", "loss.policy"]
    assert {n for _, n in seen} == {1}
    assert torch.get_num_threads() == caller_threads


def test_run_replay_of_an_open_bundle_also_runs_on_one_thread(tmp_path, monkeypatch, caller_threads):
    """The entry the TUI and ``scan`` workers use (``replay_run`` / ``run_replay`` of a verified BundleSet)."""
    from replay_lib.bundle import open_bundle

    bundle = tmp_path / "b"
    write_synthetic(bundle, samples=4, tokens=32, kl_coef=0.0)
    seen: list = []
    _recording(monkeypatch, seen)
    report, _ = runner.replay_run(open_bundle(bundle))
    assert report.passed and len(seen) == 6
    assert {n for _, n in seen} == {1}
    assert torch.get_num_threads() == caller_threads


def test_nested_and_raising_replays_restore_the_count_once(caller_threads):
    with replay_threads():
        assert torch.get_num_threads() == 1
        with replay_threads():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1  # the inner one does not restore the caller's 2 early
    assert torch.get_num_threads() == caller_threads
    with pytest.raises(RuntimeError, match="boom"):
        with replay_threads():
            raise RuntimeError("boom")
    assert torch.get_num_threads() == caller_threads


def test_the_second_worker_follows_what_the_others_used_of_the_cpus_over_the_replay(monkeypatch, tmp_path):
    """run.threads.pass_threads: over a replay's window (CpuWindow, opened by replay_threads) the busy time of this
    process's CPUs less its own decides; the load average only before the window is MIN_WINDOW long."""
    from replay_lib.run import threads

    monkeypatch.setattr(threads, "_single_pass", False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.9, 1.9, 1.9))  # the idle virtual host's reading
    times = iter([(100.0, 500.0, 7.0),  # opened: (monotonic s, busy s of CPUs 0–1, this process's CPU s)
                  (100.1, 500.2, 7.1),  # 0.1 s later: too short a window, the load average decides: 1
                  (101.0, 501.3, 8.0),  # 1 s: 1.3 s busy, 1.0 s ours → the others 0.3 of a core: 2
                  (102.0, 503.8, 9.0)])  # 2 s: 3.8 s busy, 2.0 s ours → the others 0.9: 2 − 1 − 0.9 < 0.5: 1
    read = threads._cpu_times
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(times))
    with threads.replay_threads():
        assert [threads.pass_threads() for _ in range(3)] == [1, 2, 1]
    assert threads._window is None  # closed with the outermost replay
    # /proc/stat parsed for this process's CPUs only: user nice system irq softirq steal (not idle, not iowait)
    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\n"
                    "cpu0 100 1 20 5000 7 3 2 4 0 0\n"
                    "cpu1 200 0 30 4000 9 1 1 0 0 0\n"
                    "cpu2 999 999 999 0 0 0 0 0 0 0\n")
    monkeypatch.setattr(threads.os, "sysconf", lambda name: 100)
    _, busy, _ = read(str(stat))
    assert busy == pytest.approx((100 + 1 + 20 + 3 + 2 + 4 + 200 + 30 + 1 + 1) / 100)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 5})  # a CPU without a line: no window
    assert read(str(stat)) is None
