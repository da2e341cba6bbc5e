"""loss.policy's token pass split between the stage's thread and a forked worker (stages/split.py): the same bits as
one pass, through the CLI's own replay path; a child that fails or hangs has its blocks redone by the parent; an
interrupted parent leaves no child behind; another thread alive keeps the worker a thread.

The forked path runs in fresh processes (the test runner's workers have threads of their own, so a replay in them
takes the thread worker): each script prints one JSON line that the tests assert on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from replay_lib.bundle import open_bundle
from replay_lib.demo import write_synthetic
from replay_lib.judge.report import report_to_json
from replay_lib.run.runner import replay_run
from replay_lib.stages import loss as loss_mod
from replay_lib.stages import split as split_mod
from test_loss_pass_speed import _bits

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the forked worker is Linux-only")


def _python(script: str, *args: str, timeout: float = 120) -> dict:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout  # nothing else on stdout: no child wrote to it
    return json.loads(lines[0])


# One replay through `runner.replay` (the CLI's path: checksums deferred, the hashing thread ended before the fork)
# with the split forced on a small step and this process's blocks slowed, so the child surely takes some.
REPLAY_SCRIPT = r"""
import json, os, sys, time, torch
import replay_lib.run.runner as runner
from replay_lib.judge.report import report_to_json
from replay_lib.stages import loss, split
loss.LARGE_PASS = 0
runner.pass_threads = lambda: 2
forks, taken = [], []
real_fork = os.fork
def fork():
    pid = real_fork()
    if pid:
        forks.append(pid)
    return pid
os.fork = fork
def slowed(blocks, mine, others, wait_hashed, redo):
    def slow(lo, hi):
        time.sleep(0.03)
        mine(lo, hi)
    taken.extend(split.split_pass(blocks, slow, others, wait_hashed, redo))
    return taken
loss.split_pass = slowed
kept = {}
real_run = runner._run_shard
def run_shard(ctx, *args, **kw):
    out = real_run(ctx, *args, **kw)
    kept.update(ctx.outputs[loss.SUMS_OUTPUT])
    return out
runner._run_shard = run_shard
report = runner.replay(sys.argv[1])
torch.save({k: v.clone() for k, v in kept.items()}, sys.argv[2])
try:
    os.waitpid(-1, os.WNOHANG)
    children = True
except ChildProcessError:
    children = False
print(json.dumps({"report": report_to_json(report), "forks": len(forks), "taken": len(taken),
                  "children_left": children}))
"""


def test_a_forked_worker_gives_the_bits_and_the_report_of_one_pass(tmp_path, monkeypatch):
    import replay_lib.run.runner as runner_mod

    path = write_synthetic(tmp_path / "b", samples=64, tokens=9000, seed=5, vary_lengths=True)
    got = _python(REPLAY_SCRIPT, str(path), str(tmp_path / "sums.pt"))
    assert got["forks"] == 1 and 0 < got["taken"] < split_mod.PASS_BLOCKS and not got["children_left"]
    monkeypatch.setattr(runner_mod, "pass_threads", lambda: 1)
    report, contexts = replay_run(open_bundle(path))
    assert report.passed and got["report"] == report_to_json(report)
    one = contexts[0].outputs[loss_mod.SUMS_OUTPUT]
    forked = torch.load(tmp_path / "sums.pt", weights_only=True)
    assert forked.keys() == one.keys()
    for name, value in one.items():
        assert torch.equal(_bits(value), _bits(forked[name])), name


# The split's mechanics on a toy pass: each block adds lo..hi−1 to row 0 of a shared total (so the result is
# arange(80) whoever sums what) and marks row 1 with who summed it (1 here, 2 the child). The child flags row 2
# when it starts a block, and this process sums nothing before that: the child surely takes a block. A child that
# fails adds half its block first; one that hangs does the same, then sleeps; under "interrupt" this process is
# interrupted in its first block while the child is still summing (slowly).
MECHANICS_SCRIPT = r"""
import json, os, sys, time, torch
from replay_lib.stages import split
split.WORKER_GRACE = 0.5
blocks = [(k * 10, k * 10 + 10) for k in range(8)]

