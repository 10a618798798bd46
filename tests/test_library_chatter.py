"""oomkit's own calls leave no library chatter in a notebook's output: transformers' notes about the
generate() call safe_generate makes, bitsandbytes' "eetq" line on a CPU device map, each rank's lines of a
DDP launch (collapsed into one progress line)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import LoadPlan, load, safe_generate
from helpers.core.compat import library_notes_silenced
from helpers.loading.generation import GENERATE_NOTES, generate_batch, generate_batched
from helpers.loading.loader import LOAD_NOTES
from helpers.training.distributed import run_streaming

CHATTER = re.compile("|".join([*GENERATE_NOTES, *LOAD_NOTES, "generation_config", "max_length", "use_cache"]))


@pytest.fixture
def chatty_model(tiny_llama):
    """The tiny model as a fine-tuned one often arrives: a generation_config.json with max_length and sampling
    flags (greedy decoding makes them invalid), gradient checkpointing still on and the model in train mode."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model.generation_config.max_length = 20
    model.generation_config.temperature = 0.7
    model.generation_config.top_p = 0.9
    model.generation_config.do_sample = False
    model.gradient_checkpointing_enable()
    model.train()
    return model, tokenizer


def said(capfd, caplog, record: list) -> str:
    """Everything the user would see: stderr, the log records (transformers' handler may hold a stream pytest
    does not capture) and the warnings."""
    out = capfd.readouterr()
    return "\n".join([out.out, out.err, caplog.text, *(str(w.message) for w in record)])


def test_oomkits_generate_calls_say_nothing_of_their_own_arguments(chatty_model, capfd, caplog, tmp_path):
    model, tokenizer = chatty_model
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        generate_batch(model, tokenizer, ["hello there", "a"], max_new_tokens=3)
        generate_batched(model, tokenizer, ["hello there", "a"], max_new_tokens=3, progress=False)
        safe_generate(model, tokenizer, ["one", "two"], max_new_tokens=3, batch_size=2, progress=False,
                      results=tmp_path / "r.jsonl")  # fmt: skip
    text = said(capfd, caplog, record)
    assert not CHATTER.search(text), text


def test_the_same_model_is_chatty_when_called_directly(chatty_model, capfd, caplog):
    model, tokenizer = chatty_model
    enc = tokenizer(["hello"], return_tensors="pt")
    model.generate(**enc, max_new_tokens=2, pad_token_id=tokenizer.pad_token_id)  # not once-only: said every call
    assert "Both `max_new_tokens`" in said(capfd, caplog, [])


def test_a_quantized_load_on_a_cpu_device_map_has_no_eetq_line(tiny_llama, capfd, caplog):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        load(LoadPlan(str(tiny_llama), load="nf4", device_map={"": "cpu"}), check=False)
    text = said(capfd, caplog, record)
    assert "eetq" not in text and "no linear modules" not in text


def test_only_the_named_notes_are_silenced_and_only_inside_the_block(capfd, caplog):
    log = logging.getLogger("transformers.generation.utils")
    with library_notes_silenced("Both `max_new_tokens`"):
        log.warning("Both `max_new_tokens` (=3) and `max_length`(=20) seem to have been set.")
        log.warning("something else entirely")
        warnings.warn("Both `max_new_tokens` as a warning", UserWarning, stacklevel=1)
    log.warning("Both `max_new_tokens` after the block")
    err = said(capfd, caplog, [])
    assert "(=3)" not in err and "as a warning" not in err
    assert "something else entirely" in err and "after the block" in err


RANKS = """
import sys, time
for step in range(3):
    for rank in (0, 1):
        print(f"[rank{rank}]: Loading weights: {step * 50}%", file=sys.stderr, flush=True)
print("[rank0]: step 3/3 loss 1.234", file=sys.stderr, flush=True)
"""


def test_a_launch_shows_one_progress_line_not_every_ranks_lines(capfd):
    run = run_streaming([sys.executable, "-c", RANKS], desc="torchrun, 2 processes")
    err = capfd.readouterr().err
    assert run.code == 0 and len(run.tail) == 7  # every line kept, for the error of a failed run
    assert "[rank1]" not in err and "Loading weights: 50%" not in err.split("\n")[-1]
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert final.startswith("torchrun, 2 processes: 00:0") and final.endswith("done")
    echoed = run_streaming([sys.executable, "-c", RANKS], echo=True)
    assert echoed.code == 0 and "[rank1]: Loading weights: 100%" in capfd.readouterr().err


@pytest.mark.slow
def test_forked_ranks_show_rank_zeros_bar_and_no_warning_per_rank(tiny_llama, tmp_path, capfd):
    # in a fresh interpreter: the ranks fork from it, and a pytest worker's state (what earlier tests in the
    # same process imported or cached) is not what a notebook kernel forks from
    script = (f"from helpers.training.distributed import run_ddp_qlora\n"
              f"run = run_ddp_qlora({str(tiny_llama)!r}, {str(tmp_path)!r}, num_processes=2, via='debug', steps=3, "
              f"seq_len=32)\nprint('RUN', run.in_sync, len(run.ranks))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RUN True 2" in done.stdout
    text = done.stdout + done.stderr
    assert "DDP QLoRA, 2 processes, rank 0" in text and "rank 1" not in text.replace("rank 1/2", "")
    assert "UserWarning" not in text and "Loading weights" not in text  # no rank's own warnings or load bars
