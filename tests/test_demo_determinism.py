"""The demo and test bundles are the same bytes on every host, and replay to the same numbers on every host.

torch's float32 exp/log/sqrt come from MKL, whose code path (and so a result's last bit) depends on the CPU:
an AMD EPYC takes another path than the Intel host the snapshots were made on. ``MKL_ENABLE_INSTRUCTIONS``
selects MKL's path on this host and ``ATEN_CPU_CAPABILITY`` torch's own SIMD kernels (randn, log1p, linspace), so
a fresh interpreter under either reproduces another machine's floating point. Three checks:

* every payload's tensor and every JSON file of every demo (``demo write-all``), of ``demo write`` with fixed
  arguments and of the TUI test bundles equals pinned digests (torch.save's zip container is pinned too, under
  the torch version the digests were taken with);
* under other MKL and ATen code paths a fresh interpreter writes the same bytes, file for file;
* under those code paths the replay of every bundle prints the same report as here (the text, and the JSON at
  the digits it shows: the float64 recompute's last bits follow the host's exp and sqrt), and a clean one
  recomputes every recorded number bit for bit under ``--exact`` (the producers' float32 kernels: max |err|
  0.0 in every stage).

When the generators change on purpose, re-pin with ``python tests/test_demo_determinism.py`` (prints both
tables).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay_lib.demo import bundles as demo
from replay_lib.cli import main

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DEMO_WRITE_ARGS = ["--samples", "8", "--tokens", "12", "--seed", "11", "--vary-lengths", "--kl-coef", "0.05"]
# The one bundle a replay may print differently elsewhere: hand-derived logits ([2, 1, 0]: the test's closed
# forms need them) whose float32 exp and log the replay takes as the host's libm rounds them.
NOT_SETTLED = {"tui/support-hand"}
CLEAN = {"demo/pr65-fixed", "demo/step-loss", "demo/cohort-2rank", "tui/pr65-fixed", "tui/step-loss",
         "tui/cohort-2rank", "write/synthetic"}
# Another machine's floating point: MKL's SSE4.2 path with torch's scalar kernels, and MKL's AVX2 path (the
# one it takes on an AMD host).
OTHER_KERNELS = {
    "mkl-sse42+aten-default": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ATEN_CPU_CAPABILITY": "default"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}

PINNED_TORCH = "2.13.0"
# sha256 over each bundle's files: a payload by its dtype, shape and tensor bytes, manifest.json without the
# payloads' container size and checksum, index.json and expected.json as written (COMPLETE* holds checksums).
CONTENT_DIGESTS = {
    "demo/cohort-2rank": "0e79d8ea3a990c7d480ae9b28d7c8ce8a2596a649ac0d03fe2ce9d67d4b02be7",
    "demo/hazard-clean": "579575e5ffcfe310987d7f60600def07f359b989b2d2d0131d1bb7cafe0718bb",
    "demo/kl-bug": "eac136efccb2498ff661e580ac2aec2d2734e3fa3119a0dffb2166e64f9f0774",
    "demo/loose-kl": "27624340bc0705708bd9c56246b44750fc7a97edbd22242380f05f8e11803926",
    "demo/loss-bug": "50953ac77eeddbe5aa3bb3497f7d1cfaaf010c226d9016d7003e74e1959c3223",
    "demo/nemo-loo": "4c8e0e479a687c4b02a7925e7dbf436d10bcdb93f80af3ba52e5e3e10339e17d",
    "demo/pr65-buggy": "05e41a807b58aa38f6f20af2b68f85f0e32008cfcc74cf727afd08aaa5ebe2cd",
    "demo/pr65-fixed": "be0ef4f5522d6e06ff41c698b5dbe75a78c06b9cec9ba2a4c1be3fcb3477d913",
    "demo/step-loss": "a38db150c33c753f12835edf2834c2c4c585cd14f83ccab4a2255e0745dda7b1",
    "demo/support-fullvocab": "6f57952e1d3ed8cf946737bf3a75e63ff3f9726dfee07c7ce6fd967b17862dd7",
    "demo/verl-dapo": "c45404902683ec8c9269b4fceeb218a0c12102b3bb362e127f3d234df3b6e4d2",
    "tui/brackets": "f371e9ed5626b23f9c71bac395aa88be6749a6720171684aa46af15ab937cedc",
    "tui/broken": "05e41a807b58aa38f6f20af2b68f85f0e32008cfcc74cf727afd08aaa5ebe2cd",
    "tui/cohort-2rank": "0e79d8ea3a990c7d480ae9b28d7c8ce8a2596a649ac0d03fe2ce9d67d4b02be7",
    "tui/hazard-clean": "579575e5ffcfe310987d7f60600def07f359b989b2d2d0131d1bb7cafe0718bb",
    "tui/kl-bug": "eac136efccb2498ff661e580ac2aec2d2734e3fa3119a0dffb2166e64f9f0774",
    "tui/loose-kl": "27624340bc0705708bd9c56246b44750fc7a97edbd22242380f05f8e11803926",
    "tui/loss-bug": "50953ac77eeddbe5aa3bb3497f7d1cfaaf010c226d9016d7003e74e1959c3223",
    "tui/pr65-buggy": "05e41a807b58aa38f6f20af2b68f85f0e32008cfcc74cf727afd08aaa5ebe2cd",
    "tui/pr65-fixed": "be0ef4f5522d6e06ff41c698b5dbe75a78c06b9cec9ba2a4c1be3fcb3477d913",
    "tui/refused": "da1badd17708e836c0e6b7e1405849bb2490885270b21867faaaa29fdbb7cb17",
    "tui/step-loss": "a38db150c33c753f12835edf2834c2c4c585cd14f83ccab4a2255e0745dda7b1",
    "tui/support-fullvocab": "6f57952e1d3ed8cf946737bf3a75e63ff3f9726dfee07c7ce6fd967b17862dd7",
    "tui/support-hand": "63ae83293201bddf587250b0aaba66dd95568ea7a0eff537ac8d5757639264b5",
    "tui/support-invariants": "a6da66004c45b06ae189732e19b936ee063aa19d21fc143eeae02b69c9766cd0",
    "write/synthetic": "db2307c44fa8c54d8c76e568c93fb609ef34526adb2ff1c7b480de565a3b038b",
}
# sha256 over the raw bytes of every file (payload containers, COMPLETE sentinels included), under PINNED_TORCH.
FILE_DIGESTS = {
    "demo/cohort-2rank": "26ba045467eade26b8c1e930b6f6080d54b4c02d80814bc5b0f39e5e361753d5",
    "demo/hazard-clean": "e6b4800c1c3f614e9c84e2289f7926931cd41c1b8e354a9869468de420de2380",
    "demo/kl-bug": "6a645e527506c5bad0de36fa60b1ccddb30217c82db195c677ea553adacf03be",
    "demo/loose-kl": "0be05bc5feebae8e143b512b6ea70c44558c49145d5b666a5e2c0ebdca70bb71",
    "demo/loss-bug": "4d2ef9ac86b911510c0c1a6aa6aad1d5bed201f5074b7441037ead5b4c868145",
    "demo/nemo-loo": "8e929b654a072427d24b3e59f4d65bfc16d7c2d71877556fad54dd0b12f61306",
    "demo/pr65-buggy": "716250fba50ea0f70edf7cc8188fd7fb5d575cf8acacbdb82b9f589aa60ae1b2",
    "demo/pr65-fixed": "0829961170749811cf2d82eebb2a0d3631d67473d336a96750b6762bda221cc4",
    "demo/step-loss": "4a8f09f65bbef99b95cdc0a6f169a96c899937a4784f966516c310f7280d84cb",
    "demo/support-fullvocab": "246d3171dfd42998053329f86b39744d0f8c033e56d2fe0ef13ff633f95d1faf",
    "demo/verl-dapo": "84f2b44263a967b56c97865f4cd8e791bbec0d6b82ad02c38fd9398db6a168d8",
    "tui/brackets": "7fa09879530a8154ba5658e7c061211458c10d9e2164cdd1411c7eabaf5a2ee1",
    "tui/broken": "e6e75bf1afbdde68ad1de7b8d3021857c37d939e544d363f28eb807029da050b",
    "tui/cohort-2rank": "26ba045467eade26b8c1e930b6f6080d54b4c02d80814bc5b0f39e5e361753d5",
    "tui/hazard-clean": "e6b4800c1c3f614e9c84e2289f7926931cd41c1b8e354a9869468de420de2380",
    "tui/kl-bug": "6a645e527506c5bad0de36fa60b1ccddb30217c82db195c677ea553adacf03be",
    "tui/loose-kl": "0be05bc5feebae8e143b512b6ea70c44558c49145d5b666a5e2c0ebdca70bb71",
    "tui/loss-bug": "4d2ef9ac86b911510c0c1a6aa6aad1d5bed201f5074b7441037ead5b4c868145",
    "tui/pr65-buggy": "716250fba50ea0f70edf7cc8188fd7fb5d575cf8acacbdb82b9f589aa60ae1b2",
    "tui/pr65-fixed": "0829961170749811cf2d82eebb2a0d3631d67473d336a96750b6762bda221cc4",
    "tui/refused": "1fa77e316762a79a0cbf90879c4800649e5122a4d7240a16d9f4ac765e712832",
    "tui/step-loss": "4a8f09f65bbef99b95cdc0a6f169a96c899937a4784f966516c310f7280d84cb",
    "tui/support-fullvocab": "246d3171dfd42998053329f86b39744d0f8c033e56d2fe0ef13ff633f95d1faf",
    "tui/support-hand": "1d46c668b38ca94c935c20d60679cc5a9eb7605950bb86acbcd607dbedb78ea9",
    "tui/support-invariants": "ca6dc435672e1cdbd195e22a68a4c0186c4494817cbfa20eb432a118e4e5f82d",
    "write/synthetic": "4bda33854d1f3d39c9af4d08a642c25ae553e30fabdb68f0c5aeffcc1396ac6a",
}


def _tui_bundles():
    spec = importlib.util.spec_from_file_location("tui_bundles", TESTS / "tui" / "tui_bundles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_everything(root: Path) -> Path:
    """Every demo, ``demo write DEMO_WRITE_ARGS`` and the TUI test bundles under ``root/{demo,write,tui}``,
    with a fixed producer (no torch version in a manifest: the digests hold for any torch build)."""
    tui = _tui_bundles()
    saved = demo.producer
    demo.producer = tui.fixed_producer
    try:
        demo.write_demos(root / "demo")
        (root / "write").mkdir(parents=True)
        with contextlib.redirect_stdout(io.StringIO()):
            if main(["demo", "write", str(root / "write" / "synthetic"), *DEMO_WRITE_ARGS]) != 0:
                raise RuntimeError("demo write failed")
    finally:
        demo.producer = saved
    tui.write_all(root / "tui")
    return root


def bundles(root: Path) -> list[str]:
    return sorted(f"{kind}/{p.name}" for kind in ("demo", "tui", "write") for p in (root / kind).iterdir())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _files(bundle: Path) -> list[Path]:
    return sorted(p for p in bundle.rglob("*") if p.is_file())


def content_digest(bundle: Path) -> str:
    lines = []
    for path in _files(bundle):
        if path.name.startswith("COMPLETE"):
            continue
        if path.suffix == ".pt":
            tensor = torch.load(path, weights_only=True)
            digest = _sha256(f"{tensor.dtype} {list(tensor.shape)}\n".encode() + tensor.numpy().tobytes())
        elif path.name == "manifest.json":
            doc = json.loads(path.read_bytes())
            for spec in doc["payloads"].values():
                del spec["bytes"], spec["sha256"]
            digest = _sha256(json.dumps(doc, sort_keys=True).encode())
        else:
            digest = _sha256(path.read_bytes())
        lines.append(f"{path.relative_to(bundle).as_posix()} {digest}")
    return _sha256("\n".join(lines).encode())


def file_digest(bundle: Path) -> str:
    return _sha256("\n".join(f"{p.relative_to(bundle).as_posix()} {_sha256(p.read_bytes())}"
                             for p in _files(bundle)).encode())


def _run(*argv: str) -> list:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(argv))
    return [code, stdout.getvalue(), stderr.getvalue()]


def _displayed(value):
    """A JSON report with every number as the text report shows it (the shortest float32 form): the float64
    recompute's last bits come from the host's exp and sqrt, its displayed digits do not."""
    from replay_lib.judge.report import fmt_value

    if isinstance(value, dict):
        return {k: _displayed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_displayed(v) for v in value]
    if isinstance(value, float):
        return fmt_value(value)
    return value


def replay_reports(root: Path) -> dict[str, list]:
    """Every bundle under ``root`` replayed: {name: [exit code, the text report, stderr, the JSON report at the
    displayed precision, the JSON report of ``--exact`` (float32 kernels compared bitwise: every bit)]}."""
    out = {}
    for name in bundles(root):
        if name in NOT_SETTLED:
            continue
        code, text, err = _run("replay", str(root / name))
        as_json = _run("replay", str(root / name), "--format", "json")[1]
        doc = json.loads(as_json) if as_json else None  # an invalid bundle prints its error line only
        exact = _run("replay", str(root / name), "--format", "json", "--exact")
        out[name] = [code, text, err, _displayed(doc), exact[0], exact[1]]
    return out


# A fresh interpreter: write everything under argv[1], replay what this process wrote under argv[2].
CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from test_demo_determinism import replay_reports, write_everything
write_everything(Path(sys.argv[1]))
Path(sys.argv[4]).write_text(json.dumps(replay_reports(Path(sys.argv[2]))))
"""


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    return write_everything(tmp_path_factory.mktemp("determinism") / "here")


