"""``calibrate()``: a few seconds of probes that measure this machine's device for the time estimates.

Three probes, each the best of a few repeats (the least disturbed by other work on a shared machine):

- memory bandwidth: copying a tensor far larger than the caches (bytes read + bytes written per second);
- matmul throughput: square matmuls at the dtype the device computes in (fp32 on CPU);
- time per op: tiny Llamas (1 and 5 layers, built from a config in memory, random weights) generating
  tokens: the time per token that four more layers add, divided by the aten ops they issue (counted), and
  what is left of a step (generate()'s own work). For small models this overhead (PyTorch's dispatch and
  transformers' Python) is most of the time, and it depends on the CPU, the Python and the library versions,
  so it is measured, not assumed.

The result is cached per process and device: the notebooks' preflight calls it once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..core.devices import compute_dtype_rule
from ..core.vocab import torch_dtype

__all__ = ["Calibration", "calibrate", "cached_calibration", "count_ops"]

GB, GFLOP = 1e9, 1e9


@dataclass(frozen=True)
class Calibration:
    """What :func:`~helpers.estimator.calibration.calibrate` measured on one device: a big copy's bandwidth,
    a matmul's throughput at the dtype the device computes in, and the time per op of eager transformers."""

    device: str  # "cpu" or "cuda:<name>"
    dtype: str
    bandwidth: float  # bytes/s, reads + writes of a large copy
    flops: float  # FLOP/s of the matmul probe
    op_seconds: float  # one aten op of a decoder layer, issued by transformers on a tiny model
    decode_step_seconds: float  # generate()'s own work per token, outside the layers
    threads: int
    probe_seconds: float  # how long the probes took

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    def __str__(self) -> str:
        return (
            f"calibration on {self.device} ({self.threads} threads): memory {self.bandwidth / GB:.1f} GB/s, "
            f"matmul {self.flops / GFLOP:.1f} GFLOP/s ({self.dtype}), {self.op_seconds * 1e6:.1f} us per op, "
            f"{self.decode_step_seconds * 1000:.2f} ms per generate() step "
            f"(probes took {self.probe_seconds:.1f} s)"
        )


_CACHE: dict[str, Calibration] = {}
# Probe sizes: a copy larger than any CPU's last-level cache (or a GPU's L2), a matmul big enough to
# reach the device's throughput (n^3 work over n^2 data) yet quick.
COPY_BYTES = {"cpu": 128 * 2**20, "cuda": 1024 * 2**20}
MATMUL_N = {"cpu": 1024, "cuda": 4096}


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _best(fn, repeats: int, sync) -> float:
    fn()  # warm: allocations, kernel selection
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def _bandwidth(dev: torch.device, sync) -> float:
    n = COPY_BYTES[dev.type] // 4
    src = torch.empty(n, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _best(lambda: dst.copy_(src), 5, sync)
    return 2 * n * 4 / seconds  # read once, written once


def _matmul(dev: torch.device, dtype: torch.dtype, sync) -> float:
    n = MATMUL_N[dev.type]
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    seconds = _best(lambda: a @ b, 5, sync)
    return 2 * n**3 / seconds


def count_ops(fn) -> int:
    """How many aten ops ``fn()`` issues (TorchDispatchMode): what each costs the Python overhead once."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return _Count.n


def _probe_model(dev: torch.device, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256, max_position_embeddings=128)  # fmt: skip
    return LlamaForCausalLM(config).to(dev).eval()


def _per_token(model, dev: torch.device, sync) -> tuple[float, float]:
    """(seconds, aten ops) of one decode step of ``model``'s generate(): 17 tokens less 1 (the prefill)."""
    ids = torch.ones(1, 8, dtype=torch.long, device=dev)
    mask = torch.ones_like(ids)  # as real callers pass it (safe_generate does): its ops are part of a step

    def gen(n: int):
        # no eos: every call generates exactly n tokens
        return lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip

    with torch.no_grad():
        ops = (count_ops(gen(17)) - count_ops(gen(1))) / 16
        seconds = _best(gen(17), 5, sync) - _best(gen(1), 5, sync)
    return seconds / 16, ops


def _op_seconds(dev: torch.device, sync) -> tuple[float, float]:
    """(seconds per op inside a decoder layer, seconds of generate()'s own work per token): tiny Llamas of 1
    and 5 layers decode; the difference is four layers' ops, the rest is the step's own (sampling, stopping,
    cache bookkeeping: its ops cost about twice a layer's, more Python between them). On a busy machine the
    difference of two timings can come out near zero: then the 5-layer model's mean time per op stands."""
    (t1, n1), (t5, n5) = (_per_token(_probe_model(dev, layers), dev, sync) for layers in (1, 5))
    mean = t5 / max(n5, 1)
    per_op = (t5 - t1) / max(n5 - n1, 1)
    if not mean / 3 <= per_op <= mean * 3:
        per_op = mean
    return per_op, max(t1 - per_op * (n5 - n1) / 4, 0.0)


def calibrate(device=None, *, refresh: bool = False) -> Calibration:
    """Measure this machine's device (default: the GPU if any, else the CPU) for the time estimates: memory
    bandwidth, matmul throughput and the time per op (a few seconds; cached per process and device).

    >>> cal = calibrate()                                   # doctest: +SKIP
    >>> estimate_time(estimate("data/tiny/llama", device="cpu"), calibration=cal)  # doctest: +SKIP
    """
    dev = _device(device)
    key = str(dev)
    if key in _CACHE and not refresh:
        return _CACHE[key]
    started = time.perf_counter()
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    dtype = compute_dtype_rule(dev.type)
    name = "cpu" if dev.type == "cpu" else f"{dev.type}:{torch.cuda.get_device_name(dev)}"
    op_seconds, step_seconds = _op_seconds(dev, sync)
    result = Calibration(
        device=name, dtype=dtype, bandwidth=_bandwidth(dev, sync), flops=_matmul(dev, torch_dtype(dtype), sync),
        op_seconds=op_seconds, decode_step_seconds=step_seconds, threads=torch.get_num_threads(), probe_seconds=0.0,
    )  # fmt: skip
    result = Calibration(**{**result.__dict__, "probe_seconds": time.perf_counter() - started})
    _CACHE[key] = result
    return result


def cached_calibration(device=None) -> Calibration | None:
    """The calibration this process already measured for ``device``, without probing (None: none yet)."""
    return _CACHE.get(str(_device(device)))
