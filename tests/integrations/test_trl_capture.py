"""Live capture from TRL's GRPOTrainer (``capture.integrations.trl``) through ``examples/trl_grpo.py``.

One subprocess trains every variant (TRL is imported once), capturing with the ``RELAX_REPLAY_CAPTURE*``
variables; each capture directory is then replayed by ``trajectory-replay scan`` in its own process. The
expected values in the bundles are TRL's own; the fidelity checks below recompute TRL's formulas in the test,
written from TRL 1.16.0's ``trl/trainer/grpo_trainer.py`` (huggingface/trl, the release the ``[trl]`` extra
pins): the group normalization of ``_generate_and_score_completions`` (``:2763-2787``) and the loss of
``_compute_loss`` (``:3083-3173``) — not from ``replay_lib.kernels``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[trl]' installs the tested version)")

import torch  # noqa: E402

from replay_lib.bundle import BundleReader  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# name → (example arguments, capture variables; None = capture off)
VARIANTS = {
    "clean": ([], {}),
    "off": ([], None),
    "one-pass": (["--iterations", "1"], {}),
    "grpo": (["--loss-type", "grpo", "--steps", "2"], {}),
    "dr_grpo": (["--loss-type", "dr_grpo", "--steps", "2"], {}),
    # the policy-loss families TRL has: CISPO's absolute cap (min(coef_1, epsilon_high = 0.28)) and SAPO's gate
    "cispo": (["--loss-type", "cispo", "--steps", "2"], {}),
    "sapo": (["--loss-type", "sapo", "--steps", "2"], {}),
    "bnpo": (["--loss-type", "bnpo", "--gradient-accumulation", "1", "--steps", "2"], {}),
    "beta": (["--beta", "0.1", "--steps", "2"], {}),
    # scale_rewards="batch": the group mean over the std of the whole generation batch (SPG = GAS, one process)
    "batch-std": (["--scale-rewards", "batch", "--steps", "2"], {}),
    # TRL's defaults and knobs refused before 1.16's mapping, in one run: bnpo with 2 micro-batches per step, the
    # KL × the ratio (use_bias_correction_kl), two-sided clipping at delta 1.3 (≥ 1 + epsilon_high 0.28) and an
    # entropy bonus
    "knobs": (["--loss-type", "bnpo", "--beta", "0.1", "--bias-correction-kl", "--delta", "1.3",
               "--entropy-coef", "0.05", "--steps", "2"], {}),
    "filtered": ([], {"RELAX_REPLAY_CAPTURE_STEPS": "1:1", "RELAX_REPLAY_CAPTURE_ROLLOUTS": "0"}),
    "batch-normalized-rewards": (["--bug", "batch-normalized-rewards", "--steps", "2"], {}),
    "shuffled-advantages": (["--bug", "shuffled-advantages", "--steps", "2"], {}),
    "wrong-mapping": (["--steps", "2"], {}),  # dapo captured as if it were a sum of per-sample means
}

# replayed by ``trajectory-replay scan`` (with stage link); the others bundle by bundle with ``replay``
SCANNED = ("clean", "one-pass", "filtered", "shuffled-advantages")

DRIVER = textwrap.dedent("""
    import contextlib, io, json, os, sys
    sys.path.insert(0, os.path.join(sys.argv[1], "examples"))
    import msgspec
    import replay_lib.frameworks.trl as mapping
    import trl_grpo
    from capture.integrations.trl import TESTED_VERSIONS, UntestedTRLVersion, enable_replay_capture, require_tested_trl
    from replay_lib.cli import main

    real = mapping.from_trl
    plan = json.loads(sys.argv[2])
    for name, argv, env in plan:
        for key in [k for k in os.environ if k.startswith("RELAX_REPLAY_CAPTURE")]:
            del os.environ[key]
        os.environ.update(env)
        mapping.from_trl = real if name != "wrong-mapping" else (
            lambda *a, **k: msgspec.structs.replace(real(*a, **k), loss_agg_mode="sum_of_sample_means"))
        print(json.dumps({"name": name, **trl_grpo.train(argv)}), flush=True)
    # every capture directory replayed by the CLI in this process (TRL and torch are imported once): scan (with
    # its stage link) where the test reads the links, else replay bundle by bundle (scan's worker processes
    # cost more than these few bundles)
    def cli(argv):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(argv)
        return code, json.loads(out.getvalue())

    statuses = {0: "pass", 1: "diverged"}
    for name, argv, env in plan:
        if not env:
            continue
        directory = env["RELAX_REPLAY_CAPTURE_DIR"]
        if name in sys.argv[3].split(","):
            code, report = cli(["scan", directory, "--format", "json", "--jobs", "1"])
        else:
            rows, codes = [], []
            for path in sorted(os.listdir(directory)):
                c, r = cli(["replay", os.path.join(directory, path), "--format", "json"])
                codes.append(c)
                rows.append({"path": path, "status": statuses.get(c, str(c)), "first_stage": r["first_divergent_stage"],
                             "report": r})
            code, report = (1 if 1 in codes else max(codes, default=0)), {"bundles": rows, "links": None}
        print(json.dumps({"scan": name, "code": code, "report": report}), flush=True)
    checks = {"tested": TESTED_VERSIONS}
    try:
        require_tested_trl("1.17.0")
    except UntestedTRLVersion as exc:
        checks["untested"] = str(exc)
    try:
        enable_replay_capture(object(), env={"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": "/nowhere"})
    except TypeError as exc:
        checks["not_a_trainer"] = str(exc)
    # a configuration the replay cannot recompute is refused when the trainer is built, before any training
    from trl import GRPOConfig
    tokenizer = trl_grpo.make_tokenizer()
    os.environ.update({"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": sys.argv[4]})
    try:
        trl_grpo.ReplayGRPOTrainer(
            model=trl_grpo.make_model(tokenizer, 0), reward_funcs=[trl_grpo.odd_digits],
            args=GRPOConfig(output_dir=sys.argv[4] + "-out", use_cpu=True, report_to=[], delta=1.0,
                            per_device_train_batch_size=4, num_generations=4),
            train_dataset=trl_grpo.make_dataset(8, 0), processing_class=tokenizer)
    except Exception as exc:
        checks["refused"] = [type(exc).__name__, str(exc)]
    print(json.dumps({"checks": checks}), flush=True)
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(root, trainings by name, scans by name as (exit code, JSON report), checks)``."""
    root = tmp_path_factory.mktemp("trl")
    plan = []
    for name, (argv, env) in VARIANTS.items():
        capture = {} if env is None else {"RELAX_REPLAY_CAPTURE": "1",
                                           "RELAX_REPLAY_CAPTURE_DIR": str(root / name), **env}
        plan.append((name, argv, capture))
    done = subprocess.run([sys.executable, "-c", DRIVER, str(REPO), json.dumps(plan), ",".join(SCANNED),
                           str(root / "refused")], cwd=REPO,
                          capture_output=True, text=True, timeout=480)
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
    assert sorted(scans) == sorted(n for n, (_, env) in VARIANTS.items() if env is not None)
    return root, results, scans, checks


def bundle_rows(runs, name: str, code: int) -> tuple[dict[str, dict], dict]:
    """The replay rows of a variant's bundles by path (and the whole report), its exit code checked."""
    got, report = runs[2][name]
    assert got == code, report.get("summary")
    return {b["path"]: b for b in report["bundles"]}, report


