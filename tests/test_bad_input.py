"""A table-driven sweep of bad input over the public API (``helpers.__all__``) and the CLI (issue 31).

Every case is one call with one bad value (a wrong type, a negative, zero, NaN or huge number, an
empty string, an unknown name, a missing file, a folder for a file, unicode, a hostile config.json)
and one expectation:

- ``ERR``: a clear error. It is an oomkit error (``OomkitError``) or a ``ValueError``/``TypeError``/
  ``OSError`` raised by a frame inside ``helpers/``, and its message names the bad value or the
  argument it came in (so the user knows what to change).
- ``OK``: a documented acceptance (the docstring says the value is taken, e.g. ``max_new_tokens=0``).
- ``FAILED``: preflight's way: the report comes back with ``ok`` False and a failed check naming the
  problem (so a notebook shows every check, and the CLI exits 1).

CLI cases expect an exit status (2 bad input, 1 a failed check or a plan that does not fit) and no
traceback. Each case must answer within ``CASE_S`` CPU seconds; an alarm turns a hang into a failure.
``python tests/test_bad_input.py`` prints a summary of every case that does not hold.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import helpers
from helpers import cli

HELPERS = Path(helpers.__file__).parent
REPO = HELPERS.parent
CASE_S = 2.0  # CPU seconds (of the calling thread) per case: a busy machine does not make a case slow
# (the first estimate's transformers import is done beforehand)
HANG_S = 10  # an alarm ends a case that hangs
ERR, OK, FAILED = "error", "accepted", "failed check"
NAN, INF = math.nan, math.inf
HUGE = 10**30
CLEAR_TYPES = (helpers.OomkitError, ValueError, TypeError, OSError, LookupError)


@dataclass
class Case:
    name: str
    call: Callable[[], Any]
    expect: str = ERR
    needles: tuple[str, ...] = ()  # one of these must appear in the message (case-insensitive)


class Hang(Exception):
    pass


def _alarm(*_):
    raise Hang(f"no answer within {HANG_S} s")


def _from_helpers(e: BaseException) -> bool:
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(HELPERS)


def _words(value: Any) -> tuple[str, ...]:
    """How a message may name ``value``."""
    kind = type(value).__name__
    out = [repr(value), str(value), f"got {kind}", f"not {kind}", f"({kind})", f"not a {kind}"]
    if isinstance(value, float) and math.isnan(value):
        out.append("nan")
    if isinstance(value, list | tuple | dict):  # a message may name the element that is wrong
        out += [repr(v) for v in (list(value.items()) + list(value.values()) + list(value) if isinstance(value, dict)
                                  else value)]  # fmt: skip
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**6:
        out.append("large")
    return tuple(w[:40] for w in out if w)


def judge(case: Case) -> str | None:
    """``None`` when the case holds, else what went wrong (raw / silent / hang / vague / slow)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    t0 = time.thread_time()
    try:
        result = case.call()
    except Hang:
        return "hang"
    except Exception as e:  # noqa: BLE001 - the point is to look at whatever comes out
        took = time.thread_time() - t0
        if case.expect == OK:
            return f"raised {type(e).__name__}: {str(e)[:150]}"
        if not isinstance(e, CLEAR_TYPES) or not (isinstance(e, helpers.OomkitError) or _from_helpers(e)):
            where = traceback.extract_tb(e.__traceback__)[-1]
            return f"raw {type(e).__name__} from {Path(where.filename).name}:{where.lineno}: {str(e)[:150]}"
        message = str(e).lower()
        if not message.strip():
            return f"empty {type(e).__name__} message"
        if case.needles and not any(n.lower() in message for n in case.needles):
            return f"vague: {type(e).__name__}: {str(e)[:150]} (names none of {case.needles})"
        if took > CASE_S:
            return f"slow: {took:.1f} s"
        return None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    took = time.thread_time() - t0
    if case.expect == ERR:
        return "accepted silently"
    if case.expect == FAILED:
        text = str(result).lower()
        if result.ok or not any(n.lower() in text for n in case.needles):
            return f"preflight passed or its failed check names none of {case.needles}"
    return f"slow: {took:.1f} s" if took > CASE_S else None


# --- the API table ---------------------------------------------------------------------------------

INT_BAD = [0, -1, 1.5, NAN, INF, HUGE, "8", None, True]
SIZE_BAD = [-1, 1.5, NAN, INF, "8", None, True]  # 0 allowed
FRACTION_BAD = [-0.1, 1.5, NAN, INF, "0.9", None]
FLAG_BAD = ["no", "yes", 2, None, "False"]
NAME_BAD = ["", "   ", "no-such-thing", 5, None, "ünïcödé-名前"]


def params(prefix: str, fn: Callable, name: str, values: list, /, **fixed) -> list[Case]:
    """One case per bad value of argument ``name`` of ``fn`` (the other arguments valid)."""
    return [
        Case(f"{prefix}: {name}={v!r}"[:120], lambda v=v: fn(**{**fixed, name: v}), ERR, (name, *_words(v)))
        for v in values
    ]


