"""What every stage adapter sees (:class:`StageContext`) and declares (:class:`StageDef`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import msgspec
import torch

from ..bundle import BundleReader
from ..judge.compare import Comparison, as_float64, list_tensor
from ..judge.error_model import Precision, Rules, bundle_tolerance, coarse_payloads, is_exact_field, storage_unit
from ..judge.fields import (KEEP_COLUMNS, PER_SAMPLE, PER_TOKEN, RELEASE_ROWS, Column, FieldResult, ReasonFn,
                            SampleRuns, stage_report)
from ..kernels import LOSS_CHUNK, segment_ids, segment_offsets
from ..kernels.segments import grid, token_chunk_spans
from ..judge.report import Hazard, StageReport
from ..bundle.schema import RecomputeConfig, SampleRecord, StageId


class StageInputError(Exception):
    """A stage's input is structurally unusable (e.g. a payload of the wrong length): the stage fails
    with this message as its reason instead of crashing the replay."""

    def __init__(self, message: str, field: str = "length", expected: Optional[float] = None, actual: Optional[float] = None):
        super().__init__(message)
        self.field = field
        self.expected = expected
        self.actual = actual


@dataclass
class StageContext:
    reader: BundleReader
    indices: list[int]
    partial: bool
    keep: int = 5
    # How this replay judges: teacher forcing or --chain, float64 with the error model or --exact.
    rules: Rules = field(default_factory=Rules)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    # What a stage recomputed per element beyond its output tensors, for a view that shows it (the
    # logprob.support stage leaves its per-token record here: ``support.SupportTokens``).
    records: dict[str, object] = field(default_factory=dict)
    # Stages that ran to completion on this context (their ``outputs`` are in place).
    completed: set[str] = field(default_factory=set)
    # What each stage compared: ``fields[stage]`` = its FieldResults (the report and the views read them).
    fields: dict[str, list[FieldResult]] = field(default_factory=dict)
    # Places where a legitimate producer's result is rounding-dominated or undefined (never failures).
    hazards: list[Hazard] = field(default_factory=list)
    # The recorded outputs stored coarser than the compute, by stage, and the stage's coarse_payload message
    # before they were added to it (None: the hazard is theirs alone) — :meth:`_coarse_output`.
    _coarse_outputs: dict[str, dict] = field(default_factory=dict)
    _coarse_inputs: dict[str, Optional[str]] = field(default_factory=dict)
    # How many workers a large pass may be split over (``run.threads.pass_threads``, set by the runner; stages/split.py).
    threads: int = 1

    def __post_init__(self) -> None:
        all_samples = self.reader.index.samples
        self.samples: list[SampleRecord] = [all_samples[i] for i in self.indices] if self.partial else all_samples
        self.sample_ids = [s.sample_id for s in self.samples] if self.partial else self.reader.sample_ids
        self.group_indices = [s.group_index for s in self.samples]
        all_lengths = list_tensor([s.response_length for s in all_samples], torch.int64).clamp_(min=0)
        self.full_total = int(all_lengths.sum())
        self.lengths = all_lengths[self.indices] if self.partial else all_lengths
        self._seg: Optional[torch.Tensor] = None
        self.offsets = segment_offsets(self.lengths)
        if self.partial:
            starts = segment_offsets(all_lengths)[self.indices]
            # positions of the selected samples' tokens in the full concatenated axis
            self.token_index: Optional[torch.Tensor] = starts[self.seg] + (
                torch.arange(self.seg.numel(), dtype=torch.int64) - self.offsets[self.seg]
            )
        else:
            self.token_index = None
        self._mask: Optional[torch.Tensor] = None
        self._raw: Optional[torch.Tensor] = None

    @property
    def seg(self) -> torch.Tensor:
        """``[tokens]`` int64: the (selected) sample of every token, built on first use — a million-token
        comparison that finds nothing never needs it (``offsets`` locates a divergent token)."""
        if self._seg is None:
            self._seg = segment_ids(self.lengths)
        return self._seg

    def token_chunks(self, chunk: int = LOSS_CHUNK) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``kernels.token_chunks`` of the selected samples' tokens: the same chunks, each sample of the chunk's
        tokens sliced from :attr:`seg` when the token axis is small enough to hold it (``fields.KEEP_COLUMNS``)."""
        for lo, hi, seg in self.token_spans(chunk):
            yield lo, hi, seg()

    def token_spans(self, chunk: int = LOSS_CHUNK, start: int = 0, stop: Optional[int] = None
                    ) -> Iterator[tuple[int, int, Callable[[], torch.Tensor]]]:
        """:meth:`token_chunks` with each chunk's ``seg`` made on its first call (``kernels.token_chunk_spans``);
        ``start``/``stop``: tokens ``[start, stop)`` only, the chunks cut on the same grid (multiples of ``chunk``)."""
        total = int(self.offsets[-1] + self.lengths[-1]) if self.n else 0
        stop = total if stop is None else stop
        if total > KEEP_COLUMNS:
            done = start  # the rows of the mapped payloads done with are let go behind the chunks, RELEASE_ROWS at a time
            for lo, hi, seg in token_chunk_spans(self.lengths, chunk, start, stop):
                yield lo, hi, seg
                if hi - done >= RELEASE_ROWS or hi == stop:
                    self.release(done, hi)
                    done = hi
            return
        seg = self.seg
        for lo, hi in grid(start, stop, chunk):
            yield lo, hi, (lambda lo=lo, hi=hi: seg[lo:hi])

    def release(self, lo: int, hi: int) -> None:
        """Rows ``[lo, hi)`` of the token axis are done with: their pages of the memory-mapped payloads leave the
        process's memory (``BundleReader.release_pages``; read again where touched). A partial selection's payloads
        are copies: nothing to let go."""
        if self.token_index is None:
            self.reader.release_pages(lo, hi)

    @property
    def config(self) -> RecomputeConfig:
        return self.reader.index.config

    @property
    def chain(self) -> bool:
        """``--chain``: a stage consumes the recomputed outputs before it, not its recorded inputs."""
        return self.rules.chain

    @property
    def dtype(self) -> torch.dtype:
        """What the stages recompute in (float64; float32 under ``--exact``)."""
        return self.rules.dtype

    @property
    def precision(self) -> Precision:
        """The producer's declared precision (``comparison_policy.producer_precision``)."""
        return Precision.of(self.reader.manifest.comparison_policy)

    @property
    def rank(self) -> Optional[int]:
        return self.reader.rank

    @property
    def n(self) -> int:
        return len(self.indices)

    @property
    def raw_rewards(self) -> torch.Tensor:
        """float64 ``[samples]``: the selected samples' recorded raw rewards (``None`` is NaN), made once (the reward
        stages and their explanations read them)."""
        if self._raw is None:
            self._raw = as_float64([s.raw_reward for s in self.samples])
        return self._raw

    @property
    def loss_mask(self) -> torch.Tensor:
        if self._mask is None and self.reader.has_packed_mask:  # format 1.3: the payload, never lists
            # a selection's rows copied out by the reader (of verified chunks only), else the whole mask
            flat = self.reader.packed_mask if self.token_index is None else self.reader.mask_rows(self.token_index)
            self._mask = flat.to(torch.float32)
        if self._mask is None:
            # each list's bytes joined + frombuffer: several times faster than torch.tensor() of one flat
            # Python list of millions of ints (a list converts at C speed, a chained iterator item by item)
            masks = [s.loss_mask for s in self.samples]
            try:
                flat = bytearray().join(map(bytearray, masks))
            except (ValueError, TypeError):  # a mask value outside 0..255: convert it as a list
                flat = [m for mask in masks for m in mask]
            if len(flat) != int(self.lengths.sum()):
                raise StageInputError(
                    f"loss_mask lengths sum to {len(flat)}, Σ response_length is {int(self.lengths.sum())}",
                    field="loss_mask_length", expected=float(self.lengths.sum()), actual=float(len(flat)),
                )
            if isinstance(flat, list) or not flat:
                self._mask = torch.tensor(flat, dtype=torch.float32)
            else:
                self._mask = torch.frombuffer(flat, dtype=torch.uint8).to(torch.float32)
        return self._mask

    def mask_rows(self, lo: int, hi: int) -> torch.Tensor:
        """float32 rows ``[lo, hi)`` of :attr:`loss_mask`: read from format 1.3's packed payload while the whole-step
        tensor is not built (a view reads one token's or one sample's mask), else sliced from it."""
        if self._mask is None and self.reader.has_packed_mask and self.token_index is None:
            return self.reader.packed_mask[lo:hi].to(torch.float32)
        return self.loss_mask[lo:hi]

    def drop_mask(self) -> None:
        """Let go of :attr:`loss_mask`'s whole-step float32 tensor (4 bytes a token) where format 1.3's packed payload
        builds it again (every sample selected): for a holder that keeps the context past its replay (the
        debugger's model), whose views read a window at a time (:meth:`mask_rows`)."""
        if self.reader.has_packed_mask and self.token_index is None:
            self._mask = None

    def has(self, name: str) -> bool:
        return self.reader.has_payload(name)

    def payload(self, name: str) -> torch.Tensor:
        """The payload restricted to the selected samples' tokens (first dimension = tokens)."""
        if not self.reader.has_payload(name):
            raise StageInputError(f"payload {name!r} is missing", field=name)
        # a selection's rows are copied out by the reader, which verifies what they are read from: the form first
        t = self.reader.payload(name) if self.token_index is None else self.reader.payload_meta(name)
        if t.dim() == 0 or t.shape[0] != self.full_total:
            rows = t.shape[0] if t.dim() else 0
            raise StageInputError(
                f"payload {name!r} has {rows} row(s), Σ response_length is {self.full_total}",
                field="length", expected=float(self.full_total), actual=float(rows),
            )
        if self.token_index is not None:
            return self.reader.payload_rows(name, self.token_index)
        return t

    def expected_list(self, stage: str, key: str) -> list:
        value = self.reader.expected.get(stage, {}).get(key)
        if not isinstance(value, list):
            raise StageInputError(f"expected.json $.{stage}.{key} is missing or not a list", field=key)
        if len(value) != len(self.reader.index.samples):
            raise StageInputError(
                f"expected.json $.{stage}.{key} has {len(value)} value(s) for {len(self.reader.index.samples)} sample(s)",
                field=key, expected=float(len(self.reader.index.samples)), actual=float(len(value)),
            )
        return [value[i] for i in self.indices] if self.partial else value

    def field(self, stage: str, name: str, per: str, expected, actual, *, bound: Optional[Column] = None,
              labels: Optional[list[str]] = None, note: str = "", compared: Optional[torch.Tensor] = None,
              flagged: Optional[torch.Tensor] = None,
              per_sample: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
              exact: Optional[bool] = None) -> FieldResult:
        """A :class:`FieldResult` of this context: ``per`` token (the selected samples' tokens), sample (one
        element per selected sample) or scalar (``labels`` name the elements). Its tolerance is the bundle's
        ``atol + rtol·|e|`` for the field plus ``bound`` (the producer's rounding bound per element, a
        tensor or a function of ``(lo, hi)``); an exact field of the bundle's policy has none at all.

        ``per_sample``: ``(actual, bound)`` float64 per selected sample, for a per-token field whose recomputed
        value and bound are a sample's on each of its tokens (a broadcast): when the recorded tensor is constant
        within each sample too (checked here, bit for bit), the field is judged a sample at a time
        (``fields.SampleRuns``), with the same tolerance arithmetic on the same values.

        ``exact``: bitwise comparison (default: ``--exact``'s); ``False`` for a check of two recorded things
        against each other, which no recompute reproduces bit for bit."""
        atol, rtol = bundle_tolerance(self.reader.manifest.comparison_policy, stage, name, self.rules.tolerance_policy)
        exact_field = is_exact_field(self.reader.manifest.comparison_policy, stage, name)
        if isinstance(expected, torch.Tensor) and storage_unit(self.precision.compute, expected):
            self._coarse_output(stage, name, expected)
        e = expected.detach().reshape(-1) if isinstance(expected, torch.Tensor) else as_float64(expected)

        def tolerance(lo: int, hi: int) -> torch.Tensor:
            tol = e[lo:hi].to(torch.float64).abs().mul_(rtol).add_(atol)
            if bound is not None and not exact_field:
                tol += bound[lo:hi].to(torch.float64) if isinstance(bound, torch.Tensor) else bound(lo, hi)
            return tol

        runs = None
        if per_sample is not None and per == PER_TOKEN and compared is None and not self.rules.exact:
            runs = self._runs(e, per_sample, atol, rtol, bound is not None and not exact_field)

        if per == PER_TOKEN:
            where = dict(sample_ids=self.sample_ids, group_indices=self.group_indices, offsets=self.offsets,
                         lengths=self.lengths)
        elif per == PER_SAMPLE:
            where = dict(sample_ids=self.sample_ids, group_indices=self.group_indices)
        else:
            where = {}
        result = FieldResult(stage=stage, name=name, per=per, expected=e, actual=actual, tolerance=tolerance,
                             labels=labels, note=note, rank=self.rank, compared=compared, flagged=flagged,
                             exact=self.rules.exact if exact is None else exact, runs=runs, **where)
        if per == PER_TOKEN and self.full_total > KEEP_COLUMNS:
            result.release = self.release  # judging it lets the payload rows go behind its pass, as token_chunks does
        return result

    def _runs(self, e: torch.Tensor, per_sample: tuple[torch.Tensor, torch.Tensor], atol: float, rtol: float,
              bounded: bool) -> Optional[SampleRuns]:
        """The per-sample columns of a broadcast field whose recorded tokens repeat one value per sample (NaN
        never repeats: such a field is judged token by token), else ``None``."""
        if e.numel() != int(self.lengths.sum()) or e.dtype not in (torch.float32, torch.float64, torch.float16,
                                                                   torch.bfloat16):
            return None
        present = self.lengths > 0
        first = torch.zeros(self.n, dtype=e.dtype)
        starts = self.offsets[present]
        first[present] = e[starts]
        if bool(torch.isnan(first).any()) or not self._repeats(e, starts):
            return None
        e_s = first.to(torch.float64)
        actual, bound = per_sample
        tol = e_s.abs().mul_(rtol).add_(atol)  # the token tolerance's arithmetic, on the sample's values
        if bounded:
            tol += bound.to(torch.float64)
        return SampleRuns(expected=e_s, actual=actual.to(torch.float64), tolerance=tol)

    def _repeats(self, e: torch.Tensor, starts: torch.Tensor) -> bool:
        """Whether every token of ``e`` but a sample's first equals the token before it (``==``: a NaN never
        repeats; ``starts``, ascending: where each non-empty sample starts) — each sample's tokens all equal to its
        first, the test of one comparison over RELEASE_ROWS tokens at a time, a sample's first token exempt: no
        per-sample or per-chunk Python. The mapped rows are let go behind each block as the chunked passes do."""
        total = e.numel()
        release = total > KEEP_COLUMNS
        for lo in range(0, total, RELEASE_ROWS):
            hi = min(lo + RELEASE_ROWS, total)
            a = max(lo, 1)  # token t against t − 1, t in [a, hi)
            step = torch.ne(e[a:hi], e[a - 1:hi - 1])
            first = int(torch.searchsorted(starts, a))
            step[starts[first:int(torch.searchsorted(starts, hi))] - a] = False
            same = not bool(step.any())
            if release:
                self.release(lo, hi)
            if not same:
                return False
        return True

    def hazard(self, stage: str, kind: str, *, message: str, sample: Optional[int] = None,
               group_index: Optional[int] = None) -> None:
        """Report a hazard at the selected sample ``sample`` (an index into :attr:`samples`) or a group."""
        self.hazards.append(Hazard(stage=stage, kind=kind, sample_id=self.sample_ids[sample] if sample is not None
                                   else None, group_index=group_index, message=message, rank=self.rank))

    def coarse_payload_hazard(self, stage: str, named: dict, admits: str) -> bool:
        """One ``coarse_payload`` hazard when any of ``named`` (payloads) is stored coarser than the declared
        compute (``error_model.coarse_payloads``): ``<payloads> stored coarser than the declared float32 compute:
        <admits>``. Whether it was raised."""
        coarse = coarse_payloads(self.precision.compute, named)
        if coarse:
            self.hazard(stage, "coarse_payload", message=(
                f"{coarse} stored coarser than the declared {self.precision.compute} compute: {admits}"))
        return bool(coarse)

    def _coarse_output(self, stage: str, name: str, expected: torch.Tensor) -> None:
        """A recorded output stored coarser than the compute (a bf16 copy of float32 advantages): its own
        rounding is in the field's bound (each stage's ``u_store·|T|``), so a change smaller than that is not
        seen there. Said once per stage, every such output in one clause: in the stage's ``coarse_payload``
        hazard, or one of its own."""
        outputs = self._coarse_outputs.setdefault(stage, {})
        outputs[name] = expected
        coarse = coarse_payloads(self.precision.compute, outputs)
        many = len(outputs) > 1
        own = f"compared within {'their' if many else 'its'} own rounding (about u·|value|)"
        alone = (f"{coarse} stored coarser than the declared {self.precision.compute} compute: {own}: a change "
                 "smaller than that is not seen there")
        for k, h in enumerate(self.hazards):
            if h.stage == stage and h.kind == "coarse_payload":
                base = self._coarse_inputs.setdefault(stage, h.message)
                message = alone if base is None else f"{base}; the recorded {coarse} {'are' if many else 'is'} {own}"
                self.hazards[k] = msgspec.structs.replace(h, message=message)
                return
        self._coarse_inputs[stage] = None  # the hazard is the outputs' own
        self.hazard(stage, "coarse_payload", message=alone)

    def report(self, stage: StageId, fields: list[FieldResult], *, fail_reason: "str | ReasonFn",
               pass_reason: "str | ReasonFn", structural: Optional[Comparison] = None) -> StageReport:
        """Leave ``fields`` on the context (``self.fields[stage]``) and build the stage's report from them."""
        self.fields[stage.value] = fields
        return stage_report(stage.value, fields, self.keep, fail_reason=fail_reason, pass_reason=pass_reason,
                            structural=structural)


