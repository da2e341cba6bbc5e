"""Stage ``link`` (SPEC §9): a step bundle's advantages and old log-probs against its rollout bundle's.

The pairs are written by the real bundle writer: a rollout-level bundle of rollout 7 and a step-level bundle
of step 7:0 with the same samples (``synthetic_parts`` with one seed, so the same payloads). ``kl_coef=0`` and
rollout stages only on the rollout side: a changed old log-prob there leaves the rollout bundle's own replay
clean (its KL is 0·(…) and it declares no loss), so only ``link`` can see it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay_lib.demo import ALL_STAGES, ROLLOUT_STAGES, synthetic_parts, write_bundle
from replay_lib.run.scan import ScanOptions, check_target, discover, link_partners, scan

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "examples" / "grpo_trainer.py"

# 8 samples × 16 tokens: sample s-1's tokens are 16..31 of the flat token axis, its token 3 is element 19.
SAMPLES, TOKENS = 8, 16


def _pair(root: Path, *, rollout_edit=None, step_edit=None, step_prefix="s-", step_dtype=None) -> tuple[Path, Path]:
    rollout = synthetic_parts(samples=SAMPLES, tokens=TOKENS, kl_coef=0.0, anchor=None, stages=ROLLOUT_STAGES,
                              bundle_id="r-7")
    step = synthetic_parts(samples=SAMPLES, tokens=TOKENS, kl_coef=0.0, stages=ALL_STAGES, bundle_id="b-7-0",
                           sample_prefix=step_prefix)
    if rollout_edit:
        rollout_edit(rollout[3])
    if step_edit:
        step_edit(step[3])
    if step_dtype is not None:
        step[3]["advantages"] = step[3]["advantages"].to(step_dtype)
    return write_bundle(root / "rollout-7", *rollout), write_bundle(root / "step-7-0", *step)


def _payload(bundle: Path, name: str) -> torch.Tensor:
    from replay_lib.bundle import BundleReader

    return BundleReader(bundle).payload(name)  # as stored, whichever form the writer took


def _rows(root: Path):
    targets = discover(root)
    partners = link_partners(targets)
    return {t.relpath: check_target(t, ScanOptions(), partners.get(t.path)) for t in targets}


def test_a_changed_old_log_prob_is_a_link_divergence_naming_both_bundles_the_sample_and_the_token(tmp_path):
    def edit(payloads):
        payloads["old_log_probs"] = payloads["old_log_probs"].clone()
        payloads["old_log_probs"][19] = -1.25  # s-1, token 3

    rollout, step = _pair(tmp_path, rollout_edit=edit)
    rows = _rows(tmp_path)
    assert rows["rollout-7"].status == "pass"  # its own stages cannot see it (kl_coef 0, no loss stage)
    row = rows["step-7-0"]
    assert (row.status, row.exit_code, row.first_stage) == ("diverged", 1, "link")
    own = [s for s in row.report["stages"] if s["stage"] != "link"]
    assert [s["stage"] for s in own if s["status"] == "fail"] == []  # the step bundle alone replays clean
    assert len([s for s in own if s["status"] == "pass"]) == 6  # sample … loss.policy
    link = row.report["stages"][-1]
    assert (link["stage"], link["status"], link["mismatches"]) == ("link", "fail", 1)
    d = link["divergences"][0]
    recorded = float(_payload(step, "old_log_probs")[19])  # what the trainer consumed
    assert (d["field"], d["sample_id"], d["token_offset"]) == ("old_log_probs", "s-1", 3)
    assert (d["expected"], d["actual"]) == (-1.25, recorded)
    assert d["abs_error"] == abs(recorded + 1.25)
    assert d["tolerance"] == 0.0 and math.isinf(d["noise_ratio"])  # same dtype: bit for bit
    assert row.report["first_divergent_stage"] == "link" and row.report["passed"] is False
    assert "b-7-0 (step-7-0)" in link["reason"] and "r-7 (rollout-7)" in link["reason"]
    assert row.first_divergence == (f"old_log_probs s-1@3: expected=-1.25 actual={_fmt(recorded)} "
                                    f"abs_err={_fmt(abs(recorded + 1.25))} (expected: rollout bundle r-7; actual: step bundle b-7-0)")
    assert row.link.rollout_bundle_id == "r-7" and row.link.step_bundle_id == "b-7-0"


def _fmt(x: float) -> str:
    from replay_lib.judge.report import fmt_value

    return fmt_value(x)


def test_equal_values_pass_and_count_every_token_of_both_fields(tmp_path):
    _pair(tmp_path)
    row = _rows(tmp_path)["step-7-0"]
    link = row.report["stages"][-1]
    # advantages and old_log_probs, 8 samples × 16 tokens each: 2 × 128 compared tokens
    assert (row.status, link["status"], link["compared"], link["mismatches"]) == ("pass", "pass", 256, 0)
    assert link["max_abs_error"] == 0.0


def test_a_bf16_step_payload_may_differ_by_its_rounding_only(tmp_path):
    """A bf16 copy of the float32 advantages is within u_bf16·|e| = 2^-8·|e| of each value (round to
    nearest: at most half an ulp, ulp = 2^-7·2^floor(log2|e|) ≤ 2^-7·|e|), so it links clean."""
    _pair(tmp_path, step_dtype=torch.bfloat16)
    link = _rows(tmp_path)["step-7-0"].link
    assert link.status == "pass"
    assert link.stage["mismatches"] == 0 and link.stage["max_abs_error"] > 0


def test_a_step_sample_the_rollout_bundle_does_not_hold_is_named(tmp_path):
    _pair(tmp_path, step_prefix="t-")  # the step's samples are t-0..t-7, the rollout's s-0..s-7
    row = _rows(tmp_path)["step-7-0"]
    link = row.report["stages"][-1]
    assert (row.status, link["mismatches"]) == ("diverged", 8)
    d = link["divergences"][0]
    assert (d["sample_id"], d["field"], d["message"]) == ("t-0", "sample_id",
                                                          "sample not in rollout bundle r-7 (rollout-7)")


def test_two_rollout_bundles_of_one_rollout_leave_the_link_unchecked_and_say_so(tmp_path):
    _pair(tmp_path)
    parts = synthetic_parts(samples=SAMPLES, tokens=TOKENS, kl_coef=0.0, anchor=None, stages=ROLLOUT_STAGES,
                            bundle_id="r-7-again")
    write_bundle(tmp_path / "rollout-7-again", *parts)
    result = scan(discover(tmp_path), jobs=1)
    step = next(r for r in result.rows if r.target.relpath == "step-7-0")
    assert step.status == "pass" and step.link.status == "skipped"
    assert step.link.message == "2 rollout-level bundles of rollout 7: rollout-7, rollout-7-again"


def _train(capture_dir: Path, *flags: str) -> None:
    env = dict(os.environ, RELAX_REPLAY_CAPTURE="1", RELAX_REPLAY_CAPTURE_DIR=str(capture_dir))
    # 2 rollouts of 2 prompts × 2 samples, 2 steps each: the smallest run with a step 1:0 and a control step after it
    proc = subprocess.run([sys.executable, str(TRAINER), "--rollouts", "2", "--prompts-per-rollout", "2",
                           "--n-samples", "2", "--consumer-batch", "4", "--micro-batch", "2", "--quiet", *flags],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _scan_json(directory: Path) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "replay_lib", "scan", str(directory), "--jobs", "2",
                           "--format", "json"], capture_output=True, text=True, timeout=300)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.slow
def test_the_trainers_stale_advantages_bug_is_found_by_link_and_only_by_link(tmp_path):
    """examples/grpo_trainer.py --stale-advantages-bug: step 1:0 trains on rollout 0's per-sample rewards
    (a stale cache). GRPO's advantage of every token of a sample is its normalized reward, so the token the
    link names must show rollout 1's reward of s-0 as expected and rollout 0's as actual."""
    _train(tmp_path / "bug", "--stale-advantages-bug")
    code, doc = _scan_json(tmp_path / "bug")
    assert code == 1
    # the other steps are the control: the trainer's own hand-over links clean
    assert [(l["anchor"], l["status"]) for l in doc["links"]] == [
        ("0:0", "pass"), ("0:1", "pass"), ("1:0", "diverged"), ("1:1", "pass")]
    assert [(b["path"], b["status"], b["first_stage"]) for b in doc["bundles"]] == [
        ("rollout-0", "pass", None), ("step-0-0", "pass", None), ("step-0-1", "pass", None),
        ("rollout-1", "pass", None), ("step-1-0", "diverged", "link"), ("step-1-1", "pass", None)]
    first = doc["summary"]["first_bad"]
    assert (first["anchor"], first["path"], first["stage"]) == ("1:0", "step-1-0", "link")
    d = doc["bundles"][4]["report"]["first_divergence"]
    reward = {r: json.loads((tmp_path / "bug" / f"rollout-{r}" / "index.json").read_text())["samples"][0]
              for r in (0, 1)}
    assert reward[0]["sample_id"] == reward[1]["sample_id"] == "s-0"
    assert reward[0]["reward"] != reward[1]["reward"]
    assert (d["stage"], d["field"], d["sample_id"], d["token_offset"]) == ("link", "advantages", "s-0", 0)
    assert (d["expected"], d["actual"]) == (reward[1]["reward"], reward[0]["reward"])


def test_stage_link_alone_and_stages_without_it(tmp_path):
    """``--stage link`` checks the links and replays no stage of the bundles; ``--stage reward.raw``
    replays that stage where a bundle declares it and leaves link out."""
    def edit(payloads):
        payloads["old_log_probs"] = payloads["old_log_probs"].clone()
        payloads["old_log_probs"][19] = -1.25

    _pair(tmp_path, rollout_edit=edit)
    targets = discover(tmp_path)
    partners = link_partners(targets)
    step = next(t for t in targets if t.relpath == "step-7-0")
    only_link = check_target(step, ScanOptions(stages=("link",)), partners[step.path])
    ran = [s["stage"] for s in only_link.report["stages"] if s["status"] != "skipped"]
    assert (only_link.status, only_link.first_stage, ran) == ("diverged", "link", ["link"])
    no_link = check_target(step, ScanOptions(stages=("reward.raw",)), partners[step.path])
    ran = [s["stage"] for s in no_link.report["stages"] if s["status"] != "skipped"]
    assert (no_link.status, no_link.link, ran) == ("pass", None, ["sample", "reward.raw"])  # and what it needs
