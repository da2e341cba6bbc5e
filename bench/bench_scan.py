"""Cost of ``trajectory-replay scan DIR --jobs 2`` against a shell loop of ``trajectory-replay replay``.

Builds a capture directory of ``--bundles`` (200) clean step bundles, ``write_synthetic(samples=32,
tokens=1024, kl_coef=0.0)`` each (32,768 tokens, five float32 payloads), anchored at steps 0:0 … 199:0,
then measures in one run, each as a fresh process (after one untimed floor run that warms the page cache):

* floor — one process: ``import torch`` + read and sha256 every payload file of every bundle (what any
  verifying replay of the whole directory must at least do, on one core);
* loop  — ``for b in DIR/*/; do trajectory-replay replay "$b"; done`` in bash: what a user did before
  ``scan`` (start-up, the torch import included, paid once per bundle);
* scan  — ``trajectory-replay scan DIR --jobs 2`` (start-up paid once per worker).

Wall and CPU time and the peak RSS of each come from ``os.wait4`` (CPU of the loop: bash and every replay it
waited for; of scan: the scan process and its workers, which it reaps). While scan runs, every process below
it (its workers) is sampled from /proc every 20 ms for its peak RSS (``VmHWM``): the largest is compared to
the peak RSS of a replay of one bundle (the loop's), since a worker replays one bundle at a time and frees it
before the next.

Targets (PASS/FAIL, exit 1 on a FAIL):

* scan(--jobs 2) / loop ≤ 0.6 (wall);
* peak RSS of the largest scan worker / peak RSS of one replay ≤ 1.25 (memory stays that of one bundle).

The ratios against the floor are printed beside them (scan / floor, loop / floor).

    python bench/bench_scan.py [--bundles 200] [--samples 32] [--tokens 1024] [--jobs 2] [--reps 1] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import FLOOR_CODE, cli_cmd, report, run_child, workdir  # noqa: E402

LOOP_LIMIT = 0.6
MEMORY_LIMIT = 1.25
SAMPLE_SECONDS = 0.02

BUILD_CODE = (
    "import sys\n"
    "from pathlib import Path\n"
    "from replay_lib.demo import write_synthetic\n"
    "from replay_lib.bundle.schema import ActorStepId\n"
    "root, n, samples, tokens = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])\n"
    "for r in range(n):\n"
    "    path = root / f'step-{r:05d}-0'\n"
    "    if not path.exists():\n"
    "        write_synthetic(path, samples=samples, tokens=tokens, kl_coef=0.0, seed=r, bundle_id=path.name,\n"
    "                        anchor=ActorStepId(rollout_id=r, step_id=0))\n"
)
LOOP_CODE = 'set -e; for b in "$1"/*/; do "$0" replay "$b" > /dev/null; done'


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundles", type=int, default=200)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1, help="timed runs of each (the loop is long: default 1)")
    ap.add_argument("--keep", type=Path, help="write the bundles here and keep them (default: a temp dir)")
    return ap.parse_args(argv)


def _descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        parent[int(pid)] = int(stat[stat.rindex(")") + 2:].split()[1])
    out, frontier = [], [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def _hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_sampled(cmd: list[str]) -> tuple[float, float, int, dict[int, int]]:
    """:func:`harness.run_child`, plus the peak RSS of every descendant seen while it ran."""
    peaks: dict[int, int] = {}
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                for pid in _descendants(proc.pid):
                    peaks[pid] = max(peaks.get(pid, 0), _hwm(pid))
                done.wait(SAMPLE_SECONDS)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        done.set()
        sampler.join()
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            out.seek(0)
            raise SystemExit(f"{' '.join(cmd)} exited {code}:\n{out.read().decode(errors='replace')}")
    return elapsed, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, peaks


def main(argv=None) -> int:
    args = _args(argv)
    with workdir(args.keep, "bench-scan-") as root:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD_CODE, str(root), str(args.bundles), str(args.samples),
                        str(args.tokens)], check=True)
        build_s = time.perf_counter() - t0
        bundles = sorted(p for p in root.iterdir() if p.is_dir())[: args.bundles]
        payloads = sorted(str(f) for b in bundles for f in (b / "payloads").iterdir())
        payload_bytes = sum(Path(p).stat().st_size for p in payloads)
        print(f"capture: {len(bundles)} bundles of {args.samples} samples × {args.tokens} tokens, "
              f"{len(payloads)} payload files of {payload_bytes / 2**20:.1f} MiB (built in {build_s:.1f} s)")
        replay_exe = cli_cmd("replay")
        if len(replay_exe) != 2:
            raise SystemExit("the loop needs the trajectory-replay script on PATH (pip install -e .)")
        floor_cmd = [sys.executable, "-c", FLOOR_CODE, *payloads]
        loop_cmd = ["bash", "-c", LOOP_CODE, replay_exe[0], str(root)]
        scan_cmd = cli_cmd("scan") + [str(root), "--jobs", str(args.jobs)]
        run_child(floor_cmd)  # warm the page cache and the .pyc files
        wall = {"floor": [], "loop": [], "scan": []}
        cpu = {"floor": [], "loop": [], "scan": []}
        rss = {"floor": 0, "loop": 0, "scan": 0}
        worker_peak, workers = 0, 0
        for _ in range(args.reps):
            for name, cmd in (("floor", floor_cmd), ("loop", loop_cmd)):
                t, c, m = run_child(cmd)
                wall[name].append(t)
                cpu[name].append(c)
                rss[name] = max(rss[name], m)
            t, c, m, peaks = run_sampled(scan_cmd)
            wall["scan"].append(t)
            cpu["scan"].append(c)
            rss["scan"] = max(rss["scan"], m)
            worker_peak = max([worker_peak, *peaks.values()])
            workers = max(workers, len(peaks))
        med = {k: statistics.median(v) for k, v in wall.items()}
        med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        for name in wall:
            runs = ", ".join(f"{t:.2f}" for t in wall[name])
            print(f"  {name:<5} wall median {med[name]:8.2f} s (runs: {runs})  cpu median {med_cpu[name]:8.2f} s  "
                  f"peak RSS {rss[name] / 2**20:7.1f} MiB")
        print(f"  scan: {workers} process(es) below it, the largest peak RSS {worker_peak / 2**20:.1f} MiB; "
              f"one replay (the loop's peak) {rss['loop'] / 2**20:.1f} MiB")
        per_bundle = {k: med[k] / len(bundles) for k in ("loop", "scan")}
        print(f"  per bundle: loop {per_bundle['loop'] * 1e3:.0f} ms, scan {per_bundle['scan'] * 1e3:.0f} ms; "
              f"loop / floor = {med['loop'] / med['floor']:.1f}, scan / floor = {med['scan'] / med['floor']:.2f}")
        loop_ratio = med["scan"] / med["loop"]
        memory_ratio = worker_peak / rss["loop"]
        return report([
            (f"scan(--jobs {args.jobs}) / loop = {loop_ratio:.3f} (wall; bound {LOOP_LIMIT})",
             loop_ratio <= LOOP_LIMIT),
            (f"largest scan worker peak RSS / one replay's = {memory_ratio:.2f} (bound {MEMORY_LIMIT})",
             memory_ratio <= MEMORY_LIMIT),
        ])


if __name__ == "__main__":
    sys.exit(main())
