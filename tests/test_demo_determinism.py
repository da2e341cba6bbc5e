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
    "demo/cohort-2rank": "9289c364a5828e3c4f8d3d5e92223216d60d8ba0df6ea7a2e3a201b9f686d4e1",
    "demo/hazard-clean": "a88f381668b7ab73af9be8149e2f1c370cbfe54803d8a06e2f992149211c6729",
    "demo/kl-bug": "87a47c422ad5db24c6e45178721a6ddc79eb68755a1de53f3aa08edca5cc3dcc",
    "demo/loose-kl": "8136459b092a2b82c7cf93b2205e786cf4c4653ed7d9863dff17e0ee28a886bf",
    "demo/loss-bug": "59d04ec16904b4d66b9e5b89156445efe6f3c8c5ac67171e1e978ab292498aee",
    "demo/nemo-loo": "a6fd144d1c56908f81286fd45f8ef541b7819a70e85e4e5398aab897a1d07e65",
    "demo/pr65-buggy": "05fb002c1ca12611e1b50d7282509f2c86f3f357f94c790b2ceb85da8ba2ff6a",
    "demo/pr65-fixed": "a0a073ed7d1d64467f5b4bb860a5b79c85f8073b044fdedb6ade704caeeeea6a",
    "demo/step-loss": "573703f785a4f077d420d36a066db2716f6362ff8c2a05d7d916afc49cdf6fc6",
    "demo/support-fullvocab": "9109663bf7d8233ab93f57543b4f2d4dc4a76f64261787e3062814874ac52457",
    "demo/verl-dapo": "79f7c948b53c14d25a9d339b19bb570948ff81495692c0c4ee94112b48af26c7",
    "tui/brackets": "2b9f4d41848b4a6d05ce40bdcf2d03a0f48162a1d441dd9590ee5d5d5dc084f1",
    "tui/broken": "05fb002c1ca12611e1b50d7282509f2c86f3f357f94c790b2ceb85da8ba2ff6a",
    "tui/cohort-2rank": "9289c364a5828e3c4f8d3d5e92223216d60d8ba0df6ea7a2e3a201b9f686d4e1",
    "tui/hazard-clean": "a88f381668b7ab73af9be8149e2f1c370cbfe54803d8a06e2f992149211c6729",
    "tui/kl-bug": "87a47c422ad5db24c6e45178721a6ddc79eb68755a1de53f3aa08edca5cc3dcc",
    "tui/loose-kl": "8136459b092a2b82c7cf93b2205e786cf4c4653ed7d9863dff17e0ee28a886bf",
    "tui/loss-bug": "59d04ec16904b4d66b9e5b89156445efe6f3c8c5ac67171e1e978ab292498aee",
    "tui/pr65-buggy": "05fb002c1ca12611e1b50d7282509f2c86f3f357f94c790b2ceb85da8ba2ff6a",
    "tui/pr65-fixed": "a0a073ed7d1d64467f5b4bb860a5b79c85f8073b044fdedb6ade704caeeeea6a",
    "tui/refused": "a9d5619a536e80898a2ab1f5ee433803ffc8581a82db6212d2d638e28f30d2d5",
    "tui/step-loss": "573703f785a4f077d420d36a066db2716f6362ff8c2a05d7d916afc49cdf6fc6",
    "tui/support-fullvocab": "9109663bf7d8233ab93f57543b4f2d4dc4a76f64261787e3062814874ac52457",
    "tui/support-hand": "4f69e6f978e9c3b42e3d7e4953eb5904dbaf2af7c11c8b09f9bd9823dcf213ae",
    "tui/support-invariants": "13e6681ec3cf57f8519a263067d5e09b65bffd8bf4ae49674c9752905fcfa538",
    "write/synthetic": "c41f6b4859b1ac0fdf93d1b690c13fd68cdc2a3f5de4dbd7a97c4659812bb914",
}
# sha256 over the raw bytes of every file (payload containers, COMPLETE sentinels included), under PINNED_TORCH.
FILE_DIGESTS = {
    "demo/cohort-2rank": "70bab03873eb873de3d98f7c11a0521cb32ad950ad8346cb054e952c6a6f1d09",
    "demo/hazard-clean": "64d320b802467ed73bc85e7dadb9577796dfebb1aa558b6f28634c95b90e62fc",
    "demo/kl-bug": "c792efe1144ce61f3071d04dc30f5eadb986d64232c8ef7609bdd13f1f7620bf",
    "demo/loose-kl": "e851676c25ec6942090d68db944a1cb884929ab3b4ef949de4900509136eec77",
    "demo/loss-bug": "85e20ce967e6f6331ca4ad6a67b6bc122aa08a706bd2f4f31237a9ee8adba57b",
    "demo/nemo-loo": "076c36a4d89ed5e8e62ef039010871b03981f07885e5d9c8e3da322cfa54fa81",
    "demo/pr65-buggy": "8a63a655a67aa7ddde646670955a042c19f0a4f2da3d0d4acd3d27848959bcd7",
    "demo/pr65-fixed": "dd33070b4fc7a588a0c689c6646b57f5dbf4b7f0cbf1c3ed0a51bcf19bbe818d",
    "demo/step-loss": "e162a8ad047c90213ab395fb9204e9238e1a26618ba6ab82de51cb9af58e2a56",
    "demo/support-fullvocab": "d0732bf790f7e54035d36560effb29e083b5ee3296166b0ec7867a7d0752b847",
    "demo/verl-dapo": "b8de203b1ae56c5c74ed08fb1a81480cbe909fd92033fb3d7a8f289497f3ca7c",
    "tui/brackets": "0d01971ccedf9f48265e8b8db59b5012a9db4c61ccf4e182c47258c78482baab",
    "tui/broken": "3d82286d6dc0ad9471afea31fa762f494f66c183603f3830b37212cbeeee04f2",
    "tui/cohort-2rank": "70bab03873eb873de3d98f7c11a0521cb32ad950ad8346cb054e952c6a6f1d09",
    "tui/hazard-clean": "64d320b802467ed73bc85e7dadb9577796dfebb1aa558b6f28634c95b90e62fc",
    "tui/kl-bug": "c792efe1144ce61f3071d04dc30f5eadb986d64232c8ef7609bdd13f1f7620bf",
    "tui/loose-kl": "e851676c25ec6942090d68db944a1cb884929ab3b4ef949de4900509136eec77",
    "tui/loss-bug": "85e20ce967e6f6331ca4ad6a67b6bc122aa08a706bd2f4f31237a9ee8adba57b",
    "tui/pr65-buggy": "8a63a655a67aa7ddde646670955a042c19f0a4f2da3d0d4acd3d27848959bcd7",
    "tui/pr65-fixed": "dd33070b4fc7a588a0c689c6646b57f5dbf4b7f0cbf1c3ed0a51bcf19bbe818d",
    "tui/refused": "17725d8704f67bda001fac97a9db8e37ba0e7579bb1ec2ea9785555799172b40",
    "tui/step-loss": "e162a8ad047c90213ab395fb9204e9238e1a26618ba6ab82de51cb9af58e2a56",
    "tui/support-fullvocab": "d0732bf790f7e54035d36560effb29e083b5ee3296166b0ec7867a7d0752b847",
    "tui/support-hand": "265d431c70948ab29869697b2c15ef8abc772ecfa1beed7da8e07c6c46cbcb7a",
    "tui/support-invariants": "bc085903a0f12745a6a2ba20f45961f3f466b4517e3345f26d85dfec82d42f53",
    "write/synthetic": "5f24bae30ba6531aa816755fdad99ca51af810d6890e2fc8f21364bd4cd263c2",
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
