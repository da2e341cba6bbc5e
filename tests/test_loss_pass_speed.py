"""The loss pass's cheaper steps (issue 40, point 6) give the bits of the steps they replaced: the advantages
promoted to float64 inside the surrogate's products instead of converted first, and the chunks' sample ids made
only where a plain PPO pass counts a hit."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from replay_lib.bundle import open_bundle
from replay_lib.bundle.loss_knobs import LossKnobs
from replay_lib.bundle.schema import StageId
from replay_lib.demo import write_synthetic
from replay_lib.judge import fields as fields_mod
from replay_lib.judge.report import report_to_json
from replay_lib.kernels import segments as segments_mod
from replay_lib.kernels.loss import policy_token_terms
from replay_lib.run.runner import replay_run
from replay_lib.stages import REGISTRY
from replay_lib.stages import loss as loss_mod
from replay_lib.stages import split as split_mod


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t
    return t.contiguous().view({torch.float64: torch.int64, torch.float32: torch.int32}[t.dtype])


def _edge_values(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=g, dtype=torch.float32) * 3
    old = logp + torch.randn(n, generator=g, dtype=torch.float32) * 0.3
    # ratios on the clip bounds (1 ± 0.2, 1.28) to the last bit, and odd advantages: ±0, NaN, ±inf, subnormals
    old[:6] = logp[:6] - torch.tensor([0.2, -0.2, 0.28, 0.0, 1e-8, -1e-8]).log1p()
    adv = torch.randn(n, generator=g, dtype=torch.float32)
    adv[:12] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 3.4e38, -3.4e38,
                             1.0, -1.0, 0.5])
    return logp, old, adv


@pytest.mark.parametrize("knobs", [LossKnobs(), LossKnobs(eps_clip=0.2, eps_clip_high=0.28),
                                   LossKnobs(eps_clip_c=3.0), LossKnobs(log_ratio_clamp=0.1)],
                         ids=["symmetric", "asymmetric", "dual-clip", "clamped"])
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_advantages_promoted_in_the_kernel_give_the_bits_of_converted_ones(knobs, stored):
    logp, old, adv = _edge_values(4096, seed=11)
    adv = adv.to(stored)
    converted = policy_token_terms(logp, old, adv.to(torch.float64), knobs, dtype=torch.float64)
    promoted = policy_token_terms(logp, old, adv, knobs, dtype=torch.float64)
    assert converted.keys() == promoted.keys()
    for name in converted:
        assert promoted[name].dtype == converted[name].dtype, name
        assert torch.equal(_bits(promoted[name]), _bits(converted[name])), name


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    # 288,948 ragged tokens: beyond KEEP_COLUMNS, so each chunk's sample ids come from kernels.token_chunk_spans
    path = write_synthetic(tmp_path_factory.mktemp("pass") / "b", samples=64, tokens=9000, seed=5,
                           vary_lengths=True)
    total = sum(s.response_length for s in open_bundle(path).shards[0].index.samples)
    assert total > fields_mod.KEEP_COLUMNS
    return path, total


def _loss_calls(monkeypatch) -> list:
    """The calls of the chunks' lazy sample ids made while loss.policy runs."""
    calls, inside = [], []
    made = segments_mod._Once.__call__

    def counted(self):
        if inside and self._value is None:
            calls.append(self._args)
        return made(self)

    monkeypatch.setattr(segments_mod._Once, "__call__", counted)
    stage = REGISTRY[StageId.LOSS_POLICY]

    def run(ctx):
        inside.append(1)
        try:
            return stage.run(ctx)
        finally:
            inside.clear()

    monkeypatch.setitem(REGISTRY, StageId.LOSS_POLICY, dataclasses.replace(stage, run=run))
    return calls


