"""Load a model by plan: check first, refuse with the reason and the fix, then report what landed where.

A :class:`LoadPlan` says what to load and how (load mode, compute dtype, generation budget,
placement). ``plan.from_pretrained_kwargs()`` turns it into the current transformers API
(``quantization_config=BitsAndBytesConfig(...)``, ``dtype=``). :func:`load` checks the plan
against this machine before touching any weights (the model exists, bitsandbytes can run, the
estimate fits, RAM can hold the largest weight file) and returns ``(model, tokenizer, LoadReport)``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import devices, generation
from .arguments import ArgumentError, flag, whole_number
from .attention import keep_attention_fused
from .checks import Check
from .compat import from_pretrained_dtype
from .devices import (  # the placement constants live with the device facts; named here as before
    DISK_BYTES_PER_S,
    GPU_MARGIN,
    PCIE_BYTES_PER_S,
    bitsandbytes_status,
    device_kind,
)
from .errors import LoadError, LoadRefused, ModelNotFoundError  # defined there so gpu_split can refuse
from .estimator import (
    EstimateError,
    auto_class,
    fit,
    footprint,
    footprint_by_device,
    quantization_skip_modules,
    resolve_config,
)
from .estimator import estimate as estimate_memory
from .gpu_split import (
    check_strategy,
    decide_gpus,
    first_fix,
    gpu_device,
    gpu_room,
    held_hint,
    map_gpu,
    map_strategy,
    offload_ram,
    offloaded_bytes,
    other_gpus_note,
    spill_fix,
    spill_why,
    split_plan,
    unquantized_note,
)
from .html import colored, table
from .memory import MemorySnapshot, allocated
from .placement import PREQUANTIZED_OFFLOAD, PREQUANTIZED_OFFLOAD_FIX, DevicePlan, PlacementError, bnb_prequantized
from .reducers import use_kv_cache
from .sources import (
    SourceError,
    checkpoint_size,
    drive_hint,
    hub_offline_reason,
    looks_like_path,
    memory_mapped,
    nearest_existing,
    read_json,
    shipped_config,
)
from .units import format_bytes, percent
from .vocab import DOES_NOT_FIT, DTYPE_BYTES, LOAD_MODES, QUANTIZED, dtype_name, kv_cache_name, torch_dtype

# what transformers' attn_implementation takes (a hub kernel "org/name" too)
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")

__all__ = [
    "LoadPlan", "LoadReport", "LoadError", "ModelNotFoundError", "LoadRefused",
    "load", "check_plan", "setup_tokenizer", "generate_batched", "placement", "keep_4bit_layout",
]  # fmt: skip

BNB_INSTALL = "pip install -U bitsandbytes   (in a notebook: %pip install -U bitsandbytes, then restart the runtime)"
TOKEN_HELP = (
    "Accept the model's licence on its Hugging Face page, then give this runtime a token: in Colab, "
    "add a secret named HF_TOKEN (key icon in the left bar) and allow notebook access; elsewhere set the "
    "HF_TOKEN environment variable or run `huggingface-cli login`"
)
# torch.load of a .bin shard holds it whole plus part of a copy while tensors are moved.
PICKLE_LOAD_FACTOR = 1.2


def auto_compute_dtype(device: str | None = None) -> str:
    """fp16 on pre-Ampere GPUs (T4, V100), bf16 on Ampere and later, fp16 on MPS, fp32 on CPU."""
    return devices.auto_compute_dtype(device or device_kind())


@dataclass
class LoadPlan:
    """What to load and how. Every field has the safe default; change the few you care about.

    Args:
        model: hub id (``"codellama/CodeLlama-7b-Instruct-hf"``) or local directory.
        load: ``fp16``, ``bf16``, ``fp32``, ``int8`` (LLM.int8), ``nf4`` or ``fp4`` (4-bit), or ``"auto"``:
            what ``estimate(load="auto")`` picks on this machine (the GPU's 16-bit dtype if it fits, else
            nf4), resolved when the plan is made (``plan.load`` then names the mode).
        double_quant: 4-bit only: quantize the per-block scales too (saves ~0.4 bit/parameter).
        compute_dtype: ``"auto"`` (fp16 on T4/V100, bf16 on Ampere+, fp32 on CPU) or a dtype name.
        max_new_tokens, batch_size, prompt_tokens: the generation budget the KV cache is sized for.
        device_map: ``"auto"`` lets accelerate place modules (GPU first, then CPU, then disk); ``"balanced"``,
            ``"balanced_low_0"`` and ``"sequential"`` place as transformers does, over every usable GPU.
        max_memory: per-device caps for ``device_map``; ``None`` = computed at load time from the
            estimate so the KV cache and activations keep their room on the GPU.
        offload_folder: where modules go when even CPU RAM is full (slow; see the report).
        allow_offload: accept a plan that only fits by offloading weights to CPU or disk (every token
            slower); by default such a plan is refused with the fix, never offloaded silently.
        adapter: optional PEFT adapter directory (LoRA) to attach after loading.
        token: Hugging Face token for gated models; ``None`` = ``HF_TOKEN`` / Colab secret / login.
        gpus: how many of this machine's GPUs (from GPU 0) ``device_map="auto"`` may split the model
            over; ``None`` = GPU 0 alone when the plan fits there (the others stay free), else as many
            as it needs. A split holds a bigger model; it does not generate faster.
        kv_cache: the KV cache ``generate()`` keeps: ``"dynamic"`` (default), ``"fp8"``, ``"int4"``,
            ``"int2"`` (quantized; int4/int2 need optimum-quanto or hqq) or ``"offload"`` (in RAM, a few
            layers on the GPU); estimated, and set on the model's generation config by :func:`load`.
    """

    model: str
    load: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "auto"
    max_new_tokens: int = 256
    batch_size: int = 1
    prompt_tokens: int = 512
    device_map: str | dict | None = "auto"
    max_memory: dict | None = None
    offload_folder: str | None = None
    low_cpu_mem_usage: bool = True
    allow_offload: bool = False
    attn_implementation: str | None = "sdpa"
    trust_remote_code: bool = False
    adapter: str | None = None
    token: str | None = field(default=None, repr=False)  # never shown
    gpus: int | None = None
    kv_cache: str = "dynamic"

    def __post_init__(self):
        if not isinstance(self.model, str | os.PathLike) or not str(self.model).strip():
            raise ValueError(
                f"model must be a hub id such as 'Qwen/Qwen2.5-0.5B' or a local folder, got {self.model!r}"
            )
        self.model = str(self.model)
        if self.load not in (*LOAD_MODES, "auto"):
            hint = " (4-bit is 'nf4' or 'fp4')" if str(self.load).lower() in ("int4", "4bit", "4-bit") else ""
            raise ValueError(f"unknown load mode {self.load!r}{hint}; valid: {', '.join(LOAD_MODES)}")
        try:
            self.compute_dtype = dtype_name(self.compute_dtype)  # torch.float16, "float16", "half" ... -> "fp16"
        except ValueError as e:
            raise ValueError(f"compute_dtype: {e}") from None
        if self.gpus is not None and (isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1):
            raise ValueError(
                f"gpus must be a whole number >= 1 (or None: as many as the model needs), got {self.gpus!r}"
            )
        self._check_settings()
        self.kv_cache = kv_cache_name(self.kv_cache)
        if self.load == "auto":
            self.load = self._auto_load()

    def _check_settings(self) -> None:
        """The numbers, flags and placement fields, each refused with its name and value when wrong."""
        for name in ("max_new_tokens", "batch_size", "prompt_tokens"):
            whole_number(name, getattr(self, name), minimum=0 if name == "max_new_tokens" else 1)
        for name in ("double_quant", "low_cpu_mem_usage", "allow_offload", "trust_remote_code"):
            flag(name, getattr(self, name))
        dm = self.device_map
        if (dm is not None and not isinstance(dm, str | dict | int | torch.device)) or isinstance(dm, bool) or dm == "":
            raise ArgumentError(
                f"device_map must be 'auto' (or 'balanced', 'sequential'), a device such as 'cuda:0', a dict of "
                f"module names to devices, or None; got {dm!r}"
            )
        check_strategy(dm)
        if self.max_memory is not None and not isinstance(self.max_memory, dict):
            raise ArgumentError(
                f"max_memory must be a dict such as {{0: '14GiB', 'cpu': '30GiB'}} or None, got {self.max_memory!r}"
            )
        for name in ("offload_folder", "adapter"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str | os.PathLike) or not str(value).strip()):
                raise ArgumentError(f"{name} must be a folder path (or None), got {value!r}")
        attn = self.attn_implementation
        if attn is not None and (
            not isinstance(attn, str) or (attn not in ATTENTION_IMPLEMENTATIONS and "/" not in attn)
        ):
            raise ArgumentError(
                f"attn_implementation {attn!r} is unknown; use one of {', '.join(ATTENTION_IMPLEMENTATIONS)}, a "
                "hub kernel such as 'kernels-community/flash-attn', or None (transformers' default)"
            )

    def _auto_load(self) -> str:
        """What ``estimate(load="auto")`` picks for this plan on this machine: one meaning of "auto"."""
        try:
            chosen = self.estimate("current").load
        except (EstimateError, ValueError, OSError) as e:
            raise ValueError(
                f"load='auto' picks the widest load mode that fits this machine, which needs the config of "
                f"{self.model!r}: {e}. Or pass load= one of {', '.join(LOAD_MODES)}"
            ) from None
        if chosen not in LOAD_MODES:  # a pre-quantized checkpoint (GPTQ, AWQ): not a mode LoadPlan sets
            raise ValueError(f"load='auto': {self.model!r} is pre-quantized ({chosen}); pass load= explicitly")
        return chosen

    @property
    def quantized(self) -> bool:
        return self.load in QUANTIZED

    def replace(self, **changes) -> LoadPlan:
        """A copy with ``changes`` applied (validated like a new plan)."""
        _check_fields(changes)
        return dataclasses.replace(self, **changes)

    def resolved_compute_dtype(self, device: str | None = None) -> str:
        """The compute dtype name this plan uses on ``device`` (default: this machine)."""
        if self.compute_dtype != "auto":
            return self.compute_dtype
        if self.load in DTYPE_BYTES:
            return self.load
        return auto_compute_dtype(device)

    def weights_dtype(self, device: str | None = None) -> torch.dtype:
        """dtype of the unquantized tensors: the load mode itself, or the compute dtype for int8/4-bit."""
        return torch_dtype(self.load if self.load in DTYPE_BYTES else self.resolved_compute_dtype(device))

    def quantization_config(self, device: str | None = None):
        """``BitsAndBytesConfig`` for int8/nf4/fp4, ``None`` otherwise."""
        if not self.quantized:
            return None
        from transformers import BitsAndBytesConfig

        # llm_int8_enable_fp32_cpu_offload only along a device map that names the CPU or disk (yours, or the one
        # an offload the checks accepted loads: placement.DevicePlan.quantization_changes): transformers then
        # keeps those layers unquantized. Under device_map="auto" it would keep them quantized in RAM, where
        # accelerate's offload hook cannot run 4-bit ones
        offload = isinstance(self.device_map, dict) and bool({"cpu", "disk"} & set(map(str, self.device_map.values())))
        if self.load == "int8":
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=offload)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            llm_int8_enable_fp32_cpu_offload=offload,
            bnb_4bit_quant_type=self.load,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=torch_dtype(self.resolved_compute_dtype(device)),
        )

    def from_pretrained_kwargs(self, device: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``AutoModelForCausalLM.from_pretrained(plan.model, **kwargs)``.

        Uses the current API: ``quantization_config=BitsAndBytesConfig(...)`` and ``dtype=``
        (not the deprecated ``load_in_8bit=`` / ``torch_dtype=`` keywords of older guides).
        """
        kwargs: dict[str, Any] = {
            **from_pretrained_dtype(self.weights_dtype(device)),
            "trust_remote_code": self.trust_remote_code,
        }
        if self.device_map is not None:
            kwargs["device_map"] = self.device_map
        qc = self.quantization_config(device)
        if qc is not None:
            kwargs["quantization_config"] = qc
        if self.max_memory is not None:
            kwargs["max_memory"] = self.max_memory
        if self.offload_folder is not None:
            kwargs["offload_folder"] = self.offload_folder
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        if self.token is not None:
            kwargs["token"] = self.token
        if _transformers_major() < 5:  # transformers 5 always loads shard by shard and ignores the flag
            kwargs["low_cpu_mem_usage"] = self.low_cpu_mem_usage
        return kwargs

    def estimate(self, device: Any = "current", model: Any = None):
        """The :func:`helpers.estimator.estimate` of this plan (weights, KV cache, activations, overheads).

        Args:
            device: ``"current"`` (this machine: the GPU, or the CPU), a preset such as ``"t4"``, or bytes.
            model: what to estimate instead of ``self.model`` (a resolved config, to skip re-reading it).
        """
        return estimate_memory(
            self.model if model is None else model,
            load=self.load,
            double_quant=self.double_quant,
            compute_dtype=self.estimate_compute_dtype(device),
            batch_size=self.batch_size,
            prompt_tokens=self.prompt_tokens,
            max_new_tokens=self.max_new_tokens,
            device="cpu" if device == "current" and device_kind() != "cuda" else device,
            kv_cache=self.kv_cache,
        )

    def estimate_compute_dtype(self, device: Any = "current") -> str:
        """The compute dtype to estimate with: this machine's for ``"current"``, else the estimator's auto.

        An unquantized load computes in its own dtype whatever this says; "auto" is kept for it anyway,
        so a suggested switch to a 4-bit load is estimated with the compute dtype that load would get."""
        if self.compute_dtype != "auto":
            return self.resolved_compute_dtype()
        if device in ("current", None, "cpu"):
            return auto_compute_dtype("cpu" if device == "cpu" else None)
        return "auto"  # a preset or a byte count: the estimator picks fp16 or bf16 for that GPU

    def __str__(self) -> str:
        dq = " + double quant" if self.load in ("nf4", "fp4") and self.double_quant else ""
        return (
            f"LoadPlan({self.model}: {self.load}{dq}, compute {self.resolved_compute_dtype()}, "
            f"batch {self.batch_size} x ({self.prompt_tokens} prompt + {self.max_new_tokens} new tokens), "
            f"device_map={self.device_map!r}{'' if self.gpus is None else f', gpus={self.gpus}'})"
        )


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


