"""Format 1.3.0 (SPEC §2.3): loss masks packed into the payload ``loss_mask``, payloads stored as safetensors.

Round trips of both forms (1.1.0: JSON masks and ``.pt``; 1.3.0: packed and ``.safetensors``), the original's 1.0.0
bundles still read, the payload files read by the safetensors library itself (an independent reader), and hostile
safetensors headers and packed masks refused with one line (exit 3).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from replay_lib.bundle import BundleReader, BundleWriter
from replay_lib.bundle.packed import PACKED_FORMAT_VERSION, is_packed, payload_suffix
from replay_lib.bundle.schema import FORMAT_VERSION, UNPACKED_FORMAT_VERSION
from replay_lib.demo.bundles import synthetic_parts, write_synthetic
from replay_lib.errors import BundleError

KW = dict(samples=8, tokens=24, seed=3, vary_lengths=True)
OLD = UNPACKED_FORMAT_VERSION  # the older form (masks in index.json, .pt payloads), written explicitly


def _both(tmp_path: Path) -> tuple[Path, Path]:
    old = write_synthetic(tmp_path / "old", format_version=OLD, **KW)
    new = write_synthetic(tmp_path / "new", **KW)  # the default: format 1.3.0
    return old, new


def test_version_rules():
    assert [is_packed(v) for v in ("1.0.0", "1.1.0", "1.3.0", "1.10.3", "2.0.0", "1.3", None)] == \
        [False, False, True, True, False, False, False]
    assert payload_suffix("1.1.0") == ".pt" and payload_suffix("1.3.0") == ".safetensors"


def test_round_trip_both_forms(tmp_path):
    old, new = _both(tmp_path)
    assert sorted(p.name for p in (old / "payloads").iterdir()) == [
        "advantages.pt", "entropy.pt", "kl.pt", "log_probs.pt", "old_log_probs.pt", "ref_log_probs.pt"]
    assert sorted(p.name for p in (new / "payloads").iterdir()) == [
        "advantages.safetensors", "entropy.safetensors", "kl.safetensors", "log_probs.safetensors",
        "loss_mask.safetensors", "old_log_probs.safetensors", "ref_log_probs.safetensors"]
    # a payload file gets the mode any file of the bundle gets (the umask's), not the library's own 0600
    assert {(p.stat().st_mode & 0o777) for p in (new / "payloads").iterdir()} == {(new / "index.json").stat().st_mode & 0o777}
    new_index = json.loads((new / "index.json").read_bytes())
    assert all("loss_mask" not in s for s in new_index["samples"])
    assert all("loss_mask" in s for s in json.loads((old / "index.json").read_bytes())["samples"])
    manifest = json.loads((new / "manifest.json").read_bytes())
    assert manifest["format_version"] == "1.3.0"
    total = sum(s["response_length"] for s in new_index["samples"])
    assert manifest["payloads"]["loss_mask"]["dtype"] == "torch.uint8"
    assert manifest["payloads"]["loss_mask"]["shape"] == [total]

    a, b = BundleReader(old), BundleReader(new)
    assert a.warnings == [] and b.warnings == []
    n = len(a.index.samples)
    assert [b.sample_mask(i) for i in range(n)] == [s.loss_mask for s in a.index.samples]
    assert sum(len(b.sample_mask(i)) for i in range(n)) == total
    # kept packed: no record of the 1.3 bundle lists its mask, the old form's all do
    assert all(s.loss_mask is msgspec.UNSET for s in b.index.samples) and b.packed_mask is not None
    assert a.packed_mask is None and [a.sample_mask(i) for i in range(n)] == [s.loss_mask for s in a.index.samples]
    assert [s.loss_mask for s in b.index_with_masks().samples] == [s.loss_mask for s in a.index.samples]
    # the mask payload stays packed (read per sample): the payload list is the same in both forms
    assert b.payload_names == a.payload_names
    for name in a.payload_names:
        assert torch.equal(a.payload(name), b.payload(name)), name
        assert a.payload(name).dtype == b.payload(name).dtype


def test_the_original_reader_of_safetensors_reads_our_payloads(tmp_path):
    from safetensors.torch import load_file

    _, new = _both(tmp_path)
    reader = BundleReader(new)
    for name in reader.payload_names:
        stored = load_file(str(new / "payloads" / f"{name}.safetensors"))
        assert list(stored) == ["data"]
        assert torch.equal(stored["data"], reader.payload(name))
    mask = load_file(str(new / "payloads" / "loss_mask.safetensors"))["data"]
    assert mask.tolist() == [m for i in range(len(reader.index.samples)) for m in reader.sample_mask(i)]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "replay_lib", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_replay_reports_match_between_forms(tmp_path):
    old, new = _both(tmp_path)
    reports = []
    for bundle in (old, new):
        done = _run("replay", bundle, "--format", "json")
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        reports.append(json.dumps(doc.get("stages"), sort_keys=True))
    assert reports[0] == reports[1]


def test_every_writer_of_a_new_bundle_writes_the_new_minor_by_default(tmp_path):
    """The default everywhere is 1.3.0: the format constant, the demo and synthetic builders, ``demo write-all``
    (every shipped demo), a cohort; 1.1.0 (the masks in index.json, ``.pt`` payloads) only when asked for."""
    from replay_lib.bundle.schema import WRITE_FORMAT_VERSION
    from replay_lib.demo import DEMO_NAMES
    from replay_lib.demo.bundles import write_cohort, write_pr65

    assert FORMAT_VERSION == WRITE_FORMAT_VERSION == PACKED_FORMAT_VERSION == "1.3.0"
    done = _run("demo", "write-all", tmp_path / "all")
    assert done.returncode == 0, done.stderr
    bundles = [tmp_path / "all" / name for name in DEMO_NAMES]
    bundles += [write_synthetic(tmp_path / "synthetic", samples=4, tokens=4), write_pr65(tmp_path / "pr65")]
    cohort = write_cohort(tmp_path / "cohort", samples=4, tokens=3)
    bundles += [cohort / "rank-0", cohort / "rank-1"]
    shards = [b for b in bundles if (b / "manifest.json").is_file()] + [
        shard for b in bundles if not (b / "manifest.json").is_file() for shard in sorted(b.glob("rank-*"))]
    assert len(shards) == len(DEMO_NAMES) + 5  # cohort-2rank's two shards, synthetic, pr65, the cohort's two
    for shard in shards:
        assert json.loads((shard / "manifest.json").read_bytes())["format_version"] == "1.3.0", shard
        assert (shard / "payloads" / "loss_mask.safetensors").is_file(), shard
        assert not list((shard / "payloads").glob("*.pt")), shard
        assert all("loss_mask" not in s for s in json.loads((shard / "index.json").read_bytes())["samples"]), shard
    assert _run("validate", tmp_path / "all" / "cohort-2rank").returncode == 0
    old = write_pr65(tmp_path / "old", format_version=OLD)
    assert json.loads((old / "manifest.json").read_bytes())["format_version"] == "1.1.0"
    assert sorted(p.suffix for p in (old / "payloads").iterdir()) == [".pt"] * 4


def test_demo_write_writes_the_new_minor(tmp_path):
    done = _run("demo", "write", "--samples", "4", "--tokens", "8", tmp_path / "d")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "d" / "manifest.json").read_bytes())["format_version"] == "1.3.0"
    assert (tmp_path / "d" / "payloads" / "loss_mask.safetensors").is_file()
    assert _run("validate", tmp_path / "d").returncode == 0


def test_masks_outside_a_byte_are_stored_as_int64(tmp_path):
    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=4)
    samples = [msgspec.structs.replace(s, loss_mask=[300, 0, 1, 1]) if i == 0 else s
               for i, s in enumerate(index.samples)]
    index = msgspec.structs.replace(index, samples=samples)
    manifest = msgspec.structs.replace(manifest, format_version="1.3.0")
    w = BundleWriter(tmp_path / "b", manifest, index, expected)
    for name, t in payloads.items():
        w.write_payload(name, t)
    w.finalize()
    assert json.loads((tmp_path / "b" / "manifest.json").read_bytes())["payloads"]["loss_mask"]["dtype"] == "torch.int64"
    assert BundleReader(tmp_path / "b").sample_mask(0) == [300, 0, 1, 1]


def test_writer_refuses_a_mask_of_the_wrong_length_and_a_loss_mask_payload(tmp_path):
    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=4)
    manifest = msgspec.structs.replace(manifest, format_version="1.3.0")
    w = BundleWriter(tmp_path / "a", manifest, index, expected)
    with pytest.raises(ValueError, match=r"^payload 'loss_mask': format 1.3.0 writes the samples' loss_mask there"):
        w.write_payload("loss_mask", torch.zeros(16, dtype=torch.uint8))
    w.abort()
    bad = msgspec.structs.replace(index, samples=[msgspec.structs.replace(index.samples[0], loss_mask=[1])]
                                  + index.samples[1:])
    w = BundleWriter(tmp_path / "b", manifest, bad, expected)
    with pytest.raises(ValueError, match=r"^\$\.samples\[0\]\.loss_mask: 1 values, response_length is 4$"):
        w.finalize()
    assert not (tmp_path / "b").exists()
    for version in ("1.1.0", "1.3.0"):
        unset = msgspec.structs.replace(index, samples=[msgspec.structs.replace(index.samples[0], loss_mask=msgspec.UNSET)])
        with pytest.raises(ValueError, match=r"^\$\.samples\[0\]\.loss_mask: missing \(every sample needs one\)$"):
            BundleWriter(tmp_path / version, msgspec.structs.replace(manifest, format_version=version), unset, expected)


def test_original_bundles_still_read(tmp_path):
    from test_wire_compat import write_original_bundle

    bundle = write_original_bundle(tmp_path / "orig")
    reader = BundleReader(bundle)
    assert reader.manifest.format_version == "1.0.0"
    assert all(isinstance(s.loss_mask, list) and len(s.loss_mask) == s.response_length for s in reader.index.samples)


# -- hostile input ---------------------------------------------------------------------------------------------

def _new(tmp_path) -> Path:
    return write_synthetic(tmp_path / "h", samples=4, tokens=4)


def _header(entry: dict, data: bytes, *, pad: bool = True, length=None) -> bytes:
    head = json.dumps(entry).encode()
    if pad:
        head += b" " * (-(8 + len(head)) % 8)
    return struct.pack("<Q", len(head) if length is None else length) + head + data


def _refused(bundle: Path, bundle_tools, name: str, blob: bytes) -> str:
    (bundle / "payloads" / f"{name}.safetensors").write_bytes(blob)
    bundle_tools.reseal(bundle)
    with pytest.raises(BundleError) as info:
        BundleReader(bundle)
    return str(info.value)


F32 = torch.arange(16, dtype=torch.float32).numpy().tobytes()


@pytest.mark.parametrize("blob, message", [
    (b"\x01\x02", "file is 2 bytes, shorter than the 8-byte header length"),
    (struct.pack("<Q", 1 << 40) + b"{}", "length 1099511627776 bytes, more than the 1048576 allowed"),
    (struct.pack("<Q", 500) + b"{}", "length 500 bytes runs past the end of the 10-byte file"),
    (_header({}, b"")[:8] + b"[1, 2]  ", "not a JSON object (expected `object`, got `array`)"),
    (struct.pack("<Q", 8) + b"{}      ", "expected exactly one tensor 'data', got 0 (none)"),
    (struct.pack("<Q", 8) + b"{\"a\": 1}", "expected exactly one tensor 'data', got 1 ('a')"),
    (struct.pack("<Q", 8) + b"not json", "not a JSON object (JSON is malformed: invalid character (byte 4))"),
    (_header({"data": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
              "other": {"dtype": "F32", "shape": [0], "data_offsets": [64, 64]}}, F32),
     "expected exactly one tensor 'data', got 2 ('data', 'other')"),
    (_header({"data": {"dtype": "BOOL", "shape": [64], "data_offsets": [0, 64]}}, F32),
     "$.data.dtype: 'BOOL', expected one of F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8"),
    (_header({"data": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 64]}}, F32),
     "$.data.shape: expected a list of at most 8 non-negative integers, got [-1]"),
    (_header({"data": {"dtype": "F32", "shape": [17], "data_offsets": [0, 64]}}, F32),
     "$.data.shape: [17] of F32 is 68 bytes, data_offsets hold 64"),
    (_header({"data": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 64]}}, F32),
     "$.data.shape: [1099511627776, 1099511627776] of F32 is 4835703278458516698824704 bytes, data_offsets hold 64"),
    (_header({"data": {"dtype": "F32", "shape": [16], "data_offsets": [0, 128]}}, F32),
     "$.data.data_offsets: [0, 128], expected [0, 64] (the data must fill the file after the header exactly: "
     "no gap, no overlap, nothing past its end)"),
    (_header({"data": {"dtype": "F32", "shape": [15], "data_offsets": [4, 64]}}, F32),
     "$.data.data_offsets: [4, 64], expected [0, 64] (the data must fill the file after the header exactly: "
     "no gap, no overlap, nothing past its end)"),
    (_header({"data": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}, F32 + b"tail"),
     "$.data.data_offsets: [0, 64], expected [0, 68] (the data must fill the file after the header exactly: "
     "no gap, no overlap, nothing past its end)"),
    (_header({"data": {"dtype": "F32", "shape": [16], "data_offsets": [0]}}, F32),
     "$.data.data_offsets: expected [begin, end], two non-negative integers, got [0]"),
    (_header({"data": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64], "x": 1}}, F32),
     "$.data.x: unknown field"),
    (_header({"__metadata__": {"a": 1}, "data": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}, F32),
     "$.__metadata__: expected an object of strings"),
])
def test_hostile_safetensors_headers(tmp_path, bundle_tools, blob, message):
    bundle = _new(tmp_path)
    text = _refused(bundle, bundle_tools, "log_probs", blob)
    assert text == f"{bundle / 'payloads' / 'log_probs.safetensors'}: safetensors header: {message}"


def test_a_valid_foreign_header_with_metadata_and_no_padding_reads(tmp_path, bundle_tools):
    bundle = _new(tmp_path)
    values = torch.randn(16, dtype=torch.float64)
    blob = _header({"__metadata__": {"format": "pt"},
                    "data": {"dtype": "F64", "shape": [16], "data_offsets": [0, 128]}},
                   values.numpy().tobytes(), pad=False)
    (bundle / "payloads" / "log_probs.safetensors").write_bytes(blob)
    bundle_tools.edit_json(bundle, "manifest.json",
                           lambda m: m["payloads"]["log_probs"].update(dtype="torch.float64"))
    assert torch.equal(BundleReader(bundle).payload("log_probs"), values)


def test_hostile_safetensors_in_a_real_process_exits_3_with_one_line(tmp_path, bundle_tools):
    bundle = _new(tmp_path)
    (bundle / "payloads" / "kl.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    bundle_tools.reseal(bundle)
    for command in ("validate", "replay"):
        done = _run(command, bundle)
        assert done.returncode == 3, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"trajectory-replay: error: {bundle / 'payloads' / 'kl.safetensors'}: safetensors header: length 1099511627776 bytes, "
            f"more than the 1048576 allowed"]


def test_hostile_packed_masks(tmp_path, bundle_tools):
    bundle = _new(tmp_path)
    mask_file = bundle / "payloads" / "loss_mask.safetensors"
    from replay_lib.bundle import safetensors_io

    safetensors_io.write(mask_file, torch.ones(15, dtype=torch.uint8))  # Σ response_length is 16
    bundle_tools.reseal(bundle)
    bundle_tools.edit_json(bundle, "manifest.json", lambda m: m["payloads"]["loss_mask"].update(shape=[15]))
    with pytest.raises(BundleError) as info:
        BundleReader(bundle)
    assert str(info.value) == f"{mask_file}: 15 tokens, Σ response_length in index.json is 16"

    safetensors_io.write(mask_file, torch.ones(16, dtype=torch.float32))
    bundle_tools.edit_json(bundle, "manifest.json",
                           lambda m: m["payloads"]["loss_mask"].update(shape=[16], dtype="torch.float32"))
    with pytest.raises(BundleError) as info:
        BundleReader(bundle)
    assert str(info.value) == (f"{mask_file}: manifest $.payloads.loss_mask: torch.float32 [16], expected a 1-D "
                               f"integer tensor [Σ response_length]")


def test_masks_in_both_places_or_in_neither(tmp_path, bundle_tools):
    bundle = _new(tmp_path)
    bundle_tools.edit_json(bundle, "index.json", lambda d: d["samples"][2].update(loss_mask=[1, 1, 1, 1]))
    with pytest.raises(BundleError) as info:
        BundleReader(bundle)
    assert str(info.value) == (f"{bundle / 'index.json'}: $.samples[2].loss_mask: the masks are in the payload "
                               f"loss_mask.safetensors; index.json must not hold them too")

    old = write_synthetic(tmp_path / "old", samples=4, tokens=4, format_version=OLD)
    bundle_tools.edit_json(old, "index.json", lambda d: d["samples"][1].pop("loss_mask"))
    with pytest.raises(BundleError) as info:
        BundleReader(old)
    assert str(info.value) == f"{old / 'index.json'}: $.samples[1].loss_mask: missing (required in format 1.1.0)"
    from replay_lib.bundle.inspection import inspect

    assert inspect(old).bundles[0].problems == ["index.json: $.samples[1].loss_mask: missing"]

    def drop(m):
        del m["payloads"]["loss_mask"]

    (bundle / "payloads" / "loss_mask.safetensors").unlink()
    bundle_tools.edit_json(bundle, "index.json", lambda d: d["samples"][2].pop("loss_mask"))
    bundle_tools.edit_json(bundle, "manifest.json", drop)
    with pytest.raises(BundleError) as info:
        BundleReader(bundle)
    assert str(info.value) == (f"{bundle / 'index.json'}: $.samples[0].loss_mask: missing (neither in index.json "
                               f"nor in the payload 'loss_mask')")


def test_a_12_bundle_with_inline_masks_reads(tmp_path, bundle_tools):
    """The reader reads both forms in 1.3: masks in index.json (every sample) and no mask payload."""
    bundle = _new(tmp_path)
    reader = BundleReader(bundle)
    masks = [reader.sample_mask(i) for i in range(len(reader.index.samples))]

    def drop(m):
        del m["payloads"]["loss_mask"]

    (bundle / "payloads" / "loss_mask.safetensors").unlink()
    bundle_tools.edit_json(bundle, "index.json",
                           lambda d: [s.update(loss_mask=m) for s, m in zip(d["samples"], masks)])
    bundle_tools.edit_json(bundle, "manifest.json", drop)
    assert [s.loss_mask for s in BundleReader(bundle).index.samples] == masks


def test_each_payload_is_read_by_what_its_file_is(tmp_path, bundle_tools):
    """A newer minor's bundle relabelled (or a 1.1.0 one with a safetensors file): each payload is found under
    either suffix, the version's first, and read by its own kind; masks in index.json read under any minor."""
    old = write_synthetic(tmp_path / "old", samples=4, tokens=4, format_version=OLD)
    reference = BundleReader(old)
    bundle_tools.edit_json(old, "manifest.json", lambda m: m.update(format_version="1.7.2"))
    relabelled = BundleReader(old)
    assert relabelled.warnings == []
    assert [s.loss_mask for s in relabelled.index.samples] == [s.loss_mask for s in reference.index.samples]

    from replay_lib.bundle import safetensors_io

    bundle_tools.edit_json(old, "manifest.json", lambda m: m.update(format_version="1.1.0"))
    (old / "payloads" / "kl.pt").unlink()
    safetensors_io.write(old / "payloads" / "kl.safetensors", reference.payload("kl"))
    bundle_tools.reseal(old)
    mixed = BundleReader(old)
    assert torch.equal(mixed.payload("kl"), reference.payload("kl")) and mixed.warnings == []


