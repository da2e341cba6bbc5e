"""The mismatch scan's one-pass path (finite chunks: every metric from a few float64 sums) against its general
path (one array per term, also used for NaN and infinities), and the max-ulp fast path against ``ulp_distance``."""

from __future__ import annotations

import math

import pytest
import torch

from replay_lib.kernels import token_chunks
from replay_lib.kernels.mismatch import (METRICS, DifferenceSummary, MaskedBits, MismatchScan, pair_step, segment_add,
                                          ulp_distance)


def _data(seed: int, n: int = 6, length: int = 700):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length, (n,), generator=g)
    total = int(lengths.sum())
    old = -torch.rand(total, generator=g) * 6
    rollout = old + torch.randn(total, generator=g) * 0.3
    mask = (torch.rand(total, generator=g) > 0.25).to(torch.float32)
    return lengths, rollout, old, mask


def _metrics(lengths, rollout, old, mask, general: bool, **knobs) -> dict:
    scan = MismatchScan(len(lengths), **knobs)
    if general:
        scan._add_finite = lambda *a: None  # every chunk through the general path
    for lo, hi, seg in token_chunks(lengths, 257):
        scan.add(rollout[lo:hi], old[lo:hi], mask[lo:hi], seg)
    return scan.metrics()


@pytest.mark.parametrize("knobs", [
    dict(kl_type="k3", is_level="token", is_mode="truncate", is_high=1.2),
    dict(kl_type="k1", is_level="token", is_mode="truncate", is_low=0.9, is_high=1.1),
    dict(kl_type="k2", is_level="token", is_mode="mask", is_low=0.8, is_high=1.25),
    dict(kl_type="k3", is_level="sequence", is_mode="mask", is_high=3.0),
    dict(kl_type="k3", is_level=None),
])
def test_one_pass_path_equals_the_general_path(knobs):
    for seed in range(3):
        data = _data(seed)
        fast, general = _metrics(*data, False, **knobs), _metrics(*data, True, **knobs)
        assert list(fast) == list(METRICS)
        for k in METRICS:
            a, b = fast[k], general[k]
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=1e-12), k


def test_ratio_extremes_ignore_the_off_tokens():
    """Every loss token's ratio below 1 while the off tokens' is 1: the max is the loss tokens' (not 1)."""
    old = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    rollout = torch.tensor([-0.5, -2.0, -2.75, -3.0])  # d = −0.5, (off), −0.25, −1
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    m = _metrics(torch.tensor([4]), rollout, old, mask, False, is_level="token")
    assert m["sampling/importance_sampling_ratio/max"] == math.exp(-0.25)
    assert m["sampling/importance_sampling_ratio/min"] == math.exp(-1.0)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(
        (math.exp(-0.5) + math.exp(-0.25) + math.exp(-1.0)) / 3, rel=1e-15)


def test_a_nan_chunk_takes_the_general_path():
    lengths, rollout, old, mask = _data(7)
    rollout[3] = math.nan
    mask[3] = 1.0
    fast, general = _metrics(lengths, rollout, old, mask, False), _metrics(lengths, rollout, old, mask, True)
    for k in METRICS:
        a, b = fast[k], general[k]
        assert (math.isnan(a) and math.isnan(b)) or a == b, k


def test_max_ulp_across_zero_matches_ulp_distance():
    """Opposite signs: the steps down to 0 on both sides (+0 and −0 one key), as ``ulp_distance`` counts them."""
    tiny = torch.tensor([1e-45], dtype=torch.float32)  # the smallest subnormal: bit pattern 1
    a = torch.tensor([tiny.item(), -2.0, 0.0], dtype=torch.float32)
    b = torch.tensor([-tiny.item(), -2.0000002, -tiny.item()], dtype=torch.float32)
    on = torch.ones(3, dtype=torch.bool)
    s = DifferenceSummary()
    s.add(a, b, on, 0)
    assert ulp_distance(a, b).tolist() == [2.0, 1.0, 1.0]
    assert (s.count, s.max_ulp, s.first) == (3, 2.0, 0)
    few = DifferenceSummary()  # the gather path (few differing tokens) agrees
    few.add(torch.cat([a[:1], torch.full((20,), -1.0)]), torch.cat([b[:1], torch.full((20,), -1.0)]),
            torch.ones(21, dtype=torch.bool), 0)
    assert (few.count, few.max_ulp) == (1, 2.0)


