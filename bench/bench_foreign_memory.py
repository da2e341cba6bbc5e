"""Peak memory of the readers of foreign input against the input's size (SPEC §11: within 3×).

    python bench/bench_foreign_memory.py [--mb 60] [--keep DIR]

Writes, streaming (the bench stays small), three inputs of about ``--mb`` MB:

- ``train_data_step1.jsonl``: NeMo-RL GRPO rows (1,024-token padded rows, 16-sample groups, float64 log-probs
  as Python's json writes them), imported with ``trajectory-replay import nemo-rl``;
- ``verl-list.json``: a verl config whose bulk is one long list of floats in a neutral section;
- ``verl-keys.json``: a verl config whose bulk is many short keys in a neutral section;

then runs each command as a fresh process, and the same command on a tiny input of the same shape (the
baseline: the interpreter, torch and the tool's modules). Peak RSS comes from ``os.wait4``. Reported per
input: peak, baseline, and (peak − baseline) / input bytes, the memory the input itself costs; target ≤ 3.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET = 3.0
ROW = 1024


def write_nemo(path: Path, target_bytes: int) -> int:
    rng = random.Random(0)
    n = 0
    with path.open("w") as fh:
        while fh.tell() < target_bytes or n == 0:
            prompt = [1000 + (n // 16) % 997 + t for t in range(64)]
            response = rng.randrange(64, ROW - 64)
            length = len(prompt) + response
            tokens = prompt + [rng.randrange(50_000) for _ in range(response)] + [0] * (ROW - length)
            mask = [0] * len(prompt) + [1] * response + [0] * (ROW - length)
            lp = [-rng.random() for _ in range(ROW)]
            fh.write(json.dumps({
                "content": [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]],
                "rewards": [float(rng.random() < 0.5)], "input_lengths": [length], "token_ids": [tokens],
                "token_loss_mask": [mask], "sample_loss_mask": [1.0], "advantages": [[rng.gauss(0, 1)] * ROW],
                "generation_logprobs": [lp], "prev_logprobs": [[x - 0.01 for x in lp]], "idx": n}) + "\n")
            n += 1
    return path.stat().st_size


def write_config(path: Path, target_bytes: int, shape: str) -> int:
    rng = random.Random(1)
    with path.open("w") as fh:
        fh.write('{"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"actor": {"clip_ratio_high": 0.28}},'
                 ' "trainer": {"bulk": ')
        if shape == "list":
            fh.write("[")
            first = True
            while fh.tell() < target_bytes:
                fh.write(("" if first else ", ") + ", ".join(repr(rng.random()) for _ in range(1000)))
                first = False
            fh.write("]")
        else:
            fh.write("{")
            k = 0
            while fh.tell() < target_bytes or k == 0:
                fh.write(("" if k == 0 else ", ") + ", ".join(f'"key_{k + i:08d}": "v{i}"' for i in range(1000)))
                k += 1000
            fh.write("}")
        fh.write("}}")
    return path.stat().st_size


def peak_rss(cmd: list[str]) -> int:
    """Peak RSS in bytes of ``cmd`` as a fresh child (``os.wait4``); the command must succeed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {err.strip()}")
    return usage.ru_maxrss * 1024


def cli() -> list[str]:
    exe = shutil.which("trajectory-replay")
    return [exe] if exe else [sys.executable, "-m", "replay_lib"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=60.0, help="size of each input in MB (default 60)")
    ap.add_argument("--keep", type=Path, help="write the inputs here and keep them (default: a temp dir)")
    args = ap.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-foreign-"))
    root.mkdir(parents=True, exist_ok=True)
    failed = False
    try:
        big = int(args.mb * 1e6)
        cases = []
        for name, write, small, command in (
            ("import nemo-rl", write_nemo, 1, lambda p, o: [*cli(), "import", "nemo-rl", str(p), "-o", str(o)]),
            ("config (list)", lambda p, b: write_config(p, b, "list"), 1,
             lambda p, o: [*cli(), "config", "verl", str(p)]),
            ("config (keys)", lambda p, b: write_config(p, b, "keys"), 1,
             lambda p, o: [*cli(), "config", "verl", str(p)]),
        ):
            tag = name.replace(" ", "-").replace("(", "").replace(")", "")
            suffix = ".jsonl" if "nemo" in name else ".json"
            stem = "train_data_step1" if "nemo" in name else tag
            inputs = {}
            for size_name, size in (("tiny", small), ("big", big)):
                d = root / f"{tag}-{size_name}"
                d.mkdir(exist_ok=True)
                p = d / f"{stem}{suffix}"
                inputs[size_name] = (p, write(p, size), d / "out")
            rss = {}
            for size_name, (p, _, out) in inputs.items():
                shutil.rmtree(out, ignore_errors=True)
                rss[size_name] = peak_rss(command(p, out))
            size = inputs["big"][1]
            ratio = (rss["big"] - rss["tiny"]) / size
            ok = ratio <= TARGET
            failed |= not ok
            cases.append((name, size, rss["big"], rss["tiny"], ratio, ok))
        print(f"{'input':<16} {'bytes':>12} {'peak RSS':>12} {'baseline':>12} {'(peak-base)/input':>18}")
        for name, size, peak, base, ratio, ok in cases:
            print(f"{name:<16} {size:>12,} {peak:>12,} {base:>12,} {ratio:>17.2f}×  {'PASS' if ok else 'FAIL'} "
                  f"(≤ {TARGET}×; peak/input {peak / size:.2f}×)")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
