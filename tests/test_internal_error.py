"""A crash is exit 5 (SPEC §5.2): one line on stderr naming a saved traceback file, never exit 1.

The bug is real code that fails inside a stage (a reward kernel that divides by zero, with tensors in its
locals), run in-process through each entry point's ``main`` and in real processes (``python -c`` that
installs the bug, then runs the entry point as the console script or ``python -m`` would)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import replay_lib.stages.reward as reward_stage
from replay_lib.run.crash import internal_error_line
from replay_lib.errors import EXIT_INTERNAL
from replay_lib.safe_text import safe

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^(?P<prog>[\w-]+): internal error \(a bug in this tool\): (?P<what>.*); traceback saved to "
                  r"(?P<path>\S+)$")
SENTINEL = "LOCAL" + "-SENTINEL"  # never spelled whole in a source line the traceback quotes


def crashing_group_normalize(raw_rewards, group_index, std_normalization, eps=1e-6, dtype=None, **kwargs):
    """A kernel with a bug: its locals hold a tensor (``1332.`` among its values) and a string that a
    traceback printing locals would show."""
    secret = "".join(("LOCAL", "-SENTINEL"))
    scaled = raw_rewards * 111.0
    return float(scaled.sum()) / (len(secret) - len(secret))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Tracebacks go under ``$XDG_CACHE_HOME/trajectory-replay``: a fresh one per test."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache / "trajectory-replay"


def assert_one_crash_line(err: str, prog: str, what: str, crash_dir: Path) -> Path:
    """stderr is exactly one internal-error line; the file it names exists under ``crash_dir`` and holds
    the traceback without locals."""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    m = LINE.match(lines[0])
    assert m, lines[0]
    assert m["prog"] == prog
    assert m["what"] == what
    path = Path(m["path"])
    assert path.parent == crash_dir
    assert re.fullmatch(r"crash-\d{8}T\d{6}-\d+(-\d+)?\.txt", path.name)
    text = path.read_text()
    assert "Traceback (most recent call last):" in text
    assert "crashing_group_normalize" in text  # the frame is named …
    assert SENTINEL not in text  # … but its locals are not printed
    assert "1332" not in text  # (the scaled tensor: 12 × 111)
    assert "ZeroDivisionError: float division by zero" in text
    return path


CRASH = "ZeroDivisionError: float division by zero"


def test_a_crash_in_a_stage_is_exit_5_with_one_line_naming_the_traceback(pr65_bundle, cli, cache_dir, monkeypatch):
    monkeypatch.setattr(reward_stage, "post_process", crashing_group_normalize)
    code, out, err = cli("replay", pr65_bundle)
    assert code == EXIT_INTERNAL == 5
    assert out == ""
    path = assert_one_crash_line(err, "trajectory-replay", CRASH, cache_dir)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert (cache_dir.stat().st_mode & 0o777) == 0o700


def test_json_format_crash_is_exit_5_too(pr65_bundle, cli, cache_dir, monkeypatch):
    monkeypatch.setattr(reward_stage, "post_process", crashing_group_normalize)
    code, out, err = cli("replay", "--format", "json", pr65_bundle)
    assert code == 5
    assert out == ""
    assert_one_crash_line(err, "trajectory-replay", CRASH, cache_dir)


def test_replay_tui_check_crash_is_exit_5(pr65_bundle, capsys, cache_dir, monkeypatch):
    from replay_tui.__main__ import main

    monkeypatch.setattr(reward_stage, "post_process", crashing_group_normalize)
    code = main([str(pr65_bundle), "--check"])
    out, err = capsys.readouterr()
    assert code == 5
    assert out == ""
    assert_one_crash_line(err, "replay-tui", CRASH, cache_dir)


def test_two_crashes_get_two_files(pr65_bundle, cli, cache_dir, monkeypatch):
    monkeypatch.setattr(reward_stage, "post_process", crashing_group_normalize)
    paths = set()
    for _ in range(2):
        code, _, err = cli("replay", pr65_bundle)
        assert code == 5
        paths.add(assert_one_crash_line(err, "trajectory-replay", CRASH, cache_dir))
    assert len(paths) == 2


def test_without_a_writable_cache_the_traceback_goes_to_the_temp_dir(pr65_bundle, cli, tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache directory would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(temp))
    monkeypatch.setattr(reward_stage, "post_process", crashing_group_normalize)
    code, _, err = cli("replay", pr65_bundle)
    assert code == 5
    assert_one_crash_line(err, "trajectory-replay", CRASH, temp)


def test_the_message_on_the_line_and_in_the_file_is_escaped(pr65_bundle, cli, cache_dir, monkeypatch):
    """A bug whose message carries a bundle string (here a sample id with a screen-clearing sequence)."""
    def crashing(raw_rewards, group_index, std_normalization, eps=1e-6, dtype=None, **kwargs):
        raise LookupError(f"no slot for s\x1b[2J0\u202e")

    monkeypatch.setattr(reward_stage, "post_process", crashing)
    code, _, err = cli("replay", pr65_bundle)
    assert code == 5
    assert "\x1b" not in err and "\u202e" not in err
    m = LINE.match(err.strip())
    assert m and m["what"] == "LookupError: no slot for s\\x1b[2J0\\u202e"
    text = Path(m["path"]).read_text()
    assert "\x1b" not in text and "\u202e" not in text
    assert "LookupError: no slot for s\\x1b[2J0\\u202e" in text


def test_a_long_message_is_cut_on_the_line_and_whole_in_the_file(cache_dir):
    try:
        raise ValueError("x" * 5000)
    except ValueError as exc:
        line = internal_error_line(exc)
    m = LINE.match(line)
    assert m["what"] == "ValueError: " + "x" * 199 + "…"
    assert "x" * 5000 in Path(m["path"]).read_text()


def test_keyboard_interrupt_keeps_exit_130(pr65_bundle, cli, cache_dir, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(reward_stage, "post_process", interrupted)
    code, out, err = cli("replay", pr65_bundle)
    assert (code, err) == (130, "trajectory-replay: error: interrupted\n")
    assert not cache_dir.exists()


def test_an_expected_error_is_not_an_internal_error(tmp_path, cli, cache_dir):
    code, _, err = cli("replay", tmp_path / "missing")
    assert code == 3
    assert err == f"trajectory-replay: error: {tmp_path / 'missing'}: no such file or directory\n"
    assert not cache_dir.exists()


# ------------------------------------------------------------------------------- real processes

BUG = textwrap.dedent("""
    import runpy, sys
    import replay_lib.stages.reward as reward_stage
    def crashing_group_normalize(raw_rewards, group_index, std_normalization, eps=1e-6, dtype=None, **kwargs):
        secret = "".join(("LOCAL", "-SENTINEL"))
        scaled = raw_rewards * 111.0
        return float(scaled.sum()) / (len(secret) - len(secret))
    reward_stage.post_process = crashing_group_normalize
