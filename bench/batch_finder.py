"""How close to the largest batch that fits each search gets, how many tries (and OOMs) it spends,
and what it hands back after its default safety margin.

Over 200 seeded random cases whose memory is a known function of the batch (``a * b + c``, or with
an attention-like ``q * b**2`` term), a step raises ``torch.OutOfMemoryError`` past the budget; a
batch larger than the case's ``limit`` (the dataset size) runs as the whole dataset. Contenders:

- oomkit ``find_max_batch_size(step, limit=...)`` with its defaults (exact bisection, margin 0.9),
  and with ``tolerance=0.92`` (the default before issue 17);
- oomkit ``@adaptive_batch(start=limit)``'s first call;
- accelerate's real ``find_executable_batch_size`` (imported) from its own default start (128), from
  2x and 1.2x the true maximum, and from the limit;
- Lightning's ``binsearch`` batch-size scaling, the textbook doubling + bisection: the real
  ``pytorch_lightning.tuner.batch_size_scaling._run_binsearch_scaling`` with its defaults
  (``init_val=2, max_trials=25, margin=0.05, max_val=8192``), driven through a stub trainer whose
  loop runs the step and whose dataset length is the limit. Lightning is not a dependency: install it
  beside the venv (``pip install --target /tmp/peers --no-deps pytorch-lightning lightning-utilities
  torchmetrics``, then ``PYTHONPATH=/tmp/peers:.``); without it a port of that function (labelled so
  in the output and the JSON) runs instead.

"found" is the largest size the search saw run, as a share of the true maximum (or the limit when
that fits); "handed back" is what the user gets after the method's default margin.
On CUDA, also a real forward+backward of the tiny Llama under a T4-sized memory cap.

Run: ``python bench/batch_finder.py [--cases 200]``. Writes ``bench/results/batch_finder.json``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import random
import statistics
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import format_table, write_results  # noqa: E402
from accelerate.utils import find_executable_batch_size  # noqa: E402

from helpers.oom.batch_size import adaptive_batch, find_max_batch_size  # noqa: E402

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
        b = min(batch_size, case["limit"])  # past the dataset size a batch is the whole dataset
        need = case["a"] * b + case["q"] * b**2 + case["c"]
        ok = need <= case["budget"]
        log.append((batch_size, ok))
        if not ok:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {need / MiB:.2f} MiB. GPU 0 has a "
                f"total capacity of {case['budget'] / MiB:.2f} MiB"
            )

    return step


def _result(case: dict, log: list, handed: int) -> dict:
    ran = [b for b, ok in log if ok]
    return {
        "found": min(max(ran, default=0), case["limit"]),
        "handed_back": min(handed, case["limit"]),
        "trials": len(log),
        "ooms": sum(not ok for _, ok in log),
    }


def run_ours(case: dict, default_limit: bool = False, **kw) -> dict:
    """``find_max_batch_size`` told the dataset size (``limit=``), or with its default limit (none)."""
    log: list = []
    limit = {} if default_limit else {"limit": case["limit"]}
    s = find_max_batch_size(workload(case, log), **limit, **kw)
    assert min(s.max_ok, case["limit"]) == _result(case, log, 0)["found"]  # past the limit a batch is the dataset
    return _result(case, log, s.batch_size)


def run_ours_decorator(case: dict) -> dict:
    log: list = []
    step = workload(case, log)

    @adaptive_batch(start=case["limit"], limit=case["limit"])
    def train(batch_size):
        step(batch_size)
        return batch_size

    return _result(case, log, train())


def run_accelerate(case: dict, start: int) -> dict:
    log: list = []
    step = workload(case, log)

    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size):
        step(batch_size)
        return batch_size

    try:
        found = train()
    except RuntimeError:  # "No executable batch size found, reached zero."
        found = 0
    return _result(case, log, found)


def lightning_binsearch():
    """Lightning's real ``_run_binsearch_scaling`` (and where it came from), or the labelled port."""
    try:
        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        import pytorch_lightning
        from pytorch_lightning.tuner.batch_size_scaling import _run_binsearch_scaling

        return _run_binsearch_scaling, f"pytorch_lightning {pytorch_lightning.__version__} (real code)"
    except ImportError:
        return None, "port of pytorch_lightning 2.6 _run_binsearch_scaling (Lightning not importable)"


def lightning_power():
    """Lightning's real ``_run_power_scaling``, the mode ``scale_batch_size`` uses by default (no port: the
    row is left out when Lightning cannot be imported)."""
    try:
        from pytorch_lightning.tuner.batch_size_scaling import _run_power_scaling
    except ImportError:
        return None
    return lambda trainer, init, name, trials, params, margin, max_val: _run_power_scaling(
        trainer, init, name, trials, params, max_val
    )  # power mode has no margin: the size that last ran is what it hands back


