"""``trajectory-replay reseal BUNDLE --i-edited-it``: a bundle edited by hand verifies again, marked resealed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from replay_lib.bundle.schema import FORMAT_VERSION, UNPACKED_FORMAT_VERSION
from replay_lib.cli import main
from replay_lib.demo import write_pr65
from safetensors.torch import load_file, save_file


@pytest.fixture(params=[FORMAT_VERSION, UNPACKED_FORMAT_VERSION])
def bundle(request, tmp_path) -> Path:
    """The pr65-buggy demo in the default form (1.3.0: safetensors payloads, the masks a payload: 5 of them) and in
    the older one (1.1.0: .pt payloads, 4)."""
    return write_pr65(tmp_path / "pr65", buggy=True, format_version=request.param)


def _payloads(bundle: Path) -> int:
    return 5 if (bundle / "payloads" / "loss_mask.safetensors").exists() else 4


def _kl_file(bundle: Path) -> Path:
    return next((bundle / "payloads").glob("kl.*"))


def _load(file: Path) -> torch.Tensor:
    return load_file(str(file))["data"] if file.suffix == ".safetensors" else torch.load(file, weights_only=True)


def _save(tensor: torch.Tensor, file: Path) -> None:
    if file.suffix == ".safetensors":
        save_file({"data": tensor}, str(file))
    else:
        torch.save(tensor, file)


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_refused_without_the_confirmation(bundle, capsys):
    before = snapshot(bundle)
    assert main(["reseal", str(bundle)]) == 2
    assert capsys.readouterr().err == ("trajectory-replay: error: reseal makes any change to the bundle verify (an "
                                       "accidental one too): pass --i-edited-it to confirm the edits are yours\n")
    assert snapshot(bundle) == before


def test_an_edited_expected_value_verifies_again_marked_resealed(bundle, capsys):
    text = (bundle / "expected.json").read_text()
    assert text.count("-5.5") == 1
    (bundle / "expected.json").write_text(text.replace("-5.5", "-1.0"))
    assert main(["validate", str(bundle)]) == 3
    assert "expected.json: sha256 mismatch" in capsys.readouterr().err
    before = snapshot(bundle)
    assert main(["reseal", str(bundle), "--i-edited-it"]) == 0
    assert capsys.readouterr().out == (f"resealed {bundle}: bundle b-00001, {_payloads(bundle)} payload(s), "
                                       f"producer commit demo+resealed; verified\n")
    after = snapshot(bundle)
    assert sorted(k for k in after if after[k] != before[k]) == ["COMPLETE", "COMPLETE.0", "manifest.json"]
    manifest = json.loads(after["manifest.json"])
    assert manifest["producer"]["commit"] == "demo+resealed"
    # the rest of the manifest is byte for byte as it was (the writer's form: 2-space indent, sorted keys)
    assert after["manifest.json"].replace(b'"demo+resealed"', b'"demo"') == before["manifest.json"]
    assert main(["validate", str(bundle)]) == 0
    capsys.readouterr()
    assert main(["replay", str(bundle), "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    stage = next(s for s in report["stages"] if s["stage"] == "reward.post_process")
    assert stage["mismatches"] == 3
    first = stage["divergences"][0]
    assert (first["sample_id"], first["expected"]) == ("s-1", -3.5)  # s-0 now records what the replay computes
    # resealed twice: marked once
    assert main(["reseal", str(bundle), "--i-edited-it", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["commit"], out["verified"], out["payloads"]) == ("demo+resealed", True, _payloads(bundle))


def test_a_rewritten_payload_gets_its_size_and_checksum(bundle, capsys):
    file = _kl_file(bundle)
    kl = _load(file)
    _save(torch.cat([kl, kl]), file)  # another size too: the shape is the user's to keep right
    assert main(["reseal", str(bundle), "--i-edited-it"]) == 3
    out = capsys.readouterr().out
    assert out.startswith(f"resealed {bundle}: bundle b-00001, {_payloads(bundle)} payload(s), producer commit "
                          f"demo+resealed; does not verify: {file}: shape [24], manifest $.payloads.kl.shape says [12]")
    _save(kl * 2, file)
    assert main(["reseal", str(bundle), "--i-edited-it"]) == 0
    spec = json.loads((bundle / "manifest.json").read_text())["payloads"]["kl"]
    assert spec["bytes"] == file.stat().st_size
    import hashlib
    assert spec["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()


def test_a_missing_payload_or_a_cohort_is_refused_with_nothing_written(bundle, tmp_path, capsys):
    file = _kl_file(bundle)
    file.unlink()
    before = snapshot(bundle)
    assert main(["reseal", str(bundle), "--i-edited-it"]) == 3
    assert capsys.readouterr().err == (f"trajectory-replay: error: {file}: $.payloads.kl: the payload file is "
                                       f"missing\n")
    assert snapshot(bundle) == before
    cohort = tmp_path / "cohort"
    (cohort / "rank-0").mkdir(parents=True)
    assert main(["reseal", str(cohort), "--i-edited-it"]) == 4
    assert capsys.readouterr().err.startswith(f"trajectory-replay: error: {cohort}: reseal takes a single bundle "
                                              f"directory")
