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
    "demo/cohort-2rank": "830c331e2cd42fd0ff0bc9ef7e8fdc3b65b148edf84c70a90fa408e022f3036c",
    "demo/pr65-buggy": "5eea3360ea48e5ccf1df73fc7590041ec450182a4b9054646945eb01c844c7de",
    "demo/pr65-fixed": "4a85fe0a59022c09b53aaa666279472a00dd7dea90c2960dcd106bd2fce50a76",
    "demo/step-loss": "30f22cf1d6bc3191a3b2754561e214071e593c1886b4044cc704f57c0bfba893",
    "demo/support-fullvocab": "aade6a5aa501f7644d3524121bc3185c2a98f15a8834ac1c15eb263d1ff309af",
    "tui/brackets": "a2ec689a91818fd2e437d5d559b01b25f4c8022170ef1d83129b90f301eb2293",
    "tui/broken": "5eea3360ea48e5ccf1df73fc7590041ec450182a4b9054646945eb01c844c7de",
    "tui/cohort-2rank": "830c331e2cd42fd0ff0bc9ef7e8fdc3b65b148edf84c70a90fa408e022f3036c",
    "tui/kl-bug": "c07b351decb01d0a06660c27b6a887979431bdb16faa4608ed872d7c677503fd",
    "tui/loss-bug": "7cb528bb535242a09168ed6034fff6f4bf68c5407907e1793ff403658bf36a6c",
    "tui/pr65-buggy": "5eea3360ea48e5ccf1df73fc7590041ec450182a4b9054646945eb01c844c7de",
    "tui/pr65-fixed": "4a85fe0a59022c09b53aaa666279472a00dd7dea90c2960dcd106bd2fce50a76",
    "tui/step-loss": "30f22cf1d6bc3191a3b2754561e214071e593c1886b4044cc704f57c0bfba893",
    "tui/support-fullvocab": "aade6a5aa501f7644d3524121bc3185c2a98f15a8834ac1c15eb263d1ff309af",
    "tui/support-hand": "59a0a550a060e6dd8e0504fdaef79c3f2845b3f05e03bb14de749838b3dc0279",
    "tui/support-invariants": "9f7b7847905ff687f7f806aa9f01923b9cdd991fba81587fa44502747b166cdb",
    "tui/tis": "4da8fa2bd0097a332144f2c7a6f53865e2cb13349e498fdfa04de13c33fb7856",
    "write/synthetic": "e8217a96ba3c476d5caf3747e907a31ba3e1210af509c51686d7051d530747d4",
}
# sha256 over the raw bytes of every file (payload containers, COMPLETE sentinels included), under PINNED_TORCH.
FILE_DIGESTS = {
    "demo/cohort-2rank": "750f72e4d987b4208537b1f796e61ffb7e3d684be929be927c8f9c4f59afeca3",
    "demo/pr65-buggy": "768ecee90469d51d4f077e453c4972c5f44c270ea81c28c390cee2e1341279a5",
    "demo/pr65-fixed": "ed1e10f5b79bd2f43c1db26bd07ebc5d763e93c9036cc8e96822b7d95cd616be",
    "demo/step-loss": "425730fd78eee8dc4e41cfa0fc14c4bda8ac264597c08a81dc3369d4797bdbb8",
    "demo/support-fullvocab": "71b22ed323bf6584577dd9a07ff2fa846cdf995f5739daf279394f1c4d172446",
    "tui/brackets": "1959632aaf8d37e8ed18c96746399bb72ce3e6a6199042f9797f3953a9974b45",
    "tui/broken": "efc228aac8f0bd4b2827b460f51951f0044f007b66de7d6c804547e82197d979",
    "tui/cohort-2rank": "750f72e4d987b4208537b1f796e61ffb7e3d684be929be927c8f9c4f59afeca3",
    "tui/kl-bug": "a111e8b744765eb39411518e07eff3746aaa6245dc06de6534532ab9f5e2bdf8",
    "tui/loss-bug": "d225ea9bd136575034fc79ec5c20b57c540a666518674cabea68a552dd7464c2",
    "tui/pr65-buggy": "768ecee90469d51d4f077e453c4972c5f44c270ea81c28c390cee2e1341279a5",
    "tui/pr65-fixed": "ed1e10f5b79bd2f43c1db26bd07ebc5d763e93c9036cc8e96822b7d95cd616be",
    "tui/step-loss": "425730fd78eee8dc4e41cfa0fc14c4bda8ac264597c08a81dc3369d4797bdbb8",
    "tui/support-fullvocab": "71b22ed323bf6584577dd9a07ff2fa846cdf995f5739daf279394f1c4d172446",
    "tui/support-hand": "557360c86f3fe8c060276054dd5501335b6df0dea36bb1c37b8c49cd472ffc1b",
    "tui/support-invariants": "d1d576adfa752791517390fdb98c001b53030befcbfa8724415aacc3ee34682c",
    "tui/tis": "a5f1e6dae5e7e3b9a5eb3503d4308e97a6cdebe144884fa0764820e548925657",
    "write/synthetic": "b487aa6e08b46f87406e3c034e7309aea0960ac266ad93763aef5bfb07c019a3",
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
