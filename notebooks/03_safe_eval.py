# ---
# jupyter:
#   accelerator: GPU
#   colab:
#     gpuType: T4
#     provenance: []
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: accelerator,colab
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · Evaluate without losing a result
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/oomkit/oomkit/blob/main/notebooks/03_safe_eval.ipynb)

# %% cellView="form" jupyter={"source_hidden": true}
# @title Install oomkit (Colab, Kaggle: quiet, skipped once installed) { display-mode: "form" }
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

if "google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
    try:
        importlib.metadata.version("oomkit")
    except importlib.metadata.PackageNotFoundError:  # never reinstalls the runtime's torch: oomkit accepts it
        pip = [sys.executable, "-m", "pip", "install", "-q", "oomkit @ git+https://github.com/oomkit/oomkit"]
        if (done := subprocess.run(pip, capture_output=True, text=True)).returncode:
            raise RuntimeError(f"installing oomkit failed:\n{done.stderr[-3000:]}") from None
        importlib.invalidate_caches()  # a new package imports in this kernel at once
if (spec := importlib.util.find_spec("helpers")) and not str(spec.origin).endswith(os.path.join("helpers", "__init__.py")):
    raise ImportError(f"{spec.origin} shadows oomkit's package `helpers`: rename or move it, then rerun this cell")

from helpers import configure_allocator, gpu_notice  # noqa: E402

configure_allocator()  # expandable segments, set before anything touches CUDA (else it needs a restart)
if notice := gpu_notice():  # on a CPU runtime: how to switch to a T4
    print(notice)

# %% [markdown]
# > 1. **Runtime > Change runtime type > T4 GPU** (Kaggle: *Accelerator > GPU T4*)
# > 2. Set **`MODEL`** in the form below: a hub id or a local folder with `config.json`
# > 3. **Runtime > Run all**

# %% tags=["parameters"]
# hub id or local path
MODEL = "Qwen/Qwen2.5-1.5B-Instruct"  # @param {type:"string"}
# fp16, bf16, fp32, int8, nf4, fp4
LOAD = "nf4"  # @param {type:"string"}
# None: the prompts shipped with oomkit; or a JSONL path, {"id", "prompt", "reference"} per line
PROMPTS_FILE = None  # @param {type:"raw"}
# a name goes to MyDrive/oomkit/ in Colab (MOUNT_DRIVE): survives a reset
RESULTS = "eval_results.jsonl"  # @param {type:"string"}
# Colab: mount Google Drive so the results file outlives the runtime
MOUNT_DRIVE = True  # @param {type:"boolean"}
MAX_NEW_TOKENS = 64  # @param {type:"integer"}
# "auto": start where an earlier run learned, else the estimate; or a starting int
BATCH_SIZE = "auto"  # @param {type:"raw"}
# "exact_match", "contains", or a function(output, reference) -> float
SCORE = "contains"  # @param {type:"raw"}
# None: a real run that resumes after a disconnect; a number: the demo, Stop after that many
INTERRUPT_AFTER = None  # @param {type:"raw"}
# batch x tokens: make a CPU run behave like a small GPU (None on a real GPU)
SIMULATED_BUDGET = None  # @param {type:"raw"}

# %% [markdown]
# The usual advice for evaluating on a small GPU is batch 1, `torch.cuda.empty_cache()` every 10
# samples, and stop at the first OOM: slow, and a crash at sample 480 of 500 loses all 480.
# `safe_generate` runs as fast as memory allows, adapts when memory runs short, and writes every
# finished sample to disk at once. Steps: load with a plan -> look at the prompts -> evaluate, get
# interrupted halfway in the demo -> resume -> report, plot and a check that every prompt is there exactly once.

# %% [markdown]
# ## Why batches of similar length, and why adaptive
#
# **Batch 1 wastes the GPU.** Generating one token for one prompt reads every weight of the model
# from memory; for 32 prompts it reads them once too. Small-batch generation is limited by memory
# bandwidth, not arithmetic, so a batch of 16 costs little more per step than a batch of 1 and
# produces 16 times the tokens.
#
# **Mixed lengths waste compute on padding.** In a batch, every prompt is left-padded to the
# longest one; a 20-token question next to a 400-token one computes 380 tokens of padding, and the
# KV cache holds them too. `safe_generate` sorts prompts by token length, so each batch holds
# similar lengths and little is padded. It starts with the longest prompts: the tightest batches
# come first, memory limits are found early, and the shorter prompts later get bigger batches.
#
# **Adaptive batches instead of "stop at the first OOM".** Memory needed grows with batch x
# (prompt + new tokens). The starting size comes from `find_max_batch_size`'s cache or the memory
# estimator; on an OOM the failed batch's memory is released (its traceback pinned it), the size
# moves between the largest product that ran and the smallest that failed (a search, not blind
# halving), and the same prompts are retried. A prompt that does not fit even alone is retried with
# fewer new tokens and recorded as truncated. The cache is emptied after an OOM or when much memory
# sits cached unused, not every N samples: `empty_cache()` in a loop only makes the allocator
# request the same memory again.
#
# ## 1. Choose, see the fit, load
# The panel's load mode and `max_new_tokens` are what the evaluation below runs with; its batch is
# the starting batch when `BATCH_SIZE` is a number (with `"auto"` it only shapes the estimate, and
# `safe_generate` picks its own start). Prompt tokens: about the longest prompt (step 2 prints them).

