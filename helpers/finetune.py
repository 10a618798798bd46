"""QLoRA fine-tuning that fits the GPU: plan, prepare, pick the micro-batch, train, resume, save.

A :class:`TrainPlan` holds every choice that decides memory and resumability (load mode, LoRA
rank, sequence length, effective batch = micro-batch x gradient accumulation, optimizer, precision,
checkpoints). ``plan.estimate()`` is the estimator's training budget for it; :func:`find_micro_batch`
measures the largest micro-batch that runs a real training step and keeps the effective batch by
accumulating gradients. :func:`train` runs transformers' ``Trainer`` and continues from the newest
complete checkpoint in ``plan.output_dir`` when there is one (a Colab disconnect costs at most
``save_steps`` steps; one that cut a save short costs one checkpoint more, see
:mod:`helpers.checkpoints`). :func:`save_adapter` writes only the LoRA weights.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import difflib
import filecmp
import hashlib
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .arguments import flag, number, whole_number
from .attention import keep_attention_fused
from .batch_size import find_max_batch_size
from .checkpoint_proof import prove
from .checkpoints import (
    WHY,
    CheckpointError,
    CheckpointWarning,
    ResumePoint,
    Skipped,
    complete_marker,
    find_resume,
    newest_complete,
    read_stamp,
    set_aside,
    set_aside_all,
)
from .devices import cuda_capability
from .errors import OomkitError
from .estimator import OPTIMIZERS, EstimateRow, LoraTraining, estimate
from .generation import generate_batched
from .loading import LoadPlan, keep_4bit_layout
from .reducers import chunked_lm_loss, liger_available, offload_activations
from .sources import data_path, persistent_path
from .train_view import TrainProgress
from .units import format_bytes
from .vocab import LOAD_MODES, QUANTIZED, DtypeError, ReducerError, dtype_name, loss_name, supports_bf16

__all__ = [
    "TrainPlan", "TrainableParams", "MicroBatch", "TrainResult", "AdapterReport", "prepare_qlora",
    "target_modules", "load_instructions", "prompt_text", "answer", "format_example", "build_dataset", "TrainingData", "DatasetWarning", "collate", "find_micro_batch",
    "make_trainer", "train", "last_checkpoint", "save_adapter", "merge_adapter", "CheckpointError",
    "CheckpointWarning", "FinetuneError", "run_stamp", "stamp_changes", "dataset_hash",
]  # fmt: skip

IGNORE = -100  # label value the loss skips
FALLBACK_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"


class FinetuneError(OomkitError, ValueError):
    """A plan, data file or dataset fine-tuning cannot use; the message names the value and what to pass."""


def check_optimizer(name: Any) -> str:
    """``name`` when it is ``"auto"`` or one of transformers' ``optim`` names, else a :class:`FinetuneError` listing them."""
    if name == "auto":
        return name
    from transformers.training_args import OptimizerNames

    valid = [o.value for o in OptimizerNames]
    if isinstance(name, str) and name in valid:
        return name
    common = ("adamw_torch", "paged_adamw_8bit", "adamw_8bit", "adamw_torch_fused", "adafactor", "sgd")
    text = str(name).strip().lower()
    near = [c for c in common if text and text in c][:3] or difflib.get_close_matches(text, valid, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
    raise FinetuneError(
        f"TrainPlan.optimizer {name!r} is not an optimizer transformers knows{hint}; use 'auto' "
        f"(paged 8-bit AdamW on a GPU, torch AdamW on a CPU) or one of: {', '.join(valid)}"
    )


@dataclass
class TrainPlan:
    """Everything a QLoRA run needs to fit and to resume.

    Args:
        model: hub id or local folder of the base model.
        load: ``nf4`` (QLoRA, default), ``fp4``, ``int8``, or ``fp16``/``bf16``/``fp32`` for plain LoRA.
        r, alpha, dropout: LoRA rank, scale and dropout.
        targets: ``"all-linear"`` (every linear layer but the output layer, resolved per architecture
            by :func:`target_modules`) or a list of module names such as ``["q_proj", "v_proj"]``.
        seq_len: tokens per example (longer ones are truncated).
        packing: concatenate examples into full ``seq_len`` blocks (see :func:`build_dataset`); off by default.
        batch_size: the effective batch (examples per optimizer step) = micro-batch x accumulation.
        micro_batch: examples per forward pass; ``None`` until :func:`find_micro_batch` measures it.
        optimizer: ``"auto"`` = paged 8-bit AdamW on CUDA, torch AdamW on a CPU; or a Trainer ``optim`` name.
        gradient_checkpointing: recompute activations in backward (non-reentrant variant).
        precision: ``"auto"`` = bf16 on Ampere and newer, fp16 on a T4/V100, fp32 on a CPU.
        max_steps, epochs: train for ``max_steps`` optimizer steps, or ``epochs`` when max_steps is 0.
        learning_rate, warmup_steps, seed: as in ``TrainingArguments``.
        output_dir: checkpoints; ``"auto"`` = Google Drive on Colab when mounted (survives a
            disconnect), else ``runs/lora-<model name>``.
        save_steps, save_total_limit, logging_steps: checkpoint every N steps, keep the last K, log every M.
        loss: ``"plain"``; ``"chunked"`` (the output layer and loss a chunk of tokens at a time, plain
            PyTorch, any device) or ``"fused"`` (Liger Kernel's fused linear cross-entropy, through
            ``TrainingArguments(use_liger_kernel=True)``; needs liger-kernel and a CUDA GPU). Same loss,
            a fraction of the logits' memory: see ``plan.estimate()``.
        offload_activations: what the forward pass saves for backward waits in pinned RAM (host RAM
            and PCIe time instead of GPU memory; useful without gradient checkpointing).
    """

    model: str
    load: str = "nf4"
    double_quant: bool = True
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    targets: str | list[str] = "all-linear"
    seq_len: int = 512
    packing: bool = False
    batch_size: int = 16
    micro_batch: int | None = None
    optimizer: str = "auto"
    gradient_checkpointing: bool = True
    precision: str = "auto"
    max_steps: int = 100
    epochs: float = 1.0
    learning_rate: float = 2e-4
    warmup_steps: int = 5
    seed: int = 42
    output_dir: str = "auto"
    save_steps: int = 25
    save_total_limit: int = 2
    logging_steps: int = 5
    loss: str = "plain"
    offload_activations: bool = False

    def __post_init__(self):
        if not isinstance(self.model, str | os.PathLike) or not str(self.model).strip():
            raise FinetuneError(f"TrainPlan.model must be a hub id or a local folder, got {self.model!r}")
        self.model = str(self.model)
        if self.load not in LOAD_MODES:
            raise FinetuneError(f"unknown load mode {self.load!r}; use nf4 (QLoRA), fp4, int8, or fp16/bf16/fp32")
        if isinstance(self.targets, str) and self.targets not in ("all-linear", ""):
            self.targets = [self.targets]  # one module name; list("q_proj") would be its letters
        self._check_numbers()
        if not isinstance(self.output_dir, str | os.PathLike) or not str(self.output_dir).strip():
            raise FinetuneError(f"TrainPlan.output_dir must be a folder path or 'auto', got {self.output_dir!r}")
        if (
            self.output_dir != "auto"
            and Path(self.output_dir).expanduser().exists()
            and not Path(self.output_dir).expanduser().is_dir()
        ):
            raise FinetuneError(
                f"output_dir {self.output_dir} is a file, not a folder: checkpoints need a folder; "
                "pass a folder path (it is created) or 'auto'"
            )
        if self.micro_batch is not None and not 1 <= self.micro_batch <= self.batch_size:
            raise FinetuneError(
                f"micro_batch must be between 1 and batch_size ({self.batch_size}), got {self.micro_batch}"
            )
        if self.micro_batch is not None and self.batch_size % self.micro_batch:
            fits = [d for d in range(1, self.micro_batch) if self.batch_size % d == 0]
            raise FinetuneError(
                f"micro_batch {self.micro_batch} does not divide batch_size {self.batch_size}, so "
                f"accumulation cannot keep the effective batch; use micro_batch={fits[-1]}"
            )
        try:
            self.precision = dtype_name(self.precision)
        except DtypeError as e:
            raise FinetuneError(f"TrainPlan.precision: {e}") from None
        self.optimizer = check_optimizer(self.optimizer)
        try:
            self.loss = loss_name(self.loss)
        except ReducerError as e:
            raise FinetuneError(f"TrainPlan.loss: {e}") from None
        if not isinstance(self.offload_activations, bool):
            raise FinetuneError(
                f"TrainPlan.offload_activations must be True or False, got {self.offload_activations!r}"
            )
        if self.max_steps < 0 or (self.max_steps == 0 and self.epochs <= 0):
            raise FinetuneError("give max_steps > 0, or max_steps=0 and epochs > 0")

    def _check_numbers(self) -> None:
        for name in ("r", "seq_len", "batch_size", "save_steps", "logging_steps"):
            whole_number(f"TrainPlan.{name}", getattr(self, name), error=FinetuneError)
        for name in ("micro_batch", "max_steps", "save_total_limit", "warmup_steps", "seed"):
            whole_number(f"TrainPlan.{name}", getattr(self, name), minimum=0, none_ok=name == "micro_batch",
                         error=FinetuneError)  # fmt: skip
        for name in ("double_quant", "packing", "gradient_checkpointing"):
            flag(f"TrainPlan.{name}", getattr(self, name), error=FinetuneError)
        number("TrainPlan.alpha", self.alpha, low=0, low_open=True, error=FinetuneError)
        targets = self.targets
        if targets != "all-linear" and (
            not isinstance(targets, list | tuple) or not targets or not all(isinstance(t, str) and t for t in targets)
        ):
            raise FinetuneError(
                f"TrainPlan.targets must be 'all-linear' or a list of module names such as ['q_proj', 'v_proj'], "
                f"got {targets!r}"
            )
        for name in ("epochs", "learning_rate", "dropout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise FinetuneError(f"TrainPlan.{name} must be a number, got {v!r}")
            if not math.isfinite(v):
                raise FinetuneError(f"TrainPlan.{name} must be a finite number, got {v!r}")
        if not 0 <= self.dropout < 1:
            raise FinetuneError(f"TrainPlan.dropout is a probability in [0, 1), got {self.dropout}")
        if self.learning_rate <= 0:
            raise FinetuneError(
                f"TrainPlan.learning_rate must be positive (QLoRA usually 1e-4 to 3e-4), got {self.learning_rate}"
            )

    def replace(self, **changes) -> TrainPlan:
        return dataclasses.replace(self, **changes)

    @property
    def gradient_accumulation(self) -> int:
        """Micro-batches per optimizer step (1 until the micro-batch is known)."""
        return math.ceil(self.batch_size / (self.micro_batch or self.batch_size))

    def resolved_precision(self) -> str:
        if self.precision != "auto":
            return self.precision
        cap = cuda_capability()
        return "fp32" if cap is None else ("bf16" if supports_bf16(cap) else "fp16")

    def resolved_optimizer(self) -> str:
        if self.optimizer != "auto":
            return self.optimizer
        return "paged_adamw_8bit" if torch.cuda.is_available() else "adamw_torch"

    def resolved_output_dir(self) -> Path:
        if self.output_dir != "auto":
            return Path(self.output_dir)
        name = "lora-" + Path(self.model.rstrip("/")).name.replace("/", "--")
        return persistent_path(name, default_dir="runs")  # Drive when mounted in Colab: it survives a reset

    def load_plan(self, **changes):
        """The :class:`helpers.loading.LoadPlan` that loads the base model for this run."""

        prec = self.resolved_precision()
        compute = "auto" if self.load in ("fp16", "bf16", "fp32") else prec
        return LoadPlan(self.model, load=self.load, double_quant=self.double_quant, compute_dtype=compute,
                        batch_size=self.micro_batch or 1, prompt_tokens=self.seq_len, max_new_tokens=0,
                        **changes)  # fmt: skip

    def lora_training(self, gpu: bool | None = None):
        """The estimator's :class:`helpers.estimate.LoraTraining` for this plan (on a GPU when ``gpu``)."""

        opt = "paged_adamw_8bit" if gpu and self.optimizer == "auto" else self.resolved_optimizer()
        return LoraTraining(r=self.r, alpha=self.alpha, targets=self.targets,
                            optimizer=opt if opt in OPTIMIZERS else "adamw_torch",
                            gradient_checkpointing=self.gradient_checkpointing, seq_len=self.seq_len,
                            micro_batch=self.micro_batch or 1, lora_dropout=self.dropout, loss=self.loss,
                            offload_activations=self.offload_activations)  # fmt: skip

    def estimate(self, device: Any = "t4", model: Any = None):
        """The training-step memory budget (weights, adapters, gradients, optimizer, activations, logits).

        Args:
            device: a preset such as ``"t4"`` (default: plan for the free Colab GPU), ``"current"`` or bytes.
            model: what to estimate instead of ``self.model`` (e.g. the loaded model).
        """

        here = device in ("current", "cpu", None)
        prec = self.resolved_precision() if here else ("auto" if self.precision == "auto" else self.precision)
        if device == "current" and not torch.cuda.is_available():
            device = "cpu"
        compute = prec if self.load in QUANTIZED else "auto"
        est = estimate(
            self.model if model is None else model,
            load=self.load,
            double_quant=self.double_quant,
            compute_dtype=compute,
            training=self.lora_training(gpu=device != "cpu"),
            device=device,
        )
        if self.load in QUANTIZED and compute != "fp32":
            # prepare_model_for_kbit_training casts every 16-bit parameter (embeddings, norms, lm_head)
            # to fp32 for training: those weights take twice the room they took after loading
            plain = est.row("weights.unquantized")
            est.rows.insert(
                est.rows.index(plain) + 2,
                EstimateRow(
                    "training.fp32_upcast",
                    "fp32 upcast of unquantized weights",
                    plain.bytes,
                    "exact",
                    "prepare_model_for_kbit_training trains around fp32 norms and embeddings",
                ),
            )
        return est

    def lora_config(self, model: torch.nn.Module | None = None):
        """peft ``LoraConfig``; with ``model``, ``"all-linear"`` becomes the explicit module list."""
        from peft import LoraConfig

        targets = target_modules(model, self.targets) if model is not None else self.targets
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )

    def training_arguments(self, **overrides):
        """``TrainingArguments`` for this plan (checkpoints keep adapter, optimizer, scheduler and RNG)."""
        from transformers import TrainingArguments

        prec = self.resolved_precision()
        kw = dict(
            output_dir=str(self.resolved_output_dir()), per_device_train_batch_size=self.micro_batch or 1,
            gradient_accumulation_steps=self.gradient_accumulation, learning_rate=self.learning_rate,
            max_steps=self.max_steps if self.max_steps > 0 else -1, num_train_epochs=self.epochs,
            warmup_steps=self.warmup_steps, lr_scheduler_type="linear", optim=self.resolved_optimizer(),
            fp16=prec == "fp16", bf16=prec == "bf16", logging_steps=self.logging_steps,
            save_strategy="steps", save_steps=self.save_steps, save_total_limit=self.save_total_limit,
            seed=self.seed, data_seed=self.seed, report_to="none", remove_unused_columns=False,
            dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
            include_num_input_tokens_seen=True,  # tokens/s in the live view (train_view.TrainView)
        )  # fmt: skip
        if self.loss == "fused":
            if not (liger_available() and torch.cuda.is_available()):
                raise FinetuneError(
                    "TrainPlan.loss='fused' runs Liger Kernel's fused cross-entropy, which needs liger-kernel "
                    "(pip install liger-kernel) and a CUDA GPU; use loss='chunked' (same saving, plain PyTorch)"
                )
            kw["use_liger_kernel"] = True
        kw.update(overrides)
        args = TrainingArguments(**kw)
        if args.n_gpu > 1 and hasattr(args, "_n_gpu"):
            # a notebook that sees several cards (Kaggle's 2×T4): Trainer would multiply the batch by the card
            # count and wrap the model in nn.DataParallel, so the measured micro-batch doubles on one card (a
            # quantized model is never wrapped) and a full-precision one is copied onto every card. One process
            # trains on one card, as Trainer itself sets it for a model split over cards; run_ddp_qlora uses all
            args._n_gpu = 1
        return args

    def __str__(self) -> str:
        mb = "? (find_micro_batch)" if self.micro_batch is None else str(self.micro_batch)
        steps = f"{self.max_steps} steps" if self.max_steps else f"{self.epochs:g} epochs"
        return (
            f"TrainPlan({self.model}: {self.load}, LoRA r={self.r} alpha={self.alpha} on {self.targets}, "
            f"seq {self.seq_len}, batch {self.batch_size} = micro {mb} x accumulation "
            f"{self.gradient_accumulation if self.micro_batch else '?'}, {self.resolved_optimizer()}, "
            f"{self.resolved_precision()}, checkpointing {'on' if self.gradient_checkpointing else 'off'}, "
            f"{steps}, save every {self.save_steps} to {self.resolved_output_dir()})"
        )


# -- model ---------------------------------------------------------------------------------------


def target_modules(model: torch.nn.Module | None, targets: str | list[str] = "all-linear") -> list[str]:
    """Module names LoRA adapts: for ``"all-linear"``, every linear layer's name but the output layer's."""
    if isinstance(targets, str) and targets != "all-linear":
        targets = [targets]  # one module name, not its letters
    if targets != "all-linear" and model is None:
        return list(targets)
    if model is None:
        raise FinetuneError("resolving 'all-linear' needs the loaded model")
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, bnb.nn.Linear4bit, bnb.nn.Linear8bitLt, Conv1D)
    out_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {
        # a model with LoRA attached holds each adapted layer as <name>.base_layer: the target is <name>
        name.removesuffix(".base_layer").rsplit(".", 1)[-1]
        for name, mod in model.named_modules()
        if isinstance(mod, kinds) and mod is not out_layer and "lora_" not in name
    }
    if not names:
        raise FinetuneError(f"{type(model).__name__} has no linear layer LoRA could adapt")
    if targets != "all-linear":
        every = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [
            t for t in targets if t not in every and not any(n.endswith("." + t) for n, _ in model.named_modules())
        ]
        if missing:
            raise FinetuneError(
                f"LoRA targets {missing} are not modules of {type(model).__name__}; its linear layers "
                f"are {', '.join(sorted(names))} (or use targets='all-linear')"
            )
        return list(targets)
    return sorted(names)


