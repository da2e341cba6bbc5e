"""General fixtures: a freshly written demo bundle, a tamper-and-re-seal helper, a directory snapshot."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from replay_lib.cli import main
from replay_lib.demo import write_pr65

SEALED_JSON = ("manifest.json", "index.json", "expected.json")


@pytest.fixture(autouse=True)
def _default_json_caps():
    """Every test starts and ends with the default JSON size caps: ``--max-json-bytes`` of an in-process CLI
    call sets a process-wide cap that a later library call in the same process would otherwise inherit."""
    from replay_lib.bundle.safe_open import set_max_json_bytes

    set_max_json_bytes(None)
    yield
    set_max_json_bytes(None)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dump_json(obj) -> bytes:
    """The wire form both implementations write: 2-space indent, sorted keys, one trailing newline."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def reseal_bundle(bundle: Path) -> None:
    """Recompute every checksum of a single-producer bundle after it was tampered with.

    Payload sizes and sha256 go into manifest.json (when it still parses) and every ``COMPLETE.<r>``;
    the sha256 of the three JSON files goes into ``COMPLETE.<r>`` and ``COMPLETE``. Afterwards the
    checksums are consistent, so the check under test is the one that fires, not a checksum mismatch.
    """
    bundle = Path(bundle)
    try:
        manifest = json.loads((bundle / "manifest.json").read_bytes())
    except (ValueError, UnicodeDecodeError):
        manifest = None
    if isinstance(manifest, dict) and isinstance(manifest.get("payloads"), dict):
        for name, spec in manifest["payloads"].items():
            file = bundle / "payloads" / f"{name}.pt"
            if not file.is_file():  # format 1.3: safetensors payloads
                file = file.with_suffix(".safetensors")
            if isinstance(spec, dict) and file.is_file():
                data = file.read_bytes()
                spec["bytes"], spec["sha256"] = len(data), _sha256(data)
                chunks = spec.get("chunks")
                if isinstance(chunks, dict) and isinstance(chunks.get("bytes"), int) and chunks["bytes"] > 0:
                    step = chunks["bytes"]  # format 1.3's per-chunk checksums (SPEC §2.3), recomputed alike
                    chunks["sha256"] = [_sha256(data[i:i + step]) for i in range(0, len(data), step)]
        (bundle / "manifest.json").write_bytes(dump_json(manifest))
    payload_hashes = (
        {name: spec["sha256"] for name, spec in manifest["payloads"].items() if isinstance(spec, dict)}
        if isinstance(manifest, dict) and isinstance(manifest.get("payloads"), dict)
        else None
    )
    metadata = {name: _sha256((bundle / name).read_bytes()) for name in SEALED_JSON if (bundle / name).is_file()}
    for sentinel in sorted(bundle.glob("COMPLETE*")):
        doc = json.loads(sentinel.read_bytes())
        doc["metadata"] = metadata
        if sentinel.name != "COMPLETE" and payload_hashes is not None:
            doc["payloads"] = payload_hashes
        sentinel.write_bytes(dump_json(doc))


def edit_json(bundle: Path, name: str, edit) -> None:
    """Load ``bundle/name`` as JSON, let ``edit(doc)`` change it in place, write it back and re-seal."""
    path = Path(bundle) / name
    doc = json.loads(path.read_bytes())
    edit(doc)
    path.write_bytes(dump_json(doc))
    reseal_bundle(bundle)


def tree_snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (hidden ones included, symlinks not followed): kind, size, mtime, digest."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            if path.is_symlink():
                out[str(path.relative_to(root))] = ("link", os.readlink(path), st.st_mtime_ns)
            elif path.is_dir():
                out[str(path.relative_to(root))] = ("dir", st.st_mtime_ns)
            elif not stat.S_ISREG(st.st_mode):  # a FIFO or device: never read it
                out[str(path.relative_to(root))] = ("special", st.st_mode, st.st_mtime_ns)
            else:
                out[str(path.relative_to(root))] = ("file", st.st_size, st.st_mtime_ns, _sha256(path.read_bytes()))
    return out


@pytest.fixture(scope="session")
def example_trainer():
    """``examples/grpo_trainer.py``, the example trainer the end-to-end tests train with, imported as a module."""
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    sys.path.insert(0, examples)
    try:
        import grpo_trainer
    finally:
        sys.path.remove(examples)
    return grpo_trainer


@pytest.fixture
def pr65_bundle(tmp_path: Path) -> Path:
    """A freshly written, valid PR #65 rollout-level bundle (4 samples, 12 tokens, 4 payloads)."""
    return write_pr65(tmp_path / "pr65", buggy=True)


@pytest.fixture
def bundle_tools() -> SimpleNamespace:
    """``reseal(bundle)``, ``edit_json(bundle, name, edit)``, ``dump_json(obj)``, ``snapshot(root)``."""
    return SimpleNamespace(reseal=reseal_bundle, edit_json=edit_json, dump_json=dump_json, snapshot=tree_snapshot)


@pytest.fixture
def cli(capsys):
    """``trajectory-replay ARGS`` in-process (the entry point's own ``main``) → (exit code, stdout, stderr)."""

    def call(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return call
