"""Hostile capture directories (SPEC §11): a FIFO, a device or a link under a capture directory never blocks
or floods the lookup, ``inspect`` never follows a link out of the tree or round a loop, and JSON files have
a size cap that ``--max-json-bytes`` sets.

What could hang runs in a real subprocess with a timeout: before the checks, a FIFO index.json blocked
``validate``/``replay``/``replay-tui --check`` forever and ``inspect`` walked ``/proc/self`` until killed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from replay_lib.demo import synthetic_parts, write_bundle
from replay_lib.errors import BundleError
from replay_lib.bundle.safe_open import INDEX_JSON_CAP, read_json_file
from replay_lib.bundle.schema import ActorStepId

REPO = Path(__file__).resolve().parents[1]
PROMPT = 60  # seconds: a run that is not done by then is hanging (torch imports in 2-3 s)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    return subprocess.run(list(args), cwd=REPO, capture_output=True, text=True, timeout=PROMPT, env=env)


def _bundle(path: Path, bundle_id: str, step: int) -> Path:
    return write_bundle(path, *synthetic_parts(samples=4, tokens=2, bundle_id=bundle_id,
                                                anchor=ActorStepId(rollout_id=7, step_id=step)))


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    """``a`` (step 7:0) and ``b`` (step 7:1): two valid bundles of one capture directory."""
    root = tmp_path / "capture"
    _bundle(root / "a", "a", 0)
    _bundle(root / "b", "b", 1)
    return root


def _fifo_index(bundle: Path) -> None:
    (bundle / "index.json").unlink()
    os.mkfifo(bundle / "index.json")  # a read blocks until a writer comes: forever


def _assert_one_line(proc, code: int, line: str) -> None:
    assert (proc.returncode, proc.stdout) == (code, ""), proc.stderr
    assert proc.stderr == line + "\n"


# ------------------------------------------------------------------------------- capture lookup


FIFO_B = "b (unreadable identity; index.json is not a regular file (a FIFO))"


@pytest.mark.parametrize("command", [
    ("trajectory-replay", "validate"),
    ("trajectory-replay", "replay"),
    ("replay-tui", "--check"),
])
def test_a_fifo_index_in_another_candidate_never_blocks_the_lookup(capture, command):
    _fifo_index(capture / "b")
    exe, verb = command
    args = [exe, verb, str(capture), "--step", "7:0"] if exe == "trajectory-replay" else \
        [exe, str(capture), verb, "--step", "7:0"]
    proc = _run(*args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.startswith("bundle a — ")


def test_a_fifo_index_is_listed_as_unreadable_never_read(capture):
    _fifo_index(capture / "b")
    proc = _run("trajectory-replay", "validate", str(capture), "--step", "7:1")
    _assert_one_line(proc, 3, f"trajectory-replay: error: {capture}: no bundle matches --step 7:1; "
                              f"candidates: a (step 7:0); {FIFO_B}")
    # a directory of bundles is a scan: the FIFO bundle is an invalid row, never read, and the scan ends
    proc = _run("replay-tui", str(capture), "--check")
    assert (proc.returncode, proc.stderr) == (3, ""), proc.stderr
    assert proc.stdout == (
        "[       pass] step 7:0       a\n"
        f"[    invalid] ?              b — {capture}/b/index.json: index.json is not a regular file (a FIFO)\n"
        "2 bundle(s) scanned: 1 pass, 1 invalid\nfirst bad step: none\n")


def test_an_index_linked_to_dev_zero_is_never_read(capture):
    (capture / "b" / "index.json").unlink()
    (capture / "b" / "index.json").symlink_to("/dev/zero")  # read to its end: memory runs out
    proc = _run("trajectory-replay", "replay", str(capture), "--step", "7:9")
    _assert_one_line(proc, 3, f"trajectory-replay: error: {capture}: no bundle matches --step 7:9; candidates: "
                              "a (step 7:0); b (unreadable identity; symlink leaves the bundle (→ /dev/zero))")


def test_an_index_that_is_a_socket_is_never_opened(cli, capture):
    (capture / "b" / "index.json").unlink()
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(capture / "b" / "index.json"))
        code, out, err = cli("validate", capture, "--step", "7:1")
    finally:
        sock.close()
    assert (code, out) == (3, "")
    assert err == (f"trajectory-replay: error: {capture}: no bundle matches --step 7:1; candidates: a (step 7:0); "
                   "b (unreadable identity; index.json is not a regular file (a socket))\n")


def test_an_index_nested_too_deep_in_another_candidate_is_unreadable(cli, capture):
    (capture / "b" / "index.json").write_bytes(b'{"zz": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    code, out, err = cli("validate", capture, "--step", "7:0")
    assert (code, err) == (0, "")
    code, out, err = cli("validate", capture, "--step", "7:1")
    assert (code, out) == (3, "")
    assert err == (f"trajectory-replay: error: {capture}: no bundle matches --step 7:1; candidates: a (step 7:0); "
                   "b (unreadable identity; index.json does not decode)\n")


def test_an_index_over_its_cap_is_refused_before_a_byte_is_read(cli, capture):
    index = capture / "b" / "index.json"
    os.truncate(index, INDEX_JSON_CAP + 1)  # sparse: 2 GiB + 1 byte on disk costs nothing
    code, out, err = cli("validate", capture, "--step", "7:1")
    assert (code, out) == (3, "")
    assert err == (f"trajectory-replay: error: {capture}: no bundle matches --step 7:1; candidates: a (step 7:0); "
                   f"b (unreadable identity; index.json is {INDEX_JSON_CAP + 1} bytes, over the "
                   f"{INDEX_JSON_CAP}-byte cap (raise it with --max-json-bytes))\n")


def test_max_json_bytes_sets_the_cap(cli, capture):
    size = (capture / "a" / "index.json").stat().st_size
    code, out, err = cli("validate", capture, "--step", "7:0", "--max-json-bytes", "100")
    assert (code, out) == (3, "")
    assert f"a (unreadable identity; index.json is {size} bytes, over the 100-byte cap (raise it with " \
           "--max-json-bytes))" in err
    assert cli("validate", capture, "--step", "7:0", "--max-json-bytes", "64M")[0] == 0
    # the cap belongs to that command: the next one has the defaults again
    assert cli("validate", capture, "--step", "7:0")[0] == 0
    code, out, err = cli("inspect", capture / "a", "--format", "json", "--max-json-bytes", "100")
    assert code == 0
    assert f"index.json: {size} bytes, over the 100-byte cap (not read; raise it with --max-json-bytes)" in \
        json.loads(out)["problems"]


@pytest.mark.parametrize("value", ["lots", "-1", "1.5G", ""])
def test_a_bad_max_json_bytes_is_a_usage_error(cli, capsys, capture, value):
    with pytest.raises(SystemExit) as exc:
        cli("validate", capture, "--max-json-bytes", value)
    assert exc.value.code == 2
    assert capsys.readouterr().err == ("trajectory-replay validate: error: argument --max-json-bytes: expected a "
                                       f"size in bytes such as 67108864, 64M or 2G, got {value!r}\n")


def test_a_bad_max_json_bytes_is_one_line(capture):
    proc = _run("trajectory-replay", "inspect", str(capture), "--max-json-bytes", "lots")
    _assert_one_line(proc, 2, "trajectory-replay inspect: error: argument --max-json-bytes: expected a size in "
                              "bytes such as 67108864, 64M or 2G, got 'lots'")


def test_linked_candidates_are_not_followed(cli, capture, tmp_path):
    outside = _bundle(tmp_path / "elsewhere" / "c", "c", 2)
    shutil.rmtree(capture / "b")
    (capture / "alias").symlink_to("a")  # the same bundle under a second name: would make it ambiguous
    (capture / "out").symlink_to(outside)  # a bundle outside the capture directory
    code, out, err = cli("validate", capture)
    assert (code, err) == (0, "")
    assert out.startswith("bundle a — valid")
    code, out, err = cli("validate", capture, "--step", "7:2")
    assert (code, out) == (3, "")
    assert err == f"trajectory-replay: error: {capture}: no bundle matches --step 7:2; candidates: a (step 7:0)\n"
    shutil.rmtree(capture / "a")
    code, out, err = cli("validate", capture)
    assert (code, out) == (3, "")
    assert err == (f"trajectory-replay: error: {capture}: no bundle found (no manifest.json, no COMPLETE, no bundle "
                   "subdirectories); symbolic links are not followed: alias, out\n")
    assert cli("validate", capture / "out")[0] == 0  # a linked bundle named on the command line opens


# ------------------------------------------------------------------------------ the checked read


def test_a_link_inside_the_directory_is_read_and_a_linked_directory_is_not(capture):
    b = capture / "b"
    data = (b / "index.json").read_bytes()
    (b / "index.json").rename(b / "real-index.json")
    (b / "index.json").symlink_to("real-index.json")  # stays beside it: read, as the reader reads it
    assert read_json_file(b / "index.json", capture) == data
    (capture / "via").symlink_to("b")
    with pytest.raises(BundleError) as exc:
        read_json_file(capture / "via" / "index.json", capture)
    assert str(exc.value) == f"{capture / 'via' / 'index.json'}: via is not a directory inside the tree " \
                             "(a link is never followed)"
    (b / "index.json").unlink()
    (b / "index.json").symlink_to(capture / "a" / "index.json")  # a sibling's: leaves its bundle
    with pytest.raises(BundleError, match="symlink leaves the bundle"):
        read_json_file(b / "index.json", capture)


# ------------------------------------------------------------------------------------ inspect


def test_inspect_never_leaves_the_tree_nor_loops(capture, tmp_path):
    outside = _bundle(tmp_path / "elsewhere" / "c", "c", 2)
    shutil.rmtree(capture / "b")
    (capture / "self").symlink_to("/proc/self")
    (capture / "loop").symlink_to(".")
    (capture / "up").symlink_to("..")
    (capture / "root").symlink_to("/")
    (capture / "out").symlink_to(outside.parent)
    (capture / "gone").symlink_to("nowhere")
    os.mkfifo(capture / "pipe")
    (capture / "runs").mkdir()
    (capture / "runs" / "back").symlink_to("..")
    proc = _run("trajectory-replay", "inspect", str(capture), "--format", "json")
    assert (proc.returncode, proc.stderr) == (0, "")
    doc = json.loads(proc.stdout)
    assert [b["path"] for b in doc["bundles"]] == [str(capture / "a")]
    loop = "not followed (a loop: it points at a directory that holds it)"
    assert doc["skipped"] == [
        "gone: symbolic link → nowhere, not followed (it resolves to no path: dangling, a loop of links or a "
        "special file)",
        f"loop: symbolic link → ., {loop}",
        f"out: symbolic link → {outside.parent}, not followed (it leaves the directory)",
        f"root: symbolic link → /, {loop}",
        f"runs/back: symbolic link → .., {loop}",
        "self: symbolic link → /proc/self, not followed (it leaves the directory)",
        f"up: symbolic link → .., {loop}",
    ]
    proc = _run("trajectory-replay", "inspect", str(capture))
    assert (proc.returncode, proc.stderr) == (0, "")
    assert f"skipped: loop: symbolic link → ., {loop}" in proc.stdout.splitlines()


def test_inspect_of_links_only_finds_nothing_and_says_why(cli, tmp_path):
    capture = tmp_path / "capture"
    capture.mkdir()
    (capture / "loop").symlink_to(".")
    code, out, err = cli("inspect", capture)
    assert (code, out) == (3, "")
    assert err == (f"trajectory-replay: error: {capture}: no bundle found (no manifest.json, no COMPLETE, no bundle "
                   "subdirectories); not looked into: loop: symbolic link → ., not followed (a loop: it points at a "
                   "directory that holds it)\n")


def test_a_directory_of_many_links_names_the_first_few(cli, tmp_path):
    capture = tmp_path / "capture"
    capture.mkdir()
    for i in range(7):
        (capture / f"l{i}").symlink_to("/")
    code, _, err = cli("validate", capture)
    assert code == 3
    assert err.endswith("; symbolic links are not followed: l0, l1, l2, l3, l4, and 2 more\n"), err
    code, _, err = cli("inspect", capture)
    assert code == 3
    assert err.endswith("l4: symbolic link → /, not followed (a loop: it points at a directory that holds it); "
                        "and 2 more\n"), err


def test_inspect_skips_a_linked_rank_shard(cli, tmp_path):
    cohort = tmp_path / "cohort"
    write_bundle(cohort, *synthetic_parts(samples=4, tokens=3, bundle_id="k"), rank=0, ranks=[0, 1])
    outside = _bundle(tmp_path / "elsewhere", "x", 0)
    (cohort / "rank-1").symlink_to(outside)
    code, out, err = cli("inspect", cohort, "--format", "json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert [b["path"] for b in doc["bundles"]] == [str(cohort / "rank-0")]
    assert doc["skipped"] == [f"rank-1: symbolic link → {outside}, not followed (it leaves the directory)"]


def test_inspect_stops_at_its_depth_limit(cli, tmp_path):
    from replay_lib.bundle.inspection import MAX_DEPTH

    capture = tmp_path / "capture"
    deep = capture.joinpath(*["d"] * (MAX_DEPTH + 1))
    _bundle(deep / "x", "x", 0)
    _bundle(capture / "a", "a", 0)
    code, out, err = cli("inspect", capture, "--format", "json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert [b["bundle_id"] for b in doc["bundles"]] == ["a"]
    assert doc["skipped"] == [f"{os.path.join(*['d'] * (MAX_DEPTH + 1))}: deeper than {MAX_DEPTH} directories, "
                              "not looked into"]


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self is Linux's")
def test_inspect_of_proc_self_itself_stays_put():
    # the path named on the command line is followed; nothing under it is (its links lead everywhere)
    proc = _run("trajectory-replay", "inspect", "/proc/self", "--format", "json")
    assert (proc.returncode, proc.stdout) == (3, "")
    assert proc.stderr.startswith("trajectory-replay: error: /proc/self: no bundle found (no manifest.json, no "
                                  "COMPLETE, no bundle subdirectories); not looked into: ")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- the reader's own reads


def test_the_verifying_reader_reads_its_json_files_through_the_same_checks(cli, tmp_path):
    """Not only the lookup: the reader's own reads of manifest/index/expected and the sentinels are lstat-ed,
    opened without following, size-capped (``--max-json-bytes``) and never block."""
    b = write_bundle(tmp_path / "b", *synthetic_parts(samples=4, tokens=3, bundle_id="b"))
    size, name = max((p.stat().st_size, p.name) for p in b.iterdir() if p.is_file())
    code, out, err = cli("validate", b, "--max-json-bytes", str(size - 1))
    assert (code, out) == (3, "")
    assert err == (f"trajectory-replay: error: {b / name}: {name} is {size} bytes, over the "
                   f"{size - 1}-byte cap (raise it with --max-json-bytes)\n")
    assert cli("validate", b, "--max-json-bytes", str(size))[0] == 0  # at the cap: read
    # a FIFO where the sentinel should be: refused at once (a plain read would block forever)
    (b / "COMPLETE").unlink()
    os.mkfifo(b / "COMPLETE")
    proc = _run("trajectory-replay", "validate", str(b))
    assert proc.returncode == 3 and "Traceback" not in proc.stderr
    assert proc.stderr == f"trajectory-replay: error: {b / 'COMPLETE'}: COMPLETE is not a regular file (a FIFO)\n"
