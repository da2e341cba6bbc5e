"""Helpers shared by the capture tests (imported by name: this directory is on sys.path under pytest)."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINER_PATH = ROOT / "examples" / "grpo_trainer.py"
GPU_SMOKE_PATH = ROOT / "examples" / "gpu_smoke.py"

# Small enough for a few seconds on a shared CPU: 2 prompts × 4 samples per rollout, consumer batches of 3
# (never aligned with the groups), 2 actor steps of 4 samples per rollout, micro-batches of 3 and 1.
TINY = [
    "--rollouts", "2", "--prompts-per-rollout", "2", "--n-samples", "4", "--consumer-batch", "3",
    "--steps-per-rollout", "2", "--micro-batch", "3", "--hidden", "16", "--embed", "8", "--quiet",
]


def load_module(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def capture_env(directory: Path, **extra: str) -> dict[str, str]:
    """A minimal environment that turns capture on (what a job would export)."""
    env = {"RELAX_REPLAY_CAPTURE": "1", "RELAX_REPLAY_CAPTURE_DIR": str(directory)}
    env.update(extra)
    return env


def subprocess_env(**extra: str) -> dict[str, str]:
    """The parent's environment without any capture or torch.distributed variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RELAX_REPLAY_CAPTURE") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                   "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bundle_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def stick_writer_on_disk(monkeypatch, timeout: float) -> tuple[threading.Event, threading.Event]:
    """Make every ``BundleWriter.write_payload`` block until released, as a stuck disk would.

    Returns ``(entered, gate)``: ``entered`` is set once a writer is stuck; ``gate.set()`` releases it.
    """
    from replay_lib.bundle import BundleWriter

    entered, gate = threading.Event(), threading.Event()
    original = BundleWriter.write_payload

    def stuck_disk(self, name, tensor):
        entered.set()
        assert gate.wait(timeout)
        return original(self, name, tensor)

    monkeypatch.setattr(BundleWriter, "write_payload", stuck_disk)
    return entered, gate
