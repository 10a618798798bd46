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
# # 05 · More than one GPU: Kaggle's 2×T4, device maps, CPU offload and DDP QLoRA

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
# > 1. Kaggle: *Accelerator > GPU T4 x2* (Colab's one T4 works too: the split is planned for two)
# > 2. Set **`MODEL`** in the form below: a hub id or a local folder with `config.json`
# > 3. **Run all**

# %% tags=["parameters"]
# the model to load and fine-tune (hub id or local path)
MODEL = "codellama/CodeLlama-7b-Instruct-hf"  # @param {type:"string"}
# nf4 (QLoRA), int8, fp16
LOAD = "nf4"  # @param {type:"string"}
# what to plan for: "current" (this machine), "kaggle-2xt4", ["t4", "t4"], {0: bytes, ...}
DEVICES = "kaggle-2xt4"  # @param {type:"raw"}
# the 13B-class model planned in section 3 (planning only: nothing is downloaded)
BIG_MODEL = "Llama-2-13b"  # @param {type:"string"}
# RAM offered to offloaded layers (Kaggle: ~29 GiB; Colab free: ~12 GiB)
CPU_RAM = 29 * 2**30  # @param {type:"raw"}
# without a GPU: bytes of each pretend GPU for section 5 (None: 90 % of the weights + 1 GiB)
FAKE_GPU_BYTES = None  # @param {type:"raw"}
# one per GPU (on a CPU: processes joined by gloo)
DDP_PROCESSES = 2  # @param {type:"integer"}
DDP_STEPS = 30  # @param {type:"integer"}
SEQ_LEN = 256  # @param {type:"integer"}
LEARNING_RATE = 2e-4  # @param {type:"number"}
OUTPUT_DIR = "runs/05_multi_gpu"  # @param {type:"string"}

# %% [markdown]
# When a model does not fit one T4, the next step is more cards: Kaggle gives two T4s free. This
# notebook plans a model across them **before** loading anything (the device map transformers
# will compute, each card's share of weights, KV cache and activations, what offload would cost),
# loads with that plan, then fine-tunes with QLoRA on both cards with PyTorch DDP through
# accelerate's launcher, memory reported per rank.
#
# Two different things "two GPUs" can mean: **splitting one model** (inference: layers 0-19 on GPU
# 0, the rest on GPU 1; one card works at a time, so it holds a bigger model but is not faster) and
# **data parallelism** (training: each card holds a whole copy and trains on its own batches;
# ZeRO/FSDP shard the copies). Sections 2-5 are the first, 6-7 the second.
#
# Steps: preflight -> what fits where -> a 13B-class plan on 2×T4 -> training memory per strategy ->
# plan your model -> load with the plan -> DDP QLoRA on every GPU -> cleanup.

# %% [markdown]
# ## 1. Preflight of every card
# On Kaggle pick *Accelerator: GPU T4 x2*. Each GPU is listed with its capacity; the preflight
# checks versions, bitsandbytes, each card's free memory and whether the model fits one card or,
# split as `load()` splits it, both.

# %%
# %load_ext helpers
from helpers import format_bytes, preflight
from helpers.core.devices import resolve_devices

gpus = resolve_devices("current")
for label, dev in gpus:
    print(f"GPU {label}: {format_bytes(dev['capacity'])}, bf16 {'yes' if dev['bf16'] else 'no'}")
if not gpus:
    print("no GPU here: every plan below is for the devices named, on the meta device (nothing is loaded)")
report = preflight(MODEL, load=LOAD, max_new_tokens=64,
                   show=True, calibrate=True)  # each check as it finishes; calibrate: time estimates use this machine
if not report.ok:  # sections 2-5 plan on the meta device: they run; section 6 loads, and stops first
    print("FAIL above: its fix is on its line. Sections 2-5 plan without a GPU or a download, so they run; "
          "section 6 stops before loading.")

