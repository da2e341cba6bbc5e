"""Peak memory of the readers of foreign input against the input's size (SPEC §11: within 3×).

    python bench/bench_foreign_memory.py [--mb 60] [--keep DIR]

Writes, streaming (the bench stays small), inputs of about ``--mb`` MB:

- ``train_data_step1.jsonl``: NeMo-RL GRPO rows (1,024-token padded rows, 16-sample groups, float64 log-probs
  as Python's json writes them), imported with ``trajectory-replay import nemo-rl``;
- ``config (list)`` / ``config (keys)``: a verl config whose bulk is one long list of floats / many short keys in
  a neutral section; ``yaml (keys)``: the same keys as YAML. At this size each holds more than
  ``MAX_CONFIG_NODES`` keys and values and is refused (exit 3): measured is the refusal;
- the rows marked ``@``: the same shapes with exactly ``MAX_CONFIG_NODES`` keys and values (1-2 MB), mapped;

then runs each command as a fresh process, and the same command on a tiny input of the same shape (the
baseline: the interpreter, torch and the tool's modules). Peak RSS comes from ``os.wait4``. Reported per
input: peak, baseline, and (peak − baseline) / input bytes, the memory the input itself costs; target ≤ 3, or at
the bound (where a key's Python objects alone outweigh 3× its text) the absolute ``BOUND_BUDGET``.
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
from typing import Optional

TARGET = 3.0
ROW = 1024
MAX_CONFIG_NODES = 100_000  # replay_lib.bundle.json_limits (not imported: the bench measures the CLI only)
# A config at the node bound is ~1-2 MB: its decoded keys alone take more than 3× that (a key and its value cost
# Python ~150 bytes; PyYAML's node graph ~550 bytes a node), so there the target is absolute — what the bound
# lets a config cost: 16 MiB for JSON, 64 MiB for YAML.
BOUND_BUDGET = {".json": 16 << 20, ".yaml": 64 << 20}


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


def write_config(path: Path, target_bytes: int, shape: str, nodes: Optional[int] = None) -> int:
    """A verl config of about ``target_bytes`` whose bulk is one long list of floats (``list``) or many short keys
    (``keys``) under ``trainer.bulk``; with ``nodes``, exactly that many keys and values instead (the header
    holds 15)."""
    rng = random.Random(1)
    budget = None if nodes is None else nodes - 15

    def more(written: int) -> bool:  # room for one more item
        return fh.tell() < target_bytes if budget is None else written + (1 if shape == "list" else 2) <= budget

    with path.open("w") as fh:
        fh.write('{"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"actor": {"clip_ratio_high": 0.28}},'
                 ' "trainer": {"bulk": ')
        fh.write("[" if shape == "list" else "{")
        k = 0
        while more(k if shape == "list" else 2 * k) or k == 0:
            items = []
            while len(items) < 1000 and (more((k + len(items)) * (1 if shape == "list" else 2)) or k + len(items) == 0):
                i = k + len(items)
                items.append(repr(rng.random()) if shape == "list" else f'"key_{i:08d}": "v{i % 1000}"')
            fh.write(("" if k == 0 else ", ") + ", ".join(items))
            k += len(items)
        fh.write("]" if shape == "list" else "}")
        fh.write("}}")
    return path.stat().st_size


def write_yaml(path: Path, target_bytes: int, nodes: Optional[int] = None) -> int:
    """A verl YAML config of about ``target_bytes`` whose bulk is many short keys under ``trainer.bulk``; with
    ``nodes``, exactly that many keys and values (the header holds 15)."""
    pairs = None if nodes is None else (nodes - 15) // 2
    with path.open("w") as fh:
        fh.write("algorithm:\n  adv_estimator: grpo\nactor_rollout_ref:\n  actor:\n    clip_ratio_high: 0.28\n"
                 "trainer:\n  bulk:\n")
        k = 0
        while (fh.tell() < target_bytes if pairs is None else k < pairs) or k == 0:
            n = 1000 if pairs is None else min(1000, pairs - k)
            fh.write("".join(f"    key_{k + i:08d}: v{i}\n" for i in range(max(n, 1))))
            k += max(n, 1)
    return path.stat().st_size


def peak_rss(cmd: list[str], expect: int = 0) -> int:
    """Peak RSS in bytes of ``cmd`` as a fresh child (``os.wait4``); the command must exit with ``expect``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != expect:
        raise SystemExit(f"{' '.join(cmd)} exited {os.waitstatus_to_exitcode(status)}, not {expect}: {err.strip()}")
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
        config = lambda p, o: [*cli(), "config", "verl", str(p)]  # noqa: E731
        bound = lambda b: MAX_CONFIG_NODES if b is None else None  # noqa: E731  (the big input of a "@" row)
        for name, write, size, command, expect in (
            ("import nemo-rl", write_nemo, big, lambda p, o: [*cli(), "import", "nemo-rl", str(p), "-o", str(o)], 0),
            # over MAX_CONFIG_NODES at this size: refused (exit 3) before decoding — the memory of the refusal
            ("config (list)", lambda p, b: write_config(p, b, "list"), big, config, 3),
            ("config (keys)", lambda p, b: write_config(p, b, "keys"), big, config, 3),
            ("yaml (keys)", lambda p, b: write_yaml(p, b), big, config, 3),
            # exactly MAX_CONFIG_NODES keys and values: mapped
            ("config (list) @", lambda p, b: write_config(p, b or 0, "list", bound(b)), None, config, 0),
            ("config (keys) @", lambda p, b: write_config(p, b or 0, "keys", bound(b)), None, config, 0),
            ("yaml (keys) @", lambda p, b: write_yaml(p, b or 0, bound(b)), None, config, 0),
        ):
            tag = name.replace(" ", "-").replace("(", "").replace(")", "").replace("@", "bound")
            suffix = ".jsonl" if "nemo" in name else ".yaml" if "yaml" in name else ".json"
            stem = "train_data_step1" if "nemo" in name else tag
            inputs = {}
            for size_name, n in (("tiny", 0), ("big", size)):
                d = root / f"{tag}-{size_name}"
                d.mkdir(exist_ok=True)
                p = d / f"{stem}{suffix}"
                inputs[size_name] = (p, write(p, n), d / "out")
            rss = {}
            for size_name, (p, _, out) in inputs.items():
                shutil.rmtree(out, ignore_errors=True)
                rss[size_name] = peak_rss(command(p, out), expect if size_name == "big" else 0)
            size_bytes = inputs["big"][1]
            above = rss["big"] - rss["tiny"]
            ratio = above / size_bytes
            budget = BOUND_BUDGET[suffix] if size is None else None
            ok = ratio <= TARGET or (budget is not None and above <= budget)
            failed |= not ok
            cases.append((name, size_bytes, rss["big"], rss["tiny"], ratio, ok, expect, budget))
        print(f"{'input':<16} {'bytes':>12} {'peak RSS':>12} {'baseline':>12} {'(peak-base)/input':>18}")
        for name, size, peak, base, ratio, ok, expect, budget in cases:
            print(f"{name:<16} {size:>12,} {peak:>12,} {base:>12,} {ratio:>17.2f}×  {'PASS' if ok else 'FAIL'} "
                  f"(≤ {TARGET}×{' or ≤ %d MiB at the bound' % (budget >> 20) if budget else ''}; "
                  f"{(peak - base) / 2**20:.1f} MiB above the baseline; exit {expect})")
        print("@: exactly MAX_CONFIG_NODES keys and values; the other config inputs are over it and refused (exit 3)")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