def statuses(report: dict) -> dict[str, str]:
    return {b["path"]: b["status"] for b in report["bundles"]}


def stage_status(row: dict) -> dict[str, str]:
    return {s["stage"]: s["status"] for s in row["report"]["stages"]}


def test_capture_changes_nothing_in_training(runs):
    _, results, _, _ = runs
    assert results["off"]["capture"] is None
    assert results["clean"]["weights_sha256"] == results["off"]["weights_sha256"]


@pytest.mark.parametrize("name, bundles", [
    # 4 steps, GAS 2, SPG 2, 2 iterations: each generation of 2 prompts × 4 completions feeds
    # 2 passes × 2 micro-batches = 2 optimizer steps → rollouts 0..1, steps R:0 and R:1
    ("clean", ["rollout-0", "rollout-1", "step-0-0", "step-0-1", "step-1-0", "step-1-1"]),
    # one pass: one step per generation → 4 rollouts
    ("one-pass", ["rollout-0", "rollout-1", "rollout-2", "rollout-3",
                  "step-0-0", "step-1-0", "step-2-0", "step-3-0"]),
    ("grpo", ["rollout-0", "step-0-0", "step-0-1"]),
    ("dr_grpo", ["rollout-0", "step-0-0", "step-0-1"]),
    ("cispo", ["rollout-0", "step-0-0", "step-0-1"]),
    ("sapo", ["rollout-0", "step-0-0", "step-0-1"]),
    # GAS 1, SPG 1, 2 iterations: one micro-batch of 4 per step, a generation of one prompt per 2 steps
    ("bnpo", ["rollout-0", "step-0-0", "step-0-1"]),
    ("beta", ["rollout-0", "step-0-0", "step-0-1"]),
    ("batch-std", ["rollout-0", "step-0-0", "step-0-1"]),
    ("knobs", ["rollout-0", "step-0-0", "step-0-1"]),
    ("filtered", ["rollout-0", "step-1-1"]),
])
def test_every_bundle_replays_clean(runs, name, bundles):
    root, results, scans, _ = runs
    assert results[name]["capture"] == {"directory": str(root / name), "written": len(bundles), "dropped": 0,
                                         "errors": 0}
    code, report = scans[name]
    assert statuses(report) == dict.fromkeys(bundles, "pass"), report.get("summary")
    assert code == 0
    if name in SCANNED:  # stage link: every step bundle whose rollout bundle was captured too
        linked = [b for b in bundles if b.startswith("step-") and f"rollout-{b.split('-')[1]}" in bundles]
        assert sorted(link["step"] for link in report["links"]) == linked
        assert all(link["status"] == "pass" for link in report["links"])


