"""Time beside memory: load time, prefill and decode tokens/s, a LoRA step, and the totals people ask for.

Pure functions of a model's shape and a device's speed (no probe runs here; :mod:`.calibration` measures
this machine). The model of time, term by term:

- **decode** (one new token for each of ``batch`` sequences) is memory-bandwidth bound: every weight once
  per step, ``bytes / (bandwidth x the load mode's kernel efficiency)``, and per sequence its KV cache (read by
  attention, and read and written again by the cache's append) and its logits over the vocabulary
  (:func:`decode_step_work`); the matmuls' FLOPs grow with the batch (``2 x matmul params x batch /
  throughput``). On a GPU a step takes the larger of reads and FLOPs (they overlap); on the CPU their sum;
- **prefill** (the prompt's forward pass) and **training** are compute bound: FLOPs / throughput;
- **overhead**: PyTorch eager and transformers' Python issue each op from the CPU (a few microseconds each).
  On a GPU that work overlaps the kernels (a step takes the larger of the two); on the CPU it adds to them.
  For small models it is most of the time: the op counts below were counted, and the time per op is
  measured by :func:`helpers.estimator.calibration.calibrate` on the machine that runs the model.

Card figures are datasheet peaks (:data:`CARDS`, one citation each); what a real run reaches of them is
:data:`MEMORY_EFFICIENCY` / :data:`COMPUTE_EFFICIENCY`, and bitsandbytes' kernels reach less
(:data:`KERNEL_EFFICIENCY`). A calibration replaces the card figures by measured ones (the probes already
reach what they reach: only the kernel's efficiency applies to the copy bandwidth, and
:data:`CALIBRATED_PREFILL_EFFICIENCY` / :data:`CALIBRATED_TRAINING_EFFICIENCY` to the matmul probe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..core.devices import DEVICE_SETS, DISK_BYTES_PER_S, PCIE_BYTES_PER_S
from ..core.html import escape, table
from ..core.vocab import MODES
from .calibration import Calibration
from .rows import EstimateError

__all__ = [
    "Card", "CARDS", "Speed", "ModelShape", "TimeEstimate", "speed_for", "model_shape",
    "DecodeWork", "decode_step_work", "decode_step_seconds", "prefill_seconds", "lora_step_seconds", "load_seconds", "answers_seconds",
    "estimate_time", "approx_duration", "time_line", "view_time", "time_basis", "card_named", "offload_seconds",
    "KERNEL_EFFICIENCY", "MEMORY_EFFICIENCY", "COMPUTE_EFFICIENCY",
    "CALIBRATED_PREFILL_EFFICIENCY", "CALIBRATED_TRAINING_EFFICIENCY",
]  # fmt: skip

GB = 1e9
T = 1e12


@dataclass(frozen=True)
class Card:
    """A GPU's datasheet peaks: memory bandwidth (bytes/s) and dense throughput (FLOP/s) per dtype."""

    bandwidth: float
    fp16_flops: float  # dense tensor-core fp16/bf16 (fp32 accumulate on GeForce cards, as training runs)
    int8_ops: float | None  # dense int8 tensor-core ops/s (None: the datasheet gives none)
    fp32_flops: float  # plain fp32 (no TF32)
    source: str


