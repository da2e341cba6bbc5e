"""The read-only commands' console processes end without the interpreter's teardown (``cli.end_process``): their
output flushed and their exit code kept, no exit handler run — except where one matters (Ray, coverage) or a
non-daemon thread still runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = r"""
import atexit, sys, threading, types
from replay_lib.cli import end_process
atexit.register(lambda: print("|atexit ran", end=""))
case = sys.argv[1]
if case == "ray":
    sys.modules["ray"] = types.ModuleType("ray")
if case == "thread":
    gate = threading.Event()
    threading.Thread(target=lambda: gate.wait(0.5)).start()  # non-daemon: ends on its own
print("out", end="")  # left in the buffer: end_process must flush it
sys.stderr.write("err")
end_process(3, case != "slow")
"""


@pytest.mark.parametrize("case, handlers", [("quick", False), ("slow", True), ("ray", True), ("thread", True)])
def test_a_quick_exit_flushes_keeps_the_code_and_skips_the_exit_handlers_only_where_safe(case, handlers):
    done = subprocess.run([sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stdout == "out" + ("|atexit ran" if handlers else "")
    assert done.stderr == "err"


def test_the_console_scripts_end_through_it():
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts["trajectory-replay"] == "replay_lib.cli:console_main"
    assert scripts["replay-tui"] == "replay_tui.__main__:console_main"
