"""Cost of ``trajectory-replay validate`` against the I/O floor, and how it scales with bundle size.

Builds two synthetic bundles (``write_synthetic(samples=256, tokens=8192, kl_coef=0.0)``: five float32
payloads of ≈2.1M tokens, and the same with 4× the samples), then measures in one run, interleaved,
each as a fresh process:

* floor     — ``python -c "import torch"`` + read and sha256 every payload file of the 1× bundle;
* validate  — ``trajectory-replay validate`` on the 1× and on the 4× bundle.

Prints the wall and CPU (user + sys) medians, the peak RSS of each (``os.wait4`` rusage of that child) and
PASS/FAIL for (verdicts on wall time; the CPU ratios are printed beside them as a check that holds up on a
busy, shared host):

* validate(1×) / floor ≤ 1.5;
* validate(4×) / validate(1×) ≤ 4.5 (token ratio 4), and the same bound for the peak RSS ratio.

    python bench/bench_validate.py [--samples 256] [--tokens 8192] [--reps 5] [--keep DIR]
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

FLOOR_LIMIT = 1.5
SCALE_LIMIT = 4.5
# Built in a child process: this one must stay small, or every child it forks starts with its RSS.
BUILD_CODE = (
    "import sys\n"
    "from replay_lib.demo import write_synthetic\n"
    "write_synthetic(sys.argv[1], samples=int(sys.argv[2]), tokens=int(sys.argv[3]), kl_coef=0.0,\n"
    "                bundle_id=sys.argv[4])\n"
)
FLOOR_CODE = (
    "import hashlib, sys, torch\n"
    "for p in sys.argv[1:]:\n"
    "    with open(p, 'rb') as fh:\n"
    "        hashlib.file_digest(fh, 'sha256')\n"
)


def validate_cmd() -> list[str]:
    exe = shutil.which("trajectory-replay")
    return [exe, "validate"] if exe else [sys.executable, "-m", "replay_lib", "validate"]


def run_child(cmd: list[str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + sys) and peak RSS (bytes) of one fresh process; fails loudly on a
    non-zero exit. Peak RSS and CPU come from ``os.wait4``: this child's own rusage, no other's."""
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            out.seek(0)
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{out.read().decode(errors='replace')}")
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
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-validate-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        small = root / "x1"
        big = root / "x4"
        for path, samples in ((small, args.samples), (big, 4 * args.samples)):
            if not path.exists():
                subprocess.run([sys.executable, "-c", BUILD_CODE, str(path), str(samples), str(args.tokens),
                                path.name], check=True)
        build_s = time.perf_counter() - t0
        payloads = sorted(str(p) for p in (small / "payloads").iterdir())
        tokens = args.samples * args.tokens
        size = {b: sum(f.stat().st_size for f in b.rglob("*") if f.is_file()) for b in (small, big)}
        print(f"bundles: 1× {args.samples} samples × {args.tokens} tokens = {tokens:,} tokens, "
              f"{len(payloads)} payloads, {size[small] / 2**20:.1f} MiB; 4× {size[big] / 2**20:.1f} MiB "
              f"(built in {build_s:.1f} s)")

        cmds = {
            "floor": [sys.executable, "-c", FLOOR_CODE, *payloads],
            "validate 1×": validate_cmd() + [str(small)],
            "validate 4×": validate_cmd() + [str(big)],
        }
        for cmd in cmds.values():  # warm the page cache and the interpreter's .pyc files
            run_child(cmd)
        times: dict[str, list[float]] = {k: [] for k in cmds}
        cpu: dict[str, list[float]] = {k: [] for k in cmds}
        rss: dict[str, list[int]] = {k: [] for k in cmds}
        for _ in range(args.reps):
            for name, cmd in cmds.items():
                t, c, m = run_child(cmd)
                times[name].append(t)
                cpu[name].append(c)
                rss[name].append(m)
        med = {k: statistics.median(v) for k, v in times.items()}
        med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        peak = {k: max(v) for k, v in rss.items()}
        for name in cmds:
            spread = ", ".join(f"{t:.2f}" for t in times[name])
            print(f"  {name:<12} wall median {med[name]:6.3f} s (runs: {spread})  cpu median {med_cpu[name]:6.3f} s  "
                  f"peak RSS {peak[name] / 2**20:7.1f} MiB")

        floor_ratio = med["validate 1×"] / med["floor"]
        scale_ratio = med["validate 4×"] / med["validate 1×"]
        cpu_floor = med_cpu["validate 1×"] / med_cpu["floor"]
        cpu_scale = med_cpu["validate 4×"] / med_cpu["validate 1×"]
        rss_ratio = peak["validate 4×"] / peak["validate 1×"]
        checks = [
            (f"validate(1×) / floor = {floor_ratio:.2f} wall, {cpu_floor:.2f} cpu (target ≤ {FLOOR_LIMIT})",
             floor_ratio <= FLOOR_LIMIT),
            (f"validate(4×) / validate(1×) = {scale_ratio:.2f} wall, {cpu_scale:.2f} cpu for a token ratio of 4 "
             f"(target ≤ {SCALE_LIMIT})", scale_ratio <= SCALE_LIMIT),
            (f"peak RSS validate(4×) / validate(1×) = {rss_ratio:.2f} (target ≤ {SCALE_LIMIT}); "
             f"validate(1×) / floor = {peak['validate 1×'] / peak['floor']:.2f}", rss_ratio <= SCALE_LIMIT),
        ]
        for text, ok in checks:
            print(f"{verdict(ok)}  {text}")
        return 0 if all(ok for _, ok in checks) else 1
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
