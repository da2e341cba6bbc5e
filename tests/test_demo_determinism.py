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
    "demo/cohort-2rank": "6c25364020c0cda53eaa7e9409ea1360324aef434486befbb552f9a801257eb7",
    "demo/pr65-buggy": "5a6ac385fecccdc2c3c210f92946250e904e9a0b7a911300ab606d372ec7fb5c",
    "demo/pr65-fixed": "d603b479e1d75fa2faf4bc67c640336f5413fd3ca9a7bfa1a602180050ea6963",
    "demo/step-loss": "a32868ed8efc8ebfefc0856397dace2563147046e9ea597919532477b75d8a76",
    "demo/support-fullvocab": "78d6923d06281e263f18c7e49e25393d9e3d39ff6f307ab0ae2b462267f80bc3",
    "tui/brackets": "4d35aaf63af31cd0cd943ad80f5a02fc8746b883d76955f9b96bccaf1598ed55",
    "tui/broken": "5a6ac385fecccdc2c3c210f92946250e904e9a0b7a911300ab606d372ec7fb5c",
    "tui/cohort-2rank": "6c25364020c0cda53eaa7e9409ea1360324aef434486befbb552f9a801257eb7",
    "tui/hazard-clean": "4bcebb38820d4496af73f1d8069bb7b31538172811e8056900d89bb288c09c68",
    "tui/kl-bug": "a01d131464765f6eb46a580b9b0d58ace039b12705fafd22cabad9fca7252822",
    "tui/loose-kl": "d290aa5eee4282f5006cad0d93d19ad5cdbb944cc8d06727bd75a66b8aa16e85",
    "tui/loss-bug": "31f5be1385551a752fdec30db14af56e3aaf19e4e8d185303d40e30f5221781f",
    "tui/pr65-buggy": "5a6ac385fecccdc2c3c210f92946250e904e9a0b7a911300ab606d372ec7fb5c",
    "tui/pr65-fixed": "d603b479e1d75fa2faf4bc67c640336f5413fd3ca9a7bfa1a602180050ea6963",
    "tui/step-loss": "a32868ed8efc8ebfefc0856397dace2563147046e9ea597919532477b75d8a76",
    "tui/support-fullvocab": "78d6923d06281e263f18c7e49e25393d9e3d39ff6f307ab0ae2b462267f80bc3",
    "tui/support-hand": "e4b8d938fc66149036951c7190417537ceef9cd35ed72ef0ee973d10829e5b6f",
    "tui/support-invariants": "01c6c537f76ca9f3d0b989fbe049f6f71bae3d92a8504aad5df8cf76a1cd271f",
    "tui/tis": "c2a0c71db63d88b53480de30674bb3c96b52d7454471db04f82348fbb26fa841",
    "write/synthetic": "1e75ba861331e8fffb716ed54a0785fb69bd0785046063ea03e70829bedbb736",
}
# sha256 over the raw bytes of every file (payload containers, COMPLETE sentinels included), under PINNED_TORCH.
FILE_DIGESTS = {
    "demo/cohort-2rank": "0122f440610d73149746756ec7f75c31d42b8ba900a05bf760e0946d81d2cd90",
    "demo/pr65-buggy": "401e72333db76738e9b7f233db8e63359d8512340582fcd80966ba5653270c0d",
    "demo/pr65-fixed": "d6bc66571d3e2453cf67068fff7a3f0188934158adfbddf28dd7d5c6ecd3d56f",
    "demo/step-loss": "fea49f6beae8a12b0167b78bbfa658a1fa8baa2178e061d104043f44e7e9b823",
    "demo/support-fullvocab": "2c83b51c65957942032070e6724e2fa57de4242f3e4466995ead711fcda465e7",
    "tui/brackets": "b27a23dc17604a8884865bef7f819e02d56d4f8581f9b9dcfa592a9bd9852f57",
    "tui/broken": "43b515410bbd586bd6878321d279cdd0ec47fe95e2b9682835faf499fae20099",
    "tui/cohort-2rank": "0122f440610d73149746756ec7f75c31d42b8ba900a05bf760e0946d81d2cd90",
    "tui/hazard-clean": "daa90e6a5025e863d70de1387a7268a1777561fe34ab7cd4431910dc5a320ca8",
    "tui/kl-bug": "4b23f442d9972637b7747fc813ec7ab81b4e4c72f78fb86e12b96eed18e8f867",
    "tui/loose-kl": "d1f9be3aad7bda296df5a88ffd4f8813e018df4d35b52d8e6ab6f355ee1bd42b",
    "tui/loss-bug": "41b706a89ce8460d20f28d25c3130111e3059eb2d8e8810e7147747154b48dd2",
    "tui/pr65-buggy": "401e72333db76738e9b7f233db8e63359d8512340582fcd80966ba5653270c0d",
    "tui/pr65-fixed": "d6bc66571d3e2453cf67068fff7a3f0188934158adfbddf28dd7d5c6ecd3d56f",
    "tui/step-loss": "fea49f6beae8a12b0167b78bbfa658a1fa8baa2178e061d104043f44e7e9b823",
    "tui/support-fullvocab": "2c83b51c65957942032070e6724e2fa57de4242f3e4466995ead711fcda465e7",
    "tui/support-hand": "9de410228b63fb56ea60d026ae5ded8dae9c95a65575adbc4982f4eee67f88d9",
    "tui/support-invariants": "a6540bb938ac1c9efa5d13be0532eca164dd8b6a151ce9bbd37d38f9391e1dcb",
    "tui/tis": "ecbb34ac32d4c23824561a5335e690d85ac9ad72c6a15733d633c02fa5640cce",
    "write/synthetic": "d3ec8e16e6b5eff0b1536c0100a0a86b4cbdcd0cc980fcfa9cf0c4aa43f6dbe5",
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
    from replay_lib.report import fmt_value

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
