"""The stages of ``scripts/gpu_check.py``: each takes the run and returns ``{"rows": [...], "notes": [...]}``.

Every row that compares has ``estimate``, ``measured`` and ``error_pct`` (``measured`` is ``None``
where the dry run on CPU has no allocator to read). On a GPU the full-size models are built with
random weights from the shipped configs (random weights change no byte count) and saved locally, so
nothing is downloaded.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_cap import uncapped

from helpers import footprint, unload
from helpers.core.sources import read_json, shipped_config
from helpers.core.units import format_bytes
from helpers.environment import versions
from helpers.estimator.core import estimate
from helpers.loading.loader import load
from helpers.loading.plan import LoadPlan

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "data" / "tiny" / "llama"
GPU_MODELS = {  # --models names: the weights stage builds these, one at a time, deleted after use
    "tinyllama": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "codellama": "codellama/CodeLlama-7b-hf",
    "mistral": "mistralai/Mistral-7B-v0.1",
    "qwen": "Qwen/Qwen2.5-7B",
}
DEFAULT_MODELS = ("tinyllama", "codellama")  # session 1; mistral and qwen when time allows
BIG = "codellama"  # the model of the generation, QLoRA and recovery stages: kept between stages
BUILT = ".oomkit-built"  # written last: a folder without it is an interrupted build, never reused
BUILD_INFO = "oomkit-build.json"  # layers kept and build seconds, beside the weights
MODES = (("fp16", True), ("int8", True), ("nf4", True), ("nf4", False))  # (load, double_quant)
TARGETS = {  # issue 21: what a run must show, or state the gap
    "weights": ("weights: max abs error", 0.5),
    "generate": ("generation peak: max abs error", 10.0),
    "qlora": ("QLoRA step peak: max abs error", 15.0),
}
# (batch, prompt, new tokens) of the generate stage: issue 29's cells (what one lent call can measure), and --full's
GENERATE_GRID = [(b, p, 256) for b in (1, 4) for p in (512, 2048)]
FULL_GENERATE_GRID = [(b, p, n) for b in (1, 4, 8) for p in (512, 2048) for n in (256, 1024)]
# (micro-batch, checkpointing, optimizer) of the qlora stage: issue 29's cells with the optimizer TrainPlan picks
# on CUDA, and --full's
QLORA_CELLS = [(1, True, "paged_adamw_8bit"), (2, True, "paged_adamw_8bit")]
FULL_QLORA_CELLS = [
    (mb, gc, opt) for gc in (True, False) for opt in ("paged_adamw_8bit", "adamw_torch") for mb in (1, 2, 4)
]
TIME_CARDS = ("t4", "h200")  # the time predictions registered before a run: the target card and the lent one
STAMP = ("gpu", "cap_bytes", "explanation", "figures", "message", "saved_census")  # in the JSON, not printed


def error_pct(estimated: int | None, measured: int | None) -> float | None:
    if not estimated or measured is None:
        return None
    return round(100.0 * (estimated - measured) / measured, 2)


def format_rows(rows: list[dict]) -> str:
    if not rows:
        return "  (no rows)"
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in STAMP]
    cells = [[_cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = "  " + "  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True))
    return "\n".join([line] + ["  " + "  ".join(c.ljust(w) for c, w in zip(cs, widths, strict=True)) for cs in cells])


def _cell(v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 1 << 20:
        return format_bytes(v)
    return "-" if v is None else str(v)


def sync_peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _allocated() -> int | None:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else None


def peak_allocated() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def without_context(est) -> int:
    """The estimate minus what lives outside PyTorch's allocator (compared with allocator figures)."""
    return est.total - sum(r.bytes for r in est.rows if r.key == "overhead.cuda_context")


# -- models ----------------------------------------------------------------------------------------


def check_disk(folder: Path, need: int) -> None:
    """Refuse, with what to do, before a save that would fill the disk."""
    free = shutil.disk_usage(folder).free
    if free < need + (1 << 30):
        raise OSError(f"building a model needs {format_bytes(need)} (+1 GiB spare) free in {folder}, only "
                      f"{format_bytes(free)} is: set OOMKIT_GPU_MODELS to a folder on a bigger disk, or delete "
                      f"the models there that no stage needs now")  # fmt: skip


