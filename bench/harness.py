"""What the process-level benchmarks share: building the synthetic bundles in a child process, the I/O
floor, timing fresh processes (wall, CPU, peak RSS from ``os.wait4``) and interleaved medians."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

# Built in a child process: the bench process must stay small, or every child it forks starts with its RSS.
BUILD_CODE = (
    "import sys\n"
    "from replay_lib.demo import write_synthetic\n"
    "write_synthetic(sys.argv[1], samples=int(sys.argv[2]), tokens=int(sys.argv[3]), kl_coef=0.0,\n"
    "                bundle_id=sys.argv[4])\n"
)
TORCH_CODE = "import torch\n"
# The floor: a Python process that imports torch and reads + sha256-hashes every payload file.
FLOOR_CODE = (
    "import hashlib, sys, torch\n"
    "for p in sys.argv[1:]:\n"
    "    with open(p, 'rb') as fh:\n"
    "        hashlib.file_digest(fh, 'sha256')\n"
)
# The floor ending as the read-only commands end (replay_lib.cli.end_process: os._exit, no interpreter teardown).
QUICK_FLOOR_CODE = FLOOR_CODE + "import os\nos._exit(0)\n"
# A process that imports torch and ends so: the least any replay process costs.
QUICK_TORCH_CODE = TORCH_CODE + "import os\nos._exit(0)\n"


def bundle_args(description: str, argv=None) -> argparse.Namespace:
    """The options of the two bundle benchmarks: the 1× size, repetitions and where to keep the bundles."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--keep", type=Path, help="write the bundles here and keep them (default: a temp dir)")
    return ap.parse_args(argv)


@contextmanager
def workdir(keep, prefix: str):
    """``keep`` (created, kept) or a temporary directory removed afterwards."""
    root = keep or Path(tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    try:
        yield root
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def cli_cmd(command: str) -> list[str]:
    exe = shutil.which("trajectory-replay")
    return [exe, command] if exe else [sys.executable, "-m", "replay_lib", command]


def build_bundles(root: Path, samples: int, tokens: int) -> tuple[Path, Path, float]:
    """The 1× bundle (``samples`` × ``tokens``, five float32 payloads) and the 4× one; build seconds."""
    t0 = time.perf_counter()
    small, big = root / "x1", root / "x4"
    for path, n in ((small, samples), (big, 4 * samples)):
        if not path.exists():
            subprocess.run([sys.executable, "-c", BUILD_CODE, str(path), str(n), str(tokens), path.name], check=True)
    return small, big, time.perf_counter() - t0


def run_child(cmd: list[str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + sys) and peak RSS (bytes) of one fresh process; a non-zero exit
    stops the benchmark. CPU and RSS come from ``os.wait4``: this child's own rusage, no other's."""
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


def measure(cmds: dict[str, list[str]], reps: int) -> tuple[dict, dict, dict]:
    """Interleaved runs after one warm-up each: ``(median wall, median cpu, peak rss)`` per name; prints them."""
    for cmd in cmds.values():  # warm the page cache and the interpreter's .pyc files
        run_child(cmd)
    wall: dict[str, list[float]] = {k: [] for k in cmds}
    cpu: dict[str, list[float]] = {k: [] for k in cmds}
    rss: dict[str, list[int]] = {k: [] for k in cmds}
    for _ in range(reps):
        for name, cmd in cmds.items():
            t, c, m = run_child(cmd)
            wall[name].append(t)
            cpu[name].append(c)
            rss[name].append(m)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    peak = {k: max(v) for k, v in rss.items()}
    width = max(len(k) for k in cmds)
    for name in cmds:
        runs = ", ".join(f"{t:.2f}" for t in wall[name])
        print(f"  {name:<{width}} wall median {med[name]:6.3f} s (runs: {runs})  cpu median {med_cpu[name]:6.3f} s  "
              f"peak RSS {peak[name] / 2**20:7.1f} MiB")
    return med, med_cpu, peak


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(checks: list[tuple[str, bool]]) -> int:
    for text, ok in checks:
        print(f"{verdict(ok)}  {text}")
    return 0 if all(ok for _, ok in checks) else 1
