"""``replay-tui DIR``: the run view (SPEC §9) on a real capture directory of five small bundles written by the
demo writer, scanned by the real library in a worker process. Pilot waits for the scan (``app.settled``:
the worker is done and every row is in the table), never sleeps.

The directory (anchors chosen so the scan's (rollout_id, step_id) order differs from the names' order):

    name        anchor  what                                          row
    e-clean     1:0     clean                                          pass
    b-kl        2:0     recorded kl of s-1@2 is +0.25 off             diverged, advantage.kl
    a-clean     3:0     clean                                          pass
    d-broken    4:0     its COMPLETE removed                           invalid
    c-clean     5:0     clean                                          pass

so the scan's exit code is 1 (a divergence beats an invalid bundle, SPEC §9) and the first bad step is 2:0.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

import torch

from replay_lib.demo import bundles as demo
from replay_lib.judge.report import fmt_value
from replay_lib.bundle.schema import ActorStepId

SIZE = (120, 40)
ORDER = ["e-clean", "b-kl", "a-clean", "d-broken", "c-clean"]
ANCHORS = ["1:0", "2:0", "3:0", "4:0", "5:0"]
STATUSES = ["pass", "diverged", "pass", "invalid", "pass"]
KL_DELTA = 0.25
TOKENS = 4


def _write(path: Path, rollout: int, *, kl_delta: float = 0.0) -> Path:
    manifest, index, expected, payloads = demo.synthetic_parts(
        samples=4, tokens=TOKENS, seed=rollout, bundle_id=path.name, anchor=ActorStepId(rollout_id=rollout, step_id=0),
        settle=True)
    if kl_delta:
        kl = payloads["kl"].clone()
        kl[1 * TOKENS + 2] += kl_delta  # s-1@2
        payloads = dict(payloads, kl=kl)
    return demo.write_bundle(path, manifest, index, expected, payloads)


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run-view") / "capture"
    root.mkdir()
    saved = demo.producer
    from tui_bundles import fixed_producer

    demo.producer = fixed_producer  # no torch version anywhere on screen
    try:
        _write(root / "e-clean", 1)
        _write(root / "b-kl", 2, kl_delta=KL_DELTA)
        _write(root / "a-clean", 3)
        (_write(root / "d-broken", 4) / "COMPLETE").unlink()
        _write(root / "c-clean", 5)
    finally:
        demo.producer = saved
    return root


@pytest.fixture
def held_scan(monkeypatch):
    """The real scan, held in ``on_row`` after its first row (an Event, never a sleep) until ``gate`` is set;
    ``stops`` collects the stop events the run view passed."""
    import replay_lib.run.scan as scan_module

    gate = threading.Event()
    stops: list = []
    real_scan = scan_module.scan

    def held(targets, *, on_row, stop, **kwargs):
        stops.append(stop)

        def first_then_wait(row):
            on_row(row)
            gate.wait(timeout=30)

        return real_scan(targets, on_row=first_then_wait, stop=stop, **kwargs)

    monkeypatch.setattr(scan_module, "scan", held)
    yield gate, stops
    gate.set()  # never leave a worker thread waiting


async def first_row(pilot) -> None:
    """Until the held scan's first row is in the table."""
    screen = pilot.app.run_screen
    for _ in range(400):
        await pilot.pause()
        if screen.data.rows and not screen._pending:
            return
    raise TimeoutError("no row reached the table")


def make_run_app(path: Path, **kwargs):
    from replay_tui.screens.run import RunApp

    return RunApp(path, jobs=1, **kwargs)


async def scanned(pilot) -> None:
    """Until the scan finished and all its rows are in the table (or a bundle opened from it settled)."""
    app = pilot.app
    for _ in range(400):
        await app.workers.wait_for_complete()
        await pilot.pause()
        if app.settled:
            return
    raise TimeoutError("the scan never finished on screen")


