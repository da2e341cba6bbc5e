"""Producer information: the code commit (if a git checkout is found) and the torch version.

Only a commit hash and a digest of uncommitted changes are stored — never a path, a diff or a remote URL.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from pathlib import Path
from typing import Optional

import msgspec
import torch

from replay_lib.bundle.schema import ProducerInfo

_GIT_TIMEOUT_S = 10.0


def _git(args: list[str], cwd: Path) -> Optional[bytes]:
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, timeout=_GIT_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def producer_info(source_dir: Optional[str | os.PathLike] = None,
                  framework: Optional[tuple[str, str]] = None) -> ProducerInfo:
    """``commit``: ``git rev-parse HEAD`` of ``source_dir`` (default: the working directory), ``""`` when
    unknown; ``dirty_patch_digest``: sha256 of ``git diff HEAD`` when the checkout has local changes;
    ``framework``: ``(name, version)`` of the training framework (an integration passes its own), recorded as
    ``framework`` / ``framework_version``.

    Looked up once per process and directory: the code a process runs does not change while it runs."""
    info = _producer_info(Path(source_dir).resolve() if source_dir is not None else Path.cwd().resolve())
    if framework is None:
        return info
    name, version = framework
    return msgspec.structs.replace(info, framework=str(name), framework_version=str(version))


@functools.lru_cache(maxsize=8)
def _producer_info(cwd: Path) -> ProducerInfo:
    commit = ""
    dirty = None
    head = _git(["rev-parse", "--verify", "HEAD"], cwd) if cwd.is_dir() else None
    if head:
        commit = head.decode("ascii", "replace").strip()
        diff = _git(["diff", "HEAD", "--binary"], cwd)
        if diff:
            dirty = hashlib.sha256(diff).hexdigest()
    return ProducerInfo(commit=commit, dirty_patch_digest=dirty, torch_version=torch.__version__)
