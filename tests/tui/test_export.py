"""Export (x: the viewed rows, X: the whole stage) to CSV or JSON, and the refusal to overwrite without asking.

kl-bug: 8 samples × 16 tokens, the recorded kl +0.25 off at s-5@3, 7, 11 and s-6@0; the app opens on s-5@3."""

from __future__ import annotations

import csv
import json
import os
import stat
from pathlib import Path

import pytest

from textual.widgets import Input

from replay_tui.export import COLUMNS, ExportRequest, default_export_path
from replay_tui.screens.export import ExportScreen

SIZE = (120, 40)


async def ready(pilot) -> None:
    await pilot.app.wait_settled(pilot)


async def submit(pilot, path) -> None:
    pilot.app.screen.query_one(Input).value = str(path)
    await pilot.press("enter")
    await written(pilot)


async def written(pilot) -> None:
    """The dialog's write (a worker thread) done and its outcome shown."""
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def error_text(app) -> str:
    return str(app.screen.query_one("#export-error").render())


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A home of the test's own: the default export directory is under it."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_default_paths_name_the_bundle_the_field_and_the_scope(home):
    out = f"{home}/trajectory-replay/exports"
    assert default_export_path(ExportRequest(field="kl", sample_id="s-5", whole_stage=False)) == f"{out}/kl-s-5.csv"
    assert default_export_path(ExportRequest(field="kl", sample_id="s/../x", whole_stage=False)) == \
        f"{out}/kl-s_.._x.csv"
    assert default_export_path(ExportRequest(field="kl", sample_id="s-5", whole_stage=True), "kl-bug") == \
        f"{out}/kl-bug-kl-stage.csv"
    assert default_export_path(ExportRequest(field="reward", sample_id=None, whole_stage=True), "a b/../c") == \
        f"{out}/a_b_.._c-reward.csv"


async def test_the_default_path_is_absolute_and_the_file_0644(make_app, home, tmp_path, monkeypatch):
    """Not relative to the working directory: the dialog proposes the export directory under the home, which the
    first export creates; the file's mode is what a new file gets (0644 under umask 022), not mkstemp's 0600."""
    monkeypatch.chdir(tmp_path)
    old = os.umask(0o022)
    try:
        app = make_app("kl-bug")
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press("x")
            path = app.screen.query_one(Input).value
            assert path == f"{home}/trajectory-replay/exports/kl-bug-kl-s-5.csv"
            await pilot.press("enter")
            await written(pilot)
            assert app.screen is app.debugger
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert len(list(csv.reader(open(path)))) == 1 + 16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # nothing written in the working directory


async def test_x_writes_the_sample_s_rows_as_csv(make_app, tmp_path, home):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        diff = app.debugger.diff_view.diff
        await pilot.press("x")
        assert isinstance(app.screen, ExportScreen)
        assert app.screen.query_one(Input).value == f"{home}/trajectory-replay/exports/kl-bug-kl-s-5.csv"
        out = tmp_path / "kl.csv"
        await submit(pilot, out)
        assert app.screen is app.debugger
        rows = list(csv.reader(out.open()))
        assert rows[0] == list(COLUMNS) and len(rows) == 1 + 16
        by_offset = {int(r[2]): r for r in rows[1:]}
        for t in range(16):  # each value is the viewer's, written as Python's repr (it reads back exactly)
            r = by_offset[t]
            assert r[:2] == ["", "s-5"] and r[3] == ""  # a single-rank bundle has no rank
            assert float(r[4]) == float(diff.expected_tensor[t]) and float(r[5]) == float(diff.actual_tensor[t])
            assert float(r[6]) == float(diff.error_tensor[t]) and float(r[7]) == float(diff.tolerance_tensor[t])
            assert r[8] == str(t in (3, 7, 11))
        assert any("wrote 16 row(s) of kl (sample)" in str(n.message) for n in app._notifications)


