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
# # 02 · QLoRA fine-tuning that fits a T4, with live memory monitoring
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/oomkit/oomkit/blob/main/notebooks/02_lora_finetune.ipynb)

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
# hub id or local path of the base model
MODEL = "codellama/CodeLlama-7b-Instruct-hf"  # @param {type:"string"}
# nf4 for QLoRA; fp16/bf16 for plain LoRA (needs far more memory)
LOAD = "nf4"  # @param {type:"string"}
# tokens per example; the GIS examples are short
SEQ_LEN = 256  # @param {type:"integer"}
# effective batch: micro-batch x gradient accumulation
BATCH_SIZE = 16  # @param {type:"integer"}
# None: measured, up to BATCH_SIZE; or the most to try (a divisor of BATCH_SIZE)
MICRO_BATCH = None  # @param {type:"raw"}
# LoRA rank
R = 16  # @param {type:"integer"}
# LoRA scale
ALPHA = 32  # @param {type:"integer"}
MAX_STEPS = 60  # @param {type:"integer"}
# a disconnect loses at most this many steps
SAVE_STEPS = 10  # @param {type:"integer"}
LEARNING_RATE = 2e-4  # @param {type:"number"}
# None: the shipped GIS instructions (shipped in the package), or your own JSONL path
DATA = None  # @param {type:"raw"}
# "auto": Google Drive when mounted in Colab, else runs/lora-<model>
OUTPUT_DIR = "auto"  # @param {type:"string"}
# Colab: keep checkpoints on Drive so they survive a disconnect
MOUNT_DRIVE = True  # @param {type:"boolean"}
# True: start over instead of resuming (old checkpoints are renamed previous-checkpoint-N, kept)
FRESH = False  # @param {type:"boolean"}
# what to plan for: a preset ("t4", "a100-40"), or "current"
DEVICE = "t4"  # @param {type:"string"}
MAX_NEW_TOKENS = 64  # @param {type:"integer"}
# also fold the adapter into the base weights at the end
MERGE = False  # @param {type:"boolean"}

# %% [markdown]
# Fine-tune a 7B model with LoRA on a free T4 without guessing batch sizes: the base model is
# loaded in 4 bits (QLoRA), only small adapter matrices train, the micro-batch is **measured** on a
# real training step and gradient accumulation keeps the batch you asked for. Memory is sampled
# while it trains; checkpoints go to Google Drive so a disconnected runtime resumes where it
# stopped (rerun the notebook). The result is a small adapter you reload on the base model.
#
# Steps: preflight -> plan and estimate -> load 4-bit -> answers before -> prepare QLoRA -> find
# the micro-batch -> train with the monitor -> plot -> save the adapter -> answers after ->
# reload check -> cleanup.

# %% [markdown]
# ## 1. Preflight
# GPU, versions, bitsandbytes, free memory, and whether the model fits at all.

# %%
# %load_ext helpers
from helpers import mount_drive, preflight, snapshot

start = snapshot()
report = preflight(MODEL, load=LOAD, max_new_tokens=MAX_NEW_TOKENS,
                   show=True, calibrate=True)  # each check as it finishes; calibrate: time estimates use this machine
report.raise_for_failures()  # "Run all" stops here when this model cannot run on this runtime, with the fix
if MOUNT_DRIVE:  # Colab: asked once; a refused or closed pop-up goes on without Drive and says where files go
    print(mount_drive())

# %% [markdown]
# ## 2. Plan and estimate
# **Where the memory goes in QLoRA.** The 7B base is frozen and stored in 4 bits (about 3.5 GiB);
# LoRA adds two thin matrices (rank r) beside every linear layer, and only those train: tens of
# millions of parameters instead of seven billion. Gradients and optimizer states exist only for
# them (paged 8-bit AdamW: 2 bytes each, and its pages move to CPU RAM under pressure instead of
# raising an OOM). What is left is activations: gradient checkpointing keeps one hidden state per
# layer and recomputes the rest in the backward pass, trading ~30 % speed for most of that memory.
# fp16 on a T4, bf16 on Ampere and newer.
#
# The panel estimates one training step on `DEVICE` for its settings: move them and the bar, the
# verdict and the top fix follow. Its plan is what the following cells load, prepare and train. The
# micro-batch: "auto" lets step 6 measure it (the estimate counts 1 meanwhile); a number is the most
# step 6 tries, kept when a real step fits.

# %%
from helpers import TrainPanel, TrainPlan

