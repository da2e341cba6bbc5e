"""The run view's mismatch plot: the rollout-vs-old log-prob mismatch of each step over the run, as a sparkline
of max |Δ| (one cell per step, in the scan's order), the peak, the class of the series (zero, constant offset,
jump at a step, drift, no pattern; the rule is ``replay_lib.run.mismatch_series``'s) and why, in two lines.
Hidden while no finished step row records ``rollout_log_probs``."""

from __future__ import annotations

from typing import Iterable, Optional

from rich.text import Text
from textual.widgets import Static

from replay_lib.run.mismatch_series import run_series, sparkline
from replay_lib.safe_text import safe


def plot_lines(rows: Iterable) -> Optional[tuple[str, str]]:
    """The plot's two lines for finished scan rows (any order; sorted here like the scan), ``None`` when no
    step row carries a mismatch."""
    ordered = sorted(rows, key=lambda r: r.target.sort_key)
    series = run_series(ordered)
    if series is None:
        return None
    values = series["max_abs"]
    first = (f"rollout≠old max|Δ| {sparkline(values)}  {series['steps'][0]}…{series['steps'][-1]}  "
             f"peak {max(values):.3g} · k3 peak {max(series['k3']):.3g} · {series['label']}")
    return safe(first), safe(series["why"])


class MismatchPlot(Static):
    DEFAULT_CSS = """
    MismatchPlot { height: 2; padding: 0 1; display: none; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def show_rows(self, rows: Iterable) -> None:
        lines = plot_lines(rows)
        self.display = lines is not None
        if lines is None:
            return
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(lines[0], style="bold")
        text.append("\n")
        text.append(lines[1], style="dim")
        self.update(text)
