"""``CaptureManager``: the training thread never waits; writer errors are counted, never raised."""

from __future__ import annotations

import errno
import logging
import threading

import pytest
import torch

from capture import CaptureItem, CaptureManager

DEADLOCK_GUARD_S = 60.0  # only ever reached when the code under test is broken


class GatedHandler:
    """A writer that blocks (as on a stuck disk) until the test opens the gate."""

    def __init__(self):
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.seen: list[tuple[str, dict]] = []

    def __call__(self, item: CaptureItem):
        self.entered.set()
        if not self.gate.wait(DEADLOCK_GUARD_S):
            raise TimeoutError("gate never opened")
        self.seen.append((item.label, {k: v.tolist() for k, v in item.tensors.items()}))
        return 10


def _item(label: str, value: float = 0.0) -> CaptureItem:
    return CaptureItem(kind="test", label=label, tensors={"x": torch.full((3,), value)})


def test_submit_returns_while_the_writer_is_blocked_and_drops_count(caplog):
    handler = GatedHandler()
    manager = CaptureManager(handler, max_queue=2, register_atexit=False)
    results: list[bool] = []
    try:
        assert manager.submit(_item("r-0"))
        assert handler.entered.wait(DEADLOCK_GUARD_S)  # the writer holds r-0 and is stuck on "disk"

        def training_thread():
            for i in range(1, 6):
                results.append(manager.submit(_item(f"r-{i}")))

        with caplog.at_level(logging.WARNING, logger="capture"):
            t = threading.Thread(target=training_thread)
            t.start()
            t.join(DEADLOCK_GUARD_S)
            assert not t.is_alive(), "submit() waited for the blocked writer"
        assert not handler.gate.is_set()  # everything above happened while the writer was still blocked
        assert results == [True, True, False, False, False]
        stats = manager.stats
        assert (stats.submitted, stats.dropped, stats.written) == (3, 3, 0)
        drops = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        # counted warnings on the 1st and 2nd drop (then every power of two)
        assert drops == [
            "replay capture: dropped r-3 (queue full, queue holds 2); 1 record(s) dropped so far",
            "replay capture: dropped r-4 (queue full, queue holds 2); 2 record(s) dropped so far",
        ]
    finally:
        handler.gate.set()
        assert manager.close(timeout=DEADLOCK_GUARD_S)
    assert [label for label, _ in handler.seen] == ["r-0", "r-1", "r-2"]
    assert (manager.stats.written, manager.stats.bytes_written) == (3, 30)


def test_submit_copies_the_tensors_it_is_given():
    handler = GatedHandler()
    manager = CaptureManager(handler, max_queue=4, register_atexit=False)
    source = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    item = CaptureItem(kind="test", label="copy", tensors={"x": source})
    assert manager.submit(item)
    with torch.no_grad():
        source.mul_(100)  # the trainer reuses its buffer right after submit
    copied = item.tensors["x"]
    assert copied.requires_grad is False and copied.data_ptr() != source.data_ptr()
    handler.gate.set()
    assert manager.close(timeout=DEADLOCK_GUARD_S)
    assert handler.seen == [("copy", {"x": [1.0, 2.0, 3.0]})]


def test_writer_errors_are_logged_counted_and_never_raised(caplog):
    calls: list[str] = []

    def full_disk(item: CaptureItem):
        calls.append(item.label)
        if item.label != "ok":
            raise OSError(errno.ENOSPC, "No space left on device")
        return 7

    manager = CaptureManager(full_disk, max_queue=8, register_atexit=False)
    with caplog.at_level(logging.ERROR, logger="capture"):
        for label in ("a", "b", "ok"):
            assert manager.submit(_item(label)) is True
        assert manager.close(timeout=DEADLOCK_GUARD_S)
    assert calls == ["a", "b", "ok"]  # the writer kept going after the errors
    stats = manager.stats
    assert (stats.errors, stats.written, stats.bytes_written, stats.dropped) == (2, 1, 7, 0)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "replay capture: writing a failed: [Errno 28] No space left on device (1 error(s) so far)",
        "replay capture: writing b failed: [Errno 28] No space left on device (2 error(s) so far)",
    ]


def test_close_is_bounded_and_counts_what_it_could_not_flush():
    handler = GatedHandler()
    manager = CaptureManager(handler, max_queue=4, register_atexit=False)
    for i in range(3):
        assert manager.submit(_item(f"r-{i}"))
    assert handler.entered.wait(DEADLOCK_GUARD_S)
    assert manager.close(timeout=0.05) is False  # the writer is stuck: close gives up instead of hanging
    assert manager.stats.unflushed == 3
    assert manager.submit(_item("late")) is False  # closed: refused and counted
    assert manager.stats.dropped == 1
    handler.gate.set()
    assert manager.flush(DEADLOCK_GUARD_S)
    assert [label for label, _ in handler.seen] == ["r-0", "r-1", "r-2"]


def test_flush_waits_for_everything_accepted():
    done: list[str] = []
    manager = CaptureManager(lambda item: done.append(item.label), max_queue=8, register_atexit=False)
    for i in range(5):
        manager.submit(_item(f"r-{i}"))
    assert manager.flush(DEADLOCK_GUARD_S)
    assert done == [f"r-{i}" for i in range(5)]
    assert manager.stats.written == 0  # the handler returned None: nothing published
    assert manager.close(timeout=DEADLOCK_GUARD_S) and manager.close(timeout=1) is True


def test_queue_must_hold_at_least_one_record():
    with pytest.raises(ValueError, match="max_queue must be at least 1, got 0"):
        CaptureManager(lambda item: None, max_queue=0, register_atexit=False)