@dataclass
class TrainableParams:
    """What ``prepare_qlora`` made trainable."""

    trainable: int
    total: int
    targets: list[str]
    gradient_checkpointing: bool
    note: str = ""  # e.g. that the adapters were already attached and the model came back as is

    def __str__(self) -> str:
        return (
            f"trainable parameters: {self.trainable:,} of {self.total:,} ({100 * self.trainable / self.total:.3f} %)"
            f" in LoRA adapters on {', '.join(self.targets)}; gradient checkpointing "
            f"{'on (non-reentrant)' if self.gradient_checkpointing else 'off'}"
            + (f"; {self.note}" if self.note else "")
        )


def need_model(model: Any, fn: str) -> None:
    """Refuse anything but a loaded model, naming the function and what it got."""
    if not isinstance(model, torch.nn.Module):
        raise FinetuneError(f"{fn}() needs the model load() returned, got {model!r:.60}")


def need_plan(plan: Any, fn: str) -> None:
    if not isinstance(plan, TrainPlan):
        raise FinetuneError(f"{fn}() needs a TrainPlan, got {plan!r:.60}: e.g. TrainPlan('org/name')")


def need_tokenizer(tokenizer: Any, fn: str) -> None:
    if not callable(tokenizer) or not hasattr(tokenizer, "encode"):
        raise FinetuneError(f"{fn}() needs the tokenizer load() returned, got {tokenizer!r:.60}")