# ----------------------------------------------------------------------------- checks


def _missing_path_error(kind: str, path: str, what: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"{kind} file not found: {path} does not exist ({what}).{nearest_existing(path)}{drive_hint(path)}",
        f"Pass the directory that holds {what}, or a hub id such as 'org/name'",
    )


def _check_fields(changes: dict) -> None:
    """A TypeError naming the LoadPlan fields that do not exist (and the nearest real one)."""
    import difflib

    names = [f.name for f in dataclasses.fields(LoadPlan)]
    unknown = [k for k in changes if k not in names]
    if unknown:
        near = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
        hints = "".join(f"; did you mean {v[0]}= for {k}=?" for k, v in near.items() if v)
        raise TypeError(f"unknown LoadPlan field(s) {', '.join(unknown)}{hints} Valid fields: {', '.join(names)}")


def check_model_source(model: str, token: str | None = None) -> str:
    """Where ``model`` comes from (``"local"``, ``"cache"``, ``"hub"``); raises :class:`LoadError` if unusable."""
    p = Path(model).expanduser()
    if p.exists():
        if p.is_dir() and not (p / "config.json").exists():
            raise ModelNotFoundError(
                f"Model file not found: {p} has no config.json, so it is not a saved model "
                f"(it holds: {', '.join(sorted(c.name for c in p.iterdir())[:8]) or 'nothing'})",
                "Point at the folder written by save_pretrained() (it has config.json)",
            )
        return "local"
    if looks_like_path(model):
        raise _missing_path_error("Model", model, "config.json and the weight files")
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(model, "config.json"), str):
            return "cache"
    except Exception:  # an invalid repo id: the hub check below says so
        pass
    return _check_hub(model, token)


