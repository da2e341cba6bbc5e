"""Policy-loss families (``RecomputeConfig.policy_loss``, ``kernels/families``) against an independent producer
(``producers.loss_families``, written from verl 0.9.1's and TRL 1.16's code): a legitimate float32 or bf16
producer of each family replays clean; each family's typical bug diverges at loss.policy; the kernels against
values derived by hand; an unknown family or parameter refused by name (exit 4)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from producers import Size
from producers.loss_families import CONFIGS, FAMILY_BUGS, produce_family_bundle

SIZE = Size(samples=16, tokens=256, group_size=4)


def _loss(report):
    return next(s for s in report["stages"] if s["stage"] == "loss.policy")


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_a_legitimate_producer_of_each_family_replays_clean(tmp_path, cli, precision, config):
    path = produce_family_bundle(tmp_path / "b", 0, SIZE, config, precision=precision)
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    loss = _loss(report)
    assert (code, err, loss["status"]) == (0, "", "pass"), loss
    assert loss["max_noise_ratio"] < 1.0


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_each_family_bug_is_the_first_divergence(tmp_path, cli, config):
    bug = FAMILY_BUGS[config.loss]
    path = produce_family_bundle(tmp_path / "b", 3, SIZE, config, bug=bug)
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    assert code == 1, _loss(report)
    assert report["first_divergent_stage"] == "loss.policy"
    assert report["first_divergence"]["field"] in {"pg_loss", "loss"}, report["first_divergence"]
