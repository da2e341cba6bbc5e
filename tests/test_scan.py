"""``trajectory-replay scan DIR`` (SPEC §9): discovery and order, rows and summary, exit codes, JSON, and
bad input — an empty directory, only invalid bundles, a bundle that vanishes, a worker that is killed,
Ctrl+C, --fail-fast. The bundles are written by the real writer; the CLI runs as a real process where the
output, the exit code or a signal is what is tested."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from replay_lib.demo import ROLLOUT_STAGES, synthetic_parts, write_bundle, write_cohort, write_pr65, write_synthetic
from replay_lib.judge.report import report_to_json
from replay_lib.run.scan import ScanOptions, check_target, discover, scan, scan_exit_code
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import ActorStepId

SCAN = [sys.executable, "-m", "replay_lib", "scan"]


def _run(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([*SCAN, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def _step(path: Path, rollout: int, step: int, **kw) -> Path:
    return write_synthetic(path, samples=8, tokens=16, kl_coef=0.0, bundle_id=path.name,
                           anchor=ActorStepId(rollout_id=rollout, step_id=step), **kw)


def _rollout7(path: Path) -> Path:
    """The rollout-level bundle of rollout 7 whose payloads are those of ``_step(…, 7, 0)`` (one seed)."""
    return write_bundle(path, *synthetic_parts(samples=8, tokens=16, kl_coef=0.0, anchor=None,
                                               stages=ROLLOUT_STAGES, bundle_id=path.name))


def _broken(path: Path) -> Path:
    path.mkdir()
    (path / "manifest.json").write_text("{")
    return path


def _unsupported(path: Path) -> Path:
    """A bundle whose config sets a knob this engine does not know: refused by name (exit 4)."""
    _step(path, 4, 0)
    index = json.loads((path / "index.json").read_text())
    index["config"]["future_knob"] = 0.5
    (path / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _seal_metadata(path)
    return path


def _seal_metadata(bundle: Path) -> None:
    """Re-record the sha256 of the three JSON files in every sentinel (payload hashes untouched)."""
    metadata = {n: hashlib.sha256((bundle / n).read_bytes()).hexdigest()
                for n in ("manifest.json", "index.json", "expected.json")}
    for sentinel in bundle.glob("COMPLETE*"):
        doc = json.loads(sentinel.read_text())
        doc["metadata"] = metadata
        sentinel.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


SLOW_BYTES = 1 << 30


def _slow(path: Path, rollout: int, size: int = SLOW_BYTES) -> Path:
    """A step bundle whose ``advantages`` payload is a sparse 1 GiB file that the manifest declares at that
    size: its replay spends seconds hashing it (then fails its checksum) — long enough to be killed or
    interrupted in the middle, and the test sees when a worker has the file open."""
    _step(path, rollout, 0)
    os.truncate(path / "payloads" / "advantages.safetensors", size)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["payloads"]["advantages"]["bytes"] = size
    manifest["payloads"]["advantages"].pop("chunks", None)  # no chunk list: hashed whole, as the test needs
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _seal_metadata(path)
    return path / "payloads" / "advantages.safetensors"


def _holders(file: Path) -> list[int]:
    """Pids of the processes that have ``file`` open (from /proc)."""
    target, out = str(file.resolve()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{pid}/fd")):
                out.append(int(pid))
        except OSError:
            continue
    return out


def _wait_for_holder(file: Path, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        holders = [p for p in _holders(file) if p != os.getpid()]
        if holders:
            return holders[0]
        time.sleep(0.02)
    raise AssertionError(f"no process opened {file} within {timeout} s")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """rollout 7 + its step 7:0 (linked, clean), PR #65's buggy rollout 120, an invalid bundle."""
    root = tmp_path_factory.mktemp("run")
    _rollout7(root / "rollout-7")
    _step(root / "step-7-0", 7, 0)
    write_pr65(root / "pr65", buggy=True)  # rollout 120, bundle b-00001
    _broken(root / "broken")
    return root


