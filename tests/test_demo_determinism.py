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
    "demo/cohort-2rank": "a54069406ed3f20192862c2e4cc7e34ab0109849bbf2d6caeef4eb1d04a3cf4e",
    "demo/hazard-clean": "e9276797a10a3d2d0902375859769eebe5b574e2fd9473dce8bc6b53f1a5e958",
    "demo/kl-bug": "2cf7e118b9b3047d7be907a42716cd87df84e1fd77cb36b2dc68b5659a304dbb",
    "demo/loose-kl": "2685267538e5bda87924e12d71f57546df9a173001500c5b697a75723320b746",
    "demo/loss-bug": "1902a0f4114b74a520b4cfb3222a3d9316b70f9d60a301bcc5f05872c914cde6",
    "demo/nemo-loo": "bb03c46b91ecec4e3ba9292cb39d20ef370f406af90f0654e9f47f86aaa532cd",
    "demo/pr65-buggy": "a1ff32f917179942761e89a4a89c0152dba044c8dc75025e65ea842f75e48842",
    "demo/pr65-fixed": "a9fa157ddf10c1f699ca483e9c40ce34e04439935765cb568f0c3bb53bbfe772",
    "demo/step-loss": "eada9cc68ab48e3218f17b049168c39653f3ac77501f7ebeba60339e7bd66eef",
    "demo/support-fullvocab": "8b3d6309076f3807f5fdac3b53d39ff53ab9dded01928f5c23714ba7b993bf3b",
    "demo/verl-dapo": "2338684c6109d4d48a9caaa390e097ffec29a5504a775b94b9249f0d0b1c397a",
    "tui/brackets": "b066772dc115693413a4368f3df99330c01d0bde084df4d19614e7bc21de69c6",
    "tui/broken": "a1ff32f917179942761e89a4a89c0152dba044c8dc75025e65ea842f75e48842",
    "tui/cohort-2rank": "a54069406ed3f20192862c2e4cc7e34ab0109849bbf2d6caeef4eb1d04a3cf4e",
    "tui/hazard-clean": "e9276797a10a3d2d0902375859769eebe5b574e2fd9473dce8bc6b53f1a5e958",
    "tui/kl-bug": "2cf7e118b9b3047d7be907a42716cd87df84e1fd77cb36b2dc68b5659a304dbb",
    "tui/loose-kl": "2685267538e5bda87924e12d71f57546df9a173001500c5b697a75723320b746",
    "tui/loss-bug": "1902a0f4114b74a520b4cfb3222a3d9316b70f9d60a301bcc5f05872c914cde6",
    "tui/pr65-buggy": "a1ff32f917179942761e89a4a89c0152dba044c8dc75025e65ea842f75e48842",
    "tui/pr65-fixed": "a9fa157ddf10c1f699ca483e9c40ce34e04439935765cb568f0c3bb53bbfe772",
    "tui/refused": "910730864fcffe9804a8d6916eb03b1df20ae799ecc326123cf851b8743698eb",
    "tui/step-loss": "eada9cc68ab48e3218f17b049168c39653f3ac77501f7ebeba60339e7bd66eef",
    "tui/support-fullvocab": "8b3d6309076f3807f5fdac3b53d39ff53ab9dded01928f5c23714ba7b993bf3b",
    "tui/support-hand": "3127aa43ab69d49f2c43b0f7ebd91de4c611e55a04e337a37934660281c33462",
    "tui/support-invariants": "6695bfbde9c0bf2fd81123e368e2f380976f59a254d7ca69b5a7ab2e152fc4a0",
    "write/synthetic": "7fe507f9f85ab10685156061a55a8ed8bb1a1d84570301dd2690a5b905674f74",
}
# sha256 over the raw bytes of every file (payload containers, COMPLETE sentinels included), under PINNED_TORCH.
FILE_DIGESTS = {
    "demo/cohort-2rank": "3fbb3c45589d175e176a873c2b12788b87bfcc9cb5dfcafd63701abe21b7bc90",
    "demo/hazard-clean": "c78445b1eda3f5985d0c825b7d52d7ed165b9422a2a8e3bb825ef754be62d347",
    "demo/kl-bug": "b5f4327f0c87673148040bf7ccfa9ac7b0b5ca0889122cb62e7e73b1969e160e",
    "demo/loose-kl": "2181a5e2bc7439c55aea92131c86998a44ad0631b9dd6b0711285659d3e3aed3",
    "demo/loss-bug": "3e57fa3487e6c19d352eb6d7886850c7f94cabb393d9703a32b6ae59a2093bb6",
    "demo/nemo-loo": "af95b7c400fe52ca8be3def3557f30edb3a7d52046297d65c38eeb3a9c09e020",
    "demo/pr65-buggy": "66cbbd231774060f9d3656b00a5f061a873f96ebfc6ea81cb6844e52bd694646",
    "demo/pr65-fixed": "178c5c42805727bdbea1be023304203377875c2ca961a663e94e6eadd8c6cc6c",
    "demo/step-loss": "75cc047b4e0e82482616c1105f100680d403f099c44de065f2256dbfeb6b4483",
    "demo/support-fullvocab": "377ed788d48be5cab6730da7d901b70c78df477f644e1d28e5357b8a3a95b5fa",
    "demo/verl-dapo": "f0f31016e88461aac89e0304d49db858a31d6da8087a783fe81e0216772dc80b",
    "tui/brackets": "1467ea6cd06fc7997f187f9d0a355dfab82073b6d461604cd449bd80fb86d48f",
    "tui/broken": "ac01dff2d22716ca2d1d4e3875fd30c9eb6aeead61eedc8f9fddbeda068dedb7",
    "tui/cohort-2rank": "3fbb3c45589d175e176a873c2b12788b87bfcc9cb5dfcafd63701abe21b7bc90",
    "tui/hazard-clean": "c78445b1eda3f5985d0c825b7d52d7ed165b9422a2a8e3bb825ef754be62d347",
    "tui/kl-bug": "b5f4327f0c87673148040bf7ccfa9ac7b0b5ca0889122cb62e7e73b1969e160e",
    "tui/loose-kl": "2181a5e2bc7439c55aea92131c86998a44ad0631b9dd6b0711285659d3e3aed3",
    "tui/loss-bug": "3e57fa3487e6c19d352eb6d7886850c7f94cabb393d9703a32b6ae59a2093bb6",
    "tui/pr65-buggy": "66cbbd231774060f9d3656b00a5f061a873f96ebfc6ea81cb6844e52bd694646",
    "tui/pr65-fixed": "178c5c42805727bdbea1be023304203377875c2ca961a663e94e6eadd8c6cc6c",
    "tui/refused": "dae33dd38f5dfb664668afd81df1e6233dd1a6ca9bfd350ba758554547aee9eb",
    "tui/step-loss": "75cc047b4e0e82482616c1105f100680d403f099c44de065f2256dbfeb6b4483",
    "tui/support-fullvocab": "377ed788d48be5cab6730da7d901b70c78df477f644e1d28e5357b8a3a95b5fa",
    "tui/support-hand": "3657b04bfa0dd8f361825d1ec5ce65e42a8c657775f06c2a762e592806a0953e",
    "tui/support-invariants": "6b69cba38e6e388b1fc272a0d22509b89c4e66c1258500081cff4e68ebd11b88",
    "write/synthetic": "e96df61f768b56467bf9a1e5049138a91680422b94da52503aa6afa32a51d964",
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
