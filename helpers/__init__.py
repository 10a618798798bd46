"""oomkit: load, fine-tune and evaluate Hugging Face models on small GPUs without OOM crashes.

The notebook API is importable from here (``from helpers import snapshot, estimate, LoadPlan``).
Names load lazily, on first use, so neither ``import helpers`` nor ``%load_ext helpers`` imports torch (a
notebook's first cell shows preflight's first lines before torch's seconds of import); each concern lives in its
own module (see docs/architecture.md).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from .core import session

__version__ = "0.1.0"

# public name -> module that defines it; the one table of the notebook API
_API: dict[str, str] = {
    **dict.fromkeys(["GiB", "MiB", "format_bytes", "parse_bytes"], "core.units"),
    **dict.fromkeys(["OomkitError"], "core.errors"),
    **dict.fromkeys(["MemorySnapshot", "snapshot", "allocated", "reserved", "peak_allocated"], "core.memory"),
    **dict.fromkeys(["CleanupReport", "cleanup", "free", "unload"], "oom.reclaim"),
    **dict.fromkeys(["PreflightReport", "preflight"], "environment"),
    **dict.fromkeys(["estimate", "MemoryEstimate"], "estimator.core"),
    **dict.fromkeys(["footprint"], "estimator.footprint"),
    **dict.fromkeys(["max_new_tokens_that_fit", "max_batch_that_fits", "FitVerdict"], "estimator.fitting"),
    **dict.fromkeys(["LoraTraining", "FullTraining"], "estimator.training"),
    **dict.fromkeys(["estimate_time", "TimeEstimate"], "estimator.timing"),
    **dict.fromkeys(["calibrate"], "estimator.calibration"),
    **dict.fromkeys(["module_memory", "ModuleMemory"], "loading.model_parts"),
    **dict.fromkeys(["fit"], "placement.machine_fit"),
    **dict.fromkeys(
        ["data_path", "shipped_configs", "persistent_path", "no_config_help", "mount_drive"],
        "core.sources"),
    **dict.fromkeys(["configure_allocator", "needs_restart_for", "gpu_notice"], "core.runtime"),
    **dict.fromkeys(["LoadPlan"], "loading.plan"),
    **dict.fromkeys(["check_plan"], "loading.checks"),
    **dict.fromkeys(["decide_placement", "PlacementDecision"], "placement.decision"),
    **dict.fromkeys(["LoadReport"], "loading.report"),
    **dict.fromkeys(["load"], "loading.loader"),
    **dict.fromkeys(["compare_loads", "LoadComparison"], "loading.compare"),
    **dict.fromkeys(["generate_batched"], "loading.generation"),
    **dict.fromkeys(["plan_devices", "DevicePlan"], "placement.device_plan"),
    **dict.fromkeys(["fits_table", "FitsTable"], "placement.fits"),
    **dict.fromkeys(["ModelFits"], "placement.fits"),
    **dict.fromkeys(
        ["training_memory", "TrainingMemory", "launch", "ddp_qlora_worker", "RankReport"],
        "training.distributed"),
    **dict.fromkeys(["write_launch_config", "launch_plan", "launch_qlora", "LaunchConfig"], "training.launch_config"),
    **dict.fromkeys(["rank_ram", "RankRam"], "loading.host_ram"),
    **dict.fromkeys(["LoadPanel"], "panels.widgets"),
    **dict.fromkeys(["TrainPanel"], "panels.train_panel"),
    **dict.fromkeys(["is_oom"], "oom.messages"),
    **dict.fromkeys(["explain_oom", "OOMReport"], "oom.diagnosis"),
    **dict.fromkeys(["find_max_batch_size", "adaptive_batch"], "oom.batch_size"),
    **dict.fromkeys(["load_prompts"], "evaluation.prompts"),
    **dict.fromkeys(["is_record"], "evaluation.results_file"),
    **dict.fromkeys(["safe_generate"], "evaluation.evaluate"),
    **dict.fromkeys(["EvalReport", "side_by_side"], "evaluation.report"),
    **dict.fromkeys(["simulated_budget"], "testing"),
    **dict.fromkeys(["TrainPlan", "FinetuneError"], "training.plan"),
    **dict.fromkeys(["prepare_qlora", "save_adapter", "merge_adapter"], "training.adapters"),
    **dict.fromkeys(["load_instructions", "build_dataset", "answer"], "training.data"),
    **dict.fromkeys(["load_processor", "build_family_dataset"], "training.family_data"),
    **dict.fromkeys(["find_micro_batch", "train"], "training.finetune"),
    **dict.fromkeys(["CheckpointError"], "training.checkpoints"),
    **dict.fromkeys(["MemoryMonitor"], "monitoring.monitor"),
    **dict.fromkeys(["MemoryCallback"], "monitoring.memory_callback"),
    **dict.fromkeys(["TrainView", "TrainProgress"], "training.view"),
    **dict.fromkeys(["census", "census_diff"], "leaks.census"),
    **dict.fromkeys(["watch"], "leaks.growth"),
    **dict.fromkeys(["leak_checks"], "leaks.patterns"),
    **dict.fromkeys(["record_allocations", "top_allocation_sites"], "leaks.allocations"),
}  # fmt: skip

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'helpers' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


def _quiet_optional_cpu_kernel(record: logging.LogRecord) -> bool:
    # bitsandbytes logs a warning on every import on AVX512-bf16 CPUs when the optional `kernels`
    # package (which fetches a faster 4-bit CPU kernel from the Hub) is absent; its built-in CPU
    # path works, and CPU is only where oomkit's demos and tests run, so the line is noise there.
    return "gemm_4bit_forward from kernels-community" not in str(record.msg)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_quiet_optional_cpu_kernel)

# In Colab, tqdm's bars and the load panel render only once the widget manager that fits the
# runtime's ipywidgets is on; the notebooks' first cell imports helpers, so that is before any bar.
session.enable_colab_widgets()

# Modules that hook into IPython when a notebook runs `%load_ext helpers`; each has
# `load_ipython_extension(ip)` / `unload_ipython_extension(ip)` (so `%load_ext helpers.oom.hook` works alone too).
IPYTHON_EXTENSIONS = ["helpers.oom.hook", "helpers.monitoring.cellstats"]


def _extension_modules():
    return [importlib.import_module(name) for name in IPYTHON_EXTENSIONS]


def load_ipython_extension(ip) -> None:
    """``%load_ext helpers``: OOM diagnosis on error and per-cell memory accounting."""
    for mod in _extension_modules():
        mod.load_ipython_extension(ip)


def unload_ipython_extension(ip) -> None:
    for mod in _extension_modules():
        mod.unload_ipython_extension(ip)