def _ported_binsearch(step, dataset_length: int, new_size=2, max_trials=25, margin=0.05, max_val=8192) -> int:
    """Reference port of Lightning 2.6's binsearch mode (used only when Lightning cannot be imported)."""
    low, high, count = 1, None, 0
    last_successful_size = new_size
    while True:
        if new_size >= max_val:
            break
        try:
            step(new_size)
        except torch.OutOfMemoryError:
            high = new_size
            new_size = (high + low) // 2
            if high - low <= 1:
                break
            continue
        last_successful_size = new_size
        count += 1
        if count >= max_trials:
            new_size = last_successful_size
            break
        low = new_size
        if new_size >= dataset_length:  # _adjust_batch_size: "greater or equal than the length of your dataset"
            break
        if high:
            if high - low <= 1:
                break
            new_size = (high + low) // 2
        else:
            new_size = min(int(new_size * 2.0), max_val)
    return max(1, int(new_size * (1 - margin))) if margin > 0 else new_size


class _Hung(Exception):
    """Raised by the stub loop once a search has gone on far past any sane number of tries."""


HUNG_AFTER = 100  # tries


def run_lightning(case: dict, binsearch, sized: bool = False) -> dict:
    """Lightning's binsearch with its defaults; the trainer is a stub whose loop runs the step.

    ``sized=False``: an iterable-style dataset (no length), so only OOMs and ``max_val`` bound the
    search. ``sized=True``: a map-style dataset of ``limit`` samples, which Lightning's
    ``_adjust_batch_size`` checks; there, when a batch at least the dataset's size fails, it keeps
    returning the same size and the search never ends: the stub stops it after ``HUNG_AFTER`` tries."""
    log: list = []
    step = workload(case, log)
    if binsearch is None:
        return _result(case, log, _ported_binsearch(step, case["limit"] if sized else 1 << 62))
    model = types.SimpleNamespace(batch_size=2, _trainer=None, automatic_optimization=True)

    def length():
        if not sized:
            raise NotImplementedError("All datasets are iterable-style datasets.")
        return case["limit"]

    loader = types.SimpleNamespace(_dataset_length=length)
    noop = types.SimpleNamespace(reset=lambda: None)

    class Loop:
        _combined_loader = loader
        restarting = False

        def setup_data(self):
            self._combined_loader = loader

        def load_state_dict(self, state):
            pass

        def run(self):
            if len(log) >= HUNG_AFTER:
                raise _Hung
            step(model.batch_size)

    trainer = types.SimpleNamespace(
        lightning_module=model,
        _active_loop=Loop(),
        fit_loop=types.SimpleNamespace(
            epoch_loop=types.SimpleNamespace(automatic_optimization=types.SimpleNamespace(optim_progress=noop)),
            epoch_progress=noop,
        ),
    )
    logging.disable(logging.INFO)  # its rank_zero_info line per try
    try:
        # its answer before the margin (deterministic: the same tries), then with scale_batch_size's
        # defaults (init_val=2, max_trials=25, margin=0.05, max_val=8192) for the size it hands back
        answer = binsearch(trainer, 2, "batch_size", 25, {"loop_state_dict": {}}, 0.0, 8192)
        log.clear()
        model.batch_size = 2
        handed = binsearch(trainer, 2, "batch_size", 25, {"loop_state_dict": {}}, 0.05, 8192)
    except _Hung:
        return {**_result(case, log, 0), "hung": True}
    finally:
        logging.disable(logging.NOTSET)
    # "found" is its answer: with batch 2 out of memory it returns 1 untried (its low bound starts at 1)
    return {**_result(case, log, handed), "found": min(answer, case["limit"])}


