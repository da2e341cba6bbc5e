"""A bundle directory that cannot be read (mode 000: EACCES on every ``stat`` of a name in it and on its listing)
is never silently left out, nor a traceback: ``scan`` gives it a row and an exit code, ``replay DIR`` refuses to
choose without it, and ``replay`` / ``validate`` of it exit 3 naming it.

Root reads any directory, so the checks run in a forked child that has given up root for ``nobody`` (or in this
process when it is not root): the real code paths (``lstat``, ``stat``, ``scandir`` raising PermissionError) on a
real tree under a world-readable temporary directory. The child runs nothing that computes (no torch kernels after
a fork): the readable bundle's row is computed here."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from replay_lib.cli import main
from replay_lib.cli.scan import result_lines
from replay_lib.run.rows import ScanResult, first_bad_row
from replay_lib.run.scan import check_target, discover, scan_exit_code

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _unprivileged_ids():
    import grp
    import pwd

    try:
        return pwd.getpwnam("nobody").pw_uid, grp.getgrnam("nogroup" if _has_group("nogroup") else "nobody").gr_gid
    except KeyError:
        return None


def _has_group(name: str) -> bool:
    import grp

    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


def _as_unprivileged(fn, timeout: float = 60.0):
    """``fn()`` (returning JSON) in a forked child without root's rights; its result, or its exception's text."""
    ids = _unprivileged_ids() if os.geteuid() == 0 else (os.getuid(), os.getgid())
    if ids is None:
        pytest.skip("running as root and there is no 'nobody' user to drop to")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(ids[1])
                os.setuid(ids[0])
            try:
                out = {"result": fn()}
            except BaseException as exc:  # reported to the parent, which fails the test with it
                out = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(w, json.dumps(out).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError(f"the unprivileged child did not finish within {timeout} s")
        time.sleep(0.02)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the unprivileged child failed"
    out = json.loads(data)
    assert "error" not in out, out.get("error")
    return out["result"]


def _cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def capture():
    """``cap/good`` (a clean bundle) and ``cap/locked`` (the same, mode 000) under a world-readable directory;
    each CLI command runs here once first, so that every module the child needs is already imported."""
    root = Path(tempfile.mkdtemp(prefix="unreadable-", dir="/tmp"))
    cap = root / "cap"
    try:
        for name in ("good", "locked"):
            assert _cli("demo", "write", str(cap / name))[0] == 0
        for d, _, files in os.walk(root):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)
        for argv in (("replay", cap / "good"), ("validate", cap / "good"), ("replay", cap)):
            _cli(*map(str, argv))
        [check_target(t) for t in discover(cap)]
        os.chmod(cap / "locked", 0)
        yield cap
    finally:
        os.chmod(cap / "locked", 0o755)
        shutil.rmtree(root)


def test_scan_gives_an_unreadable_bundle_a_row_and_exit_3(capture):
    """Before: ``lexists`` is False on EACCES, so the locked directory was no candidate — "1 bundle(s) scanned:
    1 pass", exit 0."""
    from replay_lib.run.rows import ScanTarget, error_row

    locked = capture / "locked"

    def child():
        targets = discover(capture)
        row = check_target(next(t for t in targets if t.relpath == "locked"))
        fields = [(t.relpath, t.kind, t.rollout_id, t.step_id, t.anchor, t.problem) for t in targets]
        return fields, row.status, row.exit_code, row.message

    listed, status, code, message = _as_unprivileged(child)
    assert listed == [["good", "step", 7, 0, "7:0", None],
                      ["locked", "unknown", None, None, "?", "cannot read: Permission denied"]]
    assert (status, code, message) == ("invalid", 3, f"{locked}: cannot read: Permission denied")
    # the scan's rows: the readable bundle's computed here (as root), the locked one's as the child saw it
    good = next(t for t in discover(capture) if t.relpath == "good")
    rows = [check_target(good), error_row(ScanTarget(locked, *listed[1]), status, message)]
    result = ScanResult(rows=rows, links=[], first_bad=first_bad_row(rows), exit_code=scan_exit_code(rows))
    assert result.exit_code == 3
    assert [line for _, line in result_lines(result, 2)] == [
        "[       pass] step 7:0       good",
        f"[    invalid] ?              locked — {locked}: cannot read: Permission denied",
        "2 bundle(s) scanned: 1 pass, 1 invalid", "first bad step: none"]


def test_replay_and_validate_of_an_unreadable_bundle_exit_3_naming_it(capture):
    """Before: ``Path.exists()`` raised PermissionError in ``resolve_bundle``: exit 5, an internal error."""
    locked = capture / "locked"
    got = _as_unprivileged(lambda: [_cli(cmd, str(locked)) for cmd in ("replay", "validate")])
    line = f"trajectory-replay: error: {locked}: cannot read: Permission denied\n"
    assert got == [[3, "", line], [3, "", line]]


def test_replay_of_the_capture_directory_does_not_pick_the_readable_bundle(capture):
    """Before: the locked directory was no candidate, so ``replay cap`` replayed ``good`` as if it were the only
    bundle (exit 0). Now the directory that cannot be looked into is named (exit 3), with or without --step."""
    got = _as_unprivileged(lambda: [_cli("replay", str(capture)), _cli("replay", str(capture), "--step", "1:0")])
    line = (f"trajectory-replay: error: {capture / 'locked'}: cannot read: Permission denied (a subdirectory of the "
            f"capture directory {capture}, which may hold a bundle; pass one bundle's own path)\n")
    assert got == [[3, "", line], [3, "", line]]
