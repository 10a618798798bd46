"""What a memory readout costs per call, in absolute microseconds: ``snapshot()`` and the bare readouts.

On a machine without CUDA ``allocated()`` and ``reserved()`` return 0 without asking a driver, so a
ratio against them measures nothing: the CPU figures are stated as µs per call (median over
``ROUNDS`` interleaved rounds, with the range), next to an empty Python call as the floor. On CUDA
(the GPU harness runs this file there: ``make gpu-check``) the same readouts hit the driver, and
``cuda`` in the JSON holds their µs per call and the ratio ``snapshot() / (allocated() + reserved())``;
on a machine without CUDA it is null.

Run: ``python bench/readout_overhead.py``. Writes ``bench/results/readout_overhead.json``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import format_table, write_results  # noqa: E402

from helpers.core.memory import allocated, ram_readout, reserved, snapshot  # noqa: E402

ROUNDS = 7
BARE = "allocated() + reserved()"


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


def measure(cases: dict, rounds: int = ROUNDS, seconds: float = 0.15) -> dict[str, dict]:
    """µs per call of each case: median and range over ``rounds`` rounds, the order rotated per round."""
    names = list(cases)
    got: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            got[name].append(per_call(cases[name], seconds) * 1e6)
    return {
        n: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v), "rounds": v} for n, v in got.items()
    }


def cuda_ratios() -> dict | None:
    """On CUDA: the readouts against the driver, and snapshot() as a multiple of the bare readout. None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    x = torch.ones(1 << 20, device="cuda")  # something allocated, so the readouts have a figure to read
    timings = measure({BARE: lambda: (allocated(), reserved()), "snapshot()": snapshot})
    del x
    return {
        "device": torch.cuda.get_device_name(0),
        "us_per_call": timings,
        "snapshot_over_bare": timings["snapshot()"]["median_us"] / timings[BARE]["median_us"],
    }


def main() -> None:
    cases = {
        "empty Python call (floor)": lambda: None,
        BARE: lambda: (allocated(), reserved()),
        "ram_readout()": ram_readout,
        "snapshot(processes=False)": lambda: snapshot(processes=False),
        "snapshot()": snapshot,
    }
    timings = measure(cases)
    rows = [[n, f"{t['median_us']:.2f}", f"{t['min_us']:.2f}-{t['max_us']:.2f}"] for n, t in timings.items()]
    print(format_table(["readout (this machine)", "µs per call (median)", "range over rounds"], rows))
    cuda = cuda_ratios()
    if cuda:
        print(f"\nCUDA ({cuda['device']}): snapshot() = {cuda['snapshot_over_bare']:.0f}x allocated() + reserved()")
    path = write_results("readout_overhead", {"rounds": ROUNDS, "us_per_call": timings, "cuda": cuda})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
