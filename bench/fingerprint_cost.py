"""What ``weights_fingerprint`` costs per tensor as tensors grow: the sample is fixed-size (``SAMPLE``
elements per tensor), so a 16M-element matrix (a 7B's 4096 x 4096) costs what a 65k-element one does.

The speed target that tests/test_fingerprint.py used to assert in milliseconds (which a busy machine
failed): the test now counts the bytes sampled per tensor, and this bench keeps the timing, as ratios
measured side by side in one process. Per size: four ``nn.Linear(side, side)`` weights fingerprinted
together, CPU seconds of this thread (``time.thread_time``) per tensor, median over ``ROUNDS``
interleaved rounds; next to it, hashing the whole tensor's bytes (what a fingerprint without sampling
would cost). Run: ``python bench/fingerprint_cost.py`` (a few seconds). Writes
``bench/results/fingerprint_cost.json``.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import format_table, write_results  # noqa: E402

from helpers.loading.fingerprint import SAMPLE, weights_fingerprint  # noqa: E402

ROUNDS = 7
SIDES = (256, 1024, 4096)  # 65k, 1M and 16M elements per matrix
PER_SIZE = 4


def cpu_per_tensor(fn, n: int) -> float:
    """CPU seconds of this thread per tensor for one call of ``fn`` over ``n`` tensors."""
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) / n


def main() -> None:
    torch.manual_seed(0)
    models = {s: torch.nn.ModuleList([torch.nn.Linear(s, s, bias=False) for _ in range(PER_SIZE)]) for s in SIDES}
    cases = {}
    for s, m in models.items():
        cases[f"sample {s}x{s}"] = (lambda m=m: weights_fingerprint(m), PER_SIZE)
        cases[f"whole {s}x{s}"] = (
            lambda m=m: [hashlib.sha256(p.detach().numpy().tobytes()).digest() for p in m.parameters()],
            PER_SIZE,
        )
    for fn, _ in cases.values():  # warm: imports, first allocations
        fn()
    got: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, n = cases[name]
            got[name].append(cpu_per_tensor(fn, n) * 1e6)
    med = {name: statistics.median(v) for name, v in got.items()}
    small, big = SIDES[0], SIDES[-1]
    sample_ratio = med[f"sample {big}x{big}"] / med[f"sample {small}x{small}"]
    whole_ratio = med[f"whole {big}x{big}"] / med[f"sample {big}x{big}"]
    rows = [
        [f"{s}x{s} ({s * s:,} elements)", f"{med[f'sample {s}x{s}']:.0f}", f"{med[f'whole {s}x{s}']:.0f}"]
        for s in SIDES
    ]
    table = format_table(["tensor", "µs CPU per tensor, sampled", "µs CPU per tensor, whole bytes hashed"], rows)
    table += (
        f"\n\nA {big}x{big} matrix costs {sample_ratio:.2f}x a {small}x{small} one ({SAMPLE} elements read from "
        f"each); hashing its whole bytes would cost {whole_ratio:.0f}x the sample. Median over {ROUNDS} "
        "interleaved rounds, CPU seconds of the measuring thread."
    )
    print(table)
    path = write_results(
        "fingerprint_cost",
        {"rounds": ROUNDS, "us_cpu_per_tensor": got, "median_us": med, "sample_ratio_big_over_small": sample_ratio,
         "whole_over_sample_big": whole_ratio, "table": table},
    )  # fmt: skip
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
