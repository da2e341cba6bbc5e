"""Top of the screen: the title line and the verdict line (replay progress while the worker runs)."""

from __future__ import annotations

from typing import Optional

from rich.text import Text
from textual.widgets import Static

from replay_lib.report import STATUS_PASS, ReplayReport

from ..model import first_divergence_text


class TitleBar(Static):
    DEFAULT_CSS = """
    TitleBar { height: 1; background: $panel; color: $text; text-style: bold; padding: 0 1; }
    """

    def show(self, name: str, report: Optional[ReplayReport] = None) -> None:
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append("replay-tui", style="bold")
        if report is not None:
            text.append(f"  {report.bundle_id}")
            text.append(f" · {name}", style="not bold")
            if report.kind:
                text.append(f" · {report.kind}-level {report.anchor}", style="not bold")
            if len(report.ranks) > 1:
                text.append(f" · {len(report.ranks)} ranks", style="not bold")
        else:
            text.append(f"  {name}", style="not bold")
        text.append("   ?/F1 help · ctrl+p commands", style="not bold dim")
        self.update(text)


FAIL_PREFIX = "✗ first divergence in "


class VerdictBar(Static):
    DEFAULT_CSS = """
    VerdictBar { height: auto; max-height: 3; padding: 0 1; }
    VerdictBar.-fail { background: $error 20%; }
    VerdictBar.-pass { background: $success 15%; }
    """
    report: Optional[ReplayReport] = None
    _progress_shown = False
    _shown_one_line = True

    def show_progress(self, stage: str, done: int, total: int) -> None:
        # One line replacing one line: no relayout of the screen (the replay worker is busy meanwhile).
        relayout = self.report is not None or not self._progress_shown
        self._progress_shown = True
        self.report = None
        self.set_classes("")
        text = Text()
        text.append("⟳ ", style="bold")
        if stage == "verify":
            text.append("verifying bundle (checksums, schema, anchors)…")
        elif stage == "model":
            text.append(f"replayed {total} stage(s); preparing the diff…")
        else:
            width = max(total, 1)
            bar = "■" * done + "□" * (width - done)
            text.append(f"replaying {stage}  {done}/{total} ")
            text.append(bar, style="dim")
        self.update(text, layout=relayout)

    def on_resize(self) -> None:
        if self.report is not None and self._one_line(self.report) != self._shown_one_line:
            self.show_report(self.report)

    def _one_line(self, report: ReplayReport) -> bool:
        """Whether the verdict and the divergence line fit on one line of this bar (before the first
        layout, of the screen: the bar spans it)."""
        line = first_divergence_text(report)
        width = self.size.width or self.app.size.width
        verdict = len(FAIL_PREFIX) + len(report.first_divergent_stage or "?")
        return not line or verdict + 3 + len(line) <= max(width - 2, 0)

    def show_report(self, report: ReplayReport) -> None:
        """One line when it fits; else the divergence goes on its own line, whole (never split)."""
        self.report = report
        one_line = self._one_line(report)
        text = Text()
        if report.passed:
            self.set_classes("-pass")
            compared = sum(1 for s in report.stages if s.status == STATUS_PASS)
            text.append("✓ no divergence", style="bold green")
            text.append(f" — {compared} stage(s) compared")
        else:
            self.set_classes("-fail")
            text.append(FAIL_PREFIX, style="bold red")
            text.append(report.first_divergent_stage or "?", style="bold red")
            line = first_divergence_text(report)
            if line:
                text.append(" — " if one_line else "\n  ")
                text.append(line, style="bold")
        self._shown_one_line = one_line
        self.update(text)