def _hub_access(model: str, token: str | None) -> None:
    from huggingface_hub import auth_check

    auth_check(model, token=token)


def _check_hub(model: str, token: str | None) -> str:
    offline = hub_offline_reason()
    if offline:
        raise ModelNotFoundError(
            f"{model!r} is not a local path and is not in the Hugging Face cache, and this machine is offline "
            f"({offline}), so the hub cannot be asked whether the model exists",
            "Pass a local directory with config.json and the weights, or go online once to download it",
        )
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        _hub_access(model, token)
    except GatedRepoError:
        have = "the token this runtime has is not allowed" if token else "no Hugging Face token was found"
        raise LoadRefused(f"{model} is a gated model and {have}", TOKEN_HELP) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"Unknown model id {model!r}: the Hugging Face Hub has no such model (or it is private)",
            "Check the spelling (org/name, case-sensitive) on huggingface.co; for a private model, log in: "
            + TOKEN_HELP,
        ) from None
    except HFValidationError as e:
        raise ModelNotFoundError(
            f"{model!r} is neither an existing path nor a valid hub id: {e}",
            "Use a hub id such as 'Qwen/Qwen2.5-0.5B' or an existing local directory",
        ) from None
    return "hub"


def check_adapter(adapter: str) -> None:
    """Raise :class:`ModelNotFoundError` unless ``adapter`` is a PEFT adapter directory."""
    p = Path(adapter).expanduser()
    if not p.exists():
        if not looks_like_path(adapter) and "/" in adapter:
            return  # a hub adapter id; PEFT resolves it
        raise _missing_path_error("Adapter", adapter, "adapter_config.json and adapter_model.safetensors")
    if not p.is_dir():
        raise ModelNotFoundError(f"Adapter {p} is a file, not a folder", ADAPTER_FIX)
    if not (p / "adapter_config.json").exists():
        raise ModelNotFoundError(
            f"Adapter file not found: {p} has no adapter_config.json "
            f"(it holds: {', '.join(sorted(c.name for c in p.iterdir())[:8]) or 'nothing'})",
            ADAPTER_FIX,
        )
    _check_adapter_config(p / "adapter_config.json")
    _check_adapter_weights(p)


ADAPTER_FIX = "Point at the folder written by model.save_pretrained() (or save_adapter()) after LoRA training"


def _check_adapter_config(path: Path) -> None:
    """The adapter's config must be a JSON object naming a known PEFT type, with a positive rank."""
    from peft import PeftType

    try:
        cfg = read_json(path, "adapter_config.json")
    except SourceError as e:
        raise LoadError(f"Adapter config unreadable: {e}", ADAPTER_FIX) from None
    if not isinstance(cfg, dict):
        raise LoadError(f"Adapter config {path} holds a JSON {type(cfg).__name__}, not an object", ADAPTER_FIX)
    if cfg.get("peft_type") not in PeftType.__members__:
        raise LoadError(
            f"Adapter config {path}: peft_type {cfg.get('peft_type')!r} is not a PEFT adapter type (e.g. 'LORA')",
            ADAPTER_FIX,
        )
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
            raise LoadError(f"Adapter config {path}: {key} is {value!r}, not a positive number", ADAPTER_FIX)


def _check_adapter_weights(folder: Path) -> None:
    """The adapter's weight file must exist and (safetensors) have a readable header."""
    safe, bin_ = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if not safe.exists() and not bin_.exists():
        raise ModelNotFoundError(
            f"Adapter weights not found: {folder} has adapter_config.json but no adapter_model.safetensors "
            "(nor adapter_model.bin); the save was cut short or the file was not copied",
            ADAPTER_FIX,
        )
    if safe.exists():
        from safetensors import safe_open

        try:
            with safe_open(str(safe), framework="pt") as f:
                names = list(f.keys())
        except Exception as e:  # noqa: BLE001 - any failure to read the header means the same thing
            raise LoadError(
                f"Adapter weights {safe} are not a readable safetensors file ({str(e)[:120]})", ADAPTER_FIX
            ) from None
        if not names:
            raise LoadError(f"Adapter weights {safe} hold no tensors", ADAPTER_FIX)


