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