async def test_X_writes_the_whole_stage_as_json(make_app, tmp_path, home):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("X")
        assert app.screen.query_one(Input).value == f"{home}/trajectory-replay/exports/kl-bug-kl-stage.csv"
        out = tmp_path / "kl.json"
        await submit(pilot, out)
        doc = json.loads(out.read_text())
        assert (doc["field"], doc["stage"], doc["scope"], doc["columns"]) == ("kl", "advantage.kl", "stage",
                                                                              list(COLUMNS))
        assert len(doc["rows"]) == 8 * 16
        divergent = [(r[1], r[2]) for r in doc["rows"] if r[8]]
        assert divergent == [("s-5", 3), ("s-5", 7), ("s-5", 11), ("s-6", 0)]
        s6 = next(r for r in doc["rows"] if (r[1], r[2]) == ("s-6", 0))
        assert abs(s6[4] - s6[5] - 0.25) < 1e-6  # the recorded kl is 0.25 above the recomputed


async def test_an_existing_file_is_kept_until_enter_is_pressed_again(make_app, tmp_path):
    out = tmp_path / "kept.csv"
    out.write_text("mine\n")
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("x")
        await submit(pilot, out)
        assert isinstance(app.screen, ExportScreen)
        assert error_text(app) == f"{out} exists — enter again to overwrite it, escape to keep it"
        assert out.read_text() == "mine\n"
        # another path forgets the confirmation; coming back asks again
        app.screen.query_one(Input).value = str(tmp_path / "other.csv")
        await pilot.pause()
        await submit(pilot, out)
        assert out.read_text() == "mine\n" and isinstance(app.screen, ExportScreen)
        await pilot.press("enter")  # the same path again: confirmed
        await written(pilot)
        assert app.screen is app.debugger and out.read_text().startswith(",".join(COLUMNS))


async def test_an_unwritable_path_keeps_the_dialog_with_the_reason(make_app, tmp_path):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("x")
        await submit(pilot, tmp_path / "no-such-dir" / "kl.csv")
        assert isinstance(app.screen, ExportScreen)
        assert error_text(app).startswith(f"cannot write {tmp_path / 'no-such-dir' / 'kl.csv'}: No such file")
        assert not (tmp_path / "no-such-dir").exists() and list(tmp_path.iterdir()) == []
        await pilot.press("escape")
        assert app.screen is app.debugger


async def test_a_directory_is_refused_at_once(make_app, tmp_path):
    """No "enter again to overwrite" for a directory: no file can replace it."""
    target = tmp_path / "victim"
    target.mkdir()
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("x")
        await submit(pilot, target)
        assert error_text(app) == f"cannot write {target}: Is a directory"
        assert target.is_dir() and list(target.iterdir()) == []


def test_csv_text_is_escaped_as_every_view_shows_it(tmp_path):
    """A sample id from the bundle with a comma, quotes, an ESC sequence and a newline: the CSV keeps its
    quoting and escapes the control characters (``cat`` cannot act on the terminal); a cell a spreadsheet
    would evaluate gets a leading quote. Numbers stay numbers (a negative one keeps its sign)."""
    from replay_tui.export import render

    rows = [[None, 's-5,"x"\x1b[31mRED\n=cmd', 3, None, -0.5, 1.0, 1.5, 1e-6, True],
            [None, "=HYPERLINK(1)", None, "@sum", -1.0, -1.0, 0.0, None, False]]
    text = render(str(tmp_path / "w.csv"), "kl", "advantage.kl", "sample", rows)
    assert "\x1b" not in text and text.count("\n") == 3
    parsed = list(csv.reader(text.splitlines()))
    assert parsed[1] == ["", 's-5,"x"\\x1b[31mRED\\n=cmd', "3", "", "-0.5", "1.0", "1.5", "1e-06", "True"]
    assert parsed[2] == ["", "'=HYPERLINK(1)", "", "'@sum", "-1.0", "-1.0", "0.0", "", "False"]