""")


def run_python(code: str, args: list, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", BUG + code, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=REPO)


@pytest.mark.parametrize("entry, prog", [
    ("from replay_lib.cli import main; sys.exit(main())", "trajectory-replay"),  # the console script
    ("sys.argv[0] = 'replay_lib'; runpy.run_module('replay_lib', run_name='__main__')", "trajectory-replay"),
    ("from replay_tui.__main__ import main; sys.exit(main())", "replay-tui"),
], ids=["trajectory-replay", "python-m-replay_lib", "replay-tui"])
def test_a_crash_in_a_real_process_is_exit_5(pr65_bundle, tmp_path, entry, prog):
    args = [pr65_bundle, "--check"] if prog == "replay-tui" else ["replay", pr65_bundle]
    proc = run_python(entry, args, tmp_path / "cache")
    assert proc.returncode == 5, proc.stderr
    assert proc.stdout == ""
    assert_one_crash_line(proc.stderr, prog, CRASH, tmp_path / "cache" / "trajectory-replay")


def test_help_lists_exit_5(cli, capsys):
    from replay_tui.__main__ import build_parser

    with pytest.raises(SystemExit):
        cli("--help")
    out = capsys.readouterr().out
    assert "  5  internal error: a bug in this tool; one line names the saved traceback file (never 1)" in out
    assert "  5  internal error: a bug in this tool" in build_parser().format_help()


def test_the_readme_lists_exit_5():
    readme = (REPO / "README.md").read_text()
    assert "| 5 | internal error: a bug in this tool; one line naming the saved traceback file (never 1) |" in readme


def test_safe_line_of_a_failing_str(cache_dir):
    class Odd(Exception):
        def __str__(self):
            raise RuntimeError("no str")

    try:
        raise Odd()
    except Odd as exc:
        line = internal_error_line(exc)
    assert LINE.match(line)["what"] == "test_safe_line_of_a_failing_str.<locals>.Odd"
    assert safe(line) == line


# ------------------------------------------------------------------------------------- the debugger


def screen_text(app, widget=None) -> str:
    """The screen's cells as the terminal gets them (only ``widget``'s content region, when given)."""
    strips = app.screen._compositor.render_strips()
    if widget is None:
        return "\n".join(strip.text for strip in strips)
    r = widget.content_region
    return "\n".join(strip.crop(r.x, r.right).text for strip in strips[r.y:r.bottom])


async def test_a_crash_in_the_replay_worker_shows_the_error_screen_and_quits_with_5(pr65_bundle, cache_dir,
                                                                                     monkeypatch):
    from replay_tui.app import ReplayApp
    from replay_tui.screens.error import ErrorScreen

    monkeypatch.setattr(reward_stage, "post_process", crashing_group_normalize)
    app = ReplayApp(pr65_bundle)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.wait_settled(pilot)
        assert isinstance(app.screen, ErrorScreen)
        line, code = app.error
        assert code == 5
        assert_one_crash_line(line + "\n", "replay-tui", CRASH, cache_dir)
        shown = screen_text(app, app.screen.query_one("#error-line"))
        assert "".join(shown.split()) == "".join(line.split())  # the line, wrapped (and cut mid-path) in its box
        text = screen_text(app)
        assert "exit code 5 — internal error: a bug in this tool" in text
        assert "Traceback" not in text and SENTINEL not in text
        await pilot.press("q")
    assert app.return_code == 5


async def test_a_crash_in_the_ui_exits_5_with_the_line_not_a_traceback(pr65_bundle, cache_dir, monkeypatch):
    """A pane that fails to draw: the app exits at once with 5 (the line is printed by ``run_app`` after the
    terminal is restored); under a test harness the exception is re-raised too, as Textual does."""
    from replay_tui.app import ReplayApp
    from replay_tui.widgets.sample_tree import SampleTree

    def render_row(self, row, width, base):
        secret = "".join(("LOCAL", "-SENTINEL"))
        return secret[len(secret) + row]  # IndexError

    monkeypatch.setattr(SampleTree, "render_row", render_row)
    app = ReplayApp(pr65_bundle)
    with pytest.raises(IndexError):
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
    assert app.return_code == 5
    line, code = app.error
    assert code == 5
    m = LINE.match(line)
    assert m and m["what"] == "IndexError: string index out of range"
    text = Path(m["path"]).read_text()
    assert "in render_row" in text and SENTINEL not in text
    assert app._exit_renderables == []  # Textual's own traceback (with locals) is not printed on exit


def run_in_terminal(code: str, args: list, cache: Path, keys: bytes = b"") -> tuple[int, bytes]:
    """Run ``python -c code`` on a pseudo-terminal (the debugger needs one); press ``keys`` once the error
    screen is up. Returns the exit status and everything written to the terminal."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(REPO), "TERM": "xterm-256color",
           "TEXTUAL_ANIMATIONS": "none"}
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdin=slave, stdout=slave,
                            stderr=slave, env=env, cwd=REPO, close_fds=True)
    os.close(slave)
    out, pressed, deadline = b"", False, time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the process closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            if keys and not pressed and b"press q to quit" in out:
                time.sleep(0.2)
                os.write(master, keys)
                pressed = True
            if proc.poll() is not None and not select.select([master], [], [], 0.1)[0]:
                break
        return proc.wait(timeout=30), out
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


