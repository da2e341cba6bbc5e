"""The shipped demo bundles and the synthetic bundles of the benchmarks (``trajectory-replay demo``).

* ``catalog`` — the demo names (no torch: ``--help`` lists them);
* ``bundles`` — what writes them (loaded on first use of any name of this package, e.g.
  ``replay_lib.demo.write_pr65``).

A top room: it uses ``bundle`` and ``kernels`` to produce bundles, and nothing imports it but the CLI, tests and
benchmarks.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    bundles = importlib.import_module(".bundles", __name__)
    return getattr(bundles, name)
