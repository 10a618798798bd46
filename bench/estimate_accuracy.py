"""Estimator accuracy: predicted weight bytes vs what is really loaded, for 7 families x 7 load modes.

Each family is built from its shipped real config scaled down (2 layers, narrow widths, same
structure: GQA ratios, tied embeddings, biases, Conv1D, explicit head_dim), saved with random
weights, then loaded for real in fp32, fp16, bf16, int8, nf4, nf4 + double quant and fp4. Measured
= ``footprint(model)`` (parameters + buffers + bitsandbytes state). Side by side: transformers'
``get_memory_footprint()`` and accelerate's ``estimate-memory`` (its own ``gather_data`` code path,
the hub lookup given the local config: ``AutoModel`` on the meta device, /2, /4, /8 for
fp16/int8/int4). Also checks that full-size parameter counts of every shipped config are exact, and
compares accelerate (same code path) and Unsloth Studio's published constants with oomkit's exact
weight bytes on every full-size shipped config.

Usage: ``python bench/estimate_accuracy.py`` (about a minute on CPU).
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import format_table, write_results  # noqa: E402
from helpers.core.sources import data_path  # noqa: E402
from helpers.estimator.core import estimate
from helpers.estimator.footprint import footprint  # noqa: E402

CONFIG_DIR = data_path("configs")

FAMILIES = {  # family -> (shipped config, scaled-down overrides)
    "Llama-2": ("meta-llama--Llama-2-7b-hf", dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=4)),
    "Mistral (GQA)": ("mistralai--Mistral-7B-v0.1", dict(hidden_size=256, intermediate_size=896, num_hidden_layers=2,
                                                          num_attention_heads=8, num_key_value_heads=2)),
    "Qwen2.5 (tied, bias)": ("Qwen--Qwen2.5-0.5B", dict(hidden_size=256, intermediate_size=1344, num_hidden_layers=2,
                                                          num_attention_heads=8, num_key_value_heads=2)),
    "Gemma-2 (head_dim)": ("google--gemma-2-2b", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                                       num_attention_heads=4, num_key_value_heads=2, head_dim=128)),
    "Phi-2": ("microsoft--phi-2", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4)),
    "GPT-2 (Conv1D)": ("openai-community--gpt2", dict(n_embd=256, n_layer=2, n_head=4)),
    "OPT": ("facebook--opt-1.3b", dict(hidden_size=256, ffn_dim=1024, num_hidden_layers=2, num_attention_heads=4,
                                        word_embed_proj_dim=256)),
}  # fmt: skip
VOCAB = 4096  # scaled from 32k-256k; multiple of 64 like the real ones
MODES = ["fp32", "fp16", "bf16", "int8", "nf4", "nf4+dq", "fp4"]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build(family: str, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from helpers.estimator.configs import resolve_config

    name, overrides = FAMILIES[family]
    d = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    d.update(overrides, vocab_size=VOCAB)
    for k in ("max_position_embeddings", "n_positions", "n_ctx"):
        if k in d:
            d[k] = 1024
    config, _, _ = resolve_config(d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = out / name
    model.save_pretrained(path)
    return path


def load(path: Path, mode: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if mode in DTYPES:
        return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[mode])
    if mode == "int8":
        q = BitsAndBytesConfig(load_in_8bit=True)
    else:
        q = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=mode[:3],
            bnb_4bit_use_double_quant=mode.endswith("+dq"),
            bnb_4bit_compute_dtype=torch.float16,
        )
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16, quantization_config=q)


ACCELERATE_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "float16", "int8": "int8"}  # else int4


def accelerate_gather(config_path: Path) -> dict[str, float]:
    """``accelerate estimate-memory``'s own code path (``accelerate.commands.estimate.gather_data``),
    offline: its hub lookup (``verify_on_hub``, which only supplies the repo's metadata) is given the
    local config instead, and ``AutoConfig.from_pretrained`` reads the same config from a folder.
    Everything else (``AutoModel`` under ``init_empty_weights``, ``calculate_maximum_sizes``, the
    /2, /4, /8 for float16, int8, int4) is accelerate's. Returns its "Total Size" per dtype, in bytes."""
    import contextlib
    import io
    import shutil
    import types

    import accelerate.commands.estimate as est

    config = json.loads(Path(config_path).read_text())
    real = est.verify_on_hub
    est.verify_on_hub = lambda repo, token=None: types.SimpleNamespace(config=config, library_name="transformers")
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            shutil.copy(config_path, Path(tmp) / "config.json")
            args = types.SimpleNamespace(model_name=tmp, library_name=None, trust_remote_code=False,
                                         dtypes=["float32", "float16", "int8", "int4"])  # fmt: skip
            data = est.gather_data(args)
    finally:
        est.verify_on_hub = real
    return {row[0]: row[2] for row in data}


def accelerate_estimate(path: Path, mode: str) -> int:
    """accelerate estimate-memory's "Total Size" for ``mode`` (its real code path, see ``accelerate_gather``)."""
    return int(accelerate_gather(path / "config.json")[ACCELERATE_DTYPE.get(mode, "int4")])


# Unsloth Studio's published VRAM constants (constants only; its code is AGPL and not used here), as we
# read them: 4-bit (NF4) weights = 16-bit weights / 3.2 (or / 3.6), plus a fixed 1.4 GB overhead that
# is not part of the weights and so is reported next to them, not added into the comparison.
UNSLOTH_NF4_DIVISORS = (3.2, 3.6)
UNSLOTH_OVERHEAD_BYTES = 1.4e9


def full_size_rows() -> list[dict]:
    """Every shipped full-size config: accelerate estimate-memory (real code path) and Unsloth's constants
    against oomkit's exact weight bytes (fp16, int8, nf4 + double quant), which match real loads to
    the byte on the scaled-down models above and count the published parameters exactly."""
    from helpers.core.sources import shipped_configs

    out = []
    for hub_id, path in shipped_configs().items():
        cfg = json.loads(path.read_text())
        if "quantization_config" in cfg:  # loads only as saved (mxfp4, fp8): no fp16/int8/nf4 to set beside the peers
            continue
        if cfg.get("text_config", cfg).get("num_local_experts"):
            # accelerate builds its model under init_empty_weights(), which allocates fused expert tensors for
            # real (Llama-4-Scout: minutes and GiBs, issue 47); bitsandbytes does not quantize them either
            continue
        acc = accelerate_gather(path)
        ours = {m: estimate(hub_id, load=m).weights for m in ("fp16", "int8")}
        ours["nf4+dq"] = estimate(hub_id, load="nf4", double_quant=True).weights
        tied = cfg.get("tie_word_embeddings", True)  # transformers' default is tied
        row = dict(model=hub_id, tied=bool(tied), params=estimate(hub_id, load="fp16").params, oomkit=ours,
                   accelerate={"fp16": acc["float16"], "int8": acc["int8"], "int4": acc["int4"]},
                   accelerate_error_pct={"fp16": err(acc["float16"], ours["fp16"]),
                                         "int8": err(acc["int8"], ours["int8"]),
                                         "int4_vs_nf4+dq": err(acc["int4"], ours["nf4+dq"])})  # fmt: skip
        row["unsloth_nf4_error_pct"] = {f"/{d:g}": err(ours["fp16"] / d, ours["nf4+dq"]) for d in UNSLOTH_NF4_DIVISORS}
        out.append(row)
    return out


class PeakTracker:
    """Peak bytes of live tensors created while active (CPU has no ``max_memory_allocated``): every
    op's outputs are recorded by storage and dropped when the storage dies."""

    def __init__(self, model: torch.nn.Module):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._record(out)
                return out

        self.mode, self.live, self.current, self.peak = _Mode(), {}, 0, 0
        # Views of the weights (w.t(), reshapes) are not allocations: footprint() counts them.
        self.known = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        for p in model.parameters():
            qs = getattr(p, "quant_state", None)
            while qs is not None:
                self.known |= {
                    t.untyped_storage().data_ptr()
                    for t in (qs.absmax, qs.code, qs.offset)
                    if isinstance(t, torch.Tensor)
                }
                qs = qs.state2

    def _record(self, out):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves

        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.data_ptr() and st.data_ptr() not in self.live and st.data_ptr() not in self.known:
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                    self.current += st.nbytes()
        self.peak = max(self.peak, self.current)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


PEAK_CONFIG = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=False)  # fmt: skip
OVERHEAD_ROWS = ("allocator rounding", "fragmentation margin")


