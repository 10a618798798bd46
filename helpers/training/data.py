"""Instruction data for fine-tuning: reading a JSONL file (:func:`load_instructions`), the prompt as the
model sees it (:func:`prompt_text`), tokenized examples with the prompt masked out of the loss
(:func:`build_dataset`, :class:`TrainingData`), padding a batch (:func:`collate`), and greedy answers
prompted exactly as in training (:func:`answer`).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch

from ..core.arguments import regular_file
from ..core.sources import data_path
from ..loading.generation import generate_batched
from .plan import FinetuneError, need_tokenizer

__all__ = ["load_instructions", "prompt_text", "format_example", "build_dataset", "TrainingData", "DatasetWarning",
           "collate", "answer", "IGNORE", "FALLBACK_TEMPLATE", "CUT_ANSWERS", "dataset_note", "main_process"]  # fmt: skip

IGNORE = -100  # label value the loss skips
FALLBACK_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"


def load_instructions(path: str | Path | None = None, *, heldout: bool = False) -> list[dict]:
    """Rows of an instruction JSONL file.

    Args:
        path: a JSONL file with one ``{"instruction": ..., "response": ...}`` object per line;
            default the shipped ``helpers/data/instructions.jsonl`` (``heldout_prompts.jsonl`` with ``heldout``).
    """
    if path is not None and not isinstance(path, str | os.PathLike):
        raise FinetuneError(f"load_instructions() takes a JSONL file path (or None: the shipped one), got {path!r:.60}")
    path = Path(path) if path is not None else data_path("heldout_prompts.jsonl" if heldout else "instructions.jsonl")
    if not path.exists():
        raise FileNotFoundError(
            f"no instruction file at {path}; pass a JSONL path with one "
            '{"instruction": ..., "response": ...} object per line'
        )
    path = regular_file(path, "instruction file", FinetuneError)
    if path.is_dir():
        raise IsADirectoryError(
            f"{path} is a folder; pass the JSONL file in it "
            f"({', '.join(sorted(p.name for p in path.glob('*.jsonl'))[:5]) or 'it has no .jsonl file'})"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise FinetuneError(
            f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8 "
            "(e.g. open(path, 'w', encoding='utf-8')) and pass it again"
        ) from None
    rows = []
    for i, line in enumerate(text.split("\n"), 1):  # "\n" only: U+2028 or U+0085 may sit inside a string
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            why = f"{e.msg}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else "nested too deep"
            raise FinetuneError(
                f"{path}:{i}: not valid JSON ({why}); every line must be one "
                '{"instruction": ..., "response": ...} object'
            ) from None
        if not isinstance(row, dict) or "instruction" not in row:
            has = (
                f"it has keys {', '.join(map(repr, row))}. Rename the fields, e.g. rows = [{{'instruction': "
                "r['question'], 'response': r['answer']} for r in rows]"
                if isinstance(row, dict)
                else f"it is a JSON {type(row).__name__}, not an object"
            )
            raise FinetuneError(
                f"{path}:{i}: every line needs an 'instruction' field (and 'response' for training); {has}"
            )
        rows.append(row)
    if not rows:
        raise FinetuneError(
            f'{path} holds no rows; every line must be one {{"instruction": ..., "response": ...}} object'
        )
    return rows


def prompt_text(tokenizer, instruction: str) -> str:
    """The prompt as the model sees it: the chat template's user turn, or a plain instruction block."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": instruction}], tokenize=False, add_generation_prompt=True
        )
    return (tokenizer.bos_token or "") + FALLBACK_TEMPLATE.format(instruction=instruction)


def _token_ids(tokenizer, instruction: str, response: str) -> tuple[list[int], list[int]]:
    """The prompt's and the answer's token ids (the answer ends with the end-of-sequence token)."""
    prompt = tokenizer(prompt_text(tokenizer, instruction), add_special_tokens=False)["input_ids"]
    answer = tokenizer(response + (tokenizer.eos_token or ""), add_special_tokens=False)["input_ids"]
    return prompt, answer


