"""The rollout-vs-old log-prob mismatch over a run (``run.mismatch_series``): per step, its class, in ``scan``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay_lib.run.mismatch_series import classify, mismatch_of, run_series, sparkline

ROOT = Path(__file__).resolve().parents[1]


def test_mismatch_of_hand_derived():
    # d = old − rollout on the loss tokens: [0.5, 0, −0.25] (the 4th token is masked out)
    m = mismatch_of(torch.tensor([-1.0, -2.0, -0.5, 9.0]), torch.tensor([-1.5, -2.0, -0.25, 0.0]),
                    torch.tensor([1, 1, 1, 0]))
    assert (m.max_abs, m.count, m.tokens) == (0.5, 2, 3)
    k3 = ((math.exp(0.5) - 1.5) + 0.0 + (math.exp(-0.25) - 0.75)) / 3
    assert m.k3 == pytest.approx(k3, rel=1e-12)
    assert mismatch_of(torch.zeros(2), torch.ones(2), torch.zeros(2)).to_json() == {
        "max_abs": 0.0, "k3": 0.0, "count": 0, "tokens": 0}


@pytest.mark.parametrize("values, kind, step, why", [
    ([0.0, 0.0, 0.0], "zero", None, "every step: rollout = old on every loss token"),
    # range 0.005 ≤ 0.1 × median 0.125
    ([0.125, 0.125, 0.13, 0.125], "constant offset", None, "range 0.005 ≤ 0.1 × median 0.125"),
    # a spike: changes 0.001, 0.489, 0.488, 0.002; the largest at step 2 is ≥ 0.5 × range 0.49 and ≥ 5 × 0.002
    ([0.01, 0.011, 0.5, 0.012, 0.01], "jump", 2,
     "change 0.489 at step 2 ≥ 0.5 × range 0.49 and ≥ 5 × the other changes' median 0.002"),
    # a level shift at step 3: the other changes are all 0
    ([0.01, 0.01, 0.01, 0.3, 0.3, 0.3], "jump", 3,
     "change 0.29 at step 3 ≥ 0.5 × range 0.29 and ≥ 5 × the other changes' median 0"),
    # steady growth: every change 0.01 < 0.5 × range 0.04; every pair concordant, τ = +1
    ([0.01, 0.02, 0.03, 0.04, 0.05], "drift", None, "Kendall τ +1.00 (|τ| ≥ 0.6): growing"),
    # τ = (3 concordant − 3 discordant) / 10 = 0; the changes are all 0.2, none 5 × the others
    ([0.1, 0.3, 0.1, 0.3, 0.1], "no pattern", None, "range 0.2, largest change 0.2 at step 1, Kendall τ +0.00"),
    ([0.1, 0.2], "too few steps", None, "2 step(s) with rollout log-probs; 3 are needed"),
])
def test_classify_hand_derived(values, kind, step, why):
    shape = classify(values)
    assert (shape.kind, shape.step, shape.why) == (kind, step, why)


def test_drift_downwards_and_a_non_finite_step():
    assert classify([0.5, 0.45, 0.41, 0.36, 0.3]).why == "Kendall τ -1.00 (|τ| ≥ 0.6): shrinking"
    shape = classify([0.1, math.inf, 0.1])
    assert (shape.kind, shape.step) == ("jump", 1)


def test_sparkline():
    assert sparkline([0.0, 0.5, 1.0, math.nan]) == "▁▅█!"
    assert sparkline([0.0, 0.0]) == "▁▁"


def _write_run(directory: Path, deltas):
    """One step bundle per delta, written by the capture: rollout = old − delta on every loss token."""
    from capture import CaptureConfig, ReplayCapture
    from replay_lib.bundle.schema import RecomputeConfig

    cfg = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2, grpo_std_normalization=False,
                          kl_loss_type="k1", kl_coef=0.0, eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.0)
    cap = ReplayCapture(CaptureConfig(enabled=True, directory=directory), cfg, register_atexit=False)
    for s, delta in enumerate(deltas):
        step = cap.begin_step(0, s)
        assert step.add_micro_batch(
            sample_ids=[f"s{s}-0", f"s{s}-1"], group_index=[0, 0], response_lengths=[3, 2], total_lengths=[8, 7],
            loss_mask=torch.tensor([1, 1, 1, 1, 0]), log_probs=torch.zeros(5), old_log_probs=torch.zeros(5),
            advantages=torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0]), entropy=torch.zeros(5),
            raw_rewards=[0.0, 1.0], rewards=[-1.0, 1.0],
            rollout_log_probs=torch.tensor([0.0, -delta, 0.0, -delta, -7.0]),  # the masked token differs by 7
        )
        assert step.finish({"loss": 0.0, "pg_loss": 0.0, "entropy_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0})
    assert cap.close(timeout=60)


def _scan(directory: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "replay_lib.cli.entry", "scan", str(directory), "--jobs", "1",
                           *extra], env=env, capture_output=True, text=True, timeout=300)


def test_scan_rows_and_json_carry_the_series_and_its_class(tmp_path):
    deltas = [0.125, 0.125, 0.125, 1.0, 0.125]  # a jump at step 0:3
    _write_run(tmp_path, deltas)
    proc = _scan(tmp_path, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    rows = doc["bundles"]
    assert [r["anchor"] for r in rows] == ["0:0", "0:1", "0:2", "0:3", "0:4"]
    k3 = lambda d: 2 * (math.exp(d) - 1 - d) / 4  # two of the four loss tokens differ by d
    for row, d in zip(rows, deltas):
        assert row["mismatch"]["max_abs"] == d and row["mismatch"]["count"] == 2 and row["mismatch"]["tokens"] == 4
        assert row["mismatch"]["k3"] == pytest.approx(k3(d), rel=1e-12)
    series = doc["summary"]["mismatch_series"]
    assert series["steps"] == ["0:0", "0:1", "0:2", "0:3", "0:4"]
    assert series["max_abs"] == deltas and series["count"] == [2] * 5
    assert (series["class"], series["class_step"], series["label"]) == ("jump", "0:3", "jump at step 0:3")

    text = _scan(tmp_path)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[3] == "[       pass] step 0:3       step-0-3  rollout≠old 2/4 max|Δ| 1 k3 0.359"
    assert lines[5] == ("rollout/old log-prob mismatch over 5 step(s), max |Δ| ▂▂▂█▂ (peak 1): jump at step 0:3 — "
                        "change 0.875 at step 0:3 ≥ 0.5 × range 0.875 and ≥ 5 × the other changes' median 0")


def test_a_run_without_rollout_log_probs_has_no_series(tmp_path):
    from replay_lib.run.rows import ScanRow, ScanTarget

    t = ScanTarget(tmp_path, "step-0-0", "step", 0, 0, "0:0")
    assert run_series([ScanRow(target=t, status="pass", exit_code=0)]) is None


def test_scan_rows_take_the_stage_values_where_the_replay_ran_it(tmp_path, monkeypatch):
    """A row's mismatch is the replay's ``logprob.mismatch`` summary (no second pass over the payloads); where the
    stage did not run (``--stage loss.policy``) the row recomputes it: the same JSON keys and values either way."""
    from replay_lib.run import check, mismatch_series
    from replay_lib.run.rows import ScanOptions, ScanTarget

    _write_run(tmp_path, [0.5])
    bundle = next(p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("step"))
    target = ScanTarget(bundle, bundle.name, "step", 0, 0, "0:0")
    recompute = mismatch_series.bundle_mismatch
    calls = []
    monkeypatch.setattr(mismatch_series, "bundle_mismatch", lambda b: calls.append(b) or recompute(b))
    row = check.check_target(target, ScanOptions())
    assert row.status == "pass" and calls == []
    expected = {"max_abs": 0.5, "count": 2, "tokens": 4}
    assert {k: row.mismatch[k] for k in expected} == expected
    assert row.mismatch["k3"] == pytest.approx(2 * (math.exp(0.5) - 1.5) / 4, rel=1e-14)
    only_loss = check.check_target(target, ScanOptions(stages=["loss.policy"]))
    assert len(calls) == 1 and set(only_loss.mismatch) == set(row.mismatch)
    assert {k: only_loss.mismatch[k] for k in expected} == expected
    assert only_loss.mismatch["k3"] == pytest.approx(row.mismatch["k3"], rel=1e-14)


def test_validate_lists_the_planned_mismatch_stage(tmp_path):
    from replay_lib.run.validate import validate

    _write_run(tmp_path, [0.5])
    bundle = next(p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("step"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert "logprob.mismatch" not in manifest["stage_contracts"]  # planned by replay, not declared
    assert validate(bundle).stages == {"sample": "recompute", "logprob.mismatch": "recompute",
                                       "loss.policy": "recompute", "loss.value": "unsupported"}
