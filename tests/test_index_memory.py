"""The memory of reading a large index.json: its samples are decoded a chunk at a time with their repeated values
shared (ids of a micro-batch or group, lengths, scores, short loss masks), and the reader lets go of each JSON file's
bytes once decoded and hashed. Bounds are measured in a fresh process with tracemalloc (allocations, not timings),
with a margin; bench/bench_index_memory.py measures the RSS at 300k samples."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from replay_lib.bundle import BundleReader
from replay_lib.bundle.schema import INDEX_DECODER, decode_index, decode_index_strict
from replay_lib.demo import synthetic_parts, write_bundle
from replay_lib.errors import BundleError

REPO = Path(__file__).resolve().parents[1]


def _index_doc(n: int) -> dict:
    """An index in the bench's shape: one token per sample, 4 samples a group, 8 a micro-batch, 5 raw scores."""
    samples = [{"group_index": i // 4, "loss_mask": [1], "micro_batch_id": f"mb-{i // 8:05d}", "raw_reward": float(i % 5),
                "reward": (i % 5 - 2) / 1.5, "response_length": 1, "sample_id": f"s-{i}", "total_length": 33}
               for i in range(n)]
    return {"bundle_id": "b", "config": {}, "identity": {"actor_step_id": {"rollout_id": 7, "step_id": 0}},
            "samples": samples}


def _blob(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_decoded_index_is_the_one_piece_decode_with_repeated_values_shared():
    doc = _index_doc(2500)  # three chunks
    doc["samples"][5]["raw_reward"], doc["samples"][6]["raw_reward"] = 0.0, -0.0
    doc["samples"][7]["reward"] = 1  # an int in a float field: a float, never merged with the int 1
    doc["samples"][9]["consumer_batch_id"] = doc["samples"][10]["consumer_batch_id"] = "cb-1"
    doc["samples"][11]["loss_mask"] = [0, 1]
    blob = _blob(doc)
    index, unknown = decode_index_strict(blob)
    assert unknown is False and index == INDEX_DECODER.decode(blob) and decode_index(blob) == (index, False)
    s = index.samples
    assert len(s) == 2500 and [r.sample_id for r in s[:3]] == ["s-0", "s-1", "s-2"]
    # shared across chunks too: one object per distinct value
    assert s[0].micro_batch_id is s[7].micro_batch_id and s[2048].micro_batch_id is s[2049].micro_batch_id
    assert len({id(r.micro_batch_id) for r in s}) == len({r.micro_batch_id for r in s}) == 313
    assert len({id(r.loss_mask) for r in s}) == 2 and s[11].loss_mask == [0, 1] and s[12].loss_mask == [1]
    assert s[12].group_index is s[13].group_index == 3 and s[9].consumer_batch_id is s[10].consumer_batch_id
    assert s[1001].raw_reward is s[2001].raw_reward == 1.0
    # 0.0 and -0.0 are equal keys, not equal values: each keeps its sign
    assert (math.copysign(1, s[5].raw_reward), math.copysign(1, s[6].raw_reward)) == (1.0, -1.0)
    assert type(s[7].reward) is float and s[7].reward == 1.0 and type(s[4].group_index) is int


def test_a_bad_sample_after_the_first_chunk_is_named_by_its_index_in_the_document():
    doc = _index_doc(2500)
    doc["samples"][2100]["loss_mask"] = [1, "0"]
    with pytest.raises(msgspec.ValidationError, match=r"^Expected `int`, got `str` - at `\$\.samples\[2100\]\.loss_mask\[1\]`$"):
        decode_index(_blob(doc))
    doc = _index_doc(2500)
    doc["samples"][1500]["tokens_per_second"] = 9.5  # an unknown field: read leniently, reported as such
    index, unknown = decode_index(_blob(doc))
    assert unknown is True and index == decode_index(_blob(_index_doc(2500)))[0]


def test_reader_names_a_bad_sample_after_the_first_chunk(tmp_path, bundle_tools):
    manifest, index, expected, payloads = synthetic_parts(samples=1100, tokens=1)
    bundle = write_bundle(tmp_path / "b", manifest, index, expected, payloads)
    bundle_tools.edit_json(bundle, "index.json", lambda d: d["samples"][1050].update(response_length="2"))
    with pytest.raises(BundleError) as err:
        BundleReader(bundle)
    assert str(err.value) == (f"{bundle / 'index.json'}: $.samples[1050].response_length: "
                              "expected `int`, got `str`")


def test_decoding_a_large_index_takes_under_twice_its_size():
    """100k samples (≈ 17 MB): the records of the one-piece decode took 2.5× the text (≈ 440 B a sample: a string
    per micro-batch id, a list per loss mask, a float per score); shared, 1.5×."""
    script = """
        import sys, tracemalloc
        sys.path.insert(0, sys.argv[1])
        from test_index_memory import _blob, _index_doc
        from replay_lib.bundle.schema import decode_index
        blob = _blob(_index_doc(100_000))
        tracemalloc.start()
        index, _ = decode_index(blob)
        print(len(index.samples), tracemalloc.get_traced_memory()[1] / len(blob))
    """
    n, ratio = _run(script, str(Path(__file__).parent)).split()
    assert int(n) == 100_000 and float(ratio) < 2.0


def test_opening_a_bundle_with_a_large_index_takes_under_four_times_its_size(tmp_path):
    """The bench's bundle at 20k samples (a 3.4 MB compact index.json): everything the reader allocates while it
    opens it. Before, 5.0× (the text of index.json and expected.json alive beside all the records); now 2.8×."""
    bundle = tmp_path / "index-bundle"
    subprocess.run([sys.executable, "-m", "replay_lib", "demo", "write", "--samples", "20000", "--tokens", "1",
                    str(bundle)], check=True, stdout=subprocess.DEVNULL, cwd=REPO, timeout=300)
    script = """
        import os, sys, tracemalloc
        from pathlib import Path
        sys.path.insert(0, sys.argv[1])
        from bench_index_memory import compact_index
        from replay_lib.bundle.reader import BundleReader
        import replay_lib.bundle.locate, replay_lib.bundle.resolution
        size = compact_index(Path(sys.argv[2]))
        import torch, replay_lib.bundle.safetensors_io, replay_lib.bundle.dtypes  # the reader imports them at its
        # first tensor (torch-free start-up): their import is not the index's memory
        tracemalloc.start()
        reader = BundleReader(sys.argv[2])
        print(len(reader.index.samples), tracemalloc.get_traced_memory()[1] / size)
    """
    n, ratio = _run(script, str(REPO / "bench"), str(bundle)).split()
    assert int(n) == 20_000 and float(ratio) < 4.0