def test_discover_orders_by_rollout_then_step_and_skips_what_resolve_capture_skips(tmp_path):
    _step(tmp_path / "z-step-2-1", 2, 1)
    _step(tmp_path / "a-step-10-0", 10, 0)
    _rollout7(tmp_path / "m-rollout-7")
    _step(tmp_path / "b-step-7-3", 7, 3)
    write_cohort(tmp_path / "cohort", samples=4, tokens=4, group_size=4)  # step 7:0 on 2 ranks
    _broken(tmp_path / "broken")
    _step(tmp_path / ".hidden", 1, 0)  # hidden: a writer's staging directory
    os.symlink(tmp_path / "z-step-2-1", tmp_path / "link-to-step")  # links are not followed
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty-dir").mkdir()
    got = [(t.relpath, t.kind, t.anchor, t.rollout_id, t.step_id) for t in discover(tmp_path)]
    assert got == [
        ("z-step-2-1", "step", "2:1", 2, 1),
        ("m-rollout-7", "rollout", "rollout 7", 7, None),  # a rollout before the steps of its rollout
        ("cohort", "cohort", "7:0", 7, 0),
        ("b-step-7-3", "step", "7:3", 7, 3),
        ("a-step-10-0", "step", "10:0", 10, 0),
        ("broken", "unknown", "?", None, None),  # unreadable identity: last
    ]
    # a bundle's own path is one target
    assert [t.relpath for t in discover(tmp_path / "b-step-7-3")] == ["b-step-7-3"]


def test_scan_text_rows_in_order_first_bad_step_and_no_progress_bar_in_a_pipe(run_dir):
    proc = _run(run_dir, "--jobs", "2")
    assert proc.returncode == 1, proc.stderr  # a divergence outranks the invalid bundle (SPEC §9)
    assert proc.stderr == ""  # piped: no progress bar
    lines = proc.stdout.splitlines()
    assert lines[0] == "[       pass] rollout 7      rollout-7"
    assert lines[1] == "[       pass] step 7:0       step-7-0"
    assert lines[2] == ("[   diverged] rollout 120    b-00001 (pr65) — reward.post_process: "
                        "reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5")
    # the row's likely cause under it (its first divergent stage's best explanation)
    assert lines[3] == ("              likely cause: the recorded rewards equal group normalization over the whole "
                        "batch of 4 samples (not semantic groups)")
    assert lines[4] == f"[    invalid] ?              broken — {run_dir / 'broken' / 'index.json'}: missing index.json"
    assert lines[5:] == [
        "4 bundle(s) scanned: 2 pass, 1 diverged, 1 invalid; link: 1 step(s) checked against their rollout "
        "bundle, 0 diverged",
        "first bad step: rollout 120 (b-00001) — reward.post_process",
    ]


def test_scan_json_is_each_bundles_replay_report_plus_the_summary(run_dir):
    proc = _run(run_dir, "--jobs", "2", "--format", "json")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    rows = doc["bundles"]
    assert [(r["path"], r["status"], r["exit_code"]) for r in rows] == [
        ("rollout-7", "pass", 0), ("step-7-0", "pass", 0), ("pr65", "diverged", 1), ("broken", "invalid", 3)]
    assert [r["cause"] for r in rows] == [None, None, "the recorded rewards equal group normalization over the "
                                          "whole batch of 4 samples (not semantic groups)", None]
    # a row's report is `replay --format json` of its bundle; the step's has stage link appended
    assert rows[2]["report"] == json.loads(report_to_json(replay(run_dir / "pr65")))
    alone = json.loads(report_to_json(replay(run_dir / "step-7-0")))
    assert rows[1]["report"]["stages"][:-1] == alone["stages"]
    link = rows[1]["report"]["stages"][-1]
    # advantages + old_log_probs of 8 samples × 16 tokens: 256 tokens, all bit-equal
    assert (link["stage"], link["status"], link["compared"], link["mismatches"]) == ("link", "pass", 256, 0)
    assert rows[3]["report"] is None
    assert doc["summary"] == {
        "bundles": 4, "scanned": 4, "exit_code": 1, "interrupted": False, "unfinished": [],
        "counts": {"pass": 2, "diverged": 1, "invalid": 1, "unsupported": 0, "error": 0, "vanished": 0},
        "first_bad": {"anchor": "rollout 120", "path": "pr65", "bundle_id": "b-00001",
                      "stage": "reward.post_process",
                      "first_divergence": "reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5"},
    }
    assert [(l["step"], l["rollout"], l["status"]) for l in doc["links"]] == [("step-7-0", "rollout-7", "pass")]


