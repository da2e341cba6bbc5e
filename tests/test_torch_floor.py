"""Every ``.pt`` of a foreign bundle (and of an imported dump) goes through torch's ``weights_only`` unpickler, which
has published escapes before torch 2.10: CVE-2025-32434 (a bypass with code execution, fixed in 2.6.0) and
CVE-2026-24747 (memory corruption, fixed in 2.10). On such a torch the reader refuses to load one, with one line
naming the advisory (exit 3); ``pyproject.toml`` requires torch>=2.10."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from replay_lib.bundle import BundleReader
from replay_lib.bundle.reader import require_safe_unpickler, torch_version
from replay_lib.bundle.schema import UNPACKED_FORMAT_VERSION
from replay_lib.demo import write_pr65
from replay_lib.errors import BundleError
from replay_lib.importers._common import load_pt

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version,expected", [("2.13.0+cpu", (2, 13, 0)), ("2.9.1+cu121", (2, 9, 1)),
                                              ("2.10.0a0+git1234", (2, 10, 0)), ("2.5", (2, 5)), ("nightly", ())])
def test_torch_version_reads_the_leading_numbers(monkeypatch, version, expected):
    monkeypatch.setattr(torch, "__version__", version)
    assert torch_version() == expected


def test_the_installed_torch_is_at_the_floor_pyproject_requires():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch>=2.10" in deps
    assert torch_version() >= (2, 10)
    require_safe_unpickler("x.pt")  # no refusal


@pytest.mark.parametrize("version,advisories", [
    ("2.9.1+cpu", "CVE-2026-24747, memory corruption"),
    ("2.5.1", "CVE-2025-32434, code execution; CVE-2026-24747, memory corruption"),
    ("unknown", "CVE-2025-32434, code execution; CVE-2026-24747, memory corruption"),
])
def test_replay_and_validate_refuse_pt_payloads_on_an_older_torch(tmp_path, cli, monkeypatch, version, advisories):
    old = write_pr65(tmp_path / "old", format_version=UNPACKED_FORMAT_VERSION)  # the older form: .pt payloads
    new = write_pr65(tmp_path / "new")  # the default form: safetensors payloads, no unpickler involved
    monkeypatch.setattr(torch, "__version__", version)
    for command in ("validate", "replay"):
        code, out, err = cli(command, old)
        assert (code, out) == (3, "")
        assert err == (f"trajectory-replay: error: {old / 'payloads' / 'advantages.pt'}: not loaded: torch "
                       f"{version}'s weights_only unpickler has known escapes ({advisories}); install torch>=2.10 "
                       "to read .pt payloads\n")
        code, out, err = cli(command, new)
        assert (code, err) == (0 if command == "validate" else 1, ""), out  # the pr65 demo diverges: exit 1
    # inspect unpickles nothing: it still reads the bundle
    code, _, err = cli("inspect", old)
    assert (code, err) == (0, "")


def test_the_same_bundle_opens_at_the_floor(pr65_bundle, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    assert BundleReader(pr65_bundle).payload_names == ["advantages", "kl", "old_log_probs", "ref_log_probs"]


def test_an_imported_dump_is_refused_on_an_older_torch(tmp_path, monkeypatch):
    dump = tmp_path / "rollout_0.pt"
    torch.save({"samples": []}, dump)
    assert load_pt(dump, "the dump") == {"samples": []}
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    with pytest.raises(BundleError) as info:
        load_pt(dump, "the dump")
    assert str(info.value) == (f"{dump}: not loaded: torch 2.6.0's weights_only unpickler has known escapes "
                               "(CVE-2026-24747, memory corruption); install torch>=2.10 to read .pt payloads")
