"""``trajectory-replay replay`` through the real CLI: the seed's PR #65 report, ``--format json`` keys,
``--stage``, and the topology refusals (exit 4, the knob named in one stderr line).

A few cases run the installed console script as a real process; the many refusal cases call the same
``main(argv)`` in-process (a fresh process per case would only add interpreter start-up time).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest

from replay_lib.demo import ALL_STAGES, ROLLOUT_STAGES, synthetic_parts, write_bundle, write_pr65
from replay_lib.bundle.schema import RecomputeConfig

SEED_LINES = [
    "bundle b-00001 — first divergent stage: reward.post_process",
    "[   pass] sample",
    "[   pass] reward.raw",
    "[   fail] reward.post_process — normalized reward mismatch in 4 sample(s)",
    "          reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5",
]
DIVERGENCE_KEYS = {"stage", "rank", "sample_id", "group_index", "field", "token_offset", "expected", "actual",
                   "abs_error"}
STAGE_KEYS = {"stage", "status", "reason", "mismatches", "max_abs_error", "divergences"}


def run_process(*args: str, exe: str = "trajectory-replay") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def pr65(tmp_path_factory):
    root = tmp_path_factory.mktemp("pr65")
    return write_pr65(root / "pr65-buggy", buggy=True), write_pr65(root / "pr65-fixed", buggy=False,
                                                                   bundle_id="b-00001-fixed")


@pytest.fixture(scope="module")
def buggy_run(pr65):
    return run_process("replay", pr65[0])


# ----------------------------------------------------------------------------------- PR #65 report


def test_pr65_buggy_bundle_prints_the_seed_report_and_exits_1(buggy_run):
    proc = buggy_run
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[:5] == SEED_LINES
    # the remaining divergences of the stage follow, then the later stages
    assert lines[5:9] == [
        "          reward s-1: expected=-3.5 actual=1.0 abs_err=4.5",
        "          reward s-2: expected=3.5 actual=-1.0 abs_err=4.5",
        "          reward s-3: expected=5.5 actual=1.0 abs_err=4.5",
        # SPEC §10: the mean of [1, 3, 10, 12] is 6.5, so the whole batch's centering gives [-5.5, -3.5, 3.5, 5.5]
        "          likely cause: the recorded rewards equal group normalization over the whole batch of 4 samples "
        "(not semantic groups) — 4/4 samples",
    ]
    # teacher forcing (SPEC §4): the stages after the wrong one consumed its recorded output faithfully and pass
    assert lines[9:] == [
        "[   pass] advantage.kl",
        "[   pass] advantage.estimate",
        "[skipped] loss.policy — not declared in manifest",
        "[skipped] loss.value — capability unsupported",
    ]
    assert "\x1b[" not in proc.stdout  # a pipe gets plain text


def test_chain_recomputes_end_to_end(cli, pr65):
    code, out, err = cli("replay", pr65[0], "--chain")
    assert (code, err) == (1, "")
    lines = out.splitlines()
    assert lines[:5] == SEED_LINES
    # it passes on its recorded inputs: marked downstream of the root cause, not a second one
    assert ("[downstream] advantage.estimate — advantage mismatch in 12 token(s) of 4 sample(s) (downstream of "
            "reward.post_process: passes on its recorded inputs)") in lines
    assert "          advantage s-0@0: expected=-5.5 actual=-1.0 abs_err=4.5" in lines
    assert "          ... 7 more; max abs_err=4.5" in lines
    code, out, _ = cli("replay", pr65[0], "--chain", "--format", "json")
    assert json.loads(out)["mode"] == "chained"


def test_pr65_fixed_bundle_exits_0(pr65):
    proc = run_process("replay", pr65[1])
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.splitlines() == [
        "bundle b-00001-fixed — no divergence (5 stage(s) compared)",
        "[   pass] sample",
        "[   pass] reward.raw",
        "[   pass] reward.post_process",
        "[   pass] advantage.kl",
        "[   pass] advantage.estimate",
        "[skipped] loss.policy — not declared in manifest",
        "[skipped] loss.value — capability unsupported",
    ]


def test_replay_tui_check_prints_the_same_report(pr65, buggy_run):
    proc = run_process(pr65[0], "--check", exe="replay-tui")
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == buggy_run.stdout


def test_json_report_keys_are_the_spec_api(pr65):
    proc = run_process("replay", pr65[0], "--format", "json")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert {"bundle_id", "passed", "first_divergent_stage", "first_divergence", "stages"} <= set(doc)
    assert (doc["bundle_id"], doc["passed"], doc["first_divergent_stage"]) == ("b-00001", False, "reward.post_process")
    first = doc["first_divergence"]
    assert DIVERGENCE_KEYS <= set(first)
    assert {k: first[k] for k in DIVERGENCE_KEYS} == {
        "stage": "reward.post_process", "rank": None, "sample_id": "s-0", "group_index": 0, "field": "reward",
        "token_offset": None, "expected": -5.5, "actual": -1.0, "abs_error": 4.5,
    }
    assert [(s["stage"], s["status"]) for s in doc["stages"]] == [
        ("sample", "pass"), ("reward.raw", "pass"), ("reward.post_process", "fail"), ("advantage.kl", "pass"),
        ("advantage.estimate", "pass"), ("loss.policy", "skipped"), ("loss.value", "skipped"),
    ]
    assert doc["mode"] == "per_stage"
    for stage in doc["stages"]:
        assert STAGE_KEYS <= set(stage)
        assert isinstance(stage["reason"], str) and isinstance(stage["mismatches"], int)
        for d in stage["divergences"]:
            assert DIVERGENCE_KEYS <= set(d)
    post = doc["stages"][2]
    assert (post["reason"], post["mismatches"], post["max_abs_error"]) == (
        "normalized reward mismatch in 4 sample(s)", 4, 4.5)
    assert [d["expected"] for d in post["divergences"]] == [-5.5, -3.5, 3.5, 5.5]
    assert doc["stages"][4]["divergences"] == [] and doc["stages"][4]["mismatches"] == 0
    assert doc["stages"][5]["max_abs_error"] is None and doc["stages"][5]["divergences"] == []


def test_json_report_of_a_passing_bundle(cli, pr65):
    code, out, err = cli("replay", pr65[1], "--format", "json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert (doc["passed"], doc["first_divergent_stage"], doc["first_divergence"]) == (True, None, None)


def test_max_divergences_limits_the_lines_per_stage(cli, pr65):
    code, out, _ = cli("replay", pr65[0], "--max-divergences", "1")
    assert code == 1
    lines = out.splitlines()
    assert lines[3:6] == [SEED_LINES[3], SEED_LINES[4], "          ... 3 more; max abs_err=4.5"]
    code, _, err = cli("replay", pr65[0], "--max-divergences", "0")
    assert code == 2 and err == "trajectory-replay: error: --max-divergences must be at least 1\n"


# ------------------------------------------------------------------------------------------ --stage


def test_stage_advantage_kl_runs_only_sample_and_kl(cli, pr65):
    code, out, err = cli("replay", pr65[0], "--stage", "advantage.kl")
    assert (code, err) == (0, "")  # the reward bug is outside the requested stages
    assert out.splitlines() == [
        "bundle b-00001 — no divergence (2 stage(s) compared)",
        "[   pass] sample",
        "[skipped] reward.raw — not requested (--stage)",
        "[skipped] reward.post_process — not requested (--stage)",
        "[   pass] advantage.kl",
        "[skipped] advantage.estimate — not requested (--stage)",
        "[skipped] loss.policy — not requested (--stage)",
        "[skipped] loss.value — not requested (--stage)",
    ]


def test_stage_pulls_in_what_it_consumes(cli, pr65):
    code, out, _ = cli("replay", pr65[0], "--stage", "advantage.estimate", "--format", "json")
    doc = json.loads(out)
    assert code == 1
    assert [s["stage"] for s in doc["stages"] if s["status"] != "skipped"] == [
        "sample", "reward.raw", "reward.post_process", "advantage.estimate"]
    code, _, _ = cli("replay", pr65[0], "--stage", "reward.raw", "--stage", "advantage.kl")
    assert code == 0


def test_stage_loss_value_declared_unsupported_is_refused(cli, pr65):
    # loss.value is recomputed (stages/value.py) where a bundle declares it recompute; PR #65's declares it
    # unsupported, as every V1 producer does
    code, out, err = cli("replay", pr65[0], "--stage", "loss.value")
    assert (code, out) == (4, "")
    assert err.startswith("trajectory-replay: error: stage loss.value is declared unsupported in ")
    assert err.endswith("manifest.json; only recompute stages can be replayed\n")


def test_stage_not_declared_is_unsupported(cli, pr65):
    code, _, err = cli("replay", pr65[0], "--stage", "loss.policy")
    assert code == 4
    assert "stage loss.policy is not declared in" in err and "manifest.json" in err


def test_unknown_stage_is_a_usage_error(cli, pr65):
    code, out, err = cli("replay", pr65[0], "--stage", "bogus")
    assert (code, out) == (2, "")
    assert err.startswith("trajectory-replay: error: unknown stage 'bogus' (expected one of: all, sample, ")
    assert err.count("\n") == 1


# ---------------------------------------------------------------------------------- topology refusals


def bundle_with(tmp_path, *, stages=ALL_STAGES, rank=None, **config):
    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=3, group_size=2, stages=stages,
                                                          rank_sizes=rank)
    index = msgspec.structs.replace(index, config=msgspec.structs.replace(index.config, **config))
    return write_bundle(tmp_path / "bundle", manifest, index, expected, payloads)


# use_tis, use_kl_loss and eps_clip_c are recomputed now (SPEC §4.2): tests/test_loss_knobs.py.
REFUSALS = [
    # the advantage side of SPEC §4.2 is recomputed (tests/test_advantage_*.py); what stays out of reach refuses
    ({"advantage_estimator": "dppo"},
     "$.config.advantage_estimator='dppo': prime-rl's DPPO is a loss family outside the clipped surrogate"),
    ({"advantage_estimator": "decoupled_ppo"}, "$.config.advantage_estimator='decoupled_ppo': AReaL's decoupled loss"),
    ({"calculate_per_token_loss": True}, "$.config.calculate_per_token_loss=True: per-token loss aggregation"),
    ({"use_rollout_logprobs": True}, "$.config.use_rollout_logprobs=True: rollout log-probs as the PPO anchor"),
]


@pytest.mark.parametrize("config,message", REFUSALS, ids=[next(iter(c)) for c, _ in REFUSALS])
def test_unsupported_knob_exits_4_naming_it(tmp_path, cli, config, message):
    path = bundle_with(tmp_path, **config)
    code, out, err = cli("replay", path)
    assert (code, out) == (4, "")
    assert err.count("\n") == 1 and err.startswith("trajectory-replay: error: ")
    assert f"{path / 'index.json'}: {message}" in err
    assert "Traceback" not in err


def test_context_parallel_rank_is_refused(tmp_path, cli):
    path = bundle_with(tmp_path, rank={"dp": 1, "tp": 1, "pp": 1, "cp": 2})
    code, out, err = cli("replay", path)
    assert (code, out) == (4, "")
    assert err.count("\n") == 1 and err.startswith("trajectory-replay: error: ")
    assert f"{path / 'index.json'}: $.identity.rank.cp=2: V1 recomputes context-parallel size 1 only" in err


class FutureConfig(RecomputeConfig, frozen=True, kw_only=True):
    """A newer producer's config with a knob this engine does not know."""

    future_knob: object = None


