"""False divergences of clean independent producers, and detection of injected bugs, by size (SPEC §5.1).

Every producer family of ``tests/producers`` (float32 ``torch.sum``, float64, Megatron micro-batches + ring
all-reduce with a CUDA-like exp, bf16 payloads in both dtypes, GPU-style trees of 256 and 1024, NumPy, bf16 copies of
float32 values) writes
clean bundles at each size for a rotation of configs (binary / partial-credit / reward-model rewards, std
normalization on and off, every KL type and KL off, entropy in and out of the loss); each is replayed in
process (``replay_lib.run.runner.replay``, every stage) and removed. Then each bug class of
``producers.bugs.BUGS`` is injected into clean families at each size.

Prints, per producer and size, ``false/clean`` divergences with the worst ``|err| / tolerance``: the report's
own ``noise_ratio`` / ``tolerance`` / ``max_noise_ratio`` when it has them (read with ``getattr``), else the
bundle's fixed ``atol + rtol·|e|`` (marked ``*``; only over the divergences the report keeps). Then, per bug
and size, ``detected/run`` (reported at the bug's own stage), with the wrong first stages named.

    python bench/bench_error_model.py [--quick] [--sizes 8x16,32x512] [--families torch_sum,numpy]
                                      [--seeds 1] [--all-configs] [--per-sample] [--no-bugs] [--tmp DIR]

``--per-sample`` writes the SPEC §4 per-sample loss terms (``$.loss.policy.per_sample``) into every bundle, as
each family reduces its samples: the replay compares them before the scalars, so a loss bug is located to a
sample, and the one-token mask shift stays visible at every size.

Targets: 0 false divergences; every bug reported at its own stage at every size up to 64 × 2,048 tokens
(larger sizes are printed: a scalar-only bug such as a one-token mask shift fades into the noise as the
per-sample means grow longer). Exit 0 when both hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from producers import BUGS, CONFIGS, FAMILIES, Size, bug_config, family, produce  # noqa: E402
from producers.bugs import visible  # noqa: E402

from replay_lib.run.runner import replay  # noqa: E402
from replay_lib.bundle.schema import Tolerance  # noqa: E402

SIZES = (Size(8, 16, group_size=4), Size(32, 512), Size(64, 2048), Size(128, 4096), Size(256, 8192),
         Size(512, 16384))
QUICK_SIZES = SIZES[:3]
# Up to here every config runs on every family and every bug on every family it is visible on; above it a
# rotation (two configs per family, one family per bug), which keeps 512 × 16,384 to about 30 bundles.
FULL_UP_TO = 64 * 2048
BUG_TARGET_UP_TO = 64 * 2048


@dataclass
class Outcome:
    passed: bool
    first_stage: Optional[str]
    worst: Optional[float]  # worst |err| / tolerance seen
    fixed_rule: bool  # worst came from the bundle's fixed atol + rtol·|e|, not the report
    seconds: float


@dataclass
class Cell:
    runs: int = 0
    hits: int = 0  # false divergences (clean) or detections (bugs)
    worst: Optional[float] = None
    fixed_rule: bool = False
    stages: dict = field(default_factory=dict)  # first divergent stage → count (of the unexpected ones)

    def add(self, hit: bool, outcome: Outcome, unexpected: Optional[str]) -> None:
        self.runs += 1
        self.hits += hit
        if unexpected is not None:
            self.stages[unexpected] = self.stages.get(unexpected, 0) + 1
        if outcome.worst is not None and (self.worst is None or outcome.worst > self.worst):
            self.worst, self.fixed_rule = outcome.worst, outcome.fixed_rule


def parse_size(text: str) -> Size:
    try:
        samples, tokens = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must be SAMPLESxTOKENS (e.g. 64x2048), got {text!r}") from None
    group = 8 if samples % 8 == 0 else 4
    if samples <= 0 or tokens <= 0 or samples % group:
        raise argparse.ArgumentTypeError(f"size {text!r}: samples must be a positive multiple of 4")
    return Size(samples, tokens, group_size=group)


def worst_ratio(report) -> tuple[Optional[float], bool]:
    """The worst ``|err| / tolerance`` the report shows: per stage ``max_noise_ratio``, per divergence
    ``noise_ratio`` or ``abs_error / tolerance`` when present; otherwise the fixed rule of the default
    ``Tolerance`` (``atol + rtol·|e|``) over the divergences it kept."""
    worst, fixed = None, False
    default = Tolerance()
    for stage in report.stages:
        ratio = getattr(stage, "max_noise_ratio", None)
        if ratio is not None:
            worst = ratio if worst is None else max(worst, ratio)
            continue
        for d in stage.divergences:
            ratio = getattr(d, "noise_ratio", None)
            if ratio is None and d.abs_error is not None:
                tol = getattr(d, "tolerance", None)
                if tol is None and d.expected is not None and math.isfinite(d.expected):
                    tol, fixed = default.atol + default.rtol * abs(d.expected), True
                if tol:
                    ratio = d.abs_error / tol
            if ratio is None and d.message is None:
                ratio = math.inf  # NaN/Inf on a side
            if ratio is not None:
                worst = ratio if worst is None else max(worst, ratio)
    return worst, fixed


def run_one(root: Path, name: str, seed: int, size: Size, config, bug=None, per_sample=False) -> Outcome:
    path = root / f"{name}-{size}-{seed}-{bug or 'clean'}"
    start = time.perf_counter()
    try:
        produce(path, name, seed, size, config, bug=bug, per_sample=per_sample)
        report = replay(path)
        worst, fixed = worst_ratio(report)
        return Outcome(report.passed, report.first_divergent_stage, worst, fixed, time.perf_counter() - start)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        gc.collect()


def configs_for(size: Size, f: int, all_configs: bool) -> list:
    if all_configs or size.samples * size.tokens <= FULL_UP_TO:
        return list(CONFIGS)
    return [CONFIGS[f % len(CONFIGS)], CONFIGS[(f + 3) % len(CONFIGS)]]


def bug_families(bug: str, families: list[str], size: Size, b: int, all_configs: bool,
                 per_sample: bool = False) -> list[str]:
    eligible = [n for n in families
                if visible(bug, family(n), per_sample=per_sample, tokens=size.samples * size.tokens)]
    if all_configs or size.samples * size.tokens <= FULL_UP_TO or not eligible:
        return eligible
    return [eligible[(b + SIZES.index(size) if size in SIZES else b) % len(eligible)]]


def fmt_cell(cell: Cell) -> str:
    if not cell.runs:
        return "-"
    text = f"{cell.hits}/{cell.runs}"
    if cell.worst is not None:
        text += f" ({cell.worst:.3g}{'*' if cell.fixed_rule else ''})"
    return text


def table(title: str, rows: dict[str, dict[str, Cell]], sizes: list[Size]) -> None:
    print(f"\n{title}")
    cols = [str(s) for s in sizes]
    width = max([len(r) for r in rows] + [8])
    cells = {r: {c: fmt_cell(rows[r].get(c, Cell())) for c in cols} for r in rows}
    colw = {c: max([len(c)] + [len(cells[r][c]) for r in rows]) for c in cols}
    print("  " + " " * width + "  " + "  ".join(f"{c:>{colw[c]}}" for c in cols))
    for r in rows:
        print(f"  {r:<{width}}  " + "  ".join(f"{cells[r][c]:>{colw[c]}}" for c in cols))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sizes up to 64x2048 only")
    ap.add_argument("--sizes", type=lambda t: [parse_size(x) for x in t.split(",")],
                    help="comma-separated SAMPLESxTOKENS (default: 8x16 … 512x16384)")
    ap.add_argument("--families", type=lambda t: t.split(","), default=list(FAMILIES),
                    help=f"comma-separated producer families (default: all of {', '.join(FAMILIES)})")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per (family, size, config)")
    ap.add_argument("--all-configs", action="store_true",
                    help="every config on every family and every bug on every family at every size")
    ap.add_argument("--per-sample", action="store_true", help="write $.loss.policy.per_sample into every bundle")
    ap.add_argument("--no-bugs", action="store_true", help="clean producers only")
    ap.add_argument("--tmp", type=Path, help="where the bundles are written (default: a temp dir)")
    args = ap.parse_args(argv)
    unknown = [n for n in args.families if n not in FAMILIES]
    if unknown:
        ap.error(f"unknown producer famil{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)} "
                 f"(expected some of {', '.join(FAMILIES)})")
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    sizes = args.sizes or list(QUICK_SIZES if args.quick else SIZES)
    root = Path(tempfile.mkdtemp(prefix="bench-error-model-", dir=args.tmp))
    clean: dict[str, dict[str, Cell]] = {n: {} for n in args.families}
    bugs: dict[str, dict[str, Cell]] = {b: {} for b in BUGS}
    wrong: list[str] = []
    try:
        for size in sizes:
            t0, count = time.perf_counter(), 0
            for f, name in enumerate(args.families):
                cell = clean[name].setdefault(str(size), Cell())
                for config in configs_for(size, f, args.all_configs):
                    for seed in range(args.seeds):
                        out = run_one(root, name, 1000 + seed, size, config, per_sample=args.per_sample)
                        cell.add(not out.passed, out, out.first_stage)
                        count += 1
                        if not out.passed:
                            print(f"  false divergence: {name} {size} {config} seed {1000 + seed}: "
                                  f"{out.first_stage} (worst {out.worst:.3g}{'*' if out.fixed_rule else ''})",
                                  file=sys.stderr)
            if not args.no_bugs:
                for b, (bug, (stage, _)) in enumerate(BUGS.items()):
                    cell = bugs[bug].setdefault(str(size), Cell())
                    for name in bug_families(bug, args.families, size, b, args.all_configs, args.per_sample):
                        config = bug_config(bug, CONFIGS[0])
                        out = run_one(root, name, 2000, size, config, bug=bug, per_sample=args.per_sample)
                        detected = out.first_stage == stage
                        cell.add(detected, out, None if detected else (out.first_stage or "pass"))
                        count += 1
                        if not detected:
                            wrong.append(f"{bug} on {name} at {size}: {out.first_stage or 'no divergence'}")
            print(f"{size}: {count} bundles in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    table("false divergences of clean bundles: false/clean (worst |err|/tolerance; * = fixed atol+rtol·|e| over "
          "the divergences kept)", clean, sizes)
    for name, row in clean.items():
        stages: dict[str, int] = {}
        for c in row.values():
            for stage, n in c.stages.items():
                stages[stage] = stages.get(stage, 0) + n
        if stages:
            print(f"  {name}: first divergent stage " + ", ".join(f"{k} ×{v}" for k, v in sorted(stages.items())))
    if not args.no_bugs:
        table("bugs reported at their own stage: detected/run (worst |err|/tolerance)", bugs, sizes)
        for line in wrong:
            print(f"  not at its stage: {line}")
    false_total = sum(c.hits for row in clean.values() for c in row.values())
    runs_total = sum(c.runs for row in clean.values() for c in row.values())
    target_sizes = {str(s) for s in sizes if s.samples * s.tokens <= BUG_TARGET_UP_TO}
    missed = [f"{bug} {s}" for bug, row in bugs.items() for s, c in row.items()
              if s in target_sizes and c.hits < c.runs]
    checks = [(f"{false_total} false divergences in {runs_total} clean bundles (target 0)", false_total == 0)]
    if not args.no_bugs:
        checks.append((f"every bug at its own stage up to {BUG_TARGET_UP_TO:,} tokens"
                       + (f" (missed: {', '.join(missed)})" if missed else ""), not missed))
    print()
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
