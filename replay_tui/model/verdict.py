"""The status bar's texts: the first divergence and its likely cause, in one line each.

Part of :mod:`replay_tui.model` (pure data, no Textual)."""

from __future__ import annotations

import math
from typing import Optional

from replay_lib.judge.report import ReplayReport, divergence_line, explanation_line, fmt_value, tied_causes


def first_divergence_text(report: ReplayReport) -> str:
    """The report's first divergence line exactly as the CLI prints it (``reward s-0: expected=…``)."""
    if report.first_divergence is None:
        return ""
    return divergence_line(report.first_divergence, len(report.ranks) > 1)

def explanation_text(report: ReplayReport) -> str:
    """The best explanation of the first divergent stage as the CLI prints it (``likely cause: … — 4/4
    samples``); "" when no known cause matches (``replay_lib.explain``)."""
    for e in report.explanations:
        if e.stage == report.first_divergent_stage:
            tied = tied_causes(report, e.stage)
            return explanation_line(e) + (f" (or {tied - 1} more that fit{'s' if tied == 2 else ''} as well)"
                                          if tied > 1 else "")
    return ""

def fmt_cell(x: Optional[float]) -> str:
    """A table cell: the CLI's shortest float32 form; NaN shows as ``nan``."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    return fmt_value(x)