def build_once(final: Path, save: Callable[[Path], None]) -> Path:
    """``final`` as ``save(folder)`` makes it, built once: into a temporary folder, marked built last,
    then renamed. A folder without the marker (a save that was killed) is removed and built again."""
    if (final / BUILT).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in [final, *final.parent.glob(f"{final.name}.tmp-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f"{final.name}.tmp-{os.getpid()}"
    try:
        save(tmp)
        (tmp / BUILT).write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def build_random_model(hub_id: str, root: Path, layers: int | None = None) -> Path:
    """A random-weight model from a shipped config (random weights change no byte count), saved as
    safetensors under ``root``, built on the GPU without the cap. ``layers`` cuts it to its first N
    decoder layers (the same layer shapes): a 7B's 13.5 GB build and three loads do not fit a lent
    GPU's 15 minutes, and the estimate of the cut config is what its rows compare with."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.estimator.configs import config_from_dict

    def save(folder: Path) -> None:
        started = time.perf_counter()
        config = config_from_dict(read_json(shipped_config(hub_id)), hub_id)
        full = config.num_hidden_layers
        if layers:
            config.num_hidden_layers = min(layers, full)
            if getattr(config, "layer_types", None):
                config.layer_types = config.layer_types[: config.num_hidden_layers]
        with uncapped(), torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
        try:
            check_disk(root, sum(t.numel() * t.element_size() for t in model.state_dict().values()))
            model.save_pretrained(folder, max_shard_size="2GB")
            AutoTokenizer.from_pretrained(TINY).save_pretrained(folder)  # any tokenizer: ids stay below the vocab
        finally:
            del model
            sync_peak_reset()
        info = {"hub_id": hub_id, "layers": config.num_hidden_layers, "of_layers": full,
                "build_seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
        (folder / BUILD_INFO).write_text(json.dumps(info) + "\n")

    cut = f"-L{layers}" if layers else ""
    print(f"  building {hub_id}{cut} (random weights) in {root}")
    return build_once(root / (hub_id.replace("/", "--") + cut), save)


def build_info(path: Path) -> dict:
    """How a built model was made (layers kept of how many, seconds to build); {} for the tiny model."""
    info = path / BUILD_INFO
    return json.loads(info.read_text()) if info.exists() else {}


def model_path(name: str, run) -> Path:
    if run.dry:
        return TINY
    return build_random_model(GPU_MODELS[name], run.models_dir, run.layers if name == BIG else None)


def drop_model(name: str, run) -> None:
    """Free the disk a model took, except the one later stages load again."""
    if not run.dry and name != BIG:
        shutil.rmtree(run.models_dir / GPU_MODELS[name].replace("/", "--"), ignore_errors=True)


def big_model(run) -> Path:
    """The model of the generation, QLoRA and recovery stages: a 7B on a GPU (cut to ``run.layers``
    decoder layers), the tiny one in the dry run."""
    return model_path(BIG, run)


def model_note(path: Path) -> list[str]:
    """The note every row set of the big model carries: which cut was measured, and its build time."""
    info = build_info(path)
    if not info:
        return []
    cut = (f"the first {info['layers']} of its {info['of_layers']} decoder layers (same layer shapes; the "
           f"estimate is of that same cut config, so the error compares like with like)"
           if info["layers"] < info["of_layers"] else f"all {info['layers']} layers")  # fmt: skip
    return [f"model: {info['hub_id']} with random weights, {cut}; built and saved in {info['build_seconds']} s"]


def plan_for(path: Path, load_mode: str, run, double_quant: bool = True) -> LoadPlan:
    compute = "fp32" if run.dry else "fp16"  # a T4 computes in fp16; the CPU in fp32
    return LoadPlan(str(path), load=load_mode, double_quant=double_quant, compute_dtype=compute,
                    device_map={"": 0} if not run.dry else None)  # fmt: skip


def partial_rows(run, stage: str) -> list[dict]:
    """The rows an earlier call of this run kind saved, on this card under this cap only."""
    path = run.partial(stage)
    rows = json.loads(path.read_text()) if path.exists() else []
    stamp = run.stamp()
    return [r for r in rows if all(r.get(k) == v for k, v in stamp.items())]


def save_partial(run, stage: str, rows: list[dict]) -> None:
    path = run.partial(stage)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, default=str))
    tmp.replace(path)
    run.flush()


def _t4() -> int:
    from helpers.core.devices import DEVICES

    return DEVICES["t4"]["capacity"]


def bnb_skipped(run, what: str) -> dict | None:
    ok, why = run.bnb()
    if ok:
        return None
    return {"rows": [], "skipped": f"skipped: {why}", "notes": [f"{what} needs bitsandbytes: {why}. Try "
            "BNB_CUDA_VERSION=126 (or the CUDA of a library the wheel ships) and run the stage again"]}  # fmt: skip


def _order(cells: list, estimates: dict) -> tuple[list, list]:
    """Cells predicted to fit a T4 first, then the smallest predicted over it as the one confirmation;
    the rest is not worth a lent GPU's minutes. Returns ``(to_run, not_run)``."""
    fit = [c for c in cells if estimates[c] <= _t4()]
    over = sorted((c for c in cells if estimates[c] > _t4()), key=lambda c: estimates[c])
    return fit + over[:1], over[1:]


def incomplete(rows: list[dict], wanted: int, notes: list[str] | None = None) -> dict:
    incomplete = len(rows) < wanted
    return {"rows": rows, "incomplete": incomplete,
            "notes": [*(notes or []), *(["time ran out: run again"] if incomplete else [])]}  # fmt: skip


# -- stages ----------------------------------------------------------------------------------------


def stage_env(run) -> dict:
    rows = [{"package": k, "version": v} for k, v in versions().items()]
    ok, why = run.bnb()
    rows.append({"package": f"bitsandbytes_status({run.device!r})", "version": "ok" if ok else "FAILS"})
    notes = [why, f"cap: {run.cap}"]
    if not ok:
        notes.append("int8/nf4 rows and the stages that load in nf4 will be skipped; try BNB_CUDA_VERSION=126")
    if not run.dry:
        free, total = torch.cuda.mem_get_info()
        fraction = run.cap.get("fraction")
        capped = f"capped to {fraction:.4f} of it ({format_bytes(run.cap['cap_bytes'])})" if fraction else "uncapped"
        notes.append(f"{torch.cuda.get_device_name(0)}: {format_bytes(total)}, {format_bytes(free)} free, {capped}")
    return {"rows": rows, "notes": notes, "bitsandbytes": {"ok": ok, "status": why}}


def stage_weights(run) -> dict:
    """estimate().weights vs footprint(model) vs the allocator's growth during the load, per model and mode."""
    rows = partial_rows(run, "weights")
    modes = MODES if not run.dry else (("fp32", True), ("int8", True), ("nf4", True), ("nf4", False))
    for name in run.models:
        label_of = {(mode, dq): mode + ("" if dq or mode != "nf4" else " (no dq)") for mode, dq in modes}
        todo = [(m, dq) for m, dq in modes if (name, label_of[m, dq]) not in {(r["name"], r["mode"]) for r in rows}]
        if not todo:
            continue
        path = None
        for mode, dq in todo:
            if run.time_left() < 90:
                break
            row = {"name": name, "mode": label_of[mode, dq], **run.stamp()}
            if mode in ("int8", "nf4") and not run.bnb()[0]:
                rows.append({**row, "estimate": None, "measured": None, "error_pct": None,
                             "note": f"skipped: {run.bnb()[1]}"})  # fmt: skip
            else:
                path = path or model_path(name, run)
                rows.append({**row, **_weights_row(path, mode, dq, row["mode"], run)})
            save_partial(run, "weights", rows)
        if all((name, label_of[m, dq]) in {(r["name"], r["mode"]) for r in rows} for m, dq in modes):
            drop_model(name, run)
    return incomplete(rows, len(run.models) * len(modes))


def _weights_row(path: Path, mode: str, dq: bool, label: str, run) -> dict:
    est = estimate(str(path), load=mode, double_quant=dq, compute_dtype="fp32" if run.dry else "fp16",
                   device="current")  # fmt: skip
    sync_peak_reset()
    before = _allocated()
    row = {"model": path.name, "mode": label, "estimate": est.weights}
    history = not run.dry
    if history:  # every block's allocating stack: what the allocator holds beyond the model gets a name
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        model, _, _ = load(plan_for(path, mode, run, dq), check=False)
    except torch.OutOfMemoryError as e:
        if history:
            torch.cuda.memory._record_memory_history(enabled=None)
        return {**row, "measured": None, "error_pct": None, "note": f"OOM under the cap: {str(e)[:80]}"}
    if torch.cuda.is_available():  # frees a loader queued on a stream land before the reading
        torch.cuda.synchronize()
        gc.collect()
    grown = None if before is None else _allocated() - before
    row.update(footprint=footprint(model), allocated=grown, measured=grown if grown is not None else footprint(model))
    row["error_pct"] = error_pct(est.weights, row["measured"])
    if grown is not None and grown - row["footprint"] > 1 << 20:  # allocated beyond the weights: name it
        row["unaccounted"] = _unaccounted(model)
        if history:
            with contextlib.suppress(Exception):  # a diagnosis must never cost the row
                row["unowned_blocks"] = _unowned_blocks(model)
    if history:
        torch.cuda.memory._record_memory_history(enabled=None)
    unload(model)
    return row


def _unowned_blocks(model, top: int = 8) -> dict:
    """Live allocator blocks that hold none of the model's storages, by allocating stack, plus the
    rounding the allocator adds to the model's own blocks (size - requested): where the bytes went."""
    owned = sorted(_model_storages(model))

    def holds_model(addr: int, size: int) -> bool:
        i = bisect.bisect_left(owned, addr)
        return i < len(owned) and owned[i] < addr + size

    rounding, groups = 0, {}
    for seg in torch.cuda.memory._snapshot().get("segments", []):
        addr = seg.get("address", 0)
        for block in seg.get("blocks", []):
            size, start = block.get("size", 0), block.get("address", addr)
            addr = start + size
            if block.get("state") != "active_allocated":
                continue
            if holds_model(start, size):
                rounding += size - block.get("requested_size", size)
                continue
            frames = [f for f in block.get("frames") or [] if str(f.get("filename", "")).endswith(".py")]
            where = " < ".join(f"{str(f['filename']).split('-packages/')[-1]}:{f.get('line')} {f.get('name')}"
                               for f in frames[:5]) or "(no Python frames)"  # fmt: skip
            g = groups.setdefault(where, [0, 0])
            g[0] += size
            g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"rounding_on_model_blocks": rounding, "unowned_total": sum(b for b, _ in groups.values()),
            "sites": [f"{format_bytes(b)} in {n} blocks: {w}" for w, (b, n) in ranked[:top]]}  # fmt: skip


def _model_storages(model) -> set[int]:
    """Data pointers of everything the model owns: parameters, buffers, and bitsandbytes' quant states."""
    ptrs = set()
    for t in [*model.parameters(), *model.buffers()]:
        ptrs.add(t.data_ptr())
        state = getattr(t, "quant_state", None) or getattr(t, "SCB", None)
        stack = [state]
        while stack:
            obj = stack.pop()
            if isinstance(obj, torch.Tensor):
                ptrs.add(obj.data_ptr())
            elif obj is not None and hasattr(obj, "__dict__"):
                stack.extend(v for v in vars(obj).values() if isinstance(v, torch.Tensor) or hasattr(v, "absmax"))
    return ptrs


def _unaccounted(model, top: int = 6) -> list[str]:
    """The largest CUDA tensors alive after a load that the model does not own (what the loader kept)."""
    owned, seen, found = _model_storages(model), set(), []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda and obj.data_ptr() not in owned | seen:
                seen.add(obj.data_ptr())
                found.append((obj.untyped_storage().nbytes(), f"{tuple(obj.shape)} {obj.dtype}"))
        except Exception:  # a half-built or dead object: skip it
            continue
    found.sort(reverse=True)
    total = sum(b for b, _ in found)
    return [f"{len(found)} tensors, {format_bytes(total)}"] + [f"{format_bytes(b)} {what}" for b, what in found[:top]]


def stage_generate(run) -> dict:
    """Peak memory of generate() over batch x prompt x new tokens vs the estimate's total."""
    if skipped := bnb_skipped(run, "the generate stage (7B in nf4)"):
        return skipped
    grid = [(1, 16, 8), (2, 16, 8)] if run.dry else FULL_GENERATE_GRID if run.full else GENERATE_GRID
    rows = partial_rows(run, "generate")
    done = {(r["batch"], r["prompt"], r["new"]) for r in rows}
    path = big_model(run)
    ests = {c: _generate_estimate(path, *c, run) for c in grid}
    to_run, not_run = _order(grid, {c: e.total for c, e in ests.items()})
    for b, p, n in not_run:
        if (b, p, n) not in done:
            rows.append({"batch": b, "prompt": p, "new": n, "estimate": without_context(ests[b, p, n]),
                         "measured": None, "error_pct": None, **run.stamp(),
                         "note": "not run: predicted over the T4 (one such cell runs as the confirmation)"})  # fmt: skip
    model = tokenizer = None
    card = time_card(run)
    for b, p, n in to_run:
        if (b, p, n) in done or run.time_left() < 90:
            continue
        if model is None:
            model, tokenizer, _ = load(plan_for(path, "nf4", run), check=False)
        rows.append({**_generate_row(model, tokenizer, ests[b, p, n], b, p, n, card), **run.stamp()})
        save_partial(run, "generate", rows)
    if model is not None:
        unload(model)
    return incomplete(rows, len(grid), model_note(path))


def _generate_estimate(path: Path, b: int, p: int, n: int, run):
    return estimate(str(path), load="nf4", batch_size=b, prompt_tokens=p, max_new_tokens=n,
                    compute_dtype="fp32" if run.dry else "fp16", device="current")  # fmt: skip


def _generate_row(model, tokenizer, est, b: int, p: int, n: int, card: str = "t4") -> dict:
    ids = torch.randint(3, min(1000, tokenizer.vocab_size), (b, p), device=model.device)

    def generate(tokens: int):
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                           min_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)  # fmt: skip

    row = {"batch": b, "prompt": p, "new": n, "estimate": without_context(est), "predicted_fit": est.total <= _t4()}
    try:
        prefill = timed(lambda: generate(1))  # the prompt's pass (and one token): before the peak is reset
        sync_peak_reset()
        total = timed(lambda: generate(n))
    except torch.OutOfMemoryError:
        del ids
        sync_peak_reset()
        return {**row, "measured": None, "error_pct": None, "note": "OOM under the T4 cap"}
    peak = peak_allocated()
    return {**row, "measured": peak, "reserved": torch.cuda.max_memory_reserved() if peak else None,
            "error_pct": error_pct(row["estimate"], peak), **generate_time(est, card, b, p, n, prefill, total)}  # fmt: skip


