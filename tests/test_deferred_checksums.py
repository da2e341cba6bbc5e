"""Deferred payload checksums (SPEC §11): the replay's stages run on a format-1.3 bundle's safetensors payloads while
the reader's thread still hashes them, and every checksum is judged before anything derived from a payload is
reported — a mismatch reported with the eager reader's message and exit code, whatever the stages did meanwhile.

In-process tests hold the hashing thread at a gate (so the stages provably run first); real processes run the CLI
with the reader's hash-ahead size set to 0, so that every payload of a small bundle is hashed by the thread (as
every payload of a bundle above ``HASH_AHEAD_BYTES`` is)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import replay_lib.bundle.reader as reader_module
from replay_lib.bundle import BundleReader, open_bundle
from replay_lib.bundle.schema import StageId
from replay_lib.demo.bundles import write_synthetic
from replay_lib.errors import BundleError
from replay_lib.judge.report import report_to_json
from replay_lib.run.runner import run_replay
from replay_lib.stages import REGISTRY

KW = dict(samples=16, tokens=512, kl_coef=0.0, seed=5)

# The CLI as its console scripts run it, every payload hashed by the reader's thread (HASH_AHEAD_BYTES = 0).
LAUNCH = """import sys
import replay_lib.bundle.reader as reader
reader.HASH_AHEAD_BYTES = 0
if sys.argv[1] == "replay-tui":
    from replay_tui.__main__ import main
    sys.exit(main(sys.argv[2:]))
from replay_lib.cli.entry import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("deferred") / "b", **KW)


def _copy(clean: Path, where: Path) -> Path:
    return Path(shutil.copytree(clean, where))


def _data_start(file: Path) -> int:
    return 8 + struct.unpack("<Q", file.read_bytes()[:8])[0]


def _alter(bundle: Path, name: str, values: list[float], at: int = 10) -> Path:
    """float32 ``values`` written over the payload ``name``'s tokens from ``at``: same size, checksums unchanged."""
    file = bundle / "payloads" / f"{name}.safetensors"
    with open(file, "r+b") as fh:
        fh.seek(_data_start(file) + 4 * at)
        fh.write(struct.pack(f"<{len(values)}f", *values))
    return file


def _mismatch_line(bundle: Path, file: Path) -> str:
    """The eager reader's refusal of ``bundle`` (opened without deferral): the line a deferred open must give."""
    with pytest.raises(BundleError) as refused:
        BundleReader(bundle)
    message = str(refused.value)
    assert message.startswith(f"{file}: sha256 mismatch (manifest "), message
    return message


@pytest.fixture
def gate(monkeypatch):
    """The reader's hashing thread held before each payload file until the gate opens (30 s at most)."""
    event = threading.Event()
    hashed = []
    original = reader_module._sha256_regular

    def held(path, stop):
        event.wait(30)
        hashed.append(Path(path).name)
        return original(path, stop)

    monkeypatch.setattr(reader_module, "HASH_AHEAD_BYTES", 0)
    monkeypatch.setattr(reader_module, "_sha256_regular", held)
    event.hashed = hashed
    return event


def test_the_reader_defers_only_when_asked(clean, gate):
    reader = BundleReader(clean, defer_checksums=True)  # returns while every payload waits for its hash
    assert not reader.verified and gate.hashed == []
    assert reader.payload("log_probs").numel() == sum(s.response_length for s in reader.index.samples)
    gate.set()
    reader.confirm()
    assert reader.verified and len(gate.hashed) == len(reader.manifest.payloads)
    reader.confirm()  # idempotent
    eager = BundleReader(clean)
    assert eager.verified


def _replay_refused(bundle, expected: str, gate, monkeypatch):
    """The bundle replayed deferred, its hashing thread held until ``confirm`` is called: the replay raises the
    checksum's line. The opened set, for more checks."""
    confirm = BundleReader.confirm

    def opening(self):
        gate.set()
        return confirm(self)

    monkeypatch.setattr(BundleReader, "confirm", opening)
    bundles = open_bundle(bundle, defer_checksums=True)
    with pytest.raises(BundleError) as refused:
        run_replay(bundles)
    assert str(refused.value) == expected
    return bundles


def test_stages_run_before_the_checksum_and_a_mismatch_wins_over_their_report(clean, tmp_path, gate, monkeypatch):
    bundle = _copy(clean, tmp_path / "b")
    file = _alter(bundle, "log_probs", [float("nan")] * 4)
    gate.set()
    expected = _mismatch_line(bundle, file)
    gate.clear()
    gate.hashed.clear()
    ran = []
    loss = REGISTRY[StageId.LOSS_POLICY]

    def recorded(ctx):
        ran.append(list(gate.hashed))  # what the thread had hashed when the stage ran
        return loss.run(ctx)

    monkeypatch.setitem(REGISTRY, StageId.LOSS_POLICY, dataclasses.replace(loss, run=recorded))
    bundles = _replay_refused(bundle, expected, gate, monkeypatch)
    assert ran == [[]]  # loss.policy ran on the altered payload before any payload was hashed
    with pytest.raises(BundleError) as again:
        bundles.confirm()
    assert str(again.value) == expected


