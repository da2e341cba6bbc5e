"""Gradient capture from TRL's GRPOTrainer (``capture.integrations.trl`` under ``RELAX_REPLAY_CAPTURE_GRAD=1``):
a hook on the log-probs TRL's loss computed records ``grad_log_probs`` once backward has run; TRL's own loss and
backward (dapo, a KL term) replay clean at ``loss.grad``, and ``examples/trl_grpo.py --bug kl-no-grad`` (the KL
term without a gradient, its value TRL's) is named there while ``loss.policy`` passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[trl]' installs the tested version)")

from replay_lib.run.runner import replay  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = ("step-0-0", "step-0-1", "step-1-0")


def run(tmp_path: Path, *flags: str) -> Path:
    directory = tmp_path / "bundles"
    tmp_path.mkdir(parents=True)
    env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(directory),
           "RELAX_REPLAY_CAPTURE_GRAD": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "trl_grpo.py"), "--beta", "0.1", "--steps", "3",
                           *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return directory


def test_trl_gradients_replay_clean_and_the_kl_without_gradient_is_named(tmp_path):
    clean = run(tmp_path / "clean")
    for name in STEPS:
        assert (clean / name / "payloads" / "grad_log_probs.safetensors").exists()  # format 1.3.0
        report = replay(clean / name)
        status = {s.stage: s.status for s in report.stages}
        assert (status["loss.policy"], status["loss.grad"]) == ("pass", "pass"), name
    bug = run(tmp_path / "bug", "--bug", "kl-no-grad")
    for name in STEPS[1:]:
        report = replay(bug / name)
        status = {s.stage: s.status for s in report.stages}
        assert (status["loss.policy"], status["loss.grad"]) == ("pass", "fail"), name
        assert report.first_divergent_stage == "loss.grad"
        assert [e.hypothesis for e in report.explanations] == ["grad.kl_no_gradient"]


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_trl_family_gradients_replay_clean(tmp_path, loss_type):
    """TRL's own CISPO (``clamp(r, max=ε_high).detach()``) and SAPO (the soft gate) losses and backward, with a KL
    term: the hook's gradient replays clean at loss.grad (kernels/families/grad.py)."""
    directory = run(tmp_path / loss_type, "--loss-type", loss_type)
    for name in STEPS:
        report = replay(directory / name)
        status = {s.stage: s.status for s in report.stages}
        assert (status["loss.policy"], status["loss.grad"]) == ("pass", "pass"), name
