"""What MemoryMonitor + MemoryCallback cost a training loop: step time with and without, side by side.

A real QLoRA loop (the tiny Llama in nf4, bitsandbytes on this machine, transformers' Trainer,
micro-batch 2 x accumulation 2, seq 64, a log every 5 steps) runs in short rounds without monitoring
and with a ``MemoryMonitor(interval)`` sampling in its thread and a ``MemoryCallback`` adding figures
to every log. Four settings: 1 and 2 torch threads x the default interval (0.5 s) and the floor
(0.01 s; ``MemoryMonitor`` refuses anything shorter). Each step is timed from ``on_step_begin`` to
``on_step_end``. A pair is two adjacent rounds, one of each variant, in ABBA order (a linear drift
in the machine's load hits both alike), and the settings are interleaved pair by pair; the pair's
ratio is (median step with) / (median step without). Reported per setting: the geometric mean of
the pair ratios with a 95 % bootstrap confidence interval (seeded), so "under 1 %" is a claim the
interval supports or does not. Also measured directly: the cost of one sample and of one callback
log, which bound the overhead from above as ``sample / interval + log / (logging_steps x step)``.

Run: ``python bench/monitor_overhead.py [--pairs 16] [--steps 8]`` (about 4 minutes on 2 idle CPU cores; 11 minutes on this shared machine, where 2-thread steps slowed 7-9x).
Writes ``bench/results/monitor_overhead.json``. Target: under 1 % slower.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import TrainerCallback, TrainerControl, TrainerState  # noqa: E402

from bench._common import format_table, write_results  # noqa: E402
from bench.readout_overhead import per_call  # noqa: E402
from helpers.loading.loader import load  # noqa: E402
from helpers.monitoring.memory_callback import MemoryCallback  # noqa: E402
from helpers.monitoring.monitor import MemoryMonitor  # noqa: E402
from helpers.training.adapters import prepare_qlora  # noqa: E402
from helpers.training.data import build_dataset, load_instructions
from helpers.training.finetune import make_trainer
from helpers.training.plan import TrainPlan

PAIRS = 16  # ABBA pairs per setting
STEPS = 8  # optimizer steps per round
INTERVALS = (0.5, 0.01)  # the default and the floor
THREADS = (1, 2)
LOGGING_STEPS = 5


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t)


def run(model, tok, plan, data, interval: float | None) -> list[float]:
    """One round of ``plan.max_steps`` steps (monitored at ``interval``, or not when None); each step's seconds."""
    timer = StepTimer()
    if interval is not None:
        with MemoryMonitor(interval=interval, warn=False) as mon:
            quiet(make_trainer(model, tok, plan, data, callbacks=[timer, MemoryCallback(mon)])).train()
    else:
        quiet(make_trainer(model, tok, plan, data, callbacks=[timer])).train()
    return timer.times


def quiet(trainer):
    """Without the log printer (both variants): the table is the output."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer


def tiny_llama() -> Path:
    path = Path(__file__).resolve().parents[1] / "data" / "tiny" / "llama"
    if not (path / "config.json").exists():
        sys.exit("build the tiny models first: python data/build_tiny_models.py")
    return path


def bootstrap_ci(ratios: list[float], n: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """Geometric mean of ``ratios`` and its 95 % percentile-bootstrap interval."""
    import math
    import random

    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(n))
    return math.exp(statistics.fmean(logs)), math.exp(means[int(0.025 * n)]), math.exp(means[int(0.975 * n) - 1])


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=PAIRS)
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    settings = [(t, i) for t in THREADS for i in INTERVALS]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        plan = TrainPlan(
            str(tiny_llama()),
            seq_len=64,
            batch_size=4,
            micro_batch=2,
            max_steps=args.steps,
            save_steps=10_000,
            logging_steps=LOGGING_STEPS,
            output_dir=out,
            warmup_steps=0,
        )
        model, tok, _ = load(plan.load_plan())
        model, _ = prepare_qlora(model, plan)
        data = build_dataset(tok, load_instructions(), plan.seq_len)
        for t in THREADS:  # warm-up per thread count: caches, allocator, first-call paths
            torch.set_num_threads(t)
            run(model, tok, plan, data, None)
        res = {f"{t} thread{'s' if t > 1 else ''}, interval {i} s": {"threads": t, "interval": i, "pairs": [],
               "without": [], "with": []} for t, i in settings}  # fmt: skip
        for k in range(args.pairs):
            for j, ((t, interval), r) in enumerate(zip(settings, res.values())):
                torch.set_num_threads(t)
                # ABBA: the order flips from pair to pair (and between settings within a pass)
                order = (None, interval) if (k + j) % 2 == 0 else (interval, None)
                got = {v: run(model, tok, plan, data, v) for v in order}
                r["without"] += got[None]
                r["with"] += got[interval]
                r["pairs"].append(statistics.median(got[interval]) / statistics.median(got[None]))
        torch.set_num_threads(1)
        mon = MemoryMonitor(interval=INTERVALS[0], warn=False)
        sample = per_call(mon.sample, 0.3)
        cb, state = MemoryCallback(), TrainerState()
        targs = plan.training_arguments()
        log = per_call(lambda: cb.on_log(targs, state, TrainerControl(), logs={}), 0.3)
    rows, summary = [], {}
    for name, r in res.items():
        gm, lo, hi = bootstrap_ci(r["pairs"])
        step = statistics.median(r["without"])
        bound = sample / r["interval"] + log / (LOGGING_STEPS * step)
        summary[name] = {**r, "median_step_without_s": step, "median_step_with_s": statistics.median(r["with"]),
                         "ratio": gm, "ci95": [lo, hi], "bound": bound}  # fmt: skip
        rows.append([name, f"{step * 1e3:.1f}", f"{statistics.median(r['with']) * 1e3:.1f}", len(r["pairs"]),
                     f"{100 * (gm - 1):+.2f} %", f"{100 * (lo - 1):+.2f} % to {100 * (hi - 1):+.2f} %",
                     f"{100 * bound:.3f} %"])  # fmt: skip
    table = format_table(
        ["setting (tiny Llama, nf4 QLoRA, CPU)", "step ms without", "step ms with", "pairs", "overhead",
         "95 % CI", "bound from direct costs"], rows)  # fmt: skip
    print(table)
    print(f"\none monitor sample {sample * 1e6:.0f} µs; one callback log {log * 1e6:.0f} µs; "
          f"{time.perf_counter() - started:.0f} s")  # fmt: skip
    write_results(
        "monitor_overhead",
        {
            "settings": summary,
            "steps_per_round": args.steps,
            "sample_s": sample,
            "callback_log_s": log,
            "logging_steps": LOGGING_STEPS,
            "table": table,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
