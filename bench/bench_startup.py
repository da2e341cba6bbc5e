"""Start-up: time to the first verdict of a fresh ``trajectory-replay`` process against ``python -c "import torch"``.

``validate`` and ``replay`` open (verify) the bundle while torch and the engine import on another thread, and a
bundle the checks that need no tensor refuse (a sha256 mismatch, JSON that does not decode, a missing file) is
reported without torch. Measured in one run, interleaved, each as a fresh process (the verdict is printed as the
process ends, so its wall time is the time to the first verdict):

* torch             — ``python -c "import torch"``;
* replay (serial)   — the engine imported first, then the bundle opened and replayed (the order before);
* replay            — ``trajectory-replay replay`` on the 4-sample PR #65 demo bundle;
* refused validate  — ``trajectory-replay validate`` on the same bundle with index.json altered (exit 3);
* refused replay    — ``trajectory-replay replay`` on it (exit 3).

Prints wall and CPU medians and PASS/FAIL for: refused validate / torch ≤ 0.5 and refused replay / torch ≤ 0.5
(no torch import on that path), replay / replay (serial) ≤ 1.1 (the overlap costs nothing).

    python bench/bench_startup.py [--reps 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import TORCH_CODE, cli_cmd, measure, report, workdir  # noqa: E402

REFUSED_LIMIT = 0.5
OVERLAP_LIMIT = 1.1
# The order before: torch and the engine imported, then the bundle opened (the exit code of the CLI kept).
SERIAL_CODE = (
    "import sys\n"
    "import replay_lib.run.runner\n"
    "from replay_lib.run.runner import replay\n"
    "from replay_lib.judge.report import render_text\n"
    "report = replay(sys.argv[1])\n"
    "print(render_text(report))\n"
    "sys.exit(report.exit_code)\n"
)


def exits(code: int, cmd: list[str]) -> list[str]:
    """``cmd`` run by a shell that exits 0 when it exits ``code`` (the harness stops at any other exit); every
    command is wrapped alike, so the shell's few milliseconds are in each."""
    return ["sh", "-c", f'"$0" "$@"; test $? -eq {code}', *cmd]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="write the bundles here and keep them (default: a temp dir)")
    args = ap.parse_args(argv)
    with workdir(args.keep, "bench-startup-") as root:
        import subprocess

        good = root / "pr65"
        subprocess.run([sys.executable, "-c", "import sys; from replay_lib.demo import write_demo; "
                        "write_demo('pr65-buggy', sys.argv[1])", str(good)], check=True)
        refused = root / "pr65-altered"
        subprocess.run(["cp", "-r", str(good), str(refused)], check=True)
        with open(refused / "index.json", "ab") as fh:
            fh.write(b" ")
        cmds = {
            "torch": exits(0, [sys.executable, "-c", TORCH_CODE]),
            "replay (serial)": exits(1, [sys.executable, "-c", SERIAL_CODE, str(good)]),
            "replay": exits(1, cli_cmd("replay") + [str(good)]),
            "refused validate": exits(3, cli_cmd("validate") + [str(refused)]),
            "refused replay": exits(3, cli_cmd("replay") + [str(refused)]),
        }
        med, med_cpu, _ = measure(cmds, args.reps)
        refused_v = med["refused validate"] / med["torch"]
        refused_r = med["refused replay"] / med["torch"]
        overlap = med["replay"] / med["replay (serial)"]
        checks = [
            (f"refused validate / torch = {refused_v:.2f} wall, "
             f"{med_cpu['refused validate'] / med_cpu['torch']:.2f} cpu (target ≤ {REFUSED_LIMIT})",
             refused_v <= REFUSED_LIMIT),
            (f"refused replay / torch = {refused_r:.2f} wall, "
             f"{med_cpu['refused replay'] / med_cpu['torch']:.2f} cpu (target ≤ {REFUSED_LIMIT})",
             refused_r <= REFUSED_LIMIT),
            (f"replay / replay (serial) = {overlap:.2f} wall, "
             f"{med_cpu['replay'] / med_cpu['replay (serial)']:.2f} cpu (target ≤ {OVERLAP_LIMIT}); "
             f"replay / torch = {med['replay'] / med['torch']:.2f}", overlap <= OVERLAP_LIMIT),
        ]
        return report(checks)


if __name__ == "__main__":
    sys.exit(main())
