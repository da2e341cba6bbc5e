"""The example trainer's advantage-side flags (SPEC §4.2) end to end: each flag's capture replays clean, and each
family's bug flag makes the right stage the first divergence — slime#2230's class (uneven groups normalized
over the whole batch) and AReaL#1419's (groups recovered by a fixed stride) at reward.post_process, a wrong
GAE λ or whitening at advantage.estimate. The trainer runs in this process (``run(argv, env)``, capture on, the
real bundle writer) except for the tests marked as subprocess runs, which run it and the CLI as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay_lib.bundle import BundleReader
from replay_lib.judge.report import report_to_text
from replay_lib.run.runner import replay

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "grpo_trainer.py"
# One rollout of 2 prompts × 4 samples, one actor step (a second rollout where the KL must be non-zero: rollout
# 0 samples from the reference weights themselves).
SMALL = ["--prompts-per-rollout", "2", "--n-samples", "4", "--consumer-batch", "3", "--steps-per-rollout", "1",
         "--micro-batch", "4", "--hidden", "16", "--embed", "8", "--quiet"]


@pytest.fixture(scope="module")
def trainer(example_trainer):
    grpo_trainer = example_trainer
    threads = torch.get_num_threads()
    yield grpo_trainer
    torch.set_num_threads(threads)


def env_for(directory: Path) -> dict[str, str]:
    return {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(directory)}


def captured(trainer, tmp_path, *flags: str, rollouts: int = 1) -> Path:
    directory = tmp_path / "bundles"
    result = trainer.run([*SMALL, "--rollouts", str(rollouts), *flags], env=env_for(directory))
    assert result.capture_stats.errors == 0 and result.capture_flushed
    return directory


CLEAN = {
    "rloo": ["--estimator", "rloo"],
    "dr_grpo": ["--estimator", "dr_grpo"],
    "reinforce_plus_plus": ["--estimator", "reinforce_plus_plus", "--gamma", "0.9"],
    "reinforce_plus_plus_baseline": ["--estimator", "reinforce_plus_plus_baseline"],
    "gae": ["--estimator", "gae", "--gamma", "0.97", "--lam", "0.9"],
    "loo": ["--loo"],
    "std_eps": ["--std-eps", "1e-4"],
    "std_biased": ["--std-biased"],
    "whiten": ["--whiten", "--mask-truncated"],
    "uneven_groups": ["--uneven-groups"],
}


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_each_advantage_flag_replays_clean(trainer, tmp_path, name):
    directory = captured(trainer, tmp_path, *CLEAN[name])
    for bundle in ("rollout-0", "step-0-0"):
        report = replay(directory / bundle)
        assert report.passed, report_to_text(report)
    config = BundleReader(directory / "rollout-0").index.config
    estimator = CLEAN[name][1] if CLEAN[name][0] == "--estimator" else "grpo"
    assert config.advantage_estimator == estimator
    if name == "loo":
        assert (config.group_baseline, config.std_zero, config.singleton_group) == ("leave_one_out", "skip", "zero")
    if name == "uneven_groups":  # groups of 5 and 3, declared by n_samples_per_prompt = 0
        index = BundleReader(directory / "rollout-0").index
        assert index.config.n_samples_per_prompt == 0
        assert sorted({g: [s.group_index for s in index.samples].count(g)
                       for g in {s.group_index for s in index.samples}}.values()) == [3, 5]
    if name == "gae":  # the critic's values and GAE's returns are recorded and compared
        reader = BundleReader(directory / "rollout-0")
        assert reader.has_payload("values") and reader.has_payload("returns")


@pytest.mark.parametrize("form", ["sequence", "token_returns"])
def test_kl_in_reward_replays_clean_and_its_sign_bug_is_found_where_the_kl_enters(trainer, tmp_path, form):
    clean = captured(trainer, tmp_path / "clean", "--kl-in-reward", form, rollouts=2)
    report = replay(clean / "rollout-1")
    assert report.passed, report_to_text(report)
    bad = captured(trainer, tmp_path / "bad", "--kl-in-reward", form, "--kl-reward-sign-bug", rollouts=2)
    report = replay(bad / "rollout-1")
    # sequence: the score the group normalizes; token_returns: the per-token rewards of the returns
    want = "reward.post_process" if form == "sequence" else "advantage.estimate"
    assert report.first_divergent_stage == want, report_to_text(report)
    if form == "sequence":  # the score's KL penalty added: explained, at every sample, and nothing else is
        assert [(e.hypothesis, e.matched, e.of) for e in report.explanations] == [("reward.kl_sign", 8, 8)]
        assert report.explanations[0].detail == ("the recorded rewards equal the KL penalty added to the score, "
                                                 "r + 0.05·Σ kl (config: r − 0.05·Σ kl)")
        # an unrelated bug in the same configuration is not explained as a sign flip
        other = captured(trainer, tmp_path / "other", "--kl-in-reward", form, "--pr65-bug", rollouts=2)
        report = replay(other / "rollout-1")
        assert report.first_divergent_stage == "reward.post_process", report_to_text(report)
        assert "reward.kl_sign" not in [e.hypothesis for e in report.explanations]


@pytest.mark.parametrize("flags,stage", [
    (["--uneven-groups-bug"], "reward.post_process"),
    (["--stride-groups-bug"], "reward.post_process"),
    (["--estimator", "rloo", "--loo-bug"], "reward.post_process"),
    (["--estimator", "gae", "--gae-lambda-bug"], "advantage.estimate"),
    (["--whiten", "--whiten-batch-bug"], "advantage.estimate"),
], ids=["uneven_groups", "stride_groups", "loo", "gae_lambda", "whiten_batch"])
def test_each_family_bug_is_the_first_divergence_at_its_stage(trainer, tmp_path, flags, stage):
    directory = captured(trainer, tmp_path, *flags)
    report = replay(directory / "rollout-0")
    assert report.first_divergent_stage == stage, report_to_text(report)
    assert [s.status for s in report.stages[:2]] == ["pass", "pass"]  # sample, reward.raw
    # the step trained on exactly the advantages the bug produced: its loss replays clean
    assert replay(directory / "step-0-0").passed


def test_uneven_groups_bug_is_slime_2230s_whole_batch_normalization(trainer, tmp_path):
    """slime rollout.py:620-623: samples that do not fill n × batch are normalized as one row."""
    directory = captured(trainer, tmp_path, "--uneven-groups-bug")
    index = BundleReader(directory / "rollout-0").index
    raw = torch.tensor([s.raw_reward for s in index.samples], dtype=torch.float64)
    whole = (raw - raw.mean()) / (raw.std() + 1e-6)  # the batch as one group: what the bug wrote
    assert [s.reward for s in index.samples] == pytest.approx(whole.tolist(), abs=1e-5)


def test_a_bug_flag_outside_its_family_is_a_usage_error(trainer, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        trainer.run([*SMALL, "--gae-lambda-bug"], env={})
    assert exc.value.code == 2
    assert "--gae-lambda-bug needs --estimator gae" in capsys.readouterr().err


def test_subprocess_gae_with_kl_returns_and_whitening_replays_clean_in_the_cli(tmp_path):
    """Real processes: the trainer with --estimator gae --kl-in-reward token_returns --whiten, then
    ``trajectory-replay replay`` on its rollout bundle (exit 0) and on the λ bug's (exit 1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAX_REPLAY_CAPTURE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    codes = []
    for name, extra in (("clean", []), ("bug", ["--gae-lambda-bug"])):
        directory = tmp_path / name
        flags = [*SMALL, "--rollouts", "2", "--estimator", "gae", "--kl-in-reward", "token_returns", "--whiten",
                 "--gamma", "0.99", "--lam", "0.9", *extra]
        proc = subprocess.run([sys.executable, str(TRAINER), *flags], cwd=tmp_path, env={**env, **env_for(directory)},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        replayed = subprocess.run([sys.executable, "-m", "replay_lib", "replay", str(directory / "rollout-1")],
                                  env=env, capture_output=True, text=True, timeout=120)
        codes.append((replayed.returncode, replayed.stdout.splitlines()[0]))
    # the five rollout stages and logprob.mismatch (the trainer records its sampler's own log-probs)
    assert codes == [(0, "bundle rollout-1 — no divergence (6 stage(s) compared)"),
                     (1, "bundle rollout-1 — first divergent stage: advantage.estimate")]


def test_exact_on_a_float64_accumulating_step_names_the_precision_not_an_aggregation_bug(trainer, tmp_path):
    """The example trainer aggregates its loss in float64 and declares it. Under --exact (a float32 recompute)
    its scalars may differ in their last float32 digits; the check of the recorded scalars against the recorded
    per-sample terms is two recorded things (no kernel reproduces their summation bit for bit) and keeps its
    rounding bound, so no "aggregation mismatch" appears, and a warning says why the scalars may differ."""
    from replay_lib.judge.error_model import Rules

    step = captured(trainer, tmp_path) / "step-0-0"
    assert replay(step).passed
    report = replay(step, rules=Rules(exact=True))
    loss = next(s for s in report.stages if s.stage == "loss.policy")
    assert "aggregation" not in (loss.reason or "")
    assert not any(d.field.endswith("_from_terms") for d in loss.divergences)
    assert any("--exact recomputes in float32; this producer declares float32 compute and float64 accumulation"
               in w for w in report.warnings)


def test_pr65_under_another_eps_and_the_biased_std_is_one_bug_and_is_explained(trainer, tmp_path):
    """--pr65-bug with --std-eps 1e-4 --std-biased: each consumer batch (3 + 3 + 2 of 8 samples) is normalized with
    the step's own eps and population std (it used 1e-6 and the unbiased std whatever the flags: two bugs, "no known
    cause"), and the explanation names the consumer batches. Checked against a NumPy normalization of the recorded
    raw rewards over those batches."""
    import numpy as np

    directory = captured(trainer, tmp_path, "--pr65-bug", "--std-eps", "1e-4", "--std-biased")
    index = BundleReader(directory / "rollout-0").index
    raw = np.array([s.raw_reward for s in index.samples], dtype=np.float64)
    batch = np.arange(raw.size) // 3
    want = np.empty_like(raw)
    for b in np.unique(batch):
        r = raw[batch == b]
        want[batch == b] = (r - r.mean()) / (r.std(ddof=0) + 1e-4)
    assert [s.reward for s in index.samples] == pytest.approx(want.tolist(), abs=1e-5)
    report = replay(directory / "rollout-0")
    assert report.first_divergent_stage == "reward.post_process"
    [e] = report.explanations
    assert e.hypothesis.startswith("reward.consumer_batches") and e.matched == e.of == raw.size, e