def bundle_with_unknown_knob(tmp_path, value):
    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=3, group_size=2)
    config = FutureConfig(**msgspec.structs.asdict(index.config), future_knob=value)
    return write_bundle(tmp_path / "bundle", manifest, msgspec.structs.replace(index, config=config), expected, payloads)


@pytest.mark.parametrize("value,shown", [(True, "True"), (2, "2"), ("on", "'on'")])
def test_unknown_config_knob_with_a_truthy_value_exits_4(tmp_path, cli, value, shown):
    path = bundle_with_unknown_knob(tmp_path, value)
    assert f'"future_knob": {json.dumps(value)}' in (path / "index.json").read_text()
    code, out, err = cli("replay", path)
    assert (code, out) == (4, "")
    assert err == (f"trajectory-replay: error: {path / 'index.json'}: $.config.future_knob={shown}: "
                   f"unknown config knob; refusing to guess what it changes\n")


@pytest.mark.parametrize("value", [False, 0, None])
def test_unknown_config_knob_with_a_neutral_value_is_a_warning(tmp_path, cli, value):
    path = bundle_with_unknown_knob(tmp_path, value)
    code, out, err = cli("replay", path)
    assert (code, err) == (0, "")
    assert f"warning: index.json $.config.future_knob={value!r}: unknown knob with a neutral value (ignored)" in out