# Datasheet peaks, dense (the "with sparsity" figures are twice these and no dense model reaches them).
CARDS: dict[str, Card] = {
    # NVIDIA T4 datasheet (2019): 320 GB/s GDDR6; 65 TFLOPS mixed-precision FP16; 130 TOPS INT8; 8.1 TFLOPS FP32
    "t4": Card(320 * GB, 65 * T, 130 * T, 8.1 * T, "NVIDIA T4 datasheet"),
    # NVIDIA L4 datasheet (2023): 300 GB/s; FP16 tensor 242 TFLOPS and INT8 485 TOPS with sparsity; FP32 30.3
    "l4": Card(300 * GB, 121 * T, 242 * T, 30.3 * T, "NVIDIA L4 datasheet (sparsity halved)"),
    # NVIDIA V100 datasheet (SXM2): 900 GB/s HBM2; 125 TFLOPS tensor; 15.7 TFLOPS FP32; no INT8 tensor cores
    "v100": Card(900 * GB, 125 * T, None, 15.7 * T, "NVIDIA V100 datasheet (SXM2)"),
    "v100-32": Card(900 * GB, 125 * T, None, 15.7 * T, "NVIDIA V100 datasheet (SXM2)"),
    # NVIDIA A100 datasheet: 40 GB 1,555 GB/s, 80 GB SXM 2,039 GB/s; FP16/BF16 312 TFLOPS; INT8 624 TOPS; FP32 19.5
    "a100-40": Card(1555 * GB, 312 * T, 624 * T, 19.5 * T, "NVIDIA A100 datasheet"),
    "a100-80": Card(2039 * GB, 312 * T, 624 * T, 19.5 * T, "NVIDIA A100 datasheet (80 GB SXM)"),
    # NVIDIA Ampere GA102 whitepaper, RTX 3090: 936 GB/s; FP16 tensor with FP32 accumulate 71 TFLOPS; INT8 284 TOPS
    "rtx3090": Card(936 * GB, 71 * T, 284 * T, 35.6 * T, "NVIDIA GA102 whitepaper"),
    # NVIDIA Ada whitepaper, RTX 4090: 1,008 GB/s; FP16 tensor with FP32 accumulate 165.2 TFLOPS; INT8 660.6 TOPS
    "rtx4090": Card(1008 * GB, 165.2 * T, 660.6 * T, 82.6 * T, "NVIDIA Ada (AD102) whitepaper"),
    # NVIDIA H100 datasheet (SXM5): 3.35 TB/s HBM3; FP16/BF16 989 TFLOPS; INT8 1,979 TOPS; FP32 67 TFLOPS
    "h100": Card(3350 * GB, 989 * T, 1979 * T, 67 * T, "NVIDIA H100 datasheet (SXM5)"),
    # NVIDIA H200 datasheet (SXM): 4.8 TB/s HBM3e; FP16/BF16 1,979 TFLOPS and INT8 3,958 TOPS with
    # sparsity; FP32 67 TFLOPS (the lent GPU machine's card)
    "h200": Card(4800 * GB, 989 * T, 1979 * T, 67 * T, "NVIDIA H200 datasheet (SXM, sparsity halved)"),
}

# Share of the datasheet bandwidth a decode step's reads reach: large device copies reach 75-90 % of peak
# (vendor STREAM-style figures), a forward pass of many smaller reads less. Assumed, to be replaced by the
# GPU issue's measured tokens/s; calibrate() on the card measures the copy bandwidth instead.
MEMORY_EFFICIENCY = 0.7
# Share of the datasheet tensor throughput that eager transformers reaches in prefill and LoRA training
# (model FLOPs utilisation; PaLM reports 46 % for a tuned stack, eager PyTorch reaches less). Assumed.
COMPUTE_EFFICIENCY = 0.35
# Share of the matmul probe's throughput (calibrate(): square matmuls, 1024 on CPU, 4096 on GPU) that a model's
# own prefill and training steps reach: smaller matmuls, attention, norms and activations between them, and for
# training autograd's saved tensors and the optimizer. FITTED, not derived: the values at which
# bench/time_estimate.py's median ratios came closest to 1 over its runs on this repository's shared CPU (tiny
# Llama and Qwen2, one thread, 4 x 128 tokens); the bench then checks the rest (op counts, FLOP formulas,
# overhead) around them. Not yet measured on a GPU.
CALIBRATED_PREFILL_EFFICIENCY = 0.6
CALIBRATED_TRAINING_EFFICIENCY = 0.45
# Decode speed of bitsandbytes' kernels relative to a 16-bit matmul reading the same bytes. Users measure
# LLM.int8 decode 2.4x (huggingface.co/Open-Orca/OpenOrcaxOpenChat-Preview2-13B/discussions/8: bf16 10.9 s,
# int8 26.2 s) to 3-5x (huggingface.co/IlyaGusev/saiga2_13b_lora/discussions/4) slower than 16-bit while
# reading half the bytes: 0.5 / 3.5 ~ 0.15; 4-bit 2-3x slower reading about a quarter
# (github.com/huggingface/transformers/issues/24502): 0.27 / 2.5 ~ 0.11.
KERNEL_EFFICIENCY = {"fp32": 1.0, "fp16": 1.0, "bf16": 1.0, "int8": 0.15, "nf4": 0.11, "fp4": 0.11,
                     "gptq": 0.5, "awq": 0.5}  # fmt: skip  # GPTQ/AWQ kernels: assumed, unmeasured here
