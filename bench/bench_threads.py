"""``trajectory-replay replay`` at several torch thread settings, against one thread and the I/O floor.

Builds ``write_synthetic(samples=256, tokens=8192, kl_coef=0.0)`` (``--samples``/``--tokens``), then measures in
one run, interleaved, each as a fresh process, ``--reps`` times (median):

* floor        — ``import torch`` + read and sha256 every payload file and index.json (bench/harness.py);
* floor, quick exit — the same ending with ``os._exit`` as ``replay`` ends (``cli.end_process``: no interpreter
  teardown, ≈ 0.3 s of a process that imported torch); printed as a stricter floor, not judged;
* replay t=1   — ``OMP_NUM_THREADS=1 trajectory-replay replay BUNDLE``;
* replay t=N   — the same with ``OMP_NUM_THREADS=N`` for each N of ``--threads`` (default 2, 4);
* replay t=default — ``OMP_NUM_THREADS`` unset (torch's default: one thread per core).

Target (issue 40, point 1): more threads are never slower than one — every ``t=N`` and ``t=default`` within
``--margin`` (default 1.15, the spread of single runs on a shared host) of ``t=1``, in CPU time (user + sys of
the process: what spin-waiting threads burn) and, while the host is not oversubscribed (1-minute load average
below its CPU count, before and after the run), in wall time too; on a host loaded beyond its cores the wall
ratio is printed but not judged (it then measures the neighbours: single runs of one command spread over 2–3×).
The floor ratio of each is printed beside it.

    python bench/bench_threads.py [--samples 256] [--tokens 8192] [--reps 3] [--threads 2,4] [--keep DIR]

Exit status 0 when every target passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BUILD_CODE, FLOOR_CODE, QUICK_FLOOR_CODE, cli_cmd, measure, report, workdir  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="2,4", help="comma-separated OMP_NUM_THREADS values besides 1 and unset")
    ap.add_argument("--margin", type=float, default=1.15)
    ap.add_argument("--keep", type=Path, help="write the bundle here and keep it (default: a temp dir)")
    ap.add_argument("--format", default=None, help="the bundle's format_version (default: write_synthetic's, 1.3.0: "
                                                   "packed masks and safetensors payloads; 1.1.0: the older form)")
    ap.add_argument("--compare-src", type=Path, metavar="DIR",
                    help="also replay with another source tree (PYTHONPATH=DIR, e.g. a `git archive` of an older "
                         "commit) at t=1 and t=default, interleaved in the same run (printed, not judged)")
    args = ap.parse_args(argv)
    with workdir(args.keep, "bench-threads-") as root:
        bundle = root / (f"b{args.samples}x{args.tokens}" + (f"-{args.format}" if args.format else ""))
        if not bundle.exists():
            build = BUILD_CODE if args.format is None else BUILD_CODE.replace(
                "bundle_id=sys.argv[4])", f"bundle_id=sys.argv[4], format_version={args.format!r})")
            subprocess.run([sys.executable, "-c", build, str(bundle), str(args.samples), str(args.tokens),
                            bundle.name], check=True)
        payloads = sorted(str(p) for p in (bundle / "payloads").iterdir())
        payload_bytes = sum(Path(p).stat().st_size for p in payloads)
        read = [*payloads, str(bundle / "index.json")]  # the floor reads the index too (issue 40)
        print(f"bundle: {args.samples} samples × {args.tokens} tokens = {args.samples * args.tokens:,} tokens, "
              f"{payload_bytes / 2**20:.1f} MiB of payloads")
        replay = cli_cmd("replay") + [str(bundle)]
        cmds = {"floor": ["env", "-u", "OMP_NUM_THREADS", sys.executable, "-c", FLOOR_CODE, *read],
                # the same work ending as the read-only commands end (os._exit: no interpreter teardown)
                "floor, quick exit": ["env", "-u", "OMP_NUM_THREADS", sys.executable, "-c", QUICK_FLOOR_CODE,
                                      *read],
                "replay t=1": ["env", "OMP_NUM_THREADS=1", *replay]}
        for n in (int(x) for x in args.threads.split(",") if x.strip()):
            cmds[f"replay t={n}"] = ["env", f"OMP_NUM_THREADS={n}", *replay]
        cmds["replay t=default"] = ["env", "-u", "OMP_NUM_THREADS", *replay]
        if args.compare_src:
            # `python -m replay_lib`: the other tree's own entry point (this install's console script may name a
            # function the other tree lacks)
            src = f"PYTHONPATH={args.compare_src.resolve()}"
            # (-P: not the current directory's replay_lib ahead of DIR's)
            other = [sys.executable, "-P", "-m", "replay_lib", "replay", str(bundle)]
            cmds["compare t=1"] = ["env", src, "OMP_NUM_THREADS=1", *other]
            cmds["compare t=default"] = ["env", "-u", "OMP_NUM_THREADS", src, *other]
        load_before = os.getloadavg()[0]
        med, med_cpu, peak = measure(cmds, args.reps)
        load = max(load_before, os.getloadavg()[0])
        cores = os.cpu_count() or 1
        judge_wall = load < cores
        print(f"host: {cores} CPUs, 1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after: "
              + ("wall and CPU judged" if judge_wall else "oversubscribed, CPU judged (wall printed)"))
        one, one_cpu = med["replay t=1"], med_cpu["replay t=1"]
        quick = med["floor, quick exit"]
        print(f"replay t=1 / floor with a quick exit = {one / quick:.2f} wall (the floor's teardown: "
              f"{med['floor'] - quick:.2f} s)")
        print(f"replay t=1 / floor = {one / med['floor']:.2f} wall ({one_cpu / med_cpu['floor']:.2f} cpu); peak RSS "
              f"{peak['replay t=1'] / 2**20:.0f} MiB = {peak['replay t=1'] / payload_bytes:.2f}× the payloads")
        checks = []
        for name in cmds:
            if name in ("floor", "floor, quick exit", "replay t=1") or name.startswith("compare"):
                continue
            w, c = med[name] / one, med_cpu[name] / one_cpu
            judged = "wall and cpu" if judge_wall else "cpu"
            checks.append((f"{name} / t=1 = {w:.2f} wall, {c:.2f} cpu (floor ratio {med[name] / med['floor']:.2f}; "
                           f"target ≤ {args.margin}, {judged})", c <= args.margin and (w <= args.margin or not judge_wall)))
        if args.compare_src:
            c1, cd = "compare t=1", "compare t=default"
            print(f"compare ({args.compare_src}): t=1 / floor = {med[c1] / med['floor']:.2f} wall "
                  f"({med_cpu[c1] / med_cpu['floor']:.2f} cpu); t=default / t=1 = {med[cd] / med[c1]:.2f} wall, "
                  f"{med_cpu[cd] / med_cpu[c1]:.2f} cpu; peak RSS {peak[c1] / 2**20:.0f} MiB")
        return report(checks)


if __name__ == "__main__":
    sys.exit(main())
