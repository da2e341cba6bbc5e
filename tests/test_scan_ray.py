"""``scan --executor ray``: the same rows as the local workers, as Ray tasks on a local ``ray.init()``.

Marked ``ray`` (deselected from the default run, which does not install the optional extra): ``.ci/run``
installs ``.[ray]`` and runs this file on its own (≈ 10–20 s on two cores, most of it Ray's start)."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time

import pytest

# collected by every run; it runs where the extra is installed (.ci/run installs it, then selects -m ray)
ray = pytest.importorskip("ray", reason="needs the optional extra [ray]")

from test_link import _pair
from test_scan import STUCK_REPLAY, _slow, _step, _wait_for_holder

from replay_lib.demo import write_pr65
from replay_lib.run.scan import discover, scan

pytestmark = pytest.mark.ray


# Imported by every Ray worker of the test below (PYTHONPATH in the runtime env): the replay of a bundle named
# "stuck…" records its worker's pid and does not return.
STUCK_HOOK = 'import os\nif os.environ.get("REPLAY_TEST_MARK"):\n' + textwrap.indent(STUCK_REPLAY, "    ")


def test_a_ray_task_over_the_time_limit_is_an_error_row_its_worker_killed(tmp_path):
    """--timeout under --executor ray: the task still running 10 s after its submission is cancelled with force
    (its worker process is killed), its bundle is an error row naming the limit, and the next bundle is scanned
    on a new worker. (First in this file: it starts its own Ray, with the hook in its workers' environment.)"""
    from replay_lib.run.rows import ScanOptions

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STUCK_HOOK)
    mark = tmp_path / "stuck.pid"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
           "REPLAY_TEST_MARK": str(mark)}
    bundles = tmp_path / "run"
    _step(bundles / "stuck", 1, 0)
    _step(bundles / "after", 2, 0)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": env})
    try:
        result = scan(discover(bundles), jobs=1, executor="ray", options=ScanOptions(timeout=10.0))
        pid = int(mark.read_text())
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:  # killed, not left sleeping
            time.sleep(0.1)
        worker_left = os.path.exists(f"/proc/{pid}")
    finally:
        ray.shutdown()
    assert not worker_left, "the stuck task's worker process was still there after the scan (before Ray's shutdown)"
    assert [(r.target.relpath, r.status, r.exit_code) for r in result.rows] == [("stuck", "error", 5),
                                                                              ("after", "pass", 0)]
    assert result.rows[0].message == (
        f"{bundles / 'stuck'}: not replayed within the time limit of 10 s (--timeout); its Ray task was cancelled "
        f"and its worker process killed; the other bundles were scanned on")
    assert result.exit_code == 5


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def _summary(result):
    return [(r.target.relpath, r.status, r.exit_code, r.first_stage, r.first_divergence) for r in result.rows]


def test_ray_tasks_give_the_rows_of_the_local_workers(tmp_path, local_ray):
    def edit(payloads):
        payloads["old_log_probs"] = payloads["old_log_probs"].clone()
        payloads["old_log_probs"][19] = -1.25  # s-1, token 3: only stage link sees it

    _pair(tmp_path, rollout_edit=edit)
    write_pr65(tmp_path / "pr65", buggy=True)
    targets = discover(tmp_path)
    seen = []
    on_ray = scan(targets, jobs=2, executor="ray", on_row=seen.append)
    assert sorted(r.target.relpath for r in seen) == ["pr65", "rollout-7", "step-7-0"]
    local = scan(targets, jobs=2)
    assert _summary(on_ray) == _summary(local)
    assert [(r[0], r[1], r[3]) for r in _summary(on_ray)] == [
        ("rollout-7", "pass", None), ("step-7-0", "diverged", "link"), ("pr65", "diverged", "reward.post_process")]
    assert [r.report for r in on_ray.rows] == [r.report for r in local.rows]
    assert on_ray.exit_code == 1 and not on_ray.interrupted


def test_a_killed_ray_worker_is_an_error_row(tmp_path, local_ray):
    slow = _slow(tmp_path / "slow", 1)
    _step(tmp_path / "after", 2, 0)
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=scan(discover(tmp_path), jobs=1, executor="ray")))
    thread.start()
    os.kill(_wait_for_holder(slow), signal.SIGKILL)
    thread.join(120)
    assert not thread.is_alive()
    rows = out["result"].rows
    assert [(r.target.relpath, r.status) for r in rows] == [("slow", "error"), ("after", "pass")]
    assert rows[0].message.startswith(f"{tmp_path / 'slow'}: the Ray task replaying it failed (")
    assert out["result"].exit_code == 5
