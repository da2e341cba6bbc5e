"""What the strips under the diff (error plot, why line, support row) read of the view they follow: a
``Protocol``, so they need the type of :class:`~replay_tui.widgets.diff_view.DiffView` without importing it
(the diff view builds the strips; they must not import it back)."""

from __future__ import annotations

from typing import Optional, Protocol

from ..model import FieldDiff


class FollowedView(Protocol):
    """The diff view as its strips see it: the shown field, the cursor, the scale, and a way to move."""

    diff: Optional[FieldDiff]
    cursor: int
    log_scale: bool

    @property
    def data_row(self) -> int:
        """The data row under the cursor (a token offset, or a table row)."""
        ...

    def show_row(self, data_row: int) -> None:
        """Move the cursor to a data row."""
        ...

    def focus(self, scroll_visible: bool = True) -> object:
        """Give the view the focus."""
        ...