# Time per op issued from Python by eager transformers when nothing was measured: assumed at twice what
# calibrate() measures on this repository's CPU (5-7 us, bench/time_estimate.py), for Colab's slower vCPUs.
DEFAULT_OP_SECONDS = 12e-6
# Ops per step, counted with TorchDispatchMode (aten calls) on transformers 5.23's Llama at 2, 4 and 8 layers
# (exactly linear in layers); bench/time_estimate.py recounts them. Other architectures differ a little.
DECODE_OPS = (72, 61)  # per layer, per step: one generate() token (logits processors and stopping included)
FORWARD_OPS = (74, 24)  # one forward pass (prefill)
LORA_STEP_OPS = {False: (526, 16), True: (733, 71)}  # forward+backward+AdamW, all-linear LoRA; key: checkpointing
# Passes over each sequence's KV cache per decode step: transformers' DynamicCache appends the new token with
# torch.cat (cache_utils.DynamicLayer.update), reading the whole cache and writing it anew, and attention reads
# it once more. Passes over its logits (fp32, batch x vocab): the lm_head writes them, generate() copies the last
# position to fp32 (generation/utils.py: ``.to(copy=True, dtype=torch.float32)``: a read and a write), the
# logits processors and argmax read them.
KV_CACHE_PASSES = 3
LOGITS_PASSES = 4
# Passes over the weights of a CPU decode step at a batch above 1: one row is a matrix-vector product that reads
# each weight once, several rows a GEMM that first packs its weight operand (reads it, writes the packed copy,
# reads that). Measured here (MKL, fp32, one thread): a 4096 x 4096 linear took 3.4 ms at 1 row, 15 ms at 2;
# 1024 x 1024: 0.08 ms, 0.16 ms. A GPU's GEMM reads its operands in place.
CPU_GEMM_WEIGHT_PASSES = 3
# Loading: the checkpoint is read (DISK_BYTES_PER_S), quantized by bitsandbytes on the GPU and copied over
# PCIe (PCIE_BYTES_PER_S); a download first unless cached. Both rates assumed: Colab's downloads from the
# Hub vary from tens to hundreds of MB/s, and quantization runs at device speed (several GB/s).
DOWNLOAD_BYTES_PER_S = 50e6
QUANTIZE_BYTES_PER_S = 2e9


@dataclass(frozen=True)
class Speed:
    """The rates a time estimate divides by, whatever their origin (a card's datasheet or a calibration)."""

    label: str
    bandwidth: float  # bytes/s a decode step's reads reach
    flops: float  # FLOP/s prefill and training matmuls reach
    op_seconds: float
    overlap: bool  # GPU: Python overhead runs while kernels do (max); CPU: it adds up (sum)
    basis: str  # where the figures come from, for the reader
    decode_step_seconds: float | None = None  # generate()'s own work per token (None: its ops x op_seconds)
    training_share: float = 1.0  # a training step reaches this share of ``flops`` (autograd, optimizer)