def test_loss_only_knob_does_not_block_the_reward_stages(tmp_path, cli):
    path = bundle_with(tmp_path, use_rollout_logprobs=True)
    assert cli("replay", path, "--stage", "reward.post_process")[0] == 0
    assert cli("replay", path, "--stage", "loss.policy")[0] == 4


def test_refusal_in_a_real_process_is_one_line_without_traceback(tmp_path):
    path = bundle_with(tmp_path, stages=ROLLOUT_STAGES, advantage_estimator="optimal_token_baseline")
    proc = run_process("replay", path)
    assert (proc.returncode, proc.stdout) == (4, "")
    assert proc.stderr == (f"trajectory-replay: error: {path / 'index.json'}: "
                           f"$.config.advantage_estimator='optimal_token_baseline': verl's optimal token baseline is "
                           f"not recomputed: it weights each token by 1 − 2·π(token) + Σ π² over the vocabulary, "
                           f"which a bundle does not record\n")


def test_help_documents_the_exit_codes():
    proc = subprocess.run([sys.executable, "-m", "replay_lib", "replay", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    for line in ("0  every compared stage passed", "1  a divergence was found", "2  bad command line",
                 "3  bundle invalid, incomplete, unsafe or ambiguous", "4  unsupported topology, stage or config knob"):
        assert line in proc.stdout
