"""Before/after figures for the hot spots fixed under issue 17: the old code against this tree, side by side.

"Before" is the real old code: the commit before the first hot-spot fix (``BEFORE``, the parent of
cc41993), materialized with ``git archive BEFORE helpers data`` into a temporary folder (its
estimator reads the shipped configs from ``data/configs``). "After" is this working tree. Every
workload runs in a fresh Python process with ``PYTHONPATH`` set to one tree, so each side imports its
own ``helpers`` (the process checks where ``helpers`` came from); both use this interpreter, so the
same torch and transformers. The rounds interleave the sides (the order flips each round: before,
after, then after, before) and the workloads; each row gives the median and range over the rounds
and, where the sides are paired, the median of the per-round ratios before / after.

Rows:

1. ``import helpers.monitoring.monitor`` after ``import torch`` (the old module imported transformers'
   ``TrainerCallback``, and with it the Trainer, at import time).
2. The first ``estimate("codellama/CodeLlama-7b-hf", load="nf4")`` after importing the estimator
   module; reference (this tree only, its own fresh process): importing what that call needs from
   transformers, then the same estimate with those imports done.
3. ``fit(est, "t4")`` with suggestions on a plan that does not fit (CodeLlama-7B fp16, batch 4,
   2048 new tokens), in row 2's process after its estimate: the first call and the median of 10.
4. ``MemoryMonitor.peak()``: ``peak()`` per call after 10,000, 100,000 and 1,000,000 samples, 1,000
   ``peak(since)`` calls at 100,000 samples (``MemoryCallback`` asks for the peak since its last log
   on every log: a window of 20 samples, a log every 10 s at the default 0.5 s interval), how many
   samples each keeps and the RSS they take. Samples are synthetic, stored the way ``sample()``
   stores them (old: ``samples.append``; new: ``_keep``, which keeps running peaks and merges older
   samples pairwise past ``max_samples``); the sampling thread never starts.
5. ``census()`` over a 60,000-node autograd chain, then ``del`` the chain and ``gc.collect()``: the
   exit status (the old walk left PyTorch crashing when the chain was freed).
6. ``safe_generate`` on the tiny Llama (fp32, CPU, 1 torch thread) over the shipped eval prompts
   (the same list of dicts on both sides), ``max_new_tokens=16``, ``progress=False``, a fresh results
   file per run, the batch-size cache cleared first; timed from outside, reading the file back
   included. Per process: the first run, then the median of ``RUNS`` more.
7. ``release_after_oom`` (this tree only): an IPython shell runs a cell whose function holds a
   512 MiB tensor when the CPU allocator fails (``torch.empty(1 << 45)``); then nothing, the
   skeptic's ``gc.collect()`` (+ ``torch.cuda.empty_cache()`` where CUDA exists), or
   ``release_after_oom()``; also with the exception kept in a variable. Bytes still pinned: process
   RSS above the figure before the cell, and whether the tensor is alive (a weak reference).

Run: ``python bench/hot_spots.py [--rounds 5]`` (about 6 minutes on 2 shared CPU cores: 346 s here).
Writes ``bench/results/hot_spots.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import format_table, write_results  # noqa: E402

BEFORE = "aab0d2f"  # parent of cc41993, the first hot-spot fix
ROUNDS = 5
RUNS = 5  # timed safe_generate runs per process after the first
MODEL = "codellama/CodeLlama-7b-hf"
CHAIN = 60_000

# Each worker prints one line "RESULT <json>" and names the file its helpers came from.
PREAMBLE = """
import json, sys, time
# the editable install's finder answers any "helpers.<x>" with this repository's file, even when PYTHONPATH's
# tree has no such module: without it the old tree would import the new code for every module it lacks
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
def result(**kw):
    import helpers
    print("RESULT " + json.dumps({"helpers": helpers.__file__, **kw}), flush=True)
"""

IMPORT_MONITOR = """
import torch
t = time.perf_counter()
try:
    import helpers.monitoring.monitor  # the layout by task
except ImportError:
    import helpers.monitor