def test_exit_codes_diverged_then_invalid_then_unsupported(tmp_path):
    rows = {}
    for name, make in (("a", lambda p: _step(p, 1, 0)), ("b", _broken), ("c", _unsupported),
                       ("d", lambda p: write_pr65(p, buggy=True))):
        make(tmp_path / name)
    for t in discover(tmp_path):
        rows[t.relpath] = check_target(t, ScanOptions())
    assert {k: (r.status, r.exit_code) for k, r in rows.items()} == {
        "a": ("pass", 0), "b": ("invalid", 3), "c": ("unsupported", 4), "d": ("diverged", 1)}
    assert rows["c"].message == (f"{tmp_path / 'c' / 'index.json'}: $.config.future_knob=0.5: unknown config knob; "
                                 f"refusing to guess what it changes")
    code = lambda *names: scan_exit_code([rows[n] for n in names])  # noqa: E731
    assert (code("a"), code("a", "c"), code("a", "b", "c"), code("a", "b", "c", "d")) == (0, 4, 3, 1)


def test_an_empty_directory_is_one_line_exit_3(tmp_path):
    proc = _run(tmp_path)
    assert (proc.returncode, proc.stdout) == (3, "")
    assert proc.stderr == (f"trajectory-replay: error: {tmp_path}: no bundle found (no manifest.json, no bundle "
                           f"subdirectories)\n")


def test_only_invalid_bundles_give_a_row_each_and_exit_3(tmp_path):
    _broken(tmp_path / "one")
    _step(tmp_path / "two", 3, 0)
    (tmp_path / "two" / "payloads" / "advantages.safetensors").unlink()
    proc = _run(tmp_path, "--jobs", "1")
    assert proc.returncode == 3 and "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    missing = tmp_path / "two" / "payloads" / "advantages.safetensors"
    assert lines[0] == (f"[    invalid] step 3:0       two — {missing}: missing "
                        f"payload listed in manifest.json $.payloads.advantages")
    assert lines[1] == f"[    invalid] ?              one — {tmp_path / 'one' / 'index.json'}: missing index.json"
    assert lines[2:] == ["2 bundle(s) scanned: 2 invalid", "first bad step: none"]


def test_a_bundle_that_vanishes_after_discovery_is_a_row_saying_so(tmp_path):
    _step(tmp_path / "keep", 1, 0)
    _step(tmp_path / "gone", 2, 0)
    targets = discover(tmp_path)
    shutil.rmtree(tmp_path / "gone")
    result = scan(targets, jobs=1)
    assert [(r.target.relpath, r.status, r.exit_code) for r in result.rows] == [("keep", "pass", 0),
                                                                              ("gone", "vanished", 3)]
    assert result.rows[1].message == f"{tmp_path / 'gone'}: vanished during the scan (listed, then gone)"
    assert result.exit_code == 3 and not result.interrupted