# Time beside memory (issue 46): the generate and QLoRA rows time their calls and carry oomkit's prediction
# (estimate_time on the datasheet figures of the card that runs; a T4's in the dry run or for a card without
# figures), predicted / measured as a ratio: registered before any GPU has measured time.
def time_card(run) -> str:
    """The card whose figures predict this run's time."""
    from helpers.estimator.timing import card_named

    return (None if run.dry else card_named(torch.cuda.get_device_name(0))) or "t4"


def timed(fn) -> float:
    """Seconds of ``fn()``, the device synchronised before and after."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def ratio(predicted: float | None, measured: float | None) -> float | None:
    return round(predicted / measured, 2) if predicted and measured else None


def predicted_generate(est, card: str, b: int, n: int) -> tuple[float, float]:
    """(decode tokens/s over the batch, prefill seconds) that oomkit predicts for one generate() call."""
    from helpers.estimator.timing import estimate_time

    t = estimate_time(est, card, answers=b, batches=(b,))
    decode = t.decode_tokens_per_s[b]
    return decode, t.answers_seconds[b] - n * b / decode  # one batch: its prefill, then n decode steps


def generate_time(est, card: str, b: int, p: int, n: int, prefill_s: float | None = None,
                  total_s: float | None = None) -> dict:  # fmt: skip
    """The time columns of a generate row: predicted, measured (``generate(1)`` for the prefill; the
    rest of ``generate(n)`` over ``n - 1`` steps for decode) and their ratio."""
    decode, prefill = predicted_generate(est, card, b, n)
    measured = b * (n - 1) / (total_s - prefill_s) if prefill_s and total_s and total_s > prefill_s and n > 1 else None
    return {"time_card": card, "decode_tok_s_predicted": round(decode, 1),
            "decode_tok_s_measured": round(measured, 1) if measured else None, "decode_ratio": ratio(decode, measured),
            "prefill_s_predicted": round(prefill, 3), "prefill_s_measured": round(prefill_s, 3) if prefill_s else None,
            "prefill_ratio": ratio(prefill, prefill_s)}  # fmt: skip


def predicted_step(est, card: str) -> float | None:
    """oomkit's seconds for one LoRA step of a TrainPlan's estimate on ``card``."""
    from helpers.estimator.timing import estimate_time

    return estimate_time(est, card).step_seconds


def time_predictions(layers: int | None, cards: tuple[str, ...] = TIME_CARDS) -> dict:
    """The times oomkit predicts for the generate and QLoRA cells (issue 29's and --full's) of the 7B cut to
    ``layers`` decoder layers, per card, without a GPU: registered before the stages measure them
    (``make gpu-predict``)."""
    import tempfile

    from helpers.estimator.configs import config_from_dict
    from helpers.training.plan import TrainPlan

    hub_id = GPU_MODELS[BIG]
    config = config_from_dict(read_json(shipped_config(hub_id)), hub_id)
    config.num_hidden_layers = min(layers or config.num_hidden_layers, config.num_hidden_layers)
    found = {"model": f"{hub_id}, {config.num_hidden_layers} decoder layers, nf4", "generate": [], "qlora": []}
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        for card in cards:
            for b, p, n in FULL_GENERATE_GRID:
                est = estimate(folder, load="nf4", batch_size=b, prompt_tokens=p, max_new_tokens=n,
                               compute_dtype="fp16", device="t4")  # fmt: skip  # memory as a T4; time per card
                decode, prefill = predicted_generate(est, card, b, n)
                found["generate"].append({"card": card, "batch": b, "prompt": p, "new": n, "issue_29": (b, p, n) in GENERATE_GRID,
                                          "decode_tok_s_predicted": round(decode, 1), "prefill_s_predicted": round(prefill, 3)})  # fmt: skip
            for mb, gc, opt in FULL_QLORA_CELLS:
                plan = TrainPlan(folder, load="nf4", micro_batch=mb, batch_size=mb, gradient_checkpointing=gc,
                                 optimizer=opt, seq_len=512, max_steps=2, save_steps=1000, output_dir=folder,
                                 precision="fp16")  # fmt: skip
                step = predicted_step(plan.estimate("t4"), card)
                found["qlora"].append({"card": card, "micro_batch": mb, "checkpointing": gc, "optimizer": opt,
                                       "issue_29": (mb, gc, opt) in QLORA_CELLS,
                                       "step_s_predicted": round(step, 3) if step else None})  # fmt: skip
    return found


def step_timer():
    """A Trainer callback keeping each optimizer step's seconds (the last one is past the warm-up)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self._started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self._started)

    return StepTimer()


