"""The ``nemo-loo`` demo (NeMo-RL's leave-one-out GRPO): a zero-std group reported as a hazard beside a real
divergence, written and replayed by the real CLI in real processes (``demo write nemo-loo DIR``, ``demo
write-all``, ``replay``), and opened by ``replay-tui --demo nemo-loo --check``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def cli(*args: str, module: str = "replay_lib") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=180)


def test_nemo_loo_demo_shows_a_hazard_beside_a_divergence(tmp_path):
    wrote = cli("demo", "write", "nemo-loo", str(tmp_path / "d"))
    assert (wrote.returncode, wrote.stdout) == (0, f"wrote nemo-loo: {tmp_path / 'd'}\n")
    proc = cli("replay", str(tmp_path / "d"), "--format", "json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    post = next(s for s in report["stages"] if s["stage"] == "reward.post_process")
    # g-2 [0.25, 1, 0.5, 0.75] was normalized with its mean 0.625 and std √(0.3125/3) = 0.3227486 (GRPO):
    # s-8 = −0.375/0.3227496 = −1.1618915; leave-one-out gives b = (2.5 − 0.25)/3 = 0.75 and the others'
    # [1, 0.5, 0.75] std 0.25: −0.5/(0.25 + 1e-6) = −1.999992
    assert [d["sample_id"] for d in post["divergences"]] == ["s-8", "s-9", "s-10", "s-11"]
    first = report["first_divergence"]
    assert (first["sample_id"], first["group_index"]) == ("s-8", 2)
    assert first["expected"] == pytest.approx(-1.1618915, abs=1e-7)
    assert first["actual"] == pytest.approx(-0.5 / (0.25 + 1e-6), rel=1e-12)
    # g-0's four equal 0.3s: never a failure, reported twice as a hazard; g-1 [1, 0, 0, 1] passes silently
    assert [(h["kind"], h["group_index"]) for h in report["hazards"]] == [("near_zero_std", 0),
                                                                          ("zero_advantage_group", 0)]
    assert all(d["group_index"] == 2 for d in post["divergences"])


def test_nemo_loo_is_among_the_shipped_demos(tmp_path):
    proc = cli("demo", "write-all", str(tmp_path / "all"))
    assert proc.returncode == 0 and f"wrote nemo-loo: {tmp_path / 'all' / 'nemo-loo'}" in proc.stdout.splitlines()
    bad = cli("demo", "write", "nemo", str(tmp_path / "x"))
    assert bad.returncode == 2 and "unknown demo 'nemo'" in bad.stderr
    tui = cli("--demo", "nemo-loo", "--check", module="replay_tui")
    assert tui.returncode == 1 and tui.stdout.startswith("bundle nemo-loo — first divergent stage: reward.post_process")
