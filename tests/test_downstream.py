"""Under ``--chain``, a stage that fails only because an upstream stage failed is marked downstream of it
(issue 17 §4; ``replay_lib.explain.downstream``): it passes when re-judged on its recorded inputs. A stage
with a bug of its own stays a root cause, and the default (teacher-forced) mode marks nothing.

Bundles from the independent producers of ``tests/producers`` (float64 family, 16 samples in groups of 4,
901 tokens — see tests/test_explain.py), written with the real writer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from producers import Config  # noqa: E402
from replay_lib.judge.error_model import Rules  # noqa: E402
from replay_lib.run.runner import replay  # noqa: E402
from test_explain import INPUTS, STEP, _parts, f32, loss_fields, normalize, write  # noqa: E402

CHAIN = Rules(chain=True)


def statuses(report) -> dict[str, tuple[str, object]]:
    return {s.stage: (s.status, s.downstream_of) for s in report.stages if s.status != "skipped"}


def test_pr65_under_chain_marks_the_advantages_and_the_loss_downstream(tmp_path):
    """producers.bugs "pr65": only reward.post_process is wrong; the producer's advantages and loss follow its
    recorded rewards faithfully. Under --chain both consume the correct recomputed rewards, so both fail —
    and both pass on their recorded inputs: downstream of reward.post_process, which alone is explained."""
    path = write(tmp_path, _parts(bug="pr65"), STEP)
    chained = replay(path, rules=CHAIN)
    assert statuses(chained) == {
        "sample": ("pass", None), "reward.raw": ("pass", None), "reward.post_process": ("fail", None),
        "advantage.kl": ("pass", None), "advantage.estimate": ("fail", "reward.post_process"),
        "loss.policy": ("fail", "reward.post_process")}
    assert chained.first_divergent_stage == "reward.post_process"
    assert [e.stage for e in chained.explanations] == ["reward.post_process"]
    teacher_forced = replay(path)
    assert statuses(teacher_forced)["advantage.estimate"] == ("pass", None)
    assert all(s.downstream_of is None for s in teacher_forced.stages)


def test_a_second_bug_stays_a_root_cause(tmp_path):
    """Rewards normalized over the whole batch (bug 1) and advantages that negate those recorded rewards
    (bug 2), the loss faithful to the recorded advantages: advantage.estimate fails on its recorded inputs too,
    so under --chain it is a root cause of its own, explained as sign-flipped; the loss is downstream of it,
    the nearest root cause before it."""
    rewards = f32(normalize(INPUTS.raw_rewards, np.zeros(16), std=True))
    negated = -np.repeat(rewards, INPUTS.lengths)
    path = write(tmp_path, _parts(name="two"), STEP, rewards=rewards, advantages=negated,
                 loss=loss_fields(INPUTS, negated.astype(np.float32)))
    chained = replay(path, rules=CHAIN)
    assert statuses(chained)["reward.post_process"] == ("fail", None)
    assert statuses(chained)["advantage.estimate"] == ("fail", None)
    assert statuses(chained)["loss.policy"] == ("fail", "advantage.estimate")
    assert [(e.stage, e.hypothesis) for e in chained.explanations] == [
        ("reward.post_process", "reward.whole_batch"), ("advantage.estimate", "advantage.sign_flipped")]


def test_clean_chain_marks_nothing(tmp_path):
    report = replay(write(tmp_path, _parts(Config()), STEP), rules=CHAIN)
    assert report.passed and all(s.downstream_of is None for s in report.stages)


def test_text_and_json_in_a_real_process(tmp_path):
    path = write(tmp_path, _parts(bug="pr65"), STEP)
    text = subprocess.run(["trajectory-replay", "replay", str(path), "--chain"], capture_output=True, text=True,
                          timeout=120)
    assert text.returncode == 1, text.stderr
    lines = text.stdout.splitlines()
    # the last physical batch of 6 (samples 12–15, only 4 left) is the group g-3 itself, normalized right: its
    # 220 tokens agree, the other 12 samples' 681 tokens diverge
    assert [line for line in lines if line.startswith("[downstream]")] == [
        "[downstream] advantage.estimate — advantage mismatch in 681 token(s) of 12 sample(s) (downstream of "
        "reward.post_process: passes on its recorded inputs)",
        "[downstream] loss.policy — loss field mismatch: loss, pg_loss (downstream of "
        "reward.post_process: passes on its recorded inputs)"]
    js = json.loads(subprocess.run(["trajectory-replay", "replay", str(path), "--chain", "--format", "json"],
                                   capture_output=True, text=True, timeout=120).stdout)
    by_stage = {s["stage"]: s for s in js["stages"]}
    assert (by_stage["advantage.estimate"]["status"], by_stage["advantage.estimate"]["downstream_of"]) == \
        ("fail", "reward.post_process")
    assert by_stage["reward.post_process"]["downstream_of"] is None
    assert js["first_divergent_stage"] == "reward.post_process"

