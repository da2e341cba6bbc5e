"""Top of the screen: the title line and the verdict line (replay progress while the worker runs)."""

from __future__ import annotations

from typing import Optional

from rich.cells import cell_len, chop_cells, set_cell_size
from rich.text import Text
from textual.widgets import Static

from replay_lib.judge.report import STATUS_PASS, ReplayReport
from replay_lib.safe_text import safe

from ..model import explanation_text, first_divergence_text


class TitleBar(Static):
    DEFAULT_CSS = """
    TitleBar { height: 1; background: $panel; color: $text; text-style: bold; padding: 0 1;
               text-wrap: nowrap; text-overflow: ellipsis; }
    """
    HINT = "   ?/F1 help · ctrl+p commands"
    _shown: tuple = ()

    def show(self, name: str, report: Optional[ReplayReport] = None) -> None:
        """The bundle's name and anchor; the key hint after them only when it fits whole (the key bar
        names ``?`` too), else the line ends with an ellipsis where the terminal does. The id and the
        directory's name come from the bundle and the capture directory: escaped."""
        self._shown = (name, report)
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append("replay-tui", style="bold")
        if report is not None:
            text.append(f"  {safe(report.bundle_id)}")
            text.append(f" · {safe(name)}", style="not bold")
            if report.kind:
                text.append(f" · {safe(report.kind)}-level {safe(report.anchor)}", style="not bold")
            if len(report.ranks) > 1:
                text.append(f" · {len(report.ranks)} ranks", style="not bold")
        else:
            text.append(f"  {safe(name)}", style="not bold")
        width = self.size.width if self.size.width else max(self.app.size.width - 2, 0)  # padding 0 1
        if text.cell_len + len(self.HINT) <= width:
            text.append(self.HINT, style="not bold dim")
        self.update(text, layout=False)

    def on_resize(self) -> None:
        if self._shown:
            self.show(*self._shown)


FAIL_PREFIX = "✗ first divergence in "
INDENT = "  "
MAX_DIVERGENCE_LINES = 3


def hang(line: str, width: int, limit: int = MAX_DIVERGENCE_LINES) -> list[str]:
    """``line`` cut at spaces into at most ``limit`` lines of ``width`` cells (a word wider than that is
    cut); what does not fit ends the last line with ``…``. Each line is shown after the indent."""
    width = max(width, 1)
    lines: list[str] = []
    current = ""
    for word in line.split(" "):
        candidate = f"{current} {word}" if current else word
        if cell_len(candidate) <= width:
            current = candidate
            continue
        if current:
            lines.append(current)
        pieces = chop_cells(word, width) if cell_len(word) > width else [word]
        lines += pieces[:-1]
        current = pieces[-1]
    if current or not lines:
        lines.append(current)
    if len(lines) > limit:
        lines = lines[:limit - 1] + [ellipsize(lines[limit - 1] + " …", width)]
    return lines


def ellipsize(text: str, width: int) -> str:
    """``text`` when it fits in ``width`` cells, else cut to ``width − 1`` cells and ``…``."""
    if cell_len(text) <= width:
        return text
    return set_cell_size(text, max(width - 1, 0)).rstrip() + "…"


