"""Capture on trigger (``capture.ring``): the last N steps held in memory, persisted when a trigger fires.

Every step below is one micro-batch of two samples (lengths 3 and 2, advantages −1 and +1) with
log_probs = old_log_probs = 0: ratio 1 on every token, so the per-sample surrogate means are +1 and −1 and the
reported loss fields are all 0 — the replay recomputes exactly that. ``rollout_log_probs`` = old − delta.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from capture import CaptureConfig, ReplayCapture, maybe_enable_for_actor
from capture.ring import CaptureRing, RingConfig, ring_config_from_env, step_mismatch
from capture_helpers import ROOT, bundle_dirs, capture_env, subprocess_env
from replay_lib.bundle import BundleReader, open_bundle
from replay_lib.bundle.schema import RecomputeConfig
from replay_lib.run.runner import replay

GUARD_S = 60.0
CFG = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2, grpo_std_normalization=False,
                      kl_loss_type="k1", kl_coef=0.1, eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.0)
ZERO_FIELDS = {"loss": 0.0, "pg_loss": 0.0, "entropy_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0}
# One step's bytes in the ring: loss_mask int64 5×8 + log_probs, old, advantages, entropy, rollout float32 5×4 each
# + raw_rewards, rewards float64 2×8 each + five reported fields as float64 0-d tensors.
STEP_BYTES = 40 + 5 * 20 + 2 * 16 + 5 * 8


def _capture(directory, ring: RingConfig) -> ReplayCapture:
    return ReplayCapture(CaptureConfig(enabled=True, directory=directory), CFG, register_atexit=False, ring=ring)


def _step(cap, rollout_id, step_id, *, delta=(0.0,) * 5, loss=0.0, grad_norm=None):
    step = cap.begin_step(rollout_id, step_id)
    old = torch.zeros(5)
    assert step.add_micro_batch(
        sample_ids=[f"r{rollout_id}-s{step_id}-0", f"r{rollout_id}-s{step_id}-1"], group_index=[0, 0],
        response_lengths=[3, 2], total_lengths=[8, 7], loss_mask=torch.ones(5, dtype=torch.int64),
        log_probs=torch.zeros(5), old_log_probs=old, advantages=torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0]),
        entropy=torch.zeros(5), raw_rewards=[0.0, 1.0], rewards=[-1.0, 1.0],
        rollout_log_probs=old - torch.tensor(delta, dtype=torch.float32),
    )
    assert step.finish(dict(ZERO_FIELDS, loss=loss), grad_norm=grad_norm)


def _persisted_and_verifiable(root, names):
    assert bundle_dirs(root) == sorted(names)
    for name in names:
        open_bundle(root / name)  # sha256, sizes, schema, SPEC §11 limits
        assert (root / name / "COMPLETE").is_file()


def test_the_ring_is_off_by_default_and_its_variables_are_checked():
    assert ring_config_from_env({}).enabled is False
    assert ring_config_from_env({"RELAX_REPLAY_CAPTURE_RING": "0"}).enabled is False
    cfg = ring_config_from_env({"RELAX_REPLAY_CAPTURE_RING": "4", "RELAX_REPLAY_CAPTURE_RING_MB": "0.5",
                                "RELAX_REPLAY_CAPTURE_TRIGGER_MAX_DLOGP": "0.25",
                                "RELAX_REPLAY_CAPTURE_TRIGGER_K3": "0.001",
                                "RELAX_REPLAY_CAPTURE_TRIGGER_GRAD_SPIKE": "5"})
    assert cfg == RingConfig(steps=4, max_bytes=524288, max_dlogp=0.25, k3=0.001, grad_spike=5.0, grad_window=32)
    with pytest.raises(ValueError, match=r"^RELAX_REPLAY_CAPTURE_RING='-1': expected an integer ≥ 0$"):
        ring_config_from_env({"RELAX_REPLAY_CAPTURE_RING": "-1"})
    with pytest.raises(ValueError, match=r"^RELAX_REPLAY_CAPTURE_TRIGGER_K3='nan': expected a non-negative finite"):
        ring_config_from_env({"RELAX_REPLAY_CAPTURE_RING": "2", "RELAX_REPLAY_CAPTURE_TRIGGER_K3": "nan"})
    with pytest.raises(ValueError, match=r"^RELAX_REPLAY_CAPTURE_RING_MB='0': expected a positive finite number$"):
        ring_config_from_env({"RELAX_REPLAY_CAPTURE_RING": "2", "RELAX_REPLAY_CAPTURE_RING_MB": "0"})
    with pytest.raises(ValueError, match=r"^RELAX_REPLAY_CAPTURE_TRIGGER_GRAD_WINDOW='3': expected an integer ≥ 4$"):
        ring_config_from_env({"RELAX_REPLAY_CAPTURE_RING": "2", "RELAX_REPLAY_CAPTURE_TRIGGER_GRAD_WINDOW": "3"})


def test_step_mismatch_hand_derived():
    # d = old − rollout = [0.1, 0, −0.2, 0.5(masked)]: max |d| 0.2; k3 = mean(e^d − 1 − d) over the 3 loss tokens
    old = torch.tensor([0.0, -1.0, -1.0, 0.0])
    rollout = torch.tensor([-0.1, -1.0, -0.8, -0.5], dtype=torch.float64)
    max_d, k3, count = step_mismatch(old, rollout, torch.tensor([1, 1, 1, 0]))
    d = [0.1, 0.0, -0.2]
    assert max_d == pytest.approx(0.2, abs=1e-7)
    assert k3 == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3, abs=1e-8)
    assert count == 2
    assert step_mismatch(old, rollout, torch.zeros(4)) == (0.0, 0.0, 0)


def test_no_trigger_writes_nothing(tmp_path):
    cap = _capture(tmp_path, RingConfig(steps=3, max_dlogp=0.01, k3=0.01, grad_spike=5.0))
    for s in range(6):
        _step(cap, 0, s, delta=(0.005, 0.0, 0.0, 0.0, 0.0), grad_norm=1.0 + s / 10)
    assert cap.close(timeout=GUARD_S)
    assert (cap.stats.written, cap.stats.errors, cap.stats.abandoned) == (0, 0, 0)
    assert cap.ring.fired == [] and cap.ring.evicted == 3
    assert list(tmp_path.iterdir()) == []


def test_a_non_finite_loss_persists_exactly_the_ring(tmp_path):
    from test_capture_hooks import GROUP_NORMALIZED, _rollout_kwargs

    cap = _capture(tmp_path, RingConfig(steps=3))
    assert cap.capture_rollout(0, **_rollout_kwargs(GROUP_NORMALIZED))
    _step(cap, 0, 0)
    _step(cap, 0, 1)
    assert cap.capture_rollout(1, **_rollout_kwargs(GROUP_NORMALIZED))
    _step(cap, 1, 0)
    _step(cap, 1, 1)
    _step(cap, 1, 2, loss=math.nan)  # fires: the ring holds steps 1-0, 1-1, 1-2 and rollout 1 (0 is orphaned)
    _step(cap, 1, 3)  # after the trigger the ring starts over: held, never written
    assert cap.close(timeout=GUARD_S)
    assert cap.ring.fired == [("step-1-2", "non-finite loss (nan)")]
    assert (cap.stats.written, cap.stats.errors) == (4, 0)
    _persisted_and_verifiable(tmp_path, ["rollout-1", "step-1-0", "step-1-1", "step-1-2"])
    for name in ("rollout-1", "step-1-0", "step-1-1"):
        assert replay(tmp_path / name).exit_code == 0
    # JSON has no NaN: the non-finite reported loss is recorded as null
    assert math.isnan(BundleReader(tmp_path / "step-1-2").expected["loss.policy"]["loss"])  # written as NaN (SPEC §2.2)


def test_max_dlogp_trigger(tmp_path):
    cap = _capture(tmp_path, RingConfig(steps=2, max_dlogp=0.25))
    _step(cap, 0, 0, delta=(0.25, 0.0, 0.0, 0.0, -0.25))  # |d| = 0.25 is not above the threshold
    _step(cap, 0, 1)
    _step(cap, 0, 2, delta=(0.0, 0.0, -0.5, 0.0, 0.0))
    assert cap.close(timeout=GUARD_S)
    assert cap.ring.fired == [("step-0-2", "max |Δlogp| 0.5 > 0.25 (1 loss token(s) differ)")]
    _persisted_and_verifiable(tmp_path, ["step-0-1", "step-0-2"])
    for name in ("step-0-1", "step-0-2"):
        assert replay(tmp_path / name).exit_code == 0
    assert BundleReader(tmp_path / "step-0-2").payload("rollout_log_probs").tolist() == [0.0, 0.0, 0.5, 0.0, 0.0]


def test_k3_trigger(tmp_path):
    # d = 0.09 on every token: k3 = e^0.09 − 1.09 = 0.0041720…; d = 0.1: e^0.1 − 1.1 = 0.0051709…
    cap = _capture(tmp_path, RingConfig(steps=5, k3=0.005))
    _step(cap, 3, 0, delta=(0.09,) * 5)
    _step(cap, 3, 1, delta=(0.1,) * 5)
    assert cap.close(timeout=GUARD_S)
    assert cap.ring.fired == [("step-3-1", "mean k3 0.00517092 > 0.005")]
    _persisted_and_verifiable(tmp_path, ["step-3-0", "step-3-1"])


def test_gradient_norm_spike_trigger(tmp_path):
    cap = _capture(tmp_path, RingConfig(steps=2, grad_spike=5.0))
    _step(cap, 0, 0, grad_norm=1.0)
    _step(cap, 0, 1, grad_norm=100.0)  # only one norm before it: no running median yet
    _step(cap, 0, 2, grad_norm=torch.tensor(0.9))
    _step(cap, 0, 3, grad_norm=1.1)
    _step(cap, 0, 4, grad_norm=1.05)  # history 1, 100, 0.9, 1.1: median 1.05, 1.05 is no spike
    _step(cap, 0, 5, grad_norm=5.26)  # history 1, 100, 0.9, 1.1, 1.05: median 1.05; 5.26 > 5.25
    assert cap.close(timeout=GUARD_S)
    assert cap.ring.fired == [("step-0-5", "gradient norm 5.26 > 5 × the running median 1.05 of the last 5 step(s)")]
    _persisted_and_verifiable(tmp_path, ["step-0-4", "step-0-5"])
    assert "trigger:grad_norm" not in BundleReader(tmp_path / "step-0-5").expected["loss.policy"]


def test_the_memory_cap_evicts_the_oldest_steps(tmp_path):
    cap = _capture(tmp_path, RingConfig(steps=10, max_bytes=2 * STEP_BYTES + STEP_BYTES // 2, max_dlogp=1.0))
    _step(cap, 0, 0)
    assert cap.flush(GUARD_S)
    assert cap.ring.held_bytes == STEP_BYTES
    for s in range(1, 5):
        _step(cap, 0, s)
    assert cap.flush(GUARD_S)
    assert (cap.ring.held_steps, cap.ring.evicted) == (2, 3)
    _step(cap, 0, 5, delta=(2.0, 0.0, 0.0, 0.0, 0.0))
    assert cap.close(timeout=GUARD_S)
    _persisted_and_verifiable(tmp_path, ["step-0-4", "step-0-5"])


def test_the_ring_is_read_from_the_environment(tmp_path):
    env = capture_env(tmp_path, RELAX_REPLAY_CAPTURE_RING="2", RELAX_REPLAY_CAPTURE_TRIGGER_MAX_DLOGP="0.1")
    cap = maybe_enable_for_actor(CFG, env=env, register_atexit=False)
    try:
        assert cap.ring.config == RingConfig(steps=2, max_dlogp=0.1)
        _step(cap, 0, 0)
        _step(cap, 0, 1)
        _step(cap, 0, 2, delta=(0.0, 0.2, 0.0, 0.0, 0.0))
    finally:
        assert cap.close(timeout=GUARD_S)
    assert bundle_dirs(tmp_path) == ["step-0-1", "step-0-2"]


def test_the_ring_is_refused_for_a_cohort_of_producers(tmp_path):
    env = capture_env(tmp_path, RELAX_REPLAY_CAPTURE_RING="4")
    with pytest.raises(ValueError) as err:
        maybe_enable_for_actor(CFG, dp_rank=0, dp_size=2, env=env, register_atexit=False)
    assert str(err.value) == ("RELAX_REPLAY_CAPTURE_RING=4: capture on trigger needs a single producer, this job has "
                              "2 (dp × cp): the triggers are evaluated per rank and a cohort needs every rank's shard")
    assert list(tmp_path.iterdir()) == []  # refused before the directory lock


CRASH_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    from replay_lib.bundle import BundleWriter
    import test_capture_ring as t
    from capture.ring import RingConfig
    calls = []
    original = BundleWriter.write_payload
    def crash_in_second_bundle(self, name, tensor):
        calls.append(str(self.staging))
        if len(set(calls)) == 2 and calls.count(calls[-1]) == 2:
            os._exit(9)  # killed mid-persist: the second bundle has one payload of several in its staging
        return original(self, name, tensor)
    BundleWriter.write_payload = crash_in_second_bundle
    from pathlib import Path
    cap = t._capture(Path(sys.argv[1]), RingConfig(steps=3, max_dlogp=0.1))
    for s in range(3):
        t._step(cap, 0, s, delta=(0.0, 0.0, 0.0, 0.0, 0.5 if s == 2 else 0.0))
    cap.close(timeout=60)
    sys.exit(0)
""")


