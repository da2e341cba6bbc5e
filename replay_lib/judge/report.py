"""The replay report: one msgspec Struct rendered three ways (text, ``--format json``, the TUI).

The JSON keys of :class:`ReplayReport`, :class:`StageReport` and :class:`Divergence` listed in SPEC §5 are
an API; fields after them are additions that scripts may ignore.
"""

from __future__ import annotations

import math
import struct
from typing import Optional, Union

import msgspec

from ..safe_text import json_document, safe
from ..bundle.selection import group_label

STATUS_PASS = "pass"
STATUS_FAIL = "fail"
STATUS_SKIPPED = "skipped"


class Divergence(msgspec.Struct, frozen=True, kw_only=True):
    stage: str
    rank: Optional[int] = None
    sample_id: Optional[str] = None
    group_index: Optional[int] = None
    field: str
    token_offset: Optional[int] = None
    expected: Optional[float] = None
    actual: Optional[float] = None
    abs_error: Optional[float] = None
    message: Optional[str] = None
    # The effective bound of this element (the bundle's atol + rtol·|e| plus the producer's rounding bound,
    # see error_model) and |a − e| / tolerance; None for a structural divergence.
    tolerance: Optional[float] = None
    noise_ratio: Optional[float] = None


class Hazard(msgspec.Struct, frozen=True, kw_only=True):
    """A place where a legitimate producer's result is dominated by rounding or mathematically undefined
    (SPEC §5.1): reported, never failed. ``kind``: ``near_zero_std``, ``singleton_group``,
    ``zero_advantage_group``, ``kl_clamp``, ``clip_boundary``, ``extreme_ratio``, ``coarse_payload``; ``sample_id`` or
    ``group_index`` says where (neither: a summary of further places)."""

    stage: str
    kind: str
    sample_id: Optional[str] = None
    group_index: Optional[int] = None
    message: str
    rank: Optional[int] = None


class StageReport(msgspec.Struct, frozen=True, kw_only=True):
    stage: str
    status: str
    reason: str = ""
    mismatches: int = 0
    max_abs_error: Optional[float] = None
    divergences: list[Divergence] = []
    capability: Optional[str] = None
    compared: int = 0
    max_noise_ratio: Optional[float] = None
    # Under --chain: the upstream stage this one fails only because of (it passes when judged on its recorded
    # inputs, replay_lib.explain.downstream); None for a root cause. Its status stays "fail".
    downstream_of: Optional[str] = None
    # Stage logprob.mismatch only (SPEC §4.4): its counts, maxima, first differing token per pair and the
    # recomputed metrics; absent (not written) for every other stage.
    mismatch: Union[dict, msgspec.UnsetType] = msgspec.UNSET


class Explanation(msgspec.Struct, frozen=True, kw_only=True):
    """A known bug that reproduces a failing stage's recorded values (SPEC §10, ``replay_lib.explain``):
    ``matched`` of the ``of`` compared elements (``unit``) agree with the hypothesis within the error model's
    tolerance; ``detail`` says it in words."""

    stage: str
    hypothesis: str
    matched: int
    of: int
    detail: str
    unit: str = "values"
    rank: Optional[int] = None


class ReplayReport(msgspec.Struct, frozen=True, kw_only=True):
    bundle_id: str
    passed: bool
    first_divergent_stage: Optional[str]
    first_divergence: Optional[Divergence]
    stages: list[StageReport]
    kind: str = ""
    anchor: str = ""
    ranks: list[int] = []
    selected_samples: Optional[list[str]] = None
    warnings: list[str] = []
    # How it was judged: "per_stage" (teacher forcing: each stage on its recorded inputs) or "chained"
    # (--chain); --exact (bitwise, float32 kernels); --tolerance-policy.
    mode: str = "per_stage"
    exact: bool = False
    tolerance_policy: str = "bundle"
    hazards: list[Hazard] = []
    explanations: list[Explanation] = []
    # --bitwise (stage logprob.mismatch's oracle); written only when on
    bitwise: Union[bool, msgspec.UnsetType] = msgspec.UNSET

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def stage(self, name: str) -> Optional[StageReport]:
        for s in self.stages:
            if s.stage == name:
                return s
        return None


