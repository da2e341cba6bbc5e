"""The headless side never imports Textual: every ``replay_lib`` module, and the ``trajectory-replay``
entry point running ``--help``, ``validate``, ``inspect`` and ``replay`` on a demo bundle.

Checked in fresh interpreters (this test process may have imported Textual already)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from replay_lib.demo import write_pr65

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = ("textual", "replay_tui")

PROBE = textwrap.dedent("""
    import contextlib, importlib, io, json, pkgutil, sys
    import replay_lib
    from replay_lib.cli import main

    imported = []
    for info in pkgutil.walk_packages(replay_lib.__path__, "replay_lib."):
        if info.name != "replay_lib.__main__":  # that one runs the CLI on import
            importlib.import_module(info.name)
            imported.append(info.name)
    codes = {}
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(["--help"])
        except SystemExit as exc:
            codes["help"] = exc.code
        for argv in (["validate", sys.argv[1]], ["inspect", sys.argv[1]], ["replay", sys.argv[1]],
                     ["replay", sys.argv[1], "--format", "json"]):
            codes[" ".join(argv[:1] + argv[2:])] = main(argv)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("textual", "replay_tui"))
    import textual  # control: the probe does see an imported Textual
    control = "textual" in sys.modules
    print(json.dumps({"imported": imported, "codes": codes, "leaked": leaked, "control": control}))
""")


def _clean_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    return env


def test_no_replay_lib_module_imports_textual(tmp_path):
    bundle = write_pr65(tmp_path / "pr65", buggy=True)
    proc = subprocess.run([sys.executable, "-c", PROBE, str(bundle)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=_clean_env())
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["leaked"] == []
    assert result["control"] is True
    assert {"replay_lib.bundle", "replay_lib.cli", "replay_lib.judge.compare", "replay_lib.demo", "replay_lib.kernels",
            "replay_lib.judge.report", "replay_lib.run.runner", "replay_lib.bundle.schema", "replay_lib.bundle.selection",
            "replay_lib.run.validate", "replay_lib.stages", "replay_lib.stages.loss"} <= set(result["imported"])
    assert result["codes"] == {"help": 0, "validate": 0, "inspect": 0, "replay": 1, "replay --format json": 1}


def _imported_modules(importtime_stderr: str) -> set[str]:
    # "import time:       123 |        456 |     textual.app" → "textual.app"
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def test_trajectory_replay_entry_point_never_imports_textual(tmp_path):
    bundle = write_pr65(tmp_path / "pr65", buggy=True)
    exe = shutil.which("trajectory-replay")
    cmd = [exe] if exe else [sys.executable, "-m", "replay_lib"]
    env = _clean_env()
    env["PYTHONPROFILEIMPORTTIME"] = "1"
    for args, code in ((["--help"], 0), (["replay", str(bundle)], 1)):
        proc = subprocess.run(cmd + args, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == code, proc.stderr[-2000:]
        modules = _imported_modules(proc.stderr)
        assert "replay_lib.cli" in modules  # the import log really covers the CLI
        assert sorted(m for m in modules if m.split(".")[0] in FORBIDDEN) == []
        if args[0] == "replay":
            assert "replay_lib.run.runner" in modules and "torch" in modules
            assert proc.stdout.startswith("bundle b-00001 — first divergent stage: reward.post_process\n")


def test_inspect_and_version_never_import_torch(tmp_path):
    # inspect is the quick look (a capture directory of many bundles): no second or two of torch import
    bundle = write_pr65(tmp_path / "pr65", buggy=True)
    probe = textwrap.dedent("""
        import contextlib, io, json, sys
        from replay_lib.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["inspect", sys.argv[1]])
            try:
                main(["--version"])
            except SystemExit as exc:
                version = exc.code
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "textual"))
        import torch  # control: the probe does see an imported torch
        print(json.dumps({"code": code, "version": version, "heavy": heavy, "control": "torch" in sys.modules,
                          "first": out.getvalue().splitlines()[0]}))
    """)
    proc = subprocess.run([sys.executable, "-c", probe, str(bundle)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=_clean_env())
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert (result["code"], result["version"], result["heavy"], result["control"]) == (0, 0, [], True)
    assert result["first"] == f"{bundle} — bundle, complete"
