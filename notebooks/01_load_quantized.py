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
# # 01 · Load a model quantized, without running out of memory
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/oomkit/oomkit/blob/main/notebooks/01_load_quantized.ipynb)

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
MODEL = "codellama/CodeLlama-7b-Instruct-hf"  # @param {type:"string"}
# fp16, bf16, fp32, int8, nf4, fp4
LOAD = "nf4"  # @param {type:"string"}
# 4-bit only: quantize the quantization scales too
DOUBLE_QUANT = True  # @param {type:"boolean"}
MAX_NEW_TOKENS = 256  # @param {type:"integer"}
BATCH_SIZE = 4  # @param {type:"integer"}
PROMPT_TOKENS = 512  # @param {type:"integer"}
# section 7: load each mode in turn and score it on PROMPTS (a few minutes for a 7B on a T4)
COMPARE_LOADS = True  # @param {type:"boolean"}
# "current" (this GPU), or a preset such as "t4" to plan for another machine
DEVICE = "current"  # @param {type:"raw"}
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a KV cache is.",
    "List three ways to reduce GPU memory when generating text.",
    "What does 4-bit quantization do to a neural network's weights?",
]

# %% [markdown]
# Pick a load mode, a generation length and a batch size with the sliders, see at once whether it
# fits the GPU, load with one click, then compare the estimate with what really landed in memory.
# Steps: preflight -> panel -> load -> estimated vs measured -> a short batched generation ->
# unload, with a readout proving the memory came back.

# %% [markdown]
# ## 1. Preflight
# GPU, versions, bitsandbytes, free memory, RAM for loading and the fit of the model you named.

# %%
# %load_ext helpers
from helpers import preflight, snapshot

start = snapshot()
report = preflight(MODEL, load=LOAD, max_new_tokens=MAX_NEW_TOKENS, batch_size=BATCH_SIZE, prompt_tokens=PROMPT_TOKENS,
                   show=True, calibrate=True)  # each check as it finishes; calibrate: time estimates use this machine
report.raise_for_failures()  # "Run all" stops here when this model cannot run on this runtime, with the fix

# %% [markdown]
# ## 2. Choose how to load it
#
# **What 8-bit and 4-bit do to the weights.** A 7B model in fp16 takes 2 bytes per parameter: it
# barely fits a T4 and leaves little for generation (the cell below computes every figure).
# - **int8** (LLM.int8, bitsandbytes) stores each linear layer's weights as 1-byte integers plus one
#   fp32 scale per row, so about 1 byte per parameter. Outlier features are computed
#   in fp16, which keeps quality close to fp16 (the seeds' "99 %").
# - **nf4 / fp4** store 4 bits per weight (half a byte) plus one scale per block of 64 weights;
#   **double quant** stores those scales in 8 bits too (another ~0.4 bit per weight saved).
#   nf4's 16 levels follow the normal distribution weights have, so it loses less than fp4.
#   Layers are dequantized to the compute dtype (fp16 on a T4, bf16 on newer GPUs) on the fly.
# - Embeddings, norms and the output layer stay in 16 bits in every mode: the estimate counts them
#   per layer, which is why "4-bit = fp32 / 8" calculators are wrong.
#
# **Why `max_new_tokens` and batch drive the KV cache.** Generation keeps the keys and values of
# every token seen so far: layers x 2 x batch x (prompt + new tokens) x kv-heads x head-dim x
# 2 bytes. It grows linearly with both sliders; the cell below shows it for CodeLlama-7B.

# %%
# The figures behind this section, computed for CodeLlama-7B on a T4 (its config ships with oomkit)
from helpers import estimate, format_bytes

SEVEN_B = "codellama/CodeLlama-7b-hf"
for mode in ("fp16", "int8", "nf4"):
    print(f"{mode:>5}: weights {format_bytes(estimate(SEVEN_B, load=mode, device='t4').weights)}")
kv = estimate(SEVEN_B, load="nf4", device="t4", batch_size=4, prompt_tokens=512, max_new_tokens=2048)
print(f"KV cache for a batch of 4 x (512 + 2048) tokens: {format_bytes(kv.row('kv_cache').bytes)}")

# %% [markdown]
# Move the sliders: the bar shows weights, KV cache, activations and overheads against the device,
# green / amber / red for fits / tight / does not fit, with the best fix when it does not fit.
# Without a widget front end (or when run headless) the panel prints a summary and the parameters
# cell above decides. `panel.plan` is always the current choice.

# %%
from helpers import LoadPanel

panel = LoadPanel(MODEL, device=DEVICE, load=LOAD, double_quant=DOUBLE_QUANT, max_new_tokens=MAX_NEW_TOKENS,
                  batch_size=BATCH_SIZE, prompt_tokens=PROMPT_TOKENS)