async def test_the_reward_table_exports_every_sample(make_app, tmp_path, home):
    app = make_app("pr65-buggy")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("x")
        assert app.screen.query_one(Input).value == f"{home}/trajectory-replay/exports/pr65-buggy-reward.csv"
        await submit(pilot, tmp_path / "reward.csv")
        rows = list(csv.reader((tmp_path / "reward.csv").open()))[1:]
        # PR #65: recorded −5.5, −3.5, 3.5, 5.5; recomputed −1, 1, −1, 1; every |err| 4.5
        assert [(r[1], r[3], float(r[4]), float(r[5]), float(r[6]), r[8]) for r in rows] == [
            ("s-0", "s-0", -5.5, -1.0, 4.5, "True"), ("s-1", "s-1", -3.5, 1.0, 4.5, "True"),
            ("s-2", "s-2", 3.5, -1.0, 4.5, "True"), ("s-3", "s-3", 5.5, 1.0, 4.5, "True")]


async def test_the_palette_lists_and_runs_export_and_copy(make_app, tmp_path, home):
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+p", *"Diff: Export the viewed")
        await app.workers.wait_for_complete()  # the palette searches in a worker
        await pilot.pause()
        shown = [str(o.prompt).splitlines()[0] for o in app.screen.query_one("CommandList")._options]
        assert shown[0] == "Diff: Export the viewed rows"
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ExportScreen) and app.screen.query_one(Input).value == f"{home}/trajectory-replay/exports/kl-bug-kl-s-5.csv"
        await pilot.press("escape")
        await pilot.press("ctrl+p", *"Copy the cursor row's")
        await app.workers.wait_for_complete()
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()

        assert app.clipboard == repr(app.debugger.diff_view.diff.row(3)[1])


async def test_a_cohort_s_stage_export_names_each_row_s_rank(make_app, tmp_path):
    app = make_app("cohort-2rank")  # 2 ranks × 8 samples × 16 tokens, ids r0-s-… and r1-s-…
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.debugger.select(field="kl", sample_id="r1-s-0")
        await pilot.pause()
        await pilot.press("X")
        await submit(pilot, tmp_path / "kl.json")
        rows = json.loads((tmp_path / "kl.json").read_text())["rows"]
        assert len(rows) == 2 * 8 * 16
        assert {(r[0], r[1][:3]) for r in rows} == {(0, "r0-"), (1, "r1-")}
        assert [r[2] for r in rows[:17]] == list(range(16)) + [0]  # offsets restart with each sample