def peak_rows(batch: int = 2, seq: int = 256) -> list[dict]:
    """Predicted vs measured peak (weights + every live tensor) for generation and LoRA/QLoRA steps."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    from helpers.estimator.training import LoraTraining

    cfg = LlamaConfig(**PEAK_CONFIG)
    out = []
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp)
        cases = [("generate (bf16, 32 new tokens)", "bf16", None), ("LoRA step (bf16, checkpointing)", "bf16", True),
                 ("LoRA step (bf16, no checkpointing)", "bf16", False),
                 ("QLoRA step (nf4, checkpointing, prepare_qlora, bf16 autocast)", "nf4", True)]  # fmt: skip
        for label, load, ckpt in cases:
            kw = {"dtype": torch.bfloat16}
            if load == "nf4":
                kw["quantization_config"] = BitsAndBytesConfig(
                    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                    bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
                # without a device_map, transformers puts a bnb model on the current CUDA device when
                # there is one, away from the CPU ids (and from what PeakTracker measures)
                kw["device_map"] = {"": "cpu"}
            model = AutoModelForCausalLM.from_pretrained(tmp, **kw)
            if ckpt is None:
                pred = estimate(tmp, load=load, batch_size=batch, prompt_tokens=seq, max_new_tokens=32, device="cpu")
                base = footprint(model)
                with torch.no_grad(), PeakTracker(model) as pt:
                    model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
            else:
                if load == "nf4":  # what the estimator models for QLoRA: peft's preparation (fp32 upcast)
                    model = prepare_model_for_kbit_training(
                        model, use_gradient_checkpointing=ckpt,
                        gradient_checkpointing_kwargs={"use_reentrant": False},
                    )  # fmt: skip
                elif ckpt:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                    model.enable_input_require_grads()
                model = get_peft_model(
                    model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.05)
                )
                model.train()
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
                pred = estimate(
                    tmp,
                    load=load,
                    compute_dtype="bf16",
                    device="cpu",
                    training=LoraTraining(
                        r=16, optimizer="adamw_torch", gradient_checkpointing=ckpt, seq_len=seq, micro_batch=batch
                    ),
                )
                base = footprint(model)
                # QLoRA runs under 16-bit autocast (a T4's fp16 on CUDA; bf16 here), as train() runs it
                cast = torch.autocast("cpu", dtype=torch.bfloat16) if load == "nf4" else contextlib.nullcontext()
                with PeakTracker(model) as pt:
                    for _ in range(2):  # the second step has optimizer states
                        with cast:
                            loss = model(input_ids=ids, labels=ids).loss
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
            predicted = sum(r.bytes for r in pred.rows if r.name not in OVERHEAD_ROWS)
            measured = base + pt.peak
            out.append(dict(case=label, measured=measured, predicted=predicted, error_pct=err(predicted, measured)))
            del model
    return out


TINY = Path(__file__).resolve().parents[1] / "data" / "tiny"
# family -> (shapes: (micro-batch, label/LM tokens, encoder tokens or images)) for the full fine-tuning table
FULL_FT_CASES = {"t5": [(2, 32, 128), (4, 64, 64)], "whisper": [(2, 32, None), (4, 96, None)],
                 "llava": [(2, 64, 1), (4, 96, 2)]}  # fmt: skip


def family_step_inputs(name: str, model, batch: int, tokens: int, extra) -> tuple[dict, dict]:
    """A training batch of the tiny model's family and the estimate's family inputs for the same shape."""
    torch.manual_seed(0)
    ids = torch.randint(10, 1000, (batch, tokens))
    if name == "t5":
        enc = torch.randint(10, 1000, (batch, extra))
        return {"input_ids": enc, "attention_mask": torch.ones_like(enc), "labels": ids}, {"encoder_tokens": extra}
    if name == "whisper":
        frames = 2 * model.config.max_source_positions
        features = torch.randn(batch, model.config.num_mel_bins, frames)
        return {"input_features": features, "labels": ids}, {"audio_seconds": frames / 100}
    image = model.config.image_token_id
    per = (model.config.vision_config.image_size // model.config.vision_config.patch_size) ** 2
    ids[:, 1 : 1 + per * extra] = image
    labels = ids.clone()
    labels[:, : 1 + per * extra] = -100
    size = model.config.vision_config.image_size
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "pixel_values": torch.randn(batch * extra, 3, size, size)}, {"images": extra}  # fmt: skip


def family_full_rows() -> list[dict]:
    """Full fine-tuning of the tiny T5, Whisper and LLaVA (fp32, AdamW, every parameter trains), checkpointing on
    and off, two shapes each: the estimate against real steps on CPU. *step*: weights + the peak of every live
    tensor over two AdamW steps (gradients, optimizer states, activations) against the estimate without its
    allocator rows; *activations*: the peak of one forward + backward once the gradients exist against the
    estimate's activation rows."""
    from transformers import AutoModelForImageTextToText, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    from helpers.estimator.training import FullTraining

    classes = {"t5": AutoModelForSeq2SeqLM, "whisper": AutoModelForSpeechSeq2Seq, "llava": AutoModelForImageTextToText}
    out = []
    for name, cases in FULL_FT_CASES.items():
        if not (TINY / name).is_dir():
            continue
        for ckpt in (True, False):
            for batch, tokens, extra in cases:
                model = classes[name].from_pretrained(TINY / name, dtype=torch.float32)
                if ckpt:
                    model.gradient_checkpointing_enable()
                model.train()
                inputs, family = family_step_inputs(name, model, batch, tokens, extra)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
                base = footprint(model)
                with PeakTracker(model) as pt:
                    for _ in range(2):  # the second step has the optimizer's states and the gradients
                        model(**inputs).loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                model(**inputs).loss.backward()
                model.zero_grad(set_to_none=False)
                act = PeakTracker(model)
                act.known |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
                with act:
                    model(**inputs).loss.backward()
                tr = FullTraining(optimizer="adamw_torch", gradient_checkpointing=ckpt, seq_len=tokens,
                                  micro_batch=batch)  # fmt: skip
                est = estimate(str(TINY / name), load="fp32", device="cpu", training=tr, **family)
                predicted = sum(r.bytes for r in est.rows if r.name not in OVERHEAD_ROWS)
                shape = (f"{extra} encoder tokens" if name == "t5" else f"{extra} image(s)" if name == "llava"
                         else f"{model.config.max_source_positions} encoder positions")  # fmt: skip
                out.append(dict(model=name, checkpointing=ckpt, micro_batch=batch, tokens=tokens, shape=shape,
                                measured=base + pt.peak, predicted=predicted,
                                error_pct=err(predicted, base + pt.peak), measured_activations=act.peak,
                                predicted_activations=est.group_bytes("activations"),
                                activations_error_pct=err(est.group_bytes("activations"), act.peak)))  # fmt: skip
                del model, opt
    return out


