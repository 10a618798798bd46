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
# # 06 · QLoRA on Whisper (speech to text) that fits a T4
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/oomkit/oomkit/blob/main/notebooks/06_family_finetune.ipynb)

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
# hub id or local path of a Whisper checkpoint
MODEL = "openai/whisper-small"  # @param {type:"string"}
# nf4 for QLoRA (the encoder stays 16-bit); fp16/bf16 for plain LoRA
LOAD = "nf4"  # @param {type:"string"}
# transcript tokens per example (the audio is always 30 s of mel frames)
SEQ_LEN = 64  # @param {type:"integer"}
# effective batch: micro-batch x gradient accumulation
BATCH_SIZE = 16  # @param {type:"integer"}
# None: measured, up to BATCH_SIZE; or the most to try (a divisor of BATCH_SIZE)
MICRO_BATCH = None  # @param {type:"raw"}
# LoRA rank and scale
R = 16  # @param {type:"integer"}
ALPHA = 32  # @param {type:"integer"}
MAX_STEPS = 60  # @param {type:"integer"}
# a disconnect loses at most this many steps
SAVE_STEPS = 10  # @param {type:"integer"}
LEARNING_RATE = 1e-4  # @param {type:"number"}
# None: spoken-pitch toy data made here (no download); or a hub dataset with "audio" and "text" columns
DATASET = None  # @param {type:"raw"}
# "auto": Google Drive when mounted in Colab, else runs/lora-<model>
OUTPUT_DIR = "auto"  # @param {type:"string"}
# Colab: keep checkpoints on Drive so they survive a disconnect
MOUNT_DRIVE = True  # @param {type:"boolean"}
# True: start over instead of resuming (old checkpoints are renamed previous-checkpoint-N, kept)
FRESH = False  # @param {type:"boolean"}
# what to plan for: a preset ("t4", "a100-40"), or "current"
DEVICE = "t4"  # @param {type:"string"}
MAX_NEW_TOKENS = 32  # @param {type:"integer"}

# %% [markdown]
# Notebook 02 fine-tunes a decoder-only LM; this one does the same for an encoder-decoder that
# listens. Whisper's audio encoder stays frozen and in 16 bits (quantizing it costs transcripts more
# than it saves), the decoder is loaded in 4 bits and LoRA adapts it. Each example is 30 s of mel
# frames (whatever the clip's length) and its transcript; `safe_generate` transcribes held-out clips
# before and after training, each result on disk as it comes, so an OOM or a disconnect loses nothing.
#
# Steps: preflight -> plan and estimate (the audio encoder's rows) -> load -> data -> transcripts
# before -> prepare QLoRA -> measure the micro-batch -> train (resumable) -> transcripts after ->
# save the adapter -> cleanup.

# %% [markdown]
# ## 1. Preflight

# %%
# %load_ext helpers
from helpers import mount_drive, preflight, snapshot

start = snapshot()
report = preflight(MODEL, load=LOAD, max_new_tokens=MAX_NEW_TOKENS,
                   show=True, calibrate=True)  # each check as it finishes; calibrate: time estimates use this machine
report.raise_for_failures()  # "Run all" stops here when this model cannot run on this runtime, with the fix
if MOUNT_DRIVE:
    print(mount_drive())

# %% [markdown]
# ## 2. Plan and estimate
# The estimate has Whisper's own rows: the audio encoder's 16-bit weights and its activations over
# the padded 30 s window (1500 frames after the convolutions, however short the clip), then the
# decoder's over `SEQ_LEN` transcript tokens with cross-attention to those frames.

# %%
from helpers import TrainPlan

