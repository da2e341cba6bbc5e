"""Cost of capture on trigger (the ring) on the training loop: the example GRPO trainer with capture off vs
capture on with ``RELAX_REPLAY_CAPTURE_RING`` and every trigger armed (none firing), in one run.

Same pattern as ``bench_capture.py``: rounds alternate the order (off→ring, ring→off, …), each run is the same
seeded training, after one warm-up run of each mode. The ring's triggers (max |Δlogp|, k3, gradient-norm spike)
are set high enough never to fire, so the writer thread holds and evaluates every step and writes nothing; a
non-finite loss would still fire. PASS when the median over rounds of (step time ring / step time off) ≤ 1.05.

    python bench/bench_capture_ring.py [--rounds 8] [--rollouts 2] [--hidden 512] [--ring 8]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_capture import LIMIT, add_trainer_arguments, load_trainer, trainer_argv  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    add_trainer_arguments(ap)
    ap.add_argument("--ring", type=int, default=8)
    args = ap.parse_args(argv)
    trainer = load_trainer()
    train_argv = trainer_argv(args)
    root = Path(tempfile.mkdtemp(prefix="bench-capture-ring-"))

    def ring_env(name: str) -> dict:
        return {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(root / name),
                "RELAX_REPLAY_CAPTURE_RING": str(args.ring), "RELAX_REPLAY_CAPTURE_TRIGGER_MAX_DLOGP": "1e9",
                "RELAX_REPLAY_CAPTURE_TRIGGER_K3": "1e9", "RELAX_REPLAY_CAPTURE_TRIGGER_GRAD_SPIKE": "1e9"}

    rows = {"off": [], "ring": []}
    try:
        trainer.run(train_argv, env={})
        trainer.run(train_argv, env=ring_env("warm-up"))
        for r in range(args.rounds):
            for mode in (("off", "ring") if r % 2 == 0 else ("ring", "off")):
                env = ring_env(f"round-{r}") if mode == "ring" else {}
                t0 = time.perf_counter()
                result = trainer.run(train_argv, env=env)
                total = time.perf_counter() - t0
                stats = result.capture_stats
                if mode == "ring" and (stats.errors or stats.dropped or stats.written or not result.capture_flushed):
                    raise SystemExit(f"the ring wrote or lost records in round {r}: {stats}")
                rows[mode].append({"step": statistics.median(result.step_times),
                                   "cpu": statistics.median(result.step_cpu_times), "flush": total - result.loop_time})
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def ratio(key: str) -> float:
        return statistics.median(on[key] / off[key] for on, off in zip(rows["ring"], rows["off"]))

    def ms(mode: str, key: str) -> float:
        return statistics.median(row[key] for row in rows[mode]) * 1e3

    step_ratio = ratio("step")
    min_ratio = min(r["step"] for r in rows["ring"]) / min(r["step"] for r in rows["off"])
    print(f"example trainer: {args.rollouts} rollouts x 2 steps, {args.prompts_per_rollout}x{args.n_samples} samples "
          f"per rollout, GRU hidden {args.hidden}; ring of {args.ring} steps; {args.rounds} rounds")
    print(f"step time      off {ms('off', 'step'):8.2f} ms   ring {ms('ring', 'step'):8.2f} ms   ratio {step_ratio:.3f}"
          f"   (min/min {min_ratio:.3f})")
    print(f"step CPU time  off {ms('off', 'cpu'):8.2f} ms   ring {ms('ring', 'cpu'):8.2f} ms   ratio {ratio('cpu'):.3f}"
          "   (training thread only)")
    print(f"close/flush    off {ms('off', 'flush'):8.2f} ms   ring {ms('ring', 'flush'):8.2f} ms")
    passed = step_ratio <= LIMIT
    print(f"{'PASS' if passed else 'FAIL'}: step time with the capture ring / without capture = {step_ratio:.3f} "
          f"(limit {LIMIT})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
