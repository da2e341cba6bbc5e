"""Framework configurations → ``RecomputeConfig`` (SPEC §8).

One module per framework turns that framework's own configuration object into the knobs the replay
recomputes, with the defaults the framework encodes (each cited by source file and line in its module).
A setting whose math the replay cannot recompute, or a key the mapping does not know whose value could change
the math, is refused by name (:class:`~replay_lib.errors.UnsupportedFrameworkConfig`, exit 4) — never mapped
to a silent default. ``from_trl`` lives in ``trl.py`` and is imported on first use.
"""

from __future__ import annotations

from typing import Any, Callable

from .nemo_rl import from_nemo_rl
from .openrlhf import from_openrlhf
from .skyrl import from_skyrl
from .slime import from_slime
from .verl import from_verl

__all__ = ["FRAMEWORKS", "from_nemo_rl", "from_openrlhf", "from_skyrl", "from_slime", "from_trl", "from_verl",
           "mapping"]


def __getattr__(name: str) -> Any:
    if name == "from_trl":  # written beside this package; imported lazily so the others work without it
        from .trl import from_trl

        return from_trl
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# CLI names → the mapping's module attribute (``trajectory-replay config FRAMEWORK FILE``).
FRAMEWORKS = {"verl": "from_verl", "slime": "from_slime", "trl": "from_trl", "skyrl": "from_skyrl",
              "nemo-rl": "from_nemo_rl", "openrlhf": "from_openrlhf"}


def mapping(framework: str) -> Callable[..., Any]:
    """The ``from_*`` function of a framework's CLI name (``KeyError`` for another name; ``ImportError`` when
    the TRL mapping is not installed)."""
    import importlib

    name = FRAMEWORKS[framework]
    module = importlib.import_module(f".{name[len('from_'):]}", __name__)
    return getattr(module, name)