def speed_for(device: str | None = None, calibration: Calibration | None = None) -> Speed:
    """The rates for a device preset (``"t4"``, ``"kaggle-2xt4"``: one of its cards, since layers split over
    cards run one after the other) from its datasheet, or those a calibration measured (``device`` ignored)."""
    if calibration is not None:
        flops = calibration.flops * CALIBRATED_PREFILL_EFFICIENCY
        return Speed(calibration.device, calibration.bandwidth, flops, calibration.op_seconds,
                     overlap=not calibration.cpu, basis=f"calibrated: {calibration}",
                     decode_step_seconds=calibration.decode_step_seconds,
                     training_share=CALIBRATED_TRAINING_EFFICIENCY / CALIBRATED_PREFILL_EFFICIENCY)  # fmt: skip
    key = str(device or "t4").lower()
    key = DEVICE_SETS[key][0] if key in DEVICE_SETS else key
    if key not in CARDS:
        raise EstimateError(
            f"no card figures for device {str(device)[:40]!r}; use one of {', '.join(CARDS)}, or pass "
            "calibration=calibrate() to time this machine (a CPU or an unlisted GPU)"
        )
    card = CARDS[key]
    return Speed(key, card.bandwidth * MEMORY_EFFICIENCY, card.fp16_flops * COMPUTE_EFFICIENCY, DEFAULT_OP_SECONDS,
                 overlap=True, basis=f"{card.source} x efficiency {MEMORY_EFFICIENCY:.0%} memory, "
                 f"{COMPUTE_EFFICIENCY:.0%} compute")  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    """What time depends on: matmul parameters (FLOPs per token / 2), bytes read per decode step, KV cache
    bytes per token, layers (ops), LoRA parameters and attention width."""

    matmul_params: int  # every weight a token multiplies by: all but the input embedding (tied: all)
    weight_bytes: int
    kv_bytes_per_token: int  # one sequence's keys and values, all layers
    layers: int
    attn_width: int  # heads x head_dim: the attention FLOPs' width
    lora_params: int = 0
    vocab: int = 0  # logits per sequence per decode step


def _combine(speed: Speed, device_seconds: float, ops: int, extra: float = 0.0) -> float:
    overhead = ops * speed.op_seconds + extra
    return max(device_seconds, overhead) if speed.overlap else device_seconds + overhead


@dataclass(frozen=True)
class DecodeWork:
    """What one decode step moves and computes: the weights once, and per sequence its KV cache
    (:data:`KV_CACHE_PASSES`) and logits (:data:`LOGITS_PASSES`); FLOPs for every sequence."""

    weight_bytes: float
    kv_bytes: float
    logits_bytes: float
    flops: float

    def __str__(self) -> str:
        return (f"decode step: weights {self.weight_bytes:,.0f} B, KV cache {self.kv_bytes:,.0f} B, "
                f"logits {self.logits_bytes:,.0f} B, {self.flops:,.0f} FLOPs")  # fmt: skip


def decode_step_work(shape: ModelShape, *, batch: int = 1, context: float = 0, cpu: bool = False) -> DecodeWork:
    """Counts for one generate() step over ``batch`` sequences holding ``context`` tokens each (``cpu``: the
    weights packed for a GEMM when ``batch`` > 1, :data:`CPU_GEMM_WEIGHT_PASSES`)."""
    return DecodeWork(
        weight_bytes=shape.weight_bytes * (CPU_GEMM_WEIGHT_PASSES if cpu and batch > 1 else 1),
        kv_bytes=KV_CACHE_PASSES * batch * context * shape.kv_bytes_per_token,
        logits_bytes=LOGITS_PASSES * batch * shape.vocab * 4,
        flops=(2 * shape.matmul_params + 4 * context * shape.attn_width * shape.layers) * batch,
    )  # fmt: skip


def decode_step_seconds(
    shape: ModelShape, speed: Speed, *, batch: int = 1, context: float = 0, load: str = "fp16"
) -> float:
    """One generate() step: a new token for each of ``batch`` sequences holding ``context`` tokens each.
    Reads (the weights at the load mode's kernel efficiency; each sequence's cache and logits) and FLOPs:
    the larger on a GPU, where they overlap; their sum on the CPU, where the same cores stream the weights and
    multiply them (a 4096 x 4096 fp32 linear at 8 rows took longer here than its packed reads plus its FLOPs
    at the matmul probe's rate)."""
    work = decode_step_work(shape, batch=batch, context=context, cpu=not speed.overlap)
    memory = work.weight_bytes / (speed.bandwidth * KERNEL_EFFICIENCY.get(load, 1.0))
    memory += (work.kv_bytes + work.logits_bytes) / speed.bandwidth
    compute = work.flops / speed.flops
    device = max(memory, compute) if speed.overlap else memory + compute
    if speed.decode_step_seconds is None:
        return _combine(speed, device, DECODE_OPS[0] * shape.layers + DECODE_OPS[1])
    return _combine(speed, device, DECODE_OPS[0] * shape.layers, speed.decode_step_seconds)


