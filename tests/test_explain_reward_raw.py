"""``reward.raw`` explained (``replay_lib.explain.reward_raw``) and its why strip (``explain.inputs``): a trainer
that normalizes each reward function's scores over the whole batch before its group normalization (TRL's
``--bug batch-normalized-rewards`` class). The bundle comes from the independent producer of
``tests/producers``; the two reward functions, their batch normalization and the weighted sums are written out
in NumPy here. The recorded ``raw_rewards`` are the weighted sum of the scores as returned, the samples'
``raw_reward`` the weighted sum of the normalized columns (what the trainer then normalized per group)."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from producers import Config, Size, produce_parts, write_parts  # noqa: E402
from replay_lib.bundle import open_bundle  # noqa: E402
from replay_lib.bundle.schema import StageId, stage_contracts  # noqa: E402
from replay_lib.explain.inputs import element_inputs  # noqa: E402
from replay_lib.run.runner import replay  # noqa: E402
from replay_lib.stages import StageContext  # noqa: E402

ROLLOUT = (StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS)
WEIGHTS = [1.0, 0.5]


def bundle(tmp_path: Path, normalized: bool = True) -> Path:
    parts = produce_parts("float64", 1, Size(16, 64, 4), Config(), bundle_id="trl-like")
    rng = np.random.default_rng(7)
    scores = np.stack([rng.integers(0, 4, 16).astype(np.float64), rng.normal(1.0, 2.0, 16)], 1)
    columns = (scores - scores.mean(0) * normalized) / (scores.std(0, ddof=1) + 1e-6)
    columns = columns.astype(np.float32)  # a float32 trainer's columns
    returned = scores @ np.array(WEIGHTS)
    normalized_sum = (columns.astype(np.float64) @ np.array(WEIGHTS)).astype(np.float32)
    samples = [msgspec.structs.replace(s, raw_reward=float(r)) for s, r in zip(parts.index.samples, normalized_sum)]
    parts.index = msgspec.structs.replace(parts.index, samples=samples)
    groups = np.array([s.group_index for s in samples])
    rewards = np.empty(16)
    for g in np.unique(groups):  # the trainer's group normalization of what it was given: right
        r = normalized_sum[groups == g].astype(np.float64)
        rewards[groups == g] = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    parts.index = msgspec.structs.replace(parts.index, samples=[
        msgspec.structs.replace(s, reward=float(np.float32(x))) for s, x in zip(parts.index.samples, rewards)])
    parts.expected = {"reward.raw": {"raw_rewards": returned.tolist(), "reward_weights": WEIGHTS,
                                     "rewards_per_func": columns.reshape(-1).astype(np.float64).tolist()},
                      "reward.post_process": {"rewards": [float(np.float32(x)) for x in rewards]}}
    parts.manifest = msgspec.structs.replace(parts.manifest, stage_contracts=stage_contracts(ROLLOUT))
    return write_parts(parts, tmp_path / "trl-like"), scores


def test_batch_normalized_scores_are_the_likely_cause_of_reward_raw(tmp_path):
    path, scores = bundle(tmp_path)
    report = replay(path)
    assert report.first_divergent_stage == "reward.raw"
    assert report.stage("reward.post_process").status == "pass"  # the group normalization of what it got
    [e] = report.explanations
    assert (e.stage, e.hypothesis, e.matched, e.of, e.unit) == ("reward.raw", "reward.raw_batch_normalized", 16, 16,
                                                               "samples")
    # the fitted scales are each function's weight × its scores' std (NumPy, unbiased), the offset Σ w·mean
    std = scores.std(0, ddof=1)
    scales = ", ".join(f"{w * (s + 1e-6):.4g}" for w, s in zip(WEIGHTS, std))
    offset = float(scores.mean(0) @ np.array(WEIGHTS))
    assert e.detail == ("the rewards the trainer normalized are each of the 2 reward functions' scores normalized "
                        "over the whole batch of 16 samples ((s − mean)/std) before its group normalization; the "
                        f"recorded raw_rewards (the scores as returned) are their affine image (weight·std {scales}; "
                        f"offset {offset:.4g})")


def test_columns_that_are_not_standardized_are_no_cause(tmp_path):
    """Columns only scaled, not centered (mean ≠ 0): an affine image still, but not a batch normalization — no
    hypothesis."""
    path, _ = bundle(tmp_path, normalized=False)
    report = replay(path)
    assert report.first_divergent_stage == "reward.raw"
    assert report.explanations == []


def test_the_why_strip_of_a_raw_reward_compares_two_recorded_values(tmp_path):
    path, scores = bundle(tmp_path)
    reader = open_bundle(path).shards[0]
    ctx = StageContext(reader=reader, indices=list(range(16)), partial=False)
    lines = element_inputs(ctx, "raw_reward", 0).lines()
    s0 = reader.index.samples[0].raw_reward
    assert lines[0].startswith(f"the trainer normalized raw_reward ")
    assert "(samples[].raw_reward); the reward functions returned " in lines[0]
    assert lines[0].endswith("(expected.json reward.raw.raw_rewards) — both recorded, nothing recomputed")
    assert "normalized: " not in lines[0]  # not the group normalization, which is another stage's
    assert lines[1].startswith("per function [") and lines[1].endswith("weights [1.0, 0.5]")
    assert f"{s0:.8g}"[:6] in lines[0]
