"""Deprecated: ``replay_lib.schema`` moved to :mod:`replay_lib.bundle.schema` (see docs/ARCHITECTURE.md).

This thin re-export keeps old imports working through the 0.1 series and is removed in 0.2.0; import from
``replay_lib.bundle.schema`` instead. Nothing inside the project imports it (tests/test_architecture.py).
"""

import warnings as _warnings

from .bundle import schema as _moved
from .bundle.schema import *  # noqa: F401,F403  (the moved module's public names)

_warnings.warn("replay_lib.schema is deprecated: import replay_lib.bundle.schema (removed in 0.2.0)", DeprecationWarning,
               stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)