def _forward_flops(shape: ModelShape, batch: int, tokens: int) -> tuple[float, float]:
    """(matmul, attention) FLOPs of one forward pass: 2 per parameter per token; QK^T and AV, 2 x 2 x
    tokens^2 x width per layer (SDPA computes the full square on CPU; a causal kernel would skip half)."""
    return 2 * shape.matmul_params * tokens * batch, 4 * tokens * tokens * shape.attn_width * shape.layers * batch


def prefill_seconds(shape: ModelShape, speed: Speed, *, batch: int = 1, tokens: int = 512, load: str = "fp16") -> float:
    """The prompt's forward pass: compute bound, plus the weights read once (what dominates a short prompt)."""
    memory = shape.weight_bytes / (speed.bandwidth * KERNEL_EFFICIENCY.get(load, 1.0))
    device = max(sum(_forward_flops(shape, batch, tokens)) / speed.flops, memory)
    return _combine(speed, device, FORWARD_OPS[0] * shape.layers + FORWARD_OPS[1])


def lora_step_flops(shape: ModelShape, *, batch: int, tokens: int, checkpointing: bool) -> float:
    """FLOPs of one LoRA step, explicitly: the forward pass (2 per parameter per token); backward computes
    the input gradient through every layer (2 more per parameter, frozen or not) and weight gradients only
    for the adapters (2 more per LoRA parameter); checkpointing runs the forward again. So per token:
    frozen 4 (6 with checkpointing) x params, LoRA 6 (8), attention 3x (4x) its forward. Not 6 x params:
    frozen weights get no weight gradient."""
    forwards = 2 if checkpointing else 1
    matmul, attention = _forward_flops(shape, batch, tokens)
    lora = 2 * shape.lora_params * tokens * batch
    # backward: one matmul per weight for the input gradient; attention's two matmuls each have two inputs
    return (forwards + 1) * matmul + (forwards + 2) * (attention + lora)


def lora_step_seconds(shape: ModelShape, speed: Speed, *, batch: int = 1, tokens: int = 512,
                      checkpointing: bool = True, load: str = "fp16") -> float:  # fmt: skip
    """One optimizer step of LoRA training on ``batch`` sequences of ``tokens`` (one micro-batch). Every
    pass (forward, again with checkpointing, backward) reads the weights: hidden under the matmuls for a
    16-bit load, but QLoRA's bitsandbytes layers dequantize them first, a separate kernel whose time adds."""
    flops = lora_step_flops(shape, batch=batch, tokens=tokens, checkpointing=checkpointing)
    compute = flops / (speed.flops * speed.training_share)
    reads = (3 if checkpointing else 2) * shape.weight_bytes / (speed.bandwidth * KERNEL_EFFICIENCY.get(load, 1.0))
    quantized = MODES.get(load) is not None and MODES[load].quantized
    device = compute + reads if quantized else max(compute, reads)
    per_layer, fixed = LORA_STEP_OPS[bool(checkpointing)]
    return _combine(speed, device, per_layer * shape.layers + fixed)


def load_seconds(params: int, weight_bytes: int, load: str, *, cached: bool = False, checkpoint_bytes: int = 2,
                 download_bytes_per_s: float = DOWNLOAD_BYTES_PER_S, gpu: bool = True) -> dict[str, float]:  # fmt: skip
    """Seconds per part of a load: download (unless cached), disk read, quantization, host-to-GPU copy.
    The checkpoint is ``checkpoint_bytes`` per parameter (2: the 16-bit files most repos ship)."""
    stored = params * checkpoint_bytes
    parts = {"download": 0.0 if cached else stored / download_bytes_per_s, "read": stored / DISK_BYTES_PER_S}
    if MODES.get(load) is not None and MODES[load].quantized:
        parts["quantize"] = stored / QUANTIZE_BYTES_PER_S
    if gpu:
        parts["to GPU"] = weight_bytes / PCIE_BYTES_PER_S
    return parts