def children_left():
    try:
        os.waitpid(-1, os.WNOHANG)
        return True
    except ChildProcessError:
        return False

def scenario(child_does):
    out = split.shared_zeros((3, 80), torch.float64)
    redone = []
    def mine(lo, hi):
        deadline = time.monotonic() + 60
        while not out[2, 0] and time.monotonic() < deadline:
            time.sleep(0.005)
        if child_does == "interrupt":
            raise KeyboardInterrupt
        time.sleep(0.05)
        out[0, lo:hi] += torch.arange(lo, hi, dtype=torch.float64)
        out[1, lo:hi] = 1
    def others(lo, hi):
        out[2, 0] = 1
        out[0, lo:lo + 5] += torch.arange(lo, lo + 5, dtype=torch.float64)
        if child_does == "fail":
            raise ValueError("the child's block fails")
        if child_does == "hang":
            time.sleep(3600)
        if child_does == "interrupt":
            time.sleep(0.5)
        out[0, lo + 5:hi] += torch.arange(lo + 5, hi, dtype=torch.float64)
        out[1, lo:hi] = 2
    def redo(lo, hi):
        redone.append(lo)
        out[0, lo:hi] = 0
        mine(lo, hi)
    start = time.monotonic()
    try:
        taken = split.split_pass(blocks, mine, others, lambda t: True, redo, fork=True)
        error = None
    except KeyboardInterrupt:
        taken, error = [], "interrupted"
    return {"exact": bool(torch.equal(out[0], torch.arange(80, dtype=torch.float64))), "taken": [lo for lo, _ in taken],
            "child_marks": int(out[1].eq(2).sum()) // 10, "redone": redone, "error": error,
            "seconds": time.monotonic() - start, "children_left": children_left()}

print(json.dumps({k: scenario(k) for k in ("sum", "fail", "hang", "interrupt")}))
"""


def test_a_failed_or_hung_child_has_its_blocks_redone_and_an_interrupt_leaves_no_child():
    got = _python(MECHANICS_SCRIPT)
    ok = got["sum"]
    # the child sums blocks while this process sleeps in each of its own; every block once, none redone
    assert ok["exact"] and ok["taken"] and len(ok["taken"]) == ok["child_marks"] and ok["redone"] == []
    assert not ok["children_left"]
    for case in ("fail", "hang"):  # the child's half-added block cleared and summed here: the exact total again
        got_case = got[case]
        assert got_case["exact"] and got_case["taken"] == [] and len(got_case["redone"]) == 1, (case, got_case)
        assert got_case["child_marks"] == 0 and not got_case["children_left"], (case, got_case)
    # the hung child: killed after the grace (0.5 s + 10× the slowest block), not after its hour
    assert 0.5 < got["hang"]["seconds"] < 60, got["hang"]
    stopped = got["interrupt"]  # the child still in its first block: killed and reaped
    assert stopped["error"] == "interrupted" and stopped["child_marks"] == 0 and not stopped["children_left"], stopped


def test_another_thread_alive_keeps_the_worker_a_thread():
    """A thread of the caller's own (the debugger's, a library user's): no fork; the thread worker sums the blocks
    in this process."""
    gate = threading.Event()
    neighbour = threading.Thread(target=gate.wait, daemon=True)
    neighbour.start()
    try:
        assert not split_mod.can_fork()
        pids, sums = [], torch.zeros(40)
        blocks = [(k * 10, k * 10 + 10) for k in range(4)]

        def add(lo, hi):
            pids.append(os.getpid())
            sums[lo:hi] += 1

        split_mod.split_pass(blocks, add, add, lambda t: True)
        assert torch.equal(sums, torch.ones(40)) and set(pids) == {os.getpid()}
    finally:
        gate.set()
        neighbour.join()
