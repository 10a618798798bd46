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
# # 04 · Leak hunting: who holds the memory?
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/oomkit/oomkit/blob/main/notebooks/04_leak_hunting.ipynb)

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
# hub id or local path; a small model is enough to see leaks
MODEL = "Qwen/Qwen2.5-0.5B"  # @param {type:"string"}
# steps per experiment: growth is caught within about 15
STEPS = 25  # @param {type:"integer"}
BATCH = 2  # @param {type:"integer"}
SEQ = 64  # @param {type:"integer"}

# %% [markdown]
# Memory that creeps up step after step until an OOM at step 1000, or memory that does not come
# back after `del model`, is held by *something*. This notebook plants each classic leak in a small
# loop, lets oomkit catch the growth within a few steps and **name the variable** that holds it,
# applies the fix, and shows the curve going flat.
#
# - `watch(step, steps)`: memory per step, trend, acceleration, predicted OOM step, and who grew.
# - `census()`: every live tensor, grouped, with the variable path that holds it.
# - `leak_checks()`: the usual culprits (graphs in lists, hooks, `Out`, tracebacks, caches, grads).

# %% [markdown]
# `%load_ext helpers` adds one line after every cell: GPU allocated change and peak (or, without a
# GPU, the change in live tensor bytes), RAM change and time. A cell whose re-runs keep leaving
# memory behind gets a warning. `%oomkit off` turns the line off.

# %%
# %load_ext helpers

# %%
import torch

from helpers import LoadPlan, census, cleanup, leak_checks, load, record_allocations, watch

device = "cuda" if torch.cuda.is_available() else "cpu"
# load() checks the model first: offline or misspelled, one line with the fix (not the hub's retries)
model, tokenizer, load_report = load(LoadPlan(MODEL, load="fp32" if device == "cpu" else "fp16"))
x = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), device=device)

# %% [markdown]
# ## 1. Keeping the loss tensor instead of the number
#
# An evaluation loop without `torch.no_grad()` that appends `out.loss` keeps each step's whole
# autograd graph, with every activation, alive.

# %%
val_losses = []


def eval_step():
    val_losses.append(model(x, labels=x).loss)  # the leak: a tensor with grad_fn


report = watch(eval_step, STEPS)
report

# %% [markdown]
# The detector flags steady growth, gives the bytes per step and when the card runs out, and the
# census diff names `val_losses[…] (autograd graph)`: the activations belong to the losses in that
# list. The fix: keep a number, and evaluate without a graph.

# %%
val_losses = []


def eval_step():
    with torch.inference_mode():
        val_losses.append(model(x, labels=x).loss.item())


fixed = watch(eval_step, STEPS)
fixed

# %% [markdown]
# ## 2. A hook that is never removed
#
# A forward hook that collects activations keeps every one of them, and re-running the cell adds
# another hook each time.

# %%
feats = []
handle = model.model.layers[0].register_forward_hook(lambda mod, inp, out: feats.append(out[0] if isinstance(out, tuple) else out))
report = watch(lambda: model(x).logits.sum().item(), STEPS)
report

# %%
handle.remove()  # the fix: keep the handle, remove it when done
feats.clear()
watch(lambda: model(x).logits.sum().item(), STEPS)

# %% [markdown]
# ## 3. A cache keyed by input shape
#
# Caching a mask per sequence length looks harmless, until every batch has a new length.

# %%
mask_cache = {}


def step_with_cache(i):
    n = 8 + i  # every batch a new length
    if n not in mask_cache:
        mask_cache[n] = torch.ones(BATCH, 1, n, n, device=device).tril()
    with torch.inference_mode():
        model(x[:, :n])


report = watch(step_with_cache, STEPS)
report

# %% [markdown]
# The fix: pad to a few bucket lengths, so the cache holds a handful of entries and then stays flat
# (a cache that fills and stabilizes is **not** flagged).

# %%
mask_cache = {}


def step_with_buckets(i):
    n = 16 * (1 + i % 3)  # three padded lengths
    if n not in mask_cache:
        mask_cache[n] = torch.ones(BATCH, 1, n, n, device=device).tril()
    with torch.inference_mode():
        model(x[:, :n])


watch(step_with_buckets, STEPS)

# %% [markdown]
# ## 4. Stored exceptions, IPython's `Out`, and gradients after evaluation
#
# These hold memory without growing every step, so `leak_checks()` looks for them directly.
#
# - An exception kept in a list keeps its traceback, every frame, and their local tensors.
# - A cell ending in an expression puts its value in `Out[n]`, for the rest of the session.
# - A training loop that ends without `zero_grad` leaves a gradient on every parameter.

# %%
errors = []


def risky_forward(x):
    hidden = model.get_input_embeddings()(x).repeat(1, 8, 1)
    raise RuntimeError(f"bad batch {tuple(hidden.shape)}")


for _ in range(3):
    try:
        risky_forward(x)
    except RuntimeError as e:
        errors.append(e)  # the leak: keep repr(e) instead

model.eval()  # on to evaluation (a cell ending in `model.eval()` would put the model in Out)
model(x, labels=x).loss.backward()  # ...right after a last training step without zero_grad

# %%
model(x).logits

# %%
found = leak_checks()
found

# %% [markdown]
# Each finding names the holder and says the fix. Applying them:

# %%
errors = [repr(e) for e in errors]
model.zero_grad(set_to_none=True)
cleanup()  # drops the Out history and the stored traceback, collects, empties the CUDA cache

# %%
leak_checks()

# %% [markdown]
# ## 5. The census: everything that is still alive, and who holds it
#
# After the fixes only the model's own weights should remain. Views are counted once (by storage);
# tensors kept alive only by an autograd graph are attributed to the tensor that carries the graph.

# %%
census()

# %% [markdown]
# ## On a GPU: the allocation history
#
# `record_allocations()` records every CUDA allocation in the block, writes a snapshot you can drop
# on <https://pytorch.org/memory_viz>, and lists the lines of code that allocated what is still
# alive.

# %%
if torch.cuda.is_available():
    kept_logits = []
    with record_allocations("leak_hunt.pickle") as rec:
        for _ in range(5):
            kept_logits.append(model(x).logits)  # leaking on purpose: the site shows up on top
    print(rec)
    del kept_logits
else:
    print("no CUDA GPU: allocation history needs one (census() and watch() work everywhere)")

# %% [markdown]
# The per-cell line can be switched off (and back on with `%oomkit on`):

# %%
# %oomkit off