def test_a_crash_mid_persist_leaves_no_partial_bundle(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT.format(tests=str(ROOT / "tests" / "capture")))
    out = tmp_path / "capture"
    proc = subprocess.run([sys.executable, str(script), str(out)], env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    assert bundle_dirs(out) == ["step-0-0"]  # the second bundle never became visible
    _persisted_and_verifiable(out, ["step-0-0"])
    hidden = [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert len(hidden) >= 1  # the killed staging, hidden; the next job's writer removes it


def test_ring_unit_rollouts_are_kept_while_a_held_step_uses_them():
    class Item:
        def __init__(self, kind, label, meta, tensors=None):
            self.kind, self.label, self.meta, self.tensors = kind, label, meta, tensors or {}

    class Meta:
        def __init__(self, rollout_id):
            self.rollout_id = rollout_id

    ring = CaptureRing(RingConfig(steps=1))
    assert ring.take(Item("rollout", "rollout-0", Meta(0), {"x": torch.zeros(2)})) == []
    assert ring.take(Item("rollout", "rollout-1", Meta(1))) == []
    assert [e.label for e in ring._entries] == ["rollout-0", "rollout-1"]  # nothing evicted without steps


def test_the_example_trainer_persists_the_ring_on_a_gradient_norm_spike(trainer, tmp_path):
    """The real trainer (3 rollouts × 2 steps) hands clip_grad_norm_'s norm to finish(); with a spike factor of
    1e-9 every step from the 5th on (4 norms of history) is a "spike": the 5th persists the ring's 2 steps,
    the 6th (the ring empty again) itself alone, with the rollouts those steps were trained on. Every persisted bundle replays clean."""
    from capture_helpers import TINY

    argv = [a if a != "2" or TINY[i - 1] != "--rollouts" else "3" for i, a in enumerate(TINY)]
    env = capture_env(tmp_path, RELAX_REPLAY_CAPTURE_RING="2", RELAX_REPLAY_CAPTURE_TRIGGER_GRAD_SPIKE="1e-9")
    result = trainer.run(argv, env=env)
    assert result.steps == 6 and result.capture_flushed
    assert (result.capture_stats.errors, result.capture_stats.dropped, result.capture_stats.abandoned) == (0, 0, 0)
    # rollout 0 left the ring with its last step; rollout 1 stays while step 1-1 is held
    assert bundle_dirs(tmp_path) == ["rollout-1", "rollout-2", "step-1-1", "step-2-0", "step-2-1"]
    assert result.capture_stats.written == 5
    for name in bundle_dirs(tmp_path):
        assert replay(tmp_path / name).exit_code == 0, name


MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    from pathlib import Path
    from capture import CaptureConfig, ReplayCapture
    from capture.ring import RingConfig
    sys.path.insert(0, {tests!r})
    from test_capture_ring import CFG, ZERO_FIELDS
    n = 1 << 20  # tokens per step: 28 MiB held per step (int64 mask + five float32 per-token payloads)
    cap = ReplayCapture(CaptureConfig(enabled=True, directory=Path(sys.argv[1])), CFG, register_atexit=False,
                        ring=RingConfig(steps=100, max_bytes=64 << 20, max_dlogp=1.0))
    mask, zeros, adv = torch.ones(n, dtype=torch.int64), torch.zeros(n), torch.ones(n)
    cap.flush(60)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for s in range(20):
        step = cap.begin_step(0, s)
        step.add_micro_batch(sample_ids=["a", "b"], group_index=[0, 0], response_lengths=[n // 2, n // 2],
                             total_lengths=[n // 2 + 1] * 2, loss_mask=mask, log_probs=zeros, old_log_probs=zeros,
                             advantages=adv, entropy=zeros, rollout_log_probs=zeros)
        step.finish(ZERO_FIELDS)
        cap.flush(60)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(cap.ring.held_steps, cap.ring.evicted, cap.ring.held_bytes, round(grown))
    cap.close(60)
""")


def test_the_memory_cap_bounds_the_process_s_memory(tmp_path):
    # 20 steps of 28 MiB = 560 MiB without the cap; with 64 MiB the ring holds 2 steps (56 MiB). Measured: the
    # peak RSS grows by ≈ 215 MiB with the cap (the ring, the step in flight, the trigger's float64 temporaries,
    # the allocator) and ≈ 670 MiB with the cap lifted; the bound, 400 MiB, tells the two apart
    script = tmp_path / "memory.py"
    script.write_text(MEMORY_SCRIPT.format(tests=str(ROOT / "tests" / "capture")))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "capture")], env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    held, evicted, held_bytes, grown_mib = (int(x) for x in proc.stdout.split())
    assert (held, evicted, held_bytes) == (2, 18, 2 * 28 * 2**20 + 2 * 5 * 8)
    assert grown_mib <= 400, grown_mib
    assert not (tmp_path / "capture").exists() or bundle_dirs(tmp_path / "capture") == []
