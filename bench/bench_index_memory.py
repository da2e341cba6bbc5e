"""Peak memory of opening a bundle whose ``index.json`` holds many samples, against the file's size.

Builds a synthetic bundle (``trajectory-replay demo write --samples N --tokens 1``: one token per sample, so
index.json is nearly all of it), rewrites its index.json compactly without the null fields (≈ 150 bytes a
sample, the density of a capture's 3M-sample, 444 MB index) and reseals the checksums; then opens it with
``BundleReader`` in a fresh process and reports

* ``ru_maxrss`` before opening (imports done) and after, and the index's size;
* the ratio (peak − before) / size — the memory decoding and checking the index took — which must be ≤ 3.

    python bench/bench_index_memory.py [--samples 500000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LIMIT = 3.0

OPEN_CODE = (
    "import resource, sys\n"
    "from replay_lib.bundle.reader import BundleReader\n"
    "import replay_lib.bundle.locate, replay_lib.bundle.resolution\n"
    "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
    "reader = BundleReader(sys.argv[1])\n"
    "assert len(reader.index.samples) == int(sys.argv[2])\n"
    "print(before * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _dump(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def compact_index(bundle: Path) -> int:
    """index.json without its null fields, with no indentation; the sentinels resealed. Its new size."""
    index = json.loads((bundle / "index.json").read_bytes())
    index["samples"] = [{k: v for k, v in s.items() if v is not None} for s in index["samples"]]
    blob = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
    (bundle / "index.json").write_bytes(blob)
    metadata = {name: _sha256((bundle / name).read_bytes()) for name in ("manifest.json", "index.json", "expected.json")}
    for sentinel in bundle.glob("COMPLETE*"):
        doc = json.loads(sentinel.read_bytes())
        doc["metadata"] = metadata
        sentinel.write_bytes(_dump(doc))
    return len(blob)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=500_000)
    parser.add_argument("--keep", type=Path, default=None)
    args = parser.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-index-"))
    try:
        bundle = root / "index-bundle"
        if not bundle.exists():
            subprocess.run([sys.executable, "-m", "replay_lib", "demo", "write", "--samples", str(args.samples),
                            "--tokens", "1", str(bundle)], check=True, stdout=subprocess.DEVNULL)
            # in a child too: a peak of this process would be inherited by every child it starts (ru_maxrss)
            subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "from bench_index_memory import compact_index; compact_index(__import__('pathlib').Path(sys.argv[2]))",
                            str(Path(__file__).resolve().parent), str(bundle)], check=True)
        size = (bundle / "index.json").stat().st_size
        out = subprocess.run([sys.executable, "-c", OPEN_CODE, str(bundle), str(args.samples)], check=True,
                             capture_output=True, text=True).stdout.split()
        before, peak = int(out[0]), int(out[1])
        ratio = (peak - before) / size
        print(f"index.json {size / 2**20:.1f} MiB ({args.samples:,} samples, {size / args.samples:.0f} B each); "
              f"peak RSS {before / 2**20:.0f} MiB before opening, {peak / 2**20:.0f} MiB after: "
              f"{(peak - before) / 2**20:.0f} MiB = {ratio:.2f}× the index (limit {LIMIT}×)")
        print("PASS" if ratio <= LIMIT else "FAIL")
        return 0 if ratio <= LIMIT else 1
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