def screen_text(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def table_lines(app) -> list[str]:
    table = app.run_screen.table
    return [table.render_line(y).text.rstrip() for y in range(table.row_count)]


# ------------------------------------------------------------------------------------------ the table


async def test_the_table_fills_in_and_q_quits_with_the_scan_s_code(run_dir):
    app = make_run_app(run_dir)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        data = app.run_screen.data
        assert [t.relpath for t in data.targets] == ORDER  # (rollout_id, step_id), not the names' order
        assert [data.status(t) for t in data.targets] == STATUSES
        lines = table_lines(app)
        kinds = [t.kind for t in data.targets]  # the library's word for each target, drawn as it is
        assert [line.split()[:5] for line in lines] == [
            ["✓", "1:0", "e-clean", kinds[0], "pass"],
            ["✗", "2:0", "b-kl", kinds[1], "diverged"],
            ["✓", "3:0", "a-clean", kinds[2], "pass"],
            ["!", "4:0", "d-broken", kinds[3], "invalid"],
            ["✓", "5:0", "c-clean", kinds[4], "pass"],
        ]
        kl_row = data.rows[run_dir / "b-kl"]
        # the row's own first divergence (the scan's line) and its stage, drawn as they are
        assert kl_row.first_stage == "advantage.kl" and kl_row.first_divergence.startswith("kl s-1@2: ")
        # the recorded kl of s-1@2 is the writer's clean float32 value k plus 0.25; the replay recomputes k in
        # float64 from the recorded log-probs (the clean twins pass: within the default atol 1e-6 of k), so
        # expected = k + 0.25, actual ≈ k, abs_err = 0.25
        k = float(demo.synthetic_parts(samples=4, tokens=TOKENS, seed=2, settle=True)[3]["kl"][1 * TOKENS + 2])
        recorded = float(torch.tensor(k, dtype=torch.float32) + KL_DELTA)
        head, actual = kl_row.first_divergence.split(" actual=")
        assert head == f"kl s-1@2: expected={fmt_value(recorded)}"
        assert actual.endswith(" abs_err=0.25") and abs(float(actual.split()[0]) - k) <= 1e-6
        assert "advantage.kl" in lines[1] and "kl s-1@2: expected=" in lines[1]
        assert "missing COMPLETE sentinel" in lines[3]
        text = screen_text(app)
        # 5 rows: 3 pass, 1 diverged, 1 invalid; the first bad step is the first diverged one in order
        assert "5 bundle(s) scanned: 3 pass, 1 diverged, 1 invalid" in text
        assert "first bad step: 2:0 (b-kl) — advantage.kl" in text
        assert "✗ q exits 1 · first bad step" in text
        assert app.exit_code == 1
        await pilot.press("q")
    assert app.return_code == 1


async def test_rows_show_while_the_scan_runs_and_q_before_the_end_exits_130(run_dir, held_scan):
    """The scan is held after its first row: the row is on screen, the other four are pending, the progress line
    counts 1/5, keys work; q stops the scan and exits 130."""
    gate, stops = held_scan
    app = make_run_app(run_dir)
    async with app.run_test(size=SIZE) as pilot:
        await first_row(pilot)
        data = app.run_screen.data
        assert [data.status(t) for t in data.targets] == ["pass", "pending", "pending", "pending", "pending"]
        assert [line.split()[0] for line in table_lines(app)] == ["✓", "·", "·", "·", "·"]
        assert "⟳ scanning 1/5 ■■■■□□□□□□□□□□□□□□□□  ✓ 1 pass" in screen_text(app)  # 20 cells · 1/5 = 4
        assert not app.run_screen.finished and app.exit_code == 130
        await pilot.press("down")
        assert app.run_screen.table.cursor == 1  # live: the keys move the cursor while it scans
        await pilot.press("q")
        assert stops[0].is_set()  # the scan was told to stop before the app exited
        gate.set()
    assert app.return_code == 130


async def test_d_shows_only_the_bundles_that_did_not_pass_and_keeps_the_cursor_s_bundle(run_dir):
    app = make_run_app(run_dir)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        screen = app.run_screen
        assert screen.table.target.relpath == "b-kl"  # the cursor starts on the first bad step
        await pilot.press("down", "down")  # d-broken (row 3 of 5)
        assert screen.table.target.relpath == "d-broken"
        await pilot.press("d")
        assert [t.relpath for t in map(screen.data.target_at, range(screen.table.row_count))] == ["b-kl", "d-broken"]
        assert screen.table.target.relpath == "d-broken" and screen.table.cursor == 1
        assert "not passing only" in screen_text(app)
        await pilot.press("d")
        assert screen.table.row_count == 5 and screen.table.target.relpath == "d-broken"
        await pilot.press("home", "e")  # e: the first bad step
        assert screen.table.target.relpath == "b-kl"


# ------------------------------------------------------------------------------------- opening a bundle


async def test_enter_opens_the_bundle_in_the_debugger_and_escape_returns_with_the_cursor_kept(run_dir):
    from replay_tui.screens.main import DebuggerScreen
    from replay_tui.screens.run import RunScreen

    app = make_run_app(run_dir)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        assert app.run_screen.table.cursor == 1  # the cursor starts on the first bad step, b-kl
        await pilot.press("enter")  # b-kl
        await scanned(pilot)
        assert isinstance(app.screen, DebuggerScreen)
        assert app.model.report.bundle_id == "b-kl" and app.model.report.exit_code == 1
        # its own replay opens on its first divergence: kl of s-1, token 2
        assert (app.debugger.sample_id, app.debugger.field, app.debugger.diff_cursor) == ("s-1", "kl", 2)
        assert "✗ first divergence in advantage.kl" in screen_text(app)
        assert "esc Run view" in screen_text(app).splitlines()[-1]  # the key bar says how to get back
        await pilot.press("escape")
        assert "esc Run view" not in screen_text(app)
        assert isinstance(app.screen, RunScreen) and app.run_screen.table.cursor == 1
        await pilot.press("down", "down", "enter")  # c-clean... no: 1 + 2 = row 3, d-broken (invalid)
        await scanned(pilot)
        from replay_tui.screens.error import ErrorScreen

        assert isinstance(app.screen, ErrorScreen) and app.screen.code == 3
        assert "d-broken/COMPLETE: missing COMPLETE sentinel" in app.screen.line
        assert "esc to go back" in screen_text(app)
        assert screen_text(app).splitlines()[-1].split() == ["q", "Quit", "r", "Retry", "esc", "Run", "view", "^p",
                                                              "palette"]  # the key bar says it too
        await pilot.press("escape")
        assert isinstance(app.screen, RunScreen) and app.run_screen.table.cursor == 3
        # ? opens the help screen, which lists the run view's own keys
        from replay_tui.screens.help import HelpScreen

        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = screen_text(app)
        assert "Run view" in text
        assert "Group identical failures" in text and "Go to the first bad step" in text
        await pilot.press("escape")
        assert isinstance(app.screen, RunScreen)
        await pilot.press("up", "up", "up", "enter")  # e-clean: a pass
        await scanned(pilot)
        assert app.model.report.bundle_id == "e-clean" and app.model.report.exit_code == 0
        await pilot.press("q")  # quitting from the debugger: the run's code, not the open bundle's 0
    assert app.return_code == 1


async def test_a_closed_bundle_is_freed_and_opening_bundles_one_after_another_does_not_grow_the_heap(run_dir):
    """The replay freezes its model (out of the collector's way) with everything alive then, the screen showing it
    included; esc gives them back to the collector. Before, each opened bundle stayed in memory for good (+22 MB
    per open and close of a 4,096-sample step), and so did up to 1,024 closed widgets' rendered lines in
    Textual's StylesCache (Textualize/textual#6665)."""
    import gc
    import weakref

    app = make_run_app(run_dir)
    opened = []
    frozen = []
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        assert app.run_screen.table.target.relpath == "b-kl"  # the cursor starts on the first bad step
        for _ in range(6):
            await pilot.press("enter")
            await scanned(pilot)
            assert app.model.report.bundle_id == "b-kl"
            opened.append((weakref.ref(app.model), weakref.ref(app.debugger)))
            await pilot.press("escape")
            for _ in range(3):
                await pilot.pause()
            frozen.append(gc.get_freeze_count())
        alive = [i for i, (model, screen) in enumerate(opened) if model() is not None or screen() is not None]
        # at most the bundle closed last is still held (the run view's last frame may still reference its screen)
        assert alive in ([], [5]), alive
        # the heap stays the same size from one open and close to the next (a leak was ≈ 20,000 objects each, so
        # 60,000 more after three more opens). On a loaded host one freeze may still find the screen closed before
        # it alive (≈ 23,000 objects, measured alternating 737k/760k): the later opens' extremes are compared with
        # the earlier ones', which a leak raises and an alternation does not
        early, late = frozen[1:4], frozen[4:]
        assert max(late) - max(early) < 1_000 and min(late) - min(early) < 1_000, frozen
        await pilot.press("q")


async def test_rows_finishing_while_a_bundle_is_open_are_in_the_table_on_escape(run_dir, held_scan):
    """The scan is held after its first row; that bundle (e-clean) is opened, the scan released and finished
    behind the debugger; esc shows all five rows, the cursor still on e-clean."""
    from replay_tui.screens.main import DebuggerScreen
    from replay_tui.screens.run import RunScreen

    gate, _ = held_scan
    app = make_run_app(run_dir)
    async with app.run_test(size=SIZE) as pilot:
        await first_row(pilot)
        await pilot.press("enter")
        for _ in range(400):
            await pilot.pause()
            if isinstance(app.screen, DebuggerScreen) and app.settled:
                break
        assert app.model.report.bundle_id == "e-clean" and not app.run_screen.finished
        gate.set()
        for _ in range(400):
            await pilot.pause()
            if app.run_screen.finished and not app.run_screen._pending:
                break
        assert isinstance(app.screen, DebuggerScreen)  # the scan finished behind it
        await pilot.press("escape")
        assert isinstance(app.screen, RunScreen) and app.run_screen.table.cursor == 0
        data = app.run_screen.data
        assert [data.status(t) for t in data.targets] == STATUSES
        assert [line.split()[0] for line in table_lines(app)] == ["✓", "✗", "✓", "!", "✓"]


# ------------------------------------------------------------------------------------- the command line


def test_replay_tui_dir_check_is_trajectory_replay_scan(run_dir, capsys):
    """Same stdout and exit code, in-process through both entry points (--jobs 1: one worker each)."""
    from replay_lib.cli import main as cli_main
    from replay_tui.__main__ import main as tui_main

    code = cli_main(["scan", str(run_dir), "--jobs", "1"])
    scan_out = capsys.readouterr().out
    assert tui_main([str(run_dir), "--check", "--jobs", "1"]) == code == 1
    assert capsys.readouterr().out == scan_out
    assert "first bad step: 2:0 (b-kl) — advantage.kl" in scan_out


@pytest.mark.parametrize(("argv", "words"), [
    (["--forensic"], "--forensic opens one cohort"),
    (["--check", "--forensic"], "--forensic opens the debugger only"),
    (["--check", "--sample", "s-0"], "--sample selects inside one bundle: pass its own path"),
    (["--sample", "s-0", "--batch", "mb-0000"], "--sample, --batch select inside one bundle"),
])
def test_one_bundle_flags_on_a_directory_of_several_bundles_are_a_usage_error(run_dir, capsys, argv, words):
    from replay_tui.__main__ import main as tui_main

    with pytest.raises(SystemExit) as exc:
        tui_main([str(run_dir), *argv])
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_scan_flags_on_one_bundle_are_a_usage_error(run_dir, capsys):
    from replay_tui.__main__ import main as tui_main

    with pytest.raises(SystemExit) as exc:
        tui_main([str(run_dir / "e-clean"), "--check", "--jobs", "2", "--fail-fast"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--jobs, --fail-fast apply to a directory of several bundles" in err
    with pytest.raises(SystemExit) as exc:
        tui_main([str(run_dir / "e-clean"), "--jobs", "2"])
    assert exc.value.code == 2 and "--jobs applies to a directory of several bundles" in capsys.readouterr().err


def test_check_with_forensic_says_its_own_exit_code(run_dir, capsys):
    """The refusal is a usage error (2); the 3 it names is what a headless check of an incomplete cohort gives."""
    from replay_tui.__main__ import main as tui_main

    with pytest.raises(SystemExit) as exc:
        tui_main([str(run_dir / "e-clean"), "--check", "--forensic"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.splitlines()[-1] == ("replay-tui: error: --forensic opens the debugger only: drop --check (a headless "
                                    "check refuses an incomplete cohort with exit 3)")


def test_a_directory_of_one_bundle_still_opens_that_bundle(run_dir, tmp_path, capsys):
    import shutil

    from replay_tui.__main__ import main as tui_main

    shutil.copytree(run_dir / "b-kl", tmp_path / "b-kl")
    assert tui_main([str(tmp_path), "--check"]) == 1  # the replay's report, not a scan's
    out = capsys.readouterr().out
    assert "first bad step" not in out and "advantage.kl" in out


# ------------------------------------------------------------------------------------------ the model


def test_run_rows_filter_and_nearest_row_without_an_app(run_dir):
    from replay_lib.run.scan import discover, error_row
    from replay_tui.widgets.run_table import RunRows

    targets = discover(run_dir)
    rows = RunRows()
    rows.set_targets(targets)
    rows.add([error_row(targets[3], "invalid", "gone"), error_row(targets[1], "error", "a bug")])
    rows.set_bad_only(True)
    assert rows.visible == [1, 3]  # error and invalid; pending and pass rows hidden
    # a bundle filtered out: the next shown one after it in scan order (a-clean, #2 → d-broken, shown as row 1)
    assert rows.nearest_visible(targets[2].path) == 1
    assert rows.nearest_visible(targets[4].path) == 1  # none after it: the last shown row
    assert rows.counts() == {"pass": 0, "diverged": 0, "invalid": 1, "unsupported": 0, "vanished": 0, "error": 1}


# ------------------------------------------------------------------------------------------ a real terminal


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_replay_tui_dir_in_a_terminal_scans_and_q_exits_with_the_scan_s_code(run_dir, tmp_path):
    """``replay-tui DIR`` as a user runs it, on a pseudo-terminal: the scan's worker process starts under the
    running debugger (whose stderr is Textual's capture), the summary reaches the screen, and q exits 1."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import subprocess
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "TEXTUAL_ANIMATIONS": "none", "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "replay_tui", str(run_dir), "--jobs", "1"], stdin=slave,
                            stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out, pressed, deadline = b"", False, time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    out += os.read(master, 65536)
                except OSError:  # the process closed the terminal
                    break
            if not pressed and b"q exits 1 \xc2\xb7" in out:
                os.write(master, b"q")
                pressed = True
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert pressed, out[-2000:]
    assert code == 1
    assert b"Traceback" not in out and b"fds_to_keep" not in out


async def test_a_step_only_the_link_failed_says_so_as_it_opens(tmp_path):
    """The rollout bundle's old log-prob of s-1@3 differs from what the step consumed: the scan's link stage
    fails the step, whose own replay passes. Opened from the run view, the debugger says why the row was ✗."""
    from replay_lib.demo import ALL_STAGES, ROLLOUT_STAGES, synthetic_parts, write_bundle
    from replay_tui.screens.main import DebuggerScreen

    rollout = synthetic_parts(samples=8, tokens=16, kl_coef=0.0, anchor=None, stages=ROLLOUT_STAGES, bundle_id="r-7")
    step = synthetic_parts(samples=8, tokens=16, kl_coef=0.0, stages=ALL_STAGES, bundle_id="b-7-0")
    rollout[3]["old_log_probs"] = rollout[3]["old_log_probs"].clone()
    rollout[3]["old_log_probs"][19] = -1.25  # s-1, token 3
    write_bundle(tmp_path / "rollout-7", *rollout)
    write_bundle(tmp_path / "step-7-0", *step)
    app = make_run_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        rows = table_lines(app)
        at = next(i for i, line in enumerate(rows) if "step-7-0" in line)
        assert "link" in rows[at] and rows[at].startswith("✗")
        assert app.run_screen.table.cursor == at  # the first bad step
        await pilot.press("enter")
        # the link view: what the step consumed against its rollout bundle's values
        from replay_tui.screens.link import LinkScreen

        assert isinstance(app.screen, LinkScreen)
        text = screen_text(app)
        assert "link · step 7:0 (step-7-0) against rollout bundle rollout-7" in text
        assert "advantages, old_log_probs of step bundle b-7-0 (step-7-0) differ from rollout bundle r-7 " \
               "(rollout-7) in 1 place(s)" in text
        assert "likely cause: no known cause matches" in text
        [row] = [line.split() for line in text.splitlines() if "s-1@3" in line]
        assert row[1:4] == ["old_log_probs", "s-1@3", "-1.25"]  # the rollout's value, then the step's
        await pilot.press("enter")  # ⏎ replays the step alone
        await scanned(pilot)
        assert isinstance(app.screen, DebuggerScreen) and app.model.report.passed
        [note] = [n.message for n in app._notifications]
        assert note.startswith("the scan's link stage: this step diverges from its rollout bundle (old_log_probs "
                               "s-1@3: expected=-1.25 ")
        assert note.endswith("the debugger replays the step alone — esc goes back to the run view")


async def test_identical_failures_are_one_row_with_a_count_and_g_lists_each(tmp_path):
    """Three steps whose recorded kl of s-1@2 is off alike (first stage advantage.kl, field kl, no known cause)
    and a clean one: the table shows the first of the three marked ×3, the cursor on it (the first bad step), the
    line under the table says so; c lists every bundle, c again collapses them."""
    saved = demo.producer
    from tui_bundles import fixed_producer

    demo.producer = fixed_producer
    try:
        _write(tmp_path / "a-clean", 1)
        for rollout in (2, 3, 4):
            _write(tmp_path / f"kl-{rollout}", rollout, kl_delta=KL_DELTA)
    finally:
        demo.producer = saved
    app = make_run_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await scanned(pilot)
        screen = app.run_screen
        lines = table_lines(app)
        assert [line.split()[:2] for line in lines] == [["✓", "1:0"], ["✗", "2:0"]]
        assert "×3 kl s-1@2: expected=" in lines[1]
        assert screen.table.target.relpath == "kl-2"
        assert "×3: this row and 2 later bundle(s) failed alike (same stage, field and cause) — c lists each" \
            in screen_text(app)
        await pilot.press("c")
        assert [line.split()[1] for line in table_lines(app)] == ["1:0", "2:0", "3:0", "4:0"]
        assert screen.table.target.relpath == "kl-2" and "×3" not in "".join(table_lines(app))
        await pilot.press("c")
        assert screen.table.row_count == 2


def test_failure_key_and_the_group_counts_without_an_app():
    """failure_key: (first stage, field, cause) of a diverged row, None otherwise; RunRows groups by it, the
    first row in scan order standing for the rest."""
    from types import SimpleNamespace

    from replay_tui.widgets.run_table import RunRows, failure_key

    def target(name, rollout):
        return SimpleNamespace(path=Path(name), relpath=name, anchor=f"{rollout}:0", kind="step")

    def row(t, status, stage=None, field=None, cause=None):
        report = {"first_divergence": {"field": field}} if field else None
        return SimpleNamespace(target=t, status=status, first_stage=stage, first_divergence=f"{field} s-0: …",
                               report=report, cause=cause)

    targets = [target(f"b{i}", i) for i in range(5)]
    rows = RunRows()
    rows.set_targets(targets)
    rows.add([row(targets[0], "pass"), row(targets[1], "diverged", "loss.policy", "pg_sum", "off-by-one"),
              row(targets[2], "diverged", "loss.policy", "pg_sum", "off-by-one"),
              row(targets[3], "diverged", "loss.policy", "pg_sum", None),
              row(targets[4], "diverged", "loss.policy", "pg_sum", "off-by-one")])
    assert failure_key(rows.rows[Path("b1")]) == ("loss.policy", "pg_sum", "off-by-one")
    assert failure_key(rows.rows[Path("b0")]) is None
    assert [targets[i].relpath for i in rows.visible] == ["b0", "b1", "b3"]
    assert (rows.grouped_with(Path("b1")), rows.grouped_with(Path("b3")), rows.grouped_with(Path("b0"))) == (3, 1, 1)
    rows.set_grouped(False)
    assert len(rows.visible) == 5 and rows.grouped_with(Path("b1")) == 1
