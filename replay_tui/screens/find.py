"""The jump dialog (``/``) that also finds in the diff: ``@17`` goes to token offset (or table row) 17 of the
viewed diff, a number to the next row whose expected or actual value matches it to the digits typed, and a
sample id jumps to that sample as :class:`JumpScreen` does (an id wins over a number: ``17`` may be an id).

The offset or value query runs through the caller (``resolve``), which moves the diff cursor and returns
the error to show, or None; the dialog stays open with the error while the user retypes."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

from rich.text import Text
from textual.widgets import Input, Static

from .jump import JumpScreen


def is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


class FindScreen(JumpScreen):
    def __init__(self, sample_ids: Sequence[str], resolve: Callable[[str], Optional[str]]) -> None:
        super().__init__(sample_ids)
        self.resolve = resolve

    def on_mount(self) -> None:
        super().on_mount()
        box = self.query_one(Input)
        box.placeholder = f"sample id, e.g. {self._example} (→ completes) · @17 offset · a value"

    def on_input_submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        if value in self.sample_ids or value in self.shown_ids or not (value.startswith("@") or is_number(value)):
            return  # a sample id (or what is none of these): JumpScreen's handler runs next and says which
        event.prevent_default()  # JumpScreen's handler would call it an unknown sample
        error = self.resolve(value)
        if error is None:
            self.dismiss(None)
        else:
            self.query_one("#jump-error", Static).update(Text(error))
