"""Start-up: ``validate`` and ``replay`` open (verify) the bundle while torch imports on another thread, and a
bundle the checks that need no tensor refuse is reported without torch. Checked in a subprocess where torch
cannot be imported at all: the old path (torch imported before the bundle was looked at) died with exit 5."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

NO_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch blocked for this test")
sys.meta_path.insert(0, _NoTorch())
from replay_lib.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_cli(*argv: str, block_torch: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    code = NO_TORCH if block_torch else "import sys; from replay_lib.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def altered(tmp_path_factory) -> Path:
    from replay_lib.demo import write_demo

    path = write_demo("pr65-buggy", tmp_path_factory.mktemp("startup") / "pr65")
    with open(path / "index.json", "ab") as fh:
        fh.write(b" ")  # still JSON, no longer the recorded sha256
    return path


@pytest.mark.parametrize("command", ["validate", "replay"])
def test_a_refused_bundle_is_reported_without_torch(altered, command):
    proc = run_cli(command, str(altered), block_torch=True)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"trajectory-replay: error: {altered}/index.json: sha256 mismatch (COMPLETE ")


def test_a_usage_error_still_comes_before_the_refused_bundle(altered):
    proc = run_cli("replay", "--stage", "nope", str(altered), block_torch=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("trajectory-replay: error: unknown stage 'nope' (expected one of: all, sample, ")
    proc = run_cli("replay", "--max-divergences", "0", str(altered), block_torch=True)
    assert (proc.returncode, proc.stderr) == (2, "trajectory-replay: error: --max-divergences must be at least 1\n")


def test_a_good_bundle_still_replays_and_validates(altered, tmp_path):
    from replay_lib.demo import write_demo

    good = write_demo("pr65-buggy", tmp_path / "pr65")
    proc = run_cli("replay", str(good), block_torch=False)
    assert proc.returncode == 1
    assert proc.stdout.startswith("bundle b-00001 — first divergent stage: reward.post_process\n")
    proc = run_cli("validate", str(good), block_torch=False)
    assert proc.returncode == 0, proc.stderr
