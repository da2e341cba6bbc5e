"""Selection (--sample/--group/--batch, expanded to whole semantic groups, failing closed), the --step /
--rollout anchors, and capture directories holding several bundles."""

from __future__ import annotations

import json
import os
import subprocess

import msgspec
import pytest

from replay_lib.demo import ROLLOUT_STAGES, synthetic_parts, write_bundle
from replay_lib.errors import SelectionError
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import ActorStepId
from replay_lib.bundle.selection import Selection

PARTIAL = "cohort-level stage skipped under partial selection"


def ids(*numbers) -> list[str]:
    return [f"s-{i}" for i in numbers]


@pytest.fixture(scope="module")
def sixteen(tmp_path_factory):
    """16 samples × 3 tokens: groups g-0…g-3 of 4; micro-batches mb-0000 = s-0…s-7, mb-0001 = s-8…s-15.
    s-13's KL token 1 is corrupted (global token 13·3 + 1)."""
    manifest, index, expected, payloads = synthetic_parts(samples=16, tokens=3, group_size=4)
    payloads["kl"][13 * 3 + 1] += 0.5
    return write_bundle(tmp_path_factory.mktemp("sel") / "sixteen", manifest, index, expected, payloads)


def json_report(cli, *args):
    code, out, err = cli("replay", *args, "--format", "json")
    assert err == "", err
    return code, json.loads(out)


def test_sample_expands_to_its_whole_group_and_skips_the_loss(cli, sixteen):
    code, doc = json_report(cli, sixteen, "--sample", "s-3")
    assert code == 0
    assert doc["selected_samples"] == ids(0, 1, 2, 3)
    stages = {s["stage"]: s for s in doc["stages"]}
    assert (stages["loss.policy"]["status"], stages["loss.policy"]["reason"]) == ("skipped", PARTIAL)
    assert stages["reward.post_process"]["status"] == "pass"
    assert stages["reward.post_process"]["reason"] == "4 sample(s) in 1 group(s) compared"
    assert stages["advantage.kl"]["reason"].startswith("12 token(s) compared")


def test_group_selection(sixteen):
    report = replay(sixteen, selection=Selection(groups=("g-2",)))
    assert report.selected_samples == ids(8, 9, 10, 11)
    assert report.passed and report.stage("loss.policy").reason == PARTIAL


def test_batch_selection_finds_the_fault_with_its_offset_inside_the_sample(sixteen):
    report = replay(sixteen, selection=Selection(batches=("mb-0001",)))
    assert report.selected_samples == ids(*range(8, 16))
    assert report.first_divergent_stage == "advantage.kl"
    d = report.first_divergence
    assert (d.sample_id, d.group_index, d.token_offset) == ("s-13", 3, 1)
    # the same divergence as in the full replay
    full = replay(sixteen)
    assert full.selected_samples is None
    assert (full.first_divergence.sample_id, full.first_divergence.token_offset) == ("s-13", 1)
    assert full.first_divergence.expected == d.expected and full.first_divergence.actual == d.actual


def test_selection_outside_the_fault_passes(cli, sixteen):
    assert cli("replay", sixteen)[0] == 1
    code, out, _ = cli("replay", sixteen, "--batch", "mb-0000")
    assert code == 0
    assert f"[skipped] loss.policy — {PARTIAL}" in out.splitlines()


def test_a_cohort_level_stage_asked_for_by_name_under_a_selection_is_refused(cli, sixteen):
    """--sample with --stage loss.policy: the stage cannot run on part of the step, and a report that skipped the one
    stage asked for and exited 0 ("no divergence") read as a pass. Exit 4, one line; with the per-sample stages it
    needs (--stage advantage.kl) the selection still replays."""
    code, out, err = cli("replay", sixteen, "--sample", "s-0", "--stage", "loss.policy")
    assert (code, out) == (4, "")
    assert err == ("trajectory-replay: error: stage loss.policy is cohort-level: it is not replayed under a partial "
                   "selection (--sample/--group/--batch); drop the selection to replay it\n")
    assert cli("replay", sixteen, "--sample", "s-0", "--stage", "advantage.kl")[0] == 0
    assert cli("replay", sixteen, "--stage", "loss.policy")[0] in (0, 1)  # the whole step: it runs