def hostile_configs(root: Path) -> dict[str, Path]:
    """name -> a model folder whose config.json is hostile or broken (on a real llama config)."""
    base = json.loads((helpers.data_path("configs") / "meta-llama--Llama-2-7b-hf.json").read_text())
    changes: dict[str, dict] = {
        "layers 10**12": {"num_hidden_layers": 10**12},
        "layers 100000": {"num_hidden_layers": 100_000},
        "layers -1": {"num_hidden_layers": -1},
        "layers 0": {"num_hidden_layers": 0},
        "layers '32'": {"num_hidden_layers": "32"},
        "layers 1.5": {"num_hidden_layers": 1.5},
        "layers null": {"num_hidden_layers": None},
        "hidden -64": {"hidden_size": -64},
        "hidden 0": {"hidden_size": 0},
        "hidden 10**12": {"hidden_size": 10**12},
        "hidden '4096'": {"hidden_size": "4096"},
        "hidden true": {"hidden_size": True},
        "vocab -1": {"vocab_size": -1},
        "vocab 10**15": {"vocab_size": 10**15},
        "heads 0": {"num_attention_heads": 0},
        "heads -32": {"num_attention_heads": -32},
        "kv heads 0": {"num_key_value_heads": 0},
        "intermediate -1": {"intermediate_size": -1},
        "intermediate 10**13": {"intermediate_size": 10**13},
        "torch_dtype float128": {"torch_dtype": "float128"},
        "torch_dtype 5": {"torch_dtype": 5},
        "torch_dtype list": {"torch_dtype": ["float16"]},
        "max positions -1": {"max_position_embeddings": -1},
        "model_type 5": {"model_type": 5},
    }
    out = {}
    for label, change in changes.items():
        folder = root / ("cfg-" + "".join(c if c.isalnum() else "_" for c in label))
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({**base, **change}))
        out[label] = folder
    return out