def test_an_exception_a_stage_raises_gives_way_to_the_checksum(clean, tmp_path, gate, monkeypatch):
    bundle = _copy(clean, tmp_path / "b")
    file = _alter(bundle, "advantages", [1e30] * 8)
    gate.set()
    expected = _mismatch_line(bundle, file)
    gate.clear()

    def broken(ctx):
        raise RuntimeError("a stage meeting the altered values")

    monkeypatch.setitem(REGISTRY, StageId.LOSS_POLICY, dataclasses.replace(REGISTRY[StageId.LOSS_POLICY], run=broken))
    _replay_refused(bundle, expected, gate, monkeypatch)
    # the same stage on a clean bundle: its own error (a bug of the tool) is what comes out
    gate.clear()
    bundles = open_bundle(clean, defer_checksums=True)
    with pytest.raises(RuntimeError, match="altered values"):
        run_replay(bundles)


def test_a_reader_check_failing_on_altered_bytes_gives_way_to_the_checksum(clean, tmp_path, gate, monkeypatch):
    """A payload whose header now says I32 (a valid header, the size unchanged) is refused by the reader's dtype
    check once loaded; with its checksum deferred (the thread held until the reader judges the pending ones) it
    still reports the sha256 mismatch, as the eager order does."""
    bundle = _copy(clean, tmp_path / "b")
    file = bundle / "payloads" / "log_probs.safetensors"
    blob = file.read_bytes()
    assert blob.count(b'"dtype":"F32"') == 1
    file.write_bytes(blob.replace(b'"dtype":"F32"', b'"dtype":"I32"'))
    gate.set()
    expected = _mismatch_line(bundle, file)
    gate.clear()
    judged = []
    judge = BundleReader._judge_pending

    def opening(self):
        judged.append(len(self._pending))
        gate.set()
        return judge(self)

    monkeypatch.setattr(BundleReader, "_judge_pending", opening)
    with pytest.raises(BundleError) as refused:
        open_bundle(bundle, defer_checksums=True)
    assert str(refused.value) == expected
    assert judged[-1] >= 1  # judged from the pending list, after the dtype check failed


def test_a_clean_bundles_report_is_the_same_deferred_or_not(clean, gate):
    gate.set()
    eager = report_to_json(run_replay(open_bundle(clean)))
    deferred = report_to_json(run_replay(open_bundle(clean, defer_checksums=True)))
    assert deferred == eager


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LAUNCH, *map(str, args)], capture_output=True, text=True,
                          timeout=180)


BYTES, NANS = [0.25, -3.5], [float("nan")] * 64


# every command with altered bytes; NaNs (values a stage computes with and may raise on) where stages run deferred
@pytest.mark.parametrize("argv, values", [
    (("trajectory-replay", "replay"), BYTES), (("trajectory-replay", "replay", "--format", "json"), BYTES),
    (("trajectory-replay", "validate"), BYTES), (("replay-tui", "--check"), BYTES),
    (("trajectory-replay", "replay", "--format", "json"), NANS), (("replay-tui", "--check"), NANS)],
    ids=["replay-bytes", "json-bytes", "validate-bytes", "check-bytes", "json-nan", "check-nan"])
def test_an_altered_payload_exits_3_with_the_sha256_line_and_no_report(clean, tmp_path, argv, values):
    bundle = _copy(clean, tmp_path / "b")
    file = _alter(bundle, "log_probs", values)
    expected = _mismatch_line(bundle, file)
    done = _run(argv[0], *argv[1:2], bundle, *argv[2:])
    assert (done.returncode, done.stdout) == (3, ""), done.stdout + done.stderr
    assert done.stderr == f"{argv[0]}: error: {expected}\n"


def test_scan_rows_an_altered_payload_invalid_with_the_sha256_line(clean, tmp_path):
    root = tmp_path / "run"
    bundle = _copy(clean, root / "b")
    file = _alter(bundle, "old_log_probs", [float("nan")] * 64)
    expected = _mismatch_line(bundle, file)
    done = _run("trajectory-replay", "scan", root, "--format", "json")
    assert done.returncode == 3, done.stdout + done.stderr
    rows = json.loads(done.stdout)["bundles"]
    assert [(row["status"], row["exit_code"], row["message"], row["report"]) for row in rows] == [
        ("invalid", 3, expected, None)]


def test_pt_payloads_keep_the_eager_order(tmp_path, gate):
    """A format-1.1 bundle (``.pt``: an unpickler) is never deferred: the open waits for every checksum."""
    bundle = write_synthetic(tmp_path / "old", format_version="1.1.0", **KW)
    gate.set()
    reader = BundleReader(bundle, defer_checksums=True)
    assert reader.verified and len(gate.hashed) == len(reader.manifest.payloads)