class VerdictBar(Static):
    DEFAULT_CSS = """
    VerdictBar { height: auto; max-height: 5; padding: 0 1; }
    VerdictBar.-fail { background: $error 20%; }
    VerdictBar.-pass { background: $success 15%; }
    """
    report: Optional[ReplayReport] = None
    _progress_shown = False
    _shown_width = 0

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
        if self.report is not None and self._text_width() != self._shown_width:
            self.show_report(self.report)

    def _text_width(self) -> int:
        """Cells for text in this bar (before the first layout, of the screen: the bar spans it)."""
        return self.size.width if self.size.width else max(self.app.size.width - 2, 0)  # padding 0 1

    def _one_line(self, report: ReplayReport) -> bool:
        """Whether the verdict and the divergence line fit on one line of this bar."""
        line = first_divergence_text(report)
        verdict = len(FAIL_PREFIX) + len(safe(report.first_divergent_stage or "?"))
        return not line or verdict + 3 + len(line) <= self._text_width()

    def show_report(self, report: ReplayReport) -> None:
        """One line when it fits; else the divergence goes on its own indented line, and a line wider than
        the bar continues under its own indent, cut at spaces (at most three lines). Hazards (reported, never
        failed) are counted at the end of the verdict's line: ``⚠ 2 hazards``, or ``⚠2`` where that is too
        wide (they never push the divergence onto a line of its own)."""
        self.report = report
        width = self._text_width()
        n = len(report.hazards)
        one_line = self._one_line(report)
        text = Text()
        if report.passed:
            self.set_classes("-pass")
            compared = sum(1 for s in report.stages if s.status == STATUS_PASS)
            text.append("✓ no divergence", style="bold green")
            text.append(f" — {compared} stage(s) compared")
            self._append_mark(text, n, width)
        else:
            self.set_classes("-fail")
            verdict = FAIL_PREFIX + safe(report.first_divergent_stage or "?")
            line = first_divergence_text(report)  # escaped, as the CLI prints it
            if line and one_line and (not n or cell_len(f"{verdict} — {line}") + len(MARK_GAP)
                                      + len(hazard_mark(n, short=True)) <= width):
                text.append(verdict, style="bold red")
                text.append(" — ")
                text.append(line, style="bold")
                self._append_mark(text, n, width)
            else:  # the verdict on one line of its own (cut, never wrapped), the divergence under it
                parts = hang(line, width - len(INDENT)) if line else []
                on_verdict, on_last = self._place_mark(verdict, parts, n, width)
                room = width - (len(MARK_GAP) + len(on_verdict) if on_verdict else 0)
                text.append(ellipsize(verdict, max(room, 1)), style="bold red")
                if on_verdict:
                    text.append(MARK_GAP + on_verdict, style=HAZARD_STYLE)
                for part in parts:
                    text.append("\n" + INDENT)
                    text.append(part, style="bold")
                if on_last:
                    text.append(MARK_GAP + on_last, style=HAZARD_STYLE)
            cause = explanation_text(report)  # the likely cause under them, cut at spaces into two lines at most
            for part in hang(cause, width - len(INDENT), limit=2) if cause else []:
                text.append("\n" + INDENT)
                text.append(part, style="italic")
        self._shown_width = width
        self.update(text)

    @staticmethod
    def _place_mark(verdict: str, parts: list[str], n: int, width: int) -> tuple[str, str]:
        """Where the hazard count goes beside a verdict on its own line: ``(on the verdict line, after the last
        divergence line)``. After the verdict, whole or short; else after the last divergence line; else after
        the verdict cut to make room (the stage's name is in the DAG too)."""
        if not n:
            return "", ""
        for mark in (hazard_mark(n), hazard_mark(n, short=True)):
            if cell_len(verdict) + len(MARK_GAP) + len(mark) <= width:
                return mark, ""
        short = hazard_mark(n, short=True)
        if parts and len(INDENT) + cell_len(parts[-1]) + len(MARK_GAP) + len(short) <= width:
            return "", short
        return short, ""

    @staticmethod
    def _append_mark(text: Text, n: int, width: int) -> None:
        """The hazard count after a verdict line, shortened (``⚠2``) when the whole one does not fit."""
        if not n:
            return
        mark = hazard_mark(n, short=text.cell_len + len(MARK_GAP) + len(hazard_mark(n)) > width)
        text.append(MARK_GAP + mark, style=HAZARD_STYLE)


MARK_GAP = "  "
HAZARD_STYLE = "bold yellow"


def hazard_mark(n: int, short: bool = False) -> str:
    """``⚠ 2 hazards`` (``⚠2`` when ``short``); empty without hazards."""
    if not n:
        return ""
    return f"⚠{n}" if short else f"⚠ {n} hazard{'s' if n != 1 else ''}"
