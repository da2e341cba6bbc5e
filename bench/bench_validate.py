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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import FLOOR_CODE, build_bundles, bundle_args, cli_cmd, measure, report, workdir  # noqa: E402

FLOOR_LIMIT = 1.5
SCALE_LIMIT = 4.5


def main(argv=None) -> int:
    args = bundle_args(__doc__.splitlines()[0], argv)
    with workdir(args.keep, "bench-validate-") as root:
        small, big, build_s = build_bundles(root, args.samples, args.tokens)
        payloads = sorted(str(p) for p in (small / "payloads").iterdir())
        tokens = args.samples * args.tokens
        size = {b: sum(f.stat().st_size for f in b.rglob("*") if f.is_file()) for b in (small, big)}
        print(f"bundles: 1× {args.samples} samples × {args.tokens} tokens = {tokens:,} tokens, "
              f"{len(payloads)} payloads, {size[small] / 2**20:.1f} MiB; 4× {size[big] / 2**20:.1f} MiB "
              f"(built in {build_s:.1f} s)")

        cmds = {
            "floor": [sys.executable, "-c", FLOOR_CODE, *payloads],
            "validate 1×": cli_cmd("validate") + [str(small)],
            "validate 4×": cli_cmd("validate") + [str(big)],
        }
        med, med_cpu, peak = measure(cmds, args.reps)

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
        return report(checks)


if __name__ == "__main__":
    sys.exit(main())
