"""How close to the largest batch that fits each search gets, and how many tries (and OOMs) it spends.

Ours (``helpers.batch_size.find_max_batch_size``, and ``@adaptive_batch``'s first call) against
accelerate's real ``find_executable_batch_size`` (imported), over 200 seeded random cases whose
memory is a known function of the batch (``a * b + c``, or with an attention-like ``q * b**2`` term);
a step raises ``torch.OutOfMemoryError`` past the budget. accelerate starts at the limit (its usual
use: "start at the biggest batch you would want"); ours searches from 1 below the same limit.
On CUDA, also a real forward+backward of the tiny Llama under a T4-sized memory cap.

Run: ``python bench/batch_finder.py [--cases 200]``. Writes ``bench/results/batch_finder.json``.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import format_table, write_results  # noqa: E402
from accelerate.utils import find_executable_batch_size  # noqa: E402

from helpers.batch_size import adaptive_batch, find_max_batch_size  # noqa: E402

MiB = 1024**2


def make_case(rng: random.Random) -> dict:
    """A workload with a known largest batch: memory(b) = a*b + q*b^2 + c under a budget."""
    limit = int(2 ** rng.uniform(6, 12))  # 64 .. 4096
    true_max = max(1, int(2 ** rng.uniform(0, math.log2(limit * 1.1))))  # sometimes the limit fits
    quadratic = rng.random() < 0.5
    a = rng.uniform(1, 50) * MiB
    q = rng.uniform(0.01, 1) * MiB if quadratic else 0.0
    c = rng.uniform(100, 4000) * MiB
    budget = a * true_max + q * true_max**2 + c + 0.5 * a  # true_max fits, true_max + 1 does not
    while a * (true_max + 1) + q * (true_max + 1) ** 2 + c <= budget:
        budget -= 0.25 * a
    return {
        "limit": limit,
        "true_max": true_max,
        "kind": "a*b+q*b^2+c" if quadratic else "a*b+c",
        "a": a,
        "q": q,
        "c": c,
        "budget": budget,
    }


def workload(case: dict, log: list):
    def step(batch_size: int):
        need = case["a"] * batch_size + case["q"] * batch_size**2 + case["c"]
        ok = need <= case["budget"]
        log.append((batch_size, ok))
        if not ok:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {need / MiB:.2f} MiB. GPU 0 has a "
                f"total capacity of {case['budget'] / MiB:.2f} MiB"
            )

    return step


def run_ours(case: dict) -> dict:
    log: list = []
    s = find_max_batch_size(workload(case, log), limit=case["limit"], margin=1.0)
    return {"found": s.max_ok, "trials": len(log), "ooms": sum(not ok for _, ok in log)}


def run_ours_decorator(case: dict) -> dict:
    log: list = []
    step = workload(case, log)

    @adaptive_batch(start=case["limit"], limit=case["limit"])
    def train(batch_size):
        step(batch_size)
        return batch_size

    found = train()
    return {"found": found, "trials": len(log), "ooms": sum(not ok for _, ok in log)}


def run_accelerate(case: dict) -> dict:
    log: list = []
    step = workload(case, log)

    @find_executable_batch_size(starting_batch_size=case["limit"])
    def train(batch_size):
        step(batch_size)
        return batch_size

    try:
        found = train()
    except RuntimeError:  # "No executable batch size found, reached zero."
        found = 0
    return {"found": found, "trials": len(log), "ooms": sum(not ok for _, ok in log)}


def summarize(name: str, rows: list[dict], cases: list[dict]) -> dict:
    frac = [r["found"] / min(c["true_max"], c["limit"]) for r, c in zip(rows, cases)]
    over = [len_ - (math.ceil(math.log2(c["limit"])) + 2) for len_, c in zip((r["trials"] for r in rows), cases)]
    return {
        "name": name,
        "median_fraction": statistics.median(frac),
        "worst_fraction": min(frac),
        "median_trials": statistics.median(r["trials"] for r in rows),
        "max_trials": max(r["trials"] for r in rows),
        "over_trial_budget": sum(o > 0 for o in over),
        "median_ooms": statistics.median(r["ooms"] for r in rows),
        "max_ooms": max(r["ooms"] for r in rows),
        "total_ooms": sum(r["ooms"] for r in rows),
    }


def cuda_tiny_model() -> dict | None:
    """A real forward+backward of the tiny Llama under a T4-sized cap (skipped without CUDA)."""
    if not torch.cuda.is_available():
        return None
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
    from build_tiny_models import build

    path = build()["llama"]
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, 15 * 1024**3 / total))
    try:
        model = AutoModelForCausalLM.from_pretrained(path).cuda()
        seq = 1024

        def step(batch_size):
            ids = torch.randint(0, model.config.vocab_size, (batch_size, seq), device="cuda")
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        out = {}
        log: list = []

        def logged(b):
            log.append(b)
            step(b)

        s = find_max_batch_size(logged, limit=4096, margin=1.0)
        out["ours"] = {"found": s.max_ok, "trials": len(s.trials), "ooms": s.oom_trials}

        acc_log: list = []

        @find_executable_batch_size(starting_batch_size=4096)
        def train(batch_size):
            acc_log.append(batch_size)
            step(batch_size)
            return batch_size

        try:
            found = train()
        except RuntimeError:
            found = 0
        out["accelerate"] = {"found": found, "trials": len(acc_log), "ooms": len(acc_log) - 1}
    finally:  # the cap must not outlive this row, even when it fails
        torch.cuda.set_per_process_memory_fraction(1.0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    cases = [make_case(rng) for _ in range(args.cases)]
    # Both sides collect garbage after every OOM; here nothing is allocated, so skip the full
    # collections to keep the run short (this benchmark counts tries, it does not time them).
    real_collect, gc.collect = gc.collect, lambda *a, **k: 0
    try:
        ours = [run_ours(c) for c in cases]
        deco = [run_ours_decorator(c) for c in cases]
        acc = [run_accelerate(c) for c in cases]
    finally:
        gc.collect = real_collect
    per_case = [
        {**{k: c[k] for k in ("limit", "true_max", "kind")}, "ours": o, "ours_decorator": d, "accelerate": a}
        for c, o, d, a in zip(cases, ours, deco, acc)
    ]
    above = [i for i, c in enumerate(cases) if c["limit"] > c["true_max"]]  # accelerate starts above the max
    fewer = sum(ours[i]["ooms"] < acc[i]["ooms"] for i in above)
    equal = sum(ours[i]["ooms"] == acc[i]["ooms"] for i in above)
    more = sum(ours[i]["ooms"] > acc[i]["ooms"] for i in above)
    summaries = [
        summarize("oomkit find_max_batch_size", ours, cases),
        summarize("oomkit @adaptive_batch (1st call)", deco, cases),
        summarize("accelerate find_executable_batch_size", acc, cases),
    ]
    header = [
        "method",
        "found (median)",
        "found (worst)",
        "trials median / max",
        "over log2(limit)+2",
        "OOM tries median / max / total",
    ]
    rows = [
        [
            s["name"],
            f"{s['median_fraction']:.1%}",
            f"{s['worst_fraction']:.1%}",
            f"{s['median_trials']:g} / {s['max_trials']}",
            s["over_trial_budget"],
            f"{s['median_ooms']:g} / {s['max_ooms']} / {s['total_ooms']}",
        ]
        for s in summaries
    ]
    table = format_table(header, rows)
    versus = (
        f"accelerate started above the true maximum in {len(above)} of {len(cases)} cases: ours used fewer "
        f"OOM tries in {fewer}, as many in {equal}, more in {more}."
    )
    cuda = cuda_tiny_model()
    print(table)
    print()
    print(versus)
    if cuda:
        print(f"CUDA tiny Llama (seq 1024, 15 GiB cap): {cuda}")
    path = write_results(
        "batch_finder",
        {
            "cases": len(cases),
            "seed": args.seed,
            "summary": summaries,
            "oom_comparison": {
                "accelerate_above_max": len(above),
                "ours_fewer": fewer,
                "equal": equal,
                "ours_more": more,
            },
            "cuda_tiny_llama": cuda,
            "table": table,
            "per_case": per_case,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