def stage_qlora(run) -> dict:
    """One QLoRA step's peak vs TrainPlan(...).estimate(), over micro-batch, checkpointing and optimizer."""
    from helpers.training.plan import TrainPlan

    if skipped := bnb_skipped(run, "the qlora stage (7B in nf4)"):
        return skipped
    dry = [(1, True, "adamw_torch"), (2, True, "adamw_torch")]
    cells = dry if run.dry else FULL_QLORA_CELLS if run.full else QLORA_CELLS
    rows = partial_rows(run, "qlora")
    done = {(r["micro_batch"], r["checkpointing"], r["optimizer"]) for r in rows}
    path = big_model(run)
    plans = {(mb, gc, opt): TrainPlan(str(path), load="nf4", micro_batch=mb, batch_size=mb, gradient_checkpointing=gc,
                                      optimizer=opt, seq_len=64 if run.dry else 512, max_steps=2, save_steps=1000,
                                      output_dir=str(run.state / "qlora-out"),
                                      precision="fp32" if run.dry else "fp16") for mb, gc, opt in cells}  # fmt: skip
    ests = {c: plan.estimate("cpu" if run.dry else "current") for c, plan in plans.items()}
    to_run, not_run = _order(cells, {c: e.total for c, e in ests.items()})
    for c in not_run:
        if c not in done:
            rows.append({"micro_batch": c[0], "checkpointing": c[1], "optimizer": c[2],
                         "estimate": without_context(ests[c]), "measured": None, "error_pct": None, **run.stamp(),
                         "note": "not run: predicted over the T4 (one such cell runs as the confirmation)"})  # fmt: skip
    base = None
    card = time_card(run)
    for c in to_run:
        if c in done or run.time_left() < 120:
            continue
        if base is None:  # loaded once: every cell gets the same base model back, its adapters removed
            base, tokenizer, _ = load(plan_for(path, "nf4", run), check=False)
        row, base = qlora_row(plans[c], ests[c], base, tokenizer, run, card)
        rows.append({**row, **run.stamp()})
        save_partial(run, "qlora", rows)
    if base is not None:
        unload(base)
    return incomplete(rows, len(cells), model_note(path))


