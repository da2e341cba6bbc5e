"""Hostile bundles: every failure kind is refused by ``validate`` with exit 3, one line on stderr that names
the file and the field, no traceback, and nothing written into the bundle.

Each hostile bundle is re-sealed after tampering (checksums recomputed) so the check under test is the one
that fires, not the checksum check. Most cases run the CLI in-process; a representative handful run
``python -m replay_lib validate`` in a real subprocess.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay_lib.cli import main
from replay_lib.bundle.packed import payload_suffix
from replay_lib.bundle.schema import FORMAT_VERSION, UNPACKED_FORMAT_VERSION
from replay_lib.demo import synthetic_parts, write_bundle, write_cohort, write_pr65
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]


class _MkdirOnLoad:
    """Unpickling this runs ``os.mkdir(marker)``: proof that a payload is never unpickled unsafely."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


# The cases tamper with the older form's files (torch.save payloads, masks in index.json): their bundle is written
# as format 1.1.0 explicitly. The cases about a payload file as a file also run on the default form (1.3.0, a
# safetensors payload): SAFETENSORS_CASES below.
VERSION = {"format": UNPACKED_FORMAT_VERSION}


def _pr65(tmp: Path) -> Path:
    return write_pr65(tmp / "bundle", buggy=True, format_version=VERSION["format"])


def _kl(bundle: Path) -> Path:
    return bundle / "payloads" / f"kl{payload_suffix(VERSION['format'])}"


def _replace_payload(bundle: Path, obj, tools) -> None:
    if _kl(bundle).suffix == ".safetensors":
        save_file({"data": obj}, str(_kl(bundle)))
    else:
        torch.save(obj, _kl(bundle))
    tools.reseal(bundle)


def _kl_tensor(bundle: Path) -> torch.Tensor:
    if _kl(bundle).suffix == ".safetensors":
        return load_file(str(_kl(bundle)))["data"]
    return torch.load(_kl(bundle), weights_only=True)


# Each case builds a hostile bundle under ``tmp`` and returns (path to validate, directory to snapshot,
# key words the one stderr line must contain).


