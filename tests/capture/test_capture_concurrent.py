"""Two jobs into one capture directory, and SIGTERM mid-write (SPEC §6).

Real processes and real files: jobs started together (and one after the other) into one directory, a holder
killed with SIGKILL, a writer stopped with SIGTERM while it stages a bundle.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import capture.terminate
from capture import DisabledCapture
from capture_helpers import capture_env, subprocess_env
from replay_lib.run.runner import replay
from test_capture_restart import GUARD_S, _enable, _rollout

JOB = Path(__file__).with_name("capture_job.py")
RUN_TIMEOUT_S = 120
ROLLOUTS = ["rollout-0", "rollout-1", "rollout-2"]
HOST = socket.gethostname()


def _start(directory: Path, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(JOB), *args], env=subprocess_env(**capture_env(directory), **env),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, stdin: str = "") -> tuple[str, str]:
    try:
        out, err = proc.communicate(stdin, timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(GUARD_S)
    return out, err


def _busy(directory: Path, pid: int, since: str, rank: str = "", lock: str = ".capture.lock",
          where: str = "") -> str:
    where = where or f"RELAX_REPLAY_CAPTURE_DIR={str(directory)!r}"
    return (f"replay capture off for this job: {where} is being written by another job (pid {pid} on {HOST} "
            f"since {since}{rank}, lock {directory / lock}); set RELAX_REPLAY_CAPTURE_RUN_ID=<id> to write "
            f"under {directory}/<id>/, or use another directory")


def _record(directory: Path, lock: str = ".capture.lock") -> dict:
    return json.loads((directory / lock).read_text())


# ------------------------------------------------------------------------------------- two jobs, one dir


def test_a_second_job_trains_on_without_capture_and_the_first_loses_nothing(tmp_path):
    directory = tmp_path / "bundles"
    first = _start(directory, "job", "3", HOLD="1")
    try:
        assert first.stdout.readline() == "enabled\n"
        record = _record(directory)
        assert (record["pid"], record["host"], record["job"], record["rank"]) == (first.pid, HOST, None, None)
        second = _start(directory, "job", "3")
        out, err = _finish(second)
        assert second.returncode == 0, err  # the capture never ends the job
        assert out == "disabled\nwritten=0 errors=0 dropped=0\n"
        assert err == _busy(directory, first.pid, record["since"]) + "\n"  # one line, on stderr
        # the way out the line names: the same directory with a run id of its own
        third = _start(directory, "job", "3", RELAX_REPLAY_CAPTURE_RUN_ID="second")
        out, err = _finish(third)
        assert (third.returncode, out, err) == (0, "enabled\nwritten=3 errors=0 dropped=0\n", "")
        out, err = _finish(first, "\n")
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(GUARD_S)
    assert (first.returncode, out, err) == (0, "written=3 errors=0 dropped=0\n", "")
    # every entry: the first job's bundles, the run directory, and no lock left by a job that closed
    assert sorted(p.name for p in directory.iterdir()) == ROLLOUTS + ["second"]
    assert sorted(p.name for p in (directory / "second").iterdir()) == ROLLOUTS
    assert all(replay(directory / name).passed for name in ROLLOUTS)


def test_two_jobs_started_at_the_same_instant_one_captures_everything(tmp_path):
    directory = tmp_path / "bundles"
    go = tmp_path / "go"
    jobs = [_start(directory, "job", "3", GO_FILE=str(go), HOLD="1") for _ in range(2)]
    try:
        assert [job.stdout.readline() for job in jobs] == ["ready\n", "ready\n"]  # torch imported
        go.touch()
        decided = sorted(job.stdout.readline() for job in jobs)  # both enabled at once, neither has closed
        assert decided == ["disabled\n", "enabled\n"]
        results = [_finish(job, "\n") for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait(GUARD_S)
    assert [job.returncode for job in jobs] == [0, 0]
    outs = sorted(out for out, _ in results)
    assert outs == ["written=0 errors=0 dropped=0\n", "written=3 errors=0 dropped=0\n"]
    [winner] = [job for job, (out, _) in zip(jobs, results) if out.startswith("written=3")]
    [err] = [err for out, err in results if out.startswith("written=0")]
    assert err.startswith(f"replay capture off for this job: RELAX_REPLAY_CAPTURE_DIR={str(directory)!r} is being "
                          f"written by another job (pid {winner.pid} on {HOST} since ")
    assert err.count("\n") == 1
    assert sorted(p.name for p in directory.iterdir()) == ROLLOUTS


def test_a_killed_holder_never_blocks_the_next_job(tmp_path):
    directory = tmp_path / "bundles"
    holder = _start(directory, "job", "0", HOLD="1")
    try:
        assert holder.stdout.readline() == "enabled\n"
    finally:
        holder.kill()  # SIGKILL: no clean-up runs, the lock file stays
        holder.wait(GUARD_S)
    assert _record(directory)["pid"] == holder.pid
    cap = _enable(capture_env(directory))
    assert cap.enabled and _rollout(cap, 0) and cap.close(timeout=GUARD_S) and cap.stats.written == 1
    assert sorted(p.name for p in directory.iterdir()) == ["rollout-0"]


def test_ranks_of_one_job_share_the_directory_and_another_job_is_refused(tmp_path, caplog):
    job = capture_env(tmp_path, MASTER_ADDR="10.1.2.3", MASTER_PORT="29500")
    ranks = [_enable(job, dp_rank=r, dp_size=2) for r in range(2)]
    assert all(cap.enabled for cap in ranks)
    record = _record(tmp_path)
    assert (record["job"], record["rank"]) == ("rendezvous 10.1.2.3:29500", 0)
    with caplog.at_level(logging.WARNING, logger="capture"):
        other = _enable(dict(job, MASTER_PORT="29501"), dp_rank=0, dp_size=2)
        single = _enable(capture_env(tmp_path))
    expected = _busy(tmp_path, record["pid"], record["since"], " (rank 0)")
    assert isinstance(other, DisabledCapture) and other.reason == expected
    assert isinstance(single, DisabledCapture) and single.reason == expected
    assert [r.getMessage() for r in caplog.records] == [expected, expected]
    for r, cap in enumerate(ranks):
        assert _rollout(cap, 5, prefix=f"r{r}-") and cap.close(timeout=GUARD_S)
    assert replay(tmp_path / "rollout-5").passed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout-5"]


def test_a_loopback_rendezvous_is_qualified_by_the_host(tmp_path):
    cap = _enable(capture_env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"), dp_rank=1, dp_size=2)
    try:
        assert _record(tmp_path)["job"] == f"rendezvous 127.0.0.1@{HOST}:29500"
    finally:
        assert cap.close(timeout=GUARD_S)


def test_cohorts_without_a_rendezvous_are_told_apart_rank_by_rank(tmp_path):
    env = capture_env(tmp_path)
    ranks = [_enable(env, dp_rank=r, dp_size=2) for r in range(2)]
    assert all(cap.enabled for cap in ranks)
    record = _record(tmp_path, ".capture.rank-1.lock")
    other = _enable(env, dp_rank=1, dp_size=2)
    assert isinstance(other, DisabledCapture)
    assert other.reason == _busy(tmp_path, record["pid"], record["since"], " (rank 1)", ".capture.rank-1.lock")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".capture.lock", ".capture.lock.guard", ".capture.rank-0.lock", ".capture.rank-0.lock.guard",
        ".capture.rank-1.lock", ".capture.rank-1.lock.guard"]
    assert all(cap.close(timeout=GUARD_S) for cap in ranks)
    assert list(tmp_path.iterdir()) == []


def test_a_run_id_names_itself_in_the_refusal(tmp_path):
    env = capture_env(tmp_path, RELAX_REPLAY_CAPTURE_RUN_ID="r-1")
    first = _enable(env)
    try:
        record = _record(tmp_path / "r-1")
        second = _enable(env)
        assert second.reason == (
            f"replay capture off for this job: RELAX_REPLAY_CAPTURE_RUN_ID='r-1': {tmp_path / 'r-1'} is being "
            f"written by another job (pid {record['pid']} on {HOST} since {record['since']}, lock "
            f"{tmp_path / 'r-1' / '.capture.lock'}); set another RELAX_REPLAY_CAPTURE_RUN_ID")
    finally:
        assert first.close(timeout=GUARD_S)


def test_a_hostile_lock_record_is_escaped(tmp_path):
    first = _enable(capture_env(tmp_path))
    try:
        lock = tmp_path / ".capture.lock"
        record = dict(_record(tmp_path), host="evil\x1b[2J", since="\n")
        lock.write_text(json.dumps(record))
        second = _enable(capture_env(tmp_path))
        assert second.reason.startswith(f"replay capture off for this job: RELAX_REPLAY_CAPTURE_DIR={str(tmp_path)!r} "
                                        f"is being written by another job (pid {record['pid']} on evil\\x1b[2J since "
                                        "\\n, lock ")
        lock.write_text("not json")
        assert "another job (a process whose record cannot be read, lock" in _enable(capture_env(tmp_path)).reason
    finally:
        assert first.close(timeout=GUARD_S)


# ------------------------------------------------------------------------------------------------ SIGTERM


@pytest.mark.parametrize("slow_s, wait_s", [(0.5, None), (30.0, "0.5")], ids=["writer-stops", "writer-stuck"])
def test_sigterm_mid_write_leaves_no_staging_and_still_ends_the_process_by_sigterm(tmp_path, slow_s, wait_s):
    directory = tmp_path / "bundles"
    extra = {"SLOW_S": str(slow_s)} | ({"SIGTERM_WAIT_S": wait_s} if wait_s else {})
    proc = _start(directory, "sigterm", **extra)
    try:
        assert proc.stdout.readline() == "published\n"
        line = proc.stdout.readline()
        assert line.startswith("staging ")
        staging = Path(line.split(" ", 1)[1].strip())
        assert staging.is_dir() and staging.name.startswith(f".rollout-1.tmp-{proc.pid}-")
        proc.send_signal(signal.SIGTERM)
        out, err = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(GUARD_S)
    assert proc.returncode == -signal.SIGTERM, err
    assert not staging.exists()
    assert sorted(p.name for p in directory.iterdir()) == ["rollout-0"]  # no staging, no lock
    assert replay(directory / "rollout-0").passed
    if wait_s is None:  # the writer stopped at its next step and said why
        assert err == ("replay capture: writing rollout-1 failed: rollout-1: not published, the process is "
                       "terminating (SIGTERM) (1 error(s) so far)\n")


def _handler_after(enable) -> object:
    cap = enable()
    try:
        return signal.getsignal(signal.SIGTERM)
    finally:
        assert cap.close(timeout=GUARD_S)


def test_the_sigterm_handler_is_installed_over_the_default_only_and_removed_at_close(tmp_path):
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert _handler_after(lambda: _enable(capture_env(tmp_path))) is capture.terminate._on_sigterm
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert not capture.terminate._captures

    def framework_handler(signum, frame):
        pass

    for theirs in (framework_handler, signal.SIG_IGN):
        previous = signal.signal(signal.SIGTERM, theirs)
        try:
            assert _handler_after(lambda: _enable(capture_env(tmp_path))) is theirs
            assert signal.getsignal(signal.SIGTERM) is theirs
        finally:
            signal.signal(signal.SIGTERM, previous)


def test_a_capture_enabled_off_the_main_thread_installs_nothing(tmp_path):
    caps = []
    thread = threading.Thread(target=lambda: caps.append(_enable(capture_env(tmp_path))))
    thread.start()
    thread.join(GUARD_S)
    [cap] = caps
    try:
        assert cap.enabled and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert _rollout(cap, 0)
    finally:
        assert cap.close(timeout=GUARD_S)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout-0"]
