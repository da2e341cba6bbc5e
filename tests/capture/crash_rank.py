"""Run the example trainer, but SIGKILL this process while it publishes one chosen bundle.

Usage: python crash_rank.py BUNDLE_ID [trainer arguments…]

The kill lands inside ``BundleWriter.finalize`` — after the payloads were staged, before the rank shard
is renamed into place and before ``COMPLETE.<rank>`` exists — i.e. the rank dies before it flushes.
"""

import os
import signal
import sys
from pathlib import Path

from replay_lib.bundle import BundleWriter

target = sys.argv[1]
original = BundleWriter.finalize


def finalize_or_die(self, ranks=(0,)):
    if self.index.bundle_id == target:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, ranks)


BundleWriter.finalize = finalize_or_die

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import grpo_trainer  # noqa: E402

sys.exit(grpo_trainer.main(sys.argv[2:]))