def test_bundles_record_trl_and_its_version(runs):
    """The producer record names the framework and the installed TRL version (a mapping reads that version's
    semantics); inspect shows them."""
    import trl

    root = runs[0]
    reader = BundleReader(root / "clean" / "step-0-0")
    assert (reader.manifest.producer.framework, reader.manifest.producer.framework_version) == ("trl", trl.__version__)
    done = subprocess.run([sys.executable, "-m", "replay_lib", "inspect", str(root / "clean" / "step-0-0")],
                          capture_output=True, text=True, check=False, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if line.startswith("  producer")][0].endswith(
        f" framework=trl {trl.__version__}")


def _tensor(reader: BundleReader, name: str) -> torch.Tensor:
    return reader.payload(name).to(torch.float64)


def _trl_loss(reader: BundleReader) -> float:
    """TRL's loss of a captured step, recomputed here in float64 from the bundle's inputs
    (grpo_trainer.py:3083-3173): coef_1 = exp(logp − old); per_token_loss = −min(coef_1·A, clamp(coef_1,
    1−ε, 1+ε_high)·A) + β·(exp(ref − logp) − (ref − logp) − 1); then per loss type over the step's tokens:
    dapo Σ x·m / (num_items_in_batch / P · GAS / SPG), grpo Σ_i mean_i / (B·GAS), dr_grpo Σ x·m / (B·GAS·L),
    bnpo Σ x·m / Σ m (GAS 1)."""
    cfg = reader.index.config
    logp, old, adv = _tensor(reader, "log_probs"), _tensor(reader, "old_log_probs"), _tensor(reader, "advantages")
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - cfg.eps_clip, 1 + cfg.eps_clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if cfg.policy_loss == "cispo":  # −min(coef_1, epsilon_high)·A·logp (:3109-3111)
        per_token = -torch.clamp(ratio, max=cfg.eps_clip_high) * adv * logp
    elif cfg.policy_loss == "sapo":  # −σ(τ·(coef_1 − 1))·4/τ·A, τ by the sign of A (:3121-3124)
        tau = torch.where(adv > 0, cfg.policy_loss_params["tau_pos"], cfg.policy_loss_params["tau_neg"])
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    if cfg.use_kl_loss:
        d = _tensor(reader, "ref_log_probs") - logp
        per_token = per_token + cfg.kl_loss_coef * (torch.exp(d) - d - 1)
    total, means, tokens = 0.0, 0.0, 0
    start = 0
    for i, s in enumerate(reader.index.samples):
        m = torch.tensor(reader.sample_mask(i), dtype=torch.float64)
        x = float((per_token[start:start + s.response_length] * m).sum())
        total, means, tokens = total + x, means + x / max(float(m.sum()), 1.0), tokens + int(m.sum())
        start += s.response_length
    if cfg.loss_agg_mode == "token_mean":  # dapo (scale P·SPG/GAS) or bnpo (the micro-batch's own tokens)
        return cfg.loss_scale * total / cfg.loss_token_count
    if cfg.loss_agg_mode == "seq_mean_token_mean":
        return means / cfg.loss_seq_count
    return total / (cfg.loss_seq_count * cfg.loss_horizon)


