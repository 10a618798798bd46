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
# # 00 · Preflight: will it fit?
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/oomkit/oomkit/blob/main/notebooks/00_preflight.ipynb)

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
# auto, fp16, bf16, fp32, int8, nf4, fp4
LOAD = "auto"  # @param {type:"string"}
MAX_NEW_TOKENS = 256  # @param {type:"integer"}

# %% [markdown]
# Run this **before loading anything**. It checks the GPU, package versions, free GPU memory,
# system RAM, disk space, and whether the model you name will fit, and gives the fix for every
# problem it finds. Nothing is downloaded except (for a hub id) the model's small `config.json`.

# %%
# %load_ext helpers
from IPython.display import display

from helpers import preflight, snapshot

report = preflight(MODEL, load=LOAD, max_new_tokens=MAX_NEW_TOKENS,
                   show=True, calibrate=True)  # each check as it finishes; calibrate: time estimates use this machine
if not report.ok:  # nothing below loads or downloads weights: the estimates and the fits table still run
    print("FAIL above: its fix is on its line. The plans below need neither a GPU nor a download, so they run.")

# %% [markdown]
# Each line is **pass**, **info**, **WARN** or **FAIL**, with the fix. A FAIL means loading as
# planned would crash (for example the kernel dying because a weight file is larger than free RAM);
# a WARN means it will work but slowly or tightly.
#
# ## Reading the memory figures
#
# - **allocated**: bytes held by live tensors.
# - **reserved**: what PyTorch's caching allocator holds from the driver. Freed tensors return
#   their blocks to this cache, not to the GPU; `reserved - allocated` is cache or fragmentation.
#   `cleanup()` gives it back.
# - **outside PyTorch** (the "non-PyTorch memory" of OOM messages): CUDA context, cuBLAS workspace,
#   and memory of *other processes*: a previous kernel that still holds the GPU shows up here.
#   Only restarting that runtime frees it.
# - **RAM**: loading streams weight files through system RAM. On Colab (12.7 GB) a file bigger than
#   free RAM kills the kernel without an error message.

# %%
snap = snapshot()
snap

# %% [markdown]
# ## How much memory will it need?
#
# The estimate behind the **fit** line: exact weight bytes for the load mode (counted layer by
# layer, including bitsandbytes' quantization state), then the KV cache, activations and overheads.
# Each row says whether it is exact, a formula or a rule of thumb; the fixes are re-estimates.

# %%
from helpers import estimate, fit, no_config_help

fit_line = next((c for c in report.checks if c.name == "fit"), None)
if fit_line is None:  # offline, and this hub id's config.json does not ship with oomkit: nothing to estimate from
    print(no_config_help(MODEL))
else:
    est = estimate(MODEL, load=fit_line.data.get("load", "nf4"), max_new_tokens=MAX_NEW_TOKENS)
    display(est)
    display(fit(est, "current" if snap.gpu else "t4"))  # no GPU here: judged against a Colab T4

# %% [markdown]
# ## What fits where
# Every load mode of this model: weights, KV cache at 512 prompt tokens plus `MAX_NEW_TOKENS`, the
# total, and whether it fits a T4, Kaggle's 2×T4, an L4, an A100 40/80 GB and this GPU (estimated;
# `python -m helpers fits MODEL` prints the same table in a terminal).

# %%
from helpers import fits_table

if fit_line is not None:  # the same config the estimate read
    display(fits_table(MODEL, tokens=512 + MAX_NEW_TOKENS))

# %% [markdown]
# The same report as text, to paste into a bug report or a forum question:

# %%
print(report)
