"""Cost of the ``logprob.support`` stage: ``replay`` time on a 512K-token bundle with K = 20 support slots,
with vs without the sample-support payloads and stage, in one run (interleaved repetitions, median).

Three replays of the same step, built from one ``support_parts(...)`` call:

* base      — the bundle as written with sample-support capture off (no support payloads, no stage);
* payloads  — the support bundle replayed without the stage (``stages=`` every other stage): the price of
  verifying (sha256) and loading the extra ≈ 86 MB of ``support_ids`` / ``support_logits`` / … payloads;
* full      — the support bundle, every stage.

Two measurements of each: ``trajectory-replay replay`` as a fresh process — the time a user waits for, and
the one the target applies to, as in bench_replay.py — and the in-process ``replay()`` call, which isolates
the stage's own compute. PASS when the CLI's full / base − 1 ≤ 30% (median wall time); the in-process
figure is printed beside it so that the stage's own share stays visible. The split into payload verification and stage compute
is printed beside it, and CPU time (user + sys of this process) next to wall time: on a busy shared host
wall time partly measures the neighbours. Every replay runs with one torch thread by default (``--threads``):
on a host shared with other jobs, two intra-op threads mostly measure how often a neighbour holds the other
core (the same stage then costs 3–5× more wall and CPU time); ``--threads 0`` keeps torch's default.

    python bench/bench_support.py [--samples 512] [--tokens 1024] [--k 20] [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from replay_lib.demo import support_parts, write_bundle
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import StageId
from replay_lib.stages import STAGE_ORDER

SUPPORT_PAYLOADS = ("support_ids", "support_logits", "sampled_token_ids", "full_log_probs")
LIMIT = 0.30
OTHER_STAGES = [s for s in STAGE_ORDER if s not in (StageId.LOGPROB_SUPPORT, StageId.LOSS_VALUE)]


def without_support(manifest, index, expected, payloads):
    """The same bundle as the trainer writes it with sample-support capture off."""
    contracts = {s: c for s, c in manifest.stage_contracts.items() if s != StageId.LOGPROB_SUPPORT}
    manifest = msgspec.structs.replace(manifest, stage_contracts=contracts)
    payloads = {n: t for n, t in payloads.items() if n not in SUPPORT_PAYLOADS}
    return manifest, index, expected, payloads


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def timed_replay(path: Path, stages=None) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), cpu_seconds()
    report = replay(path, stages=stages)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    if not report.passed:
        raise SystemExit(f"{path}: expected a clean replay, first divergent stage {report.first_divergent_stage}")
    return wall, cpu


def timed_cli(path: Path, stages=None) -> float:
    """Wall seconds of ``trajectory-replay replay PATH`` in a fresh process (exit 0 required)."""
    import subprocess

    cmd = [sys.executable, "-m", "replay_lib", "replay", str(path)]
    for s in stages or ():
        cmd += ["--stage", s.value]
    t = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"{path}: replay exited {done.returncode}: {done.stderr.decode()[-300:]}")
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for every replay (default 1; 0 = torch's default)")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-support-"))
    try:
        t0 = time.perf_counter()
        parts = support_parts(samples=args.samples, tokens=args.tokens, k=args.k, vocab_size=args.vocab_size,
                              group_size=4, bundle_id="bench-support")
        full_path = write_bundle(root / "with", *parts)
        base_path = write_bundle(root / "without", *without_support(*parts))
        del parts
        extra = sum(next((full_path / "payloads").glob(f"{n}.*")).stat().st_size for n in SUPPORT_PAYLOADS)
        print(f"bundle: {args.samples} samples x {args.tokens} tokens = {args.samples * args.tokens} tokens, "
              f"K = {args.k}, support payloads {extra / 2**20:.1f} MiB (written in {time.perf_counter() - t0:.1f} s); "
              f"torch threads {torch.get_num_threads()}")
        runs = {
            "base": lambda: timed_replay(base_path),
            "payloads": lambda: timed_replay(full_path, stages=OTHER_STAGES),
            "full": lambda: timed_replay(full_path),
        }
        for run in runs.values():  # warm the page cache and the allocator
            run()
        wall: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.reps):
            for name, run in runs.items():
                w, c = run()
                wall[name].append(w)
                cpu[name].append(c)
        w = {k: statistics.median(v) for k, v in wall.items()}
        c = {k: statistics.median(v) for k, v in cpu.items()}
        for name, label in (("base", "without support"), ("payloads", "support payloads, stage not run"),
                            ("full", "with support (payloads + stage)")):
            print(f"replay {label:<32} wall {w[name] * 1000:7.1f} ms  cpu {c[name] * 1000:7.1f} ms  "
                  f"(wall runs: {', '.join(f'{t * 1000:.0f}' for t in wall[name])})")
        print(f"  payload verification + loading ({extra / 2**20:.1f} MiB more): wall "
              f"{(w['payloads'] / w['base'] - 1) * 100:+.1f}%, cpu {(c['payloads'] / c['base'] - 1) * 100:+.1f}% of base")
        print(f"  stage compute (logprob.support):          wall "
              f"{(w['full'] - w['payloads']) / w['base'] * 100:+.1f}%, cpu {(c['full'] - c['payloads']) / c['base'] * 100:+.1f}% of base")
        overhead, overhead_cpu = w["full"] / w["base"] - 1, c["full"] / c["base"] - 1
        print(f"in-process replay(): support overhead wall {overhead * 100:+.1f}% (cpu {overhead_cpu * 100:+.1f}%) "
              f"— diagnostic, the stage's own share")
        cli: dict[str, list[float]] = {"base": [], "payloads": [], "full": []}
        for _ in range(args.reps):
            cli["base"].append(timed_cli(base_path))
            cli["payloads"].append(timed_cli(full_path, OTHER_STAGES))
            cli["full"].append(timed_cli(full_path))
        m = {k: statistics.median(v) for k, v in cli.items()}
        for name, label in (("base", "without support"), ("payloads", "support payloads, stage not run"),
                            ("full", "with support (payloads + stage)")):
            print(f"trajectory-replay replay {label:<32} wall {m[name]:6.2f} s")
        cli_overhead = m["full"] / m["base"] - 1
        verdict = "PASS" if cli_overhead <= LIMIT else "FAIL"
        print(f"support overhead on `trajectory-replay replay`: wall {cli_overhead * 100:+.1f}% "
              f"(stage alone {(m['full'] - m['payloads']) / m['base'] * 100:+.1f}%), limit +{LIMIT * 100:.0f}% {verdict}")
        return 0 if verdict == "PASS" else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