panel

# %% [markdown]
# ## 3. Load
# Click **Load** above, or run this cell: it loads `panel.plan` (or reuses what the button loaded).
# Before touching any weights it checks that the model exists, that bitsandbytes runs here, that the
# estimate fits and that RAM can hold the largest weight file, and refuses with the reason and the
# fix instead of letting the kernel die.

# %%
panel.plan

# %%
model, tokenizer, report = panel.load()
report

# %% [markdown]
# ## 4. Estimated vs measured
# `weights` compares the estimate with `footprint(model)`: every parameter, buffer and bitsandbytes
# quantization state (scales, absmax), which `model.get_memory_footprint()` leaves out. On a GPU the
# growth of `torch.cuda.memory_allocated()` during the load is shown too. The full estimate, with the
# generation budget the panel was set to:

# %%
report.estimate

# %% [markdown]
# Where those bytes sit in the model: embeddings, each decoder layer, `lm_head` and the rest, with
# bitsandbytes' quantization state counted with its layer (the parts add up to `footprint(model)`).
# In 4-bit the decoder layers shrink about four-fold while the embeddings and `lm_head` stay 16-bit:
# on a small model they can be most of what is left.

# %%
from helpers import module_memory

module_memory(model)

# %% [markdown]
# ## 5. A short batched generation
# With the panel's current `max_new_tokens` and batch size: move the sliders and re-run this cell (a
# new generation budget needs no reload; a new load mode reloads here, freeing the old model first). The
# first prompt's answer is printed as it is generated (`stream=True`); the rest come with their batch.

# %%
from helpers import generate_batched

model, tokenizer, report = panel.load()  # the sliders' plan: reloads only when the load mode changed
plan = panel.plan  # the sliders' values now, not the parameters cell's
outputs = generate_batched(model, tokenizer, PROMPTS, max_new_tokens=plan.max_new_tokens, batch_size=plan.batch_size,
                           stream=True)
for prompt, text in zip(PROMPTS, outputs, strict=True):
    print(f"> {prompt}\n{text.strip()[:300]}\n")
snapshot()

# %% [markdown]
# ### Long generations: a smaller KV cache
# The KV cache grows with batch x (prompt + new tokens); for long generations it can outgrow the
# weights. `LoadPlan(kv_cache=...)` (the panel's **KV cache** dropdown) changes what `generate()` keeps:
# `"fp8"` stores a byte per value (transformers' own backend), `"int4"` / `"int2"` fewer bits
# (needs optimum-quanto or hqq; outputs may differ), each dequantizing one layer per token, and
# `"offload"` keeps one layer's cache on the GPU and the rest in CPU RAM, crossing PCIe every token.
# The panel's current plan with each kind (a kind this machine cannot run says why):

# %%
panel.reducers()

# %% [markdown]
# ## When `device_map="auto"` offloading is a trap
# If the model does not fit the GPU, `device_map="auto"` puts the remaining layers in CPU RAM (and
# then on disk). The load "works", but every generated token copies those layers over PCIe again:
# a few GiB offloaded turns seconds into minutes, and disk offload into hours. It is a fix only for a
# one-off forward pass. The report above warns with the amount and the cost per token; the real
# fixes are int8/nf4, a shorter `max_new_tokens`, a smaller batch, or a smaller model.
#
# ## 6. Unload and prove the memory came back

# %%
from helpers import footprint, format_bytes, unload

weights = footprint(model)
loaded = snapshot()
panel.release()
del tokenizer
freed = unload(model)
after = snapshot()
print(freed)
print(f"model weights: {format_bytes(weights)}")
if after.gpu is not None:
    print(f"GPU allocated: {format_bytes(loaded.gpu.allocated)} loaded -> {format_bytes(after.gpu.allocated)} "
          f"after unload ({format_bytes(start.gpu.allocated)} before loading)")

# %% [markdown]
# ## 7. What each load mode costs in quality, on your own text
# `compare_loads` loads the model once per mode (16-bit, int8, nf4; each unloaded before the next, so a
# 7B still fits a T4), and scores each on `PROMPTS`: perplexity, how often its greedy next token agrees
# with the 16-bit one, the weights' memory and decode tokens/s. One table to pick the load mode from
# (the tiny demo model's random weights make its quality figures meaningless; a real model's are not).
# Set `COMPARE_LOADS = False` above to skip it.

# %%
from helpers import compare_loads

compare_loads(MODEL, PROMPTS) if COMPARE_LOADS else print("skipped: COMPARE_LOADS is False")
