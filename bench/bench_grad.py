"""Cost of gradient capture (``RELAX_REPLAY_CAPTURE_GRAD=1``, stage loss.grad) on the training loop: the example
async GRPO trainer with capture on, with and without the gradient hooks, in one run.

Rounds alternate the order (grad off→on, on→off, …) so drift on a shared host hits both sides; each run is the
same seeded training (identical work), in this process, after one warm-up run of each mode. Per run: the median
wall time of an actor step (micro-batch forward/backward with the hook, optimizer, the capture submits), the
training thread's CPU time per step and the bytes written per actor step. The hook only keeps a reference to the
gradient backward makes; the copy happens on the capture writer's side, as for every payload.

PASS when the median over rounds of (step time grad on / grad off) is ≤ 1.03.

    python bench/bench_grad.py [--rounds 12] [--rollouts 2] [--hidden 512]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_capture import add_trainer_arguments, load_trainer, trainer_argv  # noqa: E402

LIMIT = 1.03


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    add_trainer_arguments(ap)
    args = ap.parse_args(argv)
    trainer = load_trainer()
    train_argv = trainer_argv(args, "--kl-loss", "low_var_kl:0.01")
    root = Path(tempfile.mkdtemp(prefix="bench-grad-"))
    rows = {"off": [], "on": []}

    def env(mode: str, where: str) -> dict:
        out = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(root / where)}
        if mode == "on":
            out["RELAX_REPLAY_CAPTURE_GRAD"] = "1"
        return out

    try:
        trainer.run(train_argv, env=env("off", "warm-off"))
        trainer.run(train_argv, env=env("on", "warm-on"))
        for r in range(args.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                result = trainer.run(train_argv, env=env(mode, f"round-{r}-{mode}"))
                stats = result.capture_stats
                if stats.errors or stats.dropped or stats.abandoned or not result.capture_flushed:
                    raise SystemExit(f"capture lost records in round {r} ({mode}): {stats}")
                rows[mode].append({"step": statistics.median(result.step_times),
                                   "cpu": statistics.median(result.step_cpu_times),
                                   "bytes": stats.bytes_written, "steps": result.steps})
        if not any((root / "round-0-on").rglob("grad_log_probs.*")):
            raise SystemExit("no grad_log_probs payload was written with RELAX_REPLAY_CAPTURE_GRAD=1")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def ratio(key: str) -> float:
        return statistics.median(on[key] / off[key] for on, off in zip(rows["on"], rows["off"]))

    def ms(mode: str, key: str) -> float:
        return statistics.median(row[key] for row in rows[mode]) * 1e3

    step_ratio = ratio("step")
    per_step = {m: rows[m][0]["bytes"] / rows[m][0]["steps"] for m in rows}
    print(f"example trainer: {args.rollouts} rollouts x 2 steps, {args.prompts_per_rollout}x{args.n_samples} samples "
          f"per rollout, GRU hidden {args.hidden}, capture on; {args.rounds} rounds, order alternating")
    print(f"step time      grad off {ms('off', 'step'):8.2f} ms   grad on {ms('on', 'step'):8.2f} ms   "
          f"ratio {step_ratio:.3f}")
    print(f"step CPU time  grad off {ms('off', 'cpu'):8.2f} ms   grad on {ms('on', 'cpu'):8.2f} ms   "
          f"ratio {ratio('cpu'):.3f}   (training thread only)")
    print(f"bytes written per actor step: grad off {per_step['off']:,.0f}, grad on {per_step['on']:,.0f}")
    print("per round (step ms off/on): " + "  ".join(
        f"{off['step'] * 1e3:.0f}/{on['step'] * 1e3:.0f}" for off, on in zip(rows["off"], rows["on"])))
    passed = step_ratio <= LIMIT
    print(f"{'PASS' if passed else 'FAIL'}: step time with gradient capture on / off = {step_ratio:.3f} "
          f"(limit {LIMIT})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
