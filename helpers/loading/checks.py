"""The checks :func:`helpers.load` runs before touching any weights: the model and adapter exist,
bitsandbytes can run, the model has a place (on one GPU, split, or offloaded, as
:func:`helpers.decide_placement` decides), RAM can hold the largest weight file;
:func:`check_plan` runs them all and returns a :class:`PlanCheck`, or raises :class:`LoadError` with the
reason and the fix.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.arguments import ArgumentError
from ..core.checks import Check
from ..core.devices import bitsandbytes_status
from ..core.errors import LoadError, LoadRefused, ModelNotFoundError  # defined there so gpu_split can refuse
from ..core.memory import MemorySnapshot
from ..core.sources import (
    SourceError,
    checkpoint_size,
    drive_hint,
    hub_offline_reason,
    looks_like_path,
    memory_mapped,
    nearest_existing,
    read_json,
)
from ..core.units import format_bytes
from ..core.vocab import MODES, QUANTIZED
from ..placement.decision import PlacementDecision, decide_placement
from ..placement.device_plan import PREQUANTIZED_OFFLOAD, PREQUANTIZED_OFFLOAD_FIX, DevicePlan, bnb_prequantized
from .plan import LoadPlan

__all__ = ["check_plan", "PlanCheck", "check_model_source", "check_adapter", "check_bitsandbytes", "ram_for_loading",
           "check_ram_for_loading", "check_prequantized_map", "find_token"]  # fmt: skip

BNB_INSTALL = "pip install -U bitsandbytes   (in a notebook: %pip install -U bitsandbytes, then restart the runtime)"
TOKEN_HELP = (
    "Accept the model's licence on its Hugging Face page, then give this runtime a token: in Colab, "
    "add a secret named HF_TOKEN (key icon in the left bar) and allow notebook access; elsewhere set the "
    "HF_TOKEN environment variable or run `huggingface-cli login`"
)
# torch.load of a .bin shard holds it whole plus part of a copy while tensors are moved.
PICKLE_LOAD_FACTOR = 1.2


def _missing_path_error(kind: str, path: str, what: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"{kind} file not found: {path} does not exist ({what}).{nearest_existing(path)}{drive_hint(path)}",
        f"Pass the directory that holds {what}, or a hub id such as 'org/name'",
    )


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
    bits = f"{MODES[load].bits}-bit"
    if "not installed" in why:
        raise LoadRefused(f"{load} ({bits}) loading needs bitsandbytes, which is not installed", BNB_INSTALL)
    raise LoadRefused(
        f"{load} ({bits}) loading needs bitsandbytes, but it cannot run here: {why}",
        "Use a CUDA GPU runtime (Colab: Runtime > Change runtime type > T4 GPU) and "
        f"{BNB_INSTALL}; or load in fp16/bf16 instead",
    )


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


# What transformers needs to load a GPTQ or AWQ checkpoint (transformers/quantizers/quantizer_gptq.py and
# quantizer_awq.py): optimum's GPTQ quantizer and gptqmodel's kernels (CPU ones too), gptqmodel for AWQ.
PREQUANTIZED_BACKENDS = {"gptq": ("optimum", "gptqmodel"), "awq": ("gptqmodel",)}


def check_prequantized_backend(plan: LoadPlan) -> None:
    """Refuse a GPTQ/AWQ checkpoint this environment cannot load, before any weight is read, naming what to
    install (transformers would raise its ImportError only once the download is under way)."""
    needs = PREQUANTIZED_BACKENDS.get(plan.load, ())
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if missing:
        raise LoadRefused(
            f"{plan.model} is saved quantized with {plan.load.upper()}: loading it needs {' and '.join(missing)}, "
            "which is not installed",
            f"pip install {' '.join(missing)} (then restart the runtime); or load the original, unquantized model "
            "with load='nf4' (bitsandbytes quantizes it while loading)",
        )


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
    decision: PlacementDecision | None = None  # where the model goes (decide_placement); None with check=False


def check_plan(
    plan: LoadPlan, *, snapshot: MemorySnapshot | None = None, bnb: tuple[bool, str] | None = None, estimate=None
) -> PlanCheck:
    """Every check :func:`load` runs before loading; raises :class:`LoadError` with the reason and fix.

    ``snapshot``, ``bnb`` (``(usable, why)``) and ``estimate`` replace what would be measured,
    so tests can simulate a T4 or a machine without bitsandbytes.
    """
    from ..core.memory import snapshot as take_snapshot

    if not isinstance(plan, LoadPlan):
        raise ArgumentError(f"check_plan() checks a LoadPlan, got {plan!r:.60}: e.g. check_plan(LoadPlan('org/name'))")
    token = plan.token or find_token()
    source = check_model_source(plan.model, token)
    if plan.adapter:
        check_adapter(plan.adapter)
    snap = snapshot if snapshot is not None else take_snapshot()
    device = "cuda" if snap.backend == "cuda" else ("mps" if snap.backend == "mps" else "cpu")
    check_bitsandbytes(plan.load, device, bnb)
    check_ram_for_loading(plan.model, snap)
    check_prequantized_backend(plan)
    est = estimate if estimate is not None else plan.estimate("current")
    check_prequantized_map(plan, est)
    decision = decide_placement(plan, est, snap)
    decision.raise_refusal()
    return PlanCheck(plan=plan, source=source, estimate=est, warnings=decision.warnings, notes=decision.notes,
                     max_memory=plan.max_memory if decision.max_memory is None else decision.max_memory,
                     split=decision.plan, decision=decision)  # fmt: skip


def find_token() -> str | None:
    """The Hugging Face token this runtime has (HF_TOKEN, the login file, a Colab secret), or None."""
    try:
        from huggingface_hub import get_token  # reads HF_TOKEN, the login file and Colab secrets

        return get_token()
    except Exception:
        return None
