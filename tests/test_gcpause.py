"""gc_paused: nestable, thread-safe, and it leaves the collector as it found it."""

from __future__ import annotations

import gc
import threading

from replay_lib.bundle.gcpause import gc_paused


def test_nested_phases_restore_the_collector_once_the_last_ends():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer phase is still running
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_phases_in_two_threads():
    inside, release = threading.Event(), threading.Event()

    def worker():
        with gc_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(10)
    with gc_paused():
        pass
    assert not gc.isenabled()  # the worker's phase still holds it off
    release.set()
    t.join(10)
    assert gc.isenabled()


def test_an_exception_still_restores_it():
    try:
        with gc_paused():
            raise ValueError("boom")
    except ValueError:
        pass
    assert gc.isenabled()
