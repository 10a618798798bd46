"""The checks :func:`helpers.load` runs before touching any weights: the model and adapter exist,
bitsandbytes can run, the model has a place (on one GPU, split, or offloaded, as
:func:`helpers.decide_placement` decides), RAM can hold the largest weight file;
:func:`check_plan` runs them all and returns a :class:`PlanCheck`, or raises :class:`LoadError` with the
reason and the fix.
"""

from __future__ import annotations

import importlib.util
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.arguments import ArgumentError
from ..core.checks import Check
from ..core.devices import bitsandbytes_status
from ..core.errors import LoadError, LoadRefused, ModelNotFoundError  # defined there so gpu_split can refuse
from ..core.memory import MemorySnapshot
from ..core.sources import (
    BIN_INDEX,
    SAFE_INDEX,
    NetBudget,
    NetError,
    SourceError,
    checkpoint_size,
    drive_hint,
    http_get,
    hub_offline_reason,
    looks_like_path,
    memory_mapped,
    nearest_existing,
    read_json,
    weight_files,
)
from ..core.units import format_bytes
from ..core.vocab import MODES, QUANTIZED

if TYPE_CHECKING:  # imported where used: preflight's RAM and file checks come before anything imports torch
    from ..placement.decision import PlacementDecision
    from ..placement.device_plan import DevicePlan
    from .plan import LoadPlan

__all__ = ["check_plan", "PlanCheck", "check_model_source", "check_adapter", "check_bitsandbytes", "ram_for_loading",
           "check_ram_for_loading", "check_prequantized_map", "find_token", "weight_file_check",
           "check_weight_files"]  # fmt: skip

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
    """What ``huggingface_hub.auth_check`` asks (``/api/models/<id>/auth-check``), in one bounded request
    (:func:`helpers.sources.http_get`: a stalled mirror is a :class:`NetError` at the deadline, not a hang);
    raises huggingface_hub's own errors for its answer (gated, not found, malformed id)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import hf_raise_for_status, validate_repo_id

    validate_repo_id(model)
    url = f"{constants.ENDPOINT.rstrip('/')}/api/models/{urllib.parse.quote(model, safe='/')}/auth-check"
    headers = {"User-Agent": "oomkit"} | ({"Authorization": f"Bearer {token}"} if token else {})
    reply = http_get(url, NetBudget(max_bytes=1 << 20), headers=headers, max_bytes=1 << 20)
    http = _hub_http_library()  # the response type the installed huggingface_hub reads
    request = http.Request("GET", url)
    hf_raise_for_status(http.Response(reply.status, headers=reply.headers, content=reply.body, request=request))


def _hub_http_library():
    """huggingface_hub 2.x speaks httpx2, 1.x httpx (transformers 5 needs one of them): Colab's and the
    lowest supported versions differ from the newest."""
    try:
        import httpx2

        return httpx2
    except ImportError:
        import httpx

        return httpx


def _check_hub(model: str, token: str | None) -> str:
    offline = hub_offline_reason()
    if offline:
        raise ModelNotFoundError(
            f"{model!r} is not a local path and is not in the Hugging Face cache, and this machine is offline "
            f"({offline}), so the hub cannot be asked whether the model exists",
            "Pass a local directory with config.json and the weights, or go online once to download it",
        )
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError

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
    except (NetError, HfHubHTTPError) as e:  # a stalled or failing hub (or HF_ENDPOINT mirror)
        raise LoadRefused(
            f"the hub did not say whether {model!r} can be loaded: {(str(e).splitlines() or [''])[0][:200]}",
            "Try again in a minute; check the network (and HF_ENDPOINT, if set), or pass a local folder",
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
    from ..placement.device_plan import PREQUANTIZED_OFFLOAD, PREQUANTIZED_OFFLOAD_FIX, bnb_prequantized

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
    from ..placement.decision import decide_placement
    from .plan import LoadPlan

    if not isinstance(plan, LoadPlan):
        raise ArgumentError(f"check_plan() checks a LoadPlan, got {plan!r:.60}: e.g. check_plan(LoadPlan('org/name'))")
    token = plan.token or find_token()
    source = check_model_source(plan.model, token)
    check_weight_files(plan.model, allow_pickle=plan.allow_pickle)
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


# What load() opens of a local checkpoint, opened first: transformers reads each safetensors header
# (safe_open) and torch.load()s each pickle, and either raises a raw library error on a bad file
REDOWNLOAD = "download or copy the checkpoint again: an interrupted download or copy leaves a short file"
PICKLE_FIX = (
    "use the model's safetensors files (model.safetensors) or convert the checkpoint where you trust it; "
    "if you trust where this file came from, pass allow_pickle=True"
)
# bytes per element of each safetensors dtype (the safetensors format's Dtype list)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}  # fmt: skip


def _header_problem(f: Path, size: int) -> tuple[int, dict] | str:
    """``(header length, tensors)`` of a safetensors file, or a sentence saying why it has no header."""
    from ..estimator.hub_headers import MAX_HEADER_BYTES, parse_safetensors_header

    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"{f} is {size} bytes long: no safetensors file"
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            return (f"{f} declares a header of {n:,} bytes, and the file holds {size - 8:,} after its length: "
                    "no complete safetensors file")  # fmt: skip
        blob = fh.read(n)
    try:
        return n, parse_safetensors_header(blob, str(f))
    except SourceError as e:
        return str(e)


def _safetensors_problem(f: Path) -> tuple[str, str] | None:
    """Why ``safe_open`` (what transformers runs) would fail on ``f``, with the fix, or ``None``."""
    size = f.stat().st_size
    parsed = _header_problem(f, size)
    if isinstance(parsed, str):
        return parsed, REDOWNLOAD
    n, entries = parsed
    data, end = size - 8 - n, 0
    for name, t in sorted(entries.items(), key=lambda kv: kv[1].start):
        if t.start != end:
            return f"{f}: tensor {name!r} starts at byte {t.start:,} of the data, not {end:,}", REDOWNLOAD
        if t.dtype in _DTYPE_BYTES and t.nbytes != t.numel * _DTYPE_BYTES[t.dtype]:
            return (
                f"{f}: tensor {name!r} spans {t.nbytes:,} bytes, its shape and dtype {t.numel * _DTYPE_BYTES[t.dtype]:,}",
                REDOWNLOAD,
            )
        end += t.nbytes
    if end != data:
        what = "is truncated" if end > data else "has bytes after its last tensor"
        return f"{f} {what}: its tensors need {end:,} bytes of data, the file holds {data:,}", REDOWNLOAD
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt"):
            pass
    except Exception as e:  # noqa: BLE001 - whatever safetensors refuses, load() would raise too
        return f"{f} cannot be opened as safetensors ({type(e).__name__}: {str(e)[:120]})", REDOWNLOAD
    return None


def _pickle_problem(f: Path, allow_pickle: bool) -> tuple[str, str] | None:
    """A pickle checkpoint: refused unless ``allow_pickle``; with it, refused if it imports anything but
    tensors (transformers' ``torch.load(weights_only=True)`` would raise)."""
    if not allow_pickle:
        return f"{f.name} is a pickle checkpoint: loading it runs whatever code the file holds", PICKLE_FIX
    import torch

    with open(f, "rb") as fh:
        magic = fh.read(4)
    if magic.startswith(b"\x80") and magic != b"PK\x03\x04":
        return None  # torch.save's legacy (pre-zip) format: only torch.load's weights_only unpickler can judge it
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(f))
    except Exception as e:  # noqa: BLE001 - a short zip, a legacy or foreign file: torch.load fails on it too
        return f"{f} cannot be read as a torch checkpoint ({type(e).__name__}: {str(e)[:100]})", REDOWNLOAD
    if unsafe:
        return (f"{f.name} holds code, not only weights: it imports {', '.join(unsafe[:3])}; transformers "
                "(torch.load with weights_only=True) refuses it",
                "do not load this file; get the model's safetensors files from a source you trust")  # fmt: skip
    return None