dt = time.perf_counter() - t
result(seconds=dt, transformers_imported="transformers" in sys.modules)
"""

ESTIMATE_FIT = """
import statistics
import torch
t0 = time.perf_counter()
import helpers
try:  # the layout by task (one import path per name)
    from helpers.estimator.core import estimate
    from helpers.estimator.fitting import fit_one_card as fit
except ImportError:
  try:
    from helpers.estimator import estimate, fit_one_card as fit
  except ImportError:
    try:  # before the rename
        from helpers.estimator import estimate, fit
    except ImportError:  # the old layout
        from helpers.estimate import estimate, fit
t1 = time.perf_counter()
first = estimate(MODEL, load="nf4")
t2 = time.perf_counter()
est = estimate(MODEL, load="fp16", batch_size=4, max_new_tokens=2048)
t3 = time.perf_counter()
v = fit(est, "t4")
t4 = time.perf_counter()
warm = []
for _ in range(10):
    a = time.perf_counter()
    fit(est, "t4")
    warm.append(time.perf_counter() - a)
result(import_s=t1 - t0, estimate_s=t2 - t1, estimate_total=first.total, fit_first_s=t4 - t3,
       fit_warm_s=statistics.median(warm), verdict=v.verdict, suggestions=[s.change for s in v.suggestions])
""".replace("MODEL", repr(MODEL))

TRANSFORMERS_REF = """
import torch
t0 = time.perf_counter()
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
t1 = time.perf_counter()
from helpers import estimate
t2 = time.perf_counter()
first = estimate(MODEL, load="nf4")
t3 = time.perf_counter()
result(transformers_import_s=t1 - t0, estimate_after_imports_s=t3 - t2, estimate_total=first.total)
""".replace("MODEL", repr(MODEL))

MONITOR = """
import statistics
import psutil, torch
try:
    from helpers.monitoring.monitor import MemoryMonitor, Sample
except ImportError:
    from helpers.monitor import MemoryMonitor, Sample
INTERVAL = 0.5
mon = MemoryMonitor(interval=INTERVAL, warn=False)  # the thread is never started
store = getattr(mon, "_keep", None) or mon.samples.append  # what sample() does with a reading
proc = psutil.Process()
rss0 = proc.memory_info().rss

def per_call(fn, budget=0.3, most=2000):
    out = []
    spent = 0.0
    while len(out) < 3 or (spent < budget and len(out) < most):
        a = time.perf_counter()
        fn()
        out.append(time.perf_counter() - a)
        spent += out[-1]
    return statistics.median(out)

n, worst, fill, points = 0, 0.0, 0.0, {}
for target in (10_000, 100_000, 1_000_000):
    while n < target:
        s = Sample(n * INTERVAL, (n % 977) << 20, (n % 983) << 20, None, (n % 991) << 20, (n % 997) << 20)
        a = time.perf_counter()
        store(s)
        d = time.perf_counter() - a
        fill += d
        worst = max(worst, d)
        n += 1
    p = {"kept": len(mon.samples), "rss_mib": (proc.memory_info().rss - rss0) / 2**20,
         "peak_s": per_call(mon.peak), "peak": mon.peak(), "store_total_s": fill, "store_worst_s": worst}
    if target == 100_000:
        since = (n - 20) * INTERVAL  # the callback's window: the samples since its last log
        a = time.perf_counter()
        for _ in range(1000):
            mon.peak(since)
        p["peak_since_1000_s"] = time.perf_counter() - a
    points[str(target)] = p
# the same 1,000,000 stores with Python's garbage collector off: the slowest store without a collection in it
import gc
fresh = MemoryMonitor(interval=INTERVAL, warn=False)
store = getattr(fresh, "_keep", None) or fresh.samples.append
gc.disable()
try:
    nogc = 0.0
    for n in range(1_000_000):
        s = Sample(n * INTERVAL, (n % 977) << 20, (n % 983) << 20, None, (n % 991) << 20, (n % 997) << 20)
        a = time.perf_counter()
        store(s)
        nogc = max(nogc, time.perf_counter() - a)
finally:
    gc.enable()
