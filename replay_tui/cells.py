"""Fixed-width cells for line-API rows. Data text is never parsed as markup here: rows are rich
``Segment``s built from plain strings, so a sample id like ``s-[0]`` shows as written. Nor can it act on
the terminal: the panes escape bundle strings before they measure them (:func:`replay_lib.safe_text.safe`),
and :func:`strip_of` escapes every part again, so a row never carries a control character."""

from __future__ import annotations

import math
from typing import Iterable, Optional

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip

from replay_lib.judge.report import fmt_ratio as report_ratio
from replay_lib.judge.report import fmt_value
from replay_lib.safe_text import safe

PASS = Style(color="green")
FAIL = Style(color="red", bold=True)
FAIL_SOFT = Style(color="red")
SKIP = Style(dim=True)
WARN = Style(color="yellow")
DIM = Style(dim=True)
BOLD = Style(bold=True)
HEADER = Style(bold=True, dim=True)
FIRST = Style(color="white", bgcolor="red", bold=True)

SPARK = "▁▂▃▄▅▆▇█"


def fit(text: str, width: int, align: str = "<") -> str:
    """``text`` padded or truncated (with ``…``) to exactly ``width`` cells."""
    if width <= 0:
        return ""
    if cell_len(text) > width:
        text = set_cell_size(text, width - 1) + "…" if width > 1 else set_cell_size(text, width)
    pad = width - cell_len(text)
    return " " * pad + text if align == ">" else text + " " * pad


def strip_of(parts: Iterable[tuple[str, Optional[Style]]], width: int, base: Style) -> Strip:
    """A row of ``(text, style)`` parts, cropped/padded to ``width``, over the widget's ``base`` style.

    One ``Strip`` is built, from segments already styled, merged (neighbours of the same style become one
    segment: an |err| strip of a hundred cells is a handful) and cut to the width: the
    ``Strip(...).apply_style(base).crop_extend(...)`` chain built three strips per row."""
    texts: list[str] = []
    styles: list[Optional[Style]] = []
    used = 0
    for text, style in parts:
        if not text or used >= width:
            continue
        text = safe(text)  # the last step before the terminal (a printable part costs one isprintable call)
        n = cell_len(text)
        if used + n > width:
            text = set_cell_size(text, width - used)
            n = width - used
        if styles and styles[-1] == style:
            texts[-1] += text
        else:
            texts.append(text)
            styles.append(style)
        used += n
    segments = [Segment(text, base + style if style is not None else base) for text, style in zip(texts, styles)]
    if used < width:
        segments.append(Segment(" " * (width - used), base))
    return Strip(segments, width)


Parts = list[tuple[str, Optional[Style]]]
WRAP_INDENT = "  "  # a wrapped line's continuation rows
WRAP_SLACK = 12  # cells a formula cut to fit its rows gives up per row, so that its rows break at spaces


def _cells(parts: Parts) -> list[tuple[str, Optional[Style]]]:
    return [(ch, style) for text, style in parts for ch in safe(text)]


def _parts(cells: list[tuple[str, Optional[Style]]]) -> Parts:
    out: Parts = []
    for ch, style in cells:
        if out and out[-1][1] == style:
            out[-1] = (out[-1][0] + ch, style)
        else:
            out.append((ch, style))
    return out


