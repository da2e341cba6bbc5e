"""The loss families of issue 34 against an independent producer (``producers.loss_families_b``): each replays clean
from a float32 and a bf16 producer, and each family's typical bug is the first divergence, at loss.policy."""

from __future__ import annotations

import json

import pytest

from producers.inputs import Size
from producers.loss_families_b import FAMILIES, FAMILY_BUGS, produce_family_bundle

SIZE = Size(samples=16, tokens=256, group_size=4)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_legitimate_producer_replays_clean(tmp_path, cli, family, precision):
    path = produce_family_bundle(tmp_path / "b", family, 3, SIZE, precision=precision)
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    loss = next(s for s in report["stages"] if s["stage"] == "loss.policy")
    assert (code, err, loss["status"]) == (0, "", "pass"), loss


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_bug_is_the_first_divergence(tmp_path, cli, family):
    path = produce_family_bundle(tmp_path / "b", family, 5, SIZE, bug=FAMILY_BUGS[family])
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy"), report["stages"]
