"""The debugger shows the train/rollout correction per sample (stage logprob.mismatch): the raw, pre-clamp
importance weight beside the applied one, and the share of each sample's loss tokens the correction truncated or
masked — hand-derived on a two-sample bundle."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replay_lib.bundle import open_bundle
from replay_lib.bundle.schema import RecomputeConfig
from replay_lib.run.runner import replay_run
from replay_tui.model import build_model

from producers.mismatch import produce_mismatch_bundle


def _data():
    # sample 0: old − rollout = ln 3, 0 (raw ratios 3, 1); sample 1: ln 0.25, ln 0.5, 0 (0.25, 0.5, 1)
    old = np.log(np.array([0.3, 0.5, 0.1, 0.2, 0.4], dtype=np.float64))
    diff = np.log(np.array([3.0, 1.0, 0.25, 0.5, 1.0]))
    rollout = old - diff
    return dict(lengths=np.array([2, 3]), offsets=np.array([0, 2]), mask=np.ones(5, dtype=np.int64),
                old=old.astype(np.float32), rollout=rollout.astype(np.float32))


@pytest.mark.parametrize("mode, low, high, applied, changed", [
    ("truncate", None, 2.0, [(2.0 + 1.0) / 2, (0.25 + 0.5 + 1.0) / 3], [0.5, 0.0]),  # TIS cap 2
    ("mask", 0.4, 2.0, [(0.0 + 1.0) / 2, (0.0 + 0.5 + 1.0) / 3], [0.5, 1 / 3]),  # IcePop [0.4, 2]
])
def test_token_weights_raw_and_applied_per_sample(tmp_path, mode, low, high, applied, changed):
    path = produce_mismatch_bundle(tmp_path / mode, _data(), config=RecomputeConfig(
        is_level="token", is_mode=mode, is_low=low, is_high=high))
    bundles = open_bundle(path)
    report, contexts = replay_run(bundles)
    model = build_model(bundles, report, contexts=contexts)
    assert report.passed and {"is_weight", "is_changed_fraction"} <= set(model.fields)
    shard = model.shards[0]
    assert not shard.ensure("rollout_log_probs")  # not judged bitwise: absent, and the weights still come
    assert shard.ensure("is_weight") and shard.ensure("is_changed_fraction")
    raw, got = shard.values["is_weight"]
    assert raw.tolist() == pytest.approx([(3.0 + 1.0) / 2, (0.25 + 0.5 + 1.0) / 3], rel=1e-6)
    assert got.tolist() == pytest.approx(applied, rel=1e-6)
    assert shard.values["is_changed_fraction"][1].tolist() == pytest.approx(changed)
    assert not shard.bad["is_weight"].any()  # shown, never a mismatch


def test_sequence_weight_per_sample(tmp_path):
    path = produce_mismatch_bundle(tmp_path / "seq", _data(), config=RecomputeConfig(
        is_level="sequence", is_mode="mask", is_high=2.5))
    bundles = open_bundle(path)
    report, contexts = replay_run(bundles)
    shard = build_model(bundles, report, contexts=contexts).shards[0]
    assert shard.ensure("is_weight") and shard.ensure("is_changed_fraction")
    raw, got = shard.values["is_weight"]
    assert raw.tolist() == pytest.approx([3.0, 0.125], rel=1e-6)
    assert got.tolist() == pytest.approx([0.0, 0.125], rel=1e-6)  # 3 > 2.5: masked
    assert shard.values["is_changed_fraction"][1].tolist() == [1.0, 0.0]
    assert math.isclose(report.stage("logprob.mismatch").mismatch["metrics"]["sampling/importance_sampling_ratio/max"],
                        0.125, rel_tol=1e-6)
