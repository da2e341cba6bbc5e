"""Capture configuration from the environment and ``maybe_enable_for_actor`` (last pipeline stage only)."""

from __future__ import annotations

import sys
import subprocess
import warnings

import pytest

from capture import (
    CaptureDisabledWarning,
    DisabledCapture,
    ReplayCapture,
    config_from_env,
    maybe_enable_for_actor,
)
from capture_helpers import ROOT, subprocess_env
from replay_lib.bundle.schema import RecomputeConfig

CFG = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2)


def _enable(env, **ranks):
    return maybe_enable_for_actor(CFG, env=env, register_atexit=False, **ranks)


def test_off_by_default(tmp_path):
    assert config_from_env({}).enabled is False
    cap = _enable({"RELAX_REPLAY_CAPTURE_DIR": str(tmp_path)})
    assert isinstance(cap, DisabledCapture)
    assert (cap.enabled, cap.wants_rollout(0), cap.wants_step(0, 0)) == (False, False, False)
    assert cap.capture_rollout(0, sample_ids=["s-0"]) is False
    step = cap.begin_step(0, 0)
    assert step.add_micro_batch(sample_ids=["s-0"]) is False and step.finish({"loss": 0.0}) is False


@pytest.mark.parametrize("value", ["0", "", "off", "false"])
def test_explicit_off_values(tmp_path, value):
    env = {"RELAX_REPLAY_CAPTURE": value, "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path)}
    assert config_from_env(env).enabled is False


def test_on_without_filters_captures_everything(tmp_path):
    cfg = config_from_env({"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path)})
    assert cfg.enabled and cfg.directory == tmp_path
    assert cfg.steps is None and cfg.rollouts is None
    assert cfg.wants_step(7, 3) and cfg.wants_rollout(12)


def test_filters_select_exactly_the_listed_steps_and_rollouts(tmp_path):
    cfg = config_from_env({
        "RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path),
        "RELAX_REPLAY_CAPTURE_STEPS": "0:1, 3:0", "RELAX_REPLAY_CAPTURE_ROLLOUTS": "2,5",
    })
    assert cfg.steps == frozenset({(0, 1), (3, 0)})
    assert cfg.rollouts == frozenset({2, 5})
    assert [cfg.wants_step(r, s) for r, s in ((0, 1), (3, 0), (0, 0), (1, 0))] == [True, True, False, False]
    assert [cfg.wants_rollout(r) for r in range(6)] == [False, False, True, False, False, True]


def test_blank_filter_means_all(tmp_path):
    cfg = config_from_env({"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path),
                           "RELAX_REPLAY_CAPTURE_STEPS": " ", "RELAX_REPLAY_CAPTURE_ROLLOUTS": ""})
    assert cfg.steps is None and cfg.rollouts is None


@pytest.mark.parametrize(
    "variable, value, words",
    [
        ("RELAX_REPLAY_CAPTURE_STEPS", "0:1,x:2", ["RELAX_REPLAY_CAPTURE_STEPS", "bad item 'x:2'", "ROLLOUT_ID:STEP_ID"]),
        ("RELAX_REPLAY_CAPTURE_STEPS", "3", ["RELAX_REPLAY_CAPTURE_STEPS", "bad item '3'"]),
        ("RELAX_REPLAY_CAPTURE_STEPS", "1:2:3", ["RELAX_REPLAY_CAPTURE_STEPS", "bad item '1:2:3'"]),
        ("RELAX_REPLAY_CAPTURE_STEPS", "-1:0", ["RELAX_REPLAY_CAPTURE_STEPS", "bad item '-1:0'", "non-negative"]),
        ("RELAX_REPLAY_CAPTURE_STEPS", "0:1,", ["RELAX_REPLAY_CAPTURE_STEPS", "empty item"]),
        ("RELAX_REPLAY_CAPTURE_ROLLOUTS", "2,a", ["RELAX_REPLAY_CAPTURE_ROLLOUTS", "bad item 'a'", "rollout id"]),
        ("RELAX_REPLAY_CAPTURE_ROLLOUTS", "1:2", ["RELAX_REPLAY_CAPTURE_ROLLOUTS", "bad item '1:2'"]),
        ("RELAX_REPLAY_CAPTURE", "maybe", ["RELAX_REPLAY_CAPTURE='maybe'", "expected 1 (on) or 0 (off)"]),
    ],
)
def test_malformed_value_is_a_clear_error_at_enable_time(tmp_path, variable, value, words):
    env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path), variable: value}
    with pytest.raises(ValueError) as info:
        _enable(env)
    for word in words:
        assert word in str(info.value)


def test_malformed_filter_is_refused_even_without_a_directory():
    env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_ROLLOUTS": "one"}
    with pytest.raises(ValueError, match=r"RELAX_REPLAY_CAPTURE_ROLLOUTS='one': bad item 'one'"):
        _enable(env)


def test_missing_directory_warns_once_and_stays_off():
    env = {"RELAX_REPLAY_CAPTURE": "1"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _enable(env)
        second = _enable(env)
    relevant = [w for w in caught if issubclass(w.category, CaptureDisabledWarning)]
    assert len(relevant) == 1
    assert "RELAX_REPLAY_CAPTURE_DIR is not set" in str(relevant[0].message)
    assert "stays off" in str(relevant[0].message)
    assert isinstance(first, DisabledCapture) and isinstance(second, DisabledCapture)


def test_only_the_last_pipeline_stage_captures(tmp_path):
    env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path)}
    caps = [_enable(env, pp_rank=r, pp_size=4) for r in range(4)]
    try:
        assert [c.enabled for c in caps] == [False, False, False, True]
        assert caps[0].reason == "pipeline stage 0 of 4 is not the last"
        assert isinstance(caps[3], ReplayCapture)
        assert caps[3].context.producer_rank is None  # a single producer: no rank-* shards
        assert caps[3].context.rank_sizes == {"dp": 1, "tp": 1, "pp": 4, "cp": 1}
    finally:
        caps[3].close(timeout=10)


