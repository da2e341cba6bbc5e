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
# payloads' container size and checksums (whole and per chunk), index.json and expected.json as written (COMPLETE* holds checksums).
CONTENT_DIGESTS = {
    "demo/cohort-2rank": "19d84d490a9fbe3c21b47303dd44a9bcdec03159ed025578c8fde588c4e251e4",
    "demo/hazard-clean": "3c2c44a5a2aae6a5fb7d26b04a47ca707a81afdb8f5d0af2ba3ce2e8b2cb0c5c",
    "demo/kl-bug": "f48194fa6d59722bc96ef2878a02817a21cebb96ddf347b9abfba09445369ad0",
    "demo/loose-kl": "b6b35ae75eec556d91f2a6f4ee3a44ae2f910d8a467fc927a612e96a7e442d20",
    "demo/loss-bug": "d8db9c85816eb8dfd6d389b4f38f243d0e9d26b4cba1dda7422475e7e59a8931",
    "demo/nemo-loo": "4e48701c249668a30335721d85415bc8f9ca2dfedb6c01af576bc261d06928f1",
    "demo/pr65-buggy": "8ec50e2635081497fd65cef108b82da2b62e2c69cec14b6878158f00e6a1d9c5",
    "demo/pr65-fixed": "b111d3181484d4483a92e0ff34971939731e239c9ac5de1efa4dc55aa086062a",
    "demo/step-loss": "1a32c536d1d46852a81ef50444c5e19ccb61ade8ae609c96afdf428cd147ea5c",
    "demo/support-fullvocab": "e4c7a32638aa6c8e0b5a1b7660db767c82a32fd89c58f2fe5cc0de56b4d100f0",
    "demo/verl-dapo": "56fba5f4b9354d1adb1be6b5722d37db59ae54880a663983108506e6feabea8b",
    "tui/brackets": "01d46d10652955c8853694c0bb40abd9c59954b2f1149d753a5157714fb35114",
    "tui/broken": "8ec50e2635081497fd65cef108b82da2b62e2c69cec14b6878158f00e6a1d9c5",
    "tui/cohort-2rank": "19d84d490a9fbe3c21b47303dd44a9bcdec03159ed025578c8fde588c4e251e4",
    "tui/hazard-clean": "3c2c44a5a2aae6a5fb7d26b04a47ca707a81afdb8f5d0af2ba3ce2e8b2cb0c5c",
    "tui/kl-bug": "f48194fa6d59722bc96ef2878a02817a21cebb96ddf347b9abfba09445369ad0",
    "tui/loose-kl": "b6b35ae75eec556d91f2a6f4ee3a44ae2f910d8a467fc927a612e96a7e442d20",
    "tui/loss-bug": "d8db9c85816eb8dfd6d389b4f38f243d0e9d26b4cba1dda7422475e7e59a8931",
    "tui/pr65-buggy": "8ec50e2635081497fd65cef108b82da2b62e2c69cec14b6878158f00e6a1d9c5",
    "tui/pr65-fixed": "b111d3181484d4483a92e0ff34971939731e239c9ac5de1efa4dc55aa086062a",
    "tui/refused": "11576e9c3977b7373cdc8e3bd9e7f37a4c2e44459404451d5a33d62142632fe4",
    "tui/step-loss": "1a32c536d1d46852a81ef50444c5e19ccb61ade8ae609c96afdf428cd147ea5c",
    "tui/support-fullvocab": "e4c7a32638aa6c8e0b5a1b7660db767c82a32fd89c58f2fe5cc0de56b4d100f0",
    "tui/support-hand": "91f4d4a1ba29118db2bf6aef9dfa9f0d37b9ab08ec29c15fe8b6bcd28d9b0257",
    "tui/support-invariants": "b6a46d1d7756e8951dcc9c952ed517b22175e894b4eb3e7952d2a4e05e6f67d1",
    "write/synthetic": "c41f6b4859b1ac0fdf93d1b690c13fd68cdc2a3f5de4dbd7a97c4659812bb914",
}
# sha256 over the raw bytes of every file (payload containers, COMPLETE sentinels included), under PINNED_TORCH.
FILE_DIGESTS = {
    "demo/cohort-2rank": "3bee4d2fe8fc8d1da40b236ca54ba1702ff7937e59adac81b813daa1b08d6544",
    "demo/hazard-clean": "5e19b06bb582210aace114dcceb862dca14cf9304ada38e5ecab1a2a37b0924a",
    "demo/kl-bug": "79280d5c735c6443734ef06552e8748ab71ad6eac3995638981c06e4d469d068",
    "demo/loose-kl": "0fc8aeb7359f90bde3a38bc485f8e55282f670c76234d59ba18b47d1f2067418",
    "demo/loss-bug": "72ab72d38e03fd2f77f6ab2da5f4e57e40a9a183d4fdf3f378123d0955b4e39d",
    "demo/nemo-loo": "93a9c233fac1561035ab1f4e69dd56431fd505df222ba3cd9d3c3d682a884c80",
    "demo/pr65-buggy": "81ed2e148d70effa3f63e46fc0d68bc079820a89f78285099315c7075ec97669",
    "demo/pr65-fixed": "4614908321e820f4d89f56c48cdd140e630001343196cdb1ab17d67420e04b04",
    "demo/step-loss": "19bccd423dd74399c611c45008ddcc4d959417694dd15dd9715e1ff40cb00621",
    "demo/support-fullvocab": "2a72cfa7e6a13658dbf08e62e0dd280d28a558f1524101628f6dde8fe554e477",
    "demo/verl-dapo": "647da56737cee23dc3fe2e9d95884cb9d6256bf7e413cafa99f8fa013a5fdf3f",
    "tui/brackets": "59ec337037737b6956e081b20adfd6ea04fd17e96d2cbb24290811f3bf1d87a6",
    "tui/broken": "9269dd8ae305a8ec536c90dc5f6ef5bbb712497776058a0b8927ac0e01364b91",
    "tui/cohort-2rank": "3bee4d2fe8fc8d1da40b236ca54ba1702ff7937e59adac81b813daa1b08d6544",
    "tui/hazard-clean": "5e19b06bb582210aace114dcceb862dca14cf9304ada38e5ecab1a2a37b0924a",
    "tui/kl-bug": "79280d5c735c6443734ef06552e8748ab71ad6eac3995638981c06e4d469d068",
    "tui/loose-kl": "0fc8aeb7359f90bde3a38bc485f8e55282f670c76234d59ba18b47d1f2067418",
    "tui/loss-bug": "72ab72d38e03fd2f77f6ab2da5f4e57e40a9a183d4fdf3f378123d0955b4e39d",
    "tui/pr65-buggy": "81ed2e148d70effa3f63e46fc0d68bc079820a89f78285099315c7075ec97669",
    "tui/pr65-fixed": "4614908321e820f4d89f56c48cdd140e630001343196cdb1ab17d67420e04b04",
    "tui/refused": "d22a9c485ab099e3105c81bb1e16cfb058d3a09766e13cbe4268a4c0457ae336",
    "tui/step-loss": "19bccd423dd74399c611c45008ddcc4d959417694dd15dd9715e1ff40cb00621",
    "tui/support-fullvocab": "2a72cfa7e6a13658dbf08e62e0dd280d28a558f1524101628f6dde8fe554e477",
    "tui/support-hand": "7a24343d53fa997edd74fb153308f8156d82059836cc8d08bdebf6d42611bb6d",
    "tui/support-invariants": "8e25878cad9c5ad1d197f724354a30485e528e450e177d923ee710bbfd6aedaf",
    "write/synthetic": "b5c5822d5e3b5df46adbe2abbd75e06d325cf210cc9f136199201011d9acc02f",
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
                spec.pop("chunks", None)  # the container's chunk checksums, as its sha256
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