def prepare_qlora(model: torch.nn.Module, plan: TrainPlan):
    """Make a loaded (usually 4-bit) model trainable with LoRA.

    ``prepare_model_for_kbit_training`` (norms in fp32, input gradients on), gradient checkpointing
    with the non-reentrant variant, then ``get_peft_model`` (adapters initialised from ``plan.seed``).

    A model that already has the plan's LoRA adapters (the cell run again) comes back as is, its
    adapter weights kept; :class:`FinetuneError` when its adapters differ from the plan's or are frozen.

    Returns:
        ``(peft_model, TrainableParams)``.
    """
    need_model(model, "prepare_qlora")
    need_plan(plan, "prepare_qlora")
    from peft import get_peft_model, prepare_model_for_kbit_training

    if hasattr(model, "peft_config"):
        # before anything changes it: a second prepare_model_for_kbit_training would freeze the adapters
        # and get_peft_model would then wrap their base_layer, leaving nothing to train
        return _already_prepared(model, plan)
    quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    keep_4bit_layout(model)  # a model loaded elsewhere and generated with may have been repacked
    keep_attention_fused(model)  # packed (unmasked) GQA batches on a T4 would save seq x seq fp32 scores
    ckpt_kwargs = {"use_reentrant": False}
    with warnings.catch_warnings():
        # peft still calls transformers' old name for it (gradient_checkpointing_enable): same feature
        warnings.filterwarnings("ignore", message=".*checkpointing.* is deprecated", category=FutureWarning)
        if quantized:
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=plan.gradient_checkpointing, gradient_checkpointing_kwargs=ckpt_kwargs
            )
        elif plan.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
            model.enable_input_require_grads()
        if plan.gradient_checkpointing:
            model.config.use_cache = False  # the cache is useless in training and conflicts with checkpointing
        config = plan.lora_config(model)
        torch.manual_seed(plan.seed)  # LoRA's A matrices start random: the same seed gives the same run
        peft_model = get_peft_model(model, config)
    trainable, total = peft_model.get_nb_trainable_parameters()
    return peft_model, TrainableParams(trainable, total, sorted(config.target_modules), plan.gradient_checkpointing)