# %%
# %load_ext helpers
from helpers import LoadPanel, mount_drive, persistent_path, snapshot

if MOUNT_DRIVE:  # Colab: asked once; a refused or closed pop-up goes on without Drive and says where files go
    print(mount_drive())
RESULTS = persistent_path(RESULTS)  # MyDrive/oomkit/ when Drive is mounted: results survive a runtime reset
print(f"results go to {RESULTS}")

panel = LoadPanel(MODEL, load=LOAD, max_new_tokens=MAX_NEW_TOKENS, batch_size=8 if BATCH_SIZE == "auto" else BATCH_SIZE,
                  prompt_tokens=128)
panel

# %%
model, tokenizer, load_report = panel.load()  # the panel's plan; a second run reuses the loaded model
MAX_NEW_TOKENS = panel.plan.max_new_tokens  # the slider's value from here on
START_BATCH = BATCH_SIZE if BATCH_SIZE == "auto" else panel.plan.batch_size
load_report

# %%
before = snapshot()
before

# %% [markdown]
# ## 2. The prompts
# Each has an `id` (results are matched by id on resume; prompts without one get a stable hash of
# their text) and a `reference` answer for the score.

# %%
from helpers import data_path, load_prompts

prompts = load_prompts(PROMPTS_FILE or data_path("eval_prompts.jsonl"))
lengths = sorted(len(ids) for ids in tokenizer([p["prompt"] for p in prompts])["input_ids"])
print(f"{len(prompts)} prompts, {lengths[0]} to {lengths[-1]} tokens (median {lengths[len(lengths) // 2]})")
prompts[0]

# %% [markdown]
# ## 3. Evaluate (in the demo, interrupted halfway)
# By default this is a real run: it resumes from the results file, so re-running the cell after a
# disconnect continues where the file stopped. The demo (`INTERRUPT_AFTER = 20`) shows what Stop
# does: `on_result` is called after each sample is on disk, and raises `KeyboardInterrupt` after
# `INTERRUPT_AFTER` samples, exactly what pressing Stop does. A batch is written whole before its
# samples are reported, so the file may hold a few more than were reported: the rest of that batch.
# (A crashed or reset runtime is the same story: the file keeps every finished line, and a line torn
# mid-write is repaired on resume.) With `INTERRUPT_AFTER` set (the demo) the cell starts the file
# over: the earlier results are moved to `<file>.<time>.bak` beside it, never deleted. With `None` (a
# real run) it resumes, so re-running it after a disconnect continues where the file stopped. The
# first batch's first answer is printed as it is generated (`stream=True`).

# %%
import contextlib

from helpers import safe_generate, simulated_budget


def memory_limit():
    """A simulated GPU budget on CPU demos; nothing on a real GPU."""
    return simulated_budget(model, tokens=SIMULATED_BUDGET) if SIMULATED_BUDGET else contextlib.nullcontext()


def stop_after(n):
    seen = []

    def callback(record):
        seen.append(record["id"])
        if n is not None and len(seen) >= n:
            raise KeyboardInterrupt(f"Stop pressed after sample {n} was reported")

    return callback


try:
    with memory_limit():
        safe_generate(model, tokenizer, prompts, max_new_tokens=MAX_NEW_TOKENS, batch_size=START_BATCH, results=RESULTS,
                      resume=INTERRUPT_AFTER is None, score=SCORE, on_result=stop_after(INTERRUPT_AFTER), stream=True)
except KeyboardInterrupt as stop:
    print(f"interrupted: {stop}")

with open(RESULTS) as f:
    safe = sum(1 for _ in f)
note = f" ({INTERRUPT_AFTER} reported before Stop; the rest of that batch was on disk already)" if INTERRUPT_AFTER else ""
print(f"{safe} of {len(prompts)} samples are safe in {RESULTS}{note}")

# %% [markdown]
# ## 4. Resume
# The same call with `resume=True` (the default) skips every id already in the file and does the
# rest.

# %%
with memory_limit():
    report = safe_generate(model, tokenizer, prompts, max_new_tokens=MAX_NEW_TOKENS, batch_size=START_BATCH,
                           results=RESULTS, score=SCORE)
report

# %% [markdown]
# The resumed run's batch size (left axis, whole numbers; a red x for each batch that ran out of
# memory and was retried smaller) and memory after each batch (right axis, from zero): the batch
# grows while it fits, drops after an OOM, and grows again as the prompts get shorter. It started
# from what the interrupted run learned (kept in `find_max_batch_size`'s cache), so it usually needs
# no OOM at all.

# %%
report.plot()

# %% [markdown]
# ## 5. Nothing lost, nothing twice

# %%
import json

from helpers import is_record

with open(RESULTS) as f:
    rows = [r for r in map(json.loads, f) if is_record(r)]  # a header line (what made the results) is no result
ids = [r["id"] for r in rows]
assert len(ids) == len(set(ids)) == len(prompts), "a sample is missing or duplicated"
assert set(ids) == {p["id"] for p in prompts}
print(f"{len(ids)} results, one per prompt; {report.skipped} came from before the interruption")
for r in report.records[:3]:
    print(f"[{r['id']}] {r['prompt'][-60:]!r} -> {r['output'].strip()[:80]!r}  (score {r.get('score')})")

# %%
snapshot()