def check_bitsandbytes(load: str, device: str, status: tuple[bool, str] | None = None) -> None:
    """Refuse 8-bit/4-bit when bitsandbytes is missing or cannot run on ``device``."""
    if load not in QUANTIZED:
        return
    if status is None:
        if importlib.util.find_spec("bitsandbytes") is None:
            status = (False, "bitsandbytes is not installed")
        else:
            status = bitsandbytes_status(device)
    ok, why = status
    if ok:
        return
    bits = "8-bit" if load == "int8" else "4-bit"
    if "not installed" in why:
        raise LoadRefused(f"{load} ({bits}) loading needs bitsandbytes, which is not installed", BNB_INSTALL)
    raise LoadRefused(
        f"{load} ({bits}) loading needs bitsandbytes, but it cannot run here: {why}",
        "Use a CUDA GPU runtime (Colab: Runtime > Change runtime type > T4 GPU) and "
        f"{BNB_INSTALL}; or load in fp16/bf16 instead",
    )


UNPLACED_BNB_OFFLOAD = (
    "bitsandbytes layers are offloaded only along a device map oomkit has checked, and this architecture's "
    "placement cannot be built (transformers' own would keep 4-bit layers quantized in RAM, where they cannot run)"
)


def check_fit(plan: LoadPlan, estimate, snap: MemorySnapshot) -> tuple[list[str], DevicePlan | None]:
    """Refuse plans that cannot fit; return warnings for plans that only fit by offloading, with the checked
    placement (GPU and CPU) such a plan loads with, so what was sized is what loads.

    On a GPU the estimate must fit the free GPU memory, or (with ``device_map="auto"``) what
    does not fit must fit in RAM. Without a GPU everything lives in RAM.
    """
    warnings: list[str] = []
    ram = snap.ram.available
    g = _mapped_gpu(plan, snap)
    if g is None:
        if estimate.total > ram:
            verdict = fit(estimate, device=ram)
            raise LoadRefused(
                f"the estimate ({format_bytes(estimate.total)}) is more than the "
                f"{format_bytes(ram)} of RAM available: the process would be killed",
                first_fix(verdict) or "Use a smaller model, or a GPU runtime and int8/nf4",
            )
        return warnings, None
    room = gpu_room(estimate, g)
    verdict = fit(estimate, device=gpu_device(g, room))
    if verdict.verdict != DOES_NOT_FIT:
        return placement_spill(plan, estimate, g, room, snap)
    fix = first_fix(verdict) or "Use int8 or nf4, a smaller batch or max_new_tokens, or a smaller model"
    if map_strategy(plan.device_map) is None:
        raise LoadRefused(
            f"the estimate ({format_bytes(estimate.total)}) does not fit the {format_bytes(g.free)} free on {g.name}",
            fix,
        )
    runtime = estimate.total - estimate.weights
    if runtime > room:
        raise LoadRefused(
            f"the KV cache, activations and overheads alone ({format_bytes(runtime)}) need more than "
            f"the {format_bytes(g.free)} free on {g.name}; offloading weights cannot help",
            fix,
        )
    return check_offload(plan, estimate, g, room, snap, fix)


def check_offload(
    plan: LoadPlan, estimate, g, room: int, snap: MemorySnapshot, fix: str
) -> tuple[list[str], DevicePlan | None]:
    """The estimate does not fit GPU ``g``: what ``device_map="auto"`` would offload, sized as the split over
    several GPUs sizes it (transformers' placement for the card, offloaded bitsandbytes layers counted
    unquantized: a Llama-2-13B nf4 3.4 GiB over a T4's free memory puts 15.7 GiB into RAM, as
    tests/test_loading.py checks). Refused when that does not fit the RAM offload may take, or without
    ``allow_offload``; else a warning, and the placement to load with: a device map naming the CPU is what
    makes transformers keep the offloaded bitsandbytes layers unquantized, as they were sized."""
    too_big = f"the estimate ({format_bytes(estimate.total)}) does not fit the {format_bytes(g.free)} free on {g.name}"
    if bnb_prequantized(estimate):
        raise LoadRefused(
            f"{too_big}, and {PREQUANTIZED_OFFLOAD}{held_hint(g)}", f"{fix}; or {PREQUANTIZED_OFFLOAD_FIX}"
        )
    ram, share = snap.ram.available, offload_ram(snap)
    try:
        placed = split_plan(estimate, [gpu_device(g, room)], ram=share, offload=True, disk=bool(plan.offload_folder),
                            offload_folder=plan.offload_folder)  # fmt: skip
        on_cpu, on_disk, reason = placed.offloaded("cpu"), placed.offloaded("disk"), next(iter(placed.reasons), None)
    except PlacementError:  # an architecture the meta device cannot build: the estimate's overflow, at RAM width
        if estimate.load in QUANTIZED:
            raise LoadRefused(f"{too_big}, and {UNPLACED_BNB_OFFLOAD}{held_hint(g)}", fix) from None
        placed = None
        on_cpu = offloaded_bytes(estimate, estimate.total - room, g.supports_bf16)
        on_disk, reason = 0, None
        if on_cpu > share and plan.offload_folder:  # what RAM cannot take goes to the folder
            on_cpu, on_disk = share, on_cpu - share
    offload = on_cpu + on_disk
    if on_cpu > share or (on_disk and not plan.offload_folder):
        raise LoadRefused(
            f"{too_big}, and the {format_bytes(offload)} of weights that would be offloaded"
            f"{unquantized_note(estimate, g.supports_bf16)} do not fit the {format_bytes(ram)} of RAM available "
            f"either (offload may take {format_bytes(share)}){held_hint(g)}",
            fix,
        )
    if reason is not None:  # 4-bit weights to disk, a card without room for its runtime
        raise LoadRefused(f"{too_big}, and {reason}{held_hint(g)}", fix)
    where = "disk" if on_disk else "CPU RAM"
    if not plan.allow_offload:
        raise LoadRefused(
            f"{too_big}: loading would offload about {format_bytes(offload)} of weights to {where}, and every "
            f"generated token would be much slower{held_hint(g)}",
            f"{fix}; or accept the slowdown: LoadPlan(..., allow_offload=True)",
        )
    warning = (f"about {format_bytes(offload)} of weights will be offloaded to {where}: generation will be much "
               f"slower. Better: {fix}")  # fmt: skip
    return [warning], placed


