"""The memory monitor's thread outlives a transient read error and says when it gives up (issue 31 item 4)."""

from __future__ import annotations

import time

import psutil
import pytest

from helpers import MemoryMonitor
from helpers.monitoring.monitor import MAX_READ_FAILURES, MemoryWarning


def _wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)


def test_one_failed_readout_does_not_end_the_sampling(monkeypatch):
    real, calls = psutil.virtual_memory, {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("transient /proc read error")
        return real()

    mon = MemoryMonitor(interval=0.01, warn=False).start()
    monkeypatch.setattr(psutil, "virtual_memory", flaky)
    try:
        _wait_for(lambda: calls["n"] > 6)
        assert mon._thread.is_alive()
        n = len(mon.samples)
        _wait_for(lambda: len(mon.samples) > n + 2)
        assert len(mon.samples) > n + 2  # still sampling after the error
    finally:
        mon.stop()
    assert mon.read_errors == ["OSError: transient /proc read error"] and mon.stopped_by is None
    assert "1 readouts failed" in str(mon)


def test_a_readout_that_keeps_failing_stops_the_thread_and_says_so(monkeypatch):
    def broken():
        raise OSError("gone")

    mon = MemoryMonitor(interval=0.01).start()
    monkeypatch.setattr(psutil, "virtual_memory", broken)
    with pytest.warns(MemoryWarning, match="failed readouts"):
        _wait_for(lambda: mon.stopped_by is not None)
        mon._thread.join(timeout=5)
    monkeypatch.undo()
    mon.stop()
    assert len(mon.read_errors) == MAX_READ_FAILURES
    assert "sampling thread" in str(mon)
