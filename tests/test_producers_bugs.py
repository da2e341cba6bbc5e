"""Each bug class, injected into a clean independent producer, is reported at the stage that is wrong
(SPEC §4 teacher forcing, §5.1: a divergence is what floating-point noise cannot explain).

The bundles are small (16 × 256 tokens, binary rewards, std normalization, k3 KL at 0.05), where every bug's
signal is orders of magnitude above a legitimate producer's rounding. Each bug runs on every family whose
declared precision leaves that signal visible: the bf16 families declare ``compute: bfloat16`` for their
per-token values, which licenses ~2⁻⁸ relative noise per token, so the loss bugs (a few 1e-2 on the
scalars at this size) are asserted on the float32/float64 families only (``producers.bugs.visible``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from producers import BUGS, FAMILIES, Config, Size, bug_config, family, produce, produce_parts
from producers.bugs import visible

SIZE = Size(16, 256)
SEED = 3
BASE = Config(rewards="binary", std_normalization=True, kl_type="k3", kl_coef=0.05)
CASES = [pytest.param(bug, name, id=f"{bug}-{name}") for bug in BUGS for name in FAMILIES if visible(bug, family(name))]
STAGE_ORDER = ("sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate", "loss.policy")


@pytest.mark.parametrize("bug,name", CASES)
def test_injected_bug_is_reported_at_its_stage(tmp_path, cli, bug, name):
    stage, what = BUGS[bug]
    bundle = produce(tmp_path / "b", name, SEED, SIZE, bug_config(bug, BASE), bug=bug)
    code, out, err = cli("replay", bundle, "--format", "json")
    assert "Traceback" not in err
    assert code == 1, f"{what}: {out}"
    report = json.loads(out)
    assert report["first_divergent_stage"] == stage, what
    status = {s["stage"]: s["status"] for s in report["stages"]}
    assert [s for s in STAGE_ORDER[:STAGE_ORDER.index(stage)] if status[s] != "pass"] == []
    assert report["first_divergence"]["stage"] == stage


# Bugs that change what each sample's loss terms sum (the token-mean bug changes only how they are combined).
SAMPLE_LOSS_BUGS = ("clip_high_both", "mask_shift")


@pytest.mark.parametrize("bug,name", [pytest.param(bug, name, id=f"{bug}-{name}") for bug in SAMPLE_LOSS_BUGS
                                      for name in FAMILIES if visible(bug, family(name), per_sample=True)])
def test_loss_bug_is_located_to_a_sample_by_the_per_sample_terms(tmp_path, cli, bug, name):
    """With ``$.loss.policy.per_sample`` recorded, a loss bug is reported at loss.policy on a sample (the
    terms are compared first, SPEC §4), not only as a scalar."""
    bundle = produce(tmp_path / "b", name, SEED, SIZE, bug_config(bug, BASE), bug=bug, per_sample=True)
    code, out, err = cli("replay", bundle, "--format", "json")
    assert "Traceback" not in err
    assert code == 1, out
    report = json.loads(out)
    assert report["first_divergent_stage"] == "loss.policy"
    assert report["first_divergence"]["sample_id"] is not None, report["first_divergence"]


@pytest.mark.parametrize("bug", list(BUGS))
def test_injected_bug_changes_what_its_stage_records(bug):
    """The bug is really there: the buggy producer records something else than the clean one at the stage
    the replay must name, and the same as the clean one upstream of it."""
    stage, _ = BUGS[bug]
    config = bug_config(bug, BASE)
    clean = produce_parts("torch_sum", SEED, SIZE, config)
    buggy = produce_parts("torch_sum", SEED, SIZE, config, bug=bug)
    recorded = {
        "reward.post_process": lambda p: np.asarray(p.expected["reward.post_process"]["rewards"]),
        "advantage.kl": lambda p: p.payloads["kl"].numpy(),
        "advantage.estimate": lambda p: p.payloads["advantages"].numpy(),
        "loss.policy": lambda p: np.asarray([p.expected["loss.policy"][f] for f in sorted(p.expected["loss.policy"])]),
    }
    assert not np.array_equal(recorded[stage](clean), recorded[stage](buggy))
    for upstream in STAGE_ORDER[2:STAGE_ORDER.index(stage)]:
        if upstream in recorded:
            assert np.array_equal(recorded[upstream](clean), recorded[upstream](buggy)), upstream
    assert clean.expected["reward.raw"] == buggy.expected["reward.raw"]


def test_a_bug_that_needs_another_config_is_refused():
    with pytest.raises(ValueError, match=r"bug 'k1_for_k3' needs another config"):
        produce_parts("numpy", SEED, SIZE, Config(kl_type="k1"), bug="k1_for_k3")
    with pytest.raises(ValueError, match=r"unknown bug 'off_by_two'"):
        produce_parts("numpy", SEED, SIZE, BASE, bug="off_by_two")
