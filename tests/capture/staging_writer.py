"""Stage bundles with the real ``BundleWriter`` and then die, or wait and publish them.

Usage: python staging_writer.py DIR die|wait BUNDLE[:RANK] …

Each ``BUNDLE`` (a path relative to ``DIR``; its last component is the bundle id) is staged with its
payloads written: in ``DIR/.BUNDLE.tmp-<pid>-<hex>``, or with ``BUNDLE:RANK`` as rank ``RANK`` of a
two-rank cohort, in ``DIR/BUNDLE/.rank-RANK.tmp-<pid>-<hex>``. Then ``die`` SIGKILLs this process —
a writer killed mid-write, whose staging stays behind — and ``wait`` prints one line per staging directory,
then ``staged``, waits for a line on stdin and publishes every bundle (a live writer that must not lose its
staging meanwhile).
"""

import os
import signal
import sys
from pathlib import Path

from replay_lib.bundle import BundleWriter
from replay_lib.demo import synthetic_parts


def stage(directory: Path, spec: str) -> BundleWriter:
    name, _, rank = spec.partition(":")
    manifest, index, expected, payloads = synthetic_parts(samples=4, tokens=4, bundle_id=Path(name).name)
    writer = BundleWriter(directory / name, manifest, index, expected, rank=int(rank) if rank else None)
    for payload, tensor in payloads.items():
        writer.write_payload(payload, tensor)
    return writer


def main(argv: list[str]) -> int:
    directory, mode, specs = Path(argv[0]), argv[1], argv[2:]
    writers = [stage(directory, spec) for spec in specs]
    if mode == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    for writer in writers:
        print(writer.staging, flush=True)
    print("staged", flush=True)
    sys.stdin.readline()
    for writer in writers:
        writer.finalize(ranks=[0] if writer.rank is None else [0, 1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