def answers_seconds(shape: ModelShape, speed: Speed, *, answers: int, prompt_tokens: int, new_tokens: int,
                    batch: int = 1, load: str = "fp16") -> float:  # fmt: skip
    """Generating ``answers`` answers of ``new_tokens`` after ``prompt_tokens``, ``batch`` at a time: each batch's
    prefill, then ``new_tokens`` decode steps over a cache that grows (its mean length is exact: reads are linear)."""
    batches = math.ceil(answers / batch)
    context = prompt_tokens + new_tokens / 2
    step = decode_step_seconds(shape, speed, batch=batch, context=context, load=load)
    return batches * (prefill_seconds(shape, speed, batch=batch, tokens=prompt_tokens, load=load) + new_tokens * step)


def approx_duration(seconds: float) -> str:
    """``"~40 s"``, ``"~12 min"``, ``"~1.5 h"``: an estimate's precision, no more (a clock reads
    ``training.view.format_seconds``)."""
    if seconds < 1:
        return f"~{seconds * 1000:.0f} ms" if seconds >= 0.001 else f"~{seconds * 1e6:.0f} us"
    if seconds < 90:
        return f"~{seconds:.0f} s" if seconds >= 10 else f"~{seconds:.1f} s"
    if seconds < 90 * 60:
        return f"~{seconds / 60:.0f} min"
    return f"~{seconds / 3600:.1f} h"


def model_shape(config, lay, weight_bytes: int, kv_dtype_bytes: int = 2, training=None) -> ModelShape:
    """A :class:`ModelShape` from a config and its :func:`~.layout.layout` (``training``: a
    :class:`~.training.LoraTraining` whose adapters count; full training is not timed)."""
    from .layout import adapted_linears, dims, kv_cache_bytes

    d = dims(config)
    embedding = 0 if lay.tied else d["vocab"] * d["h"]  # a lookup, no FLOPs; a tied one is the output layer too
    lora = 0
    if training is not None and hasattr(training, "r"):
        lora = sum(training.r * (e.linear[0] + e.linear[1]) for e in adapted_linears(lay, training.targets))
    return ModelShape(
        matmul_params=max(lay.params - embedding, 0), weight_bytes=int(weight_bytes),
        kv_bytes_per_token=kv_cache_bytes(config, 1, 1, kv_dtype_bytes), layers=d["layers"],
        attn_width=d["heads"] * d["hd"], lora_params=lora, vocab=d["vocab"],
    )  # fmt: skip


@dataclass
class TimeEstimate:
    """How long a plan takes: loading, prompt and decode speed, a training step, and the totals asked for."""

    model: str
    load: str
    device: str
    basis: str
    load_parts: dict[str, float]
    prompt_tokens: int
    new_tokens: int
    prefill_tokens_per_s: float  # one prompt at batch 1
    decode_tokens_per_s: dict[int, float]  # batch -> new tokens per second over the whole batch
    answers: int
    answers_seconds: dict[int, float]  # batch -> seconds for all the answers
    steps: int = 0
    step_seconds: float | None = None
    step_shape: tuple[int, int] | None = None  # (micro_batch, seq_len) of the timed step
    notes: list[str] = field(default_factory=list)

    @property
    def load_total(self) -> float:
        return sum(self.load_parts.values())

    def lines(self) -> list[tuple[str, str]]:
        """``(what, figure)`` pairs, as ``__str__`` and the HTML table show them."""
        parts = ", ".join(f"{k} {approx_duration(v)}" for k, v in self.load_parts.items())
        rows = [("load", f"{approx_duration(self.load_total)} ({parts})"),
                ("prefill", f"~{self.prefill_tokens_per_s:,.0f} tokens/s ({self.prompt_tokens}-token prompt)"),
                ("decode", ", ".join(f"~{v:,.1f} tokens/s at batch {b}" for b, v in self.decode_tokens_per_s.items()))]  # fmt: skip
        rows.append((f"{self.answers} answers of {self.new_tokens} tokens",
                     ", ".join(f"{approx_duration(s)} at batch {b}" for b, s in self.answers_seconds.items())))  # fmt: skip
        if self.step_seconds is not None and self.step_shape is not None:
            mb, seq = self.step_shape
            rows.append((f"{self.steps} LoRA steps ({mb} x {seq} tokens)",
                         f"{approx_duration(self.steps * self.step_seconds)} ({approx_duration(self.step_seconds)} each)"))  # fmt: skip
        return rows

    def __str__(self) -> str:
        w = max(len(k) for k, _ in self.lines())
        head = f"time for {self.model} ({self.load}) on {self.device}: {self.basis}"
        return "\n".join([head] + [f"  {k:<{w}}  {v}" for k, v in self.lines()] + [f"  note: {n}" for n in self.notes])

    def _repr_html_(self) -> str:
        html = table(["", "time"], [list(r) for r in self.lines()],
                     title=f"time for {self.model} ({self.load}) on {self.device}")  # fmt: skip
        return html + "".join(f"<div>{escape(t)}</div>" for t in [self.basis, *self.notes])