def test_max_ulp_with_most_pairs_across_zero():
    """Most pairs of opposite signs (the masked path): the same distances as ``ulp_distance``."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(64, generator=g).abs()
    b = -torch.randn(64, generator=g).abs()
    b[:8] = a[:8] * 0.5  # a few of one sign, whose bit distance is large
    s = DifferenceSummary()
    s.add(a, b, torch.ones(64, dtype=torch.bool), 0)
    assert s.max_ulp == float(ulp_distance(a, b).max())


def test_max_ulp_of_large_values_across_zero_and_signed_zeros():
    """Opposite signs of sizes ≥ 2 (the bit patterns' sum passes 2^31: counted in int64), and ±0 pairs among
    many differing ones on a fully compared chunk (equal: 0 ulp)."""
    a = torch.tensor([3.0, 0.0, -1.0, -1.0, -1.0], dtype=torch.float32)
    b = torch.tensor([-5.0, -0.0, -1.5, -1.25, -2.0], dtype=torch.float32)
    s = DifferenceSummary()
    s.add(a, b, torch.ones(5, dtype=torch.bool), 0)
    assert s.count == 4 and s.max_ulp == float(ulp_distance(a, b).max()) == float(ulp_distance(a[:1], b[:1]))


def _masked_summary(a: torch.Tensor, b: torch.Tensor, m: torch.Tensor, bits: bool) -> DifferenceSummary:
    """``DifferenceSummary.add_masked`` as the stage calls it: the float64 masked difference, and the chunks'
    ``MaskedBits`` when ``bits``."""
    f64 = torch.float64
    diff = a.to(f64) * m - b.to(f64) * m
    low, high = torch.aminmax(diff)
    s = DifferenceSummary()
    mi = m.to(torch.int32)
    x, y = (MaskedBits(a, mi), MaskedBits(b, mi)) if bits else (a, b)
    s.add_masked(x, y, diff, m, float(m.sum()), 5, max(float(high), -float(low)))
    return s


@pytest.mark.parametrize("case", ["negative", "positive", "mixed", "large_mixed", "signed_zeros", "equal"])
def test_masked_comparison_equals_the_bitwise_one(case):
    """The stage's comparison without bool arrays (float64 difference, integer keys) gives the count, max |Δ|,
    max ulp and first differing token of the bit-for-bit comparison, whatever the values' signs; the values off
    the loss tokens (here of any sign and size) never count."""
    g = torch.Generator().manual_seed(11)
    n = 3000
    a = -torch.rand(n, generator=g) * 6
    b = a + torch.randn(n, generator=g) * 0.3
    if case == "negative":
        b = b.clamp(max=-1e-3)
    elif case == "positive":
        a, b = a.abs(), b.abs()
    elif case == "large_mixed":  # keys ≥ 2^30 on both sides of 0: their difference passes int32
        a[7], b[7] = 3.0e30, -2.5e30
    elif case == "signed_zeros":
        a[:50], b[:50] = 0.0, -0.0
        a[50], b[50] = 0.0, -1e-45
    elif case == "equal":
        b = a.clone()
    m = (torch.rand(n, generator=g) > 0.2).to(torch.float64)
    m[:3] = 0.0
    a[:3], b[:3] = 1e38, -1e38  # off the loss tokens
    on = m > 0
    ref = DifferenceSummary()
    ref.add(a, b, on, 5)
    for bits in (True, False):
        got = _masked_summary(a, b, m, bits)
        assert (got.compared, got.count, got.max_ulp, got.first) == (ref.compared, ref.count, ref.max_ulp, ref.first)
        assert got.max_abs == ref.max_abs


def test_masked_bits_kinds():
    mi = torch.ones(3, dtype=torch.int32)
    assert MaskedBits(torch.tensor([-1.0, 0.0, -0.0]), mi).kind == "neg"
    assert MaskedBits(torch.tensor([1.0, 0.0, 2.0]), mi).kind == "pos"
    assert MaskedBits(torch.tensor([1.0, -0.0, 2.0]), mi).kind == "mixed"
    assert MaskedBits(torch.tensor([1.0, -3.0, 2.0]), torch.tensor([1, 0, 1], dtype=torch.int32)).kind == "pos"
    # ±0 are one key: 0 ulp apart; +0 and the smallest negative subnormal 1 ulp
    s = pair_step(MaskedBits(torch.tensor([0.0, 0.0]), mi[:2]), MaskedBits(torch.tensor([-0.0, -1e-45]), mi[:2]))
    assert s.abs().tolist() == [0, 1]


def test_non_finite_values_off_the_loss_tokens_never_enter():
    """NaN and infinities off the loss tokens: the chunk leaves the one-pass path (× 0 is NaN there) and the
    general path replaces them by 0, so every metric is that of the same values with 0 there."""
    lengths, rollout, old, mask = _data(4)
    off = (mask == 0).nonzero().reshape(-1)[:3]
    dirty_r, dirty_o = rollout.clone(), old.clone()
    dirty_r[off[0]], dirty_o[off[1]], dirty_r[off[2]] = math.nan, math.inf, -math.inf
    clean = _metrics(lengths, rollout, old, mask, False)
    dirty = _metrics(lengths, dirty_r, dirty_o, mask, False)
    for k in METRICS:
        a, b = clean[k], dirty[k]
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-15), k


def test_segment_add_long_samples_with_an_empty_one():
    """Per-sample sums of long samples (one reduceat per row) with an empty sample between two: each sample's
    own sum, the empty one 0."""
    lengths = torch.tensor([600, 0, 700, 500])
    seg = torch.repeat_interleave(torch.arange(4), lengths)
    x = torch.arange(int(lengths.sum()), dtype=torch.float64)
    acc = torch.zeros((1, 4), dtype=torch.float64)
    segment_add(acc, (x,), seg)
    assert acc[0].tolist() == [sum(range(600)), 0.0, sum(range(600, 1300)), sum(range(1300, 1800))]


def test_chunk_samples_are_token_chunks_without_the_per_token_index():
    """The stage's chunks (sample boundaries by binary search) are token_chunks' chunks: the same ranges, the same
    per-token samples (empty samples in none), and every metric the same through either."""
    from replay_lib.kernels.mismatch import chunk_samples

    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 400, (30,), generator=g)
    lengths[[0, 7, 8, 29]] = 0
    total = int(lengths.sum())
    for chunk in (64, 257, 1000, total + 5):
        ours = list(chunk_samples(lengths, chunk))
        theirs = list(token_chunks(lengths, chunk))
        assert [(lo, hi) for lo, hi, _ in ours] == [(lo, hi) for lo, hi, _ in theirs]
        for (_, _, a), (_, _, b) in zip(ours, theirs):
            assert torch.equal(a.seg, b) and (a.first, a.last) == (int(b[0]), int(b[-1]))
    old = -torch.rand(total, generator=g) * 6
    rollout = old + torch.randn(total, generator=g) * 0.3
    mask = (torch.rand(total, generator=g) > 0.25).to(torch.float32)
    for chunk in (257, 4096):  # many short samples per chunk (index_add_), and long ones (reduceat)
        via = []
        for chunks in (chunk_samples(lengths, chunk), token_chunks(lengths, chunk)):
            scan = MismatchScan(len(lengths), is_level="token", is_high=2.0)
            for lo, hi, seg in chunks:
                scan.add(rollout[lo:hi], old[lo:hi], mask[lo:hi], seg)
            via.append(scan.metrics())
        for k in METRICS:
            a, b = via
            assert (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k], k
