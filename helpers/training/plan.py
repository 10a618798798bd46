"""The plan of a QLoRA run: :class:`TrainPlan` (every choice that decides memory and resumability),
its checks, its estimate, the ``LoraConfig`` and ``TrainingArguments`` it makes, and which modules
LoRA adapts (:func:`target_modules`); :class:`FinetuneError` and the argument guards the fine-tuning
functions share (:func:`need_model`, :func:`need_plan`, :func:`need_tokenizer`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.arguments import flag, number, whole_number
from ..core.devices import cuda_capability
from ..core.errors import OomkitError
from ..core.reducers import liger_available
from ..core.sources import persistent_path
from ..core.vocab import (
    BF16,
    DEFAULTS,
    FP16,
    FP32,
    MODES,
    QUANTIZED,
    DtypeError,
    ReducerError,
    dtype_name,
    half_dtype,
    load_mode_name,
    loss_name,
    supports_bf16,
)
from ..estimator.core import estimate
from ..estimator.families import frozen_modules, lora_task_type
from ..estimator.training import OPTIMIZERS, LoraTraining
from ..loading.plan import LoadPlan

__all__ = ["TrainPlan", "FinetuneError", "check_optimizer", "target_modules", "need_model", "need_plan",
           "need_tokenizer"]  # fmt: skip


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
    r: int = LoraTraining.r  # the estimator's LoRA defaults: one home
    alpha: int = LoraTraining.alpha
    dropout: float = LoraTraining.lora_dropout
    targets: str | list[str] = "all-linear"
    seq_len: int = DEFAULTS.seq_len
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
        self.load = load_mode_name(self.load, error=FinetuneError)
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
        return FP32 if cap is None else half_dtype(supports_bf16(cap))

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
        """The :class:`helpers.LoadPlan` that loads the base model for this run."""

        prec = self.resolved_precision()
        compute = prec if MODES[self.load].quantized else "auto"
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
        return estimate(
            self.model if model is None else model,
            load=self.load,
            double_quant=self.double_quant,
            compute_dtype=compute,
            training=self.lora_training(gpu=device != "cpu"),
            device=device,
        )

    def lora_config(self, model: torch.nn.Module | None = None):
        """peft ``LoraConfig``; with ``model``, ``"all-linear"`` becomes the explicit module list."""
        from peft import LoraConfig

        targets = target_modules(model, self.targets) if model is not None else self.targets
        frozen = frozen_modules(model) if model is not None else []
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=targets,
            # a vision tower's or audio encoder's layers share names with the LM's (q_proj, fc1): excluded by path
            exclude_modules="|".join(re.escape(f) + r"\..*" for f in frozen) or None,
            bias="none",
            task_type=lora_task_type(getattr(model, "config", None)) if model is not None else "CAUSAL_LM",
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
            fp16=prec == FP16, bf16=prec == BF16, logging_steps=self.logging_steps,
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
        reducers = (f", loss {self.loss}" if self.loss != "plain" else "") + (
            ", activations offloaded to RAM" if self.offload_activations else ""
        )  # the memory reducers, when one is on
        return (
            f"TrainPlan({self.model}: {self.load}, LoRA r={self.r} alpha={self.alpha} on {self.targets}, "
            f"seq {self.seq_len}, batch {self.batch_size} = micro {mb} x accumulation "
            f"{self.gradient_accumulation if self.micro_batch else '?'}, {self.resolved_optimizer()}, "
            f"{self.resolved_precision()}, checkpointing {'on' if self.gradient_checkpointing else 'off'}{reducers}, "
            f"{steps}, save every {self.save_steps} to {self.resolved_output_dir()})"
        )


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
    # a peft model names the base model's modules base_model.model.<name>: strip it to compare with frozen ones
    frozen = tuple(f + "." for f in frozen_modules(model.get_base_model() if hasattr(model, "peft_config") else model))
    names = {
        # a model with LoRA attached holds each adapted layer as <name>.base_layer: the target is <name>
        name.removesuffix(".base_layer").rsplit(".", 1)[-1]
        for name, mod in model.named_modules()
        if isinstance(mod, kinds) and mod is not out_layer and "lora_" not in name
        and not name.removeprefix("base_model.model.").startswith(frozen)
    }  # fmt: skip
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
