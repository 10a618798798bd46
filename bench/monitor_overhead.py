"""What MemoryMonitor + MemoryCallback cost a training loop: step time with and without, side by side.

A real QLoRA loop (the tiny Llama in nf4, bitsandbytes on this machine, transformers' Trainer,
micro-batch 2 x accumulation 2, seq 64, a log every 5 steps) runs in alternating rounds: without
monitoring, then with a ``MemoryMonitor(interval=0.5)`` sampling in its thread and a
``MemoryCallback`` adding figures to every log. Each step is timed from ``on_step_begin`` to
``on_step_end``; the ratio is the median over adjacent pairs of rounds of (median step with) /
(median step without), in ABBA order so the machine's load drifts the same way for both. Also measured directly: the cost of one sample and
of one callback log, which bound the overhead from above as
``sample / interval + log / (logging_steps x step)``.

Run: ``python bench/monitor_overhead.py`` (about a minute on CPU). Writes
``bench/results/monitor_overhead.json``. Target: under 1 % slower.
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
from helpers.finetune import TrainPlan, build_dataset, load_instructions, make_trainer, prepare_qlora  # noqa: E402
from helpers.loading import load  # noqa: E402
from helpers.monitor import MemoryCallback, MemoryMonitor  # noqa: E402

ROUNDS = 10  # rounds per variant, in ABBA order
STEPS = 12  # optimizer steps per round
INTERVAL = 0.5
LOGGING_STEPS = 5


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t)


def run(model, tok, plan, data, with_monitor: bool) -> list[float]:
    """One round of ``plan.max_steps`` steps; the seconds of each step."""
    timer = StepTimer()
    if with_monitor:
        with MemoryMonitor(interval=INTERVAL, warn=False) as mon:
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


def main() -> int:
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    torch.set_num_threads(1)  # the machine is shared; one thread keeps the two variants comparable
    with tempfile.TemporaryDirectory() as out:
        plan = TrainPlan(
            str(tiny_llama()),
            seq_len=64,
            batch_size=4,
            micro_batch=2,
            max_steps=STEPS,
            save_steps=10_000,
            logging_steps=LOGGING_STEPS,
            output_dir=out,
            warmup_steps=0,
        )
        model, tok, _ = load(plan.load_plan())
        model, _ = prepare_qlora(model, plan)
        data = build_dataset(tok, load_instructions(), plan.seq_len)
        steps = {"without": [], "with": []}
        pair_ratios = []
        run(model, tok, plan, data, False)  # warm-up: caches, allocator, first-call paths
        for i in range(ROUNDS):
            # ABBA order: a linear drift in the machine's load hits both variants alike
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {with_monitor: run(model, tok, plan, data, with_monitor) for with_monitor in order}
            steps["without"] += got[False]
            steps["with"] += got[True]
            pair_ratios.append(statistics.median(got[True]) / statistics.median(got[False]))
        mon = MemoryMonitor(interval=INTERVAL, warn=False)
        sample = per_call(mon.sample, 0.3)
        cb, state = MemoryCallback(), TrainerState()
        args = plan.training_arguments()
        log = per_call(lambda: cb.on_log(args, state, TrainerControl(), logs={}), 0.3)
    med = {k: statistics.median(v) for k, v in steps.items()}
    ratio = statistics.median(pair_ratios)
    bound = sample / INTERVAL + log / (LOGGING_STEPS * med["without"])
    rows = [["without monitoring", f"{med['without'] * 1e3:.1f}", len(steps["without"]), "1.000"],
            [f"MemoryMonitor({INTERVAL}) + MemoryCallback", f"{med['with'] * 1e3:.1f}", len(steps["with"]),
             f"{ratio:.3f} (pairs {min(pair_ratios):.3f} to {max(pair_ratios):.3f})"]]  # fmt: skip
    print(format_table(["training loop (tiny Llama, nf4 QLoRA, CPU)", "median step ms", "steps", "ratio"], rows))
    print()
    print(format_table(["direct cost", "µs", "share of the loop"],
                       [["one monitor sample (thread, every 0.5 s)", f"{sample * 1e6:.0f}",
                         f"{100 * sample / INTERVAL:.3f} %"],
                        [f"one callback log (every {LOGGING_STEPS} steps)", f"{log * 1e6:.0f}",
                         f"{100 * log / (LOGGING_STEPS * med['without']):.3f} %"]]))  # fmt: skip
    print(
        f"\nmeasured overhead {100 * (ratio - 1):+.2f} % (target < 1 %); upper bound from the direct costs "
        f"{100 * bound:.3f} %"
    )
    write_results(
        "monitor_overhead",
        {
            "median_step_s": med,
            "ratio": ratio,
            "steps": steps,
            "pair_ratios": pair_ratios,
            "sample_s": sample,
            "callback_log_s": log,
            "bound": bound,
            "interval": INTERVAL,
            "logging_steps": LOGGING_STEPS,
        },
    )
    return 0 if ratio < 1.01 else 1


if __name__ == "__main__":
    sys.exit(main())