points["1000000"]["store_worst_nogc_s"] = nogc
result(points=points)
"""

CENSUS = f"""
import gc
import torch
try:
    from helpers.leaks.census import census
except ImportError:
    from helpers.leaks import census
x = torch.ones(1, requires_grad=True)
y = x
for _ in range({CHAIN}):
    y = y * 1.0001
t = time.perf_counter()
c = census(globals())
dt = time.perf_counter() - t
print("CENSUS " + json.dumps({{"census_s": dt, "tensors": len(c.entries)}}), flush=True)
del c
del y
gc.collect()
result(freed=True)
"""

SAFE_GENERATE = """
import os, statistics, tempfile
import torch
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging
logging.set_verbosity_error()
logging.disable_progress_bar()
try:
    from helpers.oom import batch_size as bs
    from helpers.evaluation.evaluate import safe_generate
    from helpers.loading.loader import setup_tokenizer
except ImportError:
    from helpers import batch_size as bs
    from helpers.evaluate import safe_generate
    from helpers.loading import setup_tokenizer
tiny, prompts_file = sys.argv[1], sys.argv[2]
prompts = [json.loads(line) for line in open(prompts_file) if line.strip()]
tok = AutoTokenizer.from_pretrained(tiny)
model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
setup_tokenizer(tok, model)
folder = tempfile.mkdtemp()
times, outputs = [], None
for k in range(1 + RUNS):
    path = os.path.join(folder, f"run{k}.jsonl")
    bs.clear_cache()
    a = time.perf_counter()
    report = safe_generate(model, tok, prompts, max_new_tokens=16, results=path, resume=False, progress=False)
    records = [json.loads(line) for line in open(path) if line.strip()]
    times.append(time.perf_counter() - a)
    got = sorted((r["id"], r["output"]) for r in records if "output" in r)
    outputs = got if outputs is None else outputs
    assert got == outputs, "outputs changed between runs"
result(first_s=times[0], warm_s=statistics.median(times[1:]), samples=len(outputs), new_tokens=report.new_tokens,
       batch_sizes=list(report.batch_sizes), outputs=outputs)
""".replace("RUNS", str(RUNS))

RELEASE = """
from IPython.core.interactiveshell import InteractiveShell
variant = sys.argv[1]
ip = InteractiveShell.instance()
ip.run_cell('''
import gc, json, sys, time, weakref
import psutil, torch
from helpers.oom.reclaim import release_after_oom
proc = psutil.Process()
gc.collect()
rss0 = proc.memory_info().rss
ref = None

def step():
    global ref
    big = torch.ones(128 << 20)  # 512 MiB of fp32, alive in this frame
    ref = weakref.ref(big)
    return torch.empty(1 << 45)  # the CPU allocator fails: an OOM (helpers.is_oom)
''')
if variant.startswith("variable"):
    ip.run_cell('''
try:
    step()
except Exception as e:
    err = e
''')
else:
    ip.run_cell("step()")  # uncaught: IPython keeps it (sys.last_*, its traceback formatter)
ip.run_cell('''
from helpers.oom.messages import is_oom
held = err if "err" in globals() else sys.last_value
kind, oom = type(held).__name__, is_oom(held)
del held
rss1 = proc.memory_info().rss
a = time.perf_counter()
if VARIANT.endswith("gc"):
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
elif VARIANT.endswith("release"):
    release_after_oom()
elif VARIANT.endswith("cleanup"):
    from helpers import cleanup
    cleanup()
dt = time.perf_counter() - a
result(error=kind, is_oom=oom, alive=ref() is not None, rss_after_oom=rss1 - rss0,
       rss_pinned=proc.memory_info().rss - rss0, seconds=dt)
'''.replace("VARIANT", repr(variant)))
"""

RELEASE_VARIANTS = {  # variant -> label
    "ipython-none": "error kept by IPython; nothing",
    "ipython-gc": "error kept by IPython; gc.collect()" + " + empty_cache()",
    "ipython-release": "error kept by IPython; release_after_oom()",
    "variable-gc": "error kept in a variable; gc.collect()",
    "variable-release": "error kept in a variable; release_after_oom()",
    "variable-cleanup": "error kept in a variable; cleanup()",
}


def worker(code: str, tree: Path, cwd: Path, *args: str, may_crash: bool = False) -> dict:
    """Run ``code`` in a fresh interpreter that imports ``helpers`` from ``tree``: its RESULT, exit status, stdout."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    # the IPython cells run in the shell's namespace, so result() goes to builtins
    script = PREAMBLE + ("import builtins\nbuiltins.result = result\n" if code is RELEASE else "") + code
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=cwd)
    out = {"returncode": p.returncode, "stdout": p.stdout}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            out["result"] = json.loads(line[7:])
    if "result" in out:
        if not Path(out["result"]["helpers"]).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"a worker for {tree} imported {out['result']['helpers']}")
    elif not may_crash:
        raise SystemExit(f"worker failed (exit {p.returncode}) for {tree}:\n{(p.stderr or p.stdout)[-2000:]}")
    return out