def weight_file_check(model: str, *, allow_pickle: bool = False) -> Check | None:
    """Open what :func:`load` will open of a local checkpoint folder, before it does: each safetensors
    header complete (its declared length within the file, its tensors' data offsets end to end and within
    it), every shard its index lists present, and no pickle ``.bin`` (it can run code) unless
    ``allow_pickle``. ``None`` for a hub id or a folder without weights (nothing here to open)."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return None
    try:
        files = weight_files(folder)
    except SourceError as e:
        if not any((folder / n).is_file() for n in (SAFE_INDEX, BIN_INDEX)):
            return None  # no weights at all: the RAM line says so
        return Check("weight files", "fail", str(e), REDOWNLOAD)
    problems = [p for f in files if (p := _weight_problem(f, allow_pickle)) is not None]
    if problems:
        more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
        return Check("weight files", "fail", problems[0][0] + more, problems[0][1], {"problems": len(problems)})
    kind = "safetensors" if all(f.suffix == ".safetensors" for f in files) else "pickle (allowed)"
    return Check("weight files", "pass", f"{len(files)} {kind} file(s), each complete")


def _weight_problem(f: Path, allow_pickle: bool) -> tuple[str, str] | None:
    return _safetensors_problem(f) if f.suffix == ".safetensors" else _pickle_problem(f, allow_pickle)


def check_weight_files(model: str, *, allow_pickle: bool = False) -> None:
    """Raise :class:`LoadRefused` where :func:`weight_file_check` fails (load() would raise a raw error)."""
    check = weight_file_check(model, allow_pickle=allow_pickle)
    if check is not None and check.status == "fail":
        raise LoadRefused(check.summary, check.fix)