@pytest.mark.parametrize("name, mode, count", [
    ("clean", "token_mean", None), ("grpo", "seq_mean_token_mean", 8), ("dr_grpo", "seq_mean_token_sum_norm", 8),
    ("bnpo", "token_mean", None), ("beta", "token_mean", None), ("cispo", "token_mean", None),
    ("sapo", "seq_mean_token_mean", 8),
])
def test_recorded_loss_is_trls_formula_on_the_recorded_inputs(runs, name, mode, count):
    root, _, scans, _ = runs
    steps = sorted(p for p in (root / name).iterdir() if p.name.startswith("step-"))
    assert steps
    for path in steps:
        reader = BundleReader(path)
        cfg = reader.index.config
        assert cfg.loss_agg_mode == mode
        rollout = BundleReader(root / name / f"rollout-{path.name.split('-')[1]}")
        if name in ("clean", "beta", "cispo"):
            # dapo: T = num_items_in_batch = every loss-mask token of the generation batch (1 process), and
            # P·SPG/GAS = 1·2/2 = 1
            assert cfg.loss_token_count == int(rollout.packed_mask.sum())  # format 1.3.0: the masks packed
            assert cfg.loss_scale == 1.0
        elif name == "bnpo":  # GAS 1: the step's one micro-batch of 4 samples is its own token count
            assert len(reader.index.samples) == 4
            assert cfg.loss_token_count == int(reader.packed_mask.sum())
        else:  # B·GAS = 4·2; dr_grpo's L = max_completion_length = 6
            assert cfg.loss_seq_count == count and len(reader.index.samples) == count
            assert cfg.loss_horizon == (6 if name == "dr_grpo" else None)
        recorded = reader.expected["loss.policy"]["loss"]
        assert math.isclose(_trl_loss(reader), recorded, rel_tol=1e-5, abs_tol=1e-6), (path.name, recorded)
        if name == "beta":
            assert reader.has_payload("ref_log_probs") and cfg.kl_loss_coef == 0.1


@pytest.mark.parametrize("name", ["clean", "one-pass", "grpo"])
def test_rollout_records_trls_rewards_groups_and_normalization(runs, name):
    root, _, scans, _ = runs
    for path in sorted((root / name).glob("rollout-*")):
        reader = BundleReader(path)
        samples = reader.index.samples
        expected = reader.expected
        # TRL's order and grouping: s-0 … s-7, view(-1, num_generations=4) → groups 0,0,0,0,1,1,1,1
        assert [s.sample_id for s in samples] == [f"s-{i}" for i in range(8)]
        assert [s.group_index for s in samples] == [0, 0, 0, 0, 1, 1, 1, 1]
        per_func = expected["reward.raw"]["rewards_per_func"]
        assert expected["reward.raw"]["reward_weights"] == [1.0, 0.5]
        # raw reward = odd digits + 0.5 · (ended with <eos>): exact in float32 (halves of small integers)
        raw = [per_func[2 * i] + 0.5 * per_func[2 * i + 1] for i in range(8)]
        assert [s.raw_reward for s in samples] == raw == expected["reward.raw"]["raw_rewards"]
        assert all(float(r).is_integer() and r >= 0 for r in per_func[0::2]) and set(per_func[1::2]) <= {0.0, 1.0}
        # TRL's normalization (:2765-2787): (r − mean_group) / (Bessel std_group + 1e-4), here in float64
        for g in (0, 1):
            r = torch.tensor(raw[4 * g:4 * g + 4], dtype=torch.float64)
            want = (r - r.mean()) / (r.std(unbiased=True) + 1e-4)
            got = torch.tensor(expected["reward.post_process"]["rewards"][4 * g:4 * g + 4], dtype=torch.float64)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (path.name, g)
        # per-token advantages = each sample's normalized reward over its completion tokens
        adv = reader.payload("advantages").tolist()
        spread = [x for s, a in zip(samples, expected["reward.post_process"]["rewards"]) for x in
                  [a] * s.response_length]
        assert adv == pytest.approx(spread, abs=0.0)
        assert reader.payload("kl").abs().sum().item() == 0.0


