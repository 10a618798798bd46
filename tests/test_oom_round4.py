"""Memory failures outside PyTorch's allocator read as memory failures (issue 47 item 5).

The corpus (tests/data/oom_messages.jsonl) holds the real messages; these tests pin what the report does
with them beyond reading them: the fixes that come first, and who a cut message blames.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.oom.diagnosis import explain_oom
from helpers.oom.messages import is_oom, is_oom_text

CORPUS = [json.loads(line) for line in (Path(__file__).parent / "data" / "oom_messages.jsonl").open(encoding="utf-8")]


def _text(kind: str, source_part: str = "") -> str:
    return next(e["text"] for e in CORPUS if e["kind"] == kind and source_part in e["source"])


# modelscope/FunASR#2006's message, whole and cut after its process line (as a log viewer cuts it)
FULL = next(e["text"] for e in CORPUS if "FunASR/issues/2006" in e["source"] and not e.get("cut"))
CUT = next(e["text"] for e in CORPUS if "FunASR/issues/2006" in e["source"] and e.get("cut"))


def test_a_cut_message_whose_one_process_holds_the_card_blames_this_process_not_others():
    r = explain_oom(CUT)
    assert r.cause == "steady_state" and "other_processes" not in r.causes
    assert any("probably this process (the notebook itself)" in n for n in r.notes)
    assert "batch" in " ".join(r.fixes[:2]) and "checkpointing" in " ".join(r.fixes[:3])
    assert not any(f.startswith("Stop them") for f in r.fixes)
    whole = explain_oom(FULL)  # the whole message keeps its own reading
    assert whole.cause == "steady_state" and not any("probably this process" in n for n in whole.notes)


def test_a_cut_message_whose_process_holds_a_small_share_still_names_another_process():
    small = CUT.replace("Process 2109115 has 78.99 GiB", "Process 2109115 has 20.00 GiB")
    r = explain_oom(small)
    assert "other_processes" in r.causes and not any("probably this process" in n for n in r.notes)


def test_the_transformers_dispatch_error_gets_the_fit_fixes_for_the_model_first():
    from helpers import estimate

    text = _text("transformers_dispatch", "Senna")
    plain = explain_oom(text)
    assert plain.cause == "quantized_offload" and "llm_int8_enable_fp32_cpu_offload" in " ".join(plain.fixes)
    guided = explain_oom(text, memory_estimate=estimate("Qwen/Qwen2.5-7B", load="fp16", device="t4"))
    assert guided.fixes[0].startswith("From the estimate of Qwen/Qwen2.5-7B: ")
    assert any("load=nf4" in f for f in guided.fixes) and guided.fixes[-len(plain.fixes) :] == plain.fixes


def test_vllm_kv_errors_say_what_max_model_len_fits():
    r = explain_oom(_text("vllm_kv", "vllm/issues/2418"))
    assert (r.max_seq_len, r.kv_cache_tokens) == (4096, 3664)
    assert any("max_model_len=3664 fits" in n for n in r.notes)
    assert ("tokens the KV cache holds", "3,664 tokens") in r.figures()


@pytest.mark.parametrize(
    "text",
    [
        "RuntimeError: Could not allocate tensor with 234881024 bytes. There is not enough GPU video memory available!",
        "OOM when allocating tensor with shape[2,3] and type float on /job:localhost/replica:0/task:0/device:GPU:0",
    ],
)
def test_other_allocators_are_recognized_as_text(text):
    assert is_oom_text(text) and explain_oom(text).cause == "device_memory"


def test_a_live_directml_error_is_an_oom_but_a_vllm_or_transformers_refusal_is_not_retried():
    """A retry loop halves its batch on a live OOM: DirectML's RuntimeError is one; vLLM's and transformers'
    ValueErrors are configuration refusals that a smaller batch does not cure (text diagnosis still reads them)."""
    assert is_oom(
        RuntimeError("Could not allocate tensor with 4915840 bytes. There is not enough GPU video memory available!")
    )
    assert not is_oom(ValueError(_text("vllm_kv", "QwenLM")))
    assert not is_oom(ValueError(_text("transformers_dispatch", "Senna")))


def test_a_tensorflow_request_is_its_shape_times_its_type():
    r = explain_oom("OOM when allocating tensor with shape[1024,1024] and type half on /device:GPU:2 by allocator")
    assert (r.requested, r.device) == (1024 * 1024 * 2, 2)
    unknown_type = explain_oom("OOM when allocating tensor with shape[1024] and type qint8 on /device:GPU:0")
    assert unknown_type.requested is None and "requested" in unknown_type.unknown
