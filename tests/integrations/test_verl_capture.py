"""Live capture from verl's trainer (``capture.integrations.verl``) through ``examples/verl_grpo.py``: verl 0.9.1's
own ``compute_advantage`` and ``ppo_loss`` on the CPU, captured with the ``RELAX_REPLAY_CAPTURE*`` variables.

One subprocess trains every variant (verl and torch are imported once) and replays each capture directory with
``trajectory-replay scan``. The expected values in the bundles are verl's own; the fidelity checks recompute
verl's formulas in the test, written from verl 0.9.1's ``verl/trainer/ppo/core_algos.py``
(``compute_grpo_outcome_advantage`` :270-330, ``compute_policy_loss_vanilla`` :1286-1375, ``agg_loss``
``token-mean`` :1170-1175) — not from ``replay_lib.kernels``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if importlib.util.find_spec("verl") is None:  # verl itself is imported by the example (its heavy imports stubbed)
    pytest.skip("verl is not installed (pip install -e '.[verl]' installs the tested version)", allow_module_level=True)

import torch  # noqa: E402

from replay_lib.bundle import BundleReader  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = ["rollout-0", "rollout-1", "step-0-0", "step-0-1", "step-1-0", "step-1-1"]

# name → (example arguments, capture variables; None = capture off)
VARIANTS = {
    "clean": ([], {}),
    "off": ([], None),
    "seq-mean": (["--loss-agg-mode", "seq-mean-token-mean", "--steps", "1"], {}),
    "knobs": (["--kl-loss-coef", "0.1", "--entropy-coeff", "0.01", "--loss-agg-mode", "token-sum", "--steps", "1"],
              {}),
    "filtered": ([], {"RELAX_REPLAY_CAPTURE_STEPS": "1:1", "RELAX_REPLAY_CAPTURE_ROLLOUTS": "0"}),
    "kl-in-reward": (["--kl-in-reward", "0.5", "--single-turn"], {}),
    "hook-fails": ([], {}),  # the micro-batch hook raises: logged, the step not written, training unchanged
    "stale-group-index": (["--bug", "stale-group-index"], {}),
    "double-scaled-loss": (["--bug", "double-scaled-loss", "--steps", "1"], {}),
}

DRIVER = textwrap.dedent("""
    import contextlib, io, json, os, sys
    sys.path.insert(0, os.path.join(sys.argv[1], "examples"))
    import verl_grpo
    from capture.integrations.verl import (TESTED_VERSIONS, UntestedVerlVersion, enable_replay_capture,
                                           require_tested_verl)
    from replay_lib.cli import main
    import capture.integrations.verl as hooks_module

    plan = json.loads(sys.argv[2])
    for name, argv, env in plan:
        for key in [k for k in os.environ if k.startswith("RELAX_REPLAY_CAPTURE")]:
            del os.environ[key]
        os.environ.update(env)
        saved = hooks_module.VerlCapture._on_micro_batch
        if name == "hook-fails":
            def fail(self, *args, **kwargs):
                raise RuntimeError("a hook failed")
            hooks_module.VerlCapture._on_micro_batch = fail
        try:
            print(json.dumps({"name": name, **verl_grpo.train(argv)}), flush=True)
        finally:
            hooks_module.VerlCapture._on_micro_batch = saved
    for name, argv, env in plan:
        if not env:
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["scan", env["RELAX_REPLAY_CAPTURE_DIR"], "--format", "json", "--jobs", "1"])
        print(json.dumps({"scan": name, "code": code, "report": json.loads(out.getvalue())}), flush=True)
    checks = {"tested": TESTED_VERSIONS}
    try:
        require_tested_verl("0.9.0")
    except UntestedVerlVersion as exc:
        checks["untested"] = str(exc)
    env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": sys.argv[3]}
    cfg = verl_grpo.trainer_config(verl_grpo.parse_args([]))
    checks["off"] = enable_replay_capture(cfg, env={}) is None
    for key, path, value in (("gae", ("algorithm", "adv_estimator"), "gae"),
                             ("clip_cov", ("actor_rollout_ref", "actor", "policy_loss"), {"loss_mode": "clip_cov"})):
        bad = json.loads(json.dumps(cfg))
        node = bad
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
        try:
            enable_replay_capture(bad, env=env)
        except Exception as exc:
            checks[key] = [type(exc).__name__, str(exc)]
    checks["refused_left_nothing"] = not os.path.exists(sys.argv[3])
    # the loss function called outside the engine's train_batch (infer_batch's forward-only calls) records nothing
    import torch
    idle = hooks_module.VerlCapture(None, None, cfg)
    loss, _ = idle.wrap_loss_fn(lambda **k: (torch.tensor(2.0), {}))(model_output={}, data={}, dp_group=None)
    checks["outside_train_batch"] = [float(loss), idle.errors, idle._step is None]
    # the capture's cut of a no-padding model output = verl's own no_padding_2_padding, padded and nested layouts
    import torch
    from verl.workers.utils.padding import no_padding_2_padding
    from capture.integrations import verl as hooks
    gen = torch.Generator().manual_seed(5)
    prompt_lengths, lengths = torch.tensor([2, 3, 1]), torch.tensor([4, 1, 3])
    width_p, width_r = 3, 4
    attention = torch.zeros(3, width_p + width_r, dtype=torch.int64)
    for i in range(3):
        attention[i, width_p - prompt_lengths[i]:width_p + lengths[i]] = 1
    values = torch.randn(int(attention.sum()), generator=gen)
    padded = {"prompts": torch.zeros(3, width_p), "responses": torch.zeros(3, width_r), "attention_mask": attention}
    verl_cut = hooks._tokens(no_padding_2_padding(values, padded), lengths)
    nested = {"prompts": torch.nested.as_nested_tensor([torch.zeros(int(n)) for n in prompt_lengths],
                                                         layout=torch.jagged),
              "responses": torch.nested.as_nested_tensor([torch.zeros(int(n)) for n in lengths], layout=torch.jagged)}
    nested_values = torch.nested.nested_tensor_from_jagged(values, torch.cat([torch.zeros(1, dtype=torch.int64),
                                                                             (prompt_lengths + lengths).cumsum(0)]))
    checks["cut"] = [torch.equal(hooks._response_tokens(values, *hooks._lengths(padded)), verl_cut),
                     torch.equal(hooks._response_tokens(nested_values, *hooks._lengths(nested)), verl_cut),
                     torch.equal(hooks._tokens(no_padding_2_padding(nested_values, nested), lengths), verl_cut),
                     len(verl_cut)]
    print(json.dumps({"checks": checks}), flush=True)
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(root, trainings by name, scans by name as (exit code, JSON report), checks)``."""
    root = tmp_path_factory.mktemp("verl")
    plan = []
    for name, (argv, env) in VARIANTS.items():
        capture = {} if env is None else {"RELAX_REPLAY_CAPTURE": "1",
                                           "RELAX_REPLAY_CAPTURE_DIR": str(root / name), **env}
        plan.append((name, argv, capture))
    done = subprocess.run([sys.executable, "-c", DRIVER, str(REPO), json.dumps(plan), str(root / "refused")],
                          cwd=REPO, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr[-4000:]
    results, scans, checks = {}, {}, None
    for line in done.stdout.splitlines():
        if line.startswith('{"name"'):
            row = json.loads(line)
            results[row["name"]] = row
        elif line.startswith('{"scan"'):
            row = json.loads(line)
            scans[row["scan"]] = (row["code"], row["report"])
        elif line.startswith('{"checks"'):
            checks = json.loads(line)["checks"]
    assert sorted(results) == sorted(VARIANTS)
    return root, results, scans, checks


def statuses(report: dict) -> dict[str, str]:
    return {b["path"]: b["status"] for b in report["bundles"]}


def first_stages(report: dict) -> dict[str, str]:
    return {b["path"]: b.get("first_stage") for b in report["bundles"]}


def test_capture_changes_nothing_in_training(runs):
    _, results, _, _ = runs
    assert results["off"]["capture"] is None
    assert results["clean"]["weights_sha256"] == results["off"]["weights_sha256"]


def test_a_failing_hook_never_reaches_training(runs):
    """Every micro-batch hook raising: each step is abandoned (one hook error per step, the rest of its
    micro-batches not even tried), the rollouts are still written, and the weights are those of capture off."""
    root, results, scans, _ = runs
    assert results["hook-fails"]["weights_sha256"] == results["off"]["weights_sha256"]
    assert results["hook-fails"]["capture"] == {"directory": str(root / "hook-fails"), "written": 2, "dropped": 0,
                                                "errors": 4}
    assert statuses(scans["hook-fails"][1]) == {"rollout-0": "pass", "rollout-1": "pass"}


@pytest.mark.parametrize("name, bundles", [
    # 2 rollouts of 4 prompts × 4; ppo_mini_batch_size 2 → 2 optimizer steps per rollout, 4 micro-batches each
    ("clean", STEPS),
    ("seq-mean", ["rollout-0", "step-0-0", "step-0-1"]),
    ("knobs", ["rollout-0", "step-0-0", "step-0-1"]),
    ("filtered", ["rollout-0", "step-1-1"]),
    ("kl-in-reward", STEPS),
])
def test_every_bundle_replays_clean(runs, name, bundles):
    root, results, scans, _ = runs
    assert results[name]["capture"] == {"directory": str(root / name), "written": len(bundles), "dropped": 0,
                                         "errors": 0}
    code, report = scans[name]
    assert statuses(report) == dict.fromkeys(bundles, "pass"), report.get("summary")
    assert code == 0


def test_stale_group_index_fails_first_at_reward_post_process(runs):
    code, report = runs[2]["stale-group-index"]
    assert code == 1
    assert first_stages(report) == {"rollout-0": "reward.post_process", "rollout-1": "reward.post_process",
                                    "step-0-0": None, "step-0-1": None, "step-1-0": None, "step-1-1": None}


def test_double_scaled_loss_fails_first_at_loss_policy(runs):
    code, report = runs[2]["double-scaled-loss"]
    assert code == 1
    assert first_stages(report) == {"rollout-0": None, "step-0-0": "loss.policy", "step-0-1": "loss.policy"}


def _tensor(reader: BundleReader, name: str) -> torch.Tensor:
    return reader.payload(name).to(torch.float64)


def _groups_normalized(raw: list[float], groups: list[int]) -> list[float]:
    """verl's GRPO (core_algos.py:300-330): (score − group mean) / (unbiased group std + 1e-6); one sample: 0/1."""
    out = []
    for i, g in enumerate(groups):
        members = torch.tensor([raw[j] for j, h in enumerate(groups) if h == g], dtype=torch.float32)
        if len(members) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = members.mean(), members.std()
        out.append(float((torch.tensor(raw[i], dtype=torch.float32) - mean) / (std + 1e-6)))
    return out