REPORT_ENCODER = msgspec.json.Encoder()
REPORT_DECODER = msgspec.json.Decoder(ReplayReport)


def report_to_json(report: ReplayReport) -> str:
    """The report as JSON; the same values, with the characters :func:`safe` escapes written as ``\\uXXXX``
    (valid JSON that a terminal shows as text)."""
    return json_document(report, REPORT_ENCODER.encode)


def fmt_value(x: Optional[float]) -> str:
    """Shortest decimal that round-trips through float32 (``-5.5``, ``-1.0``, ``0.8974426``)."""
    if x is None:
        return "nan"
    if isinstance(x, int) and not isinstance(x, bool):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    try:
        target = struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return repr(x)
    for digits in range(1, 10):
        text = f"{x:.{digits}g}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == target:
            break
    if "e" in text and 1e-4 <= abs(float(text)) < 1e16 and float(text) == target:
        # exactly the float32 value: positional, as Python prints it (10.0, not 1e+01); a form whose trailing
        # zeros would claim digits the value does not have (1.2345679e+08) stays as it is
        text = repr(float(text))
    if "e" not in text and "." not in text and "n" not in text:
        text += ".0"
    return text


# The text lines below are a view of the report: what came from the bundle (ids, messages, reasons) is
# escaped here, so the CLI and the TUI show the same, terminal-safe text.


def fmt_ratio(x: Optional[float]) -> str:
    """A noise ratio as the verbose report prints it: ``0.33``, ``12``, ``2.1e6``, ``inf``."""
    if x is None or math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "0"
    if 0.01 <= x < 1000:
        return f"{x:.2g}" if x < 10 else f"{x:.0f}"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def divergence_line(d: Divergence, multi_rank: bool = False, verbose: bool = False) -> str:
    line = _divergence_line(d, multi_rank)
    if verbose and d.tolerance is not None:
        line += f" tol={fmt_value(d.tolerance)} ({fmt_ratio(d.noise_ratio)}× noise)"
    return safe(line)


def _divergence_line(d: Divergence, multi_rank: bool) -> str:
    where = d.sample_id if d.sample_id is not None else d.stage
    if d.token_offset is not None:
        where = f"{where}@{d.token_offset}"
    if multi_rank and d.rank is not None:
        where = f"{where} [rank {d.rank}]"
    # a row named after its stage (diff's expected.loss.policy.loss) is named once
    name = d.field if where == d.field else f"{d.field} {where}"
    if d.message:
        return f"{name}: {d.message}"
    err = d.abs_error
    if err is None and d.expected is not None and d.actual is not None:
        err = abs(d.actual - d.expected)  # not finite (JSON's null): inf against a finite value, nan with a NaN
    return f"{name}: expected={fmt_value(d.expected)} actual={fmt_value(d.actual)} abs_err={fmt_value(err)}"


def header_line(report: ReplayReport) -> str:
    return safe(_header_line(report))


def _header_line(report: ReplayReport) -> str:
    ranks = f" ({len(report.ranks)} ranks)" if len(report.ranks) > 1 else ""
    if report.first_divergent_stage is None:
        compared = sum(1 for s in report.stages if s.status == STATUS_PASS)
        return f"bundle {report.bundle_id}{ranks} — no divergence ({compared} stage(s) compared)"
    where = ""
    if len(report.ranks) > 1 and report.first_divergence is not None and report.first_divergence.rank is not None:
        where = f" (rank {report.first_divergence.rank})"
    return f"bundle {report.bundle_id}{ranks} — first divergent stage: {report.first_divergent_stage}{where}"


