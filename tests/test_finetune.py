"""QLoRA on the tiny model for real (bitsandbytes nf4 on CPU): loss, adapter round trip, resume."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, TrainerCallback

from helpers.loading.loader import load
from helpers.loading.plan import LoadPlan
from helpers.monitoring.memory_callback import MemoryCallback
from helpers.monitoring.monitor import MemoryMonitor
from helpers.training.adapters import prepare_qlora, save_adapter  # fmt: skip
from helpers.training.data import answer, build_dataset, collate, format_example, load_instructions, prompt_text
from helpers.training.finetune import find_micro_batch, last_checkpoint, make_trainer, train
from helpers.training.plan import TrainPlan, target_modules

ROWS = load_instructions()[:48]


def _plan(model, out, **kw):
    base = dict(
        seq_len=64,
        batch_size=4,
        max_steps=6,
        save_steps=2,
        logging_steps=1,
        output_dir=str(out),
        learning_rate=1e-3,
        warmup_steps=0,
        r=8,
        alpha=16,
    )
    return TrainPlan(str(model), **{**base, **kw})


def _prepared(plan):
    model, tok, _ = load(plan.load_plan())
    model, trainable = prepare_qlora(model, plan)
    return model, tok, trainable


class StopAt(TrainerCallback):
    """Stop training after ``step`` (a Colab disconnect right after a checkpoint)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def test_plan_defaults_and_validation(tiny_llama, tmp_path):
    plan = TrainPlan(str(tiny_llama), batch_size=16, micro_batch=4)
    assert plan.gradient_accumulation == 4
    if not torch.cuda.is_available():
        assert plan.resolved_precision() == "fp32" and plan.resolved_optimizer() == "adamw_torch"
    assert plan.resolved_output_dir().name == "lora-llama"
    with pytest.raises(ValueError, match="micro_batch"):
        TrainPlan("x", batch_size=4, micro_batch=8)
    with pytest.raises(ValueError, match="micro_batch=2"):
        TrainPlan("x", batch_size=4, micro_batch=3)
    with pytest.raises(ValueError, match="seq_len"):
        TrainPlan("x", seq_len=0)
    est = plan.estimate("t4")
    names = [r.name for r in est.rows]
    assert "LoRA adapters (fp32)" in names and "optimizer states (paged_adamw_8bit)" in names
    upcast = est.row("training.fp32_upcast")  # prepare_model_for_kbit_training's fp32 copy
    assert upcast.bytes == est.row("weights.unquantized").bytes
    assert est.capacity and est.total < est.capacity


def test_typical_plan_and_data_mistakes_say_what_to_do(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for bad, match in (
        (dict(load="int4"), "unknown load mode 'int4' .4-bit is 'nf4' or 'fp4'.; use nf4"),
        (dict(micro_batch="4"), "micro_batch must be a whole number.*got '4'"),
        (dict(max_steps=0, epochs="1"), "epochs must be a number, got '1'"),
        (dict(dropout=2), r"dropout is a probability in \[0, 1\)"),
        (dict(learning_rate="2e-4"), "learning_rate must be a number"),
    ):
        with pytest.raises(ValueError, match=match):
            TrainPlan("x", **bad)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    with pytest.raises(ValueError, match="output_dir .*notes.txt is a file, not a folder"):
        TrainPlan("x", output_dir=str(a_file))
    assert TrainPlan("x", targets="q_proj").targets == ["q_proj"]  # not ['q', '_', 'p', ...]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert target_modules(model, "q_proj") == ["q_proj"]
    with pytest.raises(ValueError, match=r"LoRA targets \['q_projj'\] are not modules.*linear layers are .*v_proj"):
        target_modules(model, ["q_projj"])
    wrong_keys = tmp_path / "qa.jsonl"
    wrong_keys.write_text('{"question": "a", "answer": "b"}\n')
    with pytest.raises(
        ValueError,
        match="qa.jsonl:1: .*it has keys 'question', 'answer'. Rename the fields, e.g. rows = \\[\\{'instruction': r\\['question'\\], 'response': r\\['answer'\\]\\} for r",
    ):
        load_instructions(wrong_keys)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"instruction": "a", "response": "b"}\n{bad}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        load_instructions(bad_json)
    with pytest.raises(IsADirectoryError, match="is a folder; pass the JSONL file in it .*bad.jsonl"):
        load_instructions(tmp_path)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    with pytest.raises(ValueError, match=r"rows \[0\] have an 'instruction' or 'response' that is not a string"):
        build_dataset(tok, [{"instruction": "a", "response": 3}], 64)
    plan = TrainPlan(str(tiny_llama), batch_size=2, micro_batch=1, output_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match="the dataset is empty"):
        make_trainer(model, tok, plan, [])
    with pytest.raises(ValueError, match=r"raw rows.*build_dataset\(tokenizer, rows, plan.seq_len\)"):
        make_trainer(model, tok, plan, ROWS[:2])


