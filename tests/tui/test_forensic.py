"""Two of the debugger's rough edges (issue 17): the error screen retries with ``r`` once the file is fixed, and
``--forensic`` opens an incomplete cohort read-only — labelled, never exit 0.

Bundles are written by the real writer (``replay_lib.demo``); an incomplete cohort is what a 2-rank job leaves
when rank 1 never flushed: ``rank-0/`` and ``COMPLETE.0`` published, no final ``COMPLETE``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from replay_lib.demo import bundles as demo
from replay_lib.bundle import open_bundle
from replay_lib.errors import BundleError

SIZE = (120, 40)
TOKENS = 4


def write_rank(cohort: Path, rank: int, *, ranks=(0, 1), kl_delta: float = 0.0) -> Path:
    """One rank shard of a 2-rank cohort (4 samples × 4 tokens, ids ``r<rank>-s-<i>``), published as the writer
    publishes it; the cohort COMPLETE is written only once every rank did."""
    manifest, index, expected, payloads = demo.synthetic_parts(
        samples=4, tokens=TOKENS, seed=100 + rank, bundle_id="coh", sample_prefix=f"r{rank}-s-",
        rank_sizes={"dp": len(ranks), "tp": 1, "pp": 1, "cp": 1}, settle=True)
    if kl_delta:
        kl = payloads["kl"].clone()
        kl[1 * TOKENS + 2] += kl_delta  # r<rank>-s-1@2
        payloads = dict(payloads, kl=kl)
    return demo.write_bundle(cohort, manifest, index, expected, payloads, rank=rank, ranks=ranks)


@pytest.fixture
def incomplete(tmp_path) -> Path:
    cohort = tmp_path / "coh"
    write_rank(cohort, 0)
    assert sorted(p.name for p in cohort.iterdir()) == ["COMPLETE.0", "rank-0"]
    return cohort


# ------------------------------------------------------------------------------------------ the reader


def test_the_strict_reader_still_refuses_an_incomplete_cohort(incomplete):
    with pytest.raises(BundleError, match=r"coh/COMPLETE: cohort has no final COMPLETE \(ranks published: COMPLETE.0\)"):
        open_bundle(incomplete)


def test_forensic_opens_the_published_ranks_and_says_what_is_missing(incomplete):
    bundles = open_bundle(incomplete, forensic=True)
    assert bundles.cohort and [s.rank for s in bundles.shards] == [0]
    assert [s.sample_id for s in bundles.shards[0].index.samples] == ["r0-s-0", "r0-s-1", "r0-s-2", "r0-s-3"]
    assert bundles.forensic == (f"{incomplete}: FORENSIC: incomplete cohort (no final COMPLETE), opened with rank(s) 0 "
                                f"of 0, 1; missing: 1; untrusted: the result cannot pass")
    assert bundles.warnings[0] == bundles.forensic  # the report lists it first among its warnings


def test_forensic_on_a_complete_cohort_is_the_strict_open(tmp_path):
    cohort = tmp_path / "coh"
    write_rank(cohort, 0)
    write_rank(cohort, 1)
    assert (cohort / "COMPLETE").is_file()
    bundles = open_bundle(cohort, forensic=True)
    assert bundles.forensic is None and [s.rank for s in bundles.shards] == [0, 1]


def test_forensic_still_verifies_each_published_shard(incomplete):
    kl = incomplete / "rank-0" / "payloads" / "kl.safetensors"
    data = bytearray(kl.read_bytes())
    data[-30] ^= 0xFF  # one byte of the archive flipped: its size is right, its sha256 is not
    kl.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"rank-0/payloads/kl\.safetensors: sha256 mismatch"):
        open_bundle(incomplete, forensic=True)


def test_a_rank_published_without_its_cohort_sentinel_uses_its_own(incomplete):
    """A writer stopped between publishing ``rank-1/`` and ``COMPLETE.1``: the shard's own COMPLETE.1 has the
    same checksums (the writer wrote both from one RankComplete), so rank 1 is verified and opened too."""
    staging = incomplete.parent / "second"
    write_rank(staging, 1)
    shutil.move(str(staging / "rank-1"), str(incomplete / "rank-1"))
    bundles = open_bundle(incomplete, forensic=True)
    assert [s.rank for s in bundles.shards] == [0, 1]
    # rank 0's cohort sentinel names ranks 0 and 1; both are there, so nothing is missing, yet it is not final
    assert bundles.forensic.endswith("opened with rank(s) 0, 1; untrusted: the result cannot pass")


def test_a_cohort_with_no_published_rank_is_refused_even_in_forensic_mode(tmp_path):
    cohort = tmp_path / "coh"
    write_rank(cohort, 0)
    (cohort / "COMPLETE.0").unlink()
    (cohort / "rank-0" / "COMPLETE.0").unlink()
    with pytest.raises(BundleError, match=r"coh: no rank shard published .* nothing to open, even in forensic mode"):
        open_bundle(cohort, forensic=True)


# ------------------------------------------------------------------------------------------ the debugger


def screen_text(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def test_forensic_debugger_is_labelled_and_a_clean_replay_exits_3(incomplete):
    from replay_tui.app import ReplayApp

    app = ReplayApp(incomplete, forensic=True)
    async with app.run_test(size=SIZE) as pilot:
        await app.wait_settled(pilot)
        assert app.model.report.exit_code == 0  # the one published rank replays clean …
        first_line = screen_text(app).splitlines()[0]
        assert first_line.strip().startswith("FORENSIC — an incomplete cohort opened read-only")
        assert app.exit_code == 3  # … and still cannot pass
        await pilot.press("q")
    assert app.return_code == 3


async def test_forensic_debugger_keeps_a_divergence_s_code(tmp_path):
    from replay_tui.app import ReplayApp

    cohort = tmp_path / "coh"
    write_rank(cohort, 0, kl_delta=0.25)
    app = ReplayApp(cohort, forensic=True)
    async with app.run_test(size=SIZE) as pilot:
        await app.wait_settled(pilot)
        assert app.model.report.first_divergent_stage == "advantage.kl"
        assert app.debugger.sample_id == "r0-s-1" and app.debugger.diff_cursor == 2
        await pilot.press("q")
    assert app.return_code == 1


async def test_without_forensic_the_incomplete_cohort_is_the_error_screen(incomplete):
    from replay_tui.app import ReplayApp
    from replay_tui.screens.error import ErrorScreen

    app = ReplayApp(incomplete)
    async with app.run_test(size=SIZE) as pilot:
        await app.wait_settled(pilot)
        assert isinstance(app.screen, ErrorScreen) and app.screen.code == 3
        assert "FORENSIC" not in screen_text(app)
        await pilot.press("q")
    assert app.return_code == 3


# ------------------------------------------------------------------------------------------ retry


async def test_r_on_the_error_screen_retries_after_the_file_is_fixed(tmp_path):
    """The bundle's COMPLETE is moved away (exit 3 on the error screen), put back, and ``r`` replays it: the
    PR #65 bundle's divergence shows, and q now exits 1 — not the old error's 3."""
    from replay_tui.app import ReplayApp
    from replay_tui.screens.error import ErrorScreen
    from replay_tui.screens.main import DebuggerScreen

    bundle = demo.write_pr65(tmp_path / "b", buggy=True)
    aside = tmp_path / "COMPLETE.aside"
    (bundle / "COMPLETE").rename(aside)
    app = ReplayApp(bundle)
    async with app.run_test(size=SIZE) as pilot:
        await app.wait_settled(pilot)
        assert isinstance(app.screen, ErrorScreen) and app.screen.code == 3
        assert "b/COMPLETE: missing COMPLETE sentinel" in app.screen.line
        assert "press q to quit · r to retry" in screen_text(app)
        await pilot.press("r")  # still broken: a fresh error screen, the same line
        await app.wait_settled(pilot)
        assert isinstance(app.screen, ErrorScreen) and len(app.screen_stack) == 2
        aside.rename(bundle / "COMPLETE")
        await pilot.press("r")
        await app.wait_settled(pilot)
        assert isinstance(app.screen, DebuggerScreen) and app.error is None
        assert app.model.report.first_divergent_stage == "reward.post_process"
        await pilot.press("q")
    assert app.return_code == 1
