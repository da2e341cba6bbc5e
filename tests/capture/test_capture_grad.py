"""Gradient capture (``RELAX_REPLAY_CAPTURE_GRAD``, ``capture.GradTap``): the variable, the hook (the gradient
backward gives the tensor, summed over two backward passes, zeros when backward never reaches it), and what a step
writes (``grad_log_probs`` only when the variable is on; a wrong length refused on the spot)."""

from __future__ import annotations

import json

import pytest
import torch

from capture import ENV_GRAD, CaptureConfig, GradTap, ReplayCapture, config_from_env
from replay_lib.bundle.schema import RecomputeConfig

CFG = RecomputeConfig()


def test_the_variable_turns_gradient_capture_on(tmp_path):
    base = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path)}
    assert config_from_env(base).grad is False
    assert config_from_env({**base, ENV_GRAD: "1"}).grad is True
    with pytest.raises(ValueError, match=ENV_GRAD):
        config_from_env({**base, ENV_GRAD: "maybe"})


def test_the_tap_keeps_the_gradient_backward_gives_the_tensor():
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    y = x * 2  # a non-leaf, like the log-probs of a forward
    tap = GradTap(y)
    (y * torch.tensor([1.0, -1.0, 0.5])).sum().backward(retain_graph=True)
    assert tap.grad.tolist() == [1.0, -1.0, 0.5]
    (3 * y).sum().backward()
    assert tap.gradient().tolist() == [4.0, 2.0, 3.5]  # two backward passes: their sum
    z = torch.ones(2, requires_grad=True) * 1.0
    assert GradTap(z).gradient().tolist() == [0.0, 0.0]  # backward never reached it: its gradient is 0
    with pytest.raises(ValueError, match="does not require grad"):
        GradTap(torch.zeros(2))


def _step(tmp_path, grad: bool, grad_values=None, n: int = 3):
    cap = ReplayCapture(CaptureConfig(enabled=True, directory=tmp_path, grad=grad), CFG, register_atexit=False)
    step = cap.begin_step(0, 0)
    logp = torch.full((n,), -0.5, requires_grad=True)
    tap = step.grad_tap(logp)
    (logp * torch.tensor([1.0, 2.0, 3.0])[:n]).sum().backward()
    step.add_micro_batch(sample_ids=["s-0"], group_index=[0], response_lengths=[3], total_lengths=[7],
                         loss_mask=[1, 1, 1], log_probs=logp.detach(), old_log_probs=torch.full((3,), -0.5),
                         advantages=torch.ones(3), entropy=torch.zeros(3),
                         grad_log_probs=tap.gradient() if tap is not None else torch.ones(n))
    step.finish(loss=1.0)
    assert cap.close(timeout=30)
    return tmp_path / "step-0-0", tap


def test_a_step_records_the_gradient_and_declares_loss_grad_only_when_on(tmp_path):
    bundle, tap = _step(tmp_path / "on", grad=True)
    assert tap is not None
    from safetensors.torch import load_file  # capture writes format 1.3.0: safetensors payloads

    assert load_file(str(bundle / "payloads" / "grad_log_probs.safetensors"))["data"].tolist() == [1.0, 2.0, 3.0]
    manifest = json.loads((bundle / "manifest.json").read_text())
    contracts = {**manifest["stage_contracts"], **manifest.get("extension_stage_contracts", {})}
    assert contracts["loss.grad"]["capability"] == "recompute"
    assert manifest["comparison_policy"]["tolerances"]["loss.grad"] == {"atol": 0.0, "rtol": 1e-6}
    bundle, tap = _step(tmp_path / "off", grad=False)
    assert tap is None and not list((bundle / "payloads").glob("grad_log_probs.*"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert "loss.grad" not in {**manifest["stage_contracts"], **manifest.get("extension_stage_contracts", {})}


def test_a_gradient_of_the_wrong_length_is_refused_on_the_spot(tmp_path):
    cap = ReplayCapture(CaptureConfig(enabled=True, directory=tmp_path, grad=True), CFG, register_atexit=False)
    try:
        step = cap.begin_step(0, 0)
        with pytest.raises(ValueError, match=r"step-0-0 mb-0000: grad_log_probs has 2 value\(s\) for "
                                             r"Σ response_length 3"):
            step.add_micro_batch(sample_ids=["s-0"], group_index=[0], response_lengths=[3], total_lengths=[7],
                                 loss_mask=[1, 1, 1], log_probs=torch.zeros(3), old_log_probs=torch.zeros(3),
                                 advantages=torch.ones(3), grad_log_probs=torch.zeros(2))
    finally:
        cap.close(timeout=30)
