"""Cost of ``trajectory-replay replay`` (every stage) against the I/O floor, its scaling, and its memory.

Builds two synthetic bundles — ``write_synthetic(samples=256, tokens=8192, kl_coef=0.0)`` (five float32
payloads of ≈2.1M tokens: log_probs, old_log_probs, entropy, advantages, kl) and the same with 4× the
samples — then measures in one run, interleaved, each as a fresh process:

* torch     — ``python -c "import torch"`` (the memory baseline);
* floor     — ``import torch`` + read and sha256 every payload file of the 1× bundle;
* replay 1× — ``trajectory-replay replay`` of the 1× bundle, all stages (sample → loss.policy);
* replay 4× — the same on the 4× bundle;
* replay verl-dapo — the 1× bundle's payloads under the verl DAPO combination of SPEC §4.2 (a global token mean
  over a recorded count × dp 4, dual-clip c = 3, clip-higher 0.2 / 0.28, the ±20 log-ratio clamp), its loss
  fields recorded as a float32 producer computes them (it replays clean).

Prints medians of the wall time (CPU time for reference), the peak RSS of each (``os.wait4`` rusage of
that child) and PASS/FAIL for:

* replay(1×) / floor ≤ 1.5 (wall) — every stage recomputed in float64 with its error-model bound;
* replay(verl-dapo) / floor ≤ 1.5 (wall) — the same with every loss-side knob of that combination on;
* replay(4×) / replay(1×) ≤ 4.5 (wall, for a token ratio of 4);
* peak RSS of replay(1×) above the ``import torch`` baseline ≤ 3× the 1× payload bytes.

    python bench/bench_replay.py [--samples 256] [--tokens 8192] [--reps 5] [--keep DIR]

Exit status 0 when every target passes, 1 otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import FLOOR_CODE, TORCH_CODE, build_bundles, bundle_args, cli_cmd, measure, report, workdir  # noqa: E402

FLOOR_LIMIT = 1.5

# The verl DAPO bundle: the 1× synthetic bundle's payloads (same seed) with the loss-side knobs set and the loss
# fields a float32 producer reports under them. Built in a child process, like the others.
VERL_DAPO_CODE = (
    "import sys\n"
    "import msgspec, torch\n"
    "from replay_lib.demo import synthetic_parts, write_bundle\n"
    "from replay_lib.kernels.loss import LossKnobs, policy_loss_fields\n"
    "m, index, expected, payloads = synthetic_parts(samples=int(sys.argv[2]), tokens=int(sys.argv[3]), kl_coef=0.0,\n"
    "                                               bundle_id='verl-dapo-bench')\n"
    "mask = torch.tensor([x for s in index.samples for x in s.loss_mask], dtype=torch.float32)\n"
    "lengths = torch.tensor([s.response_length for s in index.samples])\n"
    "cfg = msgspec.structs.replace(index.config, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0,\n"
    "                              log_ratio_clamp=20.0, loss_agg_mode='token_mean',\n"
    "                              loss_token_count=4 * int(mask.sum()), loss_scale=4.0)\n"
    "fields = policy_loss_fields(payloads['log_probs'], payloads['old_log_probs'], payloads['advantages'],\n"
    "                            payloads['entropy'], mask, lengths, eps_clip=0.2, eps_clip_high=0.28,\n"
    "                            entropy_coef=cfg.entropy_coef, knobs=LossKnobs.of(cfg))\n"
    "expected['loss.policy'] = {k: float(v) for k, v in fields.items()}\n"
    "write_bundle(sys.argv[1], m, msgspec.structs.replace(index, config=cfg), expected, payloads)\n"
)
SCALE_LIMIT = 4.5
MEMORY_LIMIT = 3.0


def main(argv=None) -> int:
    args = bundle_args(__doc__.splitlines()[0], argv)
    with workdir(args.keep, "bench-replay-") as root:
        small, big, build_s = build_bundles(root, args.samples, args.tokens)
        dapo = root / "verl-dapo"
        if not dapo.exists():
            subprocess.run([sys.executable, "-c", VERL_DAPO_CODE, str(dapo), str(args.samples), str(args.tokens)],
                           check=True)
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
            "replay verl-dapo": cli_cmd("replay") + [str(dapo)],
        }
        med, med_cpu, peak = measure(cmds, args.reps)

        floor_ratio = med["replay 1×"] / med["floor"]
        dapo_ratio = med["replay verl-dapo"] / med["floor"]
        scale_ratio = med["replay 4×"] / med["replay 1×"]
        above = peak["replay 1×"] - peak["torch"]
        memory_ratio = above / payload_bytes
        above_4x = peak["replay 4×"] - peak["torch"]
        checks = [
            (f"replay(1×) / floor = {floor_ratio:.2f} wall ({med_cpu['replay 1×'] / med_cpu['floor']:.2f} cpu) "
             f"(target ≤ {FLOOR_LIMIT})", floor_ratio <= FLOOR_LIMIT),
            (f"replay(verl-dapo) / floor = {dapo_ratio:.2f} wall ({med_cpu['replay verl-dapo'] / med_cpu['floor']:.2f} "
             f"cpu): token mean over a recorded count × dp, dual-clip 3, clip-higher, log-ratio clamp "
             f"(target ≤ {FLOOR_LIMIT})", dapo_ratio <= FLOOR_LIMIT),
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