def estimate_time(est, device: str | None = None, *, calibration: Calibration | None = None, answers: int = 500,
                  batches: tuple[int, ...] = (1, 8), steps: int = 60, training=None, cached: bool = False,
                  download_bytes_per_s: float = DOWNLOAD_BYTES_PER_S) -> TimeEstimate:  # fmt: skip
    """Time a :class:`~.core.MemoryEstimate`'s plan on ``device`` (a preset with card figures; default the
    estimate's own device) or on what ``calibration`` measured (``calibrate()``: this machine, CPU included).

    Generation uses the estimate's prompt and new tokens; the training step its ``LoraTraining`` (else
    ``training``, else none). ``cached``: the weights are already downloaded.
    """
    from .configs import resolve_config
    from .layout import layout
    from .training import LoraTraining

    dev = device or (None if calibration is not None else est.device)
    if calibration is None and (dev == "cpu" or str(dev) not in CARDS and str(dev) not in DEVICE_SETS):
        from .calibration import calibrate  # this machine's CPU or an unlisted GPU: measure it (once)

        calibration = calibrate()
    calibration = calibration or _measured_card(str(dev))
    speed = speed_for(dev, calibration)
    config, loaded = getattr(est, "config", None), None
    if config is None:
        config, _, loaded = resolve_config(est.source)
    inputs = est.inputs
    tr = inputs.get("training") or training
    lora = tr if isinstance(tr, LoraTraining) else None
    kv_bytes = {"fp32": 4}.get(est.load, 2)
    shape = model_shape(config, layout(config, loaded), est.weights, kv_bytes, lora)
    prompt, new = int(inputs.get("prompt_tokens", 512)), int(inputs.get("max_new_tokens", 256))
    decode = {b: b / decode_step_seconds(shape, speed, batch=b, context=prompt + new / 2, load=est.load)
              for b in batches}  # fmt: skip
    totals = {b: answers_seconds(shape, speed, answers=answers, prompt_tokens=prompt, new_tokens=new, batch=b,
                                 load=est.load) for b in batches}  # fmt: skip
    step = step_shape = None
    if lora is not None:
        step_shape = (lora.micro_batch, lora.seq_len)
        step = lora_step_seconds(shape, speed, batch=lora.micro_batch, tokens=lora.seq_len,
                                 checkpointing=lora.gradient_checkpointing, load=est.load)  # fmt: skip
    notes = []
    if str(dev) in DEVICE_SETS:
        notes.append("layers split over cards run one after the other: one card's speed")
    if not speed.overlap and not cached:
        cached = True  # a CPU run loads from this machine's disk: no download assumed
    return TimeEstimate(
        model=est.model, load=est.load, device=speed.label, basis=speed.basis,
        load_parts=load_seconds(est.params, est.weights, est.load, cached=cached, gpu=speed.overlap,
                                download_bytes_per_s=download_bytes_per_s),
        prompt_tokens=prompt, new_tokens=new,
        prefill_tokens_per_s=prompt / prefill_seconds(shape, speed, batch=1, tokens=prompt, load=est.load),
        decode_tokens_per_s=decode, answers=answers, answers_seconds=totals, steps=steps if lora else 0,
        step_seconds=step, step_shape=step_shape, notes=notes,
    )  # fmt: skip


