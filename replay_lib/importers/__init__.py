"""Other frameworks' debug dumps → ordinary verified bundles (SPEC §8): slime's train (+ rollout) dump and
NeMo-RL's ``train_data_step<N>.jsonl``. Dumps load with ``weights_only=True`` or as plain JSON, never unpickled.

The importers (and torch) load on first use, so building the CLI's parser stays light."""

from __future__ import annotations

from typing import Any

__all__ = ["ImportResult", "import_nemo_rl", "import_slime"]


def __getattr__(name: str) -> Any:
    if name == "import_slime":
        from .slime import import_slime

        return import_slime
    if name == "import_nemo_rl":
        from .nemo_rl import import_nemo_rl

        return import_nemo_rl
    if name == "ImportResult":
        from ._common import ImportResult

        return ImportResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