def case_truncated_payload(tmp, tools):
    b = _pr65(tmp)
    data = _kl(b).read_bytes()
    _kl(b).write_bytes(data[: len(data) // 2])
    return b, b, [f"{_kl(b)}:", f"size {len(data) // 2} bytes, manifest says {len(data)}", "truncated"]


def case_flipped_byte(tmp, tools):
    b = _pr65(tmp)
    data = bytearray(_kl(b).read_bytes())
    data[len(data) // 2] ^= 0x01
    _kl(b).write_bytes(bytes(data))
    digest = hashlib.sha256(bytes(data)).hexdigest()
    return b, b, [f"{_kl(b)}:", "sha256 mismatch", f"file {digest[:12]}"]


def case_missing_payload(tmp, tools):
    b = _pr65(tmp)
    _kl(b).unlink()
    return b, b, [f"{_kl(b)}:", "missing payload", "manifest.json $.payloads.kl"]


def case_missing_complete(tmp, tools):
    b = _pr65(tmp)
    (b / "COMPLETE").unlink()
    return b, b, [f"{b / 'COMPLETE'}:", "missing COMPLETE sentinel"]


def case_missing_rank_shard(tmp, tools):
    c = write_cohort(tmp / "cohort", samples=4, tokens=3)
    shutil.rmtree(c / "rank-1")
    return c, c, [f"{c / 'rank-1'}:", "missing rank shard", "COMPLETE $.ranks"]


def _half_cohort(tmp) -> Path:
    # Rank 0 of a two-rank cohort published; rank 1 never flushed, so there is no cohort COMPLETE.
    c = tmp / "cohort"
    write_bundle(c, *synthetic_parts(samples=4, tokens=3, bundle_id="cohort"), rank=0, ranks=[0, 1])
    assert sorted(os.listdir(c)) == ["COMPLETE.0", "rank-0"]
    return c


def case_cohort_without_final_complete(tmp, tools):
    c = _half_cohort(tmp)
    return c, c, [f"{c / 'COMPLETE'}:", "cohort has no final COMPLETE", "ranks published: COMPLETE.0"]


def case_rank_path_without_cohort_complete(tmp, tools):
    c = _half_cohort(tmp)
    return c / "rank-0", c, [f"{c / 'COMPLETE'}:", "cohort has no final COMPLETE", "rank-local bundle is refused"]


def case_pickled_object(tmp, tools):
    b = _pr65(tmp)
    marker = tmp / "code-ran"
    _replace_payload(b, _MkdirOnLoad(marker), tools)
    return b, b, [f"{_kl(b)}:", "not a loadable weights-only tensor file", "GLOBAL", "mkdir"]


def case_pickled_dict(tmp, tools):
    b = _pr65(tmp)
    _replace_payload(b, {"kl": _kl_tensor(b)}, tools)
    return b, b, [f"{_kl(b)}:", "payload must be a plain torch.Tensor, got builtins.dict"]


def case_pickled_list_of_tensors(tmp, tools):
    b = _pr65(tmp)
    t = _kl_tensor(b)
    _replace_payload(b, [t[:6].clone(), t[6:].clone()], tools)
    return b, b, [f"{_kl(b)}:", "payload must be a plain torch.Tensor, got builtins.list"]


def case_tensor_subclass(tmp, tools):
    b = _pr65(tmp)
    _replace_payload(b, torch.nn.Parameter(_kl_tensor(b), requires_grad=False), tools)
    return b, b, [f"{_kl(b)}:", "payload must be a plain torch.Tensor, got torch.nn.parameter.Parameter"]


def _add_payload_entry(b: Path, name: str, tools) -> None:
    def edit(doc):
        doc["payloads"][name] = {"name": name, "dtype": "torch.float32", "shape": [3], "bytes": 0, "sha256": ""}

    tools.edit_json(b, "manifest.json", edit)


def case_payload_name_dotdot(tmp, tools):
    b = _pr65(tmp)
    torch.save(torch.zeros(3), b / "x.pt")  # payloads/../x.pt: a loadable tensor, if the name were trusted
    _add_payload_entry(b, "../x", tools)
    return b, b, [f"{b / 'COMPLETE.0'}:", "$.payloads", "unsafe payload name '../x'"]


def case_payload_name_absolute(tmp, tools):
    b = _pr65(tmp)
    outside = tmp / "outside"
    torch.save(torch.zeros(3), outside.with_suffix(".pt"))
    _add_payload_entry(b, str(outside), tools)
    return b, b, [f"{b / 'COMPLETE.0'}:", "$.payloads", f"unsafe payload name '{outside}'"]


def case_payload_spec_name_absolute(tmp, tools):
    b = _pr65(tmp)
    tools.edit_json(b, "manifest.json", lambda doc: doc["payloads"]["kl"].__setitem__("name", "/etc/passwd"))
    return b, b, [f"{b / 'manifest.json'}:", "$.payloads.kl.name", "unsafe payload name '/etc/passwd'"]


def case_symlink_out_of_bundle(tmp, tools):
    b = _pr65(tmp)
    outside = tmp / "outside-kl.pt"
    shutil.copyfile(_kl(b), outside)  # identical bytes: size and sha256 still match, only the link is wrong
    _kl(b).unlink()
    _kl(b).symlink_to(outside)
    return b, b, [f"{_kl(b)}:", "symlink leaves the bundle", str(outside)]


def case_json_symlink_out_of_bundle(tmp, tools):
    b = _pr65(tmp)
    outside = tmp / "outside-index.json"
    shutil.copyfile(b / "index.json", outside)  # identical bytes: the sha256 in COMPLETE still matches
    (b / "index.json").unlink()
    (b / "index.json").symlink_to(outside)
    return b, b, [f"{b / 'index.json'}:", "symlink leaves the bundle", str(outside)]


def case_json_not_a_regular_file(tmp, tools):
    b = _pr65(tmp)
    (b / "expected.json").unlink()
    os.mkfifo(b / "expected.json")  # reading it would block forever
    return b, b, [f"{b / 'expected.json'}:", "expected.json is not a regular file"]


def case_payload_fifo(tmp, tools):
    b = _pr65(tmp)
    _kl(b).unlink()
    os.mkfifo(_kl(b))  # opening it for reading would block until a writer came
    return b, b, [f"{_kl(b)}:", "payload is not a regular file"]


def case_payload_link_loop(tmp, tools):
    b = _pr65(tmp)
    _kl(b).unlink()
    _kl(b).symlink_to(_kl(b).name)  # kl.pt → kl.pt
    return b, b, [f"{_kl(b)}:", "payload is a link that leads nowhere (dangling, or a loop)"]


def case_raw_pickle_payload(tmp, tools):
    """A bare pickle (no torch archive): torch's refusal is named in its own words, the opcode it refused, not
    its generic advice cut mid-sentence."""
    import pickle

    b = _pr65(tmp)
    _kl(b).write_bytes(pickle.dumps(_MkdirOnLoad(tmp / "code-ran"), protocol=4))
    tools.reseal(b)
    return b, b, [f"{_kl(b)}:", "not a loadable weights-only tensor file (", "Unsupported operand"]


def case_truncated_payload_resealed(tmp, tools):
    """A torch archive cut in half, sizes and checksums re-sealed: torch's first sentence, whole."""
    b = _pr65(tmp)
    data = _kl(b).read_bytes()
    _kl(b).write_bytes(data[: len(data) // 2])
    tools.reseal(b)
    return b, b, [f"{_kl(b)}:", "not a loadable weights-only tensor file (", "zip archive"]


def case_sample_id_of_megabytes(tmp, tools):
    """An id is at most ID_MAX_CHARS characters: one of 2 MB made the debugger spin for minutes."""
    b = _pr65(tmp)
    tools.edit_json(b, "index.json", lambda doc: doc["samples"][0].update(sample_id="A" * 2_000_000))  # re-sealed
    return b, b, [f"{b / 'index.json'}: $.samples[0].sample_id: expected `str` of length <= 1024"]


def case_empty_sample_id(tmp, tools):
    b = _pr65(tmp)
    tools.edit_json(b, "index.json", lambda doc: doc["samples"][1].update(sample_id=""))  # re-sealed
    return b, b, [f"{b / 'index.json'}: $.samples[1].sample_id: expected `str` of length >= 1"]


def case_expected_number_out_of_range(tmp, tools):
    """A 400-digit number in expected.json: named by its stage and key (msgspec alone says ``$[...][...][0]``)."""
    b = _pr65(tmp)
    data = (b / "expected.json").read_bytes()
    first = data.index(b'"raw_rewards": [') + len(b'"raw_rewards": [')
    end = min(data.index(b",", first), data.index(b"]", first))
    (b / "expected.json").write_bytes(data[:first] + b"\n      " + b"9" * 400 + data[end:])
    tools.reseal(b)
    return b, b, [f"{b / 'expected.json'}: $.reward.raw.raw_rewards[0]: number out of range"]


def case_expected_value_of_the_wrong_type(tmp, tools):
    b = _pr65(tmp)
    tools.edit_json(b, "expected.json", lambda doc: doc["reward.post_process"]["rewards"].__setitem__(2, "x"))
    return b, b, [f"{b / 'expected.json'}: $.reward.post_process.rewards[2]:", "got `str`"]


def case_nan_literal_in_index(tmp, tools):
    """Python's json writes NaN as a bare literal (the original writes a non-finite reward so, and both majors of
    it read them): index.json is read with them, and a NaN where the schema wants an integer is refused there."""
    b = _pr65(tmp)
    data = (b / "index.json").read_bytes()
    at = data.index(b'"response_length": ') + len(b'"response_length": ')
    end = data.index(b",", at)
    (b / "index.json").write_bytes(data[:at] + b"NaN" + data[end:])
    tools.reseal(b)
    return b, b, [f"{b / 'index.json'}: $.samples[0].response_length: expected `int`, got `float`"]


def case_wrong_dtype(tmp, tools):
    b = _pr65(tmp)
    _replace_payload(b, _kl_tensor(b).to(torch.float64), tools)
    return b, b, [f"{_kl(b)}:", "dtype torch.float64", "$.payloads.kl.dtype says torch.float32"]


def case_wrong_shape(tmp, tools):
    b = _pr65(tmp)
    _replace_payload(b, _kl_tensor(b)[:11].clone(), tools)
    return b, b, [f"{_kl(b)}:", "shape [11]", "$.payloads.kl.shape says [12]"]


def case_bundle_id_mismatch(tmp, tools):
    b = _pr65(tmp)
    tools.edit_json(b, "index.json", lambda doc: doc.__setitem__("bundle_id", "b-99999"))
    return b, b, [f"{b / 'index.json'}:", "$.bundle_id", "'b-99999' does not match", "'b-00001'"]


def case_unknown_major_version(tmp, tools):
    b = _pr65(tmp)
    tools.edit_json(b, "manifest.json", lambda doc: doc.__setitem__("format_version", "3.0.0"))
    return b, b, [f"{b / 'manifest.json'}:", "$.format_version", "unsupported major version '3.0.0'",
                  "(this reader reads 1.x and 2.x)"]


def case_unknown_stage_id(tmp, tools):
    b = _pr65(tmp)
    contract = {"stage": "reward.magic", "version": "v1", "capability": "recompute", "implementation": "reuse",
                "inputs": [], "expected_outputs": []}
    tools.edit_json(b, "manifest.json", lambda doc: doc["stage_contracts"].__setitem__("reward.magic", contract))
    return b, b, [f"{b / 'manifest.json'}:", "$.stage_contracts", "invalid enum value 'reward.magic'"]


def case_invalid_json(tmp, tools):
    b = _pr65(tmp)
    (b / "index.json").write_bytes(b'{"bundle_id": "b-00001", "samples": [')
    tools.reseal(b)
    return b, b, [f"{b / 'index.json'}:", "invalid JSON", "truncated"]


def case_invalid_json_not_resealed(tmp, tools):
    # The reader decodes index.json while it hashes the files; the checksum check still speaks first.
    b = _pr65(tmp)
    data = b'{"bundle_id": "b-00001", "samples": ['
    (b / "index.json").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    return b, b, [f"{b / 'index.json'}:", "sha256 mismatch", f"file {digest[:12]}"]


def case_wrong_types(tmp, tools):
    b = _pr65(tmp)
    tools.edit_json(b, "index.json", lambda doc: doc["samples"][3].__setitem__("loss_mask", [1, "1", 1]))
    return b, b, [f"{b / 'index.json'}:", "$.samples[3].loss_mask[1]", "expected `int`, got `str`"]


def case_wrong_types_scalar(tmp, tools):
    b = _pr65(tmp)
    tools.edit_json(b, "index.json", lambda doc: doc["samples"][2].__setitem__("response_length", "4"))
    return b, b, [f"{b / 'index.json'}:", "$.samples[2].response_length", "expected `int`, got `str`"]


def case_duplicate_sample_ids(tmp, tools):
    b = _pr65(tmp)
    tools.edit_json(b, "index.json", lambda doc: doc["samples"][2].__setitem__("sample_id", "s-0"))
    return b, b, [f"{b / 'index.json'}:", "$.samples[2].sample_id", "duplicate sample id 's-0'", "$.samples[0]"]


def case_non_utf8(tmp, tools):
    b = _pr65(tmp)
    data = (b / "index.json").read_bytes()
    at = data.index(b'"s-1"') + 3
    (b / "index.json").write_bytes(data[:at] + b"\xff" + data[at:])
    tools.reseal(b)
    return b, b, [f"{b / 'index.json'}:", f"not valid UTF-8 (byte {at})"]


def case_empty_bundle_dir(tmp, tools):
    d = tmp / "empty"
    d.mkdir()
    return d, d, [f"{d}:", "empty directory"]


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
SUBPROCESS_CASES = ["truncated_payload", "pickled_object", "payload_name_dotdot", "invalid_json",
                    "rank_path_without_cohort_complete"]


def _check_refusal(rc: int, out: str, err: str, keywords: list[str]) -> None:
    assert rc == 3, (rc, out, err)
    assert out == ""
    assert err.endswith("\n") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    assert err.startswith("trajectory-replay: error: ")
    for word in keywords:
        assert word in err, (word, err)
    assert "weights_only" not in err and "there is a high" not in err, err  # torch's advice is left out


@pytest.mark.parametrize("kind", sorted(CASES))
def test_validate_refuses_in_process(kind, tmp_path, capsys, bundle_tools):
    target, root, keywords = CASES[kind](tmp_path, bundle_tools)
    capsys.readouterr()
    before = bundle_tools.snapshot(root)
    rc = main(["validate", str(target)])
    out, err = capsys.readouterr()
    _check_refusal(rc, out, err, keywords)
    assert bundle_tools.snapshot(root) == before
    if kind in ("pickled_object", "raw_pickle_payload"):
        assert not (tmp_path / "code-ran").exists()


@pytest.mark.parametrize("kind", SUBPROCESS_CASES)
def test_validate_refuses_in_subprocess(kind, tmp_path, bundle_tools):
    target, root, keywords = CASES[kind](tmp_path, bundle_tools)
    before = bundle_tools.snapshot(root)
    proc = subprocess.run([sys.executable, "-m", "replay_lib", "validate", str(target)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    _check_refusal(proc.returncode, proc.stdout, proc.stderr, keywords)
    assert bundle_tools.snapshot(root) == before
    if kind in ("pickled_object", "raw_pickle_payload"):
        assert not (tmp_path / "code-ran").exists()


# The cases about a payload file as a file, on the default form's safetensors payload (kl.safetensors).
SAFETENSORS_CASES = ["truncated_payload", "flipped_byte", "missing_payload", "symlink_out_of_bundle", "payload_fifo",
                     "payload_link_loop", "wrong_dtype", "wrong_shape"]


@pytest.mark.parametrize("kind", SAFETENSORS_CASES)
def test_validate_refuses_a_tampered_safetensors_payload(kind, tmp_path, capsys, bundle_tools, monkeypatch):
    monkeypatch.setitem(VERSION, "format", FORMAT_VERSION)
    target, root, keywords = CASES[kind](tmp_path, bundle_tools)
    assert _kl(target).name == "kl.safetensors" and keywords[0] == f"{_kl(target)}:"
    capsys.readouterr()
    before = bundle_tools.snapshot(root)
    rc = main(["validate", str(target)])
    out, err = capsys.readouterr()
    _check_refusal(rc, out, err, keywords)
    assert bundle_tools.snapshot(root) == before


def test_a_truncated_safetensors_payload_resealed_is_refused_by_its_header(tmp_path, capsys, bundle_tools):
    """The safetensors twin of ``truncated_payload_resealed``: sizes and checksums re-sealed, the header's data
    offsets run past the file's end."""
    b = write_pr65(tmp_path / "bundle", buggy=True)
    kl = b / "payloads" / "kl.safetensors"
    data = kl.read_bytes()
    kl.write_bytes(data[:-4])  # the last of the 12 float32 values cut
    bundle_tools.reseal(b)
    capsys.readouterr()
    rc = main(["validate", str(b)])
    out, err = capsys.readouterr()
    _check_refusal(rc, out, err, [f"{kl}: safetensors header: $.data.data_offsets: [0, 48], expected [0, 44] "])


def test_every_case_starts_from_a_valid_bundle(tmp_path, capsys, bundle_tools):
    """The fixtures the hostile cases tamper with are valid before tampering (so the refusal is earned)."""
    b = write_pr65(tmp_path / "b", buggy=True)
    bundle_tools.reseal(b)  # re-sealing an untouched bundle must keep it valid
    c = write_cohort(tmp_path / "c", samples=4, tokens=3)
    assert main(["validate", str(b)]) == 0
    assert main(["validate", str(c)]) == 0
    assert main(["validate", str(c / "rank-0")]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.count("— valid") == 3


def _without_file_permissions(argv: list[str]) -> list[str]:
    """``argv`` run so that file permissions apply: as is for a user, under ``setpriv`` without the capabilities that
    let root read anything; ``[]`` when neither is possible here."""
    if os.geteuid() != 0:
        return argv
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return []
    probe = subprocess.run([setpriv, "--bounding-set", "-dac_override,-dac_read_search", "true"], capture_output=True)
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search", *argv] if probe.returncode == 0 else []


@pytest.mark.parametrize("what", ["payload", "payload directory"])
def test_an_unreadable_payload_is_a_bundle_error_not_an_internal_one(what, tmp_path):
    """A payload file (or the payloads/ directory) without read permission: exit 3 and one line naming the file,
    from validate, replay and replay-tui --check alike (it was exit 5, "a bug in this tool")."""
    b = _pr65(tmp_path)
    target = _kl(b) if what == "payload" else b / "payloads"
    argv = _without_file_permissions([sys.executable, "-m", "replay_lib", "validate", str(b)])
    if not argv:
        pytest.skip("file permissions cannot be made to apply here (root without setpriv)")
    target.chmod(0)
    try:
        for command in (["validate"], ["replay"], ["replay", "--format", "json"]):
            run = argv[:argv.index("validate")] + [*command, str(b)]
            proc = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=120)
            assert (proc.returncode, proc.stdout) == (3, ""), (command, proc.stderr)
            line = proc.stderr
            assert len(line.splitlines()) == 1 and "Traceback" not in line and "internal error" not in line, line
            assert line.startswith("trajectory-replay: error: " + str(b / "payloads")), line
            assert line.rstrip().endswith(": cannot read: Permission denied"), line
        tui = argv[:argv.index("-m")] + ["-m", "replay_tui", str(b), "--check"]
        proc = subprocess.run(tui, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 3 and proc.stderr.rstrip().endswith(": cannot read: Permission denied"), proc.stderr
    finally:
        target.chmod(0o755 if what != "payload" else 0o644)


def test_a_payload_swapped_for_a_fifo_while_the_bundle_is_read_never_blocks_the_reader(tmp_path):
    """A producer (or anyone) swaps a payload between a good file and a FIFO while the reader verifies the bundle:
    every open ends, valid or refused with exit 3's one line, never blocked on the FIFO (the reader opens the file
    without blocking and checks the descriptor; torch and zipfile read that very file)."""
    import threading

    from replay_lib.bundle import open_bundle
    from replay_lib.errors import BundleError

    b = _pr65(tmp_path)
    good = tmp_path / "kl-good.pt"
    shutil.copyfile(_kl(b), good)
    stop = threading.Event()

    def swap() -> None:
        staging = _kl(b).with_name("kl.pt.swap")
        while not stop.is_set():
            shutil.copyfile(good, staging)
            os.replace(staging, _kl(b))
            os.mkfifo(staging)
            os.replace(staging, _kl(b))

    outcomes: list[str] = []

    def read() -> None:
        for _ in range(150):
            try:
                open_bundle(b)
                outcomes.append("valid")
            except BundleError as exc:
                outcomes.append(str(exc).split(": ", 1)[1])

    swapper = threading.Thread(target=swap, daemon=True)
    reader = threading.Thread(target=read, daemon=True)
    swapper.start()
    reader.start()
    reader.join(timeout=60)
    stop.set()
    swapper.join(timeout=10)
    assert not reader.is_alive(), "the reader blocked on a FIFO"
    assert len(outcomes) == 150
    refused = {o for o in outcomes if o != "valid"}
    # the FIFO itself, or the moment a copy of the good file had begun
    assert all(o == "payload is not a regular file" or o.startswith("size ") for o in refused), sorted(refused)
    assert "payload is not a regular file" in outcomes  # the FIFO was met
