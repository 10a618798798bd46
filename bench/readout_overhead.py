"""How much a memory readout costs per call: ``snapshot()`` vs the bare allocated/reserved readout.

Run: ``python bench/readout_overhead.py``. Writes ``bench/results/readout_overhead.json``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import format_table, write_results  # noqa: E402

from helpers.memory import allocated, ram_readout, reserved, snapshot  # noqa: E402


def per_call(fn, min_seconds: float = 0.5) -> float:
    """Median seconds per call over batches that each run at least ~50 ms."""
    fn()
    n = 1
    while True:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t > 0.05:
            break
        n *= 2
    samples = []
    deadline = time.perf_counter() + min_seconds
    while time.perf_counter() < deadline or len(samples) < 5:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t) / n)
    samples.sort()
    return samples[len(samples) // 2]


def main() -> None:
    cases = {
        "allocated() + reserved()": lambda: (allocated(), reserved()),
        "ram_readout()": ram_readout,
        "snapshot(processes=False)": lambda: snapshot(processes=False),
        "snapshot()": snapshot,
    }
    timings = {name: per_call(fn) for name, fn in cases.items()}
    base = timings["allocated() + reserved()"]
    rows = [[name, f"{t * 1e6:.1f}", f"{t / base:.0f}x"] for name, t in timings.items()]
    print(format_table(["readout", "µs per call", "vs bare readout"], rows))
    path = write_results("readout_overhead", {"seconds_per_call": timings})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
