"""``trajectory-replay schema report``: the report's JSON Schema, generated from its types, validates the JSON
that ``replay --format json`` writes (a failing and a passing demo bundle, and a scan row's report), marks every
property stable or not, and is printed without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay_lib", *argv], capture_output=True, text=True, timeout=300,
                          env=ENV)


@pytest.fixture(scope="module")
def schema() -> dict:
    proc = cli("schema", "report")
    assert (proc.returncode, proc.stderr) == (0, "")
    return json.loads(proc.stdout)


def test_the_schema_validates_real_reports(schema, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    assert cli("demo", "write-all", str(tmp_path / "demos")).returncode == 0
    failing = cli("replay", str(tmp_path / "demos" / "pr65-buggy"), "--format", "json")
    passing = cli("replay", str(tmp_path / "demos" / "pr65-fixed"), "--format", "json")
    assert (failing.returncode, passing.returncode) == (1, 0)
    for proc in (failing, passing):
        jsonschema.validate(json.loads(proc.stdout), schema)
    # a report that breaks the schema is refused: the schema is not vacuous
    broken = json.loads(failing.stdout)
    broken["stages"][0]["mismatches"] = "four"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_every_property_is_marked_and_the_api_keys_are_stable(schema):
    defs = schema["$defs"]
    assert set(defs) == {"ReplayReport", "Divergence", "StageReport", "Hazard", "Explanation"}
    marks = {(name, key): prop["x-stable"] for name, d in defs.items() for key, prop in d["properties"].items()}
    assert all(isinstance(v, bool) for v in marks.values())
    stable = {k for k, v in marks.items() if v}
    assert {("ReplayReport", k) for k in ("bundle_id", "passed", "first_divergent_stage", "first_divergence",
                                          "stages")} <= stable
    assert {("Divergence", k) for k in ("stage", "rank", "sample_id", "group_index", "field", "token_offset",
                                        "expected", "actual", "abs_error")} <= stable
    assert {("StageReport", k) for k in ("stage", "status", "reason", "mismatches", "max_abs_error",
                                         "divergences")} <= stable
    assert ("ReplayReport", "warnings") in marks and not marks[("ReplayReport", "warnings")]
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_printing_it_imports_no_torch_and_a_bad_name_is_a_usage_error():
    code = ("import sys, io, contextlib\nfrom replay_lib.cli import main\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n    rc = main(['schema', 'report'])\n"
            "print(rc, 'torch' in sys.modules, len(out.getvalue()) > 1000)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.stdout.split() == ["0", "False", "True"], proc.stderr
    bad = cli("schema", "scan-rows")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines()[-1] == ("trajectory-replay schema: error: argument name: invalid choice: "
                                                   "'scan-rows' (choose from 'report')")