def test_a_plain_ppo_pass_makes_sample_ids_only_for_the_chunks_where_it_counts_a_hit(large, monkeypatch):
    path, total = large
    calls = _loss_calls(monkeypatch)
    report, contexts = replay_run(open_bundle(path))
    assert report.passed
    sums = contexts[0].outputs[loss_mod.SUMS_OUTPUT]
    hits = int(sums["near_clip"].sum() + sums["extreme"].sum())
    # a clean synthetic step: one token near a clip bound in 17 chunks of LOSS_CHUNK tokens; only its chunk made its
    # sample ids (before: every chunk made them)
    assert (hits, -(-total // loss_mod.LOSS_CHUNK)) == (1, 17)
    assert calls == [(98304, 114688)]


def test_a_hit_still_counts_on_its_sample(large, monkeypatch):
    """Tokens moved onto a clip bound: the near-clip count lands on their samples, with the sample ids made for
    their chunks only — the same counts as a pass that makes every chunk's."""
    path, total = large
    monkeypatch.setattr(loss_mod, "EXTREME_LOG_RATIO", 0.05)  # many tokens "extreme": hits in most chunks
    calls = _loss_calls(monkeypatch)
    report, contexts = replay_run(open_bundle(path))
    lazy = contexts[0].outputs[loss_mod.SUMS_OUTPUT]
    assert len(calls) == 17  # each chunk's once, whatever number of hits it counts
    # the same pass with every chunk's sample ids made up front (a knob that reads per-sample values would)
    spans = segments_mod.token_chunk_spans

    def eager(lengths, *args):
        for lo, hi, seg in spans(lengths, *args):
            seg()
            yield lo, hi, seg

    monkeypatch.setattr("replay_lib.stages.base.token_chunk_spans", eager)
    report2, contexts2 = replay_run(open_bundle(path))
    eager_sums = contexts2[0].outputs[loss_mod.SUMS_OUTPUT]
    assert int(lazy["extreme"].sum()) > 0
    for name in lazy:
        assert torch.equal(_bits(lazy[name]), _bits(eager_sums[name])), name
    assert report_to_json(report) == report_to_json(report2)


@pytest.mark.parametrize("pass_chunk", [loss_mod.PASS_CHUNK, 3 * segments_mod.LOSS_CHUNK])
def test_the_pass_split_over_two_threads_gives_the_same_bits(large, monkeypatch, pass_chunk):
    """loss.policy's token pass cut into blocks of whole samples taken by two threads (run.threads.pass_threads)
    sums every sample's tokens in the same runs and order as one pass: the same bits, the same report."""
    import replay_lib.run.runner as runner_mod

    path, total = large
    monkeypatch.setattr(loss_mod, "LARGE_PASS", 0)  # the split (and the larger step) on this small step too
    monkeypatch.setattr(loss_mod, "PASS_CHUNK", pass_chunk)
    taken = []

    def slower(blocks, mine, others, wait_hashed, redo):  # this thread slowed: the other one surely takes blocks
        def slow(lo, hi):
            time.sleep(0.02)
            return mine(lo, hi)

        taken.append(split_mod.split_pass(blocks, slow, others, wait_hashed, redo, fork=False))
        return taken[-1]

    monkeypatch.setattr(loss_mod, "split_pass", slower)
    runs = {}
    for threads in (1, 2):
        monkeypatch.setattr(runner_mod, "pass_threads", lambda threads=threads: threads)
        report, contexts = replay_run(open_bundle(path))
        runs[threads] = (report_to_json(report), contexts[0].outputs[loss_mod.SUMS_OUTPUT])
    assert len(taken) == 1 and 0 < len(taken[0]) < split_mod.PASS_BLOCKS
    assert runs[1][0] == runs[2][0]
    for name, value in runs[1][1].items():
        assert torch.equal(_bits(value), _bits(runs[2][1][name])), name


def test_the_blocks_are_whole_samples_covering_the_token_axis(large):
    path, total = large
    from replay_lib.stages import StageContext

    ctx = StageContext(reader=open_bundle(path).shards[0], indices=[], partial=False)
    blocks = split_mod.sample_blocks(ctx.offsets, ctx.lengths, total, split_mod.PASS_BLOCKS)
    starts = {int(o) for o, n in zip(ctx.offsets, ctx.lengths) if n > 0}
    assert len(blocks) == split_mod.PASS_BLOCKS
    assert blocks[0][0] == 0 and blocks[-1][1] == total
    assert all(a < b and b == c for (a, b), (c, _) in zip(blocks, blocks[1:]))
    assert all(lo in starts for lo, _ in blocks)


def test_the_second_thread_joins_only_once_the_payloads_are_hashed():
    blocks = [(k, k + 1) for k in range(8)]
    mine, others = [], []
    # never hashed (a huge payload): this thread sums every block, in order; the other one takes none
    assert split_mod.two_threads(blocks, lambda lo, hi: mine.append(lo), lambda lo, hi: others.append(lo),
                                 lambda timeout: False) == []
    assert (mine, others) == (list(range(8)), [])
    # hashed: the other thread takes blocks while this one is slow; every block is summed once
    mine.clear()
    hashed = threading.Event()

    def slow(lo, hi):
        hashed.set()
        time.sleep(0.05)
        mine.append(lo)

    taken = split_mod.two_threads(blocks, slow, lambda lo, hi: others.append(lo), lambda timeout: hashed.wait(timeout))
    assert sorted(mine + others) == list(range(8)) and others and [lo for lo, _ in taken] == others


def test_an_error_on_either_thread_is_raised_after_both_ended():
    blocks = [(k, k + 1) for k in range(4)]

    def fail(lo, hi):
        raise ValueError(f"block {lo}")

    with pytest.raises(ValueError, match=r"\Ablock [01]\Z"):  # the other thread may take block 0 first
        split_mod.two_threads(blocks, fail, lambda lo, hi: time.sleep(0.01), lambda timeout: True)
    with pytest.raises(ValueError, match="block"):
        split_mod.two_threads(blocks, lambda lo, hi: time.sleep(0.05), fail, lambda timeout: True)


def test_pass_threads_follow_the_affinity_and_a_scan_worker_takes_one(monkeypatch):
    from replay_lib.run import threads

    monkeypatch.setattr(threads, "_single_pass", False)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.3, 0.3, 0.3))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0})
    assert threads.pass_threads() == 1
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    assert threads.pass_threads() == 2
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.6, 0.3, 0.3))  # both cores busy: no second thread
    assert threads.pass_threads() == 1
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (63.0, 0.3, 0.3))  # one core of 64 free
    assert threads.pass_threads() == 2
    threads.single_pass_thread()
    assert threads.pass_threads() == 1
