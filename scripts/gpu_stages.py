"""The stages of ``scripts/gpu_check.py``: each takes the run and returns ``{"rows": [...], "notes": [...]}``.

Every row that compares has ``estimate``, ``measured`` and ``error_pct`` (``measured`` is ``None``
where the dry run on CPU has no allocator to read). On a GPU the full-size models are built with
random weights from the shipped configs (random weights change no byte count) and saved locally, so
nothing is downloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from helpers import footprint, unload
from helpers.environment import versions
from helpers.estimator import estimate
from helpers.loading import LoadPlan, load
from helpers.sources import read_json, shipped_config
from helpers.units import format_bytes

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "data" / "tiny" / "llama"
GPU_MODELS = ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "codellama/CodeLlama-7b-hf", "mistralai/Mistral-7B-v0.1",
              "Qwen/Qwen2.5-7B")  # fmt: skip
MODES = (("fp16", True), ("int8", True), ("nf4", True), ("nf4", False))  # (load, double_quant)
TARGETS = {  # issue 21: what a run must show, or state the gap
    "weights": ("weights: max abs error", 0.5),
    "generate": ("generation peak: max abs error", 10.0),
    "qlora": ("QLoRA step peak: max abs error", 15.0),
}


def error_pct(estimated: int | None, measured: int | None) -> float | None:
    if not estimated or measured is None:
        return None
    return round(100.0 * (estimated - measured) / measured, 2)


def format_rows(rows: list[dict]) -> str:
    if not rows:
        return "  (no rows)"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = "  " + "  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True))
    return "\n".join([line] + ["  " + "  ".join(c.ljust(w) for c, w in zip(cs, widths, strict=True)) for cs in cells])


def _cell(v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 1 << 20:
        return format_bytes(v)
    return "-" if v is None else str(v)


def _sync_peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _allocated() -> int | None:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else None


def _peak() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def _without_context(est) -> int:
    """The estimate minus what lives outside PyTorch's allocator (compared with allocator figures)."""
    return est.total - sum(r.bytes for r in est.rows if r.key == "overhead.cuda_context")


# -- models ----------------------------------------------------------------------------------------


def build_random_model(hub_id: str, run) -> Path:
    """A full-size random-weight model from a shipped config, saved as safetensors (once per state folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.estimator.configs import config_from_dict

    out = run.state / "models" / hub_id.replace("/", "--")
    if (out / "config.json").exists():
        return out
    config = config_from_dict(read_json(shipped_config(hub_id)), hub_id)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    model.save_pretrained(out, max_shard_size="2GB")
    AutoTokenizer.from_pretrained(TINY).save_pretrained(out)  # any tokenizer: ids stay below the vocab
    del model
    _sync_peak_reset()
    return out


def models(run) -> list[Path]:
    return [TINY] if run.dry else [build_random_model(m, run) for m in GPU_MODELS]


def big_model(run) -> Path:
    """The model of the generation, QLoRA and recovery stages: a 7B on a GPU, the tiny one in the dry run."""
    return TINY if run.dry else build_random_model("codellama/CodeLlama-7b-hf", run)


def _plan(path: Path, load_mode: str, run, double_quant: bool = True) -> LoadPlan:
    compute = "fp32" if run.dry else "fp16"  # a T4 computes in fp16; the CPU in fp32
    return LoadPlan(str(path), load=load_mode, double_quant=double_quant, compute_dtype=compute,
                    device_map={"": 0} if not run.dry else None)  # fmt: skip


def _partial(run, stage: str) -> list[dict]:
    path = run.partial(stage)
    return json.loads(path.read_text()) if path.exists() else []


def _save_partial(run, stage: str, rows: list[dict]) -> None:
    run.partial(stage).write_text(json.dumps(rows, default=str))


# -- stages ----------------------------------------------------------------------------------------


def stage_env(run) -> dict:
    rows = [{"package": k, "version": v} for k, v in versions().items()]
    notes = []
    if not run.dry:
        free, total = torch.cuda.mem_get_info()
        cap = torch.cuda.get_per_process_memory_fraction(0)
        notes.append(f"{torch.cuda.get_device_name(0)}: {format_bytes(total)}, {format_bytes(free)} free, "
                     f"capped to {cap:.3f} of it ({format_bytes(int(total * cap))})")  # fmt: skip
    return {"rows": rows, "notes": notes}


def stage_weights(run) -> dict:
    """estimate().weights vs footprint(model) vs the allocator's growth during the load, per model and mode."""
    rows = _partial(run, "weights")
    done = {(r["model"], r["mode"]) for r in rows}
    for path in models(run):
        for mode, dq in MODES if not run.dry else (("fp32", True), ("int8", True), ("nf4", True), ("nf4", False)):
            label = mode + ("" if dq or mode != "nf4" else " (no dq)")
            if (path.name, label) in done or run.time_left() < 90:
                continue
            rows.append(_weights_row(path, mode, dq, label, run))
            _save_partial(run, "weights", rows)
    incomplete = len(rows) < len(models(run)) * len(MODES)
    return {"rows": rows, "incomplete": incomplete, "notes": ["time ran out: run again"] if incomplete else []}