def format_example(tokenizer, instruction: str, response: str, seq_len: int, *, keep_eos: bool = True) -> dict | None:
    """Token ids and labels for one example; labels are ``-100`` on the prompt so only the answer trains.

    An answer cut at ``seq_len`` ends with the end-of-sequence token when ``keep_eos`` (its last kept
    token is replaced), so the example still teaches the model to stop. Returns ``None`` when
    truncation to ``seq_len`` would leave no answer token.
    """
    prompt, answer = _token_ids(tokenizer, instruction, response)
    return _example(tokenizer, prompt, answer, seq_len, keep_eos)


def _example(tokenizer, prompt: list[int], answer: list[int], seq_len: int, keep_eos: bool) -> dict | None:
    ids = (prompt + answer)[:seq_len]
    if len(prompt) >= len(ids):
        return None
    eos = getattr(tokenizer, "eos_token_id", None)
    if keep_eos and len(prompt) + len(answer) > seq_len and eos is not None:
        ids[-1] = eos
    labels = [IGNORE] * len(prompt) + ids[len(prompt) :]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


CUT_ANSWERS = ("keep_eos", "drop")


class DatasetWarning(UserWarning):
    """``build_dataset`` cut answers or dropped rows at this ``seq_len``.

    Raised for code that catches it (``warnings.catch_warnings``, ``pytest.warns``), but not printed in Python's
    raw ``file:line: DatasetWarning`` form: :func:`dataset_note` says it once, as an oomkit note."""


# the note says it (once, on the main process); a filter of the caller's own still sees the warning
warnings.filterwarnings("ignore", category=DatasetWarning)


def main_process() -> bool:
    """True outside a distributed launch and on its first process (``RANK``/``LOCAL_RANK`` 0, as torchrun and
    accelerate set them): a note every rank would print is said once."""
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    return rank.strip() in ("", "0")


def dataset_note(data: TrainingData, stream=None) -> bool:
    """Say what ``seq_len`` cost ``data`` (answers cut, rows dropped) as one ``[oomkit] note:`` line, on the main
    process only; True when said. Nothing when nothing was lost."""
    if not (data.cut or data.dropped) or not main_process():
        return False
    print(f"[oomkit] note: {data.summary()}", file=stream or sys.stdout, flush=True)
    return True


class TrainingData(list):
    """``build_dataset``'s examples (a list), with what ``seq_len`` cost: ``rows`` given, ``cut`` answers
    cut short (ending in the end-of-sequence token, or dropped with ``cut_answers='drop'``), ``dropped``
    rows (no answer token left, or cut and dropped)."""

    def __init__(self, examples: list[dict], *, rows: int, cut: int, dropped: int, seq_len: int, cut_answers: str):
        super().__init__(examples)
        self.rows, self.cut, self.dropped, self.seq_len, self.cut_answers = rows, cut, dropped, seq_len, cut_answers

    def summary(self) -> str:
        """One line: rows kept, answers cut, rows dropped at this seq_len."""
        what = "each ending in the end-of-sequence token" if self.cut_answers == "keep_eos" else "dropped"
        lost = ". Raise seq_len to keep them whole" if self.cut or self.dropped else ""
        return (
            f"seq_len={self.seq_len}: {self.rows - self.dropped} of {self.rows} rows kept; {self.cut} answers cut "
            f"short ({what}); {self.dropped} rows dropped{lost}"
        )