def _measured_card(preset: str) -> Calibration | None:
    """This process's GPU calibration when that GPU is the preset's card (calibrated on a Colab T4, a plan for
    "t4" uses what was measured there); None otherwise. Never probes."""
    from .calibration import cached_calibration

    try:
        cal = cached_calibration("cuda")
    except (RuntimeError, ValueError):
        return None
    card = DEVICE_SETS.get(preset, (preset,))[0].split("-")[0].upper().replace("RTX", "")
    return cal if cal is not None and card and card in cal.device.upper() else None


def time_line(est) -> str:
    """One line of time for an estimate on a GPU preset with card figures (datasheet x efficiency, no
    probe): decode speed for a generation plan, the step for a training one; "" when it cannot be timed."""
    if est.device not in CARDS:
        return ""
    try:
        t = estimate_time(est, batches=(int(est.inputs.get("batch_size", 1)),))
    except (EstimateError, KeyError, TypeError, ValueError):  # a family whose shape the formulas lack
        return ""
    if t.step_seconds is not None:
        return f"time on {t.device}: {approx_duration(t.step_seconds)} per LoRA step (datasheet x efficiency; .time() for totals)"
    (batch, rate), (_, total) = next(iter(t.decode_tokens_per_s.items())), next(iter(t.answers_seconds.items()))
    return (
        f"time on {t.device}: ~{rate:,.1f} tokens/s decoding at batch {batch}, {t.answers} answers of "
        f"{t.new_tokens} tokens {approx_duration(total)} (datasheet x efficiency; .time() for more)"
    )


def time_basis(device) -> tuple[str | None, Calibration | None] | None:
    """What :func:`view_time` divides by on ``device``, without probing: ``(preset, None)`` for a device preset
    or a GPU named as torch names it ("Tesla T4", an estimate's label for ``"current"``), ``(None,
    calibration)`` for what :func:`~.calibration.calibrate` already measured for this process's device (``"cpu"``,
    ``"current"``, this GPU's name); None when neither (a bare capacity, an uncalibrated CPU, an unlisted GPU)."""
    import torch

    from .calibration import cached_calibration

    if isinstance(device, str) and (device.lower() in CARDS or device.lower() in DEVICE_SETS):
        return device.lower(), None
    if device is not None and not isinstance(device, str):
        return None  # a bare capacity: no card to time
    gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if gpu else ""
    here = device in (None, "current", "cpu") or (gpu and str(device).startswith(name))  # "<name>, capped at 40%"
    if here:
        calibration = cached_calibration("cuda" if gpu and device != "cpu" else "cpu")
        if calibration is not None:
            return None, calibration
    card = card_named(name if here else str(device)) if (gpu and device != "cpu") or not here else None
    return (card, None) if card else None


def view_time(est, device=None, **kwargs) -> TimeEstimate | None:
    """:func:`estimate_time` for a view that must answer at once (a panel's slider, a progress bar), on
    :func:`time_basis` (a preset's card figures, or this process's calibration); None where it has none (it
    never probes) or the formulas lack the model's shape."""
    basis = time_basis(est.device if device is None else device)
    if basis is None:
        return None
    try:
        return estimate_time(est, basis[0], calibration=basis[1], **kwargs)
    except (EstimateError, KeyError, TypeError, ValueError):  # a family whose shape the formulas lack
        return None


def card_named(name: str) -> str | None:
    """The :data:`CARDS` key of a GPU as torch names it ("Tesla T4" -> "t4", "NVIDIA A100-SXM4-80GB" ->
    "a100-80"); None for a card without figures."""
    flat = name.lower().replace(" ", "").replace("-", "")
    keys = [(k, *k.partition("-")[::2]) for k in CARDS]
    sized = [k for k, base, size in keys if size and base.replace("rtx", "") in flat and f"{size}gb" in flat]
    plain = [k for k, base, size in keys if base.replace("rtx", "") in flat]  # the first of a size: the smaller
    return (sized or plain or [None])[0]


def offload_seconds(cpu_bytes: int = 0, disk_bytes: int = 0) -> float:
    """Seconds an offloaded placement adds to every forward pass (each decode step, each prefill): accelerate's
    hooks copy the ``cpu_bytes`` of weights in CPU RAM over PCIe, and read the ``disk_bytes`` from disk first."""
    return cpu_bytes / PCIE_BYTES_PER_S + disk_bytes / DISK_BYTES_PER_S
