"""slime's MIS (``examples/train_infer_mismatch_helper/mis.py`` at 624b824a8) recomputed: the mapping of its
settings (``frameworks.slime``), the rejection chain by hand, and whole steps of the independent reference
``tests/producers/slime_mis.py`` replayed clean (their autograd gradient at ``loss.grad`` too), with one injected bug
named at ``loss.policy``."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch

from replay_lib.bundle.schema import RecomputeConfig
from replay_lib.errors import UnsupportedFrameworkConfig
from replay_lib.frameworks import from_slime
from replay_lib.kernels.mismatch import mis_chain, rejection_keep

from producers.slime_mis import STEP_ARGS, Mis, produce_slime_mis_bundle

MIS_PATH = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"


def _slime(**kw) -> RecomputeConfig:
    return from_slime({"use_tis": True, "custom_tis_function_path": MIS_PATH, **kw})


def test_mapping_of_each_mode():
    trunc = _slime(tis_level="sequence", tis_mode="truncate", tis_upper_bound=3.0)
    assert (trunc.is_level, trunc.is_mode, trunc.is_low, trunc.is_high, trunc.is_log_clamp, trunc.mis_rs) == (
        "sequence", "truncate", None, 3.0, 20.0, msgspec.UNSET)
    clip = _slime(tis_level="geometric", tis_mode="clip", tis_upper_bound=2.0)  # lower: 1/upper (mis.py:174)
    assert (clip.is_level, clip.is_mode, clip.is_low, clip.is_high) == ("geometric", "truncate", 0.5, 2.0)
    mask = _slime(tis_mode="mask", tis_lower_bound=0.8, tis_upper_bound=1.25, use_rs=True, rs_level="geometric",
                  rs_veto_threshold=1e-4)
    assert (mask.is_level, mask.is_low, mask.is_high) == ("token", None, None)
    assert mask.mis_rs == [("token", 0.8, 1.25), ("geometric", 0.8, 1.25)] and mask.mis_veto == 1e-4
    off = from_slime({"use_tis": False, "custom_tis_function_path": MIS_PATH, "tis_mode": "mask", "use_rs": True})
    assert (off.is_level, off.mis_rs) == (None, msgspec.UNSET)  # mis.py:207-209: metrics only


@pytest.mark.parametrize("kw, key, why", [
    (dict(tis_batch_normalize=True), "tis_batch_normalize", "one factor per micro-batch, not recomputed"),
    (dict(tis_mode="cap"), "tis_mode", "not one of truncate, clip, mask"),
    (dict(tis_level="batch"), "tis_level", "not one of token, sequence, geometric"),
    (dict(tis_mode="clip", tis_lower_bound=3.0, tis_upper_bound=2.0), "tis_lower_bound",
     "0 < tis_lower_bound < tis_upper_bound"),
])
def test_refused_by_name(kw, key, why):
    with pytest.raises(UnsupportedFrameworkConfig) as err:
        _slime(**kw)
    assert key in str(err.value) and why in str(err.value)


def test_rejection_chain_by_hand():
    """Two samples: [Δ = log 0.5, log 3, 0] and [log 1.1, log 0.00005]. Token [0.6, 2]: the 0.5 and 3 tokens
    out; geometric [0.9, 1.2] on sample 1: mean Δ = (log 1.1 + log 5e-5)/2 → out, sample 0's mean log(1.5)/3 in;
    veto 1e-4: sample 1's 5e-5 token drops the sample."""
    d = torch.tensor([math.log(0.5), math.log(3.0), 0.0, math.log(1.1), math.log(5e-5)], dtype=torch.float64)
    mask = torch.ones(5)
    seg = torch.tensor([0, 0, 0, 1, 1])
    keep = lambda chain: rejection_keep(d, mask, seg, 2, chain).tolist()
    assert keep(mis_chain([("token", 0.6, 2.0)], None)) == [False, False, True, True, False]
    assert keep(mis_chain([("geometric", 0.9, 1.2)], None)) == [True, True, True, False, False]
    assert keep(mis_chain([("sequence", 1.0, 2.0)], None)) == [True, True, True, False, False]
    assert keep(mis_chain([], 1e-4)) == [True, True, True, False, False]
    assert keep(mis_chain([], 1e-5)) == [True] * 5