def materialize(commit: str, into: Path) -> str:
    """``git archive commit helpers data`` unpacked under ``into``; the full commit id."""
    full = subprocess.run(["git", "-C", str(REPO), "rev-parse", commit + "^{commit}"], capture_output=True, text=True)
    if full.returncode:
        sys.exit(f"commit {commit} not found in {REPO}: this bench needs the project's git history")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "helpers", "data"], capture_output=True,
                             check=True)  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return full.stdout.strip()


def after_commit() -> dict:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "helpers"], capture_output=True,
                           text=True).stdout.strip()  # fmt: skip
    return {"commit": head, "helpers_modified": bool(dirty)}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": values}  # fmt: skip


def paired(before: list[float], after: list[float]) -> dict:
    ratios = [b / a for b, a in zip(before, after, strict=True)]
    return {"before": spread(before), "after": spread(after), "ratio": spread(ratios)}


def fmt(x: dict, unit: str | None = None) -> str:
    """Median (min-max), in the unit that puts the median at 1 or more (s, ms, µs) unless one is given."""
    if unit is None:
        unit = "s" if x["median"] >= 1 else "ms" if x["median"] >= 1e-3 else "µs"
    scale = {"s": 1, "ms": 1e3, "µs": 1e6}[unit]

    def v(y: float) -> str:
        y *= scale
        return f"{y:,.0f}" if y >= 100 else f"{y:.1f}" if y >= 10 else f"{y:.2f}" if y >= 1 else f"{y:.3f}"

    return f"{v(x['median'])} {unit} ({v(x['min'])}-{v(x['max'])})"


def times(r: float) -> str:
    return f"{r:,.0f}x" if r >= 100 else f"{r:.1f}x" if r >= 10 else f"{r:.2f}x" if r >= 0.1 else f"{r:.3f}x"


