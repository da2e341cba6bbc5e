"""``replay-tui BUNDLE --check`` is headless: it never imports Textual, and its stdout and exit code are
those of ``trajectory-replay replay`` on the same bundle. Real processes, real bundles."""

from __future__ import annotations

import subprocess
import sys

from replay_tui.__main__ import main as tui_main


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120)


# One process runs both front ends' real entry points on every bundle (torch loads once), then checks
# that Textual was never imported; the console scripts themselves are compared in a second test.
PROBE = """
import contextlib, io, json, sys
from replay_lib.cli import main as cli_main
from replay_tui.__main__ import main as tui_main

def capture(fn, argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = fn(argv)
    return [rc, out.getvalue(), err.getvalue()]

results = {}
for path, fmt in json.loads(sys.argv[1]):
    results[path + " " + fmt] = {
        "cli": capture(cli_main, ["replay", path, "--format", fmt]),
        "tui": capture(tui_main, [path, "--check", "--format", fmt]),
    }
results["textual"] = sorted(m for m in sys.modules if m == "textual" or m.startswith("textual."))
print(json.dumps(results))
"""

CASES = [("pr65-buggy", "text", 1), ("pr65-fixed", "text", 0), ("broken", "text", 3), ("kl-bug", "json", 1),
         ("refused", "text", 4)]


def test_check_equals_the_cli_and_never_imports_textual(bundles):
    import json

    done = run("-c", PROBE, json.dumps([[str(bundles / name), fmt] for name, fmt, _ in CASES]))
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results.pop("textual") == []
    for name, fmt, code in CASES:
        got = results[f"{bundles / name} {fmt}"]
        (cli_rc, cli_out, cli_err), (tui_rc, tui_out, tui_err) = got["cli"], got["tui"]
        assert (tui_rc, cli_rc) == (code, code), name
        assert tui_out == cli_out, name
        assert tui_err == cli_err.replace("trajectory-replay: error:", "replay-tui: error:"), name
    buggy = results[f"{bundles / 'pr65-buggy'} text"]["tui"][1]
    assert "          reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5\n" in buggy
    broken = results[f"{bundles / 'broken'} text"]["tui"]
    assert broken[1] == "" and "COMPLETE: missing COMPLETE sentinel" in broken[2]
    refused = results[f"{bundles / 'refused'} text"]["tui"]
    assert refused[2].startswith("replay-tui: error: ") and "$.config.use_rollout_logprobs=True" in refused[2]
    assert '"first_divergent_stage": "advantage.kl"' in results[f"{bundles / 'kl-bug'} json"]["tui"][1]


def test_console_scripts_agree(bundles):
    path = str(bundles / "pr65-buggy")
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in (["trajectory-replay", "replay", path], ["replay-tui", path, "--check"])]
    (cli_out, _), (tui_out, _) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [1, 1]
    assert tui_out == cli_out and tui_out.startswith("bundle b-00001 — first divergent stage: reward.post_process\n")


def test_usage_errors_exit_2_before_any_app_starts(bundles, capsys):
    assert tui_main([str(bundles / "pr65-buggy"), "--stage", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("replay-tui: error: unknown stage 'bogus'")
    assert tui_main([str(bundles / "pr65-buggy"), "--step", "12"]) == 2
    assert "--step expects ROLLOUT_ID:STEP_ID" in capsys.readouterr().err


def test_the_debugger_without_a_terminal_refuses_in_one_line(bundles):
    """Not --check, stdin and stdout not a TTY: exit 2 at once (Textual would draw into the pipe forever)."""
    proc = subprocess.run(["replay-tui", str(bundles / "pr65-buggy")], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == ("replay-tui: error: the debugger needs a terminal (stdin and stdout); use --check "
                           "for a headless run\n")


def test_the_loading_line_shows_on_a_terminal_only_and_is_erased(monkeypatch):
    import io

    from replay_tui.__main__ import LoadingLine

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    out = Tty()
    line = LoadingLine(stream=out)
    line.show()
    line.show()  # once
    line.clear()
    line.clear()  # once
    assert out.getvalue() == "replay-tui: loading…\r\x1b[K"
    piped = io.StringIO()
    line = LoadingLine(stream=piped)
    line.show()
    line.clear()
    assert piped.getvalue() == ""  # never in a pipe or a log
    out = Tty()
    line = LoadingLine(enabled=False, stream=out)  # --check prints its report instead
    line.show()
    assert out.getvalue() == ""


def test_format_json_without_check_is_a_usage_error_not_silently_ignored(capsys, tmp_path):
    import pytest

    with pytest.raises(SystemExit) as exc:
        tui_main([str(tmp_path), "--format", "json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "replay-tui: error: --format json needs --check (the debugger itself prints no report)"


def test_demo_write_all_help_names_every_demo(capsys):
    import pytest

    from replay_lib.cli import main as cli_main
    from replay_lib.demo import _DEMO_BUILDERS

    with pytest.raises(SystemExit):
        cli_main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps at hyphens
    assert all(name in out for name in _DEMO_BUILDERS), out
