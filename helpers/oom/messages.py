"""Out-of-memory messages: recognize them however they arrive, and read their figures.

The signatures and message forms are data (message fragments and patterns), not a chain of ``if``s.
``is_oom`` and ``is_oom_text`` recognize an OOM; ``parse_message`` reads the form and the figures of
the last OOM message in a text. Diagnosis (:mod:`helpers.oom.diagnosis`) builds on them.
"""

from __future__ import annotations

import builtins
import re
from typing import TYPE_CHECKING

from ..core.units import parse_bytes

if TYPE_CHECKING:  # imported where used: `import helpers` must not import torch (seconds)
    pass

__all__ = [
    "OOM_SIGNATURES",
    "TEXT_SIGNATURES",
    "OOM_FORMS",
    "is_oom",
    "is_oom_text",
    "oom_in",
    "EXCEPTION_GROUPS",
    "parse_message",
]

# ExceptionGroup's base (Python 3.11+); an empty tuple before, which isinstance never matches
EXCEPTION_GROUPS: tuple[type, ...] = tuple(t for t in (getattr(builtins, "BaseExceptionGroup", None),) if t)

# Fragments (lower-case) that mark an allocation failure in an exception's message.
OOM_SIGNATURES: tuple[str, ...] = (
    "out of memory",  # CUDA/HIP allocator, "CUDA error: out of memory", MPS
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",  # older cuDNN
    "cudnn_status_not_supported. this error may appear if you passed in a non-contiguous input",  # cuDNN OOM in disguise
    "can't allocate memory",  # CPU: DefaultCPUAllocator
    "cannot allocate memory",
    "can not allocate memory",  # Intel XPU (IPEX): "Current platform can NOT allocate memory block ..."
    "failed to allocate",
    "not enough memory",
    "not enough gpu video memory",  # torch-directml: "Could not allocate tensor with N bytes. There is not enough ..."
)


# Fragments (lower-case) of memory deaths and refusals that the OS, a launcher, Jupyter, Windows or a
# server reports: recognized in text, never in a live exception (``is_oom`` leaves them out), so a
# retry loop does not halve its batch over a DataLoader worker's bus error.
TEXT_SIGNATURES: tuple[str, ...] = (
    "winerror 1455",  # "[WinError 1455] The paging file is too small ..." in every Windows language
    "os error 1455",
    "paging file is too small",
    "killed by signal: killed",  # a DataLoader worker taken by the OOM killer
    "killed by signal: bus error",  # ... or by an exhausted /dev/shm
    "insufficient shared memory",
    "exit code 137",  # 128 + SIGKILL
    "exit status 137",
    "exitcode: -9",  # torchrun's "failed (exitcode: -9)"
    "signal 9",
    "sigkill",
    "appears to have died",  # Jupyter: "The kernel appears to have died. It will restart automatically."
    "on startup is less than desired gpu memory utilization",  # vLLM's startup check
    # refusals and deaths of other frameworks and runners (see the forms below for each one's source)
    "some modules are dispatched on the cpu or the disk",  # transformers: a quantized model that does not fit
    "no available memory for the cache blocks",  # vLLM
    "that can be stored in kv cache",  # vLLM: "The model's max seq len (X) is larger than ... (Y)"
    # vLLM v1: "To serve at least one request with the models's max seq len (X), (Y GiB KV cache is needed, ...":
    # its first words, so the figures after them sit in the window read after the signature
    "to serve at least one request with the model",
    "oom when allocating tensor",  # TensorFlow's ResourceExhaustedError
    "oomkilled",  # Kubernetes / Docker: "Reason: OOMKilled"
    "oom killed",
    "exit code: 137",  # kubectl describe's "Exit Code: 137", VS Code's "exit code: 137"
    '"exitcode": 137',
    "exited with code 137",  # docker compose
    "killed by signal: terminated",  # a DataLoader worker sent SIGTERM
)


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it wraps) is an out-of-memory error.

    Recognizes ``torch.OutOfMemoryError``, ``MemoryError``, and ``RuntimeError``s whose message
    carries an allocation failure (cuBLAS, cuDNN, "CUDA error: out of memory", the CPU allocator),
    also when wrapped as the ``__cause__``/``__context__`` of another exception. Given message text
    instead of an exception, it reads the text (as :func:`is_oom_text` does).
    """
    if isinstance(exc, str):
        return is_oom_text(exc)
    if exc is not None and not isinstance(exc, BaseException):
        raise TypeError(f"is_oom() takes an exception (or its message text), got {type(exc).__name__} {exc!r:.60}")
    return oom_in(exc) is not None


def oom_in(exc: BaseException | None, _depth: int = 0) -> BaseException | None:
    """The out-of-memory error ``exc`` is or holds: itself, one in its ``__cause__``/``__context__`` chain,
    or one inside an ``ExceptionGroup`` (``asyncio.TaskGroup``, trio); ``None`` when there is none."""
    import torch

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and _depth < 50:
        seen.add(id(exc))
        if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
            return exc
        if isinstance(exc, RuntimeError) and any(sig in _args_text(exc) for sig in OOM_SIGNATURES):
            return exc
        for inner in exc.exceptions if isinstance(exc, EXCEPTION_GROUPS) else ():
            found = oom_in(inner, _depth + 1)
            if found is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


def _args_text(exc: BaseException) -> str:
    """The lower-cased text of ``exc``'s arguments; an argument whose ``__str__`` raises reads as its repr."""
    parts = []
    for a in exc.args:
        try:
            parts.append(str(a))
        except Exception:  # noqa: BLE001 - a hostile __str__ must not hide the error being diagnosed
            parts.append(object.__repr__(a))
    return " ".join(parts).lower()


