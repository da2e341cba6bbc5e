"""Fixtures for the capture tests: the example trainer and GPU smoke script (loaded from their files)."""

from __future__ import annotations

import pytest

import capture.config
from capture_helpers import GPU_SMOKE_PATH, TRAINER_PATH, load_module


@pytest.fixture(scope="session")
def trainer():
    return load_module("grpo_trainer_example", TRAINER_PATH)


@pytest.fixture(scope="session")
def gpu_smoke():
    return load_module("gpu_smoke_example", GPU_SMOKE_PATH)


@pytest.fixture(autouse=True)
def _fresh_warn_once(monkeypatch):
    """Each test sees the "DIR unset" warning as if it were the first in the process."""
    monkeypatch.setattr(capture.config, "_warned_no_dir", False)