def test_tensor_parallel_peers_do_not_duplicate_shards(tmp_path):
    env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path)}
    peer = _enable(env, tp_rank=1, tp_size=2)
    assert isinstance(peer, DisabledCapture)
    assert peer.reason == "tensor-parallel rank 1 duplicates tp_rank 0"


def test_data_parallel_producers_form_a_cohort(tmp_path):
    env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path)}
    caps = [_enable(env, dp_rank=r, dp_size=2, pp_rank=1, pp_size=2) for r in range(2)]
    try:
        assert [(c.context.producer_rank, c.context.producer_world) for c in caps] == [(0, 2), (1, 2)]
        assert caps[1].context.rank_sizes == {"dp": 2, "tp": 1, "pp": 2, "cp": 1}
    finally:
        for c in caps:
            c.close(timeout=10)


@pytest.mark.parametrize("ranks, message", [
    ({"pp_rank": 4, "pp_size": 4}, "pp_rank=4 must lie in [0, pp_size=4)"),
    ({"dp_rank": -1, "dp_size": 2}, "dp_rank=-1 must lie in [0, dp_size=2)"),
    ({"tp_rank": 0, "tp_size": 0}, "tp_rank=0 must lie in [0, tp_size=0)"),
])
def test_bad_rank_arguments_are_refused(tmp_path, ranks, message):
    with pytest.raises(ValueError) as info:
        _enable({"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path)}, **ranks)
    assert str(info.value) == message


def test_replay_capture_refuses_a_bad_redaction_rule(tmp_path):
    env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path)}
    with pytest.raises(ValueError, match=r"redaction rule for 'prompt' must be 'hash', 'drop' or 'truncate:N'"):
        _enable(env, redaction={"prompt": "keep"})


def test_capture_imports_without_ray_megatron_textual_or_a_gpu():
    code = (
        "import sys, capture, capture.actor, capture.bundles, capture.manager, capture.config;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'megatron', 'textual', 'replay_tui'));"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(CUDA_VISIBLE_DEVICES=""),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
