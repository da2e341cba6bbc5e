"""Cost of stage ``logprob.mismatch`` and of the train/rollout correction on ``replay`` (SPEC §4.4): a step bundle
of ``--samples`` × ``--tokens`` (default 256 × 8,192: ≈ 2.1M tokens) with ``rollout_log_probs``, written by the
independent loss producer of ``tests/producers/loss_knobs.py`` (verl-like: token mean, dual-clip, a KL term), replayed
in process (``replay_lib.run.runner.replay``), interleaved repetitions, median wall and CPU (process) time:

* base       — the bundle without the correction (``is_level`` unset), stages ``sample`` and ``loss.policy``;
* correction — the bundle with token TIS (``is_level=token``, cap 2), the same stages: the correction's cost;
* mismatch   — the correction bundle, every stage (``logprob.mismatch`` included): what ``replay`` runs;
* bitwise    — as ``mismatch`` with ``--bitwise`` (the oracle's per-token field compared too).

PASS when mismatch / base − 1 ≤ 20 % in CPU time (the stage and the correction together; on a shared host the
wall time also counts the neighbours' load). One torch thread by default (``--threads``): on a shared host two
intra-op threads mostly measure the neighbours.

    python bench/bench_mismatch.py [--samples 256] [--tokens 8192] [--reps 3] [--cli]

``--cli`` also times fresh ``trajectory-replay replay`` processes (base: ``--stage loss.policy`` on each bundle;
mismatch: every stage), the time a user waits for.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from producers.inputs import Size  # noqa: E402
from producers.loss_knobs import LossConfig, produce_loss_bundle  # noqa: E402

from replay_lib.bundle.schema import StageId  # noqa: E402
from replay_lib.judge.error_model import Rules  # noqa: E402
from replay_lib.run.runner import replay  # noqa: E402

LIMIT = 0.20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cli", action="store_true", help="also time fresh `trajectory-replay replay` processes")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-mismatch-"))
    try:
        size = Size(args.samples, args.tokens, 8)
        t0 = time.perf_counter()
        plain = produce_loss_bundle(root / "plain", 1, size, LossConfig(is_level=None, kl_loss_type=None))
        tis = produce_loss_bundle(root / "tis", 1, size, LossConfig(is_level="token", is_high=2.0, kl_loss_type=None))
        print(f"bundles written in {time.perf_counter() - t0:.1f}s ({args.samples} × {args.tokens})")
        loss_only = [StageId.SAMPLE, StageId.LOSS_POLICY]
        cases = {
            "base": (plain, loss_only, Rules()),
            "correction": (tis, loss_only, Rules()),
            "mismatch": (tis, None, Rules()),
            "bitwise": (tis, None, Rules(bitwise=True)),
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.reps):
            for name, (path, stages, rules) in cases.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                report = replay(path, stages=stages, rules=rules)
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
                if name == "mismatch":
                    assert report.stage("logprob.mismatch") is not None
        if args.cli:  # the time a user waits for: a fresh `trajectory-replay replay` process each
            import os
            import subprocess

            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads or ""), PYTHONPATH=os.pathsep.join(
                [str(ROOT), os.environ.get("PYTHONPATH", "")]))
            cmds = {"cli base": [str(plain), "--stage", "loss.policy"],
                    "cli correction": [str(tis), "--stage", "loss.policy"],
                    "cli mismatch": [str(tis)]}
            for name in cmds:
                times[name] = []
            for _ in range(args.reps):
                for name, extra in cmds.items():
                    start = time.perf_counter()
                    subprocess.run([sys.executable, "-m", "replay_lib", "replay", *extra], env=env,
                                   capture_output=True, check=False)
                    times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            ref = med["cli base"] if k.startswith("cli") else med["base"]
            print(f"{k:>14}: {v:7.2f}s  ({v / ref - 1:+.1%} vs base)  runs {', '.join(f'{t:.2f}' for t in times[k])}")
        cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
        for k, v in cpu_med.items():
            print(f"{k + ' cpu':>14}: {v:7.2f}s  ({v / cpu_med['base'] - 1:+.1%} vs base)  runs "
                  f"{', '.join(f'{t:.2f}' for t in cpu[k])}")
        if args.cli:
            print(f"cli: stage + correction add {med['cli mismatch'] / med['cli base'] - 1:+.1%}")
        over = med["mismatch"] / med["base"] - 1
        over_cpu = cpu_med["mismatch"] / cpu_med["base"] - 1
        ok = over_cpu <= LIMIT
        print(f"{'PASS' if ok else 'FAIL'}: stage + correction add {over_cpu:+.1%} CPU, {over:+.1%} wall "
              f"(limit {LIMIT:.0%} CPU)")
        return 0 if ok else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