plan = TrainPlan(MODEL, load=LOAD, r=R, alpha=ALPHA, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, micro_batch=MICRO_BATCH,
                 max_steps=MAX_STEPS, save_steps=SAVE_STEPS, logging_steps=max(1, MAX_STEPS // 10),
                 warmup_steps=MAX_STEPS // 10, learning_rate=LEARNING_RATE, output_dir=OUTPUT_DIR)
print(plan)
plan.estimate(DEVICE)

# %% [markdown]
# ## 3. Load: the decoder in 4 bits, the audio encoder in 16
# `load` picks `AutoModelForSpeechSeq2Seq` from the config; `load_processor` gives the feature
# extractor (audio -> mel frames) and the tokenizer.

# %%
from helpers import load, load_processor

model, _, load_report = load(plan.load_plan())
processor = load_processor(MODEL)
load_report

# %% [markdown]
# ## 4. Data
# Rows are `{"audio": samples at 16 kHz, "text": transcript}`. Without a dataset: tones whose pitch
# names a word, a toy task any Whisper can learn in a few steps (and no download). Held-out clips are
# the same words at another loudness and phase.

# %%
import numpy as np

RATE = processor.feature_extractor.sampling_rate
WORDS = {"low": 220.0, "middle": 440.0, "high": 880.0, "very high": 1760.0}


def tone(hz: float, seconds: float = 1.0, loudness: float = 0.5, phase: float = 0.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (loudness * np.sin(2 * np.pi * hz * t + phase)).astype(np.float32)


if DATASET is None:
    rows = [{"audio": tone(hz, 0.5 + 0.25 * k, 0.3 + 0.1 * k), "text": word} for k in range(4) for word, hz in WORDS.items()]
    heldout = [{"id": word, "audio": tone(hz, 0.8, 0.45, phase=1.0), "reference": word} for word, hz in WORDS.items()]
else:  # a hub dataset with "audio" and "text" columns, resampled to the extractor's rate
    from datasets import Audio, load_dataset

    ds = load_dataset(DATASET, split="train").cast_column("audio", Audio(sampling_rate=RATE))
    rows = [{"audio": r["audio"]["array"], "text": r["text"]} for r in ds.select(range(min(len(ds) - 8, 2000)))]
    heldout = [{"id": str(i), "audio": ds[i]["audio"]["array"], "reference": ds[i]["text"]}
               for i in range(len(ds) - 8, len(ds))]  # fmt: skip
print(f"{len(rows)} training clips, {len(heldout)} held out")

# %% [markdown]
# ## 5. Transcripts before training
# `safe_generate` takes the processor and audio prompts: each clip's mel frames are computed once, its
# result goes to the JSONL file as soon as its batch ends (the recorded prompt names a hash of the
# audio, so a resume never mixes up clips), and a batch that runs out of memory is retried smaller.
# Rerun after a disconnect, it skips the clips already transcribed (`FRESH = True` starts the files over).

# %%
from helpers import safe_generate

out = plan.resolved_output_dir()
out.mkdir(parents=True, exist_ok=True)
before = safe_generate(model, processor, heldout, max_new_tokens=MAX_NEW_TOKENS, results=out / "before.jsonl",
                       resume=not FRESH, score="contains", progress=False)  # fmt: skip
before

# %% [markdown]
# ## 6. Prepare QLoRA
# LoRA goes on the decoder's linear layers only: the audio encoder is frozen (no adapters) and stays
# in 16 bits, as loaded.

# %%
from helpers import prepare_qlora

model, trainable = prepare_qlora(model, plan)
print(trainable)

# %% [markdown]
# ## 7. Find the micro-batch
# Real forward + backward passes on full 30 s windows and `SEQ_LEN`-token transcripts, growing the
# batch until it runs out of memory (caught) or reaches `MICRO_BATCH` (the effective batch when None).

# %%
from helpers import find_micro_batch

micro = find_micro_batch(model, plan)
plan = plan.replace(micro_batch=micro.micro_batch)
micro

# %% [markdown]
# ## 8. Train
# `build_family_dataset` turns rows into mel frames + transcript labels; the collator pads the labels
# (-100) and stacks the frames. Checkpoints every `SAVE_STEPS` steps: **after a disconnect, rerun the
# notebook** and training continues from the last one.

# %%
from helpers import build_family_dataset, train

data = build_family_dataset(model, processor, rows, plan.seq_len)
result = train(model, processor, plan, data, resume=not FRESH)
print(result)

# %% [markdown]
# ## 9. Transcripts after training

# %%
after = safe_generate(model, processor, heldout, max_new_tokens=MAX_NEW_TOKENS, results=out / "after.jsonl",
                      resume=not FRESH, score="contains", progress=False)  # fmt: skip
from helpers import side_by_side

print(f"contains the word: {before.scores} before, {after.scores} after")
side_by_side(before, after)  # a row per clip: its reference, the transcript before training and after

# %% [markdown]
# ## 10. Save the adapter, clean up

# %%
from helpers import format_bytes, save_adapter, unload

adapter = save_adapter(model, result.output_dir / "adapter", processor.tokenizer)
print(adapter)
loaded = snapshot()
print(unload(model))
after_cleanup = snapshot()
print(f"process RAM: {format_bytes(loaded.ram.process_rss)} -> {format_bytes(after_cleanup.ram.process_rss)}")
