"""A replay's memory grows with the step by less than its payloads do (issue 40: peak RSS ≤ 1.5× the payload bytes).

Format 1.3 keeps the loss masks packed (never a Python list per token), and the stages stream through the
memory-mapped safetensors payloads a chunk at a time, letting each chunk's pages go behind them
(``BundleReader.release_pages``). Measured in fresh processes, as the growth of the peak between two
bundle sizes per added payload byte (``VmHWM``): the interpreter, torch and the modules a replay imports cancel out. Before these
changes it was ≈ 2.2 (the masks as lists, a float32 zero tensor per token, whole-axis ``isfinite`` copies and every
payload page resident); now ≈ 0.6.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay_lib.bundle import BundleReader
from replay_lib.bundle import safetensors_io
from replay_lib.demo.bundles import write_synthetic

ROOT = Path(__file__).resolve().parents[1]

# The child's own high-water mark: VmHWM (its memory since exec), not ru_maxrss, which starts at the RSS of the
# process that forked it (pytest's, after building the bundles).
CHILD = (
    "import json, sys\n"
    "import torch\n"
    "from replay_lib.run.runner import replay\n"
    "def hwm():\n"
    "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
    "base = hwm()\n"
    "report = replay(sys.argv[1])\n"
    "print(json.dumps({'passed': report.passed, 'base': base, 'peak': hwm()}))\n"
)

# Peak growth per payload byte between the two sizes: ≈ 0.6 measured, ≈ 2.2 before (module docstring).
GROWTH_LIMIT = 1.2


def _peak_kib(bundle: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(bundle)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["passed"] is True
    return result["peak"]


def _payload_bytes(bundle: Path) -> int:
    return sum(f.stat().st_size for f in (bundle / "payloads").iterdir())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status and MADV_DONTNEED")
def test_replay_peak_grows_by_less_than_the_payloads(tmp_path):
    small = write_synthetic(tmp_path / "small", samples=128, tokens=8192, kl_coef=0.0, format_version="1.3.0")
    large = write_synthetic(tmp_path / "large", samples=512, tokens=8192, kl_coef=0.0, format_version="1.3.0")
    added = _payload_bytes(large) - _payload_bytes(small)
    assert added == 3 * 128 * 8192 * (5 * 4 + 1)  # five float32 payloads and the uint8 mask, per token
    growth = (_peak_kib(large) - _peak_kib(small)) * 1024 / added
    assert growth <= GROWTH_LIMIT, f"peak RSS grew by {growth:.2f}× the added payload bytes"


def _rss_file_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.skipif(not (sys.platform.startswith("linux") and hasattr(mmap, "MADV_DONTNEED")),
                    reason="/proc/self/status and MADV_DONTNEED")
def test_released_rows_leave_memory_and_read_back_unchanged(tmp_path):
    path = tmp_path / "x.safetensors"
    values = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    safetensors_io.write(path, values)
    fd = os.open(path, os.O_RDONLY)
    try:
        tensor = safetensors_io.load(path, fd)
    finally:
        os.close(fd)
    before = _rss_file_kib()
    assert float(tensor.sum()) == float(values.sum())  # every page touched
    touched = _rss_file_kib()
    assert touched - before >= 3 * 1024
    safetensors_io.release(tensor, 0, 1 << 19)  # the first half's whole pages
    half = _rss_file_kib()
    assert 1.5 * 1024 <= touched - half <= 2 * 1024 + 8
    safetensors_io.release(tensor)
    assert touched - _rss_file_kib() >= 3.9 * 1024
    assert torch.equal(tensor, values)  # read again from the file, unchanged
    safetensors_io.release(values)  # not a mapped payload: nothing happens
    assert torch.equal(values, torch.arange(1 << 20, dtype=torch.float32))


def test_a_13_reader_keeps_the_masks_packed(tmp_path):
    bundle = write_synthetic(tmp_path / "b", samples=4, tokens=6, format_version="1.3.0")
    reader = BundleReader(bundle)
    old = BundleReader(write_synthetic(tmp_path / "old", samples=4, tokens=6, format_version="1.1.0"))
    assert reader.packed_mask is not None and reader.packed_mask.dtype == torch.uint8
    assert reader.packed_mask.shape == (24,)
    assert all(s.loss_mask is msgspec_unset() for s in reader.index.samples)
    assert [reader.sample_mask(i) for i in range(4)] == [s.loss_mask for s in old.index.samples]
    assert [reader.mask_length(i) for i in range(4)] == [6, 6, 6, 6]
    assert reader.packed_mask.tolist() == [m for s in old.index.samples for m in s.loss_mask]


def msgspec_unset():
    import msgspec

    return msgspec.UNSET