CASES = {
    "token-truncate": Mis(tis_level="token", tis_mode="truncate"),
    "sequence-clip": Mis(tis_level="sequence", tis_mode="clip", tis_lower_bound=0.5, tis_upper_bound=2.0),
    "geometric-mask": Mis(tis_level="geometric", tis_mode="mask", tis_lower_bound=0.9, tis_upper_bound=1.1),
    "token-mask-rs-veto": Mis(tis_level="token", tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.0,
                              use_rs=True, rs_level="geometric", rs_lower_bound=0.8, rs_upper_bound=1.25,
                              rs_veto_threshold=1e-4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_slime_mis_step_replays_clean(tmp_path, cli, name):
    path = produce_slime_mis_bundle(tmp_path / name, CASES[name], from_slime({**CASES[name].args(), **STEP_ARGS}))
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    assert (code, err, report["first_divergent_stage"]) == (0, "", None), out
    assert next(s for s in report["stages"] if s["stage"] == "loss.policy")["status"] == "pass"


@pytest.mark.parametrize("name", list(CASES))
def test_slime_mis_steps_gradient_replays_clean_at_loss_grad(tmp_path, cli, name):
    """The step's gradient from torch.autograd on the reference's loss (the rejected tokens out of the numerators,
    the denominators kept): loss.grad derives the rejections (a rejected token's gradient 0) and passes."""
    path = produce_slime_mis_bundle(tmp_path / name, CASES[name], from_slime({**CASES[name].args(), **STEP_ARGS}),
                                    grad=True)
    code, out, err = cli("replay", path, "--format", "json")
    report = json.loads(out)
    stages = {s["stage"]: s for s in report["stages"]}
    assert (code, err, report["first_divergent_stage"]) == (0, "", None), stages.get("loss.grad")
    assert (stages["loss.policy"]["status"], stages["loss.grad"]["status"]) == ("pass", "pass")
    assert stages["loss.grad"]["compared"] == sum(s["response_length"] for s in json.loads(
        (path / "index.json").read_text())["samples"])


def test_the_rejections_are_not_vacuous():
    from producers.slime_mis import make_step, mis_weights

    lengths, masks, old, logp, rollout, ref, adv = make_step(3)
    for name in ("geometric-mask", "token-mask-rs-veto"):
        _, modified = mis_weights(CASES[name], old, rollout, masks)
        kept, total = sum(float(m.sum()) for m in modified), sum(float(m.sum()) for m in masks)
        assert 0 < kept < total, name


def test_rejected_tokens_leaving_the_denominators_is_named_at_loss_policy(tmp_path, cli):
    path = produce_slime_mis_bundle(tmp_path / "b", CASES["token-mask-rs-veto"],
                                    from_slime({**CASES["token-mask-rs-veto"].args(), **STEP_ARGS}), bug="denominator")
    code, out, err = cli("replay", path, "--format", "json")
    assert (code, json.loads(out)["first_divergent_stage"]) == (1, "loss.policy"), out + err


@pytest.mark.parametrize("kw, message", [
    (dict(mis_rs=[("batch", 0.5, 2.0)]), "mis_rs[0]: expected [token|sequence|geometric, low, high] with finite "
                                          "0 < low <= high, got ['batch', 0.5, 2.0]"),
    (dict(mis_rs=[("token", 2.0, 0.5)]), "mis_rs[0]: expected [token|sequence|geometric, low, high] with finite "
                                          "0 < low <= high, got ['token', 2.0, 0.5]"),
    (dict(mis_veto=-1.0), "mis_veto: expected a finite threshold > 0, got -1.0"),
])
def test_schema_checks(kw, message):
    with pytest.raises(ValueError) as err:
        RecomputeConfig(**kw)
    assert str(err.value) == message
