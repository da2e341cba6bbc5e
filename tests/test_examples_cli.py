"""The example trainer's command line for a new user: ``--help`` shows each flag's default, and a bad flag or a bad
combination of flags is one line — the reason — not the whole usage before it (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "grpo_trainer.py"
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TRAINER), *argv], capture_output=True, text=True, timeout=120, env=ENV)


def test_help_shows_the_defaults():
    proc = run("--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "--kl-coef KL_COEF rollout-vs-reference KL coefficient (logged) (default: 0.05)" in text
    assert "--n-samples N_SAMPLES samples per prompt (group size) (default: 4)" in text


def test_a_bad_combination_or_flag_is_its_one_line_reason():
    for argv, line in ((("--dual-clip-bug",), "grpo_trainer.py: error: --dual-clip-bug needs --dual-clip (--help "
                                              "lists every flag)"),
                       (("--bogus",), "grpo_trainer.py: error: unrecognized arguments: --bogus (--help lists every "
                                      "flag)")):
        proc = run(*argv)
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", line + "\n")