def ram_for_loading(snap: MemorySnapshot, total: int | None, largest: int | None, source: str) -> Check:
    """Whether RAM can hold the largest weight file while loading (the Colab kernel dies silently if not)."""
    avail = snap.ram.available
    if total is None:
        return Check(
            "RAM for loading", "info", f"{format_bytes(avail)} RAM available; checkpoint size unknown: {source}"
        )
    # A .bin shard is unpickled whole into the process's memory (and briefly copied): a shard larger
    # than free RAM kills a Colab kernel without a message. safetensors are read through a memory map,
    # one tensor at a time: measured on CPU, loading a single 509 MiB fp16 shard took 213 MiB of
    # process memory (tests/test_loading.py measures it), so only a shard past all free RAM is a risk.
    need = largest if memory_mapped(source) else int(largest * PICKLE_LOAD_FACTOR)
    data = {"available": avail, "checkpoint": total, "largest_shard": largest}
    if avail < need:
        return Check(
            "RAM for loading",
            "fail",
            f"{format_bytes(avail)} RAM available, the largest weight file is "
            f"{format_bytes(largest)}: the kernel would die while loading",
            "Use a checkpoint with smaller shards (e.g. a -sharded variant), free RAM (helpers.cleanup()), "
            "or a High-RAM runtime",
            data,
        )
    if avail < total:
        return Check(
            "RAM for loading",
            "warn",
            f"{format_bytes(avail)} RAM available, checkpoint is "
            f"{format_bytes(total)}: fine for GPU loading, but offloading layers to CPU will not fit",
            "Keep device_map on the GPU; quantize instead of offloading",
            data,
        )
    return Check(
        "RAM for loading",
        "pass",
        f"{format_bytes(avail)} RAM available for a {format_bytes(total)} checkpoint ({source})",
        data=data,
    )


def check_ram_for_loading(model: str, snap: MemorySnapshot) -> None:
    """Refuse when the largest weight file does not fit in RAM (the Colab kernel would die silently)."""
    check = ram_for_loading(snap, *checkpoint_size(model))  # a hub id: sizes from the hub's file list
    if check.status == "fail":
        raise LoadRefused(check.summary, check.fix)


def placement_spill(
    plan: LoadPlan, estimate, g, room: int, snap: MemorySnapshot
) -> tuple[list[str], DevicePlan | None]:
    """The estimate fits ``g``; the placement transformers computes for it may still push weights to the CPU
    (``spill_why``: accelerate keeps room for the largest layer; for int8/4-bit bitsandbytes keeps 10 % of the
    card's ``max_memory`` for its buffers). Placed with the RAM the load offers, as ``max_memory_for`` passes it: refuse that
    before loading, or warn with ``allow_offload`` and load the placement that was checked; never offload
    silently, never into too little RAM."""
    if map_strategy(plan.device_map) is None or plan.max_memory is not None:
        return [], None
    ram = offload_ram(snap)
    try:
        placed = split_plan(estimate, [gpu_device(g, room)], ram=ram, offload=True)
    except PlacementError:  # an architecture the meta device cannot build: the estimate decided
        return [], None
    spill = placed.offloaded("cpu") + placed.offloaded("disk")
    if not spill:
        return [], None
    fix = spill_fix(estimate)
    why = (f"the estimate ({format_bytes(estimate.total)}) fits the {format_bytes(g.free)} free on {g.name}, but "
           f"{spill_why(estimate)} leaves {format_bytes(spill)} of weights for CPU RAM")  # fmt: skip
    if not placed.fits:
        raise LoadRefused(f"{why}, and {placed.reasons[0]}", fix)
    if not plan.allow_offload:
        raise LoadRefused(f"{why}: every generated token would be much slower",
                          f"{fix}; or accept the slowdown: LoadPlan(..., allow_offload=True)")  # fmt: skip
    return [f"{why}: generation will be much slower. Better: {fix}"], placed


def check_prequantized_map(plan: LoadPlan, estimate) -> None:
    """Refuse a ``device_map`` of the user's that offloads part of a checkpoint saved quantized by bitsandbytes:
    transformers cannot load it so (``PREQUANTIZED_OFFLOAD``). Every module on the CPU is no offload."""
    if not bnb_prequantized(estimate) or not isinstance(plan.device_map, dict):
        return
    places = {str(v) for v in plan.device_map.values()}
    offloaded = sorted(places & {"cpu", "disk"})
    if offloaded and places != {"cpu"}:
        raise LoadRefused(
            f"the device_map puts part of {plan.model} on {' and '.join(offloaded)}, and {PREQUANTIZED_OFFLOAD}",
            "put every module on the GPU (device_map={'': 0}) with a smaller batch or max_new_tokens; "
            f"or {PREQUANTIZED_OFFLOAD_FIX}",
        )


def _mapped_gpu(plan: LoadPlan, snap: MemorySnapshot):
    """The GPU a one-card ``device_map`` names (``{"": 1}``, ``"cuda:1"``), GPU 0 otherwise; None without one."""
    index = map_gpu(plan.device_map) or 0
    if snap.gpus and index >= len(snap.gpus):
        raise LoadRefused(
            f"the device_map puts the model on GPU {index} and this machine has {len(snap.gpus)} GPU(s)",
            "device_map='auto' (GPU 0 first), or {'': 0}",
        )
    return snap.gpus[index] if snap.gpus else None


def max_memory_for(estimate, snap: MemorySnapshot) -> dict | None:
    """``max_memory`` for ``device_map="auto"`` that keeps room on the GPU for KV cache and activations."""
    g = snap.gpu
    if g is None:
        return None
    runtime = max(0, estimate.total - estimate.weights)  # KV cache, activations, CUDA context, margins
    gpu_cap = max(0, gpu_room(estimate, g) - runtime - GPU_MARGIN)
    return {g.index: gpu_cap, "cpu": offload_ram(snap)}


@dataclass
class PlanCheck:
    """The outcome of :func:`check_plan`: the estimate, where the model comes from, warnings."""

    plan: LoadPlan
    source: str
    estimate: Any = None
    warnings: list[str] = field(default_factory=list)
    max_memory: dict | None = None
    split: DevicePlan | None = None  # the checked placement loaded as is: over several GPUs, or one card + CPU
    notes: list[str] = field(default_factory=list)