def _weights_row(path: Path, mode: str, dq: bool, label: str, run) -> dict:
    est = estimate(str(path), load=mode, double_quant=dq, compute_dtype="fp32" if run.dry else "fp16",
                   device="current")  # fmt: skip
    _sync_peak_reset()
    before = _allocated()
    row = {"model": path.name, "mode": label, "estimate": est.weights}
    try:
        model, _, _ = load(_plan(path, mode, run, dq), check=False)
    except torch.OutOfMemoryError as e:
        return {**row, "measured": None, "error_pct": None, "note": f"OOM under the cap: {str(e)[:80]}"}
    grown = None if before is None else _allocated() - before
    row.update(footprint=footprint(model), allocated=grown, measured=grown if grown is not None else footprint(model))
    row["error_pct"] = error_pct(est.weights, row["measured"])
    unload(model)
    return row


def stage_generate(run) -> dict:
    """Peak memory of generate() over batch x prompt x new tokens vs the estimate's total."""
    grid = [(1, 16, 8), (2, 16, 8)] if run.dry else [
        (b, p, n) for b in (1, 4, 8) for p in (512, 2048) for n in (256, 1024)
    ]  # fmt: skip
    rows = _partial(run, "generate")
    done = {(r["batch"], r["prompt"], r["new"]) for r in rows}
    path = big_model(run)
    model, tokenizer, _ = load(_plan(path, "nf4", run), check=False)
    for b, p, n in grid:
        if (b, p, n) in done or run.time_left() < 90:
            continue
        rows.append(_generate_row(model, tokenizer, path, b, p, n, run))
        _save_partial(run, "generate", rows)
    unload(model)
    incomplete = len(rows) < len(grid)
    return {"rows": rows, "incomplete": incomplete, "notes": ["time ran out: run again"] if incomplete else []}


def _generate_row(model, tokenizer, path: Path, b: int, p: int, n: int, run) -> dict:
    est = estimate(str(path), load="nf4", batch_size=b, prompt_tokens=p, max_new_tokens=n,
                   compute_dtype="fp32" if run.dry else "fp16", device="current")  # fmt: skip
    ids = torch.randint(3, min(1000, tokenizer.vocab_size), (b, p), device=model.device)
    _sync_peak_reset()
    row = {"batch": b, "prompt": p, "new": n, "estimate": _without_context(est)}
    try:
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    except torch.OutOfMemoryError:
        return {**row, "measured": None, "error_pct": None, "note": "OOM under the T4 cap"}
    peak = _peak()
    return {**row, "measured": peak, "reserved": torch.cuda.max_memory_reserved() if peak else None,
            "error_pct": error_pct(row["estimate"], peak)}  # fmt: skip


def stage_qlora(run) -> dict:
    """One QLoRA step's peak vs TrainPlan(...).estimate(), over micro-batch, checkpointing and optimizer."""
    from helpers.finetune import TrainPlan

    cells = [(1, True, "adamw_torch"), (2, True, "adamw_torch")] if run.dry else [
        (mb, gc, opt) for gc in (True, False) for opt in ("paged_adamw_8bit", "adamw_torch") for mb in (1, 2, 4)
    ]  # fmt: skip
    rows = _partial(run, "qlora")
    done = {(r["micro_batch"], r["checkpointing"], r["optimizer"]) for r in rows}
    path = big_model(run)
    for mb, gc, opt in cells:
        if (mb, gc, opt) in done or run.time_left() < 120:
            continue
        plan = TrainPlan(str(path), load="nf4", micro_batch=mb, batch_size=mb, gradient_checkpointing=gc,
                         optimizer=opt, seq_len=64 if run.dry else 512, max_steps=2, save_steps=1000,
                         output_dir=str(run.state / "qlora-out"), precision="fp32" if run.dry else "fp16")  # fmt: skip
        rows.append(_qlora_row(plan, path, run))
        _save_partial(run, "qlora", rows)
    incomplete = len(rows) < len(cells)
    return {"rows": rows, "incomplete": incomplete, "notes": ["time ran out: run again"] if incomplete else []}