@pytest.mark.parametrize("name, clean", [("clean", True), ("stale-group-index", False)])
def test_rollout_records_verls_scores_groups_and_normalization(runs, name, clean):
    root = runs[0]
    reader = BundleReader(root / name / "rollout-0")
    samples = reader.index.samples
    assert len(samples) == 16
    groups = [s.group_index for s in samples]
    assert sorted(groups.count(g) for g in set(groups)) == [4, 4, 4, 4]  # rollout.n = 4 per uid
    raw = [s.raw_reward for s in samples]
    expected = _groups_normalized(raw, groups)
    close = [math.isclose(s.reward, e, rel_tol=1e-5, abs_tol=1e-6) for s, e in zip(samples, expected)]
    assert all(close) if clean else not all(close)
    # multi-turn: the tool's tokens (the 2nd and 3rd of a response that goes on) are out of the loss
    masks = [reader.sample_mask(i) for i, s in enumerate(samples) if s.response_length >= 4]
    assert masks and all(m[1] == 0 and m[2] == 0 and m[0] == 1 and m[3] == 1 for m in masks)


def test_step_records_verls_counts_and_token_mean_loss(runs):
    """``loss`` = Σ over the micro-batches of ``Σ_t pg_t · mask_t / batch_num_tokens`` (dp_size 1), verl's vanilla
    PPO surrogate recomputed here on the recorded inputs."""
    root = runs[0]
    for step in ("step-0-0", "step-0-1", "step-1-1"):
        reader = BundleReader(root / "clean" / step)
        cfg = reader.index.config
        samples = reader.index.samples
        mask = reader.packed_mask.to(torch.float64)  # format 1.3.0: every sample's mask, flat
        assert cfg.loss_token_count == int(mask.sum())
        assert (cfg.loss_agg_mode, cfg.metric_agg_mode, cfg.loss_scale) == ("token_mean", "micro_batch_token_mean",
                                                                             1.0)
        assert sorted({s.micro_batch_id for s in samples}) == ["mb-0000", "mb-0001", "mb-0002", "mb-0003"]
        logp, old, adv = (_tensor(reader, n) for n in ("log_probs", "old_log_probs", "advantages"))
        ratio = torch.exp(torch.clamp(logp - old, -20, 20))
        clipped = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28))
        pg = torch.where(adv < 0, torch.minimum(-adv * 3.0, clipped), clipped)
        loss = float((pg * mask).sum() / mask.sum())
        assert reader.expected["loss.policy"]["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
        assert reader.expected["loss.policy"]["pg_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)


def test_the_loss_function_outside_train_batch_is_not_a_step(runs):
    assert runs[3]["outside_train_batch"] == [2.0, 0, True]


def test_the_response_cut_is_verls_no_padding_2_padding(runs):
    """Both of verl's layouts (a padded attention mask, nested prompts/responses): the tokens the capture records
    are those verl's ``no_padding_2_padding`` gives the loss (8 response tokens of 3 samples)."""
    assert runs[3]["cut"] == [True, True, True, 8]


def test_in_reward_kl_is_verls_kl_penalty_and_enters_the_normalization(runs):
    """Rollout 0: the reference is the initial policy, so the KL is 0; rollout 1 (after 2 updates): the recorded
    ``kl`` is old − ref at each loss token (verl's ``kl``, core_algos.py kl_penalty_forward), and the normalized
    rewards are GRPO's of ``score − 0.5·Σ kl`` (apply_kl_penalty, ray_trainer.py:78-112), not of the scores."""
    root = runs[0]
    first = BundleReader(root / "kl-in-reward" / "rollout-0")
    assert float(_tensor(first, "kl").abs().max()) == 0.0
    reader = BundleReader(root / "kl-in-reward" / "rollout-1")
    samples = reader.index.samples
    kl, old, ref = (_tensor(reader, n) for n in ("kl", "old_log_probs", "ref_log_probs"))
    assert float(kl.abs().max()) > 0
    assert torch.allclose(kl, old - ref, rtol=0, atol=1e-6)
    assert reader.index.config.kl_in_reward == "sequence" and reader.index.config.kl_coef == 0.5
    sums, at = [], 0
    for s in samples:
        sums.append(float(kl[at:at + s.response_length].sum()))
        at += s.response_length
    groups = [s.group_index for s in samples]
    shaped = [s.raw_reward - 0.5 * k for s, k in zip(samples, sums)]
    assert [s.reward for s in samples] == pytest.approx(_groups_normalized(shaped, groups), rel=1e-4, abs=1e-5)
    assert [s.reward for s in samples] != pytest.approx(_groups_normalized([s.raw_reward for s in samples], groups),
                                                        rel=1e-4, abs=1e-5)


def test_untested_verl_version_is_refused_in_one_line(runs):
    checks = runs[3]
    assert checks["tested"] == {"verl": "0.9.1"}
    assert checks["untested"] == ("capture.integrations.verl is tested with verl==0.9.1 only, found verl 0.9.0: "
                                  "install the tested version (pip install -e '.[verl]')")


def test_the_extra_pins_the_tested_version(runs):
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["verl"]
    assert extra == [f"verl=={runs[3]['tested']['verl']}"] == ["verl==0.9.1"]


def test_unrecomputable_configs_are_refused_before_training(runs):
    checks = runs[3]
    assert checks["off"] is True
    assert checks["gae"] == ["UnsupportedFrameworkConfig",
                             "verl config: algorithm.adv_estimator=gae: capture.integrations.verl records estimators "
                             "with one advantage per sample (grpo, grpo_vectorized, rloo, rloo_vectorized)"]
    assert checks["clip_cov"][0] == "UnsupportedFrameworkConfig"
    assert checks["clip_cov"][1] == (
        "verl config: actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov: capture.integrations.verl does not "
        "record the payload the replay needs for it (clip_cov_mask: the loss's random token draw)")
    assert checks["refused_left_nothing"] is True