def test_answer_refuses_a_bare_string_as_generate_batched_does(tiny_llama, monkeypatch):
    """A string is a sequence of characters: answer() ran one prompt per character and returned that many."""
    import helpers.training.data as training_data

    calls = []
    monkeypatch.setattr(training_data, "generate_batched", lambda model, tok, prompts, **kw: calls.append(prompts))
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    with pytest.raises(TypeError, match=r"got one string \('What is 2\+2\?'\): pass \[instruction\]"):
        answer(None, tok, "What is 2+2?")
    assert calls == []


def test_prompt_is_masked_and_answer_trains(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    row = ROWS[0]
    ex = format_example(tok, row["instruction"], row["response"], seq_len=512)
    n_prompt = len(tok(prompt_text(tok, row["instruction"]), add_special_tokens=False)["input_ids"])
    assert ex["labels"][:n_prompt] == [-100] * n_prompt
    answer = tok.decode(ex["labels"][n_prompt:], skip_special_tokens=True)
    assert answer.replace(" ", "") == row["response"].replace(" ", "")
    assert format_example(tok, row["instruction"], row["response"], seq_len=n_prompt) is None  # no answer left
    batch = collate([ex, format_example(tok, "Count the features in a.shp.", "print(1)", 512)], pad_token_id=0)
    assert batch["input_ids"].shape == batch["labels"].shape
    assert (batch["labels"][1][batch["attention_mask"][1] == 0] == -100).all()  # padding never trains
    packed = build_dataset(tok, ROWS, 256, packing=True)
    plain = build_dataset(tok, ROWS, 256)
    assert all(len(e["input_ids"]) == 256 for e in packed) and len(packed) < len(plain)
    assert sum(x != -100 for e in packed for x in e["labels"]) <= sum(x != -100 for e in plain for x in e["labels"])
    with pytest.raises(ValueError, match="response"):
        build_dataset(tok, [{"instruction": "no answer"}], 64)


def _lora_b_grads(model, tok) -> dict[str, torch.Tensor]:
    """One training forward + backward on a fixed batch; the LoRA B matrices' gradients."""
    batch = collate(build_dataset(tok, ROWS[:2], 64))
    model.train()
    model(**batch).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    model.zero_grad(set_to_none=True)
    return grads


def _cpu_repacks() -> bool:
    """Whether bitsandbytes repacks 4-bit weights for its CPU kernel on this machine."""
    import bitsandbytes as bnb

    return bool(bnb.nn.Linear4bit(64, 64, quant_type="nf4").support_avx512bf16_for_cpu)


def test_generating_before_training_keeps_the_4bit_layers_differentiable(tiny_llama, tmp_path, recwarn):
    """On AVX512-bf16 CPUs an inference forward repacks bitsandbytes' 4-bit weights for a kernel with no
    autograd; prepare_qlora undoes it, so the gradients match a model that never generated."""
    from helpers.training.data import answer

    plan = _plan(tiny_llama, tmp_path)
    model, tok, _ = load(plan.load_plan())
    reference = _lora_b_grads(prepare_qlora(model, plan)[0], tok)

    model, tok, _ = load(plan.load_plan())
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    for m in layers:  # as plain from_pretrained leaves them (load() turns the repacking off)
        m.support_avx512bf16_for_cpu = _cpu_repacks()
    answer(model, tok, ["Which CRS does a GeoJSON file use?"], max_new_tokens=4)  # the "before" answers
    if _cpu_repacks():
        assert all(m.weight.quant_state.packing_format_for_cpu for m in layers), "generation repacked them"
    model = prepare_qlora(model, plan)[0]
    assert not any(
        getattr(getattr(m.weight, "quant_state", None), "packing_format_for_cpu", False)
        for m in model.modules()
        if hasattr(m, "support_avx512bf16_for_cpu")
    )
    grads = _lora_b_grads(model, tok)
    assert not [w for w in recwarn if "autograd kernel was not registered" in str(w.message)]
    assert grads.keys() == reference.keys() and grads
    for name, g in grads.items():
        # bitsandbytes' round trip keeps the 4-bit codes, only the absmax went through bf16: ~0.4 % off.
        # Without the fix these gradients are lost entirely (relative error 1.0).
        error = ((g - reference[name]).norm() / reference[name].norm()).item()
        assert error < 0.02, (name, error)


def test_preparing_a_prepared_model_again_returns_it_with_its_adapters(tiny_llama, tmp_path):
    """The prepare cell run twice: the second kbit preparation froze the adapters and get_peft_model failed
    on {'base_layer'}, leaving 0 trainable parameters. Now the model comes back as is, adapters kept."""
    from helpers.training.plan import FinetuneError

    plan = _plan(tiny_llama, tmp_path)
    model, tok, _ = load(plan.load_plan())
    model, first = prepare_qlora(model, plan)
    with torch.no_grad():  # as if it had trained: a re-run must keep these weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    again, second = prepare_qlora(model, plan)
    assert again is model and (second.trainable, second.targets) == (first.trainable, first.targets)
    assert "already had these LoRA adapters" in str(second) and "returned as is" in str(second)
    assert all((p == 0.01).all() for n, p in again.named_parameters() if "lora_B" in n)
    assert _lora_b_grads(again, tok)  # still trains

    for change, says in [({"r": 4}, "r 8 (the plan: 4)"), ({"targets": ["q_proj"]}, "targets [")]:
        with pytest.raises(FinetuneError, match=r"already has LoRA adapters .*" + re.escape(says)) as e:
            prepare_qlora(model, plan.replace(**change))
        assert "load the base model again" in str(e.value)
    assert model.get_nb_trainable_parameters()[0] == first.trainable  # nothing changed by the refusals

    save_adapter(model, tmp_path / "adapter")
    frozen, _, _ = load(plan.load_plan(adapter=str(tmp_path / "adapter")))  # loaded for inference
    with pytest.raises(FinetuneError, match="none of their weights trains"):
        prepare_qlora(frozen, plan)


def test_target_modules_skip_output_layer(tiny_llama, tiny_qwen2):
    from transformers import AutoModelForCausalLM

    for path in (tiny_llama, tiny_qwen2):
        names = target_modules(AutoModelForCausalLM.from_pretrained(path))
        assert {"q_proj", "v_proj", "down_proj"} <= set(names) and "lm_head" not in names


def test_qlora_lowers_loss_and_adapter_reloads(tiny_llama, tmp_path):
    plan = _plan(tiny_llama, tmp_path / "run", max_steps=8, save_steps=100)
    model, tok, trainable = _prepared(plan)
    assert 0 < trainable.trainable < trainable.total
    mb = find_micro_batch(model, plan)
    assert mb.micro_batch * mb.gradient_accumulation == plan.batch_size
    plan = plan.replace(micro_batch=mb.micro_batch)
    ds = build_dataset(tok, ROWS, plan.seq_len)
    with MemoryMonitor(interval=0.05, warn=False) as mon:
        cb = MemoryCallback(mon)
        result = train(model, tok, plan, ds, callbacks=[cb])
    assert result.global_step == 8 and result.resumed_from is None
    first, last = [x for _, x in result.losses[:2]], [x for _, x in result.losses[-2:]]
    assert sum(last) < sum(first) - 0.05, result.losses
    logged = [h for h in result.log_history if "loss" in h]
    assert all("ram_rss_mib" in h for h in logged)  # the callback's figures are in the history
    assert [m.label for m in mon.marks][0] == "train from step 0" and len(mon.samples) > 3

    report = save_adapter(model, tmp_path / "adapter")
    assert "adapter_model.safetensors" in report.files and "model.safetensors" not in report.files
    assert report.bytes < 2 * 4 * trainable.trainable + 64 * 1024  # LoRA weights only
    assert save_adapter(model, tmp_path / "adapter").previous is None  # the same adapter again: replaced
    first = (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    with torch.no_grad():  # another run's adapter (notebook 02 with FRESH=True): the earlier one is kept
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(0.01)
    again = save_adapter(model, tmp_path / "adapter")
    assert again.previous is not None and (again.previous / "adapter_model.safetensors").read_bytes() == first
    assert "is kept in" in str(again) and not (tmp_path / "adapter.saving").exists()
    model.eval()
    ids = tok(
        prompt_text(tok, "Count the features in wells.csv."), return_tensors="pt", add_special_tokens=False
    ).input_ids
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    fresh, _, rep = load(
        LoadPlan(
            str(tiny_llama), load="nf4", compute_dtype=plan.resolved_precision(), adapter=str(tmp_path / "adapter")
        )
    )
    assert rep.adapter_bytes > 0
    with torch.no_grad():
        reloaded = fresh(input_ids=ids).logits
        base = fresh.get_base_model()
        with fresh.disable_adapter():
            untrained = base(input_ids=ids).logits
    torch.testing.assert_close(reloaded, trained, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(untrained, trained, atol=1e-3)  # the adapter changed the outputs


def test_interrupted_run_resumes_at_the_right_step(tiny_llama, tmp_path):
    ref_plan = _plan(tiny_llama, tmp_path / "ref", micro_batch=2)
    model, tok, _ = _prepared(ref_plan)
    ds = build_dataset(tok, ROWS, ref_plan.seq_len)
    ref = train(model, tok, ref_plan, ds)
    del model

    plan = ref_plan.replace(output_dir=str(tmp_path / "cut"))
    model, tok, _ = _prepared(plan)
    cut = train(model, tok, plan, ds, callbacks=[StopAt(4)])
    assert cut.global_step == 4 and last_checkpoint(plan.output_dir).name == "checkpoint-4"
    del model
    model, tok, _ = _prepared(plan)  # a fresh kernel after the disconnect: same cell, rerun
    again = train(model, tok, plan, ds)
    assert again.resumed_from == 4 and again.global_step == 6
    assert [s for s, _ in again.losses] == [1, 2, 3, 4, 5, 6]
    torch.testing.assert_close(
        torch.tensor([x for _, x in again.losses]), torch.tensor([x for _, x in ref.losses]), rtol=1e-4, atol=1e-4
    )
    state = json.loads((last_checkpoint(plan.output_dir) / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    for name in ("optimizer.pt", "scheduler.pt", "adapter_model.safetensors"):
        assert (last_checkpoint(plan.output_dir) / name).exists()


@pytest.mark.bnb
def test_two_real_steps_train_save_and_rerun_as_finished(tiny_llama, tmp_path):
    """The compat matrix runs this at the lowest versions pyproject claims: transformers 5.1's Trainer calls
    accelerate's unwrap_model(model, keep_torch_compile=False), which accelerate 1.2 lacked (a TypeError
    at the first step), and nothing else there ran Trainer."""
    plan = _plan(tiny_llama, tmp_path / "run", micro_batch=2, max_steps=2, save_steps=2)
    model, tok, _ = _prepared(plan)
    ds = build_dataset(tok, ROWS[:8], plan.seq_len)
    result = train(model, tok, plan, ds)
    assert result.global_step == 2 and len(result.losses) == 2 and all(math.isfinite(x) for _, x in result.losses)
    assert last_checkpoint(plan.output_dir).name == "checkpoint-2"
    again = train(model, tok, plan, ds)  # the cell run again: finished, nothing trains
    assert again.global_step == 2 and again.finished_before


def test_reducers_through_the_trainer_train_as_the_plain_loss(tiny_llama, tmp_path):
    """TrainPlan(loss="chunked", offload_activations=True) through train()'s Trainer: the same losses step by
    step as the plain path (same seed, same data), so the reducers change memory, not the training."""
    losses = {}
    for name, reducers in (("plain", {}), ("reduced", {"loss": "chunked", "offload_activations": True})):
        plan = _plan(tiny_llama, tmp_path / name, micro_batch=2, max_steps=2, save_steps=2, dropout=0.0, **reducers)
        torch.manual_seed(0)
        model, tok, _ = _prepared(plan)
        ds = build_dataset(tok, ROWS[:8], plan.seq_len)
        losses[name] = [x for _, x in train(model, tok, plan, ds).losses]
    assert len(losses["plain"]) == 2
    assert losses["reduced"] == pytest.approx(losses["plain"], rel=1e-4)


@pytest.mark.cuda
def test_cuda_qlora_step_peak_is_reported(tiny_llama):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "estimate_accuracy.py"
    spec = importlib.util.spec_from_file_location("estimate_accuracy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.cuda_qlora_row()
    assert row is not None and row["measured"] > 0
    assert abs(row["error_pct"]) < 100, row  # the bench reports the exact figure; this only guards nonsense


def test_checkpoints_go_to_drive_on_colab(monkeypatch, tmp_path):
    import helpers.core.sources as sources

    drive = tmp_path / "MyDrive"
    monkeypatch.setattr(sources, "DRIVE", drive)
    monkeypatch.setattr(sources, "in_colab", lambda: True)
    plan = TrainPlan("codellama/CodeLlama-7b-Instruct-hf")
    assert plan.resolved_output_dir() == Path("runs/lora-CodeLlama-7b-Instruct-hf")  # Drive not mounted
    drive.mkdir()
    assert plan.resolved_output_dir() == drive / "oomkit" / "lora-CodeLlama-7b-Instruct-hf"
    assert TrainPlan("m", output_dir=str(tmp_path / "x")).resolved_output_dir() == tmp_path / "x"


def test_non_finite_numbers_unknown_optimizers_and_bad_seq_len_are_refused(tiny_llama, tmp_path):
    """Before: NaN/inf learning rates, epochs and dropout were accepted (NaN loss later), 'adam' failed
    deep inside transformers, precision took only fp16/bf16/fp32, seq_len=-1 dropped a token silently."""
    from transformers import AutoTokenizer

    from helpers.core.errors import OomkitError

    for name in ("learning_rate", "epochs", "dropout"):
        for bad in (float("nan"), float("inf"), float("-inf")):
            with pytest.raises(OomkitError, match=f"TrainPlan.{name} must be a finite number, got {bad!r}"):
                TrainPlan("x", max_steps=0, **{name: bad})
    with pytest.raises(ValueError, match=r"optimizer 'adam' is not an optimizer .*did you mean .*'adamw_torch'"):
        TrainPlan("x", optimizer="adam")
    with pytest.raises(ValueError, match="use 'auto' .* or one of: .*paged_adamw_8bit"):
        TrainPlan("x", optimizer=None)
    assert TrainPlan("x", optimizer="adafactor").resolved_optimizer() == "adafactor"
    for spelling, name in ((torch.bfloat16, "bf16"), ("bfloat16", "bf16"), ("float16", "fp16"), ("half", "fp16"),
                           ("torch.float32", "fp32"), ("FP16", "fp16"), ("auto", "auto")):  # fmt: skip
        assert TrainPlan("x", precision=spelling).precision == name
    assert TrainPlan("x", precision=torch.float16).resolved_precision() == "fp16"
    with pytest.raises(ValueError, match="TrainPlan.precision: unknown dtype 'int4'; use one of auto, fp16"):
        TrainPlan("x", precision="int4")
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    for bad in (-1, 0, 2.5, True):
        with pytest.raises(OomkitError, match=f"seq_len must be a whole number of tokens >= 1.*got {bad!r}"):
            build_dataset(tok, ROWS[:2], bad)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"instruction": "Qu\'est-ce qu\'une géométrie ?", "response": "x"}\n'.encode("latin-1"))
    with pytest.raises(
        OomkitError, match=r"latin1.jsonl is not UTF-8 text \(invalid .* at byte \d+\); save it as UTF-8"
    ):
        load_instructions(latin1)


def test_persistent_files_go_to_drive_when_it_is_mounted(monkeypatch, tmp_path):
    import helpers.core.sources as sources

    monkeypatch.setattr(sources, "DRIVE", tmp_path / "MyDrive")
    monkeypatch.setattr(sources, "in_colab", lambda: True)
    assert sources.persistent_path("eval_results.jsonl") == Path("eval_results.jsonl")  # Drive not mounted
    (tmp_path / "MyDrive").mkdir()
    assert sources.persistent_path("eval_results.jsonl") == tmp_path / "MyDrive" / "oomkit" / "eval_results.jsonl"
    assert sources.persistent_path(tmp_path / "mine.jsonl") == tmp_path / "mine.jsonl"  # an explicit path wins


def test_a_notebook_seeing_two_cards_trains_the_measured_micro_batch_on_one(fake_gpus, monkeypatch, tmp_path):
    """Kaggle's 2×T4 in a notebook: TrainingArguments counts 2 GPUs, so Trainer would feed 2 × the
    micro-batch find_micro_batch measured to GPU 0 (a 4-bit model is never wrapped in DataParallel)
    and copy a full-precision model onto GPU 1. The plan's batch stays the plan's."""
    import bitsandbytes  # noqa: F401 - imported for real before torch.cuda is faked
    from transformers import Trainer  # noqa: F401

    fake_gpus(2, 15 * 2**30)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    plan = TrainPlan("some/model", micro_batch=2, batch_size=8, output_dir=str(tmp_path), precision="fp32",
                     optimizer="adamw_torch")  # fmt: skip
    args = plan.training_arguments()
    assert args.device.type == "cuda" and torch.cuda.device_count() == 2
    assert args.n_gpu == 1 and args.train_batch_size == 2
    assert args.train_batch_size * args.gradient_accumulation_steps == plan.batch_size
