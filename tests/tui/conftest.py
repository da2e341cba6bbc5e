"""Fixtures for the Textual debugger: deterministic bundles and an app factory.

Snapshots must not depend on the machine: colours on (NO_COLOR popped), no animations, a fixed producer
(no torch version on screen), and only bundle basenames are displayed (paths differ per run)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.pop("NO_COLOR", None)
os.environ["TEXTUAL_ANIMATIONS"] = "none"

import torch  # noqa: E402

from tui_bundles import write_all  # noqa: E402


@pytest.fixture(scope="session")
def bundles(tmp_path_factory) -> Path:
    """Every bundle the TUI tests open, written once per session under fixed names."""
    return write_all(tmp_path_factory.mktemp("tui-bundles"))


@pytest.fixture
def make_app(bundles):
    """``make_app("pr65-buggy", **kwargs)`` → a fresh :class:`ReplayApp` on that bundle."""
    from replay_tui.app import ReplayApp

    def factory(name: str, **kwargs) -> ReplayApp:
        return ReplayApp(bundles / name, **kwargs)

    return factory


@pytest.fixture(autouse=True)
def _torch_threads():
    # The machine is shared: the replay worker needs no intra-op parallelism for these tiny bundles.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
