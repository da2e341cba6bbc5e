"""Responsiveness of ``replay-tui``: time to the first complete frame on a large bundle against the demo,
and the cost of a cursor move in the diff viewer on a 32,768-token sample. In-process, Textual Pilot.

Builds (``synthetic_parts`` + ``BundleWriter``) a 4,096-sample bundle (16 tokens per sample) in which one
sample has 32,768 tokens and diverges (its recorded ``kl`` is off by +0.125 at four offsets from 20,000),
and the PR #65 demo bundle. Then, in one run:

* **first frame** — from ``ReplayApp(path)`` to the frame that put the final picture on the terminal:
  every update the app writes is recorded (``App._display``) and replayed afterwards onto a grid of
  cells; the first complete frame is the last one that changed a cell before the screen stayed quiet
  for 0.3 s (later re-layouts that change nothing do not count; the panes must show the report's first
  divergence and the key bar its keys). Demo and large bundle interleaved, ``--reps`` pairs, after one
  unmeasured warm-up. Target: the median of the pairs' large / demo ratios ≤ 1.5 (each pair ran back to
  back, in the same state of the host); the ratio of the medians, the CPU-time and fastest/fastest
  ratios are printed beside it, the median of the pairs' differences large − demo in ms (what the large
  step adds, whatever the demo's own frame costs), the replay worker's wall and CPU time inside the app
  (what the first frame waits for), and its parts — verify, replay, model — measured outside the app, back
  to back.
* **cursor move** — in the large bundle's diff viewer (the 32k sample, cursor at its first divergence),
  ``--moves`` × (``await pilot.press("down"|"up")`` + ``await pilot.pause()``), timed each; the floor is
  the same Pilot round trip for a key bound to nothing, in the same app, interleaved. The why strip (the
  token's inputs, ``replay_lib.explain.inputs``) and the three-line error plot are on screen and follow every move;
  the ratio move / floor is printed beside the difference. Target: median
  move − median floor ≤ 20 ms (the render cost of a move). Pilot's idle detection sleeps 20 ms per
  check by default, so a bare press + pause never takes under ~60 ms whatever the app does; the bench
  sets that granularity to 2 ms (``--stock-pilot`` keeps the default) and prints the raw medians too.

    python bench/bench_tui.py [--samples 4096] [--long-tokens 32768] [--reps 31] [--moves 100] [--keep DIR]

Exit status 0 when every target passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from replay_lib.demo import synthetic_parts, write_bundle, write_pr65  # noqa: E402
from replay_lib.kernels import get_grpo_returns, policy_loss_fields, rollout_kl  # noqa: E402

FIRST_FRAME_LIMIT = 1.5
MOVE_LIMIT_MS = 20.0
DIVERGENT_OFFSETS = (20000, 20001, 20002, 31000)
KL_DELTA = 0.125
SIZE = (120, 40)
FLOOR_KEY = "f12"  # bound to nothing


def build_large(path: Path, *, samples: int, tokens: int, long_tokens: int, long_index: int, seed: int = 11):
    """A clean synthetic bundle whose sample ``long_index`` has ``long_tokens`` tokens, then a kl fault in it."""
    manifest, index, expected, payloads = synthetic_parts(samples=samples, tokens=tokens, seed=seed,
                                                          bundle_id="bench-tui")
    gen = torch.Generator().manual_seed(seed + 1)
    n = long_tokens
    old = -torch.rand(n, generator=gen) * 3
    segment = {
        "old_log_probs": old,
        "log_probs": old + (torch.rand(n, generator=gen) - 0.5) * 0.6,
        "entropy": torch.rand(n, generator=gen) * 2,
        "ref_log_probs": old + (torch.rand(n, generator=gen) - 0.5) * 0.4,
    }
    mask = (torch.rand(n, generator=gen) < 0.9).to(torch.int64)
    start = long_index * tokens
    for name, seg in segment.items():
        t = payloads[name]
        payloads[name] = torch.cat([t[:start], seg, t[start + tokens:]])
    records = list(index.samples)
    records[long_index] = msgspec.structs.replace(records[long_index], response_length=n, total_length=n + 32,
                                                  loss_mask=mask.tolist())
    index = msgspec.structs.replace(index, samples=records)
    cfg = index.config
    lengths = torch.tensor([s.response_length for s in records], dtype=torch.int64)
    rewards = torch.tensor(expected["reward.post_process"]["rewards"], dtype=torch.float32)
    payloads["advantages"] = get_grpo_returns(rewards, lengths)
    kl = rollout_kl(payloads["old_log_probs"], payloads["ref_log_probs"], cfg.kl_coef, cfg.kl_loss_type)
    flat_mask = torch.tensor([m for s in records for m in s.loss_mask], dtype=torch.float32)
    fields = policy_loss_fields(payloads["log_probs"], payloads["old_log_probs"], payloads["advantages"],
                                payloads["entropy"], flat_mask, lengths, eps_clip=cfg.eps_clip,
                                eps_clip_high=cfg.eps_clip_high, entropy_coef=cfg.entropy_coef)
    expected["loss.policy"] = {k: float(v) for k, v in fields.items()}
    for off in DIVERGENT_OFFSETS:
        kl[start + off] += KL_DELTA
    payloads["kl"] = kl
    write_bundle(path, manifest, index, expected, payloads)
    return path, records[long_index].sample_id


QUIET_S = 0.3
# (wall, CPU of its own thread) of each replay worker run inside the app: verify, replay and model, as the first
# frame waits for them
WORKER_RUNS: list[tuple[float, float]] = []


def timed_app(path: Path):
    """The app, recording each update it writes to the terminal (Textual's one write path,
    ``App._display``) with its wall and process-CPU time. Keeping the update costs nothing: its strips
    are immutable; what each frame showed is worked out after the run (:func:`last_change`)."""
    from replay_tui.app import ReplayApp

    class TimedApp(ReplayApp):
        frames: list[tuple[float, float, object]] = []

        def _display(self, screen, renderable) -> None:
            self.frames.append((time.perf_counter(), time.process_time(), renderable))
            super()._display(screen, renderable)

        def _verify_replay_model(self, run, progress):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return super()._verify_replay_model(run, progress)
            finally:
                WORKER_RUNS.append((time.perf_counter() - t, time.thread_time() - c))

    return TimedApp(path)


def pictures(updates, size: tuple[int, int]):
    """What the terminal shows after each update: the updates replayed onto a grid of (character,
    style) cells (cursor moves and text, as a terminal would apply them)."""
    from rich.cells import cell_len
    from rich.console import Console
    from rich.segment import ControlType

    width, height = size
    console = Console(width=width, height=height, file=open(os.devnull, "w"))
    grid = [[(" ", None)] * width for _ in range(height)]
    for update in updates:
        if update is not None:
            x = y = 0
            for seg in update.__rich_console__(console, console.options):
                if seg.control:
                    for control in seg.control:
                        if control[0] == ControlType.CURSOR_MOVE_TO:
                            x, y = control[1], control[2]
                    continue
                if seg.text == "\n":
                    continue  # every update moves the cursor before each run of cells
                for ch in seg.text:
                    if 0 <= y < height and 0 <= x < width:
                        grid[y][x] = (ch, seg.style)
                    x += cell_len(ch)
        yield tuple(tuple(row) for row in grid)


def last_change(frames, size) -> int:
    """Index of the frame after which the picture never changed again: the first complete frame. (Later
    frames re-render without visible change: Textual lays the screen out again once every widget has
    its size, and again on the terminal's first resize event.)"""
    last, previous = 0, None
    for i, picture in enumerate(pictures([f[2] for f in frames], size)):
        if picture != previous:
            last, previous = i, picture
    return last


async def first_frame(path: Path, sample_id: str, offset: int) -> tuple[float, float]:
    """(wall, CPU of the whole process, worker thread included) from ``ReplayApp(path)`` to the first
    complete frame: the frame that put the final picture on the terminal (the result on every pane and
    the keys in the key bar), found by replaying every frame written until the screen has been quiet
    for ``QUIET_S``."""
    t0, c0 = time.perf_counter(), time.process_time()
    app = timed_app(path)
    app.frames = []
    async with app.run_test(size=SIZE) as pilot:
        await app.wait_settled(pilot)
        screen = app.debugger
        assert screen.sample_id == sample_id and screen.diff_view.row_count > 0, (screen.sample_id, sample_id)
        assert screen.diff_cursor == offset, screen.diff_cursor
        while True:
            seen = len(app.frames)
            await asyncio.sleep(QUIET_S)
            await pilot.pause()
            if len(app.frames) == seen:
                break
        assert app.query_one("KeyBar").items, "the key bar never showed its keys"
        final = "\n".join(strip.text for strip in app.screen._compositor.render_strips())
    frames = list(app.frames)
    i = last_change(frames, SIZE)
    shown = "\n".join("".join(ch for ch, _ in row) for row in list(pictures([f[2] for f in frames], SIZE))[-1])
    assert shown == final, "the replayed frames do not add up to the screen"
    wall, cpu, _ = frames[i]
    return wall - t0, cpu - c0


def worker_parts(path: Path, reps: int) -> dict[str, float]:
    """Medians (ms) of what the replay worker does, outside the app and back to back (warm caches), with the
    collector paused as the app's worker pauses it: verify, replay, build the model."""
    from replay_lib.bundle import open_bundle
    from replay_lib.bundle.gcpause import gc_paused
    from replay_lib.run.runner import replay_run
    from replay_tui.model import build_model

    parts: dict[str, list[float]] = {"verify (open_bundle)": [], "replay (replay_run)": [], "model (build_model)": []}
    for _ in range(reps):
        with gc_paused():
            t0 = time.perf_counter()
            bundles = open_bundle(path)
            t1 = time.perf_counter()
            report, contexts = replay_run(bundles)
            t2 = time.perf_counter()
            build_model(bundles, report, contexts=contexts)
            t3 = time.perf_counter()
        for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
            parts[key].append(dt)
    return {k: ms(v) for k, v in parts.items()}


async def cursor_moves(path: Path, sample_id: str, moves: int) -> dict[str, list[float]]:
    from replay_tui.app import ReplayApp

    app = ReplayApp(path)
    out: dict[str, list[float]] = {"move": [], "floor": [], "move_cpu": [], "floor_cpu": []}
    async with app.run_test(size=SIZE) as pilot:
        await app.wait_settled(pilot)
        view = app.debugger.diff_view
        assert app.debugger.sample_id == sample_id and view.row_count > 30000, view.row_count
        start = view.cursor
        for i in range(moves):
            key = "down" if i < moves // 2 else "up"
            for kind, k in (("move", key), ("floor", FLOOR_KEY)):
                t, c = time.perf_counter(), time.process_time()
                await pilot.press(k)
                await pilot.pause()
                out[kind].append(time.perf_counter() - t)
                out[kind + "_cpu"].append(time.process_time() - c)
        assert view.cursor == start, (view.cursor, start)  # every move happened
        # the move's cost includes the why strip (the token's inputs) and the error plot, both on screen
        why = app.debugger.diff_panel.why_strip
        assert why.region.height >= 2 and why.text_lines()[0].startswith(f"why {sample_id}@{start} "), why.text_lines()
        assert app.debugger.query_one("ErrorStrip").region.height >= 2
    return out


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


async def run(args) -> int:
    if not args.stock_pilot:
        import textual._wait as wait

        wait.SLEEP_GRANULARITY = 0.002
        wait.SLEEP_IDLE = wait.SLEEP_GRANULARITY / 20
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-tui-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        demo = root / "pr65-buggy"
        large = root / "large"
        if not demo.exists():
            write_pr65(demo, buggy=True)
        t = time.perf_counter()
        if large.exists():
            shutil.rmtree(large)
        _, long_id = build_large(large, samples=args.samples, tokens=16, long_tokens=args.long_tokens,
                                 long_index=args.samples // 3)
        print(f"built {args.samples} samples (one of {args.long_tokens} tokens: {long_id}) in "
              f"{time.perf_counter() - t:.1f} s under {root}")

        await first_frame(demo, "s-0", 0)  # warm-up: imports, CSS parsing
        demo_t, large_t, in_app = [], [], []
        for _ in range(args.reps):
            # every start from a collected heap, as in a fresh replay-tui: the apps before left their garbage
            # (a few MB a run) for a full collection that may come at any time, mid-measurement included
            gc.collect()
            demo_t.append(await first_frame(demo, "s-0", 0))
            gc.collect()
            WORKER_RUNS.clear()
            large_t.append(await first_frame(large, long_id, DIVERGENT_OFFSETS[0]))
            in_app += WORKER_RUNS
        for name, runs in (("demo ", demo_t), ("large", large_t)):
            print(f"first frame  {name} median {ms([w for w, _ in runs]):7.1f} ms wall, "
                  f"{ms([c for _, c in runs]):7.1f} ms cpu  ({', '.join(f'{w * 1000:.0f}' for w, _ in runs)})")
        ratio = ms([w for w, _ in large_t]) / ms([w for w, _ in demo_t])
        cpu_ratio = ms([c for _, c in large_t]) / ms([c for _, c in demo_t])
        print(f"  worker large in the app (the first frame waits for it): {ms([w for w, _ in in_app]):.0f} ms wall, "
              f"{ms([c for _, c in in_app]):.0f} ms CPU of its thread")
        for name, path in (("demo ", demo), ("large", large)):
            parts = worker_parts(path, args.reps)
            print(f"  worker {name} back to back " + ", ".join(f"{k} {v:.0f} ms" for k, v in parts.items()))
        fastest = min(w for w, _ in large_t) / min(w for w, _ in demo_t)
        paired = statistics.median(lw / dw for (dw, _), (lw, _) in zip(demo_t, large_t))
        # The verdict is on the pairs: each large start is divided by the demo start just before it, so both
        # ran in the same state of the host (which switches between a fast and a slow one); the ratio of the
        # two medians can divide a slow-state median by a fast-state one.
        ok_frame = paired <= FIRST_FRAME_LIMIT
        print(f"{'PASS' if ok_frame else 'FAIL'}  first frame large/demo = {paired:.2f}, the median of the "
              f"{len(demo_t)} paired ratios (≤ {FIRST_FRAME_LIMIT}); ratio of the medians {ratio:.2f} wall, "
              f"{cpu_ratio:.2f} cpu; fastest/fastest {fastest:.2f}")
        # What the large step costs above the demo's frame, in ms (the ratio's numerator less its denominator): the
        # ratio also moves with the demo's own frame: every UI speed-up shortens it, and so does a faster host.
        extra = statistics.median(lw - dw for (dw, _), (lw, _) in zip(demo_t, large_t)) * 1000
        print(f"  large − demo = {extra:.1f} ms, the median of the paired differences; the bound allows "
              f"{(FIRST_FRAME_LIMIT - 1) * ms([w for w, _ in demo_t]):.1f} ms at this demo frame")

        m = await cursor_moves(large, long_id, args.moves)
        cost = ms(m["move"]) - ms(m["floor"])
        print(f"cursor move  press+pause median {ms(m['move']):6.1f} ms (cpu {ms(m['move_cpu']):5.1f} ms) over "
              f"{len(m['move'])} moves on a {args.long_tokens}-token sample")
        print(f"pilot floor  press+pause median {ms(m['floor']):6.1f} ms (cpu {ms(m['floor_cpu']):5.1f} ms), "
              f"unbound key, same app")
        ok_move = cost <= MOVE_LIMIT_MS
        print(f"{'PASS' if ok_move else 'FAIL'}  cursor move above the floor = {cost:.1f} ms (≤ {MOVE_LIMIT_MS:g} ms), "
              f"why strip and error plot on; move/floor ratio {ms(m['move']) / ms(m['floor']):.2f}; "
              f"raw median {ms(m['move']):.1f} ms")
        return 0 if ok_frame and ok_move else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--long-tokens", type=int, default=32768)
    p.add_argument("--reps", type=int, default=31)
    p.add_argument("--moves", type=int, default=100)
    p.add_argument("--keep", metavar="DIR", help="build (or reuse) the bundles in DIR and keep them")
    p.add_argument("--stock-pilot", action="store_true", help="keep Pilot's default 20 ms idle granularity")
    args = p.parse_args()
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