# Every pattern is linear-time: bounded quantifiers only (no nested or unbounded repeats), and
# _parse never hands them more than a window of _BEFORE + _AFTER characters. A number is at most 20
# digits and may not be the tail of a longer run ((?<![\d.])), so a 100,000-digit run matches nothing.
_NUM = r"(?<![\d.])\d{1,20}(?:\.\d{1,6})?"
_SIZE = rf"({_NUM} {{0,3}}(?:[KMGT]i?B|bytes|B)\b)"

# Each message form: (form, what it is, a regex that recognizes it). First match wins, so the more
# specific forms come first. Figures are pulled out separately by _FIGURES (any form may carry them).
OOM_FORMS: tuple[tuple[str, str, str], ...] = (
    (
        "colab_ram",
        "Colab ran out of system RAM and restarted the runtime",
        r"session crashed after using all available ram",
    ),
    # deaths and refusals outside PyTorch's allocators: more specific than any allocator form
    (
        "pagefile",
        "Windows could not commit memory (RAM + page file)",
        r"(?:winerror|os error) 1455|paging file is too small",
    ),
    (
        "shm",
        "a DataLoader worker died of a bus error: shared memory (/dev/shm) ran out",
        r"killed by signal: bus error|insufficient shared memory",
    ),
    (
        "dataloader_killed",
        "a DataLoader worker was killed (SIGKILL, or SIGTERM from the job runner under memory pressure)",
        r"killed by signal: (?:killed|terminated)",
    ),
    ("kernel_died", "the Jupyter kernel died", r"kernel(?: for \S{1,200})? (?:appears to have|has) died"),
    (
        "killed",
        "the process was killed with SIGKILL (Killed, exit code 137, exitcode -9)",
        r"exit (?:code|status) 137|exitcode ?: ?-9\b|signal 9\b|sigkill|(?:^|[\s\]|])killed(?!\S)(?! by)|"
        r"oom ?killed|exit ?code\"?: {0,8}137\b|exited with code 137",
    ),
    # transformers (modeling_utils / quantizers): device_map="auto" left modules of a quantized model off the GPU
    (
        "quantized_offload",
        "transformers refused a quantized model that does not fit on the GPU (device_map put modules on CPU/disk)",
        r"some modules are dispatched on the cpu or the disk",
    ),
    # vLLM's KV-cache budget (vllm/worker/worker.py raise_if_cache_size_invalid, vllm/v1/core/kv_cache_utils.py)
    (
        "vllm_kv",
        "vLLM's KV cache does not fit in its memory budget (gpu_memory_utilization)",
        r"no available memory for the cache blocks|that can be stored in kv cache|"
        r"to serve at least one request with the model",
    ),
    ("vllm", "vLLM's startup check of free GPU memory", r"on startup is less than desired gpu memory utilization"),
    (
        "ggml",
        "llama.cpp / ggml (ollama) could not allocate a buffer",
        r"cudamalloc failed: out of memory|ggml_backend_cuda_buffer_type_alloc_buffer|"
        r"failed to allocate (?:cuda|rocm)\d{1,3} buffer",
    ),
    ("mps", "Apple MPS allocator", r"mps backend out of memory"),
    # DirectML (torch-directml's allocator, TensorFlow-DirectML's DmlAllocator): before TensorFlow's form
    (
        "directml",
        "DirectML (Windows, any GPU vendor) ran out of video memory",
        r"not enough gpu video memory|device:dml:\d|dmlallocat",
    ),
    ("tensorflow", "TensorFlow's allocator (ResourceExhaustedError)", r"oom when allocating tensor"),
    (
        "xla",
        "JAX / XLA's allocator (RESOURCE_EXHAUSTED)",
        r"resource.exhausted: out ?of memory|out of memory (?:while trying to allocate|allocating) \d|"
        r"failed to allocate request for [^()]{1,30}\(\d{1,20}b\) on device ordinal",
    ),
    ("npu", "Ascend NPU caching allocator (torch_npu)", r"npu out of memory"),
    ("hip", "ROCm/HIP caching allocator", r"hip out of memory"),
    ("xpu", "Intel XPU caching allocator", r"xpu out of memory|can not allocate memory block"),
    # before the CUDA forms: an application may add "if you encounter CUDA out of memory, ..." after it
    ("cpu", "CPU allocator (system RAM)", r"defaultcpuallocator"),
    (
        "cuda_legacy",
        "CUDA caching allocator (PyTorch < 2.1 wording)",
        r"cuda out of memory\. tried to allocate [^()]{1,40}\(gpu {1,3}\d{1,4}; [^()]{1,40}total capacity",
    ),
    ("cuda", "CUDA caching allocator", r"cuda out of memory|out of memory\. tried to allocate"),
    ("bitsandbytes", "bitsandbytes kernel or paged optimizer", r"bitsandbytes|bnb|cget_managed_ptr|paged"),
    ("nccl", "NCCL could not allocate its buffers", r"nccl warn cuda failure 'out of memory'|failed to cuda calloc"),
    ("cublas", "cuBLAS could not allocate its workspace", r"cublas_status_alloc_failed"),
    (
        "cudnn",
        "cuDNN could not allocate its workspace",
        r"cudnn_status_alloc_failed|cudnn_status_not_supported\. this error may appear if you passed in a non-contiguous",
    ),
    (
        "cuda_error",
        "the CUDA driver itself (outside PyTorch's allocator)",
        # "CUDA error:out of memory" (no space) in some builds; THC's "error=2 : out of memory"
        r"cuda error: ?out of memory|cuda runtime err(?:or)? ?\(2\) ?: out of memory|error=2 ?: out of memory|"
        r"cuda failure 2: out of memory",  # CNTK: "CUDA failure 2: out of memory ; GPU=0 ; ... expr=cudaMalloc(...)"
    ),
    (
        "cpu",
        "CPU allocator (system RAM)",
        r"can't allocate memory|cannot allocate memory|\bmemoryerror",
    ),
)