def _table(name: str, digests: dict[str, str]) -> str:
    return f"{name} = {{\n" + "".join(f'    "{k}": "{v}",\n' for k, v in digests.items()) + "}"


def test_every_bundle_matches_its_pinned_content_digest(written):
    got = {name: content_digest(written / name) for name in bundles(written)}
    assert got == CONTENT_DIGESTS, "the demo numbers changed; if on purpose, re-pin:\n" + _table("CONTENT_DIGESTS", got)


@pytest.mark.skipif(torch.__version__.split("+")[0] != PINNED_TORCH,
                    reason=f"torch.save's container is pinned for torch {PINNED_TORCH}")
def test_every_file_matches_its_pinned_digest(written):
    got = {name: file_digest(written / name) for name in bundles(written)}
    assert got == FILE_DIGESTS, "the demo files changed; if on purpose, re-pin:\n" + _table("FILE_DIGESTS", got)


@pytest.mark.parametrize("kernels", sorted(OTHER_KERNELS))
def test_other_cpu_kernels_write_the_same_bytes_and_replay_the_same_numbers(written, tmp_path, kernels):
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")}
    env.update(OTHER_KERNELS[kernels])
    result = tmp_path / "reports.json"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "there"), str(written), str(TESTS),
                           str(result)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    there = tmp_path / "there"
    assert bundles(there) == bundles(written)
    for name in bundles(written):
        here_files = {p.relative_to(written / name): p.read_bytes() for p in _files(written / name)}
        there_files = {p.relative_to(there / name): p.read_bytes() for p in _files(there / name)}
        assert here_files.keys() == there_files.keys(), name
        differ = sorted(str(rel) for rel in here_files if here_files[rel] != there_files[rel])
        assert not differ, f"{name}: {differ} differ under {kernels}"
    reports = json.loads(result.read_text())
    assert reports == replay_reports(written)
    for name in CLEAN:
        code, _, _, _, exact_code, exact = reports[name]
        errors = {s["stage"]: s["max_abs_error"] for s in json.loads(exact)["stages"] if s["status"] != "skipped"}
        assert code == 0 and exact_code == 0 and set(errors.values()) <= {0.0, None}, (name, errors)


if __name__ == "__main__":  # print the digest tables to pin
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = write_everything(Path(tmp) / "here")
        print(_table("CONTENT_DIGESTS", {n: content_digest(root / n) for n in bundles(root)}))
        print(_table("FILE_DIGESTS", {n: file_digest(root / n) for n in bundles(root)}))