def test_sample_replay_reads_only_its_rows_once_verified(tmp_path):
    """After verification, ``--sample`` touches only the selected sample's rows of a safetensors payload: rows of
    another sample overwritten on disk after the bundle was verified change nothing, the same bytes in the
    selected sample's rows make it diverge (the map shows the file as it is now: the check can fail)."""
    from replay_lib.bundle import open_bundle
    from replay_lib.bundle.selection import Selection
    from replay_lib.run.runner import run_replay

    bundle = write_synthetic(tmp_path / "b", format_version=PACKED_FORMAT_VERSION, samples=8, tokens=1024,
                             kl_coef=0.0, settle=True)
    bundles = open_bundle(bundle)  # verified: every checksum checked
    lengths = [s.response_length for s in bundles.shards[0].index.samples]
    file = bundle / "payloads" / "kl.safetensors"  # compared by advantage.kl, per token
    data_start = 8 + struct.unpack("<Q", file.read_bytes()[:8])[0]

    def corrupt(sample: int) -> None:
        offset = sum(lengths[:sample])
        with open(file, "r+b") as fh:
            fh.seek(data_start + 4 * offset)
            fh.write(torch.full((lengths[sample],), 5.0, dtype=torch.float32).numpy().tobytes())

    corrupt(5)
    report = run_replay(bundles, selection=Selection(samples=("s-3",)))
    # the group of s-3 (group size 4) is replayed with it; s-5 is in the other group
    assert report.selected_samples == ["s-0", "s-1", "s-2", "s-3"] and report.passed, report.first_divergence
    corrupt(3)
    report = run_replay(bundles, selection=Selection(samples=("s-3",)))
    assert not report.passed


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.int32, torch.int8])
def test_every_stored_dtype_round_trips_as_safetensors(tmp_path, dtype):
    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=4)
    manifest = msgspec.structs.replace(manifest, format_version="1.3.0")
    extra = (torch.arange(16 * 3) - 20).reshape(16, 3).to(dtype)
    w = BundleWriter(tmp_path / "b", manifest, index, expected)
    for name, t in payloads.items():
        w.write_payload(name, t)
    w.write_payload("extra", extra)
    w.finalize()
    reader = BundleReader(tmp_path / "b")
    assert json.loads((tmp_path / "b" / "manifest.json").read_bytes())["payloads"]["extra"]["dtype"] == str(dtype)
    assert torch.equal(reader.payload("extra").to(torch.float64), extra.to(torch.float64))


