"""Gradient capture in a real trainer process (``examples/grpo_trainer.py`` under ``RELAX_REPLAY_CAPTURE_GRAD=1``):
a tensor hook on the log-probs (and on the values, PPO) records ``grad_log_probs`` / ``grad_values``, the step
bundles declare ``loss.grad`` and replay clean with every loss knob on; each ``--grad-bug`` leaves the loss value
as it was (loss.policy passes) and is named at ``loss.grad``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from replay_lib.run.runner import replay

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "grpo_trainer.py"
SMALL = ["--rollouts", "1", "--prompts-per-rollout", "3", "--n-samples", "4", "--consumer-batch", "5",
         "--steps-per-rollout", "3", "--micro-batch", "3", "--hidden", "16", "--embed", "8", "--quiet"]
STEPS = ("step-0-0", "step-0-1", "step-0-2")


def train(tmp_path: Path, *flags: str, grad: bool = True) -> Path:
    directory = tmp_path / "bundles"
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(directory), "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    if grad:
        env["RELAX_REPLAY_CAPTURE_GRAD"] = "1"
        env["RELAX_REPLAY_CAPTURE_TOKEN_TERMS"] = "1"  # pg_losses too: the diff viewer shows the gradient beside
    proc = subprocess.run([sys.executable, str(TRAINER), *SMALL, *flags], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return directory


def statuses(path: Path) -> tuple[dict, list[str]]:
    report = replay(path)
    return {s.stage: s.status for s in report.stages}, [e.hypothesis for e in report.explanations]


def test_every_knob_with_ppo_records_and_replays_its_gradients(tmp_path):
    directory = train(tmp_path, "--loss-agg", "token_mean", "--dual-clip", "3", "--eps-clip-high", "0.28",
                      "--kl-loss", "low_var_kl:0.1", "--tis", "token:2.0", "--ppo")
    for name in STEPS:
        assert (directory / name / "payloads" / "grad_log_probs.safetensors").exists()  # format 1.3.0
        assert (directory / name / "payloads" / "grad_values.safetensors").exists()
        status, _ = statuses(directory / name)
        assert (status["loss.policy"], status["loss.value"], status["loss.grad"]) == ("pass", "pass", "pass"), name
    # the TUI's token diff of a loss term carries the token's recorded gradient (its ∂L/∂logp column)
    import torch

    from replay_lib.bundle import BundleReader, open_bundle
    from replay_tui.model.token_diff import token_diff

    reader = BundleReader(directory / "step-0-0")
    first = reader.index.samples[0]
    diff = token_diff(open_bundle(directory / "step-0-0"), first.sample_id, "pg_losses")
    grad = reader.payload("grad_log_probs")[:first.response_length].to(torch.float64)
    assert diff.grad is not None and torch.equal(diff.grad, grad)


def test_gspo_icepop_replays_clean_and_capture_off_writes_no_gradient(tmp_path):
    directory = train(tmp_path, "--gspo", "--tis", "sequence:4", "--icepop", "0.5", "--kl-loss", "k3:0.1",
                      "--loss-agg", "seq_mean_token_mean")
    for name in STEPS:
        assert statuses(directory / name)[0]["loss.grad"] == "pass"
    off = train(tmp_path / "off", "--kl-loss", "k3:0.1", grad=False)
    assert not list((off / "step-0-0" / "payloads").glob("grad_log_probs.*"))
    assert "loss.grad" not in statuses(off / "step-0-0")[0]


# (flags, the step where the bug shows, the explanation): kl_no_grad shows from step 0-1 (on step 0-0 the
# policy equals its reference, so the KL term has no gradient anyway); zero_coef_nan on step 0-0 (its NaN
# then reaches the weights, and every later loss is NaN too)
BUGS = {
    "kl_no_grad": (("--kl-loss", "k2:0.1"), "step-0-1", "grad.kl_no_gradient"),
    "is_not_detached": (("--tis", "token:2.0"), "step-0-2", "grad.is_weight_not_detached"),
    "ratio_detached": ((), "step-0-0", "grad.ratio_detached"),
    "zero_coef_nan": ((), "step-0-0", "grad.nonfinite_zero_coefficient"),
    "scale_twice": ((), "step-0-0", "grad.scaled"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_grad_bug_flag_is_named_at_loss_grad_with_the_loss_unchanged(tmp_path, bug):
    flags, step, hypothesis = BUGS[bug]
    directory = train(tmp_path, *flags, "--grad-bug", bug)
    status, explained = statuses(directory / step)
    assert (status["loss.policy"], status["loss.grad"]) == ("pass", "fail")
    assert explained == [hypothesis], explained


# --loss FAMILY (its parameters as the trainer's tests give them): each family's gradient recorded by the hook
FAMILY_FLAGS = {"dro": ("--loss-param", "beta=0.5"), "dppo_tv": ("--loss-param", "trunc=1.5"),
                "dppo_kl": ("--loss-param", "trunc=1.5")}


@pytest.mark.slow
def test_every_loss_family_records_and_replays_its_gradient_clean(tmp_path):
    """The example trainer with ``--loss FAMILY`` under RELAX_REPLAY_CAPTURE_GRAD=1: the hook's gradient of each
    family's loss (the trainer backpropagates the float32 kernels, their stop-gradients included) replays clean at
    loss.grad on the step after the first (off-policy), loss.policy passing too."""
    from replay_lib.kernels.families import FAMILIES, token_payloads

    from concurrent.futures import ThreadPoolExecutor

    short = [a if a != "3" or SMALL[i - 1] != "--steps-per-rollout" else "2" for i, a in enumerate(SMALL)]

    def run(family: str) -> subprocess.CompletedProcess:
        env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path / family / "bundles"),
               "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
               "RELAX_REPLAY_CAPTURE_GRAD": "1"}
        (tmp_path / family).mkdir()
        return subprocess.run([sys.executable, str(TRAINER), *short, "--loss", family, *FAMILY_FLAGS.get(family, ())],
                              cwd=tmp_path / family, env=env, capture_output=True, text=True, timeout=300)

    # every family the trainer trains with: Clip-Cov's random draw is not recorded by the example (its --loss
    # choices leave it out), its gradient is tests/test_grad_families.py's
    families = sorted(f for f in FAMILIES if not token_payloads(f))
    with ThreadPoolExecutor(max_workers=2) as pool:  # two trainers at a time: most of each is torch's import
        procs = dict(zip(families, pool.map(run, families)))
    failed = {}
    for family, proc in procs.items():
        assert proc.returncode == 0, (family, proc.stderr[-3000:])
        status, _ = statuses(tmp_path / family / "bundles" / "step-0-1")
        if (status["loss.policy"], status.get("loss.grad")) != ("pass", "pass"):
            failed[family] = status
    assert failed == {}