def summarize(name: str, rows: list[dict], cases: list[dict], margin: str) -> dict:
    best = [min(c["true_max"], c["limit"]) for c in cases]
    frac = [r["found"] / b for r, b in zip(rows, best)]
    handed = [r["handed_back"] / b for r, b in zip(rows, best)]
    over = [r["trials"] - (math.ceil(math.log2(c["limit"])) + 2) for r, c in zip(rows, cases)]
    return {
        "name": name,
        "margin": margin,
        "median_fraction": statistics.median(frac),
        "worst_fraction": min(frac),
        "exact": sum(f == 1 for f in frac),
        "median_handed_back": statistics.median(handed),
        "worst_handed_back": min(handed),
        "median_trials": statistics.median(r["trials"] for r in rows),
        "mean_trials": statistics.mean(r["trials"] for r in rows),
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


OURS = "oomkit find_max_batch_size"
TEXTBOOK = "Lightning binsearch (doubling + bisection)"
TEXTBOOK_SIZED = "Lightning binsearch, dataset of `limit` samples"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    cases = [make_case(rng) for _ in range(args.cases)]
    binsearch, lightning_source = lightning_binsearch()
    power = lightning_power()
    print(f"Lightning: {lightning_source}")
    contenders = {  # name -> (margin in words, runner)
        OURS: ("0.9 (default)", lambda c: run_ours(c)),
        "oomkit find_max_batch_size, no limit= (its default)": ("0.9 (default)", lambda c: run_ours(c, True)),
        "oomkit, tolerance=0.92 (the old default)": ("0.9 (default)", lambda c: run_ours(c, tolerance=0.92)),
        "oomkit @adaptive_batch (1st call, start=limit)": ("none", run_ours_decorator),
        TEXTBOOK: ("0.05 (default)", lambda c: run_lightning(c, binsearch)),
        TEXTBOOK_SIZED: ("0.05 (default)", lambda c: run_lightning(c, binsearch, sized=True)),
        **(
            {"Lightning power (scale_batch_size's default mode)": ("none", lambda c: run_lightning(c, power))}
            if power is not None
            else {}
        ),
        "accelerate, start 128 (its default)": ("none", lambda c: run_accelerate(c, 128)),
        "accelerate, start 2x true max": ("none", lambda c: run_accelerate(c, 2 * c["true_max"])),
        "accelerate, start 1.2x true max": (
            "none",
            lambda c: run_accelerate(c, max(c["true_max"] + 1, round(1.2 * c["true_max"]))),
        ),
        "accelerate, start at the limit": ("none", lambda c: run_accelerate(c, c["limit"])),
    }
    # Every contender collects garbage after each OOM; here nothing is allocated, so skip the full
    # collections to keep the run short (this benchmark counts tries, it does not time them).
    real_collect, gc.collect = gc.collect, lambda *a, **k: 0
    try:
        runs = {name: [fn(c) for c in cases] for name, (_, fn) in contenders.items()}
    finally:
        gc.collect = real_collect
    hung = {name: sum(bool(r.get("hung")) for r in rows) for name, rows in runs.items()}
    summaries = [
        {
            **summarize(
                name,
                [r for r in runs[name] if not r.get("hung")],
                [c for c, r in zip(cases, runs[name]) if not r.get("hung")],
                margin,
            ),
            "hung": hung[name],
        }
        for name, (margin, _) in contenders.items()
    ]
    per_case = [
        {**{k: c[k] for k in ("limit", "true_max", "kind")}, **{name: runs[name][i] for name in runs}}
        for i, c in enumerate(cases)
    ]
    ours, book = runs[OURS], runs[TEXTBOOK]
    head_to_head = {
        "fewer_trials": sum(o["trials"] < t["trials"] for o, t in zip(ours, book)),
        "equal_trials": sum(o["trials"] == t["trials"] for o, t in zip(ours, book)),
        "more_trials": sum(o["trials"] > t["trials"] for o, t in zip(ours, book)),
        "fewer_ooms": sum(o["ooms"] < t["ooms"] for o, t in zip(ours, book)),
        "more_ooms": sum(o["ooms"] > t["ooms"] for o, t in zip(ours, book)),
    }
    header = [
        "method",
        "margin",
        "found median / worst",
        "exact",
        "handed back median / worst",
        "trials median / mean / max",
        "over log2(limit)+2",
        "OOM tries median / max / total",
        "never stopped",
    ]
    rows = [
        [
            s["name"],
            s["margin"],
            f"{s['median_fraction']:.1%} / {s['worst_fraction']:.1%}",
            f"{s['exact']}/{len(cases)}",
            f"{s['median_handed_back']:.1%} / {s['worst_handed_back']:.1%}",
            f"{s['median_trials']:g} / {s['mean_trials']:.2f} / {s['max_trials']}",
            s["over_trial_budget"],
            f"{s['median_ooms']:g} / {s['max_ooms']} / {s['total_ooms']}",
            s["hung"],
        ]
        for s in summaries
    ]
    table = format_table(header, rows)
    cuda = cuda_tiny_model()
    print(table)
    print()
    print(f"oomkit vs {TEXTBOOK}, per case: {head_to_head}")
    if cuda:
        print(f"CUDA tiny Llama (seq 1024, 15 GiB cap): {cuda}")
    path = write_results(
        "batch_finder",
        {
            "cases": len(cases),
            "seed": args.seed,
            "lightning": lightning_source,
            "summary": summaries,
            "vs_textbook": head_to_head,
            "cuda_tiny_llama": cuda,
            "table": table,
            "per_case": per_case,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
