"""Multi-process writers: racing finalizers publish exactly one valid cohort COMPLETE; a writer killed
mid-write publishes nothing a reader will accept.

Real processes (``multiprocessing``, fork: the children inherit the prepared tensors instead of
re-importing torch). Every tensor is computed in the parent: a forked child must not run torch kernels
(its OpenMP pool does not survive fork), it only writes. Races are forced with barriers, and a kill is
aimed with an event the child sets at the exact point of interest, so no test depends on timing.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
import torch

import replay_lib.bundle.writer as bundle_mod
from replay_lib.bundle import BundleWriter, open_bundle
from replay_lib.cli import main
from replay_lib.demo import synthetic_parts, write_bundle
from replay_lib.errors import BundleError
from replay_lib.bundle.schema import BundleComplete, encode_json
from replay_lib.run.validate import inspect, validate

CTX = mp.get_context("fork")
JOIN_S = 60  # generous upper bound for a child to finish; never used as a delay

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _rank_parts(rank: int):
    return synthetic_parts(samples=4, tokens=3, bundle_id="cohort-7-0", seed=100 + rank, sample_prefix=f"r{rank}-s-",
                           rank_sizes={"dp": 2, "tp": 1, "pp": 1, "cp": 1})


def _record_links(queue, rank: int, before_link=None) -> None:
    """Report every attempt to publish the cohort COMPLETE (os.link) and whether it won."""
    real_link = os.link

    def link(src, dst, *args, **kwargs):
        if before_link is not None:
            before_link()
        try:
            real_link(src, dst, *args, **kwargs)
        except FileExistsError:
            queue.put((rank, "lost"))
            raise
        queue.put((rank, "won"))

    os.link = link


def _writer_child(cohort: str, parts, rank: int, start, queue, collide) -> None:
    if collide is not None:
        # Both ranks publish their shard first, then both run the finalizer and both reach os.link.
        after_publish, before_link = collide
        real_try = bundle_mod.try_finalize_cohort

        def try_finalize(path):
            after_publish.wait(JOIN_S)
            return real_try(path)

        bundle_mod.try_finalize_cohort = try_finalize
        _record_links(queue, rank, before_link=lambda: before_link.wait(JOIN_S))
    else:
        _record_links(queue, rank)
    manifest, index, expected, payloads = parts
    writer = BundleWriter(cohort, manifest, index, expected, rank=rank)
    for name, tensor in payloads.items():
        writer.write_payload(name, tensor)
    start.wait(JOIN_S)
    writer.finalize(ranks=[0, 1])
    queue.put((rank, "done"))


def _run_children(targets) -> None:
    procs = [CTX.Process(target=fn, args=args) for fn, args in targets]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(JOIN_S)
        assert [p.exitcode for p in procs] == [0] * len(procs)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()


def _drain(queue, n_done: int) -> list:
    events = []
    while sum(1 for _, e in events if e == "done") < n_done:
        events.append(queue.get(timeout=JOIN_S))
    return events


def _assert_one_valid_cohort(cohort: Path) -> None:
    names = sorted(os.listdir(cohort))
    assert names == ["COMPLETE", "COMPLETE.0", "COMPLETE.1", "rank-0", "rank-1"]  # no temp file left behind
    assert os.stat(cohort / "COMPLETE").st_nlink == 1
    shards = {str(r): bundle_mod.RANK_COMPLETE_DECODER.decode((cohort / f"COMPLETE.{r}").read_bytes())
              for r in (0, 1)}
    assert (cohort / "COMPLETE").read_bytes() == encode_json(BundleComplete(ranks=[0, 1], shards=shards))
    bundles = open_bundle(cohort)
    assert bundles.cohort and [s.rank for s in bundles.shards] == [0, 1]
    result = validate(cohort)
    assert result.valid and result.ranks == [0, 1] and result.samples == 8


@pytest.mark.parametrize("collide", [True, False], ids=["forced-collision", "free-race"])
def test_two_writers_racing_to_finalize_yield_one_valid_cohort(collide, tmp_path):
    parts = [_rank_parts(0), _rank_parts(1)]
    rounds = 8
    for i in range(rounds):
        cohort = tmp_path / f"round-{i}" / "cohort-7-0"
        start = CTX.Barrier(2)
        queue = CTX.Queue()
        sync = (CTX.Barrier(2), CTX.Barrier(2)) if collide else None
        _run_children([(_writer_child, (str(cohort), parts[r], r, start, queue, sync)) for r in (0, 1)])
        events = _drain(queue, 2)
        outcomes = sorted(e for _, e in events if e != "done")
        if collide:
            assert outcomes == ["lost", "won"]  # both tried to publish COMPLETE; exactly one did
        else:
            assert outcomes in (["won"], ["lost", "won"])
        _assert_one_valid_cohort(cohort)
        assert sorted(os.listdir(cohort.parent)) == ["cohort-7-0"]


def test_finalize_waits_for_every_expected_rank(tmp_path):
    cohort = tmp_path / "cohort-7-0"
    write_bundle(cohort, *_rank_parts(0), rank=0, ranks=[0, 1])
    assert not (cohort / "COMPLETE").exists()
    assert bundle_mod.try_finalize_cohort(cohort) is False
    # rank 1 claims a different expected cohort: anchors disagree, no COMPLETE
    parts = _rank_parts(1)
    write_bundle(cohort, *parts, rank=1, ranks=[0, 1, 2])
    assert not (cohort / "COMPLETE").exists()
    shard1 = json.loads((cohort / "COMPLETE.1").read_bytes())
    assert shard1["expected_ranks"] == [0, 1, 2]
    # the disagreeing sentinel corrected (as a restarted rank 1 would publish it): now it finalizes
    shard1["expected_ranks"] = [0, 1]
    (cohort / "COMPLETE.1").write_bytes(encode_json(bundle_mod.RANK_COMPLETE_DECODER.decode(json.dumps(shard1))))
    assert bundle_mod.try_finalize_cohort(cohort) is True
    _assert_one_valid_cohort(cohort)


# ------------------------------------------------------------------------------ killed mid-write


def _block(reached, release) -> None:
    reached.set()
    release.wait(JOIN_S)  # the parent SIGKILLs us long before this returns


def _killed_child(target: str, where: str, parts, big, reached, release) -> None:
    manifest, index, expected, payloads = parts
    if where == "publish":  # inside finalize, just before the atomic rename that publishes the bundle
        real_rename = os.rename
        os.rename = lambda src, dst: (_block(reached, release), real_rename(src, dst))
    if where == "rank-sentinel":  # rank dir published, COMPLETE.<r> not yet written
        bundle_mod._atomic_write = lambda path, data: _block(reached, release)
    rank = 1 if where == "rank-sentinel" else None
    writer = BundleWriter(target, manifest, index, expected, rank=rank)
    writer.write_payload("log_probs", big)  # a big payload: ~16 MB on disk
    if where == "payloads":
        _block(reached, release)
    for name, tensor in payloads.items():
        if name != "log_probs":
            writer.write_payload(name, tensor)
    writer.finalize(ranks=[0, 1] if rank is not None else [0])


def _kill_at(target: Path, where: str) -> None:
    parts = synthetic_parts(samples=4, tokens=3, bundle_id="victim")
    big = torch.arange(4_000_000, dtype=torch.float32)
    reached, release = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_killed_child, args=(str(target), where, parts, big, reached, release))
    proc.start()
    try:
        assert reached.wait(JOIN_S), "child never reached the kill point"
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(JOIN_S)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()


@pytest.mark.parametrize("where", ["payloads", "publish"])
def test_writer_killed_mid_write_publishes_nothing(where, tmp_path, capsys):
    capture = tmp_path / "capture"
    target = capture / "victim"
    _kill_at(target, where)
    assert not target.exists()
    leftovers = os.listdir(capture)
    assert len(leftovers) == 1 and leftovers[0].startswith(".victim.tmp-")  # only the hidden staging dir
    staging = capture / leftovers[0]
    assert (staging / "payloads" / "log_probs.safetensors").stat().st_size > 16_000_000  # the default form (1.3.0)
    assert (staging / "COMPLETE").exists() == (where == "publish")

    with pytest.raises(BundleError, match="empty directory"):
        open_bundle(capture)
    with pytest.raises(BundleError, match="no such file or directory"):
        open_bundle(target)
    with pytest.raises(BundleError, match="no bundle found"):
        inspect(capture)
    assert main(["validate", str(capture)]) == 3
    assert "empty directory" in capsys.readouterr().err


def test_rank_killed_before_its_sentinel_leaves_no_readable_cohort(tmp_path, capsys):
    cohort = tmp_path / "cohort"
    write_bundle(cohort, *synthetic_parts(samples=4, tokens=3, bundle_id="victim"), rank=0, ranks=[0, 1])
    _kill_at(cohort, "rank-sentinel")
    assert sorted(os.listdir(cohort)) == ["COMPLETE.0", "rank-0", "rank-1"]
    for path in (cohort, cohort / "rank-0", cohort / "rank-1"):
        with pytest.raises(BundleError, match="cohort has no final COMPLETE"):
            open_bundle(path)
        assert main(["validate", str(path)]) == 3
        err = capsys.readouterr().err
        assert f"{cohort / 'COMPLETE'}: cohort has no final COMPLETE (ranks published: COMPLETE.0)" in err
    assert bundle_mod.try_finalize_cohort(cohort) is False
