"""Rough edges a new user hit in the command-line tools (issue: "The debugger explains", §4 help texts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from replay_lib.demo import write_cohort, write_pr65
from replay_lib.bundle.schema import RecomputeConfig, config_changes


def test_replay_tui_help_describes_the_debugger_exit_codes_only():
    out = subprocess.run([sys.executable, "-m", "replay_tui", "--help"], capture_output=True, text=True, check=True)
    epilog = out.stdout[out.stdout.index("exit codes (on quitting"):]
    # worded for the debugger: nothing about validate or inspect, every code of the API and 130
    assert "validate" not in epilog and "inspect" not in epilog
    codes = [line.split()[0] for line in epilog.splitlines()[1:] if line.split() and line.split()[0].isdigit()]
    assert codes == ["0", "1", "2", "3", "4", "5", "130"]


def test_inspect_elides_a_long_micro_batch_list(tmp_path, cli, bundle_tools):
    b = write_pr65(tmp_path / "b")
    ids = [f"mb-{i:04d}" for i in range(64)]
    bundle_tools.edit_json(b, "index.json", lambda doc: doc["identity"].__setitem__("micro_batch_ids", ids))
    code, out, _ = cli("inspect", b)
    assert code == 0
    line = next(x for x in out.splitlines() if "micro_batch_ids" in x)
    # the first 8 ids, then the count of the other 56 — not 64 ids on one line
    assert line.split(None, 1)[1] == "mb-0000, mb-0001, mb-0002, mb-0003, mb-0004, mb-0005, mb-0006, mb-0007 … (+56)"


def test_inspect_lists_the_core_knobs_and_only_the_changed_others(tmp_path, cli, bundle_tools):
    b = write_pr65(tmp_path / "b")
    bundle_tools.edit_json(b, "index.json", lambda doc: doc["config"].update(grpo_std_eps=1e-4))
    code, out, _ = cli("inspect", b)
    line = next(x for x in out.splitlines() if x.strip().startswith("config"))
    n_knobs = len(RecomputeConfig.__struct_fields__)
    import msgspec
    n_unset = sum(f.default is msgspec.UNSET for f in msgspec.structs.fields(RecomputeConfig))
    # 8 core knobs + the one changed knob are listed; the other recorded ones are counted, and the optional knobs
    # the bundle does not write (their default unset) are said to be not recorded (never shown as if they were)
    assert n_unset >= 6
    assert line.endswith(f", grpo_std_eps=0.0001 (+{n_knobs - 9 - n_unset} knobs at their defaults; "
                         f"{n_unset} not recorded)")
    assert line.split()[1] == "advantage_estimator=grpo,"


def test_config_changes_keeps_core_knobs_and_non_defaults():
    assert config_changes(RecomputeConfig(loss_agg_mode="token_mean", eps_clip=0.3)) == {
        "advantage_estimator": "grpo", "n_samples_per_prompt": 1, "grpo_std_normalization": False,
        "kl_loss_type": "k1", "kl_coef": 0.0, "eps_clip": 0.3, "eps_clip_high": 0.2, "entropy_coef": 0.0,
        "loss_agg_mode": "token_mean"}


def test_a_bare_sample_id_on_a_cohort_suggests_the_rank_prefixed_ones(tmp_path, cli):
    c = write_cohort(tmp_path / "c", samples=4, tokens=3)
    code, _, err = cli("replay", c, "--sample", "s-0")
    assert code == 3
    assert err.strip().endswith("--sample s-0: not found in any rank shard (did you mean r0-s-0, r1-s-0?)")
    code, _, err = cli("replay", c, "--sample", "zz")
    assert code == 3 and err.strip().endswith("--sample zz: not found in any rank shard")


def test_demo_write_all_into_a_file_says_it_is_not_a_directory(tmp_path, cli):
    target = tmp_path / "afile"
    target.write_text("mine\n")
    code, out, err = cli("demo", "write-all", target)
    assert (code, out) == (2, "")
    assert err == (f"trajectory-replay: error: {target}: not a directory (demo write-all writes one subdirectory "
                   f"per demo in DIR)\n")
    assert target.read_text() == "mine\n"
    help_text = subprocess.run([sys.executable, "-m", "replay_lib", "demo", "write-all", "--help"],
                               capture_output=True, text=True, check=True).stdout
    assert "a directory to write them in, one subdirectory each" in " ".join(help_text.split())


def test_a_checksum_mismatch_names_the_sentinel_that_records_it(tmp_path, cli):
    b = write_pr65(tmp_path / "b", buggy=True)
    (b / "index.json").write_bytes((b / "index.json").read_bytes().replace(b'"raw_reward": 1.0', b'"raw_reward": 2.0', 1))
    code, _, err = cli("validate", b)
    assert code == 3 and f"{b / 'index.json'}: sha256 mismatch (COMPLETE " in err


def test_inspect_words_a_schema_problem_as_validate_does(tmp_path, cli, bundle_tools):
    b = write_pr65(tmp_path / "b", buggy=True)
    bundle_tools.edit_json(b, "index.json", lambda d: d["samples"][3].update(loss_mask="oops"))
    code, out, _ = cli("inspect", b)
    assert code == 0 and "problem: index.json: $.samples[3].loss_mask: expected `array`, got `str`" in out
    code, _, err = cli("validate", b)
    assert code == 3 and err.endswith("index.json: $.samples[3].loss_mask: expected `array`, got `str`\n")


def test_a_zero_json_cap_is_a_usage_error(tmp_path):
    b = write_pr65(tmp_path / "b", buggy=True)
    out = subprocess.run([sys.executable, "-m", "replay_lib", "replay", str(b), "--max-json-bytes", "0"],
                         capture_output=True, text=True)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.strip().endswith("argument --max-json-bytes: expected a positive size in bytes such as 67108864, "
                                       "64M or 2G, got '0'")


def test_every_spec_section_the_docs_cite_is_in_the_shipped_spec():
    """README, --help texts and docstrings cite "SPEC §N": docs/SPEC.md ships with the project and holds each
    section cited (a user once found the citations but no SPEC)."""
    import re

    root = Path(__file__).resolve().parents[1]
    spec = (root / "docs" / "SPEC.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", spec, re.M))
    sources = [root / "README.md", *sorted((root / "replay_lib").rglob("*.py")), *sorted((root / "replay_tui").rglob("*.py")),
               *sorted((root / "capture").rglob("*.py"))]
    cited = {m for path in sources for m in re.findall(r"SPEC §(\d+(?:\.\d+)?)", path.read_text(encoding="utf-8"))}
    assert cited and cited <= sections, sorted(cited - sections)
    assert "docs/SPEC.md" in (root / "README.md").read_text(encoding="utf-8")
