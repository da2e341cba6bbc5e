"""The sample dumps of ``examples/dumps/``: ``scripts/make_sample_dumps.py`` writes exactly the committed bytes, and
the README's ``trajectory-replay import`` commands run as written (from a directory where ``examples/`` is the
repository's), each import then replaying clean on every stage its dump feeds. Real processes, real files."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DUMPS = REPO / "examples" / "dumps"
FILES = ["nemo-rl/grpo_math.yaml", "nemo-rl/train_data_step3.jsonl", "slime/args.json", "slime/rollout_7.pt",
         "slime/train_7_0.pt"]


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_script_writes_the_committed_dumps(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "make_sample_dumps.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(digests(tmp_path)) == FILES
    assert digests(tmp_path) == {f: v for f, v in digests(DUMPS).items() if f in FILES}


def readme_imports() -> list[str]:
    text = (REPO / "README.md").read_text()
    return [line for line in text.splitlines() if line.startswith("trajectory-replay import ")]


# (framework, bundle, what the import prints, the replay's stage statuses)
EXPECTED = {
    "slime": ("slime-7", "wrote slime-7 (bundle slime-7: 8 sample(s) in 2 group(s), 28 token(s))",
              {"sample": "pass", "reward.raw": "pass", "reward.post_process": "pass", "advantage.kl": "pass",
               "advantage.estimate": "pass", "loss.policy": "skipped", "loss.value": "skipped"}),
    "nemo-rl": ("nemo-3", "wrote nemo-3 (bundle nemo-3: 8 sample(s) in 2 group(s), 28 token(s))",
                {"sample": "pass", "reward.raw": "pass", "reward.post_process": "pass", "advantage.kl": "skipped",
                 "advantage.estimate": "pass", "loss.policy": "skipped", "loss.value": "skipped"}),
}


def test_the_readme_names_both_importers():
    assert [line.split()[2] for line in readme_imports()] == ["slime", "nemo-rl"]


@pytest.mark.parametrize("with_config", [False, True])
@pytest.mark.parametrize("framework", ["slime", "nemo-rl"])
def test_readme_import_commands_run_as_written(tmp_path, framework, with_config):
    """The README's line, its optional ``[--config FILE]`` left out or given, run by the installed CLI's module."""
    line = next(line for line in readme_imports() if line.split()[2] == framework)
    optional = re.search(r"\[(.*)\]", line)
    assert optional is not None and optional.group(1).startswith("--config examples/dumps/")
    command = line.replace(optional.group(0), optional.group(1) if with_config else "")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    argv = shlex.split(command)
    assert argv[0] == "trajectory-replay"
    run = [sys.executable, "-m", "replay_lib", *argv[1:]]
    done = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    bundle, wrote, stages = EXPECTED[framework]
    assert done.returncode == 0, done.stderr
    assert wrote in done.stdout.splitlines()
    note = "note: n_samples_per_prompt=4: the most common group size"
    assert (note in done.stdout) is not with_config  # the config gives the group size
    replay = subprocess.run([sys.executable, "-m", "replay_lib", "replay", bundle, "--format", "json"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr
    assert {s["stage"]: s["status"] for s in json.loads(replay.stdout)["stages"]} == stages
