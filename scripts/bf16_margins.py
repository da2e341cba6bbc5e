"""How far above the bound each injected bug lands on bf16 bundles, and how close a clean one comes to it.

    python scripts/bf16_margins.py [--samples 64] [--tokens 2048] [--families stored_bf16 bf16_bfloat16]

For each family of ``tests/producers`` and each bug of ``producers.BUGS`` (on the config the bug needs), one
bundle is produced and replayed; the **margin** is the largest noise ratio (|recomputed − recorded| / bound) at the
bug's stage: how many bounds the injected change is worth where it is best seen (a margin below 1 is a bug the
bound hides). The clean bundle's largest noise ratio over every stage is printed too (it must stay below 1).

``--reveal``: the smallest relative change each recorded value can carry and still be revealed, measured by
scaling it by ``1 + ε`` (ε = 1e-3, ×10 until the change dominates the stage's noise ratio) in an otherwise
clean bundle — the scalar ``pg_loss`` of loss.policy, the
per-token ``kl`` payload (advantage.kl), the per-token ``advantages`` payload (advantage.estimate) — and reading the
noise ratio ρ at its stage: a change is revealed from about ``ε/ρ`` on.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import copy  # noqa: E402

import torch  # noqa: E402
from producers import BUGS, Config, Size, bug_config, produce, produce_parts, write_parts  # noqa: E402

from replay_lib.run.runner import replay  # noqa: E402

BASE = Config(rewards="binary", std_normalization=True, kl_type="k3", kl_coef=0.05)


def worst(report, stage=None) -> float:
    ratios = [s.max_noise_ratio for s in report.stages
              if s.max_noise_ratio is not None and (stage is None or s.stage == stage)]
    return max(ratios, default=float("nan"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--families", nargs="+", default=["stored_bf16", "bf16_bfloat16"])
    ap.add_argument("--bugs", nargs="+", default=list(BUGS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reveal", action="store_true", help="the smallest revealed relative change instead")
    args = ap.parse_args(argv)
    size = Size(args.samples, args.tokens)
    rows = []
    if args.reveal:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.families:
                parts = produce_parts(name, args.seed, size, BASE)
                for what, stage in (("pg_loss", "loss.policy"), ("kl", "advantage.kl"),
                                    ("advantages", "advantage.estimate")):
                    eps, rho, k = 1e-3, 0.0, 0
                    while rho < 2 and eps <= 10:  # until the change dominates the stage's noise ratio
                        eps *= 10 if k else 1
                        k += 1
                        p = copy.copy(parts)
                        if what == "pg_loss":
                            p.expected = copy.deepcopy(parts.expected)
                            p.expected["loss.policy"]["pg_loss"] *= 1 + eps
                        else:
                            p.payloads = dict(parts.payloads)
                            t = parts.payloads[what]
                            p.payloads[what] = (t.to(torch.float64) * (1 + eps)).to(t.dtype)
                        rep = replay(write_parts(p, Path(tmp) / f"{name}-{what}-{k}"))
                        rho = worst(rep, stage)
                    rows.append({"family": name, "value": what, "size": str(size), "eps": eps, "ratio": rho,
                                 "revealed_from": eps / rho})
                    print(f"{name:16} {str(size):10} {what:11} ε={eps:g}: ratio {rho:.3g} → revealed from about "
                          f"{eps / rho:.2g} relative", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            clean = replay(produce(Path(tmp) / f"{name}-clean", name, args.seed, size, BASE))
            rows.append({"family": name, "bug": None, "exit": clean.exit_code, "ratio": worst(clean)})
            print(f"{name:16} {'clean':16} exit {clean.exit_code}  worst noise ratio {worst(clean):.3g}", flush=True)
            for bug in args.bugs:
                stage = BUGS[bug][0]
                try:
                    cfg = bug_config(bug, BASE)
                except ValueError as exc:
                    print(f"{name:16} {bug:16} skipped: {exc}")
                    continue
                rep = replay(produce(Path(tmp) / f"{name}-{bug}", name, args.seed, size, cfg, bug=bug))
                margin = worst(rep, stage)
                rows.append({"family": name, "bug": bug, "stage": stage, "exit": rep.exit_code,
                             "first": rep.first_divergent_stage, "margin": margin})
                print(f"{name:16} {bug:16} exit {rep.exit_code}  first {rep.first_divergent_stage}  "
                      f"margin at {stage}: {margin:.3g}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