def _already_prepared(model, plan: TrainPlan) -> tuple[Any, TrainableParams]:
    """``model`` as is when its LoRA adapters are the plan's and train, else a :class:`FinetuneError`."""
    keep_4bit_layout(model)
    reload = "load the base model again (rerun the load cell) and call prepare_qlora on it"
    trainable, total = model.get_nb_trainable_parameters()
    if trainable == 0:
        raise FinetuneError(
            "this model already has LoRA adapters, but none of their weights trains (loaded for inference, "
            f"e.g. load(LoadPlan(..., adapter=...))): to train, {reload} (without adapter=)"
        )
    config = model.peft_config[model.active_adapter]
    have_targets = [config.target_modules] if isinstance(config.target_modules, str) else config.target_modules
    want = plan.lora_config(model)
    # what transformers' is_gradient_checkpointing reads (renamed is_activation_checkpointing in 5.x)
    checkpointing = any(getattr(m, "gradient_checkpointing", None) is True for m in model.modules())
    pairs = [
        ("r", getattr(config, "r", None), want.r),
        ("alpha", getattr(config, "lora_alpha", None), want.lora_alpha),
        ("dropout", getattr(config, "lora_dropout", None), want.lora_dropout),
        ("targets", sorted(have_targets or []), sorted(want.target_modules)),
        ("gradient_checkpointing", checkpointing, plan.gradient_checkpointing),
    ]
    differ = [f"{name} {have!r} (the plan: {wanted!r})" for name, have, wanted in pairs if have != wanted]
    if differ:
        raise FinetuneError(
            f"this model already has LoRA adapters ({type(config).__name__}) with other settings: "
            f"{'; '.join(differ)}. Adapters cannot be changed in place: {reload}, or set the plan back"
        )
    note = "the model already had these LoRA adapters (prepare_qlora ran on it before): returned as is, weights kept"
    return model, TrainableParams(trainable, total, sorted(have_targets), checkpointing, note)


# -- data ----------------------------------------------------------------------------------------