def check_plan(
    plan: LoadPlan, *, snapshot: MemorySnapshot | None = None, bnb: tuple[bool, str] | None = None, estimate=None
) -> PlanCheck:
    """Every check :func:`load` runs before loading; raises :class:`LoadError` with the reason and fix.

    ``snapshot``, ``bnb`` (``(usable, why)``) and ``estimate`` replace what would be measured,
    so tests can simulate a T4 or a machine without bitsandbytes.
    """
    from .memory import snapshot as take_snapshot

    if not isinstance(plan, LoadPlan):
        raise ArgumentError(f"check_plan() checks a LoadPlan, got {plan!r:.60}: e.g. check_plan(LoadPlan('org/name'))")
    token = plan.token or _find_token()
    source = check_model_source(plan.model, token)
    if plan.adapter:
        check_adapter(plan.adapter)
    snap = snapshot if snapshot is not None else take_snapshot()
    device = "cuda" if snap.backend == "cuda" else ("mps" if snap.backend == "mps" else "cpu")
    check_bitsandbytes(plan.load, device, bnb)
    check_ram_for_loading(plan.model, snap)
    est = estimate if estimate is not None else plan.estimate("current")
    check_prequantized_map(plan, est)
    checked = PlanCheck(plan=plan, source=source, estimate=est, max_memory=plan.max_memory)
    decision = decide_gpus(plan, est, snap)  # None: one GPU (or none) decides, as below
    if decision is not None:
        checked.split, checked.warnings, checked.notes = decision.split, decision.warnings, decision.notes
        checked.max_memory = decision.max_memory if decision.max_memory is not None else plan.max_memory
        return checked
    checked.warnings, checked.split = check_fit(plan, est, snap)  # split: a one-card offload's GPU/CPU map
    checked.notes = other_gpus_note(plan, snap)
    if checked.max_memory is None and map_strategy(plan.device_map) is not None:
        checked.max_memory = max_memory_for(est, snap)
    return checked


def _find_token() -> str | None:
    try:
        from huggingface_hub import get_token  # reads HF_TOKEN, the login file and Colab secrets

        return get_token()
    except Exception:
        return None


# ----------------------------------------------------------------------------- the report