class Chunked:
    """Columns computed together for rows ``[lo, hi)`` by one function (a recomputed value and its bound share
    their inputs), the last chunk kept: a FieldResult reads a chunk's actual and tolerance one after the
    other, and each column is then a function of ``(lo, hi)``."""

    def __init__(self, fn: Callable[[int, int], dict[str, torch.Tensor]]) -> None:
        self.fn = fn
        self._key: Optional[tuple[int, int]] = None
        self._value: dict[str, torch.Tensor] = {}

    def __call__(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        if self._key != (lo, hi):
            self._value = self.fn(lo, hi)
            self._key = (lo, hi)
        return self._value

    def column(self, name: str) -> Callable[[int, int], torch.Tensor]:
        return lambda lo, hi: self(lo, hi)[name]


@dataclass(frozen=True)
class StageDef:
    """A stage adapter: what it needs upstream, which knobs it refuses, and how it runs.

    ``needs``: stages whose recomputed output it consumes (run first when declared ``recompute``).
    ``cohort_level``: compares a cohort scalar, so it is skipped under a partial selection.
    ``refuse``: ``config -> [(knob, why)]`` knobs V1 cannot recompute for this stage (exit 4).
    ``requirements``: ``reader -> [missing]`` inputs/expected outputs, checked by ``validate``.
    ``any_cp`` / ``optional``: see the fields.
    """

    id: StageId
    run: Callable[[StageContext], StageReport]
    needs: tuple[StageId, ...] = ()
    cohort_level: bool = False
    refuse: Callable[[RecomputeConfig], list[tuple[str, str]]] = lambda cfg: []
    requirements: Callable[[BundleReader], list[str]] = lambda reader: []
    description: str = ""
    # Reads whole trajectories (a producer joins context-parallel shards), so it runs at any CP size.
    any_cp: bool = False
    # Outside the V1 DAG: reported only when a bundle declares it.
    optional: bool = False