def test_batch_scaled_rewards_are_trls_group_mean_over_the_batch_std(runs):
    # scale_rewards="batch" (:2774-2787): (r − mean_group) / (Bessel std of all 8 rewards + 1e-4), in float64 here
    root = runs[0]
    reader = BundleReader(root / "batch-std" / "rollout-0")
    assert reader.index.config.grpo_std_scope == "batch"
    raw = torch.tensor([s.raw_reward for s in reader.index.samples], dtype=torch.float64)
    assert [s.group_index for s in reader.index.samples] == [0, 0, 0, 0, 1, 1, 1, 1]
    mean = raw.view(2, 4).mean(dim=1).repeat_interleave(4)
    want = (raw - mean) / (raw.std(unbiased=True) + 1e-4)
    got = torch.tensor(reader.expected["reward.post_process"]["rewards"], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # the group std would give other values here (the groups' stds differ from the batch's)
    group = (raw - mean) / (raw.view(2, 4).std(dim=1, unbiased=True).repeat_interleave(4) + 1e-4)
    assert not torch.allclose(got, group, rtol=1e-3, atol=1e-3)


def test_old_log_probs_without_trls_recompute_are_the_first_forward(runs):
    """One pass (GAS 2 % generate_every 2 == 0, grpo_trainer.py:2643): TRL computes no old log-probs and uses
    the detached current ones (:3066); the rollout bundle records exactly the step's log-probs."""
    root, _, scans, _ = runs
    rollout = BundleReader(root / "one-pass" / "rollout-2")
    step = BundleReader(root / "one-pass" / "step-2-0")
    assert torch.equal(step.payload("old_log_probs"), step.payload("log_probs"))
    by_id = {}
    start = 0
    for s in step.index.samples:
        by_id[s.sample_id] = step.payload("log_probs")[start:start + s.response_length]
        start += s.response_length
    start = 0
    for s in rollout.index.samples:
        assert torch.equal(rollout.payload("old_log_probs")[start:start + s.response_length], by_id[s.sample_id])
        start += s.response_length


def test_batch_normalized_rewards_fail_first_at_reward_raw(runs):
    """The reward functions' scores normalized over the whole batch before TRL's group normalization: the
    rewards TRL normalized are not the scores the functions returned (reward.raw), while TRL's normalization
    of what it was given is right (reward.post_process passes on the recorded raw rewards)."""
    rows, report = bundle_rows(runs, "batch-normalized-rewards", 1)
    assert rows["rollout-0"]["first_stage"] == "reward.raw"
    stages = stage_status(rows["rollout-0"])
    assert (stages["reward.raw"], stages["reward.post_process"], stages["advantage.estimate"]) == \
        ("fail", "pass", "pass")
    reader = BundleReader(runs[0] / "batch-normalized-rewards" / "rollout-0")
    actual = torch.tensor([s.raw_reward for s in reader.index.samples], dtype=torch.float64)
    # what TRL normalized: per function (r − mean)/(std + 1e-6), weighted 1 and 0.5 → a weighted sum of
    # zero-mean columns has mean 0 over the batch (to float32 rounding)
    assert abs(float(actual.mean())) < 1e-6
    assert [rows[p]["status"] for p in ("step-0-0", "step-0-1")] == ["pass", "pass"]
    # explained from the recorded values: each reward function's column standardized, the recorded sum of the
    # scores as returned an affine image of them (the scores' std × weight: 1.389, 0.2588)
    [e] = rows["rollout-0"]["report"]["explanations"]
    assert (e["stage"], e["hypothesis"], e["matched"], e["of"]) == ("reward.raw", "reward.raw_batch_normalized", 8, 8)
    assert e["detail"] == (
        "the rewards the trainer normalized are each of the 2 reward functions' scores normalized over the whole "
        "batch of 8 samples ((s − mean)/std) before its group normalization; the recorded raw_rewards (the scores "
        "as returned) are their affine image (weight·std 1.389, 0.2588; offset 2.437)")


def test_shuffled_advantages_fail_first_at_advantage_estimate(runs):
    """Advantages rolled by one sample inside each micro-batch: the rollouts are clean; each step's first
    divergence is advantage.estimate (the consumed advantages are not the samples' normalized rewards), and
    loss.policy, judged on what the loss consumed, passes; the link stage sees the same samples differ."""
    rows, report = bundle_rows(runs, "shuffled-advantages", 1)
    assert rows["rollout-0"]["status"] == "pass"
    for path in ("step-0-0", "step-0-1"):
        assert rows[path]["first_stage"] == "advantage.estimate"
        stages = stage_status(rows[path])
        assert (stages["advantage.estimate"], stages["loss.policy"]) == ("fail", "pass")
    assert [link["status"] for link in report["links"]] == ["diverged", "diverged"]


def test_a_wrong_denominator_fails_loss_policy(runs):
    """Control: the same dapo run captured with a mapping that claims a sum of per-sample means — only the
    loss's denominator is wrong, and only loss.policy fails."""
    rows, report = bundle_rows(runs, "wrong-mapping", 1)
    assert rows["rollout-0"]["status"] == "pass"
    for path in ("step-0-0", "step-0-1"):
        assert rows[path]["first_stage"] == "loss.policy"


def test_untested_trl_version_is_refused_in_one_line(runs):
    checks = runs[3]
    assert checks["untested"] == ("capture.integrations.trl is tested with trl==1.16.0 only, found trl 1.17.0: "
                                  "install the tested version (pip install -e '.[trl]')")


def test_the_extra_pins_the_tested_versions(runs):
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trl"]
    assert sorted(extra) == sorted(f"{name}=={version}" for name, version in runs[3]["tested"].items())
    import trl

    assert trl.__version__ == runs[3]["tested"]["trl"]


def test_only_a_grpo_trainer_is_instrumented(runs):
    assert runs[3]["not_a_trainer"] == "enable_replay_capture needs a trl.GRPOTrainer, got object"


def test_an_unrecomputable_config_is_refused_before_training(runs):
    root, _, _, checks = runs
    assert checks["refused"] == ["UnsupportedFrameworkConfig", "TRL config: delta=1.0: at or below 1 the cap clips "
                                 "the ratio below the unclipped 1 on both sides (TRL recommends delta > 1 + epsilon); "
                                 "not recomputed"]
    assert not (root / "refused").exists()


# What the "knobs" run gave GRPOConfig (examples/trl_grpo.py): bnpo, GAS 2, beta 0.1 with
# use_bias_correction_kl, epsilon 0.2 / epsilon_high 0.28, delta 1.3, entropy_coef 0.05.
KNOBS_RUN = {"gas": 2, "beta": 0.1, "epsilon": 0.2, "epsilon_high": 0.28, "delta": 1.3, "entropy_coef": 0.05}


def _trl_bnpo_loss(reader: BundleReader, args: dict) -> float:
    """TRL 1.16's loss of a bnpo step with the knobs of ``args`` (the GRPOConfig values, not the bundle's mapped
    config), written from ``_compute_loss`` in float64 on the bundle's recorded inputs: coef_1 = exp(logp − old)
    (:3083-3094); per_token_kl = (exp(ref − logp) − (ref − logp) − 1) · coef_1 (use_bias_correction_kl,
    :3099-3105); coef_2 = clamp(coef_1, 1 − ε, 1 + ε_high), then coef_1 = clamp(coef_1, max=delta) (:3113-3116);
    per_token_loss = −min(coef_1·A, coef_2·A) + beta·per_token_kl (:3118-3150); each micro-batch's
    Σ x·m / max(Σ m, 1) / GAS (:3158-3162) minus entropy_coef · Σ H·m / max(Σ m, 1) / GAS (:3196-3211), summed
    over the step's micro-batches."""
    logp, old, adv = _tensor(reader, "log_probs"), _tensor(reader, "old_log_probs"), _tensor(reader, "advantages")
    ref, entropy = _tensor(reader, "ref_log_probs"), _tensor(reader, "entropy")
    coef_1 = torch.exp(logp - old)
    kl = (torch.exp(ref - logp) - (ref - logp) - 1) * coef_1
    coef_2 = torch.clamp(coef_1, 1 - args["epsilon"], 1 + args["epsilon_high"])
    capped = torch.clamp(coef_1, max=args["delta"])
    per_token = -torch.minimum(capped * adv, coef_2 * adv) + args["beta"] * kl
    batches: dict = {}
    start = 0
    for i, s in enumerate(reader.index.samples):
        m = torch.tensor(reader.sample_mask(i), dtype=torch.float64)
        span = slice(start, start + s.response_length)
        acc = batches.setdefault(s.micro_batch_id, [0.0, 0.0, 0.0])
        acc[0] += float((per_token[span] * m).sum())
        acc[1] += float((entropy[span] * m).sum())
        acc[2] += float(m.sum())
        start += s.response_length
    assert len(batches) == args["gas"]
    return sum(x / max(n, 1.0) / args["gas"] - args["entropy_coef"] * h / max(n, 1.0) / args["gas"]
               for x, h, n in batches.values())


def test_knobs_run_records_trls_loss_and_reaches_every_knob(runs):
    """The recorded loss of each step is TRL's formula with the run's GRPOConfig values; the second pass (ratio
    ≠ 1) has tokens capped at delta (ratio > 1.3 with a negative advantage), so every knob is exercised."""
    root = runs[0]
    for name in ("step-0-0", "step-0-1"):
        reader = BundleReader(root / "knobs" / name)
        cfg = reader.index.config
        assert (cfg.loss_agg_mode, cfg.entropy_agg_mode, cfg.entropy_coef) == \
            ("micro_batch_token_mean", "micro_batch_token_mean", 0.05)
        assert (cfg.kl_loss_coef, cfg.kl_loss_ratio_weighted, cfg.eps_clip_c) == (0.1, True, 1.3)
        assert [s.micro_batch_id for s in reader.index.samples] == ["mb-0000"] * 4 + ["mb-0001"] * 4
        recorded = reader.expected["loss.policy"]["loss"]
        assert math.isclose(_trl_bnpo_loss(reader, KNOBS_RUN), recorded, rel_tol=1e-5, abs_tol=1e-6), \
            (name, recorded)
    reader = BundleReader(root / "knobs" / "step-0-1")
    ratio = torch.exp(_tensor(reader, "log_probs") - _tensor(reader, "old_log_probs"))
    mask = reader.packed_mask.to(torch.bool)  # format 1.3.0: every sample's mask, flat
    capped = (ratio > KNOBS_RUN["delta"]) & (_tensor(reader, "advantages") < 0) & mask
    assert int(capped.sum()) > 0


@pytest.mark.parametrize("knob, value", [
    ("kl_loss_ratio_weighted", False),  # the KL not multiplied by the ratio (use_bias_correction_kl=False)
    ("eps_clip_c", None),  # delta ignored
    ("entropy_coef", 0.0),  # the entropy bonus left out
])
def test_a_knob_mapped_wrong_fails_loss_policy(runs, tmp_path, bundle_tools, knob, value):
    """Control: the knobs run's second step with one mapped knob undone: loss.policy (the only stage the
    knob enters) is the first divergence, and the explanations (which re-aggregate under each other mode, the
    samples' micro-batch partition included) do not crash; the bundle as captured passes
    (test_every_bundle_replays_clean)."""
    import contextlib
    import io
    import shutil

    from replay_lib.cli import main

    path = tmp_path / "step"
    shutil.copytree(runs[0] / "knobs" / "step-0-1", path)

    def edit(doc):
        if value is None:
            doc["config"].pop(knob, None)
        else:
            doc["config"][knob] = value

    bundle_tools.edit_json(path, "index.json", edit)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["replay", str(path), "--format", "json"])
    report = json.loads(out.getvalue())
    assert (code, report["first_divergent_stage"]) == (1, "loss.policy")


def test_without_vllm_no_rollout_log_probs_are_recorded(runs):
    """On CPU without vLLM TRL's own generate() returns no sampling log-probs (grpo_trainer.py:1889): there is
    nothing to record, and the bundles hold no ``rollout_log_probs`` (so no logprob.mismatch stage runs)."""
    root = runs[0]
    for name in ("rollout-0", "step-0-0"):
        reader = BundleReader(root / "clean" / name)
        assert not reader.has_payload("rollout_log_probs"), name