def ratio(x: dict) -> str:
    r = x["ratio"]
    return f"{times(r['median'])} ({times(r['min'])}-{times(r['max'])})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    args = ap.parse_args(argv)
    tiny = REPO / "data" / "tiny" / "llama"
    if not (tiny / "config.json").exists():
        sys.exit("build the tiny models first: python data/build_tiny_models.py")
    prompts_file = REPO / "helpers" / "data" / "eval_prompts.jsonl"
    started = time.perf_counter()
    raw: dict[str, dict[str, list]] = {}

    def keep(name: str, side: str, out: dict) -> None:
        raw.setdefault(name, {}).setdefault(side, []).append(out)

    with tempfile.TemporaryDirectory() as scratch:
        old, cwd = Path(scratch) / "before", Path(scratch) / "cwd"  # cwd: nothing named helpers in it
        old.mkdir()
        cwd.mkdir()
        before_commit = materialize(BEFORE, old)
        trees = {"before": old, "after": REPO}
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            print(f"round {r + 1}/{args.rounds} ({', '.join(order)})", file=sys.stderr, flush=True)
            for side in order:
                keep("import", side, worker(IMPORT_MONITOR, trees[side], cwd))
            for side in order:
                keep("estimate", side, worker(ESTIMATE_FIT, trees[side], cwd))
            keep("transformers", "after", worker(TRANSFORMERS_REF, REPO, cwd))
            for side in order:
                keep("monitor", side, worker(MONITOR, trees[side], cwd))
            for side in order:
                keep("census", side, worker(CENSUS, trees[side], cwd, may_crash=True))
            for side in order:
                keep("generate", side, worker(SAFE_GENERATE, trees[side], cwd, str(tiny), str(prompts_file)))
            variants = list(RELEASE_VARIANTS)
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                keep(v, "after", worker(RELEASE, REPO, cwd, v))

    def res(name: str, side: str, key: str) -> list:
        return [o["result"][key] for o in raw[name][side]]

    rows, out = [], {}

    def row(key, label, measure, pair, changed):
        out[key] = {"label": label, "measure": measure, **pair, "changed": changed}  # values in seconds
        rows.append([label, measure, fmt(pair["before"]), fmt(pair["after"]), ratio(pair),
                     pair["before"]["n"], changed])  # fmt: skip

    trainer = {s: all(res("import", s, "transformers_imported")) for s in ("before", "after")}
    row("import_monitor", "`import helpers.monitoring.monitor` (after `import torch`)", "wall time, fresh process",
        paired(res("import", "before", "seconds"), res("import", "after", "seconds")),
        f"TrainerCallback imported on first use of MemoryCallback (transformers imported: "
        f"before {'yes' if trainer['before'] else 'no'}, after {'yes' if trainer['after'] else 'no'})")  # fmt: skip
    totals = {s: set(res("estimate", s, "estimate_total")) for s in ("before", "after")}
    row("first_estimate", f'first `estimate("{MODEL}", load="nf4")`', "after importing the estimator",
        paired(res("estimate", "before", "estimate_s"), res("estimate", "after", "estimate_s")),
        "mostly transformers' own imports on both sides (reference below); "
        f"same total bytes: {'yes' if totals['before'] == totals['after'] else 'NO'}")  # fmt: skip
    row("estimator_import", "import the estimator module", "`helpers.estimate` / `helpers.estimator`",
        paired(res("estimate", "before", "import_s"), res("estimate", "after", "import_s")),
        "estimate.py split into estimator/ (rows, configs, layout, training, core, fitting)")  # fmt: skip
    ref_import = spread(res("transformers", "after", "transformers_import_s"))
    ref_est = spread(res("transformers", "after", "estimate_after_imports_s"))
    out["transformers_reference"] = {"import": ref_import, "estimate_after_imports": ref_est,
                                     "imports": "from transformers import AutoConfig, AutoModelForCausalLM, "
                                                "LlamaConfig, LlamaForCausalLM"}  # fmt: skip
    rows.append(["reference: import transformers' Auto classes + Llama", "after only, fresh process", "—",
                 fmt(ref_import), "—", ref_import["n"], "what the first estimate has to import"])  # fmt: skip
    rows.append(["reference: the same estimate after those imports", "after only, same process", "—",
                 fmt(ref_est), "—", ref_est["n"], "the estimate's own work"])  # fmt: skip
    first_fit = {s: raw["estimate"][s][0]["result"]["suggestions"] for s in ("before", "after")}
    row("fit_first", "`fit(est, \"t4\")`, first call", "CodeLlama-7B fp16, batch 4, 2048 new: does not fit",
        paired(res("estimate", "before", "fit_first_s"), res("estimate", "after", "fit_first_s")),
        "first call builds the layouts of the other shipped configs (smaller-model fix) on both sides")  # fmt: skip
    row("fit_warm", "`fit(est, \"t4\")`, warm", "median of 10 calls in the process",
        paired(res("estimate", "before", "fit_warm_s"), res("estimate", "after", "fit_warm_s")),
        f"suggestions before {len(first_fit['before'])}, after {len(first_fit['after'])} (in the JSON): "
        "a fix that 'fits' must now leave the tight margin")  # fmt: skip
    out["fit_suggestions"] = first_fit
    out["fit_verdict"] = {s: raw["estimate"][s][0]["result"]["verdict"] for s in ("before", "after")}

    def mon(side, n, key):
        return [o["result"]["points"][str(n)][key] for o in raw["monitor"][side]]

    for n in (10_000, 100_000, 1_000_000):
        row(f"peak_{n}", f"`MemoryMonitor.peak()` after {n:,} samples", "per call",
            paired(mon("before", n, "peak_s"), mon("after", n, "peak_s")),
            "running peaks kept per sample: no scan")  # fmt: skip
    row("peak_since_1000", "1,000 `peak(since)` calls at 100,000 samples", "total (MemoryCallback: one per log)",
        paired(mon("before", 100_000, "peak_since_1000_s"), mon("after", 100_000, "peak_since_1000_s")),
        "bisect to the window (20 samples) instead of scanning every sample")  # fmt: skip
    row("store_1m", "storing 1,000,000 samples", "total time in the store calls",
        paired(mon("before", 1_000_000, "store_total_s"), mon("after", 1_000_000, "store_total_s")),
        "running peaks per sample, and the pairwise merge past max_samples")  # fmt: skip
    row("store_worst", "slowest single store of those 1,000,000", "one call",
        paired(mon("before", 1_000_000, "store_worst_s"), mon("after", 1_000_000, "store_worst_s")),
        "a store during which Python's garbage collector ran (see the row below)")  # fmt: skip
    row("store_worst_nogc", "the same, garbage collector off", "one call",
        paired(mon("before", 1_000_000, "store_worst_nogc_s"), mon("after", 1_000_000, "store_worst_nogc_s")),
        "past max_samples the older half is merged at most 256 pairs per store, never in one call")  # fmt: skip
    kept = {
        s: {n: statistics.median(mon(s, n, "kept")) for n in (10_000, 100_000, 1_000_000)} for s in ("before", "after")
    }
    rss = {s: spread(mon(s, 1_000_000, "rss_mib")) for s in ("before", "after")}
    same_peaks = all(
        o["result"]["points"][k]["peak"] == raw["monitor"]["before"][0]["result"]["points"][k]["peak"]
        for s in ("before", "after") for o in raw["monitor"][s] for k in ("10000", "100000", "1000000")
    )  # fmt: skip
    out["monitor_samples_kept"] = kept
    out["monitor_rss_mib_at_1m"] = rss
    out["monitor_same_peaks"] = same_peaks
    rows.append(
        [
            "samples kept after 10k / 100k / 1M",
            "len(mon.samples)",
            " / ".join(f"{kept['before'][n]:,.0f}" for n in kept["before"]),
            " / ".join(f"{kept['after'][n]:,.0f}" for n in kept["after"]),
            "—",
            len(raw["monitor"]["after"]),
            f"bounded: older half merged pairwise past max_samples; same peaks: {'yes' if same_peaks else 'NO'}",
        ]
    )
    rows.append(["RSS held by 1,000,000 samples", "MiB above the empty monitor",
                 f"{rss['before']['median']:.0f} ({rss['before']['min']:.0f}-{rss['before']['max']:.0f})",
                 f"{rss['after']['median']:.0f} ({rss['after']['min']:.0f}-{rss['after']['max']:.0f})", "—",
                 rss["after"]["n"], "the list no longer grows without bound"])  # fmt: skip

    def census_outcome(side):
        codes = [o["returncode"] for o in raw["census"][side]]
        freed = [o.get("result", {}).get("freed", False) for o in raw["census"][side]]
        walked = [json.loads(next(x for x in o["stdout"].splitlines() if x.startswith("CENSUS "))[7:])
                  for o in raw["census"][side]]  # fmt: skip
        return {
            "returncodes": codes,
            "survived": sum(freed),
            "runs": len(codes),
            "census_s": spread([w["census_s"] for w in walked]),
            "tensors": [w["tensors"] for w in walked],
        }

    cen = {s: census_outcome(s) for s in ("before", "after")}
    out["census_chain"] = {"nodes": CHAIN, **cen}

    def signal(c: dict) -> str:
        codes = sorted(set(c["returncodes"]))
        named = ", ".join(f"signal {-k} (SIGSEGV)" if k == -11 else (f"signal {-k}" if k < 0 else f"exit {k}")
                          for k in codes)  # fmt: skip
        return f"survived {c['survived']}/{c['runs']}: {named}"

    rows.append(
        [
            f"`census()` over a {CHAIN:,}-node autograd chain, then free it",
            "exit status of the process",
            signal(cen["before"]),
            signal(cen["after"]),
            "—",
            cen["after"]["runs"],
            "graph walks share a budget of live node wrappers (20,000): a walked chain can be freed",
        ]
    )
    rows.append(
        [
            "that `census()` call",
            "wall time; live tensors counted",
            f"{fmt(cen['before']['census_s'])}; {statistics.median(cen['before']['tensors']):,.0f}",
            f"{fmt(cen['after']['census_s'])}; {statistics.median(cen['after']['tensors']):,.0f}",
            "—",
            cen["after"]["runs"],
            "after stops at the budget (with a note), so it counts fewer tensors",
        ]
    )
    gen_same = all(o["result"]["outputs"] == raw["generate"]["before"][0]["result"]["outputs"]
                   for s in ("before", "after") for o in raw["generate"][s])  # fmt: skip
    n_prompts = raw["generate"]["after"][0]["result"]["samples"]
    row("safe_generate_first", f"`safe_generate`, tiny Llama, {n_prompts} prompts x 16 tokens",
        "first run in a fresh process, 1 thread",
        paired(res("generate", "before", "first_s"), res("generate", "after", "first_s")),
        f"prompts tokenized once (ids padded by hand), one batched generation; same outputs: "
        f"{'yes' if gen_same else 'NO'}")  # fmt: skip
    row("safe_generate_warm", "the same, later runs", f"median of {RUNS} runs in the process",
        paired(res("generate", "before", "warm_s"), res("generate", "after", "warm_s")),
        "after also hashes the prompts, records the model and locks the results file")  # fmt: skip
    out["safe_generate"] = {
        "prompts": n_prompts,
        "max_new_tokens": 16,
        "torch_threads": 1,
        "runs_per_process": RUNS,
        "same_outputs": gen_same,
        "batch_sizes": {s: raw["generate"][s][0]["result"]["batch_sizes"] for s in trees},
    }

    rel = {}
    for v, label in RELEASE_VARIANTS.items():
        got = [o["result"] for o in raw[v]["after"]]
        rel[v] = {"label": label, "pinned_bytes": spread([g["rss_pinned"] for g in got]),
                  "after_oom_bytes": spread([g["rss_after_oom"] for g in got]),
                  "tensor_alive": sum(g["alive"] for g in got), "runs": len(got),
                  "seconds": spread([g["seconds"] for g in got]), "error": got[0]["error"],
                  "is_oom": all(g["is_oom"] for g in got)}  # fmt: skip
        p = rel[v]["pinned_bytes"]
        rows.append([f"after an OOM: {label}", "RSS still pinned (MiB); 512 MiB tensor alive", "—",
                     f"{p['median'] / 2**20:.0f} ({p['min'] / 2**20:.0f}-{p['max'] / 2**20:.0f}); "
                     f"alive {rel[v]['tensor_alive']}/{rel[v]['runs']}", "—", rel[v]["runs"],
                     f"cleanup took {fmt(rel[v]['seconds'])}"])  # fmt: skip
    out["release_after_oom"] = rel

    header = ["hot spot", "measure", f"before ({BEFORE}): median (range)", "after (this tree): median (range)",
              "before / after (median of rounds, range)", "rounds", "what changed"]  # fmt: skip
    table = format_table(header, rows)
    print(table)
    seconds = time.perf_counter() - started
    print(f"\n{seconds:.0f} s")
    path = write_results(
        "hot_spots",
        {
            "before": {"commit": before_commit, "note": "parent of cc41993, the first hot-spot fix"},
            "after": after_commit(),
            "rounds": args.rounds,
            "model": MODEL,
            "rows": out,
            "table": table,
            "seconds": seconds,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
