"""The "why" strip under the diff rows: the inputs of the element under the cursor.

What it prints is :meth:`ReplayModel.element_inputs` (``replay_lib.explain.inputs``): for a reward its group's raw
rewards, mean, std, eps and each member's micro-batch and consumer batch; for a KL token ``r`` and the
formula; for a loss token the ratio, its clip region, the mask, the advantage and the token's contribution
to its sample's term. Line 1 is the formula with its values, line 2 the inputs, line 3 (tall terminals) a
reward group's members or what a loss token adds to its sample's terms. A line longer than the strip is wide
wraps, and a formula too long for its rows keeps its value (``cells.fit_rows``). Line API: one lookup per cursor
move, the lines cached until the element changes, the rows until the strip's size changes too."""

from __future__ import annotations

from typing import Optional

from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from replay_lib.explain.inputs import STREAM_MARK, ElementInputs
from replay_lib.safe_text import safe
from replay_lib.stages import StageInputError

from ..cells import BOLD, DIM, fit_rows, strip_of
from .followed import FollowedView
from ..model import ReplayModel


LINES = 3


def inputs_parts(inputs: ElementInputs) -> list[list[tuple[str, Optional[Style]]]]:
    """The strip's lines as ``(text, style)`` parts: labels dim, values plain; bundle text escaped."""
    where = safe(inputs.sample_id or "")
    if inputs.offset is not None:
        where += f"@{inputs.offset}"
    first: list[tuple[str, Optional[Style]]] = [("why ", DIM)]
    if where:
        first.append((where + " ", BOLD))
    first.append((safe(inputs.formula), None))
    lines = [first]
    items: list[tuple[str, Optional[Style]]] = []
    for label, value in inputs.items:
        items += [(("  " if items else "") + label + " ", DIM), (safe(value), None)]
    if items:
        lines.append(items)
    if inputs.members:
        streamed = any(cb.startswith(STREAM_MARK) for _, _, cb in inputs.members)
        members: list[tuple[str, Optional[Style]]] = [("mb/cb" + (" (~: stream order)" if streamed else ""), DIM)]
        for sid, mb, cb in inputs.members:
            members += [("  " + safe(sid) + " ", BOLD if sid == inputs.sample_id else None), (safe(mb), None),
                        ("/", DIM), (safe(cb), None)]
        lines.append(members)
    if inputs.note:
        lines.append([(safe(inputs.note), DIM)])
    return lines


class WhyStrip(Widget):
    DEFAULT_CSS = """
    WhyStrip { height: 3; border-top: none; }
    """

    def __init__(self, view: FollowedView, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view = view
        self.model: Optional[ReplayModel] = None
        self._key: tuple = ()
        self._lines: list[list[tuple[str, Optional[Style]]]] = []
        self._rows: tuple[tuple, list[list[tuple[str, Optional[Style]]]]] = ((), [])

    def element_key(self) -> tuple:
        diff = self.view.diff
        if diff is None or self.model is None or not len(diff):
            return ()
        return id(self.model), diff.field, diff.sample_id, self.view.data_row

    def current_lines(self) -> list[list[tuple[str, Optional[Style]]]]:
        key = self.element_key()
        if key != self._key:
            self._key = key
            self._lines = self._compute()
        return self._lines

    def _compute(self) -> list[list[tuple[str, Optional[Style]]]]:
        diff = self.view.diff
        if not self._key:
            return []
        try:
            inputs = self.model.element_inputs(diff.field, diff.sample_id, self.view.data_row)
        except (KeyError, IndexError) as exc:
            return [[("why ", DIM), (safe(str(exc.args[0]) if exc.args else "no input breakdown"), DIM)]]
        except StageInputError as exc:
            return [[("why ", DIM), ("inputs unusable: " + safe(str(exc)), DIM)]]
        return inputs_parts(inputs)

    def text_lines(self) -> list[str]:
        """The strip as plain text (tests, the clipboard)."""
        return ["".join(t for t, _ in parts) for parts in self.current_lines()]

    def rows(self) -> list[list[tuple[str, Optional[Style]]]]:
        """The lines as the strip shows them: wrapped to its width, within its height, the formula (and its
        value) first (``cells.fit_rows``)."""
        lines = self.current_lines()
        key = (self._key, self.size.width, self.size.height)
        if self._rows[0] != key:
            self._rows = (key, fit_rows(lines, self.size.width, self.size.height))
        return self._rows[1]

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.rich_style
        rows = self.rows()
        if y >= len(rows):
            return Strip.blank(width, base)
        return strip_of(rows[y], width, base)
