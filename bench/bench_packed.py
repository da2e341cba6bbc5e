"""Format 1.3.0 (packed masks, safetensors payloads) against 1.1.0 (JSON masks, ``.pt``), per size: ``inspect`` ≤ 1 s
and ``replay --sample ONE`` ≤ 0.2× a full replay of the same bundle, each beside the floor measured in the same run
(a process that imports torch and reads + sha256-hashes every payload file).

    python bench/bench_packed.py --sizes 256x8192,1024x16384 --reps 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import FLOOR_CODE, cli_cmd, measure, report, workdir  # noqa: E402

BUILD = (
    "import sys\n"
    "from replay_lib.demo import write_synthetic\n"
    "write_synthetic(sys.argv[1], samples=int(sys.argv[2]), tokens=int(sys.argv[3]), kl_coef=0.0,\n"
    "                bundle_id=sys.argv[4], format_version=sys.argv[5])\n"
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="256x8192", help="SAMPLESxTOKENS, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--versions", default="1.1.0,1.3.0", help="formats to compare (1.3.0 is checked)")
    args = ap.parse_args(argv)
    checks = []
    with workdir(args.keep, "bench-packed-") as root:
        for size in args.sizes.split(","):
            samples, tokens = (int(x) for x in size.lower().split("x"))
            cmds = {}
            versions = args.versions.split(",")
            for version in versions:
                path = root / f"b{samples}x{tokens}-{version}"
                if not path.exists():
                    t0 = time.perf_counter()
                    subprocess.run([sys.executable, "-c", BUILD, str(path), str(samples), str(tokens), path.name,
                                    version], check=True)
                    print(f"built {path.name} in {time.perf_counter() - t0:.1f} s")
                payloads = sorted(str(p) for p in (path / "payloads").iterdir())
                index = (path / "index.json").stat().st_size
                print(f"{path.name}: index.json {index / 2**20:.1f} MiB, payloads "
                      f"{sum(Path(p).stat().st_size for p in payloads) / 2**20:.1f} MiB")
                cmds[f"{version} floor"] = [sys.executable, "-c", FLOOR_CODE, *payloads, str(path / "index.json")]
                cmds[f"{version} inspect"] = [*cli_cmd("inspect"), str(path)]
                cmds[f"{version} replay"] = [*cli_cmd("replay"), str(path)]
                cmds[f"{version} replay --sample"] = [*cli_cmd("replay"), str(path), "--sample", "s-3"]
            print(f"== {samples}×{tokens}")
            wall, _, _ = measure(cmds, args.reps)
            for version in versions:
                ratio = wall[f"{version} replay --sample"] / wall[f"{version} replay"]
                print(f"  {version}: replay {wall[f'{version} replay'] / wall[f'{version} floor']:.2f}× floor, "
                      f"--sample {ratio:.3f}× replay, inspect {wall[f'{version} inspect']:.2f} s")
            new = "1.3.0"
            checks.append((f"{samples}×{tokens} (1.3.0): inspect {wall[f'{new} inspect']:.2f} s ≤ 1 s",
                           wall[f"{new} inspect"] <= 1.0))
            ratio = wall[f"{new} replay --sample"] / wall[f"{new} replay"]
            checks.append((f"{samples}×{tokens} (1.3.0): replay --sample {ratio:.3f}× a full replay ≤ 0.2×",
                           ratio <= 0.2))
    return report(checks)


if __name__ == "__main__":
    sys.exit(main())
