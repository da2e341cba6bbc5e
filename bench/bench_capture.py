"""Cost of capture on the training loop: the example async GRPO trainer with capture on vs off, in one run.

Rounds alternate the order (off→on, on→off, …) so drift on a shared host hits both sides; each run is the
same seeded training (identical work), in this process, after one warm-up run of each mode. Per run:

* step time: the median wall time of an actor step (``train_one_step``: micro-batch forward/backward,
  gradient all-reduce, optimizer, and the capture submits), which is what capture must not slow down;
* loop time per step: the whole training loop divided by its steps. It also contains the waits for the
  rollout worker, which in this CPU-only example shares the same cores as the capture writer thread
  (in a real job generation runs elsewhere), so it is reported, not gated;
* the training thread's CPU time per step, the bytes written per actor step (rollout- and step-level
  bundles together) and the flush time at close (after the loop).

PASS when the median over rounds of (step time on / step time off) is ≤ 1.05. The ratio of the fastest
runs is printed beside it: neighbours on a shared host only ever add time.

    python bench/bench_capture.py [--rounds 16] [--rollouts 2] [--hidden 512]
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 1.05


def load_trainer():
    spec = importlib.util.spec_from_file_location("grpo_trainer_bench", ROOT / "examples" / "grpo_trainer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module



def add_trainer_arguments(ap: argparse.ArgumentParser) -> None:
    """The example trainer's size, shared by the capture benches (bench_grad, bench_capture_ring)."""
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--prompts-per-rollout", type=int, default=8)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--embed", type=int, default=128)


def trainer_argv(args, *extra: str) -> list[str]:
    """The example trainer's command line for :func:`add_trainer_arguments`' values, then ``extra``."""
    return ["--rollouts", str(args.rollouts), "--prompts-per-rollout", str(args.prompts_per_rollout),
            "--n-samples", str(args.n_samples), "--consumer-batch", str(args.n_samples * 3 // 2),
            "--steps-per-rollout", "2", "--micro-batch", str(args.micro_batch), "--hidden", str(args.hidden),
            "--embed", str(args.embed), *extra, "--quiet"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--token-terms", action="store_true",
                    help="the cost of RELAX_REPLAY_CAPTURE_TOKEN_TERMS=1: 'off' is capture without the per-token "
                         "loss terms, 'on' capture with them")
    add_trainer_arguments(ap)
    args = ap.parse_args(argv)
    trainer = load_trainer()
    train_argv = trainer_argv(args)
    root = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    rows = {"off": [], "on": []}
    try:
        # Warm-up, both modes: imports, allocator, first torch.save, the producer's one git lookup.
        base = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(root / "warm-base")} \
            if args.token_terms else {}
        terms = {"RELAX_REPLAY_CAPTURE_TOKEN_TERMS": "1"} if args.token_terms else {}
        trainer.run(train_argv, env=dict(base))
        trainer.run(train_argv, env={"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(root / "warm-up"),
                                     **terms})
        for r in range(args.rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for mode in order:
                env = dict(base, RELAX_REPLAY_CAPTURE_DIR=str(root / f"base-{r}")) if base else {}
                if mode == "on":
                    env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(root / f"round-{r}"), **terms}
                t0 = time.perf_counter()
                result = trainer.run(train_argv, env=env)
                total = time.perf_counter() - t0
                stats = result.capture_stats
                if mode == "on" and (stats.errors or stats.dropped or stats.abandoned or not result.capture_flushed):
                    raise SystemExit(f"capture lost records in round {r}: {stats}")
                rows[mode].append({
                    "step": statistics.median(result.step_times),
                    "loop": result.loop_time / result.steps,
                    "cpu": statistics.median(result.step_cpu_times),
                    "flush": total - result.loop_time,
                    "bytes": stats.bytes_written,
                    "written": stats.written,
                    "steps": result.steps,
                })
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def ratio(key: str) -> float:
        return statistics.median(on[key] / off[key] for on, off in zip(rows["on"], rows["off"]))

    def min_ratio(key: str) -> float:
        return min(row[key] for row in rows["on"]) / min(row[key] for row in rows["off"])

    def delta_ms(key: str) -> float:
        return statistics.median(on[key] - off[key] for on, off in zip(rows["on"], rows["off"])) * 1e3

    def ms(mode: str, key: str) -> float:
        return statistics.median(row[key] for row in rows[mode]) * 1e3

    on0 = rows["on"][0]
    bytes_per_step = on0["bytes"] / on0["steps"]
    step_ratio = ratio("step")
    print(f"example trainer: {args.rollouts} rollouts x 2 steps, {args.prompts_per_rollout}x{args.n_samples} samples "
          f"per rollout, GRU hidden {args.hidden}; {args.rounds} rounds, order alternating")
    print(f"step time           off {ms('off', 'step'):8.2f} ms   on {ms('on', 'step'):8.2f} ms   "
          f"ratio {step_ratio:.3f}   (min/min {min_ratio('step'):.3f}; on − off {delta_ms('step'):+.1f} ms)")
    print(f"loop time per step  off {ms('off', 'loop'):8.2f} ms   on {ms('on', 'loop'):8.2f} ms   "
          f"ratio {ratio('loop'):.3f}   (min/min {min_ratio('loop'):.3f}; includes rollout-worker waits)")
    print(f"step CPU time       off {ms('off', 'cpu'):8.2f} ms   on {ms('on', 'cpu'):8.2f} ms   "
          f"ratio {ratio('cpu'):.3f}   (training thread only)")
    print(f"close/flush         off {ms('off', 'flush'):8.2f} ms   on {ms('on', 'flush'):8.2f} ms   (after the loop)")
    print(f"bytes written per actor step: {bytes_per_step:,.0f} "
          f"({on0['written']} bundles, {on0['bytes']:,} bytes for {on0['steps']} steps)")
    print("per round (step ms off/on): " + "  ".join(
        f"{off['step'] * 1e3:.0f}/{on['step'] * 1e3:.0f}" for off, on in zip(rows["off"], rows["on"])))
    passed = step_ratio <= LIMIT
    print(f"{'PASS' if passed else 'FAIL'}: step time with capture on / off = {step_ratio:.3f} (limit {LIMIT})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
