"""Peak memory of ``trajectory-replay replay``, of the debugger's replay worker and of the debugger itself, as a
ratio to the payload bytes.

Builds ``write_synthetic(samples, tokens, kl_coef=…, format_version=…)`` (format 1.3.0 by default: five float32
payloads and the packed uint8 mask; ``--kl-coef 0.05`` adds the reference log-probs and the kl the debugger opens
on), or measures ``--bundle DIR`` as it is (read only: a ``demo write`` bundle, a 134M-token step), then runs, each
as a fresh process, ``--reps`` times, interleaved:

* torch   — ``python -c "import torch"`` (the interpreter and torch: what every replay carries);
* replay  — ``OMP_NUM_THREADS=1 trajectory-replay replay BUNDLE``;
* worker  — what the debugger's worker does for its first frame, on one thread: ``open_bundle``, ``replay_run``,
  ``replay_tui.model.build_model`` (the Textual app's own screen is not in it);
* tui     — the debugger itself: ``ReplayApp(BUNDLE)`` under ``run_test`` at 120 × 40, up to its first complete
  frame (the event ``bench_tui.py`` waits for: the result on screen, then 0.3 s without a frame written); its
  ``VmHWM`` then (the whole process since exec: interpreter, torch, Textual, replay, model and screen), and
  the time to that frame (wall, and the process's CPU time: comparable on a busy host).

Peak RSS is the child's ``ru_maxrss`` (``os.wait4``; the bench process stays small, so a child does not start with
its RSS), the tui's its ``VmHWM`` at the first frame. Targets (issue 40, point 4): the replay's and the worker's peak
above ``import torch`` ≤ ``--limit`` (1.5) × the payload bytes (the whole-process ratio printed beside it: torch's
≈ 220 MiB dominate it below a few hundred MiB of payloads); the debugger's whole process at its first frame
≤ ``--limit`` × the payload bytes, the replay's whole-process figure printed beside it. The children import the
``replay_lib`` of the working directory first (``python -c`` puts it on ``sys.path``): run it from the tree.

    python bench/bench_memory.py [--samples 1024] [--tokens 16384] [--reps 1] [--format 1.3.0] [--kl-coef 0]
                                 [--keep DIR | --bundle DIR]

Exit status 0 when every target passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import TORCH_CODE, cli_cmd, measure, report, workdir  # noqa: E402

BUILD = (
    "import sys\n"
    "from replay_lib.demo import write_synthetic\n"
    "write_synthetic(sys.argv[1], samples=int(sys.argv[2]), tokens=int(sys.argv[3]), kl_coef=float(sys.argv[6]),\n"
    "                bundle_id=sys.argv[4], format_version=sys.argv[5])\n"
)
WORKER = (
    "import sys\n"
    "from replay_lib.bundle import open_bundle\n"
    "from replay_lib.run.runner import replay_run\n"
    "from replay_tui.model import build_model\n"
    "bundles = open_bundle(sys.argv[1])\n"
    "report, contexts = replay_run(bundles)\n"
    "build_model(bundles, report, contexts=contexts)\n"
)
# The debugger up to its first complete frame; prints {"base": VmHWM after the imports (KiB), "peak": VmHWM at the
# first frame (KiB), "first_frame": seconds from ReplayApp(...) to the last frame before the screen stayed quiet,
# "cpu": the process's CPU seconds (every thread) by then}.
TUI = (
    "import asyncio, json, sys, time\n"
    "def hwm():\n"
    "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
    "from replay_tui.app import ReplayApp\n"
    "base = hwm()\n"
    "class App(ReplayApp):\n"
    "    last = cpu = 0.0\n"
    "    def _display(self, screen, renderable):\n"
    "        super()._display(screen, renderable)\n"
    "        App.last, App.cpu = time.perf_counter(), time.process_time()\n"
    "async def main():\n"
    "    t0, c0 = time.perf_counter(), time.process_time()\n"
    "    app = App(sys.argv[1])\n"
    "    async with app.run_test(size=(120, 40)) as pilot:\n"
    "        await app.wait_settled(pilot)\n"
    "        assert app.error is None, app.error\n"
    "        while True:\n"
    "            seen = App.last\n"
    "            await asyncio.sleep(0.3)\n"
    "            await pilot.pause()\n"
    "            if App.last == seen:\n"
    "                break\n"
    "        print(json.dumps({'base': base, 'peak': hwm(), 'first_frame': App.last - t0, 'cpu': App.cpu - c0}))\n"
    "asyncio.run(main())\n"
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--format", default="1.3.0", help="the bundle's format_version (1.1.0: masks in index.json, .pt)")
    ap.add_argument("--limit", type=float, default=1.5)
    ap.add_argument("--kl-coef", type=float, default=0.0, help="the built bundle's kl_coef (0: no reference log-probs)")
    ap.add_argument("--keep", type=Path, help="write the bundle here and keep it (default: a temp dir)")
    ap.add_argument("--bundle", type=Path, help="measure this bundle as it is (read only) instead of building one")
    args = ap.parse_args(argv)
    with workdir(args.keep, "bench-memory-") as root:
        bundle = args.bundle
        if bundle is None:
            kl = f"-kl{args.kl_coef:g}" if args.kl_coef else ""
            bundle = root / f"b{args.samples}x{args.tokens}-{args.format}{kl}"
            if not bundle.exists():
                subprocess.run([sys.executable, "-c", BUILD, str(bundle), str(args.samples), str(args.tokens),
                                bundle.name, args.format, str(args.kl_coef)], check=True)
        payload_bytes = sum(p.stat().st_size for p in (bundle / "payloads").iterdir())
        index_bytes = (bundle / "index.json").stat().st_size
        manifest = json.loads((bundle / "manifest.json").read_text())
        tokens = next(iter(manifest.get("payloads", {}).values()), {}).get("shape", [0])[0]
        print(f"bundle {bundle.name}: {tokens:,} tokens, format {manifest.get('format_version')}: "
              f"payloads {payload_bytes / 2**20:.1f} MiB, index.json {index_bytes / 2**20:.1f} MiB")
        load = os.getloadavg()[0]
        one = ["env", "OMP_NUM_THREADS=1"]
        cmds = {"torch": [sys.executable, "-c", TORCH_CODE],
                "replay": [*one, *cli_cmd("replay"), str(bundle)],
                "worker": [*one, sys.executable, "-c", WORKER, str(bundle)]}
        _, _, peak = measure(cmds, args.reps)
        tui = [_tui(bundle) for _ in range(args.reps)]
        tui_peak = max(t["peak"] for t in tui) * 1024
        tui_base = max(t["base"] for t in tui) * 1024
        frames = ", ".join(f"{t['first_frame']:.2f}" for t in tui)
        print(f"  tui    VmHWM at the first frame {tui_peak / 2**20:7.1f} MiB (after its imports "
              f"{tui_base / 2**20:.0f} MiB); first frame after {statistics.median(t['first_frame'] for t in tui):.2f} s "
              f"(runs: {frames}), {statistics.median(t['cpu'] for t in tui):.2f} s of CPU")
        print(f"host: {os.cpu_count()} CPUs, 1-minute load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
        checks = []
        for name in ("replay", "worker"):
            above = peak[name] - peak["torch"]
            checks.append((f"{name}: peak RSS {peak[name] / 2**20:.0f} MiB = {peak[name] / payload_bytes:.2f}× the "
                           f"payloads; above import torch {above / 2**20:.0f} MiB = {above / payload_bytes:.2f}× "
                           f"(target ≤ {args.limit}×)", above <= args.limit * payload_bytes))
        checks.append((f"tui: whole process at its first frame {tui_peak / 2**20:.0f} MiB = "
                       f"{tui_peak / payload_bytes:.2f}× the payloads (replay {peak['replay'] / payload_bytes:.2f}×; "
                       f"target ≤ {args.limit}×); above its imports {(tui_peak - tui_base) / 2**20:.0f} MiB = "
                       f"{(tui_peak - tui_base) / payload_bytes:.2f}×", tui_peak <= args.limit * payload_bytes))
        return report(checks)


def _tui(bundle: Path) -> dict:
    """One fresh debugger process up to its first complete frame (``TUI``), on one thread as its worker runs."""
    out = subprocess.run(["env", "OMP_NUM_THREADS=1", sys.executable, "-c", TUI, str(bundle)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise SystemExit(f"the debugger exited {out.returncode}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