def bad_files(root: Path) -> dict[str, Path]:
    """name -> a path that is not what a file argument wants."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "empty.jsonl").write_text("")
    (root / "binary.jsonl").write_bytes(b"\x00\xff\xfe\x80" * 64)
    (root / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    (root / "not-json.jsonl").write_text("{this is not json\n")
    (root / "list-line.jsonl").write_text("[1, 2, 3]\n")
    (root / "a-folder").mkdir(exist_ok=True)
    return {
        "missing file": root / "no" / "such.jsonl",
        "a folder": root / "a-folder",
        "empty file": root / "empty.jsonl",
        "binary file": root / "binary.jsonl",
        "latin-1 file": root / "latin1.jsonl",
        "not JSON": root / "not-json.jsonl",
        "a JSON list per line": root / "list-line.jsonl",
        "unicode missing": root / "ünï" / "名前.jsonl",
    }


def estimate_cases(root: Path) -> list[Case]:
    est = helpers.estimate
    m = "Llama-2-7b-hf"
    cases = params(
        "estimate",
        est,
        "model",
        ["", " ", 5, None, ["a"], 3.5, str(root / "nope" / "x"), str(root / "files" / "a-folder"), "ünïcödé/名前-7b"],
    )
    cases += [Case(f"estimate: config {k}", lambda p=p: est(str(p), load="nf4", device="t4"), ERR,
                   tuple(k.split()[:1]) + ("config",)) for k, p in hostile_configs(root).items()]  # fmt: skip
    cases += params("estimate", est, "load", ["int3", "", "int4", 4, None, "fp64", "NF5"], model=m)
    cases += params("estimate", est, "double_quant", FLAG_BAD, model=m, load="nf4")
    cases += params("estimate", est, "compute_dtype", ["float128", "", 16, "int8", None], model=m, load="nf4")
    cases += params("estimate", est, "batch_size", INT_BAD, model=m, load="nf4")
    cases += params("estimate", est, "prompt_tokens", INT_BAD, model=m, load="nf4")
    cases += params("estimate", est, "max_new_tokens", SIZE_BAD + [HUGE], model=m, load="nf4")
    cases += params("estimate", est, "training", ["lora", 5, {}, True], model=m, load="nf4")
    cases += params("estimate", est, "device", ["t5", "", -1, 0, NAN, INF, "-5GiB", [], object(), "ünï"],
                    model=m, load="nf4")  # fmt: skip
    cases += params("estimate", est, "skip_modules", ["lm_head", 5, [5]], model=m, load="nf4")
    cases += params("estimate", est, "sampling", FLAG_BAD, model=m, load="nf4")
    cases += [Case("estimate: max_new_tokens=0 (prefill only)", lambda: est(m, load="nf4", max_new_tokens=0), OK)]
    return cases


def training_cases() -> list[Case]:
    lora, full = helpers.LoraTraining, helpers.FullTraining
    cases = params("LoraTraining", lora, "r", INT_BAD)
    cases += params("LoraTraining", lora, "alpha", [0, -1, NAN, "32", None])
    cases += params("LoraTraining", lora, "targets", [5, "", [], [5], None])
    cases += params("LoraTraining", lora, "optimizer", ["adam", "", 5, None])
    cases += params("LoraTraining", lora, "gradient_checkpointing", FLAG_BAD)
    cases += params("LoraTraining", lora, "seq_len", INT_BAD)
    cases += params("LoraTraining", lora, "micro_batch", INT_BAD)
    cases += params("LoraTraining", lora, "lora_dropout", [-0.1, 1.0, 1.5, NAN, "0.1", None])
    cases += params("FullTraining", full, "optimizer", ["adam", "", 5])
    cases += params("FullTraining", full, "gradient_checkpointing", FLAG_BAD)
    cases += params("FullTraining", full, "seq_len", INT_BAD)
    cases += params("FullTraining", full, "micro_batch", [0, -1, NAN, "1"])
    cases += params("FullTraining", full, "master_weights", FLAG_BAD)
    return cases


def fit_cases() -> list[Case]:
    est = helpers.estimate("Llama-2-7b-hf", load="nf4")
    cases = params("fit", helpers.fit, "est", ["Llama-2-7b-hf", 5, None, {}], device="t4")
    cases += params("fit", helpers.fit, "device", ["t5", "", -1, 0, NAN, INF, [], "ünï"], est=est)
    cases += params("fit", helpers.fit, "suggest", ["no", 2], est=est, device="t4")
    for fn in (helpers.max_new_tokens_that_fit, helpers.max_batch_that_fits):
        cases += params(fn.__name__, fn, "model_or_estimate", [5, None, ""])
        cases += params(fn.__name__, fn, "device", ["t5", -1, NAN], model_or_estimate=est)
        cases += params(fn.__name__, fn, "limit", [0, -1, NAN, "8"], model_or_estimate=est)
    return cases


def plan_cases(root: Path) -> list[Case]:
    lp = helpers.LoadPlan
    m = "Llama-2-7b-hf"
    cases = params("LoadPlan", lp, "model", ["", "  ", 5, None, ["a"]])
    cases += params("LoadPlan", lp, "load", ["int3", "", "int4", 4, None, "fp64"], model=m)
    cases += params("LoadPlan", lp, "double_quant", FLAG_BAD, model=m)
    cases += params("LoadPlan", lp, "compute_dtype", ["float128", "", 16, "int8"], model=m)
    cases += params("LoadPlan", lp, "max_new_tokens", SIZE_BAD, model=m)
    cases += params("LoadPlan", lp, "batch_size", INT_BAD, model=m)
    cases += params("LoadPlan", lp, "prompt_tokens", INT_BAD, model=m)
    cases += params("LoadPlan", lp, "device_map", [5.5, "everywhere", "", ["cuda"], True], model=m)
    cases += params("LoadPlan", lp, "max_memory", ["lots", 5, [1]], model=m)
    cases += params("LoadPlan", lp, "offload_folder", [5, ""], model=m)
    cases += params("LoadPlan", lp, "low_cpu_mem_usage", FLAG_BAD, model=m)
    cases += params("LoadPlan", lp, "allow_offload", FLAG_BAD, model=m)
    cases += params("LoadPlan", lp, "attn_implementation", ["flash9", 5, ""], model=m)
    cases += params("LoadPlan", lp, "trust_remote_code", FLAG_BAD, model=m)
    cases += params("LoadPlan", lp, "adapter", [5, ""], model=m)
    cases += params("LoadPlan", lp, "gpus", [0, -1, 1.5, NAN, "2", True], model=m)
    cases += [Case(f"LoadPlan: config {k}", lambda p=p: lp(str(p), load="auto"), ERR, ("config", k.split()[0]))
              for k, p in list(hostile_configs(root / "lp").items())[::3]]  # fmt: skip
    tp = helpers.TrainPlan
    cases += params("TrainPlan", tp, "model", ["", 5, None])
    cases += params("TrainPlan", tp, "load", ["int3", "", "auto5", 4], model=m)
    cases += params("TrainPlan", tp, "double_quant", FLAG_BAD, model=m)
    for name in ("r", "seq_len", "batch_size", "max_steps", "save_steps", "logging_steps"):
        cases += params("TrainPlan", tp, name, [-1, 1.5, NAN, "8", None, True], model=m)
    cases += params("TrainPlan", tp, "alpha", [0, -1, NAN, "32"], model=m)
    cases += params("TrainPlan", tp, "dropout", [-0.1, 1.0, NAN, "0.1"], model=m)
    cases += params("TrainPlan", tp, "targets", [5, "", [], [5]], model=m)
    cases += params("TrainPlan", tp, "packing", FLAG_BAD, model=m)
    cases += params("TrainPlan", tp, "micro_batch", [0, -1, 3, 1.5, "2"], model=m)
    cases += params("TrainPlan", tp, "optimizer", ["adam", "", 5], model=m)
    cases += params("TrainPlan", tp, "gradient_checkpointing", FLAG_BAD, model=m)
    cases += params("TrainPlan", tp, "precision", ["float128", "", 5, "int8"], model=m)
    cases += params("TrainPlan", tp, "epochs", [-1, NAN, INF, "1"], model=m, max_steps=0)
    cases += params("TrainPlan", tp, "learning_rate", [0, -1e-4, NAN, INF, "2e-4"], model=m)
    cases += params("TrainPlan", tp, "warmup_steps", [-1, 1.5, "5"], model=m)
    cases += params("TrainPlan", tp, "save_total_limit", [-1, 1.5], model=m)
    cases += params("TrainPlan", tp, "output_dir", [5, "", str(root / "files" / "empty.jsonl")], model=m)
    return cases


def preflight_cases(root: Path) -> list[Case]:
    pf = helpers.preflight
    m = "Llama-2-7b-hf"
    cases = params("preflight", pf, "model", [5, "", ["a"]])
    cases += [Case("preflight: a missing model folder", lambda: pf(str(root / "nope" / "m")), FAILED, ("nope",)),
              Case("preflight: a typo'd shipped id", lambda: pf("meta-llama/Llama-2-7b-hff"), FAILED,
                   ("did you mean",))]  # fmt: skip
    cases += params("preflight", pf, "load", ["int3", "", 4, None, "int4"], model=m)
    cases += params("preflight", pf, "max_new_tokens", SIZE_BAD, model=m)
    cases += params("preflight", pf, "batch_size", INT_BAD, model=m)
    cases += params("preflight", pf, "prompt_tokens", [0, -1, NAN, "512"], model=m)
    cases += params("preflight", pf, "colab", ["yes", 2], model=m)
    cases += params("preflight", pf, "snapshot", [5, "now"], model=m)
    cases += params("preflight", pf, "package_versions", [5, "torch"], model=m)
    cases += params("preflight", pf, "bnb", [5, "yes"], model=m)
    cases += [Case(f"preflight: config {k}", lambda p=p: pf(str(p), load="nf4"), FAILED, ("config", k.split()[0]))
              for k, p in list(hostile_configs(root / "pf").items())[1::3]]  # fmt: skip
    return cases


def placement_cases() -> list[Case]:
    pd, ft, tm = helpers.plan_devices, helpers.fits_table, helpers.training_memory
    m = "Llama-2-7b-hf"
    cases = params("plan_devices", pd, "model", [5, "", None], load="nf4")
    cases += params("plan_devices", pd, "load", ["int3", "", 4], model=m)
    cases += params("plan_devices", pd, "devices", ["t5", [], 5, {5: "t4"}, [-1], "ünï"], model=m, load="nf4")
    cases += params("plan_devices", pd, "cpu_offload", FLAG_BAD, model=m, load="nf4", devices="t4")
    cases += params("plan_devices", pd, "headroom", [-1, "lots", NAN], model=m, load="nf4", devices="t4")
    cases += params("plan_devices", pd, "cpu_memory", [-1, NAN, "8GiB"], model=m, load="nf4", devices="t4")
    cases += params("plan_devices", pd, "batch_size", [0, -1, NAN], model=m, load="nf4", devices="t4")
    cases += params("fits_table", ft, "loads", [("int3",), "nf4", (), 5])  # None: every mode (documented)
    cases += params("fits_table", ft, "machines", [5, {"x": "t5"}, {}, "t4"])
    cases += params("fits_table", ft, "model", ["", 5])  # a model name is what fits_table(model) takes
    cases += params("fits_table", ft, "tokens", [0, 1, -5, "768", True], model=m)
    cases += params("training_memory", tm, "model", [5, "", None])
    cases += params("training_memory", tm, "strategy", ["zero4", "", 5], model=m)
    cases += params("training_memory", tm, "world_size", [0, -1, 1.5, "2"], model=m)
    cases += params("training_memory", tm, "seq_len", [0, -1, NAN], model=m)
    cases += params("training_memory", tm, "micro_batch", [0, -1, NAN], model=m)
    cases += params("training_memory", tm, "r", [0, -1, NAN], model=m, qlora=True)
    cases += params("training_memory", tm, "optimizer", ["adam5", 5], model=m)
    cases += params("training_memory", tm, "qlora", FLAG_BAD, model=m)
    cases += params("training_memory", tm, "device", ["t5", -1], model=m)
    return cases


def runtime_cases() -> list[Case]:
    ca, nr = helpers.configure_allocator, helpers.needs_restart_for
    bad_settings = ["garbage", "", 5, None, "expandable_segments:Maybe", "max_split_size_mb:-5",
                    "garbage_collection_threshold:2", "expandable_segments:True,,", "ünï:1"]  # fmt: skip
    cases = params("needs_restart_for", nr, "setting", bad_settings)
    cases += [Case(f"configure_allocator: setting={v!r}", lambda v=v: _allocator(ca, v), ERR, ("setting", *_words(v)))
              for v in bad_settings]  # fmt: skip
    cases += params("parse_bytes", helpers.parse_bytes, "text",
                    ["", "abc", "nanGiB", "infGiB", None, "5 XB", "1e400GiB", "GiB", "ünï"])  # fmt: skip
    cases += params("format_bytes", helpers.format_bytes, "n", ["abc", [], NAN, INF])
    cases += params("format_bytes", helpers.format_bytes, "precision", [-1, "2", NAN], n=1024)
    cases += params("persistent_path", helpers.persistent_path, "name", ["", 5, None])
    cases += params("persistent_path", helpers.persistent_path, "default_dir", [5, None], name="x")
    cases += params("data_path", helpers.data_path, "name", ["../../pyproject.toml", "nope", 5, "/etc"])
    cases += params("no_config_help", helpers.no_config_help, "model", [5, None])
    cases += [Case("format_bytes: -1 (a negative difference)", lambda: helpers.format_bytes(-1), OK),
              Case("parse_bytes: '-5GiB' (a difference)", lambda: helpers.parse_bytes("-5GiB"), OK)]  # fmt: skip
    return cases


def _allocator(configure: Callable, setting: Any) -> None:
    before = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    try:
        configure(setting)
    finally:
        for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            os.environ.pop(key, None)
        if before is not None:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = before


def tool_cases(files: dict[str, Path]) -> list[Case]:
    fmb, ab, mm = helpers.find_max_batch_size, helpers.adaptive_batch, helpers.MemoryMonitor

    def step(b):
        return None

    cases = params("find_max_batch_size", fmb, "step", [5, None, "step"])
    cases += params("find_max_batch_size", fmb, "start", INT_BAD, step=step)
    cases += params("find_max_batch_size", fmb, "limit", [0, -1, 1.5, NAN, "8", True], step=step)
    cases += params("find_max_batch_size", fmb, "margin", [0, -0.1, 1.5, NAN, INF, "0.9"], step=step)
    cases += params("find_max_batch_size", fmb, "growth", [1, 0, -2, 1.5, NAN, "4"], step=step)
    cases += params("find_max_batch_size", fmb, "tolerance", [0, -1, 2, NAN, "1"], step=step)
    cases += params("adaptive_batch", ab, "start", INT_BAD)
    cases += params("adaptive_batch", ab, "limit", [0, -1, NAN, "8"])
    cases += params("adaptive_batch", ab, "tolerance", [0, -1, 2, NAN, "0.9"])
    cases += params("adaptive_batch", ab, "grow", FLAG_BAD)
    cases += params("MemoryMonitor", mm, "interval", [0, -1, NAN, INF, "1", None])
    cases += params("MemoryMonitor", mm, "threshold", [90, 0, -0.1, NAN, "0.9", None])
    cases += params("MemoryMonitor", mm, "capacity", [-1, 0, NAN, "15GiB"])
    cases += params("MemoryMonitor", mm, "device", [-1, 1.5, [-1]])
    cases += params("MemoryMonitor", mm, "top", [-1, NAN, "5"])
    cases += params("MemoryMonitor", mm, "warn", FLAG_BAD)
    cases += params("MemoryMonitor", mm, "max_samples", [0, -1, NAN, "10"])
    mc = helpers.MemoryCallback
    cases += params("MemoryCallback", mc, "monitor", [5, "m"])
    cases += params("MemoryCallback", mc, "warmup", [-1, NAN, "2"])
    cases += params("MemoryCallback", mc, "window", [0, -1, NAN])
    cases += params("MemoryCallback", mc, "min_growth", [-1, NAN, "1MiB"])
    w = helpers.watch
    cases += params("watch", w, "step_fn", [5, None], steps=3)
    cases += params("watch", w, "steps", [0, -1, NAN, "5"], step_fn=lambda: None)
    cases += params("watch", w, "warmup", [-1, NAN], step_fn=lambda: None, steps=3)
    cases += params("watch", w, "window", [0, -1], step_fn=lambda: None, steps=3)
    cases += params("watch", w, "capacity", [-1, NAN], step_fn=lambda: None, steps=3)
    cases += params("explain_oom", helpers.explain_oom, "error_or_text", [5, None, b"CUDA out of memory", []])
    cases += [Case("explain_oom: '' (no OOM in it: the unknown form)", lambda: helpers.explain_oom(""), OK)]
    cases += params("explain_oom", helpers.explain_oom, "live", ["yes", 2], error_or_text="CUDA out of memory.")
    cases += [Case("explain_oom: a megabyte of text", lambda: helpers.explain_oom("x" * 10**6), OK)]
    cases += params("load_prompts", helpers.load_prompts, "prompts",
                    [5, None, [], [5], [""], [{"prompt": 5}], [{"text": "hi"}], "what is a tensor?",
                     *files.values()])  # fmt: skip
    cases += params("load_instructions", helpers.load_instructions, "path", list(files.values()) + [5])
    cases += params("top_allocation_sites", helpers.top_allocation_sites, "snapshot",
                    [5, list(files.values())[0], list(files.values())[1], list(files.values())[3]])  # fmt: skip
    cases += params("top_allocation_sites", helpers.top_allocation_sites, "n", [-1, "5", NAN], snapshot={})
    return cases


def memory_cases() -> list[Case]:
    cases = params("cleanup", helpers.cleanup, "namespace", [5, "globals", []])
    cases += params("cleanup", helpers.cleanup, "drop_history", ["no", 2])
    cases += params("free", lambda names=(), **kw: helpers.free(*names, **kw), "names", [(5,), ("",), (None,)])
    cases += params("free", helpers.free, "namespace", [5, "globals"])
    cases += params("unload", helpers.unload, "model", [5, None, "model"])
    cases += params("snapshot", helpers.snapshot, "disks", [5, "/", {"x": 5}])
    cases += params("snapshot", helpers.snapshot, "processes", ["no", 2])
    cases += params("census", helpers.census, "namespace", [5, "globals"])
    cases += params("census_diff", helpers.census_diff, "before", [5, None], after=None)
    cases += params("leak_checks", helpers.leak_checks, "namespace", [5, "x"])
    cases += params("leak_checks", helpers.leak_checks, "cache_entries", [-1, NAN, "16"])
    cases += params("footprint", helpers.footprint, "model", [5, "Llama-2-7b-hf", None])
    cases += params("is_oom", helpers.is_oom, "exc", [5, b"CUDA out of memory", []])
    cases += [Case("is_oom: message text (read as is_oom_text)", lambda: helpers.is_oom("CUDA out of memory"), OK),
              Case("is_oom: None (no exception, not an OOM)", lambda: helpers.is_oom(None), OK)]  # fmt: skip
    cases += params("simulated_budget", _entered(helpers.simulated_budget), "tokens", [0, -1, NAN, "100"],
                    model=torch.nn.Linear(1, 1))  # fmt: skip
    cases += params("simulated_budget", _entered(helpers.simulated_budget), "model", [5, None], tokens=10)
    cases += params("launch", helpers.launch, "function", [5, None])
    cases += params("launch", helpers.launch, "num_processes", [0, -1, 1.5, "2"], function=print)
    cases += params("launch", helpers.launch, "via", ["mpi", "", 5], function=print)
    for fn in (helpers.allocated, helpers.reserved, helpers.peak_allocated):
        cases += params(fn.__name__, fn, "device", ["gpu", -1, 1.5, "cpu"])
    cases += params("check_plan", helpers.check_plan, "plan", [5, None, {}])
    cases += params("load", helpers.load, "plan", [5, None, "", "  "])
    return cases


def _entered(manager: Callable) -> Callable:
    """A context-manager function as a call that enters and leaves it (its checks run on entry)."""

    def call(**kwargs):
        with manager(**kwargs):
            pass

    return call


def model_cases(tiny: Path, files: dict[str, Path], root: Path) -> list[Case]:
    """Cases that need the tiny model (loaded once)."""
    model, tokenizer, _ = helpers.load(helpers.LoadPlan(str(tiny), load="fp32"))
    sg = helpers.safe_generate
    res = str(root / "r.jsonl")
    base = {"model": model, "tokenizer": tokenizer, "prompts": ["hi"], "results": res, "progress": False}
    cases = params("safe_generate", sg, "prompts", [5, None, [], [5], [""]], **base)
    cases += params("safe_generate", sg, "max_new_tokens", [-1, 1.5, NAN, "8", None, HUGE], **base)
    cases += params("safe_generate", sg, "batch_size", [0, -1, 1.5, "big", NAN, None], **base)
    cases += params("safe_generate", sg, "results", [5, str(root / "files" / "a-folder"), ""], **base)
    cases += params("safe_generate", sg, "resume", ["no", 2], **base)
    cases += params("safe_generate", sg, "generation_kwargs", [5, "greedy", {"num_beams": -1}], **base)
    cases += params("safe_generate", sg, "score", ["nope", 5], **base)
    cases += params("safe_generate", sg, "max_batch_size", [0, -1, NAN], **base)
    cases += params("safe_generate", sg, "model", [5, None], **{k: v for k, v in base.items() if k != "model"})
    cases += params("safe_generate", sg, "tokenizer", [5, None], **{k: v for k, v in base.items() if k != "tokenizer"})
    gb = helpers.generate_batched
    gbase = {"model": model, "tokenizer": tokenizer, "prompts": ["hi"], "progress": False}
    cases += params("generate_batched", gb, "prompts", [5, "hi", [5]], **gbase)
    cases += params("generate_batched", gb, "max_new_tokens", [-1, NAN, "8"], **gbase)
    cases += params("generate_batched", gb, "batch_size", [0, -1, NAN, "4"], **gbase)
    bd = helpers.build_dataset
    rows = [{"instruction": "say hi", "response": "hi"}]
    cases += params("build_dataset", bd, "rows", [5, [5], [{}], "rows", None], tokenizer=tokenizer, seq_len=64)
    cases += params("build_dataset", bd, "seq_len", [0, -1, NAN, "64", None, 1.5], tokenizer=tokenizer, rows=rows)
    cases += params("build_dataset", bd, "tokenizer", [5, None], rows=rows, seq_len=64)
    an = helpers.answer
    cases += params("answer", an, "instructions", [5, "say hi", [5]], model=model, tokenizer=tokenizer)
    cases += params("answer", an, "max_new_tokens", [-1, NAN], model=model, tokenizer=tokenizer, instructions=["x"])
    cases += params("answer", an, "batch_size", [0, -1], model=model, tokenizer=tokenizer, instructions=["x"])
    plan = helpers.TrainPlan(str(tiny), load="fp32", output_dir=str(root / "out"))
    cases += params("prepare_qlora", helpers.prepare_qlora, "model", [5, None], plan=plan)
    cases += params("prepare_qlora", helpers.prepare_qlora, "plan", [5, "plan", None], model=model)
    cases += params("find_micro_batch", helpers.find_micro_batch, "model", [5, None], plan=plan)
    cases += params("find_micro_batch", helpers.find_micro_batch, "margin", [0, -1, 1.5, NAN], model=model, plan=plan)
    cases += params("save_adapter", helpers.save_adapter, "model", [5, None], path=str(root / "ad"))
    cases += params("merge_adapter", helpers.merge_adapter, "model", [5, None, model])
    cases += params("train", helpers.train, "plan", [5, None], model=model, tokenizer=tokenizer, dataset=[])
    cases += params("train", helpers.train, "dataset", [5, [], [5]], model=model, tokenizer=tokenizer, plan=plan)
    cases += params("TrainPanel", helpers.TrainPanel, "plan", [5, None, "x"])
    cases += params("TrainPanel", helpers.TrainPanel, "device", ["t5", -1], plan=plan, widgets=False)
    cases += params("LoadPanel", helpers.LoadPanel, "device", ["t5", -1], model="Llama-2-7b-hf", widgets=False)
    cases += params("LoadPanel", helpers.LoadPanel, "load", ["int3", 4], model="Llama-2-7b-hf", widgets=False)
    cases += adapter_cases(tiny, root)
    return cases


def adapter_cases(tiny: Path, root: Path) -> list[Case]:
    """A corrupted or missing adapter passed to load(): a clear error naming the file."""
    root = root / "adapters"
    root.mkdir(parents=True)
    good_config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                   "base_model_name_or_path": str(tiny), "task_type": "CAUSAL_LM"}  # fmt: skip
    kinds: dict[str, dict[str, bytes | str] | None] = {
        "missing folder": None,
        "empty folder": {},
        "config not JSON": {"adapter_config.json": "{nope"},
        "config a list": {"adapter_config.json": "[1]"},
        "config not UTF-8": {"adapter_config.json": b"\xff\xfe"},
        "config without weights": {"adapter_config.json": json.dumps(good_config)},
        "weights not safetensors": {"adapter_config.json": json.dumps(good_config),
                                    "adapter_model.safetensors": b"garbage bytes"},
        "weights empty": {"adapter_config.json": json.dumps(good_config), "adapter_model.safetensors": b""},
        "peft_type unknown": {"adapter_config.json": json.dumps({**good_config, "peft_type": "NOPE"})},
        "r negative": {"adapter_config.json": json.dumps({**good_config, "r": -4})},
    }  # fmt: skip
    cases = []
    for label, contents in kinds.items():
        folder = root / label.replace(" ", "-")
        if contents is None:
            plan = helpers.LoadPlan(str(tiny), load="fp32", adapter=str(folder))
            cases.append(Case(f"load: adapter {label}", lambda p=plan: helpers.load(p), ERR, ("adapter",)))
            continue
        folder.mkdir()
        for fname, data in contents.items():
            (folder / fname).write_bytes(data if isinstance(data, bytes) else data.encode())
        plan = helpers.LoadPlan(str(tiny), load="fp32", adapter=str(folder))
        cases.append(Case(f"load: adapter {label}", lambda p=plan: helpers.load(p), ERR, ("adapter",)))
    a_file = root / "file-adapter"
    a_file.write_text("x")
    cases.append(Case("load: adapter is a file", lambda: helpers.load(helpers.LoadPlan(
        str(tiny), load="fp32", adapter=str(a_file))), ERR, ("adapter",)))  # fmt: skip
    return cases


def api_cases(root: Path, tiny: Path | None) -> list[Case]:
    files = bad_files(root / "files")
    cases = estimate_cases(root) + training_cases() + fit_cases() + plan_cases(root) + preflight_cases(root)
    cases += placement_cases() + runtime_cases() + tool_cases(files) + memory_cases()
    if tiny is not None:
        cases += model_cases(tiny, files, root)
    return cases


# --- the CLI table ---------------------------------------------------------------------------------


@dataclass
class CliCase:
    argv: list[str]
    code: int  # the exit status expected
    stdin: str = ""


def cli_cases(root: Path) -> list[CliCase]:
    configs = hostile_configs(root / "cli")
    m = "Llama-2-7b-hf"
    cases = [CliCase(["estimate", str(p), "--load", "nf4", "--device", "t4"], 2) for p in configs.values()]
    est_bad = [["--load", "int3"], ["--load", ""], ["--batch", "0"], ["--batch", "-1"], ["--batch", "x"],
               ["--batch", "99999999999999999999999999"], ["--prompt-tokens", "0"], ["--prompt-tokens", "-5"],
               ["--max-new-tokens", "-1"], ["--compute-dtype", "float128"], ["--device", "t5"],
               ["--device", "-5GiB"], ["--device", "9" * 400 + "GiB"], ["--device", ""], ["--device", "nan"],
               ["--lora", "r=x"], ["--lora", "r=0"], ["--lora", "r=-1"], ["--lora", "seq_len=0"],
               ["--lora", "gradient_checkpointing=maybe"], ["--lora", "optimizer=adam"], ["--lora", "nokey"],
               ["--lora", "bogus=1"], ["--lora", "lora_dropout=2"], ["--lora", "micro_batch=0"],
               ["--lora", "r=16", "--full"], ["--unknown-flag"]]  # fmt: skip
    cases += [CliCase(["estimate", m, *a], 2) for a in est_bad]
    cases += [CliCase(["estimate", a], 2) for a in ["", str(root / "nope" / "m"), str(root), "ünï/名前"]]
    cases += [CliCase(["estimate"], 2)]
    pf_bad = [["--load", "int3"], ["--batch", "0"], ["--batch", "x"], ["--prompt-tokens", "0"],
              ["--max-new-tokens", "-1"], ["--model", ""], ["--model", str(root / "nope" / "m")],
              ["--model", "meta-llama/Llama-2-7b-hff"], ["--bogus"]]  # fmt: skip
    cases += [CliCase(["preflight", *a], 1 if a[0] == "--model" and a[1] else 2) for a in pf_bad]
    cases += [CliCase(["explain", str(root / "nope.txt")], 2), CliCase(["explain", str(root)], 2),
              CliCase(["explain"], 2, stdin=""), CliCase(["explain", "--bogus"], 2),
              CliCase(["bogus-command"], 2), CliCase([""], 2)]  # fmt: skip
    return cases


def run_cli(case: CliCase) -> str | None:
    """``None`` when the command exits with the expected status and no traceback, else what happened."""
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.StringIO(case.stdin)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    t0 = time.thread_time()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(case.argv)
            except SystemExit as e:  # argparse's own usage errors exit 2
                code = e.code if isinstance(e.code, int) else 2
    except Hang:
        return "hang"
    except Exception as e:  # noqa: BLE001
        return f"raw {type(e).__name__}: {str(e)[:150]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        sys.stdin = old_stdin
    took = time.thread_time() - t0
    if "Traceback" in err.getvalue() + out.getvalue():
        return "traceback printed"
    if code != case.code:
        return f"exit {code}, expected {case.code}: {(err.getvalue() or out.getvalue())[-200:]!r}"
    if code == 2 and not err.getvalue().strip():
        return "exit 2 without a message on stderr"
    return f"slow: {took:.1f} s" if took > CASE_S else None


# --- the tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bad_input")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # an unknown name never reaches the network


def _warm() -> None:
    helpers.estimate("Llama-2-7b-hf", load="nf4")  # transformers' import is not a case's time


def test_the_api_sweep_gives_a_clear_error_for_every_bad_input(sweep_root, tiny_llama, monkeypatch):
    _warm()
    monkeypatch.chdir(sweep_root)
    cases = api_cases(sweep_root / "api", tiny_llama)
    assert len(cases) >= 450
    failures = [f"{c.name}: {why}" for c in cases if (why := judge(c))]
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


def test_the_cli_sweep_exits_with_a_status_and_a_message_never_a_traceback(sweep_root):
    _warm()
    cases = cli_cases(sweep_root / "cli-root")
    assert len(cases) >= 58
    failures = [f"{c.argv}: {why}" for c in cases if (why := run_cli(c))]
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


@pytest.mark.parametrize(
    "argv",
    [["estimate", "Llama-2-7b-hf", "--batch", "0"], ["preflight", "--load", "int3"]],
)  # fmt: skip
def test_the_cli_in_a_real_process_exits_2_with_one_line_not_a_traceback(argv):
    # timeout=300: a hang guard only (the import of torch on a busy machine takes its time)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "helpers", *argv], capture_output=True, text=True, env=env,
                          timeout=300, cwd=REPO)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip()


if __name__ == "__main__":  # a summary of every case that does not hold
    import tempfile

    sys.path.insert(0, str(REPO / "tests"))
    os.environ["HF_HUB_OFFLINE"] = "1"
    from conftest import _builder

    root = Path(tempfile.mkdtemp())
    _warm()
    os.chdir(root)
    tiny = _builder().build()["llama"] if "--no-model" not in sys.argv else None
    all_cases = api_cases(root / "api", tiny)
    bad = []
    for c in all_cases:
        print("..", c.name, file=sys.stderr, flush=True)
        if w := judge(c):
            bad.append((c.name, w))
            print(f"{c.name}  ->  {w}", flush=True)
    clis = cli_cases(root / "cli-root")
    bad_cli = [(" ".join(c.argv)[:100], w) for c in clis if (w := run_cli(c))]
    for n, w in bad_cli:
        print(f"{n}  ->  {w}")
    print(f"API {len(bad)} of {len(all_cases)} fail; CLI {len(bad_cli)} of {len(clis)} fail")