# Figures and the patterns that carry them, in any of the forms above. Sizes are 1024-based however
# they are spelled: PyTorch prints GiB/MiB/KiB, and its MPS allocator prints "GB"/"MB"/"KB" for the
# same 1024-based values (MPSAllocator's format_size divides by 1073741824).
_FIGURES: tuple[tuple[str, str], ...] = (
    ("requested", rf"tried to allocate {_SIZE}"),
    ("requested", r"you tried to allocate (\d{1,20}) bytes"),
    ("requested", r"failed to cuda calloc (\d{1,20}) bytes"),  # NCCL
    # ggml: the exact bytes of "failed to allocate CUDA0 buffer of size N" before its rounded MiB
    ("requested", r"failed to allocate (?:cuda|rocm)\d{1,3} buffer of size (\d{1,20})"),
    ("requested", rf"allocating {_SIZE} on device"),
    ("requested", r"could not allocate tensor with (\d{1,20}) bytes"),  # DirectML
    ("requested", r"out of memory (?:while trying to allocate|allocating) (\d{1,20}) bytes"),  # JAX / XLA
    ("requested", r"failed to allocate request for [^()]{1,30}\((\d{1,20})b\) on device ordinal"),  # XLA's BFC
    ("requested_at_least", r"tried to allocate more than (\d{1,3}) ?eb\b"),  # PyTorch's cap on what it prints
    ("device", r"\bgpu {1,3}(\d{1,4})\b"),
    ("device", r"\bon device (\d{1,4}):"),  # ggml
    ("device", r"\b(?:cuda|rocm)(\d{1,3}) buffer"),  # ggml
    ("device", r"\bon device cuda:(\d{1,3})"),  # vLLM
    ("device", r"\bnpu {1,3}(\d{1,4})\b"),  # Ascend: "(NPU 3; ...)"
    ("device", r"/device:(?:gpu|dml|xla_gpu|tpu):(\d{1,4})\b"),  # TensorFlow's device names
    ("device", r"\bgpu=(\d{1,4})\b"),  # CNTK: "CUDA failure 2: out of memory ; GPU=0 ;"
    ("device", r"\bon device ordinal (\d{1,4})\b"),  # XLA
    ("device", r":\d{1,10}:\d{1,10} \[(\d{1,4})\] "),  # NCCL's "host:pid:tid [cudaDev]" prefix
    ("total", rf"total capaci?ty of {_SIZE}"),  # PyTorch 2.1-2.3 print "capacty"
    ("total", rf"{_SIZE} total capacity"),
    ("free", rf"of which {_SIZE} is free"),
    ("free", rf"{_SIZE} free"),
    ("this_process", rf"this process has {_SIZE} memory in use"),
    ("allocated", rf"{_SIZE} is allocated by pytorch"),
    ("allocated", rf"{_SIZE} already allocated"),
    ("reserved_unallocated", rf"{_SIZE} is reserved by pytorch but unallocated"),
    # PyTorch 1.0-1.3: "... W cached)" printed cached minus allocated, i.e. reserved but unallocated
    ("reserved_unallocated", rf"free; {_SIZE} cached\)"),
    ("reserved", rf"{_SIZE} reserved in total by pytorch"),
    ("mps_allocated", rf"mps allocated: {_SIZE}"),
    ("other_allocations", rf"other allocations: {_SIZE}"),
    ("max_allowed", rf"max allowed: {_SIZE}"),
    ("process_cap", rf"{_SIZE} allowed;"),  # set_per_process_memory_fraction's cap, when one is set
    # vLLM's KV-cache budget: bytes (v1) and token counts (COUNTS: not bytes)
    ("kv_cache_needed", rf"{_SIZE} kv cache is needed"),
    ("kv_cache_available", rf"available kv cache memory \({_SIZE}\)"),
    ("max_seq_len", r"max seq len \((\d{1,12})\)"),
    ("kv_cache_tokens", r"can be stored in kv cache \((\d{1,12})\)"),
    ("max_len_that_fits", r"estimated maximum model length is (\d{1,12})"),
)
COUNTS = ("max_seq_len", "kv_cache_tokens", "max_len_that_fits")  # figures that are token counts, not bytes
# TensorFlow states the tensor, not its bytes: "shape[16,128,98,98] and type float" is 16*128*98*98*4 B
_TF_TENSOR = re.compile(r"oom when allocating tensor (?:with|of) shape ?\[([\d, ]{0,200})\] and type (\w{1,12})", re.I)
_TF_ITEMSIZE = {"float": 4, "half": 2, "bfloat16": 2, "double": 8, "int8": 1, "uint8": 1, "bool": 1, "int16": 2,
                "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "complex64": 8, "complex128": 16}  # fmt: skip
# vLLM: "Free memory on device [cuda:N] (FREE/TOTAL GiB) on startup is less than desired GPU memory
# utilization (FRACTION, WANTED GiB)": two figures in one parenthesis, read here rather than in _FIGURES
_GIB = r"(\d{1,10}(?:\.\d{1,6})?)"
_VLLM = re.compile(
    rf"free memory on device(?: [\w:]{{1,20}})? \({_GIB}/{_GIB} ?gib\) on startup is less than desired gpu "
    rf"memory utilization \((?:\d{{1,3}}(?:\.\d{{1,6}})?), {_GIB} ?gib\)",
    re.I,
)
_PROCESS = re.compile(rf"process (\d{{1,10}}) has {_SIZE} memory in use", re.I)
_FORM_RES = tuple((name, what, re.compile(pattern)) for name, what, pattern in OOM_FORMS)
_FIGURE_RES = tuple((name, re.compile(pattern, re.I)) for name, pattern in _FIGURES)
# The text examined around the last OOM signature of a long log: a message states its figures after
# its signature (within ~1 KB); the part before catches a message whose own signature came earlier.
_BEFORE, _AFTER = 2000, 4000
_FORM_CONTEXT = 1200  # characters before the last signature that still belong to its message
_LEAD_IN = 40  # of a whole message (it states its own request): the words before its signature


_COLAB = "session crashed after using all available ram"
_SPACES = re.compile(r"\s+")


def _last_signature(low: str) -> int:
    """Where the last OOM signature of ``low`` (lower-cased text) starts, or -1: plain ``str.rfind``s."""
    return max(max(low.rfind(sig) for sig in (*OOM_SIGNATURES, *TEXT_SIGNATURES, _COLAB)), _last_killed(low))


# A shell's "Killed" (the OOM killer's SIGKILL), alone or ending its line: "...it/s]Killed",
# "line 3: 4242 Killed   python train.py". Checked on the line of each of the last few "killed"s
# only (rfind, then a bounded regex), so a long log costs no regex scan.
_KILLED_LINE = re.compile(r"(?:^|[\s\]|])killed\s*$|\b\d{1,10} +killed +\S")
_KILLED_TRIES = 20


def _last_killed(low: str) -> int:
    end = len(low)
    for _ in range(_KILLED_TRIES):
        pos = low.rfind("killed", 0, end)
        if pos < 0:
            return -1
        start = low.rfind("\n", max(0, pos - 200), pos) + 1 or max(0, pos - 200)
        stop = low.find("\n", pos)
        line = low[start : stop if 0 <= stop < pos + 200 else pos + 200]
        if _KILLED_LINE.search(line):
            return pos
        end = pos
    return -1


def _window(text: str) -> tuple[str, str]:
    """(before, after): the text around the last OOM message, whitespace-flattened, bounded in size.

    ``after`` starts at the last signature (the message that matters in a long log); ``before`` is
    what precedes it, for figures a message states ahead of a later signature.
    """
    pos = _last_signature(text.lower())
    if pos < 0:
        pos = len(text)
    before = text[max(0, pos - _BEFORE) : pos]
    after = text[pos : pos + _AFTER]
    return _SPACES.sub(" ", before), _SPACES.sub(" ", after)  # messages arrive wrapped across lines


def _figure(regex: re.Pattern, before: str, after: str) -> str | None:
    m = regex.search(after)
    if m is None:
        m = next(reversed(list(regex.finditer(before))), None)  # the nearest one before
    return m.group(1) if m else None


_REQUESTED = next(regex for name, regex in _FIGURE_RES if name == "requested")


def _form_of(low: str) -> tuple[str, str]:
    for name, what, regex in _FORM_RES:
        if regex.search(low):
            return name, what
    return "unknown", "an error that does not look like an out-of-memory message"


def parse_message(text: str) -> dict:
    """The last OOM message in ``text``: its ``form`` and ``source`` (an ``OOM_FORMS`` entry, or
    "unknown"), each figure it states (bytes; the GPU index as ``device``) and ``processes``."""
    before, after = _window(text)
    # A message that states its own request after its signature is whole: an earlier message in the
    # same log (a CPU OOM, a run with a memory cap) must not lend it a form or figures. Otherwise the
    # last signature may sit in a hint after the real message ("if you encounter CUDA out of memory"),
    # or inside it ("... (Cannot allocate memory)"): the text before it is read too.
    if _REQUESTED.search(after) and _form_of((before[-_LEAD_IN:] + after).lower())[0] != "unknown":
        before = before[-_LEAD_IN:]  # its own first words only: "torch.OutOfMemoryError: CUDA "
    low = (before[-_FORM_CONTEXT:] + after).lower()
    form, source = _form_of(low)
    if form == "bitsandbytes" and not (is_oom_text(low) or "paged" in low):
        form, source = "unknown", "an error that does not look like an out-of-memory message"
    figures: dict = {}
    for name, regex in _FIGURE_RES:
        if name in figures:
            continue
        value = _figure(regex, before, after)
        if value is not None:
            figures[name] = _value(name, value)
    if "requested" not in figures:
        requested = _tf_request(before[-_FORM_CONTEXT:] + after)
        if requested is not None:
            figures["requested"] = requested
    vllm = _VLLM.search(before[-_FORM_CONTEXT:] + after)  # its signature sits mid-message
    if vllm is not None:
        free, total, wanted = (parse_bytes(f"{v} GiB") for v in vllm.groups())
        figures.update(free=free, total=total, requested=wanted)
    figures["processes"] = [(int(pid), parse_bytes(size)) for pid, size in _PROCESS.findall(after)]
    return {"form": form, "source": source, **figures}


def _tf_request(text: str) -> int | None:
    """The bytes of the tensor a TensorFlow OOM names (its shape times its type's size), or None."""
    m = _TF_TENSOR.search(text)
    itemsize = _TF_ITEMSIZE.get(m.group(2).lower()) if m else None
    if itemsize is None:
        return None
    count = 1
    for dim in m.group(1).replace(" ", "").split(","):
        count *= int(dim) if dim else 1
    return count * itemsize


def _value(name: str, text: str) -> int:
    """A figure's bytes (the GPU index for ``device``; "more than N EB" as N EiB; a count for COUNTS)."""
    if name == "device" or name in COUNTS:
        return int(text)
    if name == "requested_at_least":
        return int(text) << 60
    return int(text) if text.isdigit() else parse_bytes(text)


def is_oom_text(text: str) -> bool:
    """True when ``text`` reads like an out-of-memory message (any form in OOM_FORMS)."""
    low = text.lower()
    if _last_signature(low) >= 0:
        return True
    # a signature wrapped across lines: flatten the whitespace (of the last 1 MB of a long log)
    flat = " ".join(low[-(1 << 20) :].split())
    return any(sig in flat for sig in (*OOM_SIGNATURES, *TEXT_SIGNATURES)) or _COLAB in flat
