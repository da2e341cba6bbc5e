"""Deprecated: ``replay_lib.report`` moved to :mod:`replay_lib.judge.report` (see docs/ARCHITECTURE.md).

This thin re-export keeps old imports working through the 0.1 series and is removed in 0.2.0; import from
``replay_lib.judge.report`` instead. Nothing inside the project imports it (tests/test_architecture.py).
"""

import warnings as _warnings

from .judge import report as _moved
from .judge.report import *  # noqa: F401,F403  (the moved module's public names)

_warnings.warn("replay_lib.report is deprecated: import replay_lib.judge.report (removed in 0.2.0)", DeprecationWarning,
               stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)