plan = TrainPlan(MODEL, load=LOAD, r=R, alpha=ALPHA, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, micro_batch=MICRO_BATCH,
                 max_steps=MAX_STEPS, save_steps=SAVE_STEPS, logging_steps=max(1, MAX_STEPS // 10),
                 warmup_steps=MAX_STEPS // 10, learning_rate=LEARNING_RATE, output_dir=OUTPUT_DIR)
panel = TrainPanel(plan, device=DEVICE)
panel

# %% [markdown]
# The estimator's budget for the panel's choice, row by row:

# %%
plan = panel.plan  # the controls' values now, not the parameters cell's
print(plan)
panel.state.estimate

# %% [markdown]
# ### When it does not fit: memory reducers
# Two settings cut a step's memory without changing what is learned (the panel has both):
# - **`loss="chunked"`** computes the output layer and the cross-entropy a chunk of tokens at a time,
#   so the fp32 scores of every token x the whole vocabulary never exist at once; it costs the output
#   layer's matmul once more per step. It matters most for large vocabularies (Llama-3, Qwen2.5,
#   Gemma) and long sequences. `"fused"` (Liger Kernel, where liger-kernel is installed) saves a
#   little more at no speed cost.
# - **`offload_activations=True`** keeps what the forward pass saves for backward in pinned CPU RAM
#   instead of on the GPU, copied over PCIe each step. It replaces gradient checkpointing (which
#   already keeps one hidden state per layer): with checkpointing on it saves almost nothing.
#
# The current plan with each of them, against `DEVICE`:

# %%
panel.reducers()

# %% [markdown]
# ## 3. Load the base model in 4 bits
# Checked before any weight is read (model exists, bitsandbytes works, it fits, RAM suffices).

# %%
from helpers import load

model, tokenizer, report = load(plan.load_plan())
report

# %% [markdown]
# ## 4. Answers before training
# Held-out prompts: file names, columns and values the training set never shows.

# %%
from helpers import answer, load_instructions

heldout = [row["instruction"] for row in load_instructions(heldout=True)]
before = answer(model, tokenizer, heldout, max_new_tokens=MAX_NEW_TOKENS, stream=True)  # the first one as it comes

# %% [markdown]
# ## 5. Prepare QLoRA
# `prepare_model_for_kbit_training` (norms in fp32, input gradients), non-reentrant gradient
# checkpointing, LoRA on every linear layer but the output layer. Run again, this cell returns the
# prepared model as is (adapters and their weights kept); other LoRA settings need the base loaded
# again (step 3), and it says so.

# %%
from helpers import prepare_qlora

model, trainable = prepare_qlora(model, plan)
print(trainable)

# %% [markdown]
# ## 6. Find the micro-batch
# A real forward + backward at the plan's sequence length, growing the batch until it runs out of
# memory (caught, the memory given back) or reaches the panel's micro-batch (the effective batch
# when "auto"). That cap, when it runs, is used whole; after an OOM, 90 % of the largest that ran.
# Either is rounded down to a divisor of the effective batch; gradient accumulation makes up the rest.

# %%
from helpers import find_micro_batch

micro = find_micro_batch(model, plan)
plan = plan.replace(micro_batch=micro.micro_batch)
micro

# %% [markdown]
# ## 7. Train, with memory watched
# While it trains, one output updates in place: step/total, ETA, loss, tokens/s and GPU memory
# against the card (text lines when run headless); afterwards one line says the peak reserved, its
# share of the card and the wall time (`result.progress`). `MemoryMonitor` samples GPU
# allocated/reserved, the driver's view and RAM twice a second in a thread and warns (naming the largest tensors) past 90 % of the card. `MemoryCallback` adds
# allocated, reserved, peak since the last log and RAM to every log line and says so if memory
# keeps growing between logs (a leak). Checkpoints every `SAVE_STEPS` steps hold the adapter,
# optimizer, scheduler and RNG state: **if the runtime disconnects, rerun the notebook** and this
# cell continues from the last checkpoint at the right step (a finished run is not trained again:
# its adapter is loaded; other data or settings than the checkpoint's are named in a warning). With
# `FRESH = True` it starts over and moves the old checkpoints aside (`previous-checkpoint-N`, kept);
# saving the new adapter keeps a different earlier one as `adapter.<time>.previous`.

# %%
from helpers import MemoryCallback, MemoryMonitor, build_dataset, train

data = build_dataset(tokenizer, load_instructions(DATA), plan.seq_len, packing=plan.packing)
with MemoryMonitor(interval=0.5) as monitor:
    callback = MemoryCallback(monitor)
    result = train(model, tokenizer, plan, data, callbacks=[callback], resume=not FRESH)
print(result)
print(callback.leaks or "no steady memory growth between log steps")

# %% [markdown]
# ## 8. The memory timeline
# Peaks are annotated; dotted lines are the marks (train start, checkpoints, end). The CSV keeps the
# samples for later.

# %%
monitor.to_csv(result.output_dir / "memory.csv")
monitor

# %%
monitor.plot(f"QLoRA on {MODEL}")

# %% [markdown]
# ## 9. Save the adapter (only the adapter)
# Megabytes, not the 13 GiB base: keep it on Drive, share it, load it on the base model.

# %%
from helpers import save_adapter

adapter = save_adapter(model, result.output_dir / "adapter", tokenizer)
print(adapter)

# %% [markdown]
# ## 10. Before and after

# %%
from helpers import side_by_side

after = answer(model, tokenizer, heldout, max_new_tokens=MAX_NEW_TOKENS)
side_by_side(before, after, heldout)  # a row per prompt: its answer before training and after

# %% [markdown]
# ## 11. Reload the adapter on a fresh base
# Free the training model first (two 7B models do not belong on a T4 at once), then load the base
# again with `adapter=`: the answers match the trained model's (on a GPU the trained copy kept norms
# and embeddings in fp32 and the reload has them in fp16, so a late token of a long answer may differ).

# %%
from helpers import unload

unload(model)
model, tokenizer, report = load(plan.load_plan(adapter=str(adapter.path)))
reloaded = answer(model, tokenizer, heldout[:2], max_new_tokens=MAX_NEW_TOKENS)
print("reloaded adapter gives the same answers:", reloaded == after[:2])

# %% [markdown]
# Optional: merge the adapter into the weights (no peft at inference). With a 4-bit base the merged
# weights are quantized again, which rounds them; for an exact merge load the base in fp16 first.

# %%
if MERGE:
    from helpers import merge_adapter

    model = merge_adapter(model)

# %% [markdown]
# ## 12. Clean up, and prove the memory came back

# %%
loaded = snapshot()
freed = unload(model)
after_cleanup = snapshot()
print(freed)
from helpers import format_bytes

if after_cleanup.gpu is not None:
    print(f"GPU allocated: {format_bytes(loaded.gpu.allocated)} -> {format_bytes(after_cleanup.gpu.allocated)} "
          f"(before loading: {format_bytes(start.gpu.allocated)})")
after_cleanup