def test_combined_selections_union_their_groups(sixteen):
    report = replay(sixteen, selection=Selection(samples=("s-0",), groups=("g-3",)))
    assert report.selected_samples == ids(0, 1, 2, 3, 12, 13, 14, 15)
    assert report.first_divergence.sample_id == "s-13"
    report = replay(sixteen, selection=Selection(samples=("s-9", "s-1"), groups=("1",)))
    assert report.selected_samples == ids(*range(0, 12))  # group 0 (s-1), 1 (g-1 as a bare number), 2 (s-9)


def test_selection_covering_every_group_is_not_partial(sixteen):
    report = replay(sixteen, selection=Selection(batches=("mb-0000", "mb-0001")))
    assert report.selected_samples is None
    assert report.stage("loss.policy").status == "pass"


def test_batch_that_splits_a_group_expands_beyond_the_batch(tmp_path):
    # groups of 3: mb-0000 = s-0…s-7 covers groups 0, 1 and two thirds of group 2 → s-8 joins
    path = write_bundle(tmp_path / "b", *synthetic_parts(samples=12, tokens=2, group_size=3))
    report = replay(path, selection=Selection(batches=("mb-0000",)))
    assert report.selected_samples == ids(*range(0, 9))
    assert report.passed


# ------------------------------------------------------------------------------------ fail closed


@pytest.fixture
def ungrouped(tmp_path):
    """s-5 lost its group_index."""
    manifest, index, expected, payloads = synthetic_parts(samples=8, tokens=2, group_size=4)
    samples = list(index.samples)
    samples[5] = msgspec.structs.replace(samples[5], group_index=None)
    return write_bundle(tmp_path / "ungrouped", manifest, msgspec.structs.replace(index, samples=samples), expected,
                        payloads)


@pytest.mark.parametrize("args", [("--sample", "s-5"), ("--batch", "mb-0000"), ("--sample", "s-0", "--sample", "s-5")])
def test_sample_without_group_index_fails_closed(cli, ungrouped, args):
    code, out, err = cli("replay", ungrouped, *args)
    assert (code, out) == (3, "")
    assert err == (f"trajectory-replay: error: {ungrouped}: $.samples[5].group_index: sample 's-5' has no semantic "
                   f"group; refusing to infer one (selection fails closed)\n")


def test_grouped_samples_of_that_bundle_still_select(ungrouped):
    report = replay(ungrouped, selection=Selection(samples=("s-1",)))
    assert report.selected_samples == ids(0, 1, 2, 3) and report.passed


@pytest.mark.parametrize("args,message", [
    (("--sample", "s-99"), "--sample s-99: no such sample in the bundle"),
    (("--group", "g-9"), "--group g-9: no sample belongs to semantic group 9"),
    (("--batch", "mb-0042"), "--batch mb-0042: empty or unknown micro-batch (no sample has micro_batch_id='mb-0042')"),
    (("--group", "banana"), "--group expects a semantic group like g-1 (or 1), got 'banana'"),
    (("--sample", "s-0", "--sample", "s-99"), "--sample s-99: no such sample in the bundle"),
])
def test_unknown_ids_and_empty_batches_exit_3(cli, sixteen, args, message):
    code, out, err = cli("replay", sixteen, *args)
    assert (code, out) == (3, "")
    assert err.count("\n") == 1 and message in err


def test_selection_error_class_from_the_library(sixteen):
    with pytest.raises(SelectionError, match=r"--batch mb-9: empty or unknown micro-batch"):
        replay(sixteen, selection=Selection(batches=("mb-9",)))


# ------------------------------------------------------------------------------------ --step / --rollout


@pytest.fixture(scope="module")
def anchored(tmp_path_factory):
    root = tmp_path_factory.mktemp("anchors")
    step = write_bundle(root / "step", *synthetic_parts(samples=4, tokens=2, bundle_id="step"))  # 7:0
    rollout = write_bundle(root / "rollout", *synthetic_parts(samples=4, tokens=2, bundle_id="rollout", anchor=None,
                                                              stages=ROLLOUT_STAGES))  # rollout 7
    return step, rollout


def test_matching_anchors_replay(cli, anchored):
    step, rollout = anchored
    assert cli("replay", step, "--step", "7:0")[0] == 0
    assert cli("replay", rollout, "--rollout", "7")[0] == 0