# %% [markdown]
# ## 2. What fits where
# Llama 2 at 7B, 13B and 70B in each load mode on a T4, Kaggle's two T4s, an L4 and an A100,
# generating 512 + 256 tokens. Each cell is a full placement plan (section 3 shows one); the
# percentage is the fullest GPU's share of its memory. No offload: offloaded layers cross PCIe on
# every token (section 3, last plan).

# %%
from helpers import fits_table

fits_table()

# %% [markdown]
# ## 3. A 13B-class model on two T4s
# fp16 weights of a 13B model are 24 GiB: no single T4 holds them, two do. The plan is the device
# map `from_pretrained(device_map="auto")` will compute (accelerate's placement, the model's
# no-split decoder layers, bitsandbytes' 10 % margin), with each card's share of the weights, of
# the KV cache (by the layers placed there) and of the activations.

# %%
from helpers import estimate, fit, plan_devices
from helpers.placement.device_plan import reference_configs

big = reference_configs()[BIG_MODEL]
fit(estimate(big, load="fp16", device="t4"), DEVICES)  # not on GPU 0 alone: the fixes, both GPUs among them

# %% [markdown]
# `fit()` ranks the ways out: a smaller load mode, a shorter generation, and past one card the split over
# Kaggle's two T4s (or layers offloaded to CPU RAM, with their cost per token). The split it proposes is
# this plan:

# %%
plan_devices(big, load="fp16", devices=DEVICES)

# %% [markdown]
# In 4 bits the same model fits one T4; across two it leaves each card most of its memory for
# longer prompts and bigger batches:

# %%
plan_devices(big, load="nf4", devices=DEVICES)

# %% [markdown]
# The other `device_map` strings place differently, and `load()` checks the placement each one asks
# for. A 4-bit 13B fits one T4, so `"sequential"` (fill GPU 0, then GPU 1) keeps it all on GPU 0, and
# `"balanced_low_0"` (GPU 0 gets only what GPU 1 cannot hold) all on GPU 1, GPU 0 staying free for
# `generate`'s work. `"balanced"` is `"auto"`.

# %%
for strategy in ("sequential", "balanced_low_0"):
    print(plan_devices(big, load="nf4", devices=DEVICES, strategy=strategy).summary)

# %% [markdown]
# And on **one** T4 in fp16 with CPU offload: it fits, at the price stated (every token copies the
# offloaded layers over PCIe). int8 and 4-bit offload need `llm_int8_enable_fp32_cpu_offload`, and
# 4-bit layers cannot go to disk: the plan refuses what transformers or bitsandbytes would refuse.

# %%
plan_devices(big, load="fp16", devices=["t4"], cpu_offload=True, cpu_memory=CPU_RAM)

# %% [markdown]
# ## 4. Training memory per strategy
# Full fine-tuning keeps 16 bytes per parameter (16-bit weights and gradients, fp32 Adam states):
# DDP copies all of it to every card, ZeRO-2 shards gradients and optimizer states, ZeRO-3/FSDP
# shard the weights too. QLoRA trains only adapters on a frozen 4-bit base, which DDP replicates.

# %%
from helpers import training_memory

for strategy in ("ddp", "zero2", "zero3"):
    print(training_memory(big, strategy=strategy, world_size=2, device="t4"), end="\n\n")
training_memory(big, strategy="ddp", world_size=2, qlora=True, seq_len=SEQ_LEN, device="t4")

# %% [markdown]
# ## 5. Plan the model you load
# On a machine with GPUs this plans across them; without one, across pretend GPUs sized so the
# model must be split (the same placement code, fed fake capacities through `max_memory`).

# %%
from helpers import GiB, estimate

if gpus:
    plan = plan_devices(MODEL, load=LOAD, devices="current")
else:
    weights = estimate(MODEL, load=LOAD, compute_dtype="fp16").weights
    fake = FAKE_GPU_BYTES or int(weights * 0.9) + GiB  # 1 GiB kept free on each for the runtime
    plan = plan_devices(MODEL, load=LOAD, devices=[fake, fake], headroom=GiB, compute_dtype="fp16")
