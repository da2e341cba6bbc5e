"""Stage ``logprob.mismatch`` against verl 0.9.1's own metric code: ``verl/utils/debug/metrics.py``
``calculate_debug_metrics`` (``training/rollout_probs_diff_{max,mean,std}``) and
``verl/trainer/ppo/rollout_corr_helper.py`` ``compute_offpolicy_metrics`` (``rollout_corr/*``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from replay_lib.kernels.mismatch import VERL_DEBUG, VERL_ROLLOUT_CORR, mismatch_metrics

from .conftest import import_verl

import_verl()

from producers.mismatch import make_logprobs, produce_mismatch_bundle, verl_metrics  # noqa: E402

KINDS = ("exact", "fp8_lattice", "flat", "first_token", "bf16", "one_bad")


@pytest.mark.parametrize("kind", KINDS)
def test_float64_formulas_are_verls(kind):
    data = make_logprobs(11, 6, 48, kind)
    wide = {k: (v.astype(np.float64) if k in ("old", "rollout") else v) for k, v in data.items()}
    theirs = verl_metrics(wide)
    seg = torch.repeat_interleave(torch.arange(6), torch.from_numpy(data["lengths"]))
    ours = mismatch_metrics(torch.from_numpy(wide["rollout"]), torch.from_numpy(wide["old"]),
                            torch.from_numpy(data["mask"]), seg, 6)
    assert set(theirs) == set(VERL_DEBUG) | set(VERL_ROLLOUT_CORR)
    for k, v in theirs.items():
        assert ours[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k


@pytest.mark.parametrize("kind", KINDS)
def test_recorded_float32_metrics_pass(cli, tmp_path, kind):
    data = make_logprobs(12, 16, 256, kind)
    path = produce_mismatch_bundle(tmp_path / kind, data, expected=verl_metrics(data))
    code, out, err = cli("replay", path, "--format", "json")
    stage = next(s for s in json.loads(out)["stages"] if s["stage"] == "logprob.mismatch")
    assert (code, stage["status"]) == (0, "pass"), stage["reason"]
    assert stage["reason"].endswith(f"; {len(VERL_DEBUG) + len(VERL_ROLLOUT_CORR)} recorded metric(s) compared")


def test_metrics_of_another_batch_diverge(cli, tmp_path):
    data = make_logprobs(13, 16, 256, "fp8_lattice")
    other = dict(data, rollout=data["rollout"].copy())
    other["rollout"][data["offsets"][4] + 2] += np.float32(0.125)  # the engine's value of one token differs
    other["mask"] = data["mask"].copy()
    other["mask"][data["offsets"][4] + 2] = 1
    data["mask"] = other["mask"]
    path = produce_mismatch_bundle(tmp_path / "b", data, expected=verl_metrics(other))
    code, out, err = cli("replay", path, "--format", "json")
    stage = next(s for s in json.loads(out)["stages"] if s["stage"] == "logprob.mismatch")
    assert code == 1
    assert stage["reason"].startswith("mismatch metric(s) differ: ")
    assert "rollout_corr/kl," in stage["reason"]
