"""Messages the replay worker posts to the app (attributes down, messages up)."""

from __future__ import annotations

from textual.message import Message

from .model import ReplayModel


class ReplayProgress(Message):
    """``stage`` is a stage id, ``"verify"`` (checking the bundle) or ``"model"`` (building the diff)."""

    def __init__(self, run: int, stage: str, done: int, total: int) -> None:
        super().__init__()
        self.run = run
        self.stage = stage
        self.done = done
        self.total = total


class ReplayFinished(Message):
    def __init__(self, run: int, model: ReplayModel) -> None:
        super().__init__()
        self.run = run
        self.model = model


class ReplayFailed(Message):
    """The bundle could not be replayed: ``message`` is the CLI's one line, ``code`` its exit code."""

    def __init__(self, run: int, message: str, code: int) -> None:
        super().__init__()
        self.run = run
        self.message = message
        self.code = code