def cuda_qlora_row(seq: int = 256, micro: int = 2) -> dict | None:
    """On CUDA: ``TrainPlan.estimate()`` vs ``max_memory_allocated`` for QLoRA steps of the tiny Llama
    (fp16, paged 8-bit AdamW, checkpointing) with the process capped at a T4's memory. None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from helpers.core.devices import DEVICES
    from helpers.loading.loader import load as load_plan
    from helpers.training.adapters import prepare_qlora
    from helpers.training.plan import TrainPlan

    tiny = Path(__file__).resolve().parents[1] / "data" / "tiny" / "llama"
    if not (tiny / "config.json").exists():
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, DEVICES["t4"]["capacity"] / total))
    try:
        plan = TrainPlan(
            str(tiny), seq_len=seq, batch_size=micro, micro_batch=micro, precision="fp16", optimizer="paged_adamw_8bit"
        )
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model, _, _ = load_plan(plan.load_plan())
        model, _ = prepare_qlora(model, plan)
        model.train()
        import bitsandbytes as bnb

        opt = bnb.optim.PagedAdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(0, model.config.vocab_size, (micro, seq), device="cuda")
        for _ in range(2):  # the second step has optimizer states
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
        est = plan.estimate("t4")
        predicted = sum(r.bytes for r in est.rows if not r.name.startswith("CUDA context"))
        del model, opt
        return dict(
            case=f"QLoRA step, tiny Llama, T4 cap (nf4, fp16, seq {seq}, micro {micro})",
            measured=measured,
            predicted=predicted,
            error_pct=err(predicted, measured),
            predicted_total=est.total,
        )
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def cuda_generate_row(batch: int = 4, prompt: int = 512, new: int = 128) -> dict | None:
    """On CUDA: the estimate (weights, KV cache, prefill, logits) vs ``max_memory_allocated`` for
    prefill + generation of the 4-layer peak-test Llama in fp16 under a T4 cap. None without CUDA.
    The CUDA context is outside the allocator and left out; rounding and fragmentation rows stay in."""
    if not torch.cuda.is_available():
        return None
    from transformers import AutoModelForCausalLM, LlamaConfig

    from helpers.core.devices import DEVICES

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, DEVICES["t4"]["capacity"] / total))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            AutoModelForCausalLM.from_config(LlamaConfig(**PEAK_CONFIG), dtype=torch.float16).save_pretrained(tmp)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float16, device_map="cuda")
            ids = torch.randint(0, PEAK_CONFIG["vocab_size"], (batch, prompt), device="cuda")
            with torch.no_grad():
                model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False
                )
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated() - base
            est = estimate(tmp, load="fp16", batch_size=batch, prompt_tokens=prompt, max_new_tokens=new, device="t4")
            predicted = sum(r.bytes for r in est.rows if not r.name.startswith("CUDA context"))
            del model
        return dict(
            case=f"generate, 4-layer Llama fp16, T4 cap (batch {batch}, {prompt} + {new} tokens)",
            measured=measured,
            predicted=predicted,
            error_pct=err(predicted, measured),
        )
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def err(pred: int, meas: int) -> float:
    return 100.0 * (pred - meas) / meas


def main() -> int:
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    t0 = time.time()
    rows, records = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            path = build(family, Path(tmp))
            for mode in MODES:
                model = load(path, mode)
                measured = footprint(model)
                hf = model.get_memory_footprint()
                load_mode = mode.replace("+dq", "")
                pred = estimate(
                    path,
                    load=load_mode,
                    double_quant=mode.endswith("+dq"),
                    compute_dtype="fp16" if load_mode in ("int8", "nf4", "fp4") else "auto",
                ).weights
                acc = accelerate_estimate(path, mode)
                rec = dict(family=family, load=mode, measured=measured, predicted=pred, error_pct=err(pred, measured),
                           transformers=hf, transformers_error_pct=err(hf, measured), accelerate=acc,
                           accelerate_error_pct=err(acc, measured))  # fmt: skip
                records.append(rec)
                rows.append(
                    [
                        family,
                        mode,
                        f"{measured:,}",
                        f"{pred:,}",
                        f"{rec['error_pct']:+.2f} %",
                        f"{rec['transformers_error_pct']:+.1f} %",
                        f"{rec['accelerate_error_pct']:+.1f} %",
                    ]
                )
                del model
    counts = []
    known = {"meta-llama/Llama-2-7b-hf": 6_738_415_616, "mistralai/Mistral-7B-v0.1": 7_241_732_096,
             "Qwen/Qwen2.5-0.5B": 494_032_768, "openai-community/gpt2": 124_439_808,
             "TinyLlama/TinyLlama-1.1B-Chat-v1.0": 1_100_048_384, "meta-llama/Llama-3.1-8B": 8_030_261_248,
             "Qwen/Qwen2.5-7B": 7_615_616_512, "microsoft/phi-2": 2_779_683_840, "google/gemma-2-2b": 2_614_341_888,
             "facebook/opt-1.3b": 1_315_758_080, "Qwen/Qwen2.5-1.5B": 1_543_714_304,
             "codellama/CodeLlama-7b-hf": 6_738_546_688}  # fmt: skip
    for hub_id, n in known.items():
        got = estimate(hub_id, load="fp16").params
        counts.append([hub_id, f"{n:,}", f"{got:,}", "exact" if got == n else f"off by {got - n:+,}"])
    print(
        format_table(
            ["family", "load", "measured bytes", "oomkit", "oomkit err", "get_memory_footprint err", "accelerate err"],
            rows,
        )
    )
    print()
    print(format_table(["shipped config", "published parameters", "oomkit count", ""], counts))
    full = full_size_rows()
    print()
    print(format_table(["full-size config", "tied", "accelerate fp16", "accelerate int8", "accelerate int4 vs nf4+dq",
                        "Unsloth nf4 (/3.2 / /3.6)"],
                       [[f["model"], "yes" if f["tied"] else "no", f"{f['accelerate_error_pct']['fp16']:+.1f} %",
                         f"{f['accelerate_error_pct']['int8']:+.1f} %",
                         f"{f['accelerate_error_pct']['int4_vs_nf4+dq']:+.1f} %",
                         " / ".join(f"{v:+.1f} %" for v in f["unsloth_nf4_error_pct"].values())] for f in full]))  # fmt: skip
    peaks = peak_rows()
    print()
    print(format_table(["CPU peak (weights + live tensors)", "measured", "oomkit", "error"],
                       [[p["case"], f"{p['measured']:,}", f"{p['predicted']:,}", f"{p['error_pct']:+.1f} %"]
                        for p in peaks]))  # fmt: skip
    family_full = family_full_rows()
    print()
    print(format_table(["full fine-tuning (fp32, AdamW)", "checkpointing", "batch x tokens", "step: measured",
                        "oomkit", "error", "activations: measured", "oomkit", "error"],
                       [[f["model"] + f" ({f['shape']})", "on" if f["checkpointing"] else "off",
                         f"{f['micro_batch']} x {f['tokens']}", f"{f['measured']:,}", f"{f['predicted']:,}",
                         f"{f['error_pct']:+.1f} %", f"{f['measured_activations']:,}",
                         f"{f['predicted_activations']:,}", f"{f['activations_error_pct']:+.1f} %"]
                        for f in family_full]))  # fmt: skip
    gpu = cuda_qlora_row()
    gpu_generate = cuda_generate_row()
    if gpu is not None or gpu_generate is not None:
        print()
        print(format_table(["CUDA peak (max_memory_allocated)", "measured", "oomkit estimate", "error"],
                           [[g["case"], f"{g['measured']:,}", f"{g['predicted']:,}", f"{g['error_pct']:+.1f} %"]
                            for g in (gpu_generate, gpu) if g is not None]))  # fmt: skip
    worst = max(abs(r["error_pct"]) for r in records)
    all_exact = all(c[3] == "exact" for c in counts)
    print(
        f"\nworst oomkit weight error {worst:.3f} % over {len(records)} loads; parameter counts "
        f"{'all exact' if all_exact else 'NOT all exact'}; {time.time() - t0:.0f} s"
    )
    write_results(
        "estimate_accuracy",
        {
            "rows": records,
            "param_counts": counts,
            "worst_error_pct": worst,
            "peaks": peaks,
            "family_full": family_full,
            "cuda_qlora": gpu,
            "cuda_generate": gpu_generate,
            "counts_exact": all_exact,
            "full_size": full,
            "unsloth_constants": {"nf4_divisors": UNSLOTH_NF4_DIVISORS, "overhead_bytes": UNSLOTH_OVERHEAD_BYTES},
        },
    )
    return 0 if worst < 1.0 and all_exact else 1


if __name__ == "__main__":
    sys.exit(main())