def test_a_bundle_removed_while_it_is_replayed_is_a_vanished_row(tmp_path):
    slow = _slow(tmp_path / "slow", 1, size=1 << 28)
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=scan(discover(tmp_path), jobs=1)))
    thread.start()
    _wait_for_holder(slow)  # its worker is hashing the payload
    shutil.rmtree(tmp_path / "slow")
    thread.join(120)
    assert not thread.is_alive()
    [row] = out["result"].rows
    assert (row.status, row.exit_code) == ("vanished", 3)
    assert row.message.startswith(f"{tmp_path / 'slow'}: vanished during the scan")


def test_a_killed_worker_is_an_error_row_and_the_other_bundles_are_scanned_on(tmp_path):
    slow = _slow(tmp_path / "slow", 1)
    _step(tmp_path / "after", 2, 0)
    seen, out = [], {}
    thread = threading.Thread(target=lambda: out.update(result=scan(discover(tmp_path), jobs=1, on_row=seen.append)))
    thread.start()
    os.kill(_wait_for_holder(slow), signal.SIGKILL)  # the worker, while it hashes the slow bundle
    thread.join(120)
    assert not thread.is_alive()
    result = out["result"]
    assert [(r.target.relpath, r.status, r.exit_code) for r in result.rows] == [("slow", "error", 5),
                                                                              ("after", "pass", 0)]
    assert result.rows[0].message == (f"{tmp_path / 'slow'}: the worker replaying it died (killed by SIGKILL); "
                                      f"the other bundles were scanned on")
    assert sorted(r.target.relpath for r in seen) == ["after", "slow"]  # on_row: once per row
    assert result.exit_code == 5