def qlora_row(plan, est, base, tokenizer, run, card: str = "t4"):
    """One cell on ``base``; returns the row and the base model to use next (reloaded if it could not be
    taken back from the adapters)."""
    from helpers.training.adapters import prepare_qlora
    from helpers.training.data import build_dataset, load_instructions
    from helpers.training.finetune import make_trainer

    row = {"micro_batch": plan.micro_batch, "checkpointing": plan.gradient_checkpointing,
           "optimizer": plan.optimizer, "estimate": without_context(est), "predicted_fit": est.total <= _t4()}  # fmt: skip
    model, _ = prepare_qlora(base, plan)
    data = build_dataset(tokenizer, load_instructions()[: 8 * plan.micro_batch], plan.seq_len, packing=True)
    trainer = None
    timer = step_timer()
    sync_peak_reset()
    try:
        trainer = make_trainer(model, tokenizer, plan, data, callbacks=[timer], report_to=[])
        trainer.train()
        peak = peak_allocated()
        row.update(measured=peak, error_pct=error_pct(row["estimate"], peak))
    except torch.OutOfMemoryError:
        row.update(measured=None, error_pct=None, note="OOM under the T4 cap")
    step = predicted_step(est, card)
    measured = timer.seconds[-1] if timer.seconds else None
    row.update(time_card=card, step_s_predicted=round(step, 3) if step else None,
               step_s_measured=round(measured, 3) if measured else None, step_ratio=ratio(step, measured))  # fmt: skip
    del trainer, data
    if not plan.gradient_checkpointing and plan.micro_batch == 1 and row.get("measured"):
        row["saved_census"] = _saved_census(model, plan, est, run)
    try:
        base = model.unload()  # the LoRA layers out, the 4-bit base as it was
        if getattr(base, "is_gradient_checkpointing", False):
            base.gradient_checkpointing_disable()
        with contextlib.suppress(Exception):
            base.disable_input_require_grads()
        base.config.use_cache = True
    except Exception as e:  # cannot take it back: load it again
        print(f"  note: reloading the base model ({type(e).__name__}: {e})")
        unload(model)
        base, _, _ = load(plan_for(Path(plan.model), "nf4", run), check=False)
    del model
    gc.collect()
    sync_peak_reset()
    return row, base


