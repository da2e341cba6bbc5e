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

* replay(1×) / floor ≤ 1.5 (wall) — every stage recomputed in float64 with its error-model bound;
* replay(4×) / replay(1×) ≤ 4.5 (wall, for a token ratio of 4);
* peak RSS of replay(1×) above the ``import torch`` baseline ≤ 3× the 1× payload bytes.

    python bench/bench_replay.py [--samples 256] [--tokens 8192] [--reps 5] [--keep DIR]

Exit status 0 when every target passes, 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import FLOOR_CODE, TORCH_CODE, build_bundles, bundle_args, cli_cmd, measure, report, workdir  # noqa: E402

FLOOR_LIMIT = 1.5
SCALE_LIMIT = 4.5
MEMORY_LIMIT = 3.0


def main(argv=None) -> int:
    args = bundle_args(__doc__.splitlines()[0], argv)
    with workdir(args.keep, "bench-replay-") as root:
        small, big, build_s = build_bundles(root, args.samples, args.tokens)
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
            "replay 1×": cli_cmd("replay") + [str(small)],
            "replay 4×": cli_cmd("replay") + [str(big)],
        }
        med, med_cpu, peak = measure(cmds, args.reps)

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
        return report(checks)


if __name__ == "__main__":
    sys.exit(main())
