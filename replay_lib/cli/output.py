"""Printing the CLI's lines: Rich colours on a terminal, plain text elsewhere, every line escaped.

Below every command module (they all print through :func:`emit`), so no command imports the entry point.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence, TextIO

from ..safe_text import safe

STYLES = {
    "header-fail": "bold red",
    "header-pass": "bold green",
    "pass": "green",
    "fail": "bold red",
    "skipped": "dim",
    "detail": "yellow",
    "hazard": "cyan",
    "explanation": "bold yellow",
    "warning": "magenta",
    "title": "bold",
    "": "",
}


def use_color(stream: TextIO) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def emit(lines: Sequence[tuple[str, str]], stream: Optional[TextIO] = None) -> None:
    """Rich colours on a TTY, plain text otherwise (pipes, CI logs, files). Every line is escaped here, the
    last step before the terminal: whatever a view forgot, a bundle string never writes an escape sequence."""
    stream = stream or sys.stdout
    lines = [(style, safe(line)) for style, line in lines]
    if use_color(stream):
        from rich.console import Console
        from rich.text import Text

        console = Console(file=stream, highlight=False, soft_wrap=True)
        for style, line in lines:
            console.print(Text(line, style=STYLES.get(style, "")))
    else:
        stream.write("".join(line + "\n" for _, line in lines))
    stream.flush()
