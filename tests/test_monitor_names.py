"""MemoryMonitor's threshold warning names who holds the largest tensors, from its sampling thread: the census of
the namespace it was given (or the notebook's), and where there is none, a note saying how to get the names."""

from __future__ import annotations

import threading

import torch

from helpers.core.units import MiB
from helpers.monitoring.monitor import UNNAMED_NOTE, MemoryMonitor


def crossing_from_a_thread(mon: MemoryMonitor):
    """The first crossing, sampled on another thread (as the monitor's own does)."""
    t = threading.Thread(target=mon.sample)
    t.start()
    t.join()
    assert len(mon.crossings) == 1
    return mon.crossings[0]


def test_a_crossing_names_the_holders_from_the_given_namespace():
    # 16 MiB each, nested where only the census finds a name (not a top-level variable)
    held = {"activations": [torch.ones(4 * MiB) for _ in range(2)]}
    mon = MemoryMonitor(interval=1, capacity=1 * MiB, threshold=0.9, warn=False, namespace={"held": held})
    crossing = crossing_from_a_thread(mon)
    names = {name for name, b, _ in crossing.top if b >= 16 * MiB}
    assert {'held["activations"][0]', 'held["activations"][1]'} <= names, crossing.top
    assert crossing.note == "" and 'held["activations"][0]' in str(crossing)
    assert any(desc == "(4194304,) float32 cpu" for _, _, desc in crossing.top)


def test_without_a_namespace_it_says_how_to_get_the_names(monkeypatch):
    # a script: no notebook namespace (another test in this worker may have started an IPython shell)
    monkeypatch.setattr("helpers.monitoring.monitor.user_namespace", lambda: {})
    hog = torch.zeros(4 * MiB)  # noqa: F841 - listed, but no namespace names it outside a notebook
    mon = MemoryMonitor(interval=1, capacity=1 * MiB, threshold=0.9, warn=False)
    crossing = crossing_from_a_thread(mon)
    assert any(b >= 16 * MiB for _, b, _ in crossing.top)
    assert crossing.note == UNNAMED_NOTE and "census()" in str(crossing) and "namespace=globals()" in str(crossing)


def test_a_bad_namespace_is_refused():
    import pytest

    with pytest.raises(ValueError, match="namespace must be a dict such as globals"):
        MemoryMonitor(namespace=["not", "a", "dict"])