def stage_line(s: StageReport, verbose: bool = False) -> str:
    """``[   fail] stage — reason``; ``verbose``: the reason of a passing stage too, and the stage's largest
    noise ratio (how close to its tolerance the worst element came)."""
    line = f"[{'downstream' if s.downstream_of else s.status:>7}] {s.stage}"
    if s.reason and (s.status != STATUS_PASS or verbose):
        line += f" — {s.reason}"
    if s.downstream_of:
        line += f" (downstream of {s.downstream_of}: passes on its recorded inputs)"
    if verbose and s.max_noise_ratio is not None:
        line += f" (max {fmt_ratio(s.max_noise_ratio)}× noise)"
    return safe(line)


def explanation_line(e: "Explanation") -> str:
    """``likely cause: <detail> — 4/4 samples`` (``likely cause [rank 1]: …`` when one rank's shard has it)."""
    where = f" [rank {e.rank}]" if e.rank is not None else ""
    return safe(f"likely cause{where}: {e.detail} — {e.matched}/{e.of} {e.unit}")


def tied_causes(report: "ReplayReport", stage: str) -> int:
    """How many of ``stage``'s explanations fit as well as its best (the same ``matched/of``): two exclusive
    causes that both reproduce every value (a mask shifted earlier or later, under a coarse payload's
    allowance) are a tie the report says, not a ranking."""
    mine = [(e.matched, e.of) for e in report.explanations if e.stage == stage]
    return sum(1 for m in mine if m == mine[0]) if mine else 0


def hazard_line(h: "Hazard", multi_rank: bool = False) -> str:
    where = h.sample_id if h.sample_id is not None else (group_label(h.group_index) if h.group_index is not None
                                                         else "")
    if multi_rank and h.rank is not None:
        where = f"{where} [rank {h.rank}]" if where else f"[rank {h.rank}]"
    return safe(f"hazard: {h.stage} {h.kind}{' ' + where if where else ''}: {h.message}")


def render_text(report: ReplayReport, max_lines: int = 5, verbose: bool = False) -> list[tuple[str, str]]:
    """``(style, line)`` pairs; style is one of header/pass/fail/skipped/detail/explanation/hazard/warning. ``verbose``
    adds each divergence's tolerance and noise ratio and each stage's largest noise ratio; the default text
    is the seed's (SPEC §5.2)."""
    multi = len(report.ranks) > 1
    out: list[tuple[str, str]] = [("header-fail" if not report.passed else "header-pass", header_line(report))]
    for s in report.stages:
        out.append((s.status, stage_line(s, verbose)))
        if s.status != STATUS_FAIL:
            continue
        shown = s.divergences[:max_lines]
        for d in shown:
            out.append(("detail", " " * 10 + divergence_line(d, multi, verbose)))
        hidden = s.mismatches - len(shown)
        if hidden > 0:
            tail = f"... {hidden} more"
            if s.max_abs_error is not None:
                tail += f"; max abs_err={fmt_value(s.max_abs_error)}"
            out.append(("detail", " " * 10 + tail))
        for e in report.explanations:
            if e.stage == s.stage:
                out.append(("explanation", " " * 10 + explanation_line(e)))
        tied = tied_causes(report, s.stage)
        if tied > 1:
            out.append(("explanation", " " * 10 + f"({tied} causes fit these values equally well: the recorded "
                                                  "values cannot tell them apart)"))
        if verbose and not s.downstream_of and not any(e.stage == s.stage for e in report.explanations):
            out.append(("explanation", " " * 10 + "likely cause: no known cause matches"))
    for h in report.hazards:
        out.append(("hazard", hazard_line(h, multi)))
    for w in report.warnings:
        out.append(("warning", safe(f"warning: {w}")))
    return out


def report_to_text(report: ReplayReport, max_lines: int = 5) -> str:
    return "\n".join(line for _, line in render_text(report, max_lines)) + "\n"
