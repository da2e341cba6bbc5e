"""Format 1.3.0 (packed masks, safetensors payloads) against 1.1.0 (JSON masks, ``.pt``), per size: ``inspect`` ≤ 1 s
and ``replay --sample ONE`` ≤ 0.2× a full replay of the same bundle, each beside the floor measured in the same run
(a process that imports torch and reads + sha256-hashes every payload file). Also printed: the ratio of what each
replay takes beyond a process that only imports torch (``torch import``): the part of ``--sample``'s time that
depends on the bundle.

``--sample`` verifies only the chunks its rows are read from (per-chunk checksums, SPEC §2.3); the 1.3.0 bundle is
also measured as ``1.3.0-whole``, the same files with the manifest's chunk lists taken out (payloads hard-linked,
the JSON checksums recomputed): a selected replay then verifies every payload whole, as before the chunk lists.
``--bundle PATH`` measures an existing 1.3.0 bundle instead of building one (read only; its ``-whole`` copy is
made beside ``--keep`` or in a temporary directory, payloads hard-linked when on the same file system).

    python bench/bench_packed.py --sizes 256x8192,1024x16384 --reps 3
    python bench/bench_packed.py --bundle /tmp/part-134 --versions 1.3.0 --sample s-17 --reps 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import FLOOR_CODE, QUICK_TORCH_CODE, cli_cmd, measure, report, workdir  # noqa: E402

BUILD = (
    "import sys\n"
    "from replay_lib.demo import write_synthetic\n"
    "write_synthetic(sys.argv[1], samples=int(sys.argv[2]), tokens=int(sys.argv[3]), kl_coef=0.0,\n"
    "                bundle_id=sys.argv[4], format_version=sys.argv[5])\n"
)


def without_chunk_lists(src: Path, dst: Path) -> Path:
    """``src`` as it would be without per-chunk checksums: payloads hard-linked (copied across file systems),
    manifest.json without ``chunks``, the JSON checksums in the sentinels recomputed. ``src`` is only read."""
    if dst.exists():
        return dst
    (dst / "payloads").mkdir(parents=True)
    for f in (src / "payloads").iterdir():
        try:
            os.link(f, dst / "payloads" / f.name)
        except OSError:
            shutil.copyfile(f, dst / "payloads" / f.name)
    manifest = json.loads((src / "manifest.json").read_bytes())
    for spec in manifest["payloads"].values():
        spec.pop("chunks", None)
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    for name in ("index.json", "expected.json"):
        shutil.copyfile(src / name, dst / name)
    metadata = {name: hashlib.sha256((dst / name).read_bytes()).hexdigest()
                for name in ("manifest.json", "index.json", "expected.json")}
    for sentinel in src.glob("COMPLETE*"):
        doc = json.loads(sentinel.read_bytes())
        doc["metadata"] = metadata
        (dst / sentinel.name).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return dst


# A process that imports torch and ends as the read-only commands end (os._exit): the least any replay costs.
TORCH_IMPORT = [sys.executable, "-c", QUICK_TORCH_CODE]


def commands(path: Path, sample: str) -> dict[str, list[str]]:
    payloads = sorted(str(p) for p in (path / "payloads").iterdir())
    index = (path / "index.json").stat().st_size
    print(f"{path.name}: index.json {index / 2**20:.1f} MiB, payloads "
          f"{sum(Path(p).stat().st_size for p in payloads) / 2**20:.1f} MiB")
    return {"floor": [sys.executable, "-c", FLOOR_CODE, *payloads, str(path / "index.json")],
            "inspect": [*cli_cmd("inspect"), str(path)],
            "replay": [*cli_cmd("replay"), str(path)],
            "replay --sample": [*cli_cmd("replay"), str(path), "--sample", sample]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="256x8192", help="SAMPLESxTOKENS, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--versions", default="1.1.0,1.3.0", help="formats to compare (1.3.0 is checked)")
    ap.add_argument("--bundle", type=Path, action="append", default=[],
                    help="an existing 1.3.0 bundle to measure (instead of --sizes; never written to)")
    ap.add_argument("--sample", default="s-3", help="the sample of replay --sample")
    args = ap.parse_args(argv)
    checks = []
    with workdir(args.keep, "bench-packed-") as root:
        for bundle in args.bundle:
            cmds = {f"1.3.0 {k}": v for k, v in commands(bundle, args.sample).items()}
            whole = without_chunk_lists(bundle, root / f"{bundle.name}-whole")
            cmds["1.3.0-whole replay --sample"] = commands(whole, args.sample)["replay --sample"]
            cmds["torch import"] = TORCH_IMPORT
            print(f"== {bundle}")
            wall, _, _ = measure(cmds, args.reps)
            checks += _sample_checks(bundle.name, wall)
            shutil.rmtree(whole)
        for size in ([] if args.bundle else args.sizes.split(",")):
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
                cmds.update({f"{version} {k}": v for k, v in commands(path, args.sample).items()})
                if version == "1.3.0":
                    whole = without_chunk_lists(path, root / f"{path.name}-whole")
                    cmds["1.3.0-whole replay --sample"] = commands(whole, args.sample)["replay --sample"]
            cmds["torch import"] = TORCH_IMPORT
            print(f"== {samples}×{tokens}")
            wall, _, _ = measure(cmds, args.reps)
            for version in versions:
                ratio = wall[f"{version} replay --sample"] / wall[f"{version} replay"]
                print(f"  {version}: replay {wall[f'{version} replay'] / wall[f'{version} floor']:.2f}× floor, "
                      f"--sample {ratio:.3f}× replay, inspect {wall[f'{version} inspect']:.2f} s")
            if "1.3.0" in versions:
                checks += _sample_checks(f"{samples}×{tokens}", wall)
    return report(checks)


def _sample_checks(name: str, wall: dict) -> list[tuple[str, bool]]:
    new = "1.3.0"
    ratio = wall[f"{new} replay --sample"] / wall[f"{new} replay"]
    whole = wall.get(f"{new}-whole replay --sample")
    if whole is not None:
        print(f"  {new}: --sample {wall[f'{new} replay --sample']:.2f} s with chunk lists, {whole:.2f} s verifying "
              f"every payload whole ({whole / wall[f'{new} replay']:.3f}× replay)")
    torch_s = wall.get("torch import")
    if torch_s is not None:  # what every replay process pays before it reads a byte
        beyond = (wall[f"{new} replay --sample"] - torch_s) / (wall[f"{new} replay"] - torch_s)
        print(f"  {new}: beyond the {torch_s:.2f} s of a process that imports torch and ends (os._exit, as replay "
              f"ends): --sample {beyond:.3f}× a full replay")
    return [(f"{name} (1.3.0): inspect {wall[f'{new} inspect']:.2f} s ≤ 1 s", wall[f"{new} inspect"] <= 1.0),
            (f"{name} (1.3.0): replay --sample {ratio:.3f}× a full replay ≤ 0.2×", ratio <= 0.2)]


if __name__ == "__main__":
    sys.exit(main())