def _qlora_row(plan, path: Path, run) -> dict:
    from helpers.finetune import build_dataset, load_instructions, make_trainer, prepare_qlora

    est = plan.estimate("cpu" if run.dry else "current")
    row = {"micro_batch": plan.micro_batch, "checkpointing": plan.gradient_checkpointing,
           "optimizer": plan.optimizer, "estimate": _without_context(est)}  # fmt: skip
    model, tokenizer, _ = load(_plan(path, "nf4", run), check=False)
    model, _ = prepare_qlora(model, plan)
    data = build_dataset(tokenizer, load_instructions()[: 8 * plan.micro_batch], plan.seq_len, packing=True)
    _sync_peak_reset()
    try:
        make_trainer(model, tokenizer, plan, data, report_to=[]).train()
        peak = _peak()
        row.update(measured=peak, error_pct=error_pct(row["estimate"], peak))
    except torch.OutOfMemoryError:
        row.update(measured=None, error_pct=None, note="OOM under the T4 cap")
    unload(model)
    return row


def stage_context(run) -> dict:
    """What this process holds outside PyTorch (CUDA context, cuBLAS workspace) vs the rule of thumb."""
    from helpers.devices import CUBLAS_WORKSPACE, CUDA_CONTEXT

    rule = CUDA_CONTEXT + CUBLAS_WORKSPACE
    if run.dry:
        return {"rows": [{"what": "CUDA context + cuBLAS", "estimate": rule, "measured": None, "error_pct": None}],
                "notes": ["no CUDA context on a CPU: measured on a GPU only"]}  # fmt: skip
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.float16)
    (a @ a).sum().item()  # creates the cuBLAS handle and workspace
    from helpers.memory import snapshot

    g = snapshot().gpu
    outside = g.non_pytorch if g is not None else None
    return {"rows": [{"what": "CUDA context + cuBLAS", "estimate": rule, "measured": outside,
                      "error_pct": error_pct(rule, outside)}],
            "notes": ["measured = this process's use (NVML) minus PyTorch's reserved memory"]}  # fmt: skip


def stage_recovery(run) -> dict:
    """Real OOMs under the cap: batch search vs the true maximum, safe_generate loses nothing,
    explain_oom on a live OOM, cleanup() regains what the OOM pinned, the monitor vs the allocator."""
    import gpu_recovery

    path = big_model(run)
    model, tokenizer, _ = load(_plan(path, "nf4" if not run.dry else "fp32", run), check=False)
    try:
        rows = [
            gpu_recovery.batch_search(model, tokenizer, run),
            gpu_recovery.no_result_lost(model, tokenizer, run),
            gpu_recovery.live_explanation(run),
            gpu_recovery.cleanup_after_oom(run),
            gpu_recovery.monitor_vs_allocator(run),
        ]
    finally:
        unload(model)
    return {"rows": rows, "notes": []}


def stage_pytest_cuda(run) -> dict:
    if run.dry:
        return {"rows": [], "notes": ["the cuda-marked tests need a GPU: skipped in the dry run"]}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", str(REPO / "tests")]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=max(60, run.time_left() - 30))
    last = (out.stdout.strip().splitlines() or [""])[-1]
    return {"rows": [{"command": " ".join(cmd[1:6]), "result": last, "exit": out.returncode}],
            "notes": [] if out.returncode == 0 else [out.stdout[-3000:]]}  # fmt: skip


def stage_notebooks(run) -> dict:
    if run.dry:
        return {"rows": [], "notes": ["notebooks run on the CPU in `make test`/`make demo`: skipped in the dry run"]}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "run_notebooks.py")], capture_output=True,
                         text=True, cwd=REPO, timeout=max(60, run.time_left() - 30))  # fmt: skip
    return {"rows": [{"notebooks": "all (tiny model, on the GPU)", "exit": out.returncode,
                      "seconds": round(time.perf_counter() - started, 1)}],
            "notes": [out.stdout[-2000:]] if out.returncode else []}  # fmt: skip


# -- summary ---------------------------------------------------------------------------------------


def summarize(results: dict[str, dict], *, dry: bool) -> str:
    """A table of the issue's targets, met or not, from whatever stages have run."""
    lines = ["# GPU check" + (" (DRY RUN on CPU: no GPU figure)" if dry else ""), "",
             "| target | goal | result | verdict |", "|---|---|---|---|"]  # fmt: skip
    for stage, (what, limit) in TARGETS.items():
        errs = [abs(r["error_pct"]) for r in results.get(stage, {}).get("rows", []) if r.get("error_pct") is not None]
        worst = max(errs) if errs else None
        verdict = "not run" if worst is None else ("dry" if dry else ("PASS" if worst <= limit else "MISS"))
        lines.append(f"| {what} | <= {limit} % | {'-' if worst is None else f'{worst:.2f} %'} | {verdict} |")
    for row in results.get("recovery", {}).get("rows", []):
        verdict = "dry" if dry else ("PASS" if row.get("met") else "MISS")
        lines.append(f"| {row['check']} | {row['goal']} | {row['result']} | {verdict} |")
    return "\n".join(lines)
