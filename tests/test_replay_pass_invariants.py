"""The replay's faster passes give the same bits as the passes they replaced (issue 40, point 3): the loss pass over
``PASS_CHUNK`` tokens against the same pass over ``LOSS_CHUNK`` tokens, the broadcast check of a per-token field
against its per-sample definition, and the finite test of a payload against torch's."""

from __future__ import annotations

import math

import pytest
import torch

from replay_lib.bundle import open_bundle
from replay_lib.demo import write_synthetic
from replay_lib.judge import fields as fields_mod
from replay_lib.judge.report import report_to_json
from replay_lib.kernels import LOSS_CHUNK
from replay_lib.run.runner import replay_run
from replay_lib.stages import base as base_mod
from replay_lib.stages import loss as loss_mod


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (``torch.equal`` takes −0.0 for 0.0)."""
    return t.contiguous().view({torch.float64: torch.int64, torch.float32: torch.int32}[t.dtype])


@pytest.mark.parametrize("samples,tokens", [(40, 5000), (64, 9000)])
def test_the_loss_pass_gives_the_same_bits_at_any_pass_chunk(tmp_path, monkeypatch, samples, tokens):
    # ragged samples (empty ones too) cut by chunk edges at different places; (64, 9000): 288,948 tokens, beyond
    # KEEP_COLUMNS, so the chunks' sample ids come from kernels.token_chunks rather than a slice of ctx.seg
    path = write_synthetic(tmp_path / "b", samples=samples, tokens=tokens, seed=5, vary_lengths=True,
                           format_version="1.3.0")
    total = sum(s.response_length for s in open_bundle(path).shards[0].index.samples)
    assert (total > fields_mod.KEEP_COLUMNS) == (samples == 64) and total > 2 * loss_mod.PASS_CHUNK
    monkeypatch.setattr(loss_mod, "LARGE_PASS", 0)  # the larger step on these small steps too
    runs = {}
    for chunk in (loss_mod.PASS_CHUNK, LOSS_CHUNK, 3 * LOSS_CHUNK):
        monkeypatch.setattr(loss_mod, "PASS_CHUNK", chunk)
        report, contexts = replay_run(open_bundle(path))
        runs[chunk] = (report_to_json(report), contexts[0].outputs[loss_mod.SUMS_OUTPUT])
    (json_a, sums_a), *others = runs.values()
    assert len(sums_a) >= 10
    for json_b, sums_b in others:
        assert json_b == json_a
        assert sums_b.keys() == sums_a.keys()
        for name in sums_a:
            assert torch.equal(_bits(sums_b[name]), _bits(sums_a[name])), name


class _Reader:
    def __init__(self) -> None:
        self.released: list[tuple[int, int]] = []

    def release_pages(self, lo: int, hi: int) -> None:
        self.released.append((lo, hi))


def _context(lengths: list[int]) -> base_mod.StageContext:
    ctx = object.__new__(base_mod.StageContext)
    ctx.reader = _Reader()
    ctx.indices = list(range(len(lengths)))
    ctx.lengths = torch.tensor(lengths, dtype=torch.int64)
    ctx.offsets = torch.cumsum(ctx.lengths, 0) - ctx.lengths
    ctx.token_index = None
    return ctx


def _per_sample_definition(e: torch.Tensor, lengths: list[int]):
    """The definition the check implements: every non-empty sample's tokens equal (``==``) to its first, which is
    not NaN; its value per sample (0 for an empty one), else ``None``."""
    out, at = [], 0
    for n in lengths:
        run = e[at:at + n]
        if n and (math.isnan(float(run[0])) or not bool((run == run[0]).all())):
            return None
        out.append(float(run[0]) if n else 0.0)
        at += n
    return out


def test_the_broadcast_check_is_the_per_sample_definition(monkeypatch):
    # blocks of 7 tokens (RELEASE_ROWS) so that samples straddle them; empty and one-token samples
    monkeypatch.setattr(base_mod, "RELEASE_ROWS", 7)
    monkeypatch.setattr(base_mod, "KEEP_COLUMNS", 10)
    lengths = [3, 0, 1, 9, 1, 0, 6, 2, 14, 3]
    values = [0.5, 0.0, -2.0, 1.25, 3.0, 0.0, -0.0, 7.0, 0.25, 9.0]
    e = torch.tensor([v for v, n in zip(values, lengths) for _ in range(n)], dtype=torch.float32)
    off = (torch.cumsum(torch.tensor(lengths), 0) - torch.tensor(lengths)).tolist()  # where each sample starts
    cases = {"constant": e.clone()}
    signed_zero = e.clone()
    signed_zero[off[6] + 2] = 0.0  # −0.0 == 0.0 within the sample of −0.0
    cases["signed zero"] = signed_zero
    for name, at, value in (("a token off", off[3] + 4, 1.5), ("a first token off", off[6], 0.5),
                            ("a last token off", e.numel() - 1, 8.0), ("NaN alone", off[4], math.nan),
                            ("NaN first", off[3], math.nan), ("NaN inside", off[6] + 5, math.nan),
                            ("at a block edge", 14, 4.0)):
        changed = e.clone()
        changed[at] = value
        cases[name] = changed
    want_runs = {"constant", "signed zero"}
    for name, values_e in cases.items():
        ctx = _context(lengths)
        runs = ctx._runs(values_e, (torch.zeros(len(lengths), dtype=torch.float64),
                                    torch.zeros(len(lengths), dtype=torch.float64)), 0.0, 0.0, True)
        want = _per_sample_definition(values_e, lengths)
        assert (runs is not None) == (want is not None) == (name in want_runs), name
        if runs is not None:
            assert runs.expected.tolist() == want
            # every block of the mapped rows let go behind the check, in order
            assert ctx.reader.released == [(lo, min(lo + 7, e.numel())) for lo in range(0, e.numel(), 7)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_finite_test_is_torchs(dtype):
    a = torch.linspace(-3, 3, 200_000).to(dtype)
    assert fields_mod._all_finite(a) is True
    for bad in (math.inf, -math.inf, math.nan):
        for at in (0, 65_535, 65_536, 199_999):
            b = a.clone()
            b[at] = bad
            assert fields_mod._all_finite(b) is False == bool(torch.isfinite(b).all())


def test_the_sequential_float32_sums_are_a_token_order_loop():
    # against error_model.sequential_sum32 (numpy's add.accumulate in float32, from 0) per sample and row, fed at
    # chunk edges that cut samples anywhere; empty samples keep 0, a sample's sum carries across chunks
    from replay_lib.judge.error_model import sequential_sum32

    gen = torch.Generator().manual_seed(11)
    lengths = torch.tensor([0, 5, 1, 37, 0, 0, 64, 3, 100, 1, 0, 29], dtype=torch.int64)
    offsets = torch.cumsum(lengths, 0) - lengths
    total = int(lengths.sum())
    # float64 terms spread over twelve decades (their float32 rounding and the sums' differ from float64's), signed
    # zeros among them as masked products give
    rows = torch.randn((3, total), generator=gen, dtype=torch.float64) * torch.logspace(-6, 6, total, dtype=torch.float64)
    rows[1, ::7] = -0.0
    rows[:, :5] = -0.0  # a sample of −0.0 only: its sequential sum from 0 is +0.0
    for step in (1, 7, 16, 64, total):
        sums = loss_mod.SequentialSums32(lengths, offsets, 3, step)
        for lo in range(0, total, step):
            hi = min(lo + step, total)
            sums.add(lo, hi, rows[:, lo:hi])
        want = torch.tensor([[sequential_sum32(rows[k, o:o + n]) for o, n in zip(offsets.tolist(), lengths.tolist())]
                             for k in range(3)], dtype=torch.float32)
        assert torch.equal(_bits(sums.totals), _bits(want)), step
        assert _bits(sums.totals[:, 1]).tolist() == [0, 0, 0]  # +0.0, not −0.0
