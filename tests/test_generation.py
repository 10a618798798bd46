"""helpers.loading.generation: one left-padded batched generate, new text only, token ids computed once."""

from __future__ import annotations

import pytest
import torch

from helpers.loading.generation import (
    count_new_tokens,
    encode,
    generate_batch,
    generate_batched,
    pad_left,
    stop_token_ids,
)
from helpers.oom.retry import Watch

PROMPTS = ["memory memory memory item", "short", "a somewhat longer prompt about memory use"]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from helpers.loading.loader import load

    model, tokenizer, _ = load(str(tiny_llama), load="fp32", check=False)
    return model, tokenizer


def test_pad_left_matches_the_tokenizers_left_padding(tiny):
    _, tok = tiny
    ref = tok(PROMPTS, return_tensors="pt", padding=True)
    assert tok.padding_side == "left"
    ours = pad_left(encode(tok, PROMPTS), tok.pad_token_id)
    assert torch.equal(ours["input_ids"], ref["input_ids"]) and torch.equal(
        ours["attention_mask"], ref["attention_mask"]
    )


def test_batch_equals_one_at_a_time_and_ids_equal_strings(tiny):
    model, tok = tiny
    side = tok.padding_side
    tok.padding_side = "right"  # generation pads on the left whatever the tokenizer says
    try:
        watch = Watch()
        batch = generate_batch(model, tok, PROMPTS, max_new_tokens=5, do_sample=False, watch=watch)
        again = generate_batch(model, tok, encode(tok, PROMPTS), max_new_tokens=5, do_sample=False)
    finally:
        tok.padding_side = side
    single = [generate_batch(model, tok, [p], max_new_tokens=5, do_sample=False).texts[0] for p in PROMPTS]
    assert batch.texts == again.texts == single
    assert batch.token_ids.shape == (3, 5) and batch.token_ids.device.type == "cpu" and len(watch) == 1
    stop = stop_token_ids(model, tok)
    assert batch.new_tokens == [count_new_tokens(row, stop) for row in batch.token_ids]
    assert generate_batched(model, tok, PROMPTS, max_new_tokens=5, batch_size=2, do_sample=False) == single


def test_several_sequences_per_prompt_and_training_mode_restored(tiny):
    model, tok = tiny
    model.train()
    try:
        out = generate_batched(model, tok, PROMPTS[:2], max_new_tokens=3, num_return_sequences=2, do_sample=True)
        assert len(out) == 4 and model.training
    finally:
        model.eval()
    with pytest.raises(TypeError, match="pass \\[prompt\\]"):
        generate_batched(model, tok, "one string")
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1, got 0"):
        generate_batched(model, tok, PROMPTS, batch_size=0)


def test_stream_prints_the_first_prompts_answer_as_it_comes(tiny, capsys):
    """A long generation shows progress: the first prompt's new text is printed while its batch runs,
    and it is exactly what the call returns for that prompt; nothing of the other rows is printed."""
    model, tok = tiny
    prompts = ["Question: what is 2 + 2?\nAnswer:", "A longer prompt, so the first row is padded", "third"]
    quiet = generate_batched(model, tok, prompts, max_new_tokens=8, batch_size=2)
    assert capsys.readouterr().out == ""  # off by default
    streamed = generate_batched(model, tok, prompts, max_new_tokens=8, batch_size=2, stream=True)
    out = capsys.readouterr().out
    assert streamed == quiet  # streaming changes nothing returned
    header, text = out.split("\n", 1)
    assert header == "streaming the first prompt's answer:" and text == streamed[0] + "\n"


@pytest.mark.parametrize("budget", [None, 30], ids=["fits", "first-batches-oom"])
def test_safe_generate_streams_its_first_batch(tiny, tmp_path, capsys, budget):
    """The first batch that runs streams its first answer once, also when earlier attempts ran out of memory."""
    import contextlib

    from helpers.evaluation.evaluate import safe_generate
    from helpers.testing import simulated_budget

    model, tok = tiny
    prompts = [{"id": f"p{i}", "prompt": "word " * (3 + i)} for i in range(5)]
    with simulated_budget(model, tokens=budget) if budget else contextlib.nullcontext():
        report = safe_generate(model, tok, prompts, max_new_tokens=6, results=tmp_path / "r.jsonl", progress=False,
                               stream=True)  # fmt: skip
    assert (report.oom_retries > 0) == bool(budget)
    header, text = capsys.readouterr().out.split("\n", 1)
    first = max(report.records, key=lambda r: r["prompt_tokens"])  # longest prompts go first
    assert header == "streaming the first batch's first answer:" and text == first["output"] + "\n"


def test_stream_steps_aside_for_beam_search_and_a_callers_streamer(tiny, capsys):
    """generate refuses a streamer with beam search, and a caller's own streamer would be passed twice:
    stream=True then streams nothing of its own instead of raising (it raised ValueError / TypeError)."""
    from transformers import TextStreamer

    model, tok = tiny
    beams = generate_batched(model, tok, PROMPTS, max_new_tokens=4, batch_size=2, stream=True, num_beams=2)
    assert len(beams) == len(PROMPTS) and capsys.readouterr().out == ""
    generate_batched(model, tok, PROMPTS[:1], max_new_tokens=4, stream=True, streamer=TextStreamer(tok))
    assert "streaming the first prompt" not in capsys.readouterr().out  # the caller's streamer ran, not ours


def test_prompts_past_the_context_are_refused_or_capped_when_asked(tiny, monkeypatch):
    import helpers
    from helpers.core.errors import ContextLengthError

    model, tok = tiny
    lengths = [len(row) for row in encode(tok, PROMPTS)]
    context = max(lengths) + 2  # the longest prompt leaves room for 2 new tokens
    monkeypatch.setattr(model.config, "max_position_embeddings", context)
    longest = lengths.index(max(lengths))
    calls = []
    monkeypatch.setattr(model, "generate", lambda *a, **k: calls.append(k) or model.__class__.generate(model, *a, **k))
    for fn in (generate_batched, helpers.generate_batched):
        with pytest.raises(
            ContextLengthError,
            match=rf"{context}-token context: #{longest} \({max(lengths)} tokens\)\. Pass max_new_tokens=2 or less",
        ):
            fn(model, tok, PROMPTS, max_new_tokens=5, progress=False)
    assert calls == []  # refused before any generation
    assert len(generate_batched(model, tok, PROMPTS, max_new_tokens=2)) == 3  # within the context: as before
    calls.clear()
    out = generate_batched(model, tok, PROMPTS, max_new_tokens=5, batch_size=1, over_context="cap")
    assert len(out) == 3 and [k["max_new_tokens"] for k in calls] == [min(5, context - n) for n in lengths]
    monkeypatch.setattr(model.config, "max_position_embeddings", max(lengths))  # the longest fills it
    with pytest.raises(ContextLengthError, match="no room for one new token"):
        generate_batched(model, tok, PROMPTS, max_new_tokens=1, over_context="cap")
    with pytest.raises(ContextLengthError, match="over_context must be 'refuse'.*got 'trim'"):
        generate_batched(model, tok, PROMPTS, over_context="trim")