def wrap_parts(parts: Parts, width: int, hard: bool = False) -> list[Parts]:
    """A line of ``(text, style)`` parts as rows of at most ``width`` cells: broken after the last space of a
    row when there is one in its second half (``hard``: always at the width); continuation rows are indented."""
    cells = _cells(parts)
    rows: list[Parts] = []
    indent = [(ch, None) for ch in WRAP_INDENT] if width > 2 * len(WRAP_INDENT) else []
    while cells:
        room, used, cut = width - (len(indent) if rows else 0), 0, 0
        while cut < len(cells) and used + cell_len(cells[cut][0]) <= room:
            used += cell_len(cells[cut][0])
            cut += 1
        if cut < len(cells) and not hard:
            space = next((i for i in range(cut - 1, cut // 2, -1) if cells[i][0] == " "), None)
            cut = space + 1 if space is not None else cut
        cut = max(cut, 1)  # a character wider than the row still takes one: every row consumes something
        rows.append(_parts((indent if rows else []) + cells[:cut]))
        cells = cells[cut:]
    return rows or [[]]


def _width(cells: list[tuple[str, Optional[Style]]]) -> int:
    return sum(cell_len(ch) for ch, _ in cells)


def _value_end(text: str) -> int:
    """Where the value of a formula ends: after the last number that follows a `` = `` (``… = -1.999992 (note);
    b = the mean …`` ends after ``-1.999992``); the whole text when there is none."""
    end, at = len(text), text.find(" = ")
    while at >= 0:
        after = text.find(" ", at + 3)
        word = text[at + 3:after if after >= 0 else len(text)].rstrip(",;)")
        try:
            float(word)
            end = after if after >= 0 else len(text)
        except ValueError:
            pass
        at = text.find(" = ", at + 3)
    return end


def elide_line(parts: Parts, cells_left: int) -> Parts:
    """``parts`` cut to ``cells_left`` cells, keeping a formula's value (:func:`_value_end`): the text up to the
    value stays whole when it fits, what follows it (a note) is cut with ``…``; when it does not fit, its middle
    goes for ``…`` (its start says what it is, its end is the value)."""
    cells = _cells(parts)
    if _width(cells) <= cells_left or cells_left < 3:
        return parts if cells_left >= 3 else _parts(cells[:max(cells_left, 0)])
    text = "".join(ch for ch, _ in cells)
    end = _value_end(text)
    head, tail = cells[:end], cells[end:]
    if tail and _width(head) + 2 <= cells_left:
        while _width(head) + _width(tail) + 1 > cells_left:
            tail.pop()
        return _parts(head + tail + [("…", DIM)])
    first = (cells_left - 1) * 2 // 5
    last = cells_left - 1 - first
    return _parts(head[:first] + [("…", DIM)] + head[len(head) - last:])


def fit_rows(lines: list[Parts], width: int, height: int) -> list[Parts]:
    """Logical lines (the first most important) wrapped into at most ``height`` rows of ``width`` cells: the
    first line takes the rows it needs but one (kept for the second line), cut around its value when it needs
    more (:func:`elide_line`); the next lines take what is left: the last row shown ends in ``…`` when its line
    goes on."""
    if width <= 0 or height <= 0 or not lines:
        return []
    most = height - 1 if len(lines) > 1 and height > 1 else height
    first = wrap_parts(lines[0], width)
    if len(first) > most:
        room = width + (most - 1) * (width - len(WRAP_INDENT))
        # broken at spaces when the line cut a little shorter still fits so and keeps all of it up to its value (a
        # few cells given up at each row's end), else at the width
        cells = _cells(lines[0])
        head = _width(cells[:_value_end("".join(ch for ch, _ in cells))])
        tries = [(room - WRAP_SLACK * (most - 1), False)] if head + 2 <= room - WRAP_SLACK * (most - 1) else []
        for cut, hard in (*tries, (room, True)):
            wrapped = wrap_parts(elide_line(lines[0], cut), width, hard=hard)
            if len(wrapped) <= most:
                break
        first = wrapped[:most]
    rows = [(row, i == len(first) - 1) for i, row in enumerate(first)]  # (row, its line ends there)
    for line in lines[1:]:
        wrapped = wrap_parts(line, width)
        rows += [(row, i == len(wrapped) - 1) for i, row in enumerate(wrapped)]
    if len(rows) <= height:
        return [row for row, _ in rows]
    shown = [row for row, _ in rows[:height]]
    if not rows[height - 1][1]:
        last = _cells(shown[-1])
        while last and sum(cell_len(ch) for ch, _ in last) > width - 1:
            last.pop()
        shown[-1] = _parts(last + [("…", DIM)])
    return shown


def fit_number(x: Optional[float], width: int) -> str:
    """The CLI's shortest float32 form when it fits, else fewer significant digits (never ``…``)."""
    text = "nan" if x is None or math.isnan(x) else fmt_value(x)
    if len(text) <= width or x is None or not math.isfinite(x):
        return fit(text, width, ">")
    for digits in range(8, 0, -1):
        text = f"{x:.{digits}g}"
        if len(text) <= width:
            break
    return fit(text, width, ">")


def fmt_ratio(x: Optional[float]) -> str:
    """A noise ratio ``|a − e| / tolerance`` in a few cells, as the verbose text report prints it: ``0``,
    ``0.33``, ``2.1``, ``46``, ``457``, ``2.1e6``, ``4.2e-5``; ``inf`` for a difference against a zero tolerance
    (``--exact``), ``nan`` where a side is not finite, ``—`` where nothing was compared. Two digits are what
    the ratio is read for: within the noise (< 1), or how many times beyond it."""
    return "—" if x is None else report_ratio(x)


def fit_ratio(x: Optional[float], width: int) -> str:
    """:func:`fmt_ratio` right-aligned in ``width`` cells; an exponent form too wide loses its mantissa's
    decimal (``1.0e308`` → ``1e308``) rather than being cut."""
    text = fmt_ratio(x)
    if len(text) > width and "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{round(float(mantissa))}e{exponent}"
    return fit(text, width, ">")


def fmt_tolerance(x: Optional[float]) -> str:
    """A tolerance in a few cells, two significant digits (``1e-6``, ``2.2e-6``, ``0.0013``, ``0``): the bound's
    size, not its every bit; ``—`` where there is none."""
    if x is None:
        return "—"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "0"
    r = float(f"{x:.1e}")
    if 1e-3 <= abs(r) < 100:
        return f"{r:.2g}"
    if 100 <= abs(r) < 1e4:
        return f"{r:.0f}"
    return _short_exponent(f"{r:.1e}")


def _short_exponent(text: str) -> str:
    """``2.1e+06`` → ``2.1e6``, ``4.0e-05`` → ``4e-5``: the exponent without its sign and zero padding."""
    mantissa, exponent = text.split("e")
    if mantissa.endswith(".0"):
        mantissa = mantissa[:-2]
    return f"{mantissa}e{int(exponent)}"