def build_dataset(
    tokenizer, rows: list[dict], seq_len: int, *, packing: bool = False, cut_answers: str = "keep_eos"
) -> TrainingData:
    """Tokenized examples, one per row (or packed), as a :class:`TrainingData` list that counts what
    ``seq_len`` cost (``.cut``, ``.dropped``, ``.summary()``; when any, an oomkit note says so once, and a
    :class:`DatasetWarning` is raised for code that catches it).

    A row longer than ``seq_len`` is truncated, so its answer is cut short: ``cut_answers="keep_eos"``
    (default) keeps it, ending in the end-of-sequence token so it still teaches where to stop; ``"drop"``
    drops it. A row whose prompt alone fills ``seq_len`` has no answer token to learn and is dropped.

    Args:
        packing: concatenate examples into full ``seq_len`` blocks (fewer pad tokens, but examples
            see each other's text through attention); off by default: one example per sequence.
    """
    if cut_answers not in CUT_ANSWERS:
        raise FinetuneError(f"cut_answers={cut_answers!r}: use 'keep_eos' (cut answers end in EOS) or 'drop'")
    need_tokenizer(tokenizer, "build_dataset")
    if not isinstance(rows, list | tuple):
        raise FinetuneError(
            f"rows must be a list of {{'instruction', 'response'}} dicts (load_instructions()), got {rows!r:.60}"
        )
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise FinetuneError(f"seq_len must be a whole number of tokens >= 1 (e.g. plan.seq_len), got {seq_len!r}")
    missing = [
        i for i, r in enumerate(rows) if not isinstance(r, dict) or "response" not in r or "instruction" not in r
    ]
    if missing:
        raise FinetuneError(f"rows {missing[:5]} lack an 'instruction' or 'response' field; training needs both")
    not_text = [
        i for i, r in enumerate(rows) if not isinstance(r["instruction"], str) or not isinstance(r["response"], str)
    ]
    if not_text:
        raise FinetuneError(
            f"rows {not_text[:5]} have an 'instruction' or 'response' that is not a string "
            f"(row {not_text[0]}: {rows[not_text[0]]!r:.80}); convert them with str()"
        )
    kept, cut, dropped = [], 0, 0
    for r in rows:
        prompt, answer = _token_ids(tokenizer, r["instruction"], r["response"])
        example = _example(tokenizer, prompt, answer, seq_len, keep_eos=True)
        is_cut = example is not None and len(prompt) + len(answer) > seq_len
        cut += is_cut
        if example is None or (is_cut and cut_answers == "drop"):
            dropped += 1
        else:
            kept.append(example)
    if not kept:
        raise FinetuneError(f"seq_len={seq_len} leaves no answer token in any example; raise TrainPlan.seq_len")
    if packing:
        ids = [t for e in kept for t in e["input_ids"]]
        labels = [t for e in kept for t in e["labels"]]
        kept = [
            {
                "input_ids": ids[i : i + seq_len],
                "attention_mask": [1] * len(ids[i : i + seq_len]),
                "labels": labels[i : i + seq_len],
            }
            for i in range(0, len(ids) - seq_len + 1, seq_len)
        ]
    data = TrainingData(kept, rows=len(rows), cut=cut, dropped=dropped, seq_len=seq_len, cut_answers=cut_answers)
    if cut or dropped:
        dataset_note(data)
        warnings.warn(data.summary(), DatasetWarning, stacklevel=2)
    return data


def collate(examples: list[dict], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Pad a batch on the right (labels with -100, attention mask with 0), each key to its own longest
    (a T5 example's labels are not as long as its input); arrays (Whisper's mel features, a VLM's
    pixels) are stacked as they are."""
    fill = {"input_ids": pad_token_id, "labels": IGNORE}
    out = {}
    for key in examples[0]:
        values = [e[key] for e in examples]
        if isinstance(values[0], list):
            n = max(len(v) for v in values)
            out[key] = torch.tensor([v + [fill.get(key, 0)] * (n - len(v)) for v in values])
        else:
            out[key] = torch.stack([torch.as_tensor(v) for v in values])
    return out


@torch.inference_mode()
def answer(
    model, tokenizer, instructions: list[str], *, max_new_tokens: int = 64, batch_size: int = 4, stream: bool = False,
    progress: bool = True,
) -> list[str]:  # fmt: skip
    """Greedy answers to ``instructions``, prompted exactly as in training (same template, no extra BOS).

    ``stream=True`` prints the first answer token by token while its batch runs; ``progress``: a bar of the
    batches (each can take seconds)."""
    if isinstance(instructions, str):  # else one prompt per character: as generate_batched refuses it
        raise TypeError(
            f"instructions must be a list of strings, got one string ({instructions[:40]!r}): pass [instruction]"
        )
    if not isinstance(instructions, list | tuple) or not all(isinstance(q, str) for q in instructions):
        raise TypeError(f"instructions must be a list of strings, got {instructions!r:.60}")
    need_tokenizer(tokenizer, "answer")
    prompts = [prompt_text(tokenizer, q) for q in instructions]
    return generate_batched(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                            progress=progress, desc="answer", add_special_tokens=False, do_sample=False, use_cache=True,
                            stream=stream)  # fmt: skip