def test_a_12_cohort_replays_like_a_11_one(tmp_path):
    from replay_lib.demo.bundles import write_bundle
    from replay_lib.run.runner import replay

    reports = []
    for version in ("1.1.0", "1.3.0"):
        cohort = tmp_path / version
        for r in range(2):
            manifest, *rest = synthetic_parts(bundle_id="c", seed=100 + r, sample_prefix=f"r{r}-s-", batch_offset=r,
                                              rank_sizes={"dp": 2, "tp": 1, "pp": 1, "cp": 1}, vary_lengths=True,
                                              kl_coef=0.0)
            write_bundle(cohort, msgspec.structs.replace(manifest, format_version=version), *rest, rank=r,
                         ranks=range(2))
        assert (cohort / "rank-1" / "payloads" / ("loss_mask.safetensors" if version == "1.3.0" else "kl.pt")).is_file()
        report = replay(cohort)
        assert report.passed and report.ranks == [0, 1]
        reports.append(msgspec.json.encode(report.stages))
    assert reports[0] == reports[1]


def test_inspect_skips_the_masks_of_an_old_index(tmp_path):
    """``inspect`` summarizes a 1.1.0 bundle without decoding its masks (they stay undecoded JSON text) and says
    exactly what the full decode would."""
    from replay_lib.bundle.inspection import inspect
    from replay_lib.bundle.packed import decode_index_lean
    from replay_lib.bundle.schema import decode_index

    old = write_synthetic(tmp_path / "old", format_version=OLD, **KW)
    blob = (old / "index.json").read_bytes()
    lean, (full, _) = decode_index_lean(blob), decode_index(blob)
    assert all(type(s.loss_mask) is msgspec.Raw for s in lean.samples)
    assert [json.loads(bytes(s.loss_mask)) for s in lean.samples] == [s.loss_mask for s in full.samples]
    assert (lean.identity, lean.config, [s.response_length for s in lean.samples]) == \
        (full.identity, full.config, [s.response_length for s in full.samples])
    info = inspect(old).bundles[0]
    assert (info.samples, info.groups, info.tokens, info.problems) == (8, 2, sum(s.response_length for s in
                                                                                full.samples), [])
    # a document the lean decode does not take as it is goes the usual way, which words the problem
    doc = json.loads(blob)
    doc["samples"][2]["response_length"] = "x"
    (old / "index.json").write_text(json.dumps(doc))
    with pytest.raises(msgspec.ValidationError):
        decode_index_lean((old / "index.json").read_bytes())
    assert inspect(old).bundles[0].problems == ["index.json: $.samples[2].response_length: expected `int`, got `str`"]
    doc["samples"][2]["response_length"] = 4
    doc["samples"][1]["loss_mask"] = "oops"  # no array at all: still worded (its items are not read)
    (old / "index.json").write_text(json.dumps(doc))
    assert inspect(old).bundles[0].problems == ["index.json: $.samples[1].loss_mask: expected `array`, got `str`"]


def test_a_13_bundle_converts_to_2_0_and_back(tmp_path):
    """``convert --to 2.0.0`` of a 1.3 bundle: its safetensors payloads carried as ``.pt``, its packed masks written
    into the 2.0 index (not as a payload); back to 1.0.0, every mask and payload is the source's."""
    from replay_lib.run.convert import convert

    src = write_synthetic(tmp_path / "src", samples=4, tokens=6, format_version="1.3.0")
    result = convert(src, tmp_path / "two", "2.0.0")
    assert result.format_version == "2.0.0"
    assert sorted(p.name for p in (tmp_path / "two" / "payloads").iterdir()) == [
        "advantages.pt", "entropy.pt", "kl.pt", "log_probs.pt", "old_log_probs.pt", "ref_log_probs.pt"]
    back = convert(tmp_path / "two", tmp_path / "one", "1.0.0")
    assert back.format_version == "1.0.0"
    a, b = BundleReader(src), BundleReader(tmp_path / "one")
    assert [s.loss_mask for s in b.index.samples] == [a.sample_mask(i) for i in range(4)]
    assert b.payload_names == [n for n in a.payload_names]
    for name in a.payload_names:
        assert torch.equal(a.payload(name), b.payload(name)), name
