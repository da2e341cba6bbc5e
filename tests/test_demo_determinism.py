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
    "demo/cohort-2rank": "c45f44472894b2546dea470fd771b1c5dc0ee943e9bf78bf506aec6908360497",
    "demo/hazard-clean": "16b73b0d4dd25c8684183cbbac100611c1d2ab66d34798f3a3c339660f78eec0",
    "demo/kl-bug": "26a2fe89880c20b76c850a886280183f65b8da38898b7e7f4a22f9ab7ef62e35",
    "demo/loose-kl": "dcff6f619982b0bc2269d398706231fa02f001d5465ed21e8308091816851a47",
    "demo/loss-bug": "9777bd7f758426094abcc8ae8be5b28ee06d054cfe8668482b69313c269fa728",
    "demo/nemo-loo": "8dfd87a017118b9dfbe92633283cbe5ef17f38064b9a2f06da21cdf91c8e8d88",
    "demo/pr65-buggy": "0c172fe5afad388d2c14db4e5b80c5b82644fc3597d73e15e426dff47434b1ad",
    "demo/pr65-fixed": "03340290f09305473f18015872b51b37f1b325df58accbfed52f28649e5b152a",
    "demo/step-loss": "b8e01383a2c20a159b4175ba5207ef09dabdecde268d703e113b13f1ea440003",
    "demo/support-fullvocab": "823a1d2658d481f8433ef15641cb823adb6b09e3155704699f9e1eb737f8a7f7",
    "demo/verl-dapo": "54779cc475fb815be1de27420c9a5397dab86e2e08ebbcce771493965d5bfddf",
    "tui/brackets": "dc0cb95c35b0e224825b3871c9bbe6efae0baa31ea49964f8ad6450b4b1c96de",
    "tui/broken": "0c172fe5afad388d2c14db4e5b80c5b82644fc3597d73e15e426dff47434b1ad",
    "tui/cohort-2rank": "c45f44472894b2546dea470fd771b1c5dc0ee943e9bf78bf506aec6908360497",
    "tui/hazard-clean": "16b73b0d4dd25c8684183cbbac100611c1d2ab66d34798f3a3c339660f78eec0",
    "tui/kl-bug": "26a2fe89880c20b76c850a886280183f65b8da38898b7e7f4a22f9ab7ef62e35",
    "tui/loose-kl": "dcff6f619982b0bc2269d398706231fa02f001d5465ed21e8308091816851a47",
    "tui/loss-bug": "9777bd7f758426094abcc8ae8be5b28ee06d054cfe8668482b69313c269fa728",
    "tui/pr65-buggy": "0c172fe5afad388d2c14db4e5b80c5b82644fc3597d73e15e426dff47434b1ad",
    "tui/pr65-fixed": "03340290f09305473f18015872b51b37f1b325df58accbfed52f28649e5b152a",
    "tui/refused": "c82179ed5be049e775ebb9a3eee6c69e71641f5e6b3f74818a0924b0b45f38f0",
    "tui/step-loss": "b8e01383a2c20a159b4175ba5207ef09dabdecde268d703e113b13f1ea440003",
    "tui/support-fullvocab": "823a1d2658d481f8433ef15641cb823adb6b09e3155704699f9e1eb737f8a7f7",
    "tui/support-hand": "91788c06cb95cef487dfbf39bb9d26723baae12c36f2cee71a842c6bc9b1bdc5",
    "tui/support-invariants": "e71616640d413c3cfb23db96005d14a760885751f414d7bed6b9e319dfbf9184",
    "write/synthetic": "e902928646c4ba487a7e3198063b160a2a16e6f642549aa0d77512ea2e09a60f",
}
# sha256 over the raw bytes of every file (payload containers, COMPLETE sentinels included), under PINNED_TORCH.
FILE_DIGESTS = {
    "demo/cohort-2rank": "dd2d26a428d09b8594f690d4d4b85de11cb0457242df190ad02c245e32a1e6e3",
    "demo/hazard-clean": "288e963b2d6b5d73c6a298cab1461069637b3ecf3da2818d12a499af62d37c06",
    "demo/kl-bug": "d3aa40efefdb920a3d278218bda47b4d932c10834a391e81a41311852ba2f354",
    "demo/loose-kl": "e9ae008555acf6a95c966375032f4fa72000527b744d449a8389c52b76357bd1",
    "demo/loss-bug": "82704d35d312ef10127e61f47c126b0a54197fbe622ebf8c2bbe852a4fdeb416",
    "demo/nemo-loo": "f314dd9291e67411d0d0327b89b0de38bd044496bd1bc89a27f2c68caa2351cd",
    "demo/pr65-buggy": "352dafb5532779d8f503a02694314f8db1ae9a1cac2dd1ab68568267429b4fbd",
    "demo/pr65-fixed": "9525565f4954a05fde05b0516d859fe03646a4370d3fcec2be6af67eb4a4a7b8",
    "demo/step-loss": "b0655d79de1284f720a38fe2bc4b4eca849e7af555cf6502d3e987cc9f53b4ba",
    "demo/support-fullvocab": "c5fbf1709611323467c230aed8db6f0e6b425a40b667595a9596be6ddf68ebe5",
    "demo/verl-dapo": "68f8af0f49c0f478252b999d4a08bdc930feebf3df8210624dcd17b9a0baaefb",
    "tui/brackets": "24f574a9c914595327bd2585f03872e6231f336fb4417fe7de13568fb79cd15b",
    "tui/broken": "a6739679f72803f771508d448189e4f4fb5e88c61c3cdef8da2d0a64cadfd76f",
    "tui/cohort-2rank": "dd2d26a428d09b8594f690d4d4b85de11cb0457242df190ad02c245e32a1e6e3",
    "tui/hazard-clean": "288e963b2d6b5d73c6a298cab1461069637b3ecf3da2818d12a499af62d37c06",
    "tui/kl-bug": "d3aa40efefdb920a3d278218bda47b4d932c10834a391e81a41311852ba2f354",
    "tui/loose-kl": "e9ae008555acf6a95c966375032f4fa72000527b744d449a8389c52b76357bd1",
    "tui/loss-bug": "82704d35d312ef10127e61f47c126b0a54197fbe622ebf8c2bbe852a4fdeb416",
    "tui/pr65-buggy": "352dafb5532779d8f503a02694314f8db1ae9a1cac2dd1ab68568267429b4fbd",
    "tui/pr65-fixed": "9525565f4954a05fde05b0516d859fe03646a4370d3fcec2be6af67eb4a4a7b8",
    "tui/refused": "e2befd0c36d55e6999caeba1e8058dd5e11ae663c223ec767b0abeeef17b4620",
    "tui/step-loss": "b0655d79de1284f720a38fe2bc4b4eca849e7af555cf6502d3e987cc9f53b4ba",
    "tui/support-fullvocab": "c5fbf1709611323467c230aed8db6f0e6b425a40b667595a9596be6ddf68ebe5",
    "tui/support-hand": "c65793927a0a51fe83690681d05660ebf9ce28a8982f74b0eccda5ce811135f6",
    "tui/support-invariants": "23c85c073cb3f04ca1979cb12680debf99d68aaf157574280d7e16a9c8a50051",
    "write/synthetic": "21a82c29feda9e458836e457e17aeffef021b8511df26582b4d5a144a0ed31f3",
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
