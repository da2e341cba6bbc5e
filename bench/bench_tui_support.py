"""Cursor moves in ``replay-tui``'s diff viewer with the support strip on a 32,768-token sample.

Builds (``support_parts`` with ``full_vocab_bug=True`` + ``BundleWriter``) a sample-support bundle of
``--samples`` trajectories × ``--tokens`` tokens with top-``--k`` support rows over a ``--vocab`` vocabulary:
every loss-bearing token of ``s-0`` diverges in ``logprob.support``, so the debugger opens on
``support_logprob s-0@0`` with the support strip under the rows. Then, in one process:

* **cursor move** — exactly ``bench_tui.py``'s measure: ``--moves`` × (``await pilot.press("down"|"up")`` +
  ``await pilot.pause()``), each timed, interleaved with the same round trip for a key bound to nothing
  (the floor). Target: median move − median floor ≤ 20 ms (a move repaints two diff rows, the |err|
  strip's cursor and the support strip's two lines).
* **support row** — ``ReplayModel.support_row`` alone (what the strip computes per move, outside the app),
  over ``--moves`` offsets spread along the sample: its median in µs and its share of the median move.

    python bench/bench_tui_support.py [--samples 4] [--tokens 32768] [--k 20] [--vocab 151936] [--moves 100]

Exit status 0 when the target passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_tui import MOVE_LIMIT_MS, SIZE, cursor_moves, ms  # noqa: E402
from replay_lib.demo import write_support_bundle  # noqa: E402


def model_row_times(path: Path, sample_id: str, moves: int) -> list[float]:
    from replay_lib.bundle import open_bundle
    from replay_lib.run.runner import run_replay
    from replay_tui.model import build_model

    bundles = open_bundle(path)
    model = build_model(bundles, run_replay(bundles))
    n = model.sample(sample_id).response_length
    rows = []
    for i in range(moves):
        offset = i * (n - 1) // max(moves - 1, 1)
        t = time.perf_counter()
        model.support_row(sample_id, offset)
        rows.append(time.perf_counter() - t)
    return rows


async def run(args) -> int:
    if not args.stock_pilot:
        import textual._wait as wait

        wait.SLEEP_GRANULARITY = 0.002
        wait.SLEEP_IDLE = wait.SLEEP_GRANULARITY / 20
    root = Path(tempfile.mkdtemp(prefix="bench-tui-support-"))
    try:
        t = time.perf_counter()
        path = write_support_bundle(root / "support", full_vocab_bug=True, samples=args.samples, tokens=args.tokens,
                                    k=args.k, vocab_size=args.vocab, group_size=args.samples, bundle_id="bench-support")
        print(f"built {args.samples} samples × {args.tokens} tokens, top-{args.k} rows over {args.vocab} ids, in "
              f"{time.perf_counter() - t:.1f} s")

        rows = model_row_times(path, "s-0", args.moves)
        m = await cursor_moves(path, "s-0", args.moves)
        cost = ms(m["move"]) - ms(m["floor"])
        row_ms = statistics.median(rows) * 1000
        print(f"support row  median {row_ms * 1000:7.1f} µs (ReplayModel.support_row, outside the app) = "
              f"{row_ms / ms(m['move']):.1%} of a median move")
        print(f"cursor move  press+pause median {ms(m['move']):6.1f} ms (cpu {ms(m['move_cpu']):5.1f} ms) over "
              f"{len(m['move'])} moves on a {args.tokens}-token sample, support strip shown")
        print(f"pilot floor  press+pause median {ms(m['floor']):6.1f} ms (cpu {ms(m['floor_cpu']):5.1f} ms), "
              f"unbound key, same app")
        ok = cost <= MOVE_LIMIT_MS
        print(f"{'PASS' if ok else 'FAIL'}  cursor move above the floor = {cost:.1f} ms (≤ {MOVE_LIMIT_MS:g} ms); "
              f"raw median {ms(m['move']):.1f} ms; terminal {SIZE[0]}×{SIZE[1]}")
        return 0 if ok else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--moves", type=int, default=100)
    p.add_argument("--stock-pilot", action="store_true", help="keep Pilot's default 20 ms idle granularity")
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