plan

# %% [markdown]
# ## 6. Load across the GPUs
# `load()` plans the split itself, for what each card has free right now, and checks every card's
# share (weights, its layers' KV cache, activations, context) before reading a weight. A model that
# fits GPU 0 stays there, leaving the other card free; one that does not is split, or refused with
# the fix when even the cards together cannot hold it. `gpus=` asks for a split anyway (here: every
# GPU, to show one). The report shows each card's planned share beside what landed there.
# Without a GPU the section-5 split is loaded with every part on the CPU.

# %%
from helpers import LoadPlan, load

report.raise_for_failures()  # "Run all" stops here (a 7B on a CPU runtime: before any download), with the fix
if gpus:
    model, tokenizer, report = load(LoadPlan(MODEL, load=LOAD, gpus=len(gpus)))
else:
    model, tokenizer, report = load(LoadPlan(MODEL, load=LOAD, device_map=plan.cpu_device_map()))
report

# %% [markdown]
# Generate on the split model with a `MemoryMonitor` watching every card: each GPU gets its own
# lines and its own 90 % warning, which names the card (a split can fill GPU 1 while GPU 0 has
# room; an OOM there is explained that way too). Without a GPU it draws the process's RAM.

# %%
from helpers import MemoryMonitor, generate_batched

with MemoryMonitor(interval=0.05) as monitor:
    monitor.mark("generate")
    texts = generate_batched(model, tokenizer, ["def fibonacci(n):"] * 4, max_new_tokens=32, batch_size=4)
print(monitor)
monitor.plot(title="generation on the split model")

# %%
from helpers import free

free("model")  # the training below loads its own copy in every process

# %% [markdown]
# ## 7. QLoRA with DDP on every GPU
# Each process loads the 4-bit model on its own GPU, trains the LoRA adapters on its shard of the
# data, and DDP averages the gradients, so the adapters stay identical on every rank. From a
# notebook, accelerate's `notebook_launcher` forks one process per GPU, which works only before
# this kernel touches CUDA; after sections 1-6 `launch` runs `torchrun` instead, whose processes
# import the function they run by name: it must live in a module (as `ddp_qlora_worker` does), not
# in a notebook cell. Without a GPU the processes are joined by gloo on the CPU: the same DDP path,
# at CPU speed.

# %%
import torch

from helpers.training.distributed import run_ddp_qlora

n = min(DDP_PROCESSES, torch.cuda.device_count()) if gpus else DDP_PROCESSES
run = run_ddp_qlora(MODEL, OUTPUT_DIR, num_processes=n, steps=DDP_STEPS, seq_len=SEQ_LEN, learning_rate=LEARNING_RATE)
run

# %% [markdown]
# ### The same run from an accelerate config
# Outside a notebook (a script, a Kaggle "Save & Run", several machines) the run goes through
# `accelerate launch`. `write_launch_config` writes the config that realises a `TrainPlan` on these
# GPUs (DDP here; FSDP or DeepSpeed ZeRO-2/3 with its JSON by `strategy=`), with the memory per GPU
# and the host RAM every process needs while it loads (each rank loads its own copy);
# `launch_qlora` launches the same DDP QLoRA worker through it and collects the ranks' reports.
# Without a GPU the config asks for CPU processes joined by gloo.

# %%
from helpers import TrainPlan, launch_qlora, write_launch_config

train_plan = TrainPlan(MODEL, load=LOAD, batch_size=2 * n, micro_batch=2, seq_len=SEQ_LEN)
config = write_launch_config(train_plan, f"{OUTPUT_DIR}/launch", devices=n if not gpus else "current", strategy="ddp")
print(config)
launched = launch_qlora(config, MODEL, f"{OUTPUT_DIR}/accelerate", steps=DDP_STEPS, seq_len=SEQ_LEN,
                        learning_rate=LEARNING_RATE, load=LOAD)
launched

# %% [markdown]
# ## 8. Cleanup

# %%
from helpers import cleanup

cleanup()