def placement(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of parameters, buffers and quantization state per device (``"cuda:0"``, ``"cpu"``,
    ``"disk"``, ``"meta"``): the same count as ``footprint(model)``, split by where it lives."""
    device_map = getattr(model, "hf_device_map", None) or {}
    out: dict[str, int] = {}
    if len(set(map(str, device_map.values()))) > 1:
        for name, dev in device_map.items():
            sub = model.get_submodule(name) if name else model
            key = f"cuda:{dev}" if isinstance(dev, int) else str(dev)
            out[key] = out.get(key, 0) + sum(footprint_by_device(sub).values())
        return out
    return footprint_by_device(model)


def _offload_warnings(where: dict[str, int]) -> list[str]:
    warnings = []
    on_cpu, on_disk = where.get("cpu", 0), where.get("disk", 0)
    if any(k.startswith("cuda") for k in where) and on_cpu:
        ms = on_cpu / PCIE_BYTES_PER_S * 1000
        warnings.append(
            f"{format_bytes(on_cpu)} of weights were offloaded to CPU RAM: every generated token "
            f"copies them to the GPU (~{ms:.0f} ms per token at {format_bytes(PCIE_BYTES_PER_S)}/s "
            "PCIe, typically 5-20x slower generation). Quantize (int8/nf4) to keep it all on the GPU."
        )
    if on_disk:
        s = on_disk / DISK_BYTES_PER_S
        warnings.append(
            f"{format_bytes(on_disk)} of weights were offloaded to disk: ~{s:.1f} s per generated "
            "token just to read them back. This is not a fix; use a smaller model or nf4."
        )
    return warnings


@dataclass(repr=False)
class LoadReport:
    """Estimated vs measured memory of a load, how long it took, where modules went, and warnings."""

    plan: LoadPlan
    estimated_weights: int
    measured_weights: int
    estimated_total: int
    load_seconds: float
    placement: dict[str, int]
    cuda_allocated: int | None = None  # memory_allocated() growth during the load, all GPUs (CUDA only)
    adapter_bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    estimate: Any = field(default=None, repr=False)
    tokenizer_note: str = ""
    split: DevicePlan | None = field(default=None, repr=False)  # the placement over several GPUs, if planned
    notes: list[str] = field(default_factory=list)

    @property
    def weights_error(self) -> float | None:
        """(measured - estimated) / estimated weights, in percent."""
        return percent(self.measured_weights - self.estimated_weights, self.estimated_weights)

    def rows(self) -> list[list[str]]:
        err = self.weights_error
        rows = [
            [
                "weights",
                format_bytes(self.estimated_weights),
                format_bytes(self.measured_weights),
                "n/a" if err is None else f"{err:+.2f} %",
            ]
        ]
        if self.cuda_allocated is not None:
            rows.append(
                [
                    "CUDA allocated by the load",
                    format_bytes(self.estimated_weights),
                    format_bytes(self.cuda_allocated),
                    f"{percent(self.cuda_allocated - self.estimated_weights, self.estimated_weights):+.2f} %",
                ]
            )
        if self.adapter_bytes:
            rows.append(["adapter", "", format_bytes(self.adapter_bytes), ""])
        rows.append(["total while generating (estimate)", format_bytes(self.estimated_total), "", ""])
        return rows

    def placement_rows(self) -> list[list[str]]:
        """Per device: the bytes measured there, and the split's estimate when the load was split."""
        planned = {}
        if self.split is not None:
            planned = {(f"cuda:{s.device}" if isinstance(s.device, int) else str(s.device)): s.weights
                       for s in self.split.shares if s.weights}  # fmt: skip
        keys = list(dict.fromkeys([*planned, *self.placement]))
        return [[k, format_bytes(planned[k]) if k in planned else "", format_bytes(self.placement.get(k, 0))]
                for k in keys]  # fmt: skip

    def __str__(self) -> str:
        head = f"loaded {self.plan.model} as {self.plan.load} in {self.load_seconds:.1f} s"
        lines = [head]
        for name, est, meas, err in self.rows():
            lines.append(f"  {name:<36} estimated {est or '-':>11}  measured {meas or '-':>11}  {err}")
        if self.split is None:
            lines.append("  placement: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.placement.items()))
        else:
            lines += [f"  {'on ' + dev:<36} estimated {est or '-':>11}  measured {meas:>11}"
                      for dev, est, meas in self.placement_rows()]  # fmt: skip
        if self.tokenizer_note:
            lines.append(f"  tokenizer: {self.tokenizer_note}")
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)

    def __repr__(self) -> str:  # the text a notebook shows without HTML (papermill, a terminal)
        return self.__str__()

    def _repr_html_(self) -> str:
        from html import escape

        title = f"{self.plan.model} as {self.plan.load}, loaded in {self.load_seconds:.1f} s"
        html = table(["", "estimated", "measured", "difference"], self.rows(), title=title)
        if self.split is None:
            html += table(["device", "bytes"], [[k, format_bytes(v)] for k, v in self.placement.items()],
                          title="where the weights went")  # fmt: skip
        else:
            html += table(["device", "estimated", "measured"], self.placement_rows(), title="where the weights went")
        for n in self.notes:
            html += f"<div style='font-family:monospace'>{escape(n)}</div>"
        for w in self.warnings:
            html += f"<div style='font-family:monospace'>{colored('⚠ ' + w, 'warn')}</div>"
        return html


# ----------------------------------------------------------------------------- loading


def setup_tokenizer(tokenizer, model=None):
    """Make a tokenizer ready for batched generation: a pad token and left padding (decoder-only).

    Returns a one-line note of what was changed.
    """
    notes = []
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
            notes.append("added a <pad> token")
        else:
            tokenizer.pad_token = fallback
            notes.append(f"pad token = {fallback!r} (it had none)")
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    if not encoder_decoder and tokenizer.padding_side != "left":
        # right padding puts pad tokens between a prompt and its continuation
        tokenizer.padding_side = "left"
        notes.append("left padding for batched generation")
    if model is not None and getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return "; ".join(notes) or "ready (pad token and padding side already set)"


def model_class(model: str, trust_remote_code: bool = False, token: str | None = None):
    """The transformers Auto class that loads ``model``: AutoModelForCausalLM, AutoModelForSeq2SeqLM (T5,
    BART), AutoModelForSpeechSeq2Seq (Whisper) or AutoModelForImageTextToText (LLaVA, Qwen2-VL), as
    :func:`helpers.estimator.families.auto_class` decides from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, token=token)
    except Exception:  # from_pretrained itself then says what is wrong with the checkpoint
        return AutoModelForCausalLM
    return auto_class(config)


def _attn_supported(model: str, attn: str | None, trust_remote_code: bool) -> str | None:
    """Keep ``attn`` (``"sdpa"``) when the architecture supports it, else let transformers pick."""
    if attn != "sdpa":
        return attn
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        cls = auto_class(config)._model_mapping[type(config)]
        return "sdpa" if getattr(cls, "_supports_sdpa", False) else None
    except Exception:
        return None


def load(
    plan: LoadPlan | str,
    *,
    check: bool = True,
    snapshot: MemorySnapshot | None = None,
    bnb: tuple[bool, str] | None = None,
    **plan_changes,
):
    """Check ``plan``, load the model and tokenizer, and report estimated vs measured memory.

    Args:
        plan: a :class:`LoadPlan` (or a model id/path, with ``plan_changes`` as its fields).
        check: run the pre-load checks (model exists, bitsandbytes, fit, RAM); ``False`` skips
            the fit and RAM refusals (you accept the risk) but still checks paths and bitsandbytes.
        snapshot, bnb: simulate a device (see :func:`check_plan`).

    Returns:
        ``(model, tokenizer, LoadReport)``.

    Raises:
        LoadError (``ModelNotFoundError`` or ``LoadRefused``) with the reason and the fix.
    """
    from transformers import AutoTokenizer

    if isinstance(plan, str | os.PathLike):
        _check_fields(plan_changes)
        plan = LoadPlan(str(plan), **plan_changes)
    elif not isinstance(plan, LoadPlan):
        raise TypeError(
            f"load() takes a LoadPlan or a model id/path, got {type(plan).__name__} {plan!r:.60}: "
            "e.g. load('Qwen/Qwen2.5-0.5B', load='nf4') or load(LoadPlan(...))"
        )
    elif plan_changes:
        plan = plan.replace(**plan_changes)
    checked = _checked(plan, check, snapshot, bnb)
    est = checked.estimate
    kwargs, token = _run_kwargs(plan, checked)
    cuda = torch.cuda.is_available()
    before = allocated("all") if cuda else 0
    started = time.perf_counter()
    model = _from_pretrained(plan.model, kwargs, est)
    keep_4bit_layout(model)  # what footprint() measures now is what generation and training see
    use_kv_cache(model, plan.kv_cache)
    attention = keep_attention_fused(model)
    tokenizer = AutoTokenizer.from_pretrained(plan.model, token=token, trust_remote_code=plan.trust_remote_code)
    measured = footprint(model)
    where = placement(model)
    model, adapter_bytes = _with_adapter(model, plan.adapter, measured)
    seconds = time.perf_counter() - started
    note = setup_tokenizer(tokenizer, model)
    model.eval()
    report = LoadReport(
        plan=plan,
        estimated_weights=est.weights,
        measured_weights=measured,
        estimated_total=est.total,
        load_seconds=seconds,
        placement=where,
        cuda_allocated=(allocated("all") - before) if cuda else None,
        adapter_bytes=adapter_bytes,
        warnings=[*checked.warnings, *_offload_warnings(where)],
        estimate=est,
        tokenizer_note=note,
        split=checked.split,
        notes=[*checked.notes, *([attention] if attention else [])],
    )
    return model, tokenizer, report


def _checked(plan: LoadPlan, check: bool, snapshot: MemorySnapshot | None, bnb) -> PlanCheck:
    """The pre-load checks (all of them, or with ``check=False`` only paths, adapter and bitsandbytes)."""
    if check:
        return check_plan(plan, snapshot=snapshot, bnb=bnb)
    token = plan.token or _find_token()
    checked = PlanCheck(plan, check_model_source(plan.model, token), plan.estimate("current"))
    if plan.adapter:
        check_adapter(plan.adapter)
    check_bitsandbytes(plan.load, device_kind(), bnb)
    check_prequantized_map(plan, checked.estimate)  # a certain failure, not a risk to accept
    return checked


def _run_kwargs(plan: LoadPlan, checked: PlanCheck) -> tuple[dict[str, Any], str | None]:
    """``from_pretrained`` keyword arguments for the checked plan, and the hub token to use."""
    run_plan = plan.replace(
        max_memory=checked.max_memory,
        attn_implementation=_attn_supported(plan.model, plan.attn_implementation, plan.trust_remote_code),
    )
    if run_plan.token is None:
        run_plan.token = _find_token()
    # a split loads the map that was checked card by card (transformers would compute the same one)
    kwargs = (
        run_plan.from_pretrained_kwargs() if checked.split is None else checked.split.from_pretrained_kwargs(run_plan)
    )
    _keep_vision_unquantized(plan, kwargs)
    if checked.estimate.quantized_by is not None:  # the checkpoint's own config decides (transformers warns)
        # nor is llm_int8_enable_fp32_cpu_offload passed another way: the checks refused any offload of a
        # bitsandbytes checkpoint, which transformers cannot load (placement.PREQUANTIZED_OFFLOAD)
        kwargs.pop("quantization_config", None)
    if device_kind() != "cuda" and (map_strategy(kwargs.get("device_map")) or checked.split is not None):
        # nothing to place on a CPU-only machine (a split here was planned for a simulated one)
        kwargs["device_map"] = None
        kwargs.pop("max_memory", None)
    return kwargs, run_plan.token


def _keep_vision_unquantized(plan: LoadPlan, kwargs: dict[str, Any]) -> None:
    """A VLM's vision tower and projector stay in 16 bits in an int8/4-bit load, as the estimate counts them."""
    qc = kwargs.get("quantization_config")
    if qc is None:
        return
    try:
        skip = quantization_skip_modules(resolve_config(plan.model)[0])
    except (EstimateError, OSError, ValueError):
        return
    if skip:
        qc.llm_int8_skip_modules = skip


def _from_pretrained(model: str, kwargs: dict[str, Any], est):
    """``from_pretrained`` of the model's family class (:func:`model_class`); the refusal transformers gives
    when its own placement offloads part of a checkpoint saved quantized by bitsandbytes (a ``max_memory``
    with a CPU share: the checks predicted no offload) becomes oomkit's, with the fix."""
    cls = model_class(model, kwargs.get("trust_remote_code", False), kwargs.get("token"))
    try:
        return cls.from_pretrained(model, **kwargs)
    except ValueError as e:
        if "llm_int8_enable_fp32_cpu_offload" not in str(e):
            raise
        if bnb_prequantized(est):
            raise LoadRefused(
                f"transformers' placement put part of {model} on the CPU or disk, and {PREQUANTIZED_OFFLOAD}",
                "free GPU memory (unload an earlier model), a smaller batch or max_new_tokens; "
                f"or {PREQUANTIZED_OFFLOAD_FIX}",
            ) from None
        raise LoadRefused(  # the checks predicted no offload; transformers' own placement disagrees
            f"transformers' placement would put part of {model} on the CPU or disk, which the checks did not "
            "predict (they refuse or announce every offload)",
            f"free GPU memory (unload an earlier model); or {spill_fix(est)}",
        ) from None


def _with_adapter(model, adapter: str | None, base_bytes: int):
    """``model`` with the PEFT adapter at ``adapter`` attached (if any), and the adapter's bytes."""
    if not adapter:
        return model, 0
    from peft import PeftModel

    _check_adapter_base(model, adapter)
    with warnings.catch_warnings():
        # peft still calls transformers' old name (is_gradient_checkpointing): same feature
        warnings.filterwarnings("ignore", message=".*checkpointing.* is deprecated", category=FutureWarning)
        try:
            model = PeftModel.from_pretrained(model, adapter)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:  # peft's own words are kept, shortened
            base = _adapter_base(adapter)
            raise LoadError(
                f"Adapter {adapter} does not fit this model{f' (it was trained on {base!r})' if base else ''}: "
                f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                "load the base model the adapter was trained on, or train an adapter for this one",
            ) from None
    return model, footprint(model) - base_bytes


# the config fields that tell one base model from another (an adapter is tied to its base's shapes and words)
BASE_IDENTITY = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")


def _check_adapter_base(model, adapter: str) -> None:
    """Refuse an adapter whose adapter_config.json names a base model (a local folder or a shipped config)
    that differs from ``model`` in architecture or size: its weights would load silently where shapes match
    (a qwen2 adapter on a llama) and mean nothing."""
    base = _adapter_base(adapter)
    if not base:
        return
    folder = Path(base).expanduser()
    source = folder / "config.json" if (folder / "config.json").is_file() else shipped_config(base)
    if source is None:
        return  # a hub id not at hand: its config cannot be compared offline
    try:
        base_config = read_json(source, "config.json")
    except SourceError:
        return
    ours = model.config.to_dict() if hasattr(model, "config") else {}
    differ = [
        f"{k} {base_config[k]!r} (adapter's base) vs {ours[k]!r} (this model)"
        for k in BASE_IDENTITY
        if k in base_config and k in ours and base_config[k] != ours[k]
    ]
    if differ:
        raise LoadError(
            f"Adapter {adapter} was trained on {base!r}, another base model: {'; '.join(differ)}",
            f"load {base!r} (the base the adapter was trained on) with adapter={adapter!r}, or train an adapter "
            "for this model",
        )


def _adapter_base(adapter: str) -> str | None:
    try:
        return json.loads((Path(adapter).expanduser() / "adapter_config.json").read_text()).get(
            "base_model_name_or_path"
        )
    except (OSError, ValueError, AttributeError):
        return None


def keep_4bit_layout(model: torch.nn.Module) -> int:
    """Keep bitsandbytes' 4-bit layers in the layout they were loaded in, on CPU; the layers restored.

    On CPUs with AVX512-bf16, bitsandbytes repacks a ``Linear4bit``'s weight for a faster CPU kernel
    at its first inference forward and keeps it that way: the absmax goes to bf16 (rounded, and the
    double-quantized state expanded, so the footprint changes under the estimate), and the kernel
    (``gemv_4bit``) has no autograd, so a later training step passes no gradient through the frozen
    layer ("an autograd kernel was not registered ... silently incorrect") and the adapters below
    it get none. This turns the repacking off for these layers and undoes any that already happened
    (bitsandbytes' own inverse). GPUs never repack; there it changes nothing.
    """
    restored = 0
    for module in model.modules():
        if not hasattr(module, "support_avx512bf16_for_cpu"):
            continue
        module.support_avx512bf16_for_cpu = False
        state = getattr(module.weight, "quant_state", None)
        if getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu_inverse(
                module.weight.data, state
            )
            restored += 1
    return restored


@torch.inference_mode()
def generate_batched(
    model,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 4,
    progress: bool = True,
    stream: bool = False,
    **generate_kwargs,
) -> list[str]:
    """Generate for ``prompts`` in batches of ``batch_size`` with a tqdm bar; returns only the new text.

    ``stream=True`` prints the first prompt's answer token by token while its batch runs."""
    # the arguments are checked by generation.generate_batched; int8 with fp32 compute (CPU) casts to fp16 inside every layer and logs it on every call
    bnb_log = logging.getLogger("bitsandbytes.autograd._functions")
    quiet = _DropMessage("MatMul8bitLt: inputs will be cast")
    bnb_log.addFilter(quiet)
    try:
        return generation.generate_batched(
            model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, progress=progress,
            stream=stream, **generate_kwargs,
        )  # fmt: skip
    finally:
        bnb_log.removeFilter(quiet)


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)
