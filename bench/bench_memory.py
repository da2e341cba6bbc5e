"""Peak memory of ``trajectory-replay replay`` and of the debugger's replay worker, as a ratio to the payload bytes.

Builds ``write_synthetic(samples, tokens, kl_coef=0.0, format_version=…)`` (format 1.3.0 by default: five float32
payloads and the packed uint8 mask), then runs, each as a fresh process, ``--reps`` times, interleaved:

* torch   — ``python -c "import torch"`` (the interpreter and torch: what every replay carries);
* replay  — ``OMP_NUM_THREADS=1 trajectory-replay replay BUNDLE``;
* worker  — what the debugger's worker does for its first frame, on one thread: ``open_bundle``, ``replay_run``,
  ``replay_tui.model.build_model`` (the Textual app's own screen is not in it).

Peak RSS is the child's ``ru_maxrss`` (``os.wait4``; the bench process stays small, so a child does not start with
its RSS). Targets (issue 40, point 4): each peak above ``import torch`` ≤ ``--limit`` (1.5) × the payload bytes; the
whole-process ratio is printed beside it (torch's ≈ 220 MiB dominate it below a few hundred MiB of payloads).
The children import the ``replay_lib`` of the working directory first (``python -c`` puts it on ``sys.path``): run
it from the tree to measure.

    python bench/bench_memory.py [--samples 1024] [--tokens 16384] [--reps 1] [--format 1.3.0] [--keep DIR]

Exit status 0 when every target passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import TORCH_CODE, cli_cmd, measure, report, workdir  # noqa: E402

BUILD = (
    "import sys\n"
    "from replay_lib.demo import write_synthetic\n"
    "write_synthetic(sys.argv[1], samples=int(sys.argv[2]), tokens=int(sys.argv[3]), kl_coef=0.0,\n"
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--format", default="1.3.0", help="the bundle's format_version (1.1.0: masks in index.json, .pt)")
    ap.add_argument("--limit", type=float, default=1.5)
    ap.add_argument("--keep", type=Path, help="write the bundle here and keep it (default: a temp dir)")
    args = ap.parse_args(argv)
    with workdir(args.keep, "bench-memory-") as root:
        bundle = root / f"b{args.samples}x{args.tokens}-{args.format}"
        if not bundle.exists():
            subprocess.run([sys.executable, "-c", BUILD, str(bundle), str(args.samples), str(args.tokens),
                            bundle.name, args.format], check=True)
        payload_bytes = sum(p.stat().st_size for p in (bundle / "payloads").iterdir())
        index_bytes = (bundle / "index.json").stat().st_size
        print(f"bundle: {args.samples} × {args.tokens} = {args.samples * args.tokens:,} tokens, format {args.format}: "
              f"payloads {payload_bytes / 2**20:.1f} MiB, index.json {index_bytes / 2**20:.1f} MiB")
        one = ["env", "OMP_NUM_THREADS=1"]
        cmds = {"torch": [sys.executable, "-c", TORCH_CODE],
                "replay": [*one, *cli_cmd("replay"), str(bundle)],
                "worker": [*one, sys.executable, "-c", WORKER, str(bundle)]}
        _, _, peak = measure(cmds, args.reps)
        checks = []
        for name in ("replay", "worker"):
            above = peak[name] - peak["torch"]
            checks.append((f"{name}: peak RSS {peak[name] / 2**20:.0f} MiB = {peak[name] / payload_bytes:.2f}× the "
                           f"payloads; above import torch {above / 2**20:.0f} MiB = {above / payload_bytes:.2f}× "
                           f"(target ≤ {args.limit}×)", above <= args.limit * payload_bytes))
        return report(checks)


if __name__ == "__main__":
    sys.exit(main())
