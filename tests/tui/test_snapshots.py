"""SVG snapshots of the main states (pytest-textual-snapshot; ``snap_compare`` is sync only).

Regenerate with ``pytest tests/tui --snapshot-update`` and look at every changed SVG before committing."""

from __future__ import annotations

from pathlib import Path

from test_run_view import make_run_app, run_dir, scanned  # noqa: F401 (run_dir: the fixture)


async def _ready(pilot) -> None:
    await pilot.app.wait_settled(pilot)


def _after(*keys: str):
    async def run_before(pilot) -> None:
        await _ready(pilot)
        if keys:
            await pilot.press(*keys)
        await _ready(pilot)

    return run_before


def test_first_screen_120x40(snap_compare, make_app):
    assert snap_compare(make_app("pr65-buggy"), terminal_size=(120, 40), run_before=_after())


def test_first_screen_80x24(snap_compare, make_app):
    assert snap_compare(make_app("pr65-buggy"), terminal_size=(80, 24), run_before=_after())


def test_stage_pane_on_a_failing_loss_bundle(snap_compare, make_app):
    # the DAG focused, its cursor on the first divergent stage (loss.policy), whose reason shows below
    assert snap_compare(make_app("loss-bug"), terminal_size=(120, 40), run_before=_after("1"))


def test_tree_filtered_to_divergences(snap_compare, make_app):
    assert snap_compare(make_app("kl-bug"), terminal_size=(120, 40), run_before=_after("2", "d"))


def test_diff_viewer_after_n(snap_compare, make_app):
    # opens on kl s-5@3 (the first divergence); n moves to s-5@7
    assert snap_compare(make_app("kl-bug"), terminal_size=(120, 40), run_before=_after("n"))


def test_help_screen(snap_compare, make_app):
    assert snap_compare(make_app("pr65-buggy"), terminal_size=(120, 40), run_before=_after("question_mark"))


def test_invalid_bundle_error_screen(snap_compare, bundles, monkeypatch):
    # a relative path, so the one-line error (which names the file) is the same on every machine
    monkeypatch.chdir(bundles)
    from replay_tui.app import ReplayApp

    assert snap_compare(ReplayApp(Path("broken")), terminal_size=(120, 40), run_before=_after())


def test_support_row_under_the_diff(snap_compare, make_app):
    # support-fullvocab opens on support_logprob s-0@0; n moves to s-0@1, whose support row shows below
    assert snap_compare(make_app("support-fullvocab"), terminal_size=(120, 40), run_before=_after("n"))


def test_error_model_columns(snap_compare, bundles, monkeypatch):
    # loose-kl: atol 0.1 on advantage.kl, s-1@2 0.25 off (×noise 2.5, red), s-1@5 0.05 off (0.5, within it); a
    # relative path, so the warning about the loose tolerance (which names the manifest) is the same everywhere
    monkeypatch.chdir(bundles)
    from replay_tui.app import ReplayApp

    assert snap_compare(ReplayApp(Path("loose-kl")), terminal_size=(120, 40), run_before=_after())


def test_hazard_list(snap_compare, make_app):
    # a passing bundle with one hazard (group g-1's rewards are equal): ⚠ on the verdict line and in the tree, z
    assert snap_compare(make_app("hazard-clean"), terminal_size=(120, 40), run_before=_after("z"))


def test_run_view_after_the_scan(snap_compare, run_dir):
    # the five-bundle capture of test_run_view, scanned to the end (its rows never change after it); e puts the
    # cursor on the first bad step (b-kl, 2:0), whose bundle the line under the table names
    async def run_before(pilot) -> None:
        await scanned(pilot)
        await pilot.press("e")

    assert snap_compare(make_run_app(run_dir), terminal_size=(120, 40), run_before=run_before)


def test_why_strip_on_a_loss_token(snap_compare, tmp_path):
    # pg_losses s-2@1 is +0.5 off (test_why_strip): the viewer opens there, the why strip gives the token's
    # ratio, clip region, mask, advantage and its share of s-2's term
    from replay_tui.app import ReplayApp
    from test_why_strip import write_loss_terms_bug

    assert snap_compare(ReplayApp(write_loss_terms_bug(tmp_path / "loss-terms")), terminal_size=(120, 40),
                        run_before=_after())


def test_reward_table_at_60x20(snap_compare, make_app):
    # the DAG under the samples with its ◀; the table keeps actual and abs err
    assert snap_compare(make_app("pr65-buggy"), terminal_size=(60, 20), run_before=_after())


def test_diff_sorted_by_err_with_a_log_plot(snap_compare, make_app):
    # kl-bug s-5: s sorts by |err| (its three 0.25 errors first), L puts the error plot on a log scale
    assert snap_compare(make_app("kl-bug"), terminal_size=(120, 40), run_before=_after("s", "L"))
