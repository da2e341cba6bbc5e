"""Cost of ``trajectory-replay replay`` (every stage) against the I/O floor, its scaling, and its memory.

Builds two synthetic bundles — ``write_synthetic(samples=256, tokens=8192, kl_coef=0.0)`` (five float32
payloads of ≈2.1M tokens: log_probs, old_log_probs, entropy, advantages, kl) and the same with 4× the
samples — then measures in one run, interleaved, each as a fresh process:

* torch     — ``python -c "import torch"`` (the memory baseline);
* floor     — ``import torch`` + read and sha256 every payload file of the 1× bundle;
* replay 1× — ``trajectory-replay replay`` of the 1× bundle, all stages (sample → loss.policy);
* replay 4× — the same on the 4× bundle.

Prints medians of the wall time (CPU time for reference), the peak RSS of each (``os.wait4`` rusage of
that child) and PASS/FAIL for:

* replay(1×) / floor ≤ 2.0 (wall);
* replay(4×) / replay(1×) ≤ 4.5 (wall, for a token ratio of 4);
* peak RSS of replay(1×) above the ``import torch`` baseline ≤ 3× the 1× payload bytes.

    python bench/bench_replay.py [--samples 256] [--tokens 8192] [--reps 5] [--keep DIR]

Exit status 0 when every target passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOOR_LIMIT = 2.0
SCALE_LIMIT = 4.5
MEMORY_LIMIT = 3.0

# Built in a child process: the bench process must stay small, or every child it forks starts with its RSS.
BUILD_CODE = (
    "import sys\n"
    "from replay_lib.demo import write_synthetic\n"
    "write_synthetic(sys.argv[1], samples=int(sys.argv[2]), tokens=int(sys.argv[3]), kl_coef=0.0,\n"
    "                bundle_id=sys.argv[4])\n"
)
TORCH_CODE = "import torch\n"
FLOOR_CODE = (
    "import hashlib, sys, torch\n"
    "for p in sys.argv[1:]:\n"
    "    with open(p, 'rb') as fh:\n"
    "        hashlib.file_digest(fh, 'sha256')\n"
)


def replay_cmd() -> list[str]:
    exe = shutil.which("trajectory-replay")
    return [exe, "replay"] if exe else [sys.executable, "-m", "replay_lib", "replay"]


def run_child(cmd: list[str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + sys) and peak RSS (bytes) of one fresh process; a non-zero exit
    (a replay that finds a divergence in a clean bundle, say) stops the benchmark."""
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            out.seek(0)
            raise SystemExit(f"{' '.join(cmd)} exited {code}:\n{out.read().decode(errors='replace')}")
    rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return elapsed, usage.ru_utime + usage.ru_stime, rss


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--keep", type=Path, help="write the bundles here and keep them (default: a temp dir)")
    args = ap.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-replay-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        small, big = root / "x1", root / "x4"
        for path, samples in ((small, args.samples), (big, 4 * args.samples)):
            if not path.exists():
                subprocess.run([sys.executable, "-c", BUILD_CODE, str(path), str(samples), str(args.tokens),
                                path.name], check=True)
        build_s = time.perf_counter() - t0
        payloads = sorted(str(p) for p in (small / "payloads").iterdir())
        payload_bytes = sum(Path(p).stat().st_size for p in payloads)
        tokens = args.samples * args.tokens
        size = {b: sum(f.stat().st_size for f in b.rglob("*") if f.is_file()) for b in (small, big)}
        print(f"bundles: 1× {args.samples} samples × {args.tokens} tokens = {tokens:,} tokens, {len(payloads)} "
              f"payloads of {payload_bytes / 2**20:.1f} MiB, bundle {size[small] / 2**20:.1f} MiB; "
              f"4× bundle {size[big] / 2**20:.1f} MiB (built in {build_s:.1f} s)")

        cmds = {
            "torch": [sys.executable, "-c", TORCH_CODE],
            "floor": [sys.executable, "-c", FLOOR_CODE, *payloads],
            "replay 1×": replay_cmd() + [str(small)],
            "replay 4×": replay_cmd() + [str(big)],
        }
        for cmd in cmds.values():  # warm the page cache and the interpreter's .pyc files
            run_child(cmd)
        wall: dict[str, list[float]] = {k: [] for k in cmds}
        cpu: dict[str, list[float]] = {k: [] for k in cmds}
        rss: dict[str, list[int]] = {k: [] for k in cmds}
        for _ in range(args.reps):
            for name, cmd in cmds.items():
                t, c, m = run_child(cmd)
                wall[name].append(t)
                cpu[name].append(c)
                rss[name].append(m)
        med = {k: statistics.median(v) for k, v in wall.items()}
        med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        peak = {k: max(v) for k, v in rss.items()}
        for name in cmds:
            runs = ", ".join(f"{t:.2f}" for t in wall[name])
            print(f"  {name:<10} wall median {med[name]:6.3f} s (runs: {runs})  cpu median {med_cpu[name]:6.3f} s  "
                  f"peak RSS {peak[name] / 2**20:7.1f} MiB")

        floor_ratio = med["replay 1×"] / med["floor"]
        scale_ratio = med["replay 4×"] / med["replay 1×"]
        above = peak["replay 1×"] - peak["torch"]
        memory_ratio = above / payload_bytes
        above_4x = peak["replay 4×"] - peak["torch"]
        checks = [
            (f"replay(1×) / floor = {floor_ratio:.2f} wall ({med_cpu['replay 1×'] / med_cpu['floor']:.2f} cpu) "
             f"(target ≤ {FLOOR_LIMIT})", floor_ratio <= FLOOR_LIMIT),
            (f"replay(4×) / replay(1×) = {scale_ratio:.2f} wall ({med_cpu['replay 4×'] / med_cpu['replay 1×']:.2f} cpu) "
             f"for a token ratio of 4 (target ≤ {SCALE_LIMIT})", scale_ratio <= SCALE_LIMIT),
            (f"peak RSS of replay(1×) above import torch = {above / 2**20:.1f} MiB = {memory_ratio:.2f}× the "
             f"{payload_bytes / 2**20:.1f} MiB of payloads (target ≤ {MEMORY_LIMIT}×; 4×: "
             f"{above_4x / 2**20:.1f} MiB = {above_4x / (4 * payload_bytes):.2f}× its payloads)",
             memory_ratio <= MEMORY_LIMIT),
        ]
        for text, ok in checks:
            print(f"{verdict(ok)}  {text}")
        return 0 if all(ok for _, ok in checks) else 1
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
