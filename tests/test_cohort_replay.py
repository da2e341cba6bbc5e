"""Multi-rank cohorts: every rank shard is verified and replayed, and a divergence names its rank."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from replay_lib.demo import synthetic_parts, write_bundle, write_cohort
from replay_lib.errors import BundleError, SelectionError
from replay_lib.judge.report import report_to_text
from replay_lib.run.runner import replay
from replay_lib.bundle.selection import Selection

BUNDLE_ID = "cohort-7-0"
SAMPLES, TOKENS = 8, 4  # per rank; groups of 4


def rank_parts(rank: int):
    return synthetic_parts(samples=SAMPLES, tokens=TOKENS, group_size=4, bundle_id=BUNDLE_ID, seed=100 + rank,
                           sample_prefix=f"r{rank}-s-", rank_sizes={"dp": 2, "tp": 1, "pp": 1, "cp": 1})


def write_ranks(root, faults=None, ranks=(0, 1), publish=(0, 1)):
    """Each rank publishes its shard through BundleWriter(rank=r); ``faults[r](expected, payloads)`` tampers first."""
    faults = faults or {}
    for r in publish:
        manifest, index, expected, payloads = rank_parts(r)
        if r in faults:
            faults[r](expected, payloads)
        write_bundle(root, manifest, index, expected, payloads, rank=r, ranks=ranks)
    return root


def kl_fault(sample: int, offset: int):
    def apply(expected, payloads):
        payloads["kl"][sample * TOKENS + offset] += 0.5
    return apply


def raw_fault(sample: int):
    def apply(expected, payloads):
        expected["reward.raw"]["raw_rewards"][sample] += 1.0
    return apply


def test_clean_cohort_replays_every_shard(tmp_path):
    report = replay(write_cohort(tmp_path / "cohort"))
    assert report.passed and report.ranks == [0, 1]
    assert report_to_text(report).splitlines()[0] == "bundle cohort-7-0 (2 ranks) — no divergence (6 stage(s) compared)"


def test_fault_on_rank_1_is_named_in_the_report(tmp_path):
    root = write_ranks(tmp_path / BUNDLE_ID, {1: kl_fault(5, 2)})
    report = replay(root)
    assert report.ranks == [0, 1]
    assert report.first_divergent_stage == "advantage.kl"
    d = report.first_divergence
    assert (d.stage, d.rank, d.sample_id, d.group_index, d.field, d.token_offset) == (
        "advantage.kl", 1, "r1-s-5", 1, "kl", 2)
    assert d.abs_error == pytest.approx(0.5, abs=1e-6)
    # every shard was replayed: counts cover both ranks
    assert report.stage("sample").compared == 2 * SAMPLES
    assert report.stage("reward.post_process").compared == 2 * SAMPLES
    assert report.stage("advantage.kl").compared == 2 * SAMPLES * TOKENS
    assert report.stage("loss.policy").compared == 2 * 5  # five loss fields per rank
    assert report.stage("advantage.kl").reason == "kl mismatch in 1 token(s) of 1 sample(s) (rank 1)"
    assert [s.stage for s in report.stages if s.status == "fail"] == ["advantage.kl"]


def test_fault_on_rank_1_through_the_real_cli(tmp_path):
    root = write_ranks(tmp_path / BUNDLE_ID, {1: kl_fault(5, 2)})
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    proc = subprocess.run(["trajectory-replay", "replay", str(root)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert (proc.returncode, proc.stderr) == (1, "")
    lines = proc.stdout.splitlines()
    assert lines[0] == "bundle cohort-7-0 (2 ranks) — first divergent stage: advantage.kl (rank 1)"
    assert "[   fail] advantage.kl — kl mismatch in 1 token(s) of 1 sample(s) (rank 1)" in lines
    detail = [line for line in lines if line.startswith("          kl ")]
    assert len(detail) == 1 and detail[0].startswith("          kl r1-s-5@2 [rank 1]: expected=")


def test_earliest_stage_across_ranks_wins(tmp_path):
    # rank 0 breaks advantage.kl, rank 1 breaks reward.raw (earlier in the DAG)
    root = write_ranks(tmp_path / BUNDLE_ID, {0: kl_fault(0, 0), 1: raw_fault(6)})
    report = replay(root)
    assert report.first_divergent_stage == "reward.raw"
    assert (report.first_divergence.rank, report.first_divergence.sample_id) == (1, "r1-s-6")
    assert [s.stage for s in report.stages if s.status == "fail"] == ["reward.raw", "advantage.kl"]
    assert report.stage("advantage.kl").divergences[0].rank == 0


def test_same_stage_on_both_ranks_reports_rank_order_and_each_ranks_counts(tmp_path):
    def two_faults(expected, payloads):
        kl_fault(7, 3)(expected, payloads)
        kl_fault(2, 1)(expected, payloads)

    root = write_ranks(tmp_path / BUNDLE_ID, {0: two_faults, 1: kl_fault(1, 0)})
    report = replay(root)
    kl = report.stage("advantage.kl")
    assert kl.mismatches == 3
    assert [(d.rank, d.sample_id, d.token_offset) for d in kl.divergences] == [
        (0, "r0-s-2", 1), (0, "r0-s-7", 3), (1, "r1-s-1", 0)]
    assert kl.reason == ("rank 0: kl mismatch in 2 token(s) of 2 sample(s); "
                         "rank 1: kl mismatch in 1 token(s) of 1 sample(s)")
    assert (report.first_divergence.rank, report.first_divergence.sample_id) == (0, "r0-s-2")


def test_json_report_of_a_cohort(tmp_path, capsys):
    from replay_lib.cli import main

    root = write_ranks(tmp_path / BUNDLE_ID, {1: kl_fault(5, 2)})
    assert main(["replay", str(root), "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["first_divergence"]["rank"] == 1 and doc["first_divergence"]["sample_id"] == "r1-s-5"
    assert doc["ranks"] == [0, 1]


def test_selection_in_a_cohort_replays_the_group_on_its_rank(tmp_path):
    root = write_ranks(tmp_path / BUNDLE_ID, {1: kl_fault(5, 2)})
    report = replay(root, selection=Selection(samples=("r1-s-6",)))
    assert report.selected_samples == ["r1-s-4", "r1-s-5", "r1-s-6", "r1-s-7"]
    assert (report.first_divergence.rank, report.first_divergence.sample_id) == (1, "r1-s-5")
    assert replay(root, selection=Selection(samples=("r0-s-6",))).passed
    with pytest.raises(SelectionError, match=r"--sample r9-s-0: not found in any rank shard"):
        replay(root, selection=Selection(samples=("r9-s-0",)))


def test_rank_path_of_a_finished_cohort_replays_that_shard(tmp_path):
    root = write_ranks(tmp_path / BUNDLE_ID, {1: kl_fault(5, 2)})
    report = replay(root / "rank-1")
    assert report.ranks == [1] and report.first_divergence.rank == 1
    assert replay(root / "rank-0").passed


def test_cohort_missing_a_rank_is_refused_before_any_stage(tmp_path):
    root = write_ranks(tmp_path / BUNDLE_ID, publish=(0,))
    assert not (root / "COMPLETE").exists()
    for path in (root, root / "rank-0"):
        with pytest.raises(BundleError, match=r"cohort has no final COMPLETE \(ranks published: COMPLETE\.0\)"):
            replay(path)
