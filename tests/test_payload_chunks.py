"""Per-chunk payload checksums (SPEC §2.3, §11): ``replay --sample/--group/--batch`` verifies only the chunks that
hold the selected samples' bytes, a full replay and ``validate`` verify every byte as before.

The bundles are written with 64 KiB chunks (the smallest a reader takes) so that a 64-sample bundle has several
chunks per payload; the commands run in real processes on real files. Expected checksums come from ``hashlib`` over
the file's own slices, never from the code under test.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay_lib.bundle import chunks
from replay_lib.bundle.resolution import open_bundle
from replay_lib.bundle.selection import Selection
from replay_lib.demo.bundles import write_synthetic
from replay_lib.errors import BundleError
from replay_lib.judge.report import render_text
from replay_lib.run.runner import run_replay

CHUNK = 1 << 16
# 64 samples × 1,024 tokens, groups of 4: a float32 payload is 262,144 data bytes after an 80-byte header → 5 chunks.
# Sample s-40 (group 10: s-40..s-43, tokens 40,960..45,056) lies in chunk 2 of each float32 payload.
KW = dict(samples=64, tokens=1024, kl_coef=0.0)
PREFIX = "trajectory-replay: error: "


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _run(*args):
    return subprocess.run([sys.executable, "-m", "replay_lib", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def bundle(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(chunks, "CHUNK_BYTES", CHUNK)
    return write_synthetic(tmp_path / "b", bundle_id="b", **KW)


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_bytes())


def _flip(file: Path, at: int) -> None:
    """One byte changed in place (same size; no checksum updated)."""
    data = bytearray(file.read_bytes())
    data[at] ^= 0x55
    file.write_bytes(bytes(data))


def _reseal_manifest_only(path: Path, edit) -> None:
    """Edit manifest.json and record its new sha256 in the sentinels, nothing else (the chunk lists stay as edited)."""
    doc = _manifest(path)
    edit(doc)
    blob = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
    (path / "manifest.json").write_bytes(blob)
    for sentinel in path.glob("COMPLETE*"):
        sdoc = json.loads(sentinel.read_bytes())
        sdoc["metadata"]["manifest.json"] = _sha(blob)
        sentinel.write_text(json.dumps(sdoc, indent=2, sort_keys=True) + "\n")


def _sample_bytes(path: Path, name: str, sample: int) -> tuple[int, int]:
    """The byte range of sample ``sample``'s rows in payload ``name`` (the data fills the file's tail)."""
    index = json.loads((path / "index.json").read_bytes())
    spec = _manifest(path)["payloads"][name]
    itemsize = {"torch.float32": 4, "torch.uint8": 1}[spec["dtype"]]
    base = spec["bytes"] - spec["shape"][0] * itemsize
    start = sum(s["response_length"] for s in index["samples"][:sample])
    return base + start * itemsize, base + (start + index["samples"][sample]["response_length"]) * itemsize


def test_writer_records_each_chunk(bundle, tmp_path):
    manifest = _manifest(bundle)
    for name, spec in manifest["payloads"].items():
        data = (bundle / "payloads" / f"{name}.safetensors").read_bytes()
        assert spec["sha256"] == _sha(data)
        assert spec["chunks"] == {"bytes": CHUNK,
                                  "sha256": [_sha(data[i:i + CHUNK]) for i in range(0, len(data), CHUNK)]}
    assert len(manifest["payloads"]["log_probs"]["chunks"]["sha256"]) == 5


def test_default_chunk_size_and_pt_payloads(tmp_path):
    """4 MiB chunks by default; none for .pt payloads (format 1.1.0 is written as before)."""
    default = write_synthetic(tmp_path / "default", samples=4, tokens=8)
    assert {spec["chunks"]["bytes"] for spec in _manifest(default)["payloads"].values()} == {4 << 20}
    old = write_synthetic(tmp_path / "old", samples=4, tokens=8, format_version="1.1.0")
    assert all("chunks" not in spec for spec in _manifest(old)["payloads"].values())


def test_hash_file_one_read(tmp_path):
    data = torch.randint(0, 256, (3 * (1 << 20) + 12345,), dtype=torch.uint8).numpy().tobytes()
    file = tmp_path / "f"
    file.write_bytes(data)
    for chunk in (1 << 16, 1 << 20, 32 << 20):  # several chunks a read, one read a chunk (two threads), one chunk
        whole, sums = chunks.hash_file(file, chunk)
        assert whole == _sha(data)
        assert sums == [_sha(data[i:i + chunk]) for i in range(0, len(data), chunk)]


def test_far_chunk_altered_only_a_full_verification_sees_it(bundle):
    before = _run("replay", bundle, "--sample", "s-40")
    assert before.returncode == 0, before.stderr
    # the report text is the one a fully verified open gives
    full_open = run_replay(open_bundle(bundle), selection=Selection(samples=("s-40",)))
    assert before.stdout == "".join(line + "\n" for _, line in render_text(full_open))
    file = bundle / "payloads" / "log_probs.safetensors"
    recorded = _manifest(bundle)["payloads"]["log_probs"]["sha256"]
    _flip(file, file.stat().st_size - 100)  # chunk 3, far from the chunk 2 of s-40
    after = _run("replay", bundle, "--sample", "s-40")
    assert (after.returncode, after.stdout, after.stderr) == (0, before.stdout, "")
    actual = _sha(file.read_bytes())
    line = (f"{PREFIX}{file}: sha256 mismatch (manifest {recorded[:12]}…, COMPLETE.0 {recorded[:12]}…, "
            f"file {actual[:12]}…)\n")
    for args in (("replay", bundle), ("validate", bundle)):
        done = _run(*args)
        assert (done.returncode, done.stdout, done.stderr) == (3, "", line)


def test_selection_reads_only_its_chunks(bundle):
    """What a selected replay verified: the header chunk and the chunk of its group's rows, nothing else; any other
    read through the reader verifies first (a range) or hashes the whole file (the whole tensor)."""
    bundles = open_bundle(bundle, defer_payloads=True)
    reader = bundles.shards[0]
    assert reader.verified_chunks() == {name: [0] for name in
                                        ("advantages", "entropy", "kl", "log_probs", "loss_mask", "old_log_probs")}
    report = run_replay(bundles, selection=Selection(samples=("s-40",)))
    assert report.passed and report.selected_samples == ["s-40", "s-41", "s-42", "s-43"]
    # the group's rows of each float32 payload are in chunk 2; of the one-byte mask, in chunk 0 (with the header)
    assert reader.verified_chunks() == {"advantages": [0, 2], "entropy": [0, 2], "kl": [0, 2], "log_probs": [0, 2],
                                        "loss_mask": [0], "old_log_probs": [0, 2]}
    file = bundle / "payloads" / "log_probs.safetensors"
    _flip(file, file.stat().st_size - 100)
    near = reader.payload_rows("log_probs", torch.arange(40 * 1024, 44 * 1024))
    assert near.shape == (4096,)
    with pytest.raises(BundleError, match=r"log_probs\.safetensors: chunk 3 \(bytes 196608–262144\): sha256 "
                                          r"mismatch \(manifest \$\.payloads\.log_probs\.chunks\.sha256\[3\] "):
        reader.payload_rows("log_probs", torch.arange(63 * 1024, 64 * 1024))
    with pytest.raises(BundleError, match=r"log_probs\.safetensors: sha256 mismatch \(manifest "):
        reader.payload("log_probs")


def test_selected_chunk_altered_is_refused(bundle):
    file = bundle / "payloads" / "advantages.safetensors"
    lo, hi = _sample_bytes(bundle, "advantages", 41)
    assert lo // CHUNK == 2 and (hi - 1) // CHUNK == 2
    _flip(file, lo + 10)
    expected = _manifest(bundle)["payloads"]["advantages"]["chunks"]["sha256"][2]
    data = file.read_bytes()
    done = _run("replay", bundle, "--sample", "s-40")
    assert (done.returncode, done.stdout) == (3, "")
    assert done.stderr == (f"{PREFIX}{file}: chunk 2 (bytes 131072–196608): sha256 mismatch (manifest "
                           f"$.payloads.advantages.chunks.sha256[2] {expected[:12]}…, file "
                           f"{_sha(data[2 * CHUNK:3 * CHUNK])[:12]}…)\n")
    assert _run("replay", bundle, "--group", "g-10").stderr == done.stderr
    assert _run("replay", bundle, "--sample", "s-3").returncode == 0  # another group's chunk


def test_altered_header_chunk_is_refused(bundle):
    file = bundle / "payloads" / "kl.safetensors"
    _flip(file, 40)  # inside the JSON header: one of its characters
    done = _run("replay", bundle, "--sample", "s-3")
    assert done.returncode == 3 and done.stdout == ""
    assert done.stderr.startswith(f"{PREFIX}{file}: chunk 0 (bytes 0–65536): sha256 mismatch (manifest "
                                  f"$.payloads.kl.chunks.sha256[0] ")
    assert done.stderr.count("\n") == 1


def test_chunk_checksum_altered_in_manifest(bundle):
    def edit(doc):
        sums = doc["payloads"]["kl"]["chunks"]["sha256"]
        sums[1] = "0" * 64

    blob = (bundle / "manifest.json").read_bytes()
    recorded = json.loads((bundle / "COMPLETE").read_bytes())["metadata"]["manifest.json"]
    doc = json.loads(blob)
    edit(doc)
    (bundle / "manifest.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    actual = _sha((bundle / "manifest.json").read_bytes())
    line = f"{PREFIX}{bundle / 'manifest.json'}: sha256 mismatch (COMPLETE {recorded[:12]}…, file {actual[:12]}…)\n"
    for args in (("replay", bundle, "--sample", "s-40"), ("replay", bundle), ("validate", bundle)):
        done = _run(*args)
        assert (done.returncode, done.stdout, done.stderr) == (3, "", line)


def test_bundle_without_chunk_lists_is_verified_whole(bundle, bundle_tools, tmp_path):
    bundle_tools.edit_json(bundle, "manifest.json",
                           lambda doc: [spec.pop("chunks") for spec in doc["payloads"].values()])
    file = bundle / "payloads" / "log_probs.safetensors"
    recorded = _manifest(bundle)["payloads"]["log_probs"]["sha256"]
    _flip(file, file.stat().st_size - 100)
    line = (f"{PREFIX}{file}: sha256 mismatch (manifest {recorded[:12]}…, COMPLETE.0 {recorded[:12]}…, "
            f"file {_sha(file.read_bytes())[:12]}…)\n")
    done = _run("replay", bundle, "--sample", "s-40")
    assert (done.returncode, done.stdout, done.stderr) == (3, "", line)
    # format 1.1.0 (.pt payloads, no chunk lists): the same
    old = write_synthetic(tmp_path / "old", bundle_id="old", format_version="1.1.0", **KW)
    file = old / "payloads" / "log_probs.pt"
    recorded = _manifest(old)["payloads"]["log_probs"]["sha256"]
    _flip(file, file.stat().st_size - 30000)
    done = _run("replay", old, "--sample", "s-40")
    assert (done.returncode, done.stdout) == (3, "")
    assert done.stderr == (f"{PREFIX}{file}: sha256 mismatch (manifest {recorded[:12]}…, COMPLETE.0 "
                           f"{recorded[:12]}…, file {_sha(file.read_bytes())[:12]}…)\n")


@pytest.mark.parametrize("edit, where", [
    (lambda c: c["sha256"].pop(), "$.payloads.log_probs.chunks.sha256: 4 checksum(s), expected 5 (one per "
                                  "65536-byte chunk of the 262224-byte file)"),
    (lambda c: c.update(sha256=c["sha256"] + [c["sha256"][0]]),
     "$.payloads.log_probs.chunks.sha256: 6 checksum(s), expected 5 (one per 65536-byte chunk of the 262224-byte "
     "file)"),
    (lambda c: c.update(sha256="ab" * 32),
     "$.payloads.log_probs.chunks.sha256: expected an array of sha256 digests, got a string"),
    (lambda c: c["sha256"].__setitem__(3, "zz" * 32),
     "$.payloads.log_probs.chunks.sha256[3]: expected a sha256 digest (64 lowercase hex digits), got a string of 64 "
     "character(s) that is not one"),
    (lambda c: c["sha256"].__setitem__(3, c["sha256"][3].upper()),
     "$.payloads.log_probs.chunks.sha256[3]: expected a sha256 digest (64 lowercase hex digits), got a string of 64 "
     "character(s) that is not one"),
    (lambda c: c["sha256"].__setitem__(3, 7),
     "$.payloads.log_probs.chunks.sha256[3]: expected a sha256 digest (64 lowercase hex digits), got an integer"),
    (lambda c: c.update(bytes="65536"),
     "$.payloads.log_probs.chunks.bytes: expected an integer from 65536 to 1073741824, got a string"),
    (lambda c: c.update(bytes=1024),
     "$.payloads.log_probs.chunks.bytes: expected an integer from 65536 to 1073741824, got 1024"),
    (lambda c: c.pop("bytes"), "$.payloads.log_probs.chunks.bytes: missing (the size of each chunk)"),
    (lambda c: c.clear() or c.update(x=1), "$.payloads.log_probs.chunks.bytes: missing (the size of each chunk)"),
], ids=["too-few", "too-many", "not-a-list", "not-hex", "upper-hex", "not-a-string", "size-type", "size-small",
        "no-size", "not-chunks"])
def test_malformed_chunk_list(bundle, edit, where):
    """Exit 3 naming the field, for a selected replay and a full verification alike."""
    _reseal_manifest_only(bundle, lambda doc: edit(doc["payloads"]["log_probs"]["chunks"]))
    line = f"{PREFIX}{bundle / 'manifest.json'}: {where}\n"
    for args in (("replay", bundle, "--sample", "s-40"), ("validate", bundle)):
        done = _run(*args)
        assert (done.returncode, done.stdout, done.stderr) == (3, "", line)


def test_reseal_recomputes_the_chunk_lists(bundle):
    file = bundle / "payloads" / "log_probs.safetensors"
    _flip(file, file.stat().st_size - 100)
    done = _run("reseal", bundle, "--i-edited-it")
    assert done.returncode == 0, done.stderr
    data = file.read_bytes()
    # recomputed at the writer's size (4 MiB: one chunk here), in the same read as the whole file's sha256
    assert _manifest(bundle)["payloads"]["log_probs"]["chunks"] == {"bytes": 4 << 20, "sha256": [_sha(data)]}
    assert _run("replay", bundle, "--sample", "s-63").returncode == 0



def test_chunks_not_an_object(bundle):
    _reseal_manifest_only(bundle, lambda doc: doc["payloads"]["kl"].update(chunks=[1, 2]))
    done = _run("replay", bundle, "--sample", "s-40")
    assert (done.returncode, done.stdout, done.stderr) == (
        3, "", f"{PREFIX}{bundle / 'manifest.json'}: $.payloads.kl.chunks: expected an object, got an array\n")


def test_cohort_verifies_each_shard_as_far_as_its_selection_reads(tmp_path, monkeypatch):
    """A cohort: a shard verifies the chunks of its own selected samples; a shard that selects none is not read."""
    from replay_lib.demo.bundles import write_cohort

    monkeypatch.setattr(chunks, "CHUNK_BYTES", CHUNK)
    cohort = write_cohort(tmp_path / "c", ranks=2, **KW)
    file = cohort / "rank-1" / "payloads" / "kl.safetensors"
    lo, _ = _sample_bytes(cohort / "rank-1", "kl", 40)
    _flip(file, lo + 4)  # rank 1's r1-s-40, in its chunk 2
    assert _run("replay", cohort, "--sample", "r0-s-40").returncode == 0  # rank 1 selects nothing: not read
    assert _run("replay", cohort, "--sample", "r1-s-3").returncode == 0  # rank 1's chunk 0 only
    done = _run("replay", cohort, "--sample", "r1-s-40")
    expected = _manifest(cohort / "rank-1")["payloads"]["kl"]["chunks"]["sha256"][2]
    assert (done.returncode, done.stdout) == (3, "")
    assert done.stderr == (f"{PREFIX}{file}: chunk 2 (bytes 131072–196608): sha256 mismatch (manifest "
                           f"$.payloads.kl.chunks.sha256[2] {expected[:12]}…, file "
                           f"{_sha(file.read_bytes()[2 * CHUNK:3 * CHUNK])[:12]}…)\n")
    full = _run("replay", cohort)
    assert full.returncode == 3 and full.stderr.startswith(f"{PREFIX}{file}: sha256 mismatch (manifest ")


def test_deferred_open_of_a_full_replay_verifies_every_payload_first(bundle):
    """``runner.replay`` defers only for a selection; a deferred open given a whole replay (an empty selection) still
    verifies every payload whole before any stage runs."""
    file = bundle / "payloads" / "old_log_probs.safetensors"
    _flip(file, file.stat().st_size - 100)
    bundles = open_bundle(bundle, defer_payloads=True)  # header chunks only: opens
    progress = []
    with pytest.raises(BundleError, match=r"old_log_probs\.safetensors: sha256 mismatch \(manifest "):
        run_replay(bundles, progress=lambda *args: progress.append(args))
    assert progress == []  # no stage started


def test_validate_checks_every_chunk_list_a_full_replay_does_not_need(bundle, monkeypatch):
    """A chunk list that lies while the whole file's sha256 is right (a writer's bug, the manifest sealed over it):
    validate and reseal's verification refuse it, naming the chunk, as a selected replay that reads the chunk does;
    a full replay (whole-file checksums) passes. The same line whichever way the chunks were
    hashed: ahead by the reader (a small bundle), on the hashing thread beside the whole file, or chunk by chunk
    when the thread left them."""
    from replay_lib.bundle import reader as reader_mod
    from replay_lib.run.validate import validate

    file = bundle / "payloads" / "log_probs.safetensors"
    data = file.read_bytes()
    sums = _manifest(bundle)["payloads"]["log_probs"]["chunks"]["sha256"]
    assert len(sums) == 5 and len(data) > 4 * CHUNK
    _reseal_manifest_only(bundle, lambda doc: doc["payloads"]["log_probs"]["chunks"]["sha256"].__setitem__(4, sums[3]))
    line = (f"{file}: chunk 4 (bytes {4 * CHUNK}–{len(data)}): sha256 mismatch (manifest $.payloads.log_probs.chunks."
            f"sha256[4] {sums[3][:12]}…, file {sums[4][:12]}…)")
    for args, code in ((("validate", bundle), 3), (("replay", bundle, "--sample", "s-63"), 3), (("replay", bundle), 0)):
        done = _run(*args)
        assert done.returncode == code, (args, done.stderr)
        assert done.stderr == (f"{PREFIX}{line}\n" if code else ""), args
    monkeypatch.setattr(reader_mod, "HASH_AHEAD_BYTES", 0)  # every payload hashed by the reader's thread
    with pytest.raises(BundleError) as raised:
        validate(bundle)
    assert str(raised.value) == line
    monkeypatch.setattr(reader_mod._Digests, "parts", lambda self, path: None)  # the thread's digests missing
    with pytest.raises(BundleError) as raised:
        validate(bundle)
    assert str(raised.value) == line
    edited = _run("reseal", bundle, "--i-edited-it")  # recomputes the lists (at its own 4 MiB), verifies as validate
    assert edited.returncode == 0, edited.stderr
    assert _manifest(bundle)["payloads"]["log_probs"]["chunks"] == {"bytes": 4 << 20, "sha256": [_sha(data)]}
    validate(bundle)
