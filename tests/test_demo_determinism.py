"""The demo and test bundles are the same bytes on every host, and replay to the same numbers on every host.

torch's float32 exp/log/sqrt come from MKL, whose code path (and so a result's last bit) depends on the CPU:
an AMD EPYC takes another path than the Intel host the snapshots were made on. ``MKL_ENABLE_INSTRUCTIONS``
selects MKL's path on this host and ``ATEN_CPU_CAPABILITY`` torch's own SIMD kernels (randn, log1p, linspace), so
a fresh interpreter under either reproduces another machine's floating point. Three checks:

* every payload's tensor and every JSON file of every demo (``demo write-all``), of ``demo write`` with fixed
  arguments and of the TUI test bundles equals pinned digests (torch.save's zip container is pinned too, under
  the torch version the digests were taken with);
* under other MKL and ATen code paths a fresh interpreter writes the same bytes, file for file;
* under those code paths the replay of every bundle prints the same report as here, and a clean one
  recomputes every recorded number bit for bit (max |err| 0.0 in every stage).

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

from replay_lib import demo
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
    "demo/cohort-2rank": "6c4f78558f1e763413ac5c5073d089b2a3aa234ff63c7e51517e17b98a2070a1",
    "demo/pr65-buggy": "71854d38b438f4adb595b193fd95da17a7d85d2a0a1e0241ac338c729af4d0b3",
    "demo/pr65-fixed": "c19cbc755ec4b17a311e7ff7b0d86840135f87cd3ba7e9924375ae1c22c4dd42",
    "demo/step-loss": "30f22cf1d6bc3191a3b2754561e214071e593c1886b4044cc704f57c0bfba893",
    "demo/support-fullvocab": "d3984822685133628e2b258d8dba0a2bf11db47f9150be41fc393ccbef8def46",
    "tui/brackets": "d4912462f5039891b20a2c0dd438794ea08f3f23716b3c2c886b46a453700a46",
    "tui/broken": "71854d38b438f4adb595b193fd95da17a7d85d2a0a1e0241ac338c729af4d0b3",
    "tui/cohort-2rank": "6c4f78558f1e763413ac5c5073d089b2a3aa234ff63c7e51517e17b98a2070a1",
    "tui/kl-bug": "ac69127b6d89ffbbef85ab3a18568fa25532c4a23a752359fb69b535189c789f",
    "tui/loss-bug": "8e39da0976465169bf29e739c3f455e76938edd4c4c74a6b4ef674a23ba52274",
    "tui/pr65-buggy": "71854d38b438f4adb595b193fd95da17a7d85d2a0a1e0241ac338c729af4d0b3",
    "tui/pr65-fixed": "c19cbc755ec4b17a311e7ff7b0d86840135f87cd3ba7e9924375ae1c22c4dd42",
    "tui/step-loss": "30f22cf1d6bc3191a3b2754561e214071e593c1886b4044cc704f57c0bfba893",
    "tui/support-fullvocab": "d3984822685133628e2b258d8dba0a2bf11db47f9150be41fc393ccbef8def46",
    "tui/support-hand": "59a0a550a060e6dd8e0504fdaef79c3f2845b3f05e03bb14de749838b3dc0279",
    "tui/support-invariants": "6016b2f36d55111b41ca7da2b3e77ac5e5424fcc5c691b98cac9a904ea41a866",
    "tui/tis": "d4787d965f57c987cb8180eca5c326b9e793cee2f862378bc3fbaba791323966",
    "write/synthetic": "4bb04d7907cd528f990dd63938fae0e37573a333f7fa81959dc702d37e3414ea",
}
# sha256 over the raw bytes of every file (payload containers, COMPLETE sentinels included), under PINNED_TORCH.
FILE_DIGESTS = {
    "demo/cohort-2rank": "98e09ff2a5f6610a3243a707b846267c8e64e8990a1ca9132e3afed8fbc2fd61",
    "demo/pr65-buggy": "251bffc3cbd6d2cefbd80c5d906c92c2e5326e9f5bce2231499837e75479ea3d",
    "demo/pr65-fixed": "2365a6f9f9252b58a1b59e3291df22c75c51159f8b5ea9d1f48fa637a5edd10b",
    "demo/step-loss": "425730fd78eee8dc4e41cfa0fc14c4bda8ac264597c08a81dc3369d4797bdbb8",
    "demo/support-fullvocab": "c02341cf9f554bb99b7d2a701205ce24035733ffb69fa4d314189df6d69b03f2",
    "tui/brackets": "b902d2c305cdc05a313a10e41ebd97c86e36f29cebce0f9ca511015e98b15620",
    "tui/broken": "190a72b7a4377739d1f8645ad443ed8d906fcb5b4e0b0522911f1a991289df8e",
    "tui/cohort-2rank": "98e09ff2a5f6610a3243a707b846267c8e64e8990a1ca9132e3afed8fbc2fd61",
    "tui/kl-bug": "d60fdfb61937e828792fcaf2be888f3634b03de12963463e357f645f72a14d86",
    "tui/loss-bug": "89f73b3aa11038caba391ac8f0a3dac7566ca3eb3ddca417e23fb75317b52c63",
    "tui/pr65-buggy": "251bffc3cbd6d2cefbd80c5d906c92c2e5326e9f5bce2231499837e75479ea3d",
    "tui/pr65-fixed": "2365a6f9f9252b58a1b59e3291df22c75c51159f8b5ea9d1f48fa637a5edd10b",
    "tui/step-loss": "425730fd78eee8dc4e41cfa0fc14c4bda8ac264597c08a81dc3369d4797bdbb8",
    "tui/support-fullvocab": "c02341cf9f554bb99b7d2a701205ce24035733ffb69fa4d314189df6d69b03f2",
    "tui/support-hand": "557360c86f3fe8c060276054dd5501335b6df0dea36bb1c37b8c49cd472ffc1b",
    "tui/support-invariants": "0aed364ca5449ffada655701edb016d0adec538ad7fcef4dcd2f4b54888b7d88",
    "tui/tis": "aa94a3e7b55871cad2fa7d90c7e41f26e7d0ac91e1431765a1bb979f217dbce4",
    "write/synthetic": "1d2bd7ff4c78bdf1e798a7f1f6f215620a476a07fbb635741c931cd14c0e2846",
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


def replay_reports(root: Path) -> dict[str, list]:
    """``trajectory-replay replay B --format json`` of every bundle under ``root``: {name: [exit code, stdout,
    stderr]}."""
    out = {}
    for name in bundles(root):
        if name in NOT_SETTLED:
            continue
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["replay", str(root / name), "--format", "json"])
        out[name] = [code, stdout.getvalue(), stderr.getvalue()]
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
        code, stdout, _ = reports[name]
        errors = {s["stage"]: s["max_abs_error"] for s in json.loads(stdout)["stages"] if s["status"] != "skipped"}
        assert code == 0 and set(errors.values()) <= {0.0, None}, (name, errors)


if __name__ == "__main__":  # print the digest tables to pin
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = write_everything(Path(tmp) / "here")
        print(_table("CONTENT_DIGESTS", {n: content_digest(root / n) for n in bundles(root)}))
        print(_table("FILE_DIGESTS", {n: file_digest(root / n) for n in bundles(root)}))