@pytest.mark.parametrize("which,args,code,message", [
    (0, ("--step", "7:1"), 3, "--step 7:1 does not match the bundle's actor_step_id 7:0"),
    (0, ("--rollout", "7"), 3, "--rollout 7 given but the bundle is step-level (actor_step_id=7:0); use --step"),
    (1, ("--rollout", "8"), 3, "--rollout 8 does not match the bundle's rollout_id 7"),
    (1, ("--step", "7:0"), 3, "--step 7:0 given but the bundle is rollout-level (rollout_id=7); use --rollout"),
    (0, ("--step", "7:0", "--rollout", "7"), 2, "--step and --rollout are mutually exclusive"),
    (1, ("--step", "7:0", "--rollout", "7"), 2, "--step and --rollout are mutually exclusive"),
    (0, ("--step", "7"), 2, "--step expects ROLLOUT_ID:STEP_ID (e.g. 120:0), got '7'"),
    (1, ("--rollout", "x"), 2, "--rollout expects an integer rollout id, got 'x'"),
])
def test_anchor_mismatches_are_clear_errors(cli, anchored, which, args, code, message):
    got, out, err = cli("replay", anchored[which], *args)
    assert (got, out) == (code, "")
    assert err.count("\n") == 1 and message in err


# ------------------------------------------------------------------------------------ capture directories


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    write_bundle(root / "a", *synthetic_parts(samples=4, tokens=2, bundle_id="a"))
    write_bundle(root / "b", *synthetic_parts(samples=4, tokens=2, bundle_id="b", anchor=ActorStepId(rollout_id=7, step_id=1)))
    write_bundle(root / "c", *synthetic_parts(samples=4, tokens=2, bundle_id="c", anchor=None, stages=ROLLOUT_STAGES))
    return root


CANDIDATES = "candidates: a (step 7:0); b (step 7:1); c (rollout 7)"


def test_ambiguous_capture_directory_lists_the_candidates(capture):
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    proc = subprocess.run(["trajectory-replay", "replay", str(capture)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert (proc.returncode, proc.stdout) == (3, "")
    assert proc.stderr == (f"trajectory-replay: error: {capture}: ambiguous capture directory with 3 bundles "
                           f"(pass --step R:S or --rollout R; or check them all: trajectory-replay scan); "
                           f"{CANDIDATES}\n")


@pytest.mark.parametrize("args,bundle_id", [(("--step", "7:1"), "b"), (("--step", "7:0"), "a"), (("--rollout", "7"), "c")])
def test_anchor_picks_one_bundle_of_a_capture_directory(cli, capture, args, bundle_id):
    code, doc = json_report(cli, capture, *args)
    assert code == 0 and doc["bundle_id"] == bundle_id


def test_anchor_matching_no_bundle_lists_the_candidates(cli, capture):
    code, out, err = cli("replay", capture, "--step", "9:9")
    assert (code, out) == (3, "")
    assert f"{capture}: no bundle matches --step 9:9; {CANDIDATES}" in err


def test_two_bundles_with_the_same_anchor_stay_ambiguous(cli, tmp_path):
    write_bundle(tmp_path / "x", *synthetic_parts(samples=4, tokens=2, bundle_id="x"))
    write_bundle(tmp_path / "y", *synthetic_parts(samples=4, tokens=2, bundle_id="y"))
    write_bundle(tmp_path / "z", *synthetic_parts(samples=4, tokens=2, bundle_id="z", anchor=None, stages=ROLLOUT_STAGES))
    code, _, err = cli("replay", tmp_path, "--step", "7:0")
    assert code == 3
    # only the bundles that match are listed, and an anchor cannot tell them apart: their paths can
    assert err.endswith(f"{tmp_path}: ambiguous capture directory with 2 bundles (all match --step 7:0; pass one "
                        "bundle's own path); candidates: x (step 7:0); y (step 7:0)\n"), err
    code, _, err = cli("replay", tmp_path)
    assert code == 3
    assert err.endswith(f"{tmp_path}: ambiguous capture directory with 3 bundles (pass --step R:S or --rollout R, "
                        "or one bundle's own path; or check them all: trajectory-replay scan); candidates: x (step "
                        "7:0); y (step 7:0); z (rollout 7)\n"), err


def test_a_negative_group_index_is_labelled_and_selected_as_one():
    """The schema allows a negative ``group_index``; it reads ``g(-1)`` (it once read ``g--1``) and ``--group``
    takes what the label says, or the bare number."""
    from replay_lib.bundle.selection import group_label, parse_group

    assert [group_label(g) for g in (None, 0, 7, -1)] == ["-", "g-0", "g-7", "g(-1)"]
    assert [parse_group(t) for t in ("g-7", "7", "g(-1)", "-1", " g-0 ")] == [7, 7, -1, -1, 0]
    for bad in ("g--1", "g-", "g(1)", "x"):
        with pytest.raises(SelectionError):
            parse_group(bad)