def _saved_census(model, plan, est, run) -> dict:
    """What autograd saves for backward in one forward without checkpointing, by dtype, against the
    estimate's ``activations.saved`` row: the per-tensor truth the per-token formula (derived on a
    CPU in fp32) is held against on CUDA under fp16 autocast. Model-owned storages are left out."""
    owned = {t.untyped_storage().data_ptr() for t in model.parameters()}
    seen: dict[int, tuple[int, str]] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if t.device == model.device and ptr not in owned:
            seen.setdefault(ptr, (t.untyped_storage().nbytes(), str(t.dtype).replace("torch.", ""), tuple(t.shape)))
        # detached: a saved output handed back as itself holds its own grad_fn, a cycle no gc frees,
        # which kept the whole graph and the base model on the card after the census (GPU run 2)
        return t.detach()

    ids = torch.randint(3, 1000, (plan.micro_batch, plan.seq_len), device=model.device)
    dtype = torch.float16 if not run.dry else torch.bfloat16
    model.train()
    sync_peak_reset()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast(model.device.type, dtype):
            out = model(input_ids=ids, labels=ids)
        saver = _savers(out.loss.grad_fn)
        del out
    except torch.OutOfMemoryError:
        return {"note": "OOM during the census"}
    by_dtype: dict[str, int] = {}
    by_shape: dict[str, list[int]] = {}  # "(1, 512, 4096) float16 <- MulBackward0" -> [bytes, count]
    for ptr, (size, name, shape) in seen.items():
        by_dtype[name] = by_dtype.get(name, 0) + size
        g = by_shape.setdefault(f"{shape} {name} <- {saver.get(ptr, '?')}", [0, 0])
        g[0] += size
        g[1] += 1
    total = sum(by_dtype.values())
    layers = getattr(model.config, "num_hidden_layers", 1)
    estimated = sum(r.bytes for r in est.rows if r.key == "activations.saved")
    shapes = sorted(by_shape.items(), key=lambda kv: -kv[1][0])[:60]
    return {"saved": total, "by_dtype": by_dtype, "tensors": len(seen), "estimate_saved": estimated,
            "by_shape": {k: {"bytes": b, "count": n} for k, (b, n) in shapes},
            "per_token_per_layer": total // (plan.micro_batch * plan.seq_len * layers),
            "estimate_per_token_per_layer": estimated // (plan.micro_batch * plan.seq_len * layers)}  # fmt: skip


def _savers(root) -> dict[int, str]:
    """Storage pointer -> the autograd nodes that saved it (``_saved_*`` fields and a custom
    Function's ``saved_tensors``), walking the graph from the loss: which op keeps which tensor."""
    names: dict[int, set[str]] = {}
    stack, visited = [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        kept = []
        for attr in dir(node):
            if attr.startswith("_saved_") or attr == "saved_tensors":
                with contextlib.suppress(Exception):
                    v = getattr(node, attr)
                    kept += [t for t in (v if isinstance(v, tuple | list) else [v]) if isinstance(t, torch.Tensor)]
        for t in kept:
            names.setdefault(t.untyped_storage().data_ptr(), set()).add(type(node).__name__)
        stack.extend(n for n, _ in getattr(node, "next_functions", ()))
    return {ptr: "+".join(sorted(n)) for ptr, n in names.items()}


def stage_context(run) -> dict:
    """What lives on the card outside PyTorch's allocator (CUDA context, kernels) vs the rule of thumb."""
    from helpers.core.devices import CUBLAS_WORKSPACE, CUDA_CONTEXT

    rule = CUDA_CONTEXT + CUBLAS_WORKSPACE
    what = "CUDA context + cuBLAS"
    if run.dry:
        return {"rows": [{"what": what, "estimate": rule, "measured": None, "error_pct": None}],
                "notes": ["no CUDA context on a CPU: measured on a GPU only"]}  # fmt: skip
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    context_only = total - free - torch.cuda.memory_reserved()
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.float16)
    (a @ a).sum().item()  # creates the cuBLAS handle and workspace
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    del a
    return {"rows": [{"what": what, "estimate": rule, "measured": outside, "error_pct": error_pct(rule, outside),
                      "context_only": context_only, **run.stamp()}],
            "notes": ["measured = the card's used memory, device-wide (cudaMemGetInfo), minus PyTorch's reserved "
                      "memory: this process's context only while nothing else runs on the card (a lent machine); "
                      "not NVML per process. Later calls cap at the T4's capacity minus this figure"]}  # fmt: skip


def stage_attention(run) -> dict:
    """helpers.core.attention's grouped-query fix on TinyLlama (32 query heads, 4 key/value heads): the
    prefill peak of a 2048-token prompt without and with it, flash and cuDNN attention off as on a
    T4, against the estimate (which prices the fixed path), and the two runs' last logits compared."""
    from transformers.integrations import sdpa_attention

    from helpers.core.attention import keep_gqa_off_math_kernel

    prompt, mode = (64, "fp32") if run.dry else (2048, "fp16")
    path = model_path("tinyllama", run) if not run.dry else TINY
    est = estimate(str(path), load=mode, batch_size=1, prompt_tokens=prompt, max_new_tokens=1,
                   compute_dtype=mode, device="cpu" if run.dry else "current")  # fmt: skip
    model, tokenizer, _ = load(plan_for(path, mode, run), check=False)
    keep_gqa_off_math_kernel()  # load() applies it where no fused GQA kernel exists; the dry run too
    fixed = sdpa_attention.use_gqa_in_sdpa
    shipped = getattr(fixed, "__wrapped__", fixed)
    rows, logits = [], {}
    try:
        for label, chosen in (("transformers as shipped (enable_gqa)", shipped), ("with the fix", fixed)):
            sdpa_attention.use_gqa_in_sdpa = chosen
            row = _generate_row(model, tokenizer, est, 1, prompt, 1)
            logits[label] = _last_logits(model, prompt)
            rows.append({"attention": label, **row, **run.stamp()})
    finally:
        sdpa_attention.use_gqa_in_sdpa = fixed
        unload(model)
    a, b = logits.values()
    same = None if a is None or b is None else round(float((a - b).abs().max()), 4)
    saved = [r["measured"] for r in rows]
    notes = [f"last-token logits, largest difference between the two: {same}",
             "the estimate prices the fixed path (one layer's expanded K/V); the unfixed row shows what a T4 "
             "pays without helpers.core.attention"]  # fmt: skip
    if None not in saved:
        notes.insert(0, f"the fix saves {format_bytes(saved[0] - saved[1])} of prefill peak at {prompt} tokens")
    return {"rows": rows, "notes": notes, "logits_max_diff": same}


def _last_logits(model, prompt: int):
    ids = torch.arange(3, 3 + prompt, device=model.device).remainder(1000).unsqueeze(0)
    try:
        with torch.inference_mode():
            return model(input_ids=ids, logits_to_keep=1).logits[0, -1].float().cpu()
    except torch.OutOfMemoryError:
        sync_peak_reset()
        return None


# the real OOM -> explain_oom -> cleanup() checks first: they need no model and are issue 29's must-have
RECOVERY_CHECKS = ("live_explanation", "cleanup_after_oom", "batch_search", "no_result_lost", "monitor_vs_allocator")
NEEDS_MODEL = ("batch_search", "no_result_lost")


def stage_recovery(run) -> dict:
    """Real OOMs under the cap: batch search vs the true maximum, safe_generate loses nothing,
    explain_oom on a live OOM, cleanup() regains what the OOM pinned, the monitor vs the allocator.
    Each check is saved as it ends; a call cut off continues with the next one."""
    import gpu_recovery

    rows = partial_rows(run, "recovery")
    done = {r.get("name") for r in rows}
    model = tokenizer = None
    try:
        for name in RECOVERY_CHECKS:
            if name in done or run.time_left() < 60:
                continue
            if name in NEEDS_MODEL and not run.dry and not run.bnb()[0]:
                row = {"check": name, "goal": "-", "result": f"skipped: {run.bnb()[1]}", "met": None}
            else:
                if name in NEEDS_MODEL and model is None:
                    mode = "fp32" if run.dry else "nf4"
                    model, tokenizer, _ = load(plan_for(big_model(run), mode, run), check=False)
                elif name not in NEEDS_MODEL and model is not None:
                    unload(model)  # the other checks want the card to themselves
                    model = None
                fn = getattr(gpu_recovery, name)
                row = fn(model, tokenizer, run) if name in NEEDS_MODEL else fn(run)
            rows.append({**row, "name": name, **run.stamp()})
            save_partial(run, "recovery", rows)
    finally:
        if model is not None:
            unload(model)
    return incomplete(rows, len(RECOVERY_CHECKS))


def _cuda_test_files() -> list[str]:
    """The test files with ``@pytest.mark.cuda`` tests: collecting all of tests/ can fail on one import."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "mark.cuda" in p.read_text(encoding="utf-8"))  # fmt: skip


def pytest_configure(config) -> None:
    """With ``-p gpu_stages``: the pytest_cuda stage's tests run under the harness's T4 cap."""
    fraction = os.environ.get("OOMKIT_GPU_CAP_FRACTION")
    if fraction and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(fraction), 0)


def stage_pytest_cuda(run) -> dict:
    if run.dry:
        return {"rows": [], "notes": ["the cuda-marked tests need a GPU: skipped in the dry run"]}
    files = _cuda_test_files()
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "scripts"), str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    if run.cap.get("fraction"):
        env["OOMKIT_GPU_CAP_FRACTION"] = str(run.cap["fraction"])
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-p", "gpu_stages",
           "--disable-warnings", "--tb=short", "-rfE", *files]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=max(60, run.time_left() - 30))  # fmt: skip
    last = (out.stdout.strip().splitlines() or [""])[-1]
    return {"rows": [{"command": f"pytest -m cuda ({len(files)} files)", "result": last, "exit": out.returncode,
                      "cap": "T4 cap" if run.cap.get("fraction") else "uncapped", **run.stamp()}],
            "notes": [" ".join(files)] + ([] if out.returncode == 0 else [out.stdout[-3000:] + out.stderr[-1000:]])}  # fmt: skip


def stage_notebooks(run) -> dict:
    if run.dry:
        return {"rows": [], "notes": ["notebooks run on the CPU in `make test`/`make demo`: skipped in the dry run"]}
    started = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "run_notebooks.py")], capture_output=True,
                         text=True, cwd=REPO, env=env, timeout=max(60, run.time_left() - 30))  # fmt: skip
    return {"rows": [{"notebooks": "all (tiny model, on the GPU)", "exit": out.returncode, "cap": "uncapped",
                      "seconds": round(time.perf_counter() - started, 1), **run.stamp()}],
            "notes": ["uncapped: the kernels are processes of their own, without the harness's T4 cap"]
            + ([out.stdout[-2000:] + out.stderr[-1000:]] if out.returncode else [])}  # fmt: skip


# -- summary ---------------------------------------------------------------------------------------


def summarize(results: dict[str, dict], *, dry: bool, errors: dict[str, dict] | None = None) -> str:
    """A table of the issue's targets, met or not, from every stage result present."""
    lines = ["# GPU check" + (" (DRY RUN on CPU: no GPU figure)" if dry else ""), "",
             "| target | goal | result | verdict |", "|---|---|---|---|"]  # fmt: skip
    for stage, (what, limit) in TARGETS.items():
        result = results.get(stage, {})
        rows = result.get("rows", [])
        errs = [abs(r["error_pct"]) for r in rows if r.get("error_pct") is not None]
        worst = max(errs) if errs else None
        if worst is None:
            verdict = result.get("skipped") or "not run"
            shown = "-"
        else:
            verdict = "dry" if dry else ("PASS" if worst <= limit else "MISS")
            shown = f"{worst:.2f} % over {len(errs)} of {len(rows)} cells measured"
        lines.append(f"| {what} | <= {limit} % | {shown} | {verdict} |")
    for row in results.get("recovery", {}).get("rows", []):
        verdict = "dry" if dry else ("skipped" if row.get("met") is None else ("PASS" if row.get("met") else "MISS"))
        lines.append(f"| {row['check']} | {row['goal']} | {row['result']} | {verdict} |")
    for row in results.get("attention", {}).get("rows", []):
        shown = (
            "-" if row.get("measured") is None else f"{format_bytes(row['measured'])} ({row.get('error_pct')} % off)"
        )
        lines.append(f"| GQA prefill peak, {row['prompt']} tokens: {row['attention']} | estimate "
                     f"{format_bytes(row['estimate'])} | {shown} | {'dry' if dry else 'measured'} |")  # fmt: skip
    for stage in ("context", "pytest_cuda", "notebooks"):
        for row in results.get(stage, {}).get("rows", []):
            if stage == "context" and row.get("measured") is not None:
                lines.append(f"| CUDA context + cuBLAS (device-wide) | calibrate {format_bytes(row['estimate'])} | "
                             f"{format_bytes(row['measured'])} | measured |")  # fmt: skip
            elif "exit" in row:
                lines.append(f"| {stage} ({row.get('cap', '-')}) | exit 0 | {row.get('result', '')} exit "
                             f"{row['exit']} | {'PASS' if row['exit'] == 0 else 'MISS'} |")  # fmt: skip
    for stage, error in (errors or {}).items():
        lines.append(f"| stage {stage} | runs | {error['error'][:120].replace('|', '/')} | ERROR |")
    return "\n".join(lines)