TUI = "import sys\nfrom replay_tui.__main__ import main\nsys.exit(main())\n"


def crash_line_of(out: bytes) -> str:
    """The internal-error line the process printed after restoring the terminal (its last line)."""
    tail = out.decode("utf-8", "replace").split("\x1b[?1049l")[-1]  # after leaving the alternate screen
    lines = [line for line in tail.replace("\r", "").split("\n") if "internal error" in line]
    assert len(lines) == 1, tail
    return lines[0][lines[0].index("replay-tui:"):]


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_the_debugger_in_a_terminal_shows_the_error_screen_and_exits_5(pr65_bundle, tmp_path):
    code, out = run_in_terminal(BUG + TUI, [pr65_bundle], tmp_path / "cache", keys=b"q")
    assert code == 5
    assert b"Traceback" not in out and SENTINEL.encode() not in out
    assert_one_crash_line(crash_line_of(out), "replay-tui", CRASH, tmp_path / "cache" / "trajectory-replay")


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_a_ui_crash_in_a_terminal_exits_5_with_the_line(pr65_bundle, tmp_path):
    ui_bug = ("import replay_tui.widgets.sample_tree as tree\n"
              "def render_row(self, row, width, base):\n"
              "    secret = ''.join(('LOCAL', '-SENTINEL'))\n"
              "    return secret[len(secret) + row]\n"
              "tree.SampleTree.render_row = render_row\n")
    code, out = run_in_terminal(ui_bug + TUI, [pr65_bundle], tmp_path / "cache")
    assert code == 5
    assert b"Traceback" not in out and SENTINEL.encode() not in out
    line = crash_line_of(out)
    m = LINE.match(line)
    assert m and m["what"] == "IndexError: string index out of range"
    assert Path(m["path"]).parent == tmp_path / "cache" / "trajectory-replay"
