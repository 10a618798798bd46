"""What to load and how: :class:`LoadPlan` (load mode, compute dtype, generation budget, placement), its
checks, its estimate and the ``from_pretrained`` keyword arguments it makes in the current transformers API
(``quantization_config=BitsAndBytesConfig(...)``, ``dtype=``); :func:`auto_compute_dtype`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import devices
from ..core.arguments import ArgumentError, flag, whole_number
from ..core.compat import from_pretrained_dtype
from ..core.devices import (
    device_kind,
)
from ..core.units import parse_bytes
from ..core.vocab import (
    DEFAULTS,
    DTYPE_BYTES,
    FOUR_BIT,
    LOAD_MODES,
    MODES,
    PREQUANTIZED,
    QUANTIZED,
    dtype_name,
    kv_cache_name,
    load_mode_name,
    torch_dtype,
)
from ..estimator.core import estimate as estimate_memory
from ..estimator.rows import EstimateError
from ..placement.gpu_room import check_strategy

# what transformers' attn_implementation takes (a hub kernel "org/name" too)
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")

__all__ = ["LoadPlan", "auto_compute_dtype", "check_fields", "ATTENTION_IMPLEMENTATIONS"]


def auto_compute_dtype(device: str | None = None) -> str:
    """fp16 on pre-Ampere GPUs (T4, V100), bf16 on Ampere and later, fp16 on MPS, fp32 on CPU."""
    return devices.compute_dtype_rule(device or device_kind())


_MAX_MEMORY_DEVICES = ("cpu", "disk", "mps")  # besides GPU indices: what accelerate's max_memory keys name


def check_max_memory(max_memory: dict | None) -> None:
    """Refuse a ``max_memory`` that accelerate would reject mid-load or read wrongly: keys are GPU indices
    (0, 1, ...), "cpu", "disk" or "mps"; values are bytes (an int >= 0) or a size such as "14GiB"."""
    for key, cap in (max_memory or {}).items():
        gpu = isinstance(key, int) and not isinstance(key, bool) and key >= 0
        if not gpu and key not in _MAX_MEMORY_DEVICES:
            hint = f" (for {key} write {key.split(':')[-1]})" if isinstance(key, str) and key[-1:].isdigit() else ""
            raise ArgumentError(
                f"max_memory key {key!r}: use a GPU index (0, 1, ...) or one of {', '.join(_MAX_MEMORY_DEVICES)}{hint}"
            )
        if isinstance(cap, str):
            try:
                size = parse_bytes(cap)
            except ValueError:
                size = -1
        else:
            size = cap if isinstance(cap, int) and not isinstance(cap, bool) else -1
        if size < 0:
            raise ArgumentError(
                f"max_memory[{key!r}] = {cap!r:.40}: a cap is bytes (an int >= 0) or a size such as '14GiB'"
            )


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
        allow_pickle: accept a local pickle ``.bin`` checkpoint (loading a pickle can run code the file
            holds); by default only safetensors load from a local folder. A pickle that imports anything
            but tensors is refused either way.
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
    max_new_tokens: int = DEFAULTS.max_new_tokens
    batch_size: int = DEFAULTS.batch_size
    prompt_tokens: int = DEFAULTS.prompt_tokens
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
    allow_pickle: bool = False

    def __post_init__(self):
        if not isinstance(self.model, str | os.PathLike) or not str(self.model).strip():
            raise ValueError(
                f"model must be a hub id such as 'Qwen/Qwen2.5-0.5B' or a local folder, got {self.model!r}"
            )
        self.model = str(self.model)
        if not (isinstance(self.load, str) and self.load.lower() in PREQUANTIZED):  # a GPTQ/AWQ repo loads as saved
            self.load = load_mode_name(self.load, auto=True, error=ValueError)
        self.load = self.load.lower()
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
        for name in ("double_quant", "low_cpu_mem_usage", "allow_offload", "trust_remote_code", "allow_pickle"):
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
        check_max_memory(self.max_memory)
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
        return chosen  # a load mode, or a GPTQ/AWQ checkpoint's own ("gptq", "awq"): it loads as saved

    @property
    def quantized(self) -> bool:
        return self.load in QUANTIZED

    def replace(self, **changes) -> LoadPlan:
        """A copy with ``changes`` applied (validated like a new plan)."""
        check_fields(changes)
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
        mode = MODES[self.load]
        if not mode.four_bit:
            return BitsAndBytesConfig(**mode.bnb, llm_int8_enable_fp32_cpu_offload=offload)
        return BitsAndBytesConfig(
            **mode.bnb,
            llm_int8_enable_fp32_cpu_offload=offload,
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
        """The :func:`helpers.estimate` of this plan (weights, KV cache, activations, overheads).

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
        dq = " + double quant" if self.load in FOUR_BIT and self.double_quant else ""
        return (
            f"LoadPlan({self.model}: {self.load}{dq}, compute {self.resolved_compute_dtype()}, "
            f"batch {self.batch_size} x ({self.prompt_tokens} prompt + {self.max_new_tokens} new tokens)"
            f"{'' if self.kv_cache in (None, 'dynamic') else f', KV cache {self.kv_cache}'}, "
            f"device_map={self.device_map!r}{'' if self.gpus is None else f', gpus={self.gpus}'})"
        )


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def check_fields(changes: dict) -> None:
    """A TypeError naming the LoadPlan fields that do not exist (and the nearest real one)."""
    import difflib

    names = [f.name for f in dataclasses.fields(LoadPlan)]
    unknown = [k for k in changes if k not in names]
    if unknown:
        near = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
        hints = "".join(f"; did you mean {v[0]}= for {k}=?" for k, v in near.items() if v)
        raise TypeError(f"unknown LoadPlan field(s) {', '.join(unknown)}{hints} Valid fields: {', '.join(names)}")