def test_a_whole_stage_is_written_a_block_of_samples_at_a_time(tmp_path, monkeypatch):
    """X on a large step: the rows are made and written a block of whole samples at a time (never the whole
    stage's rows, nor the file's text, at once) and the file is the one a single block gives, in CSV and in JSON."""
    from replay_lib.bundle import open_bundle
    from replay_lib.demo import write_synthetic
    from replay_lib.run.runner import replay_run
    from replay_tui import export as export_mod
    from replay_tui.model import build_model

    path = write_synthetic(tmp_path / "b", samples=24, tokens=40, seed=3, vary_lengths=True)
    bundles = open_bundle(path)
    report, contexts = replay_run(bundles)
    model = build_model(bundles, report, contexts=contexts)
    request = ExportRequest(field="kl", sample_id=None, whole_stage=True)
    lengths = contexts[0].lengths.tolist()
    made = []
    rows_of = export_mod._rows

    def recorded(*args, **kw):
        made.append(rows_of(*args, **kw))
        return made[-1]

    monkeypatch.setattr(export_mod, "_rows", recorded)
    texts = {}
    for block in (1 << 16, 100):
        monkeypatch.setattr(export_mod, "EXPORT_BLOCK", block)
        made.clear()
        for suffix in ("csv", "json"):
            out = tmp_path / f"kl-{block}.{suffix}"
            line = export_mod.export_field(model, request, str(out))
            assert line.startswith(f"wrote {sum(lengths)} row(s) of kl (stage)"), line
            texts[block, suffix] = out.read_text()
        sizes = [len(rows) for rows in made[:len(made) // 2]]
        if block == 100:  # whole samples up to 100 tokens a block: more than one block, none beyond the bound
            assert len(sizes) > 1 and max(sizes) <= 100 and sum(sizes) == sum(lengths)
        else:
            assert sizes == [sum(lengths)]
    assert texts[100, "csv"] == texts[1 << 16, "csv"] and texts[100, "json"] == texts[1 << 16, "json"]
    # each block judged as a window of the field (FieldResult.window): the rows its whole-step columns give
    shard = model.shards[0]
    result = shard.results["kl"]
    whole = rows_of(result.expected, result.actual, result.abs_error, result.tolerance, result.divergent,
                    rank=shard.rank, sample_ids=[sid for sid, n in zip(contexts[0].sample_ids, lengths)
                                                 for _ in range(n)],
                    offsets=[t for n in lengths for t in range(n)])
    assert export_mod.export_rows(model, request)[1] == whole
    doc = json.loads(texts[100, "json"])
    assert doc["columns"] == list(COLUMNS) and len(doc["rows"]) == sum(lengths)
    assert [row[2] for row in doc["rows"][:lengths[0] + 1]] == [*range(lengths[0]), 0]  # offsets restart per sample


def test_a_large_field_s_export_never_builds_its_whole_step_columns(tmp_path):
    """A field beyond KEEP_COLUMNS keeps no float64 columns once judged; X writes it a window at a time and leaves
    it so (building every row first took ≈ 500 bytes a token: 1,009 MiB for a 2M-token step)."""
    from replay_lib.bundle import open_bundle
    from replay_lib.demo import write_synthetic
    from replay_lib.judge.fields import KEEP_COLUMNS
    from replay_lib.run.runner import replay_run
    from replay_tui.export import export_field
    from replay_tui.model import build_model

    path = write_synthetic(tmp_path / "b", samples=64, tokens=9000, seed=5, vary_lengths=True)
    bundles = open_bundle(path)
    report, contexts = replay_run(bundles)
    model = build_model(bundles, report, contexts=contexts)
    total = int(contexts[0].lengths.sum())
    assert total > KEEP_COLUMNS
    out = tmp_path / "kl.csv"
    line = export_field(model, ExportRequest(field="kl", sample_id=None, whole_stage=True), str(out))
    assert line.startswith(f"wrote {total} row(s) of kl (stage)")
    result = model.shards[0].results["kl"]
    assert "_columns" not in result.__dict__ and "expected" not in result.__dict__
    rows = list(csv.reader(out.read_text().splitlines()))
    assert len(rows) == total + 1 and rows[1][1:3] == ["s-0", "0"] and rows[-1][2] == str(int(contexts[0].lengths[-1]) - 1)


async def test_a_long_export_runs_beside_the_dialog_and_escape_cancels_it(make_app, tmp_path, monkeypatch):
    """The write runs on a worker thread: the dialog stays responsive, says how many rows are written, and escape
    stops the write before its next block — the partial file removed, the cancellation said. The same path then
    writes in full."""
    import threading
    import time

    from replay_tui import export as export_mod

    monkeypatch.setattr(export_mod, "EXPORT_BLOCK", 16)  # one sample a block: 8 blocks
    permits = threading.Semaphore(0)  # each block waits for one
    rows_of = export_mod._rows

    def slow(*args, **kw):
        assert permits.acquire(timeout=10)
        return rows_of(*args, **kw)

    monkeypatch.setattr(export_mod, "_rows", slow)
    out = tmp_path / "kl.csv"
    app = make_app("kl-bug")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("X")
        app.screen.query_one(Input).value = str(out)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ExportScreen) and app.screen.writing == str(out)
        permits.release()  # one block written; the worker then waits inside the next one
        for _ in range(500):
            if app.screen._rows:
                break
            time.sleep(0.01)
        app.screen._show_rows()
        assert error_text(app) == f"writing {out}… 16 row(s) — escape cancels"
        await pilot.press("escape")
        assert error_text(app) == "cancelling…"
        for _ in range(8):
            permits.release()
        await written(pilot)
        assert app.screen is app.debugger and not out.exists()
        assert list(tmp_path.glob(".kl.csv.*")) == []  # no partial file left beside it
        assert any(f"export cancelled: {out} not written" in str(n.message) for n in app._notifications)
        for _ in range(8):
            permits.release()
        await pilot.press("X")
        await submit(pilot, out)
        assert app.screen is app.debugger and len(out.read_text().splitlines()) == 1 + 8 * 16
