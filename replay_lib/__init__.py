"""Trajectory Replay: verifiable offline replay of one asynchronous RL post-training step.

Headless: importing this package never imports Textual. ``replay_lib.replay(path)`` is
:func:`replay_lib.run.runner.replay`, loaded on first use (importing the package does not import torch).
The rooms of the package, bottom to top, are described in docs/ARCHITECTURE.md.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "replay":
        from .run.runner import replay

        return replay
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