def load_instructions(path: str | Path | None = None, *, heldout: bool = False) -> list[dict]:
    """Rows of an instruction JSONL file.

    Args:
        path: a JSONL file with one ``{"instruction": ..., "response": ...}`` object per line;
            default the shipped ``helpers/data/instructions.jsonl`` (``heldout_prompts.jsonl`` with ``heldout``).
    """
    if path is not None and not isinstance(path, str | os.PathLike):
        raise FinetuneError(f"load_instructions() takes a JSONL file path (or None: the shipped one), got {path!r:.60}")
    path = Path(path) if path is not None else data_path("heldout_prompts.jsonl" if heldout else "instructions.jsonl")
    if not path.exists():
        raise FileNotFoundError(
            f"no instruction file at {path}; pass a JSONL path with one "
            '{"instruction": ..., "response": ...} object per line'
        )
    if path.is_dir():
        raise IsADirectoryError(
            f"{path} is a folder; pass the JSONL file in it "
            f"({', '.join(sorted(p.name for p in path.glob('*.jsonl'))[:5]) or 'it has no .jsonl file'})"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise FinetuneError(
            f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8 "
            "(e.g. open(path, 'w', encoding='utf-8')) and pass it again"
        ) from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise FinetuneError(
                f"{path}:{i}: not valid JSON ({e.msg}, column {e.colno}); every line must be one "
                '{"instruction": ..., "response": ...} object'
            ) from None
        if not isinstance(row, dict) or "instruction" not in row:
            has = (
                f"it has keys {', '.join(map(repr, row))}. Rename the fields, e.g. rows = [{{'instruction': "
                "r['question'], 'response': r['answer']} for r in rows]"
                if isinstance(row, dict)
                else f"it is a JSON {type(row).__name__}, not an object"
            )
            raise FinetuneError(
                f"{path}:{i}: every line needs an 'instruction' field (and 'response' for training); {has}"
            )
        rows.append(row)
    if not rows:
        raise FinetuneError(
            f'{path} holds no rows; every line must be one {{"instruction": ..., "response": ...}} object'
        )
    return rows


def prompt_text(tokenizer, instruction: str) -> str:
    """The prompt as the model sees it: the chat template's user turn, or a plain instruction block."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": instruction}], tokenize=False, add_generation_prompt=True
        )
    return (tokenizer.bos_token or "") + FALLBACK_TEMPLATE.format(instruction=instruction)


def _token_ids(tokenizer, instruction: str, response: str) -> tuple[list[int], list[int]]:
    """The prompt's and the answer's token ids (the answer ends with the end-of-sequence token)."""
    prompt = tokenizer(prompt_text(tokenizer, instruction), add_special_tokens=False)["input_ids"]
    answer = tokenizer(response + (tokenizer.eos_token or ""), add_special_tokens=False)["input_ids"]
    return prompt, answer


def format_example(tokenizer, instruction: str, response: str, seq_len: int, *, keep_eos: bool = True) -> dict | None:
    """Token ids and labels for one example; labels are ``-100`` on the prompt so only the answer trains.

    An answer cut at ``seq_len`` ends with the end-of-sequence token when ``keep_eos`` (its last kept
    token is replaced), so the example still teaches the model to stop. Returns ``None`` when
    truncation to ``seq_len`` would leave no answer token.
    """
    prompt, answer = _token_ids(tokenizer, instruction, response)
    return _example(tokenizer, prompt, answer, seq_len, keep_eos)


def _example(tokenizer, prompt: list[int], answer: list[int], seq_len: int, keep_eos: bool) -> dict | None:
    ids = (prompt + answer)[:seq_len]
    if len(prompt) >= len(ids):
        return None
    eos = getattr(tokenizer, "eos_token_id", None)
    if keep_eos and len(prompt) + len(answer) > seq_len and eos is not None:
        ids[-1] = eos
    labels = [IGNORE] * len(prompt) + ids[len(prompt) :]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


CUT_ANSWERS = ("keep_eos", "drop")


class DatasetWarning(UserWarning):
    """``build_dataset`` cut answers or dropped rows at this ``seq_len``."""


class TrainingData(list):
    """``build_dataset``'s examples (a list), with what ``seq_len`` cost: ``rows`` given, ``cut`` answers
    cut short (ending in the end-of-sequence token, or dropped with ``cut_answers='drop'``), ``dropped``
    rows (no answer token left, or cut and dropped)."""

    def __init__(self, examples: list[dict], *, rows: int, cut: int, dropped: int, seq_len: int, cut_answers: str):
        super().__init__(examples)
        self.rows, self.cut, self.dropped, self.seq_len, self.cut_answers = rows, cut, dropped, seq_len, cut_answers

    def summary(self) -> str:
        """One line: rows kept, answers cut, rows dropped at this seq_len."""
        what = "each ending in the end-of-sequence token" if self.cut_answers == "keep_eos" else "dropped"
        lost = ". Raise seq_len to keep them whole" if self.cut or self.dropped else ""
        return (
            f"seq_len={self.seq_len}: {self.rows - self.dropped} of {self.rows} rows kept; {self.cut} answers cut "
            f"short ({what}); {self.dropped} rows dropped{lost}"
        )


def build_dataset(
    tokenizer, rows: list[dict], seq_len: int, *, packing: bool = False, cut_answers: str = "keep_eos"
) -> TrainingData:
    """Tokenized examples, one per row (or packed), as a :class:`TrainingData` list that counts what
    ``seq_len`` cost (``.cut``, ``.dropped``, ``.summary()``; a :class:`DatasetWarning` says so when any).

    A row longer than ``seq_len`` is truncated, so its answer is cut short: ``cut_answers="keep_eos"``
    (default) keeps it, ending in the end-of-sequence token so it still teaches where to stop; ``"drop"``
    drops it. A row whose prompt alone fills ``seq_len`` has no answer token to learn and is dropped.

    Args:
        packing: concatenate examples into full ``seq_len`` blocks (fewer pad tokens, but examples
            see each other's text through attention); off by default: one example per sequence.
    """
    if cut_answers not in CUT_ANSWERS:
        raise FinetuneError(f"cut_answers={cut_answers!r}: use 'keep_eos' (cut answers end in EOS) or 'drop'")
    need_tokenizer(tokenizer, "build_dataset")
    if not isinstance(rows, list | tuple):
        raise FinetuneError(
            f"rows must be a list of {{'instruction', 'response'}} dicts (load_instructions()), got {rows!r:.60}"
        )
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise FinetuneError(f"seq_len must be a whole number of tokens >= 1 (e.g. plan.seq_len), got {seq_len!r}")
    missing = [
        i for i, r in enumerate(rows) if not isinstance(r, dict) or "response" not in r or "instruction" not in r
    ]
    if missing:
        raise FinetuneError(f"rows {missing[:5]} lack an 'instruction' or 'response' field; training needs both")
    not_text = [
        i for i, r in enumerate(rows) if not isinstance(r["instruction"], str) or not isinstance(r["response"], str)
    ]
    if not_text:
        raise FinetuneError(
            f"rows {not_text[:5]} have an 'instruction' or 'response' that is not a string "
            f"(row {not_text[0]}: {rows[not_text[0]]!r:.80}); convert them with str()"
        )
    kept, cut, dropped = [], 0, 0
    for r in rows:
        prompt, answer = _token_ids(tokenizer, r["instruction"], r["response"])
        example = _example(tokenizer, prompt, answer, seq_len, keep_eos=True)
        is_cut = example is not None and len(prompt) + len(answer) > seq_len
        cut += is_cut
        if example is None or (is_cut and cut_answers == "drop"):
            dropped += 1
        else:
            kept.append(example)
    if not kept:
        raise FinetuneError(f"seq_len={seq_len} leaves no answer token in any example; raise TrainPlan.seq_len")
    if packing:
        ids = [t for e in kept for t in e["input_ids"]]
        labels = [t for e in kept for t in e["labels"]]
        kept = [
            {
                "input_ids": ids[i : i + seq_len],
                "attention_mask": [1] * len(ids[i : i + seq_len]),
                "labels": labels[i : i + seq_len],
            }
            for i in range(0, len(ids) - seq_len + 1, seq_len)
        ]
    data = TrainingData(kept, rows=len(rows), cut=cut, dropped=dropped, seq_len=seq_len, cut_answers=cut_answers)
    if cut or dropped:
        warnings.warn(data.summary(), DatasetWarning, stacklevel=2)
    return data


def collate(examples: list[dict], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Pad a batch on the right (labels with -100, attention mask with 0)."""
    n = max(len(e["input_ids"]) for e in examples)

    def pad(key, value):
        return torch.tensor([e[key] + [value] * (n - len(e[key])) for e in examples])

    return {
        "input_ids": pad("input_ids", pad_token_id),
        "attention_mask": pad("attention_mask", 0),
        "labels": pad("labels", IGNORE),
    }


@torch.inference_mode()
def answer(
    model, tokenizer, instructions: list[str], *, max_new_tokens: int = 64, batch_size: int = 4, stream: bool = False
) -> list[str]:
    """Greedy answers to ``instructions``, prompted exactly as in training (same template, no extra BOS).

    ``stream=True`` prints the first answer token by token while its batch runs."""
    if isinstance(instructions, str):  # else one prompt per character: as generate_batched refuses it
        raise TypeError(
            f"instructions must be a list of strings, got one string ({instructions[:40]!r}): pass [instruction]"
        )
    if not isinstance(instructions, list | tuple) or not all(isinstance(q, str) for q in instructions):
        raise TypeError(f"instructions must be a list of strings, got {instructions!r:.60}")
    need_tokenizer(tokenizer, "answer")
    prompts = [prompt_text(tokenizer, q) for q in instructions]
    return generate_batched(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                            progress=False, add_special_tokens=False, do_sample=False, use_cache=True,
                            stream=stream)  # fmt: skip


# -- micro-batch ---------------------------------------------------------------------------------


@dataclass
class MicroBatch:
    """The measured micro-batch and the accumulation that keeps the effective batch."""

    micro_batch: int
    gradient_accumulation: int
    batch_size: int
    search: Any

    @property
    def why(self) -> str:
        """How the micro-batch follows from the search, in a few words."""
        s = self.search
        if s.limit and s.max_ok >= s.limit:
            how, usable = f"the cap {s.limit} ran: no margin, that is for after an out-of-memory try", s.max_ok
        else:
            how, usable = f"{s.margin:.0%} of the largest that ran, {s.max_ok}: {s.batch_size}", s.batch_size
        if self.micro_batch == usable:
            return how
        return f"{how}; the largest divisor of {self.batch_size} up to {usable} is {self.micro_batch}"

    def __str__(self) -> str:
        return (
            f"micro-batch {self.micro_batch} x gradient accumulation {self.gradient_accumulation} = "
            f"effective batch {self.batch_size} ({self.why})\n{self.search}"
        )

    def _repr_html_(self) -> str:
        return f"<p><b>{self.__str__().splitlines()[0]}</b></p>{self.search._repr_html_()}"


def find_micro_batch(model: torch.nn.Module, plan: TrainPlan, *, margin: float = 0.9) -> MicroBatch:
    """Measure the largest micro-batch a real training step (forward + backward at ``seq_len``) fits.

    The search is capped at ``plan.micro_batch`` when the plan has one (a choice made in
    :class:`~helpers.train_panel.TrainPanel`: the most to try), else at ``plan.batch_size``. When
    that cap runs it is kept whole; after an out-of-memory try, ``margin`` of the largest size that
    ran (the margin guards the edge a search found; a cap that ran found none). Either is rounded
    down to a divisor of the effective batch, so micro-batch x accumulation is exactly the batch
    asked for. Set it on the plan with ``plan = plan.replace(micro_batch=mb.micro_batch)``.
    """
    need_model(model, "find_micro_batch")
    need_plan(plan, "find_micro_batch")
    number("margin", margin, low=0, high=1, low_open=True, error=FinetuneError)

    vocab = model.get_input_embeddings().num_embeddings
    device = next(p for p in model.parameters()).device
    was_training = model.training
    model.train()

    precision = plan.resolved_precision()
    # Trainer runs fp16/bf16 under autocast; without it the activations of prepare_model_for_kbit_training's
    # fp32 layers stay fp32 and the search would settle for a smaller micro-batch than training needs
    autocast = (
        torch.autocast(device.type, dtype=torch.float16 if precision == "fp16" else torch.bfloat16)
        if device.type == "cuda" and precision in ("fp16", "bf16")
        else contextlib.nullcontext()
    )

    def step(b: int) -> None:
        ids = torch.randint(0, vocab, (b, plan.seq_len), device=device)
        try:
            with autocast:
                loss = training_loss(model, {"input_ids": ids, "labels": ids}, plan)
            loss.backward()
        finally:
            model.zero_grad(set_to_none=True)

    limit = plan.micro_batch or plan.batch_size
    try:
        search = find_max_batch_size(step, limit=limit, margin=margin, key=_micro_batch_key(plan, precision, device))
    finally:
        model.train(was_training)
    # the margin is headroom below a size that ran out of memory; when the limit itself ran there was none
    usable = search.max_ok if search.max_ok >= limit else search.batch_size
    micro = max(d for d in range(1, usable + 1) if plan.batch_size % d == 0)
    return MicroBatch(micro, plan.batch_size // micro, plan.batch_size, search)


def _micro_batch_key(plan: TrainPlan, precision: str, device: torch.device) -> tuple:
    """The search cache key: everything that changes a training step's memory (LoRA targets and
    dropout change what is adapted and saved for backward; precision the activations' size), and the
    limit, so a search stopped by a smaller one is not taken for the answer to a larger one."""
    targets = plan.targets if isinstance(plan.targets, str) else tuple(plan.targets)
    return ("qlora", plan.model, plan.load, plan.double_quant, plan.r, targets, plan.dropout, precision,
            plan.seq_len, plan.gradient_checkpointing, plan.micro_batch or plan.batch_size, str(device), plan.loss,
            plan.offload_activations)  # fmt: skip


# -- training ------------------------------------------------------------------------------------


def last_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest *complete* ``checkpoint-N`` folder in ``output_dir`` (None when there is none).

    Incomplete or corrupted ones (a kill during the save) are passed over; see :mod:`helpers.checkpoints`.
    """
    return newest_complete(output_dir)


def make_trainer(model, tokenizer, plan: TrainPlan, dataset: list[dict], *, callbacks=(), **argument_overrides):
    """A ``Trainer`` for ``plan`` (needs ``plan.micro_batch``; see :func:`find_micro_batch`).

    Each checkpoint it saves is marked complete and stamped with the run's settings and a hash of
    ``dataset`` (see :func:`run_stamp`), which :func:`train` compares when it resumes.
    """
    return _trainer_and_stamp(model, tokenizer, plan, dataset, callbacks, argument_overrides)[0]


def training_loss(model, inputs: dict, plan: TrainPlan, num_items=None) -> torch.Tensor:
    """One forward pass's loss with the plan's reducers: the chunked loss (``plan.loss="chunked"``) and
    activation offload (``plan.offload_activations``); the model's own loss otherwise (Liger's fused one
    when ``"fused"``: TrainingArguments patches the model)."""
    with offload_activations(plan.offload_activations):
        if plan.loss == "chunked":
            rest = {k: v for k, v in inputs.items() if k not in ("input_ids", "labels")}
            return chunked_lm_loss(model, inputs["input_ids"], inputs["labels"], num_items, **rest)
        kw = {} if num_items is None else {"num_items_in_batch": num_items}
        return model(**inputs, **kw).loss


def _reducing_trainer(base):
    """``Trainer`` whose loss runs through :func:`training_loss` (the plan's reducers)."""

    class ReducingTrainer(base):
        def __init__(self, *args, plan: TrainPlan, **kwargs):
            super().__init__(*args, **kwargs)
            self.plan = plan

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if return_outputs or (self.plan.loss != "chunked" and not self.plan.offload_activations):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            items = num_items_in_batch if self.model_accepts_loss_kwargs else None
            return training_loss(model, inputs, self.plan, items)

    return ReducingTrainer


def _trainer_and_stamp(model, tokenizer, plan: TrainPlan, dataset, callbacks, overrides: dict) -> tuple[Any, dict]:
    from transformers import Trainer

    if plan.micro_batch is None:
        raise FinetuneError(
            "plan.micro_batch is not set: run find_micro_batch(model, plan) and "
            "plan = plan.replace(micro_batch=...) first (or set it by hand)"
        )
    if len(dataset) == 0:
        raise FinetuneError(
            "the dataset is empty: nothing to train on (check the data file and build_dataset's seq_len)"
        )
    first = dataset[0]
    if not isinstance(first, dict) or "input_ids" not in first or "labels" not in first:
        raise FinetuneError(
            "the dataset holds raw rows, not tokenized examples: pass "
            "build_dataset(tokenizer, rows, plan.seq_len) (it adds input_ids and labels)"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    args = plan.training_arguments(**overrides)
    stamp = run_stamp(plan, args, dataset)
    trainer = _reducing_trainer(Trainer)(
        plan=plan,
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=lambda ex: collate(ex, pad),
        callbacks=[*callbacks, complete_marker(stamp)],  # the COMPLETE marker goes last, after everything is saved
    )
    return trainer, stamp


def dataset_hash(dataset) -> str:
    """sha256 of every example's token ids and labels, in order: what training sees of the data."""
    h = hashlib.sha256()
    for example in dataset:
        for key in ("input_ids", "labels"):
            values = list(example[key])
            h.update(len(values).to_bytes(8, "little"))  # so [1, 2] + [3] differs from [1] + [2, 3]
            try:
                h.update(array.array("q", values).tobytes())
            except (TypeError, OverflowError):  # tensors, numpy ints: their text is still the same each time
                h.update(repr([int(v) for v in values]).encode())
    return h.hexdigest()


# what decides the adapter a run trains: a checkpoint written with other values is another run's
_STAMPED_PLAN = ("model", "load", "double_quant", "r", "alpha", "dropout", "targets", "seq_len", "packing")


def run_stamp(plan: TrainPlan, args, dataset) -> dict:
    """The settings and data a run trains with, as stored in each of its checkpoints (JSON-able).

    The micro-batch (measured; the effective batch is stamped), the output folder, save and log
    intervals and gradient checkpointing are left out: they change memory or bookkeeping, not the result.
    """
    stamped = {name: getattr(plan, name) for name in _STAMPED_PLAN}
    stamped["targets"] = stamped["targets"] if isinstance(stamped["targets"], str) else list(stamped["targets"])
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    steps = {"max_steps": args.max_steps} if args.max_steps > 0 else {"epochs": args.num_train_epochs}
    stamped.update(batch_size=args.per_device_train_batch_size * args.gradient_accumulation_steps,
                   optimizer=str(getattr(args.optim, "value", args.optim)), precision=precision,
                   learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, seed=args.seed, **steps)  # fmt: skip
    return {"plan": stamped, "dataset": {"examples": len(dataset), "sha256": dataset_hash(dataset)}}


def stamp_changes(old: dict | None, new: dict) -> list[str]:
    """What differs between the stamp a checkpoint holds and this run's, one phrase each ([] when none
    differs, or the checkpoint has no stamp: written before stamps existed)."""
    if not old:
        return []
    before, now = old.get("plan", {}), new["plan"]
    changes = [f"{k} {before[k]!r} -> {v!r}" for k, v in now.items() if k in before and before[k] != v]
    was, data = old.get("dataset", {}), new["dataset"]
    if was.get("sha256") not in (None, data["sha256"]):
        changes.append(
            f"the data ({was.get('examples')} examples, sha256 {str(was['sha256'])[:12]}) -> "
            f"({data['examples']} examples, sha256 {data['sha256'][:12]})"
        )
    return changes


@dataclass
class TrainResult:
    """What a (possibly resumed) run did."""

    output_dir: Path
    resumed_from: int | None
    global_step: int
    max_steps: int
    losses: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    log_history: list[dict] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)  # newer checkpoints passed over, and why
    set_aside: list[Skipped] = field(default_factory=list)  # an earlier run's checkpoints, moved (resume=False)
    changed: list[str] = field(default_factory=list)  # how the resumed checkpoint's settings or data differ
    finished_before: bool = False  # the checkpoint had reached max_steps: its adapter loaded, nothing trained
    progress: TrainProgress | None = None  # the live view's last update: peak reserved, share of the card, time

    @property
    def first_loss(self) -> float | None:
        return self.losses[0][1] if self.losses else None

    @property
    def last_loss(self) -> float | None:
        return self.losses[-1][1] if self.losses else None

    def __str__(self) -> str:
        start = f"resumed at step {self.resumed_from}" if self.resumed_from else "started from scratch"
        done = f"trained to step {self.global_step} of {self.max_steps} ({start}) in {self.seconds:.1f} s"
        if self.finished_before:
            done = (
                f"already finished: the checkpoint of step {self.resumed_from} is the run's last (of {self.max_steps}), "
                "so its adapter is loaded into the model and nothing trained (raise max_steps or epochs to train "
                "on, or pass resume=False to start over)"
            )
        loss = (
            f"; loss {self.first_loss:.3f} (step {self.losses[0][0]}) -> {self.last_loss:.3f} "
            f"(step {self.losses[-1][0]})"
            if self.losses
            else ""
        )
        skipped = "".join(f"; skipped {s}" for s in self.skipped)
        if self.set_aside:
            n, names = len(self.set_aside), ", ".join(s.moved_to.name for s in self.set_aside if s.moved_to)
            skipped += f"; set aside the {n} checkpoint{'s' if n > 1 else ''} of an earlier run (kept as {names})"
        if self.changed:
            skipped += f"; the checkpoint was written with other settings or data: {', '.join(self.changed)}"
        summary = f"\n{self.progress.summary()}" if self.progress is not None and not self.finished_before else ""
        return f"{done}{loss}; checkpoints in {self.output_dir}{skipped}{summary}"


def train(
    model, tokenizer, plan: TrainPlan, dataset: list[dict], *, callbacks=(), resume: bool = True,
    view: str | bool = "auto", **argument_overrides,
) -> TrainResult:  # fmt: skip
    """Train with ``Trainer``; continue from the newest complete checkpoint in the output folder when ``resume``.

    A checkpoint holds the adapter, optimizer, scheduler and RNG states, so a rerun after a
    disconnect continues at the step where it saved, with the same data order. A newer checkpoint
    that a kill left half written, or that is corrupted, is skipped with a :class:`CheckpointWarning`
    naming the file, and renamed ``incomplete-checkpoint-N`` (kept, not deleted); the skips are in
    ``TrainResult.skipped``. A lone checkpoint cut short is set aside the same way and training starts over;
    when several are there and none is complete, :class:`CheckpointError` says what to do.
    A complete checkpoint is then proven (:func:`helpers.checkpoint_proof.prove`): its adapter and
    optimizer/scheduler states must load as plain tensors, be finite and fit this model; one that does
    not is renamed ``unusable-checkpoint-N`` (its ``SET_ASIDE.txt`` says why) and the one before is
    used; when none is left, one :class:`CheckpointError` says so and the next run starts from scratch.

    A checkpoint that already reached ``max_steps`` (the run finished; the cell run again) is not
    trained further: its adapter is loaded into ``model`` and ``TrainResult.finished_before`` is set.
    Each checkpoint holds the run's settings and a hash of its data (:func:`run_stamp`); resuming
    from one written with others warns (:class:`CheckpointWarning`) and lists them in ``TrainResult.changed``.

    ``resume=False`` starts over: the folder's ``checkpoint-N`` are renamed ``previous-checkpoint-N``
    first (kept; listed in ``TrainResult.set_aside``), so a later resume continues this run, not theirs.

    ``view`` shows the run live (:class:`~helpers.train_view.TrainView`: step/total, ETA, loss, tokens/s,
    GPU memory against the card; an updating output in a notebook, text lines without one; ``"html"``,
    ``"text"``, or ``False`` for none; a ``TrainView`` among ``callbacks`` is used instead), and its last
    figures are ``TrainResult.progress``: peak reserved, share of the card, wall time.
    """
    from .train_view import TrainView

    need_model(model, "train")
    need_plan(plan, "train")
    need_tokenizer(tokenizer, "train")
    if not isinstance(dataset, list | tuple) or not dataset or not all(isinstance(e, dict) for e in dataset):
        raise FinetuneError(f"dataset must be build_dataset()'s non-empty list of examples, got {dataset!r:.60}")
    keep_4bit_layout(model)
    shown = next((c for c in callbacks if isinstance(c, TrainView)), None)
    if shown is None and view:
        shown = TrainView("auto" if view is True else view)
        callbacks = [*callbacks, shown]
    trainer, stamp = _trainer_and_stamp(model, tokenizer, plan, dataset, callbacks, argument_overrides)
    if shown is not None:  # the view replaces Trainer's raw log dicts (disable_tqdm) or its bar
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
    out = Path(trainer.args.output_dir)
    point = _proven_resume(trainer.model, out, stamp) if resume else ResumePoint(None, None)
    # starting over: the earlier run's checkpoints must go out of Trainer's way (renamed, kept), or its
    # rotation by age keeps an old high-numbered one and the next resume continues the old run
    aside = [] if resume else set_aside_all(out, "an earlier run's checkpoint (resume=False starts over)")
    total = _total_steps(trainer.args, len(dataset))
    finished = point.checkpoint is not None and point.step >= total
    changed = stamp_changes(read_stamp(point.checkpoint), stamp) if point.checkpoint else []
    if changed:
        _warn_changed(point.checkpoint, out, changed, finished)
    if finished:  # Trainer would run one step past max_steps and rotate an older checkpoint out
        _load_checkpoint_weights(trainer, point.checkpoint)
        history = json.loads((point.checkpoint / "trainer_state.json").read_text(encoding="utf-8")).get(
            "log_history", []
        )
        losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
        return TrainResult(out, point.step, point.step, total, losses, 0.0, history, point.skipped, aside, changed,
                           finished_before=True)  # fmt: skip
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(point.checkpoint) if point.checkpoint else None)
    history = trainer.state.log_history
    losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
    return TrainResult(out, point.step, trainer.state.global_step, trainer.state.max_steps, losses,
                       time.perf_counter() - started, history, point.skipped, aside, changed,
                       progress=shown.last if shown is not None else None)  # fmt: skip


def _warn_changed(checkpoint: Path, out: Path, changed: list[str], finished: bool) -> None:
    """Resuming from a checkpoint written with other settings or data: say which, and what happens now."""
    then = (
        "it had finished, so nothing trains on the new ones: its adapter is loaded as it is"
        if finished
        else "training continues from it with the new ones"
    )
    warnings.warn(
        f"{checkpoint.name} in {out} was written with other settings or data: {'; '.join(changed)}. "
        f"{then.capitalize()}; pass resume=False to train from scratch (the old checkpoints are kept, renamed)",
        CheckpointWarning,
        stacklevel=3,  # the caller of train()
    )


_SHAPE_KEYS = ("model", "r", "targets")  # stamped settings that decide the adapter's and optimizer's shapes


def _proven_resume(model, out: Path, stamp: dict) -> ResumePoint:
    """The newest checkpoint whose files are whole *and* load into ``model`` (:func:`prove`).

    One that fails is renamed ``unusable-checkpoint-N`` with a file saying why, and the one before is
    tried; the next rerun therefore never meets the same broken checkpoint again. A checkpoint
    trained with other settings (its stamp differs) is not set aside: the plan is what changed.
    """
    point = find_resume(out)
    _set_aside_skipped(point, out)
    unusable: list[Skipped] = []
    while point.checkpoint is not None:
        why = prove(point.checkpoint, model)
        if why is None:
            break
        # another rank, targets or base explains a misfit: the plan changed, the checkpoint is fine
        changed = [c for c in stamp_changes(read_stamp(point.checkpoint), stamp) if c.split(" ")[0] in _SHAPE_KEYS]
        if changed:
            raise FinetuneError(
                f"{point.checkpoint} does not fit this run: {why}; it was trained with other settings "
                f"({'; '.join(changed)}). Pass resume=False to start over (it is kept, renamed), or train "
                "with the settings it was made with"
            )
        unusable.append(set_aside(Skipped(point.checkpoint, why), "unusable"))
        point = find_resume(out)
        _set_aside_skipped(point, out)
    for skip in unusable:
        instead = f"resuming from {point.checkpoint.name} instead" if point.checkpoint else "no earlier one is good"
        warnings.warn(
            f"{skip.path.name} in {out} cannot be resumed from: {skip}; {instead}", CheckpointWarning, stacklevel=3
        )
    if unusable and point.checkpoint is None:
        names = ", ".join(s.moved_to.name if s.moved_to else s.path.name for s in unusable)
        raise CheckpointError(
            f"no checkpoint in {out} can be resumed from: {unusable[0]}. Set aside as {names} (each holds "
            f"{WHY} saying why). Run again to train from scratch (or pass resume=False)"
        )
    point.skipped = unusable + point.skipped
    return point


def _set_aside_skipped(point: ResumePoint, out: Path) -> None:
    """Rename the checkpoints :func:`find_resume` passed over (kept) and warn about each."""
    for skip in point.skipped:
        set_aside(skip)
        kept = f" (the folder is kept as {skip.moved_to.name})" if skip.moved_to else ""
        instead = f"resuming from {point.checkpoint.name}" if point.checkpoint else "starting from scratch"
        warnings.warn(
            f"skipped {skip.path.name} in {out}: {skip.problem}; {instead} instead{kept}",
            CheckpointWarning,
            stacklevel=3,
        )


def _total_steps(args, examples: int) -> int:
    """The optimizer steps the run makes in all, as Trainer counts them (one process)."""
    if args.max_steps > 0:
        return args.max_steps
    per = args.per_device_train_batch_size
    batches = examples // per if args.dataloader_drop_last else math.ceil(examples / per)
    accumulation = args.gradient_accumulation_steps
    per_epoch = max(batches // accumulation + int(batches % accumulation > 0), 1)
    return math.ceil(args.num_train_epochs * per_epoch)


def _load_checkpoint_weights(trainer, folder: Path) -> None:
    """Put the trained weights of ``folder`` into the trainer's model (the adapter for a PEFT model)."""
    model = trainer.model
    if not hasattr(model, "peft_config"):
        trainer._load_from_checkpoint(str(folder))  # what Trainer runs on resume, for any other model
        return
    from peft import load_peft_weights, set_peft_model_state_dict

    try:
        loaded = set_peft_model_state_dict(model, load_peft_weights(str(folder)), adapter_name=model.active_adapter)
    except RuntimeError as e:  # a size mismatch: another rank
        raise FinetuneError(
            f"the adapter in {folder} does not fit this model's LoRA adapters ({str(e).splitlines()[-1].strip()}); "
            "its LoRA settings differ from the plan's: pass resume=False to start over (it is kept)"
        ) from None
    unexpected = list(getattr(loaded, "unexpected_keys", None) or [])
    if unexpected:
        raise FinetuneError(
            f"the adapter in {folder} has {len(unexpected)} weights this model has no place for (e.g. "
            f"{unexpected[0]}): its LoRA targets differ from the plan's; pass resume=False to start over (it is kept)"
        )


# -- adapter -------------------------------------------------------------------------------------


@dataclass
class AdapterReport:
    path: Path
    files: dict[str, int]
    previous: Path | None = None  # where a different adapter that was at ``path`` was moved

    @property
    def bytes(self) -> int:
        return sum(self.files.values())

    def __str__(self) -> str:
        return (
            f"adapter saved to {self.path}: {format_bytes(self.bytes)} in {', '.join(sorted(self.files))} "
            "(LoRA weights and config only; load it on the base model with "
            f"helpers.loading.load(LoadPlan(<base>, load=..., adapter='{self.path}')))"
        ) + (f"; the different adapter that was there is kept in {self.previous}" if self.previous else "")


def save_adapter(model, path: str | Path, tokenizer=None) -> AdapterReport:
    """Save only the LoRA adapter (and the tokenizer when given), not the base model's weights."""
    if not hasattr(model, "peft_config"):
        raise TypeError("save_adapter needs the PEFT model returned by prepare_qlora (it has the adapter)")
    if not isinstance(path, str | os.PathLike) or not str(path).strip():
        raise FinetuneError(f"save_adapter() takes a folder path, got {path!r:.60}")
    path = Path(path)
    # written beside, then swapped in: a crash mid-save leaves the old adapter whole, and a different
    # one (another run's, FRESH=True) is moved aside instead of overwritten
    staging = path.with_name(path.name + ".saving")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    except OSError as e:  # a read-only folder, a full disk: nothing half-written is left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise AdapterSaveError(
            f"could not save the adapter to {path} ({type(e).__name__}: {e.strerror or e}); nothing was written "
            f"and {'the adapter already there is untouched' if path.exists() else 'no folder was left'}. Save to a "
            "writable folder with free space (df -h shows it), e.g. save_adapter(model, '/content/adapter')"
        ) from None
    previous = None
    if path.exists():
        if _same_files(path, staging):
            shutil.rmtree(path)
        else:
            previous = path.with_name(f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}.previous")
            path.rename(previous)
    staging.rename(path)
    files = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}
    return AdapterReport(path, files, previous)


class AdapterSaveError(FinetuneError, OSError):
    """``save_adapter`` could not write (a read-only folder, a full disk); nothing half-written is left."""


def _same_files(a: Path, b: Path) -> bool:
    """Whether two folders hold the same files with the same bytes (a re-save of the same adapter)."""
    names = sorted(p.name for p in a.iterdir() if p.is_file())
    if names != sorted(p.name for p in b.iterdir() if p.is_file()):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def merge_adapter(model):
    """Fold the LoRA weights into the base model (``merge_and_unload``) for adapter-free inference.

    With a 4-bit base the merged weights are quantized again, which rounds them: outputs shift a
    little. For the exact merge, load the base in fp16/bf16, attach the adapter, then merge.
    """
    if not callable(getattr(model, "merge_and_unload", None)):
        raise FinetuneError(
            f"merge_adapter() folds a LoRA adapter into its base; {type(model).__name__} has none: pass the model "
            "prepare_qlora() returned, or one loaded with LoadPlan(adapter=...)"
        )
    return model.merge_and_unload()