def test_ctrl_c_stops_the_workers_and_prints_what_finished(tmp_path):
    _step(tmp_path / "first", 1, 0)
    slow = _slow(tmp_path / "slow", 2)
    proc = subprocess.Popen([*SCAN, str(tmp_path), "--jobs", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    worker = _wait_for_holder(slow)  # "first" is done: its only worker moved on to "slow"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err
    assert out.splitlines() == ["[       pass] step 1:0       first", "1 of 2 bundle(s) scanned: 1 pass",
                                "first bad step: none", "interrupted: 1 bundle(s) not scanned"]
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _holders(slow), "a worker still reads the slow bundle after the scan returned"


def test_fail_fast_stops_at_the_first_diverged_bundle(tmp_path):
    write_pr65(tmp_path / "pr65", buggy=True)  # rollout 120
    _slow(tmp_path / "later", 200)
    result = scan(discover(tmp_path), jobs=1, fail_fast=True)
    assert [(r.target.relpath, r.status) for r in result.rows] == [("pr65", "diverged")]
    assert [t.relpath for t in result.unfinished] == ["later"]
    assert (result.exit_code, result.interrupted, result.first_bad.target.relpath) == (1, False, "pr65")
    from replay_lib.cli.scan import summary_lines

    assert summary_lines(result, 2)[-1] == (
        "warning", "stopped at the first diverged bundle (--fail-fast): 1 bundle(s) not scanned")


def test_a_progress_bar_is_drawn_on_a_terminal(tmp_path):
    import pty

    _step(tmp_path / "only", 1, 0)
    master, slave = pty.openpty()
    proc = subprocess.Popen([*SCAN, str(tmp_path), "--jobs", "1"], stdout=subprocess.PIPE, stderr=slave,
                            env=dict(os.environ, TERM="xterm", COLUMNS="100"))
    os.close(slave)
    out, _ = proc.communicate(timeout=120)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    assert proc.returncode == 0
    assert b"scan" in drawn and b"1/1" in drawn  # the bar's label and its count, on the terminal (stderr)
    assert out.decode().splitlines()[-1] == "first bad step: none"  # the rows still on stdout


def test_workers_that_cannot_start_end_the_scan_with_a_row_each_instead_of_respawning(tmp_path, monkeypatch):
    """Every worker exits before it is ready: after three such starts the bundles left become error rows
    naming how the last one ended; the scan returns."""
    from replay_lib.run import executor

    _step(tmp_path / "a", 1, 0)
    _step(tmp_path / "b", 2, 0)
    code = "import sys; sys.stderr.write('no torch here\\n'); sys.exit(3)"
    monkeypatch.setattr(executor, "worker_command", lambda *fds: [sys.executable, "-c", code])
    result = scan(discover(tmp_path), jobs=2)
    why = "not scanned: no worker process could start (exited with status 3: no torch here; 3 times)"
    assert [(r.target.relpath, r.status, r.message) for r in result.rows] == [
        ("a", "error", f"{tmp_path / 'a'}: {why}"), ("b", "error", f"{tmp_path / 'b'}: {why}")]
    assert result.exit_code == 5


def test_bundle_text_never_reaches_the_terminal_unescaped(tmp_path, capsys):
    """A directory name and a bundle id holding escape sequences (clear screen, OSC 52 clipboard write)
    show as visible escapes in the rows, the summary and the JSON."""
    from replay_lib.cli import main

    evil = tmp_path / "step\x1b[2J"
    write_synthetic(evil, samples=4, tokens=4, kl_coef=0.0, bundle_id="b\x1b]52;c;QUJD\x07",
                    anchor=ActorStepId(rollout_id=1, step_id=0))
    (evil / "payloads" / "advantages.safetensors").unlink()  # invalid: the reader's message names the path too
    write_synthetic(tmp_path / "ok", samples=4, tokens=4, kl_coef=0.0, bundle_id="b\x1b]52;c;QUJD\x07",
                    anchor=ActorStepId(rollout_id=2, step_id=0))
    assert main(["scan", str(tmp_path), "--jobs", "1"]) == 3
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert out.splitlines()[:2] == [
        f"[    invalid] step 1:0       step\\x1b[2J — {tmp_path}/step\\x1b[2J/payloads/advantages.safetensors: missing payload "
        f"listed in manifest.json $.payloads.advantages",
        "[       pass] step 2:0       b\\x1b]52;c;QUJD\\x07 (ok)"]
    assert main(["scan", str(tmp_path), "--jobs", "1", "--format", "json"]) == 3
    out = capsys.readouterr().out
    assert "\x1b" not in out and json.loads(out)["bundles"][0]["path"] == "step\x1b[2J"


def test_an_unreadable_bundle_is_an_invalid_row_not_an_internal_error(tmp_path, monkeypatch):
    """An OSError while reading (here a permission error, which root never gets from the file system
    itself) names the file and is invalid input (exit 3), not a bug of the tool (exit 5)."""
    import replay_lib.bundle

    _step(tmp_path / "locked", 1, 0)
    index = tmp_path / "locked" / "index.json"

    def denied(path, **kwargs):
        raise PermissionError(13, "Permission denied", str(index))

    monkeypatch.setattr(replay_lib.bundle, "open_bundle", denied)
    [target] = discover(tmp_path)
    row = check_target(target, ScanOptions())
    assert (row.status, row.exit_code, row.message) == ("invalid", 3, f"{index}: cannot read: Permission denied")


# A worker whose replay of a bundle named "stuck…" says so (its pid in $REPLAY_TEST_MARK) inside run_replay — after
# the bundle was opened and verified, while the stages run — and then does not return.
STUCK_REPLAY = """
import os, time
import replay_lib.run.runner as runner
real = runner.run_replay
def run_replay(bundles, **kw):
    if bundles.path.name.startswith("stuck"):
        mark = os.environ["REPLAY_TEST_MARK"]
        with open(mark + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(mark + ".tmp", mark)
        time.sleep(3600)
    return real(bundles, **kw)
runner.run_replay = run_replay
"""
STUCK_WORKER = STUCK_REPLAY + """
import sys
from replay_lib.run import worker
sys.exit(worker.main(sys.argv))
"""


def _stuck_workers(monkeypatch, tmp_path: Path) -> Path:
    from replay_lib.run import executor

    mark = tmp_path / "replaying.pid"  # a file: never a scan candidate
    monkeypatch.setenv("REPLAY_TEST_MARK", str(mark))
    monkeypatch.setattr(executor, "worker_command",
                        lambda *args: [sys.executable, "-c", STUCK_WORKER, *map(str, args[:2]), "1" if args[2] else "0"])
    return mark


def _wait_for_mark(mark: Path, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if mark.exists():
            return int(mark.read_text())
        time.sleep(0.02)
    raise AssertionError(f"no worker started replaying the stuck bundle within {timeout} s")


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return False  # killed but never reaped
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_worker_killed_while_it_replays_is_an_error_row_and_a_new_one_scans_on(tmp_path, monkeypatch):
    """The worker is killed in the middle of the replay (the bundle opened and verified, the stages running), not
    while idle or reading: the bundle is an error row naming the signal, the worker is reaped, and a new worker
    replays the bundles after it."""
    mark = _stuck_workers(monkeypatch, tmp_path)
    _step(tmp_path / "stuck", 1, 0)
    _step(tmp_path / "after", 2, 0)
    write_pr65(tmp_path / "pr65", buggy=True)  # rollout 120
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=scan(discover(tmp_path), jobs=1)))
    thread.start()
    pid = _wait_for_mark(mark)
    os.kill(pid, signal.SIGKILL)
    thread.join(120)
    assert not thread.is_alive()
    result = out["result"]
    assert [(r.target.relpath, r.status, r.exit_code) for r in result.rows] == [
        ("stuck", "error", 5), ("after", "pass", 0), ("pr65", "diverged", 1)]
    assert result.rows[0].message == (f"{tmp_path / 'stuck'}: the worker replaying it died (killed by SIGKILL); "
                                      f"the other bundles were scanned on")
    assert result.exit_code == 1 and _gone(pid)


def test_a_bundle_over_the_time_limit_is_an_error_row_its_worker_killed_and_replaced(tmp_path, monkeypatch):
    """--timeout: a replay that does not end within the limit is an error row naming it, its worker process is
    killed (and reaped) and replaced, and the bundles after it are scanned."""
    mark = _stuck_workers(monkeypatch, tmp_path)
    _step(tmp_path / "stuck", 1, 0)
    _step(tmp_path / "after", 2, 0)
    result = scan(discover(tmp_path), jobs=1, options=ScanOptions(timeout=3.0))
    assert [(r.target.relpath, r.status, r.exit_code) for r in result.rows] == [("stuck", "error", 5),
                                                                              ("after", "pass", 0)]
    assert result.rows[0].message == (f"{tmp_path / 'stuck'}: not replayed within the time limit of 3 s (--timeout); "
                                      f"its worker process was killed and replaced; the other bundles were scanned on")
    assert result.rows[0].seconds >= 3.0
    assert result.exit_code == 5 and _gone(_wait_for_mark(mark))


def test_the_time_limit_in_a_real_process(tmp_path):
    """``scan --timeout``: the row and the exit code in the CLI (a 1 GiB payload to hash takes longer than a
    millisecond), a negative limit is a usage error, and the help names the default."""
    _slow(tmp_path / "slow", 1)
    proc = _run(tmp_path, "--jobs", "1", "--timeout", "0.001")
    assert (proc.returncode, proc.stderr) == (5, "")
    assert proc.stdout.splitlines() == [
        f"[      error] step 1:0       slow — {tmp_path / 'slow'}: not replayed within the time limit of 0.001 s "
        f"(--timeout); its worker process was killed and replaced; the other bundles were scanned on",
        "1 bundle(s) scanned: 1 error", "first bad step: none"]
    bad = _run(tmp_path, "--timeout", "-5")
    assert (bad.returncode, bad.stdout, bad.stderr) == (
        2, "", "trajectory-replay: error: --timeout must be a number of seconds, 0 for no limit (got -5)\n")
    assert "(default: 600; 0: no limit)" in " ".join(_run("--help").stdout.split())
