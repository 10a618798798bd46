"""Prompts for an evaluation: read from a list, a JSONL file or a ``datasets.Dataset``, checked, given ids.

``load_prompts(prompts)`` normalizes any of them to ``[{'id', 'prompt', 'reference'}]``: ids from the
data, or stable hashes of the text (``prompt_id``). Bad input (a missing or non-UTF-8 file, a line
that is not JSON, a dict where a list belongs, repeated ids, text UTF-8 cannot encode) raises
``EvalError`` naming the problem and the fix, before anything is generated.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..core.arguments import regular_file
from ..core.errors import EvalError

__all__ = ["load_prompts", "prompt_id"]


def prompt_id(prompt: str) -> str:
    """A stable id for a prompt without one: the first 12 hex digits of its SHA-1."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:12]


def _rows(prompts: Any) -> Iterable[Any]:
    if isinstance(prompts, str | os.PathLike):
        path = regular_file(prompts, "prompt file", EvalError)
        if not path.is_file():
            one = (
                ""
                if path.suffix in (".jsonl", ".json") or os.sep in str(prompts)
                else f" To evaluate this text as a single prompt, pass a list: [{str(prompts)[:40]!r}]."
            )
            raise EvalError(
                f"prompt file {path} not found: pass a JSONL path with one {{'prompt': ...}} per line, "
                f"or a list of prompts.{one}"
            )
        rows = []
        # JSONL lines end at "\n" only: str.splitlines would also split inside strings at U+2028, U+0085...
        for n, line in enumerate(_read_utf8(path).split("\n"), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise EvalError(f"{path} line {n} is not valid JSON ({e.msg})") from None
                except RecursionError:
                    raise EvalError(
                        f"{path} line {n} nests lists or objects deeper than the JSON reader goes: a prompt record "
                        "is one flat object, {'prompt': ..., 'reference': ...}"
                    ) from None
                if isinstance(row, list):
                    raise EvalError(
                        f"{path} line {n} is a JSON array; the file must be JSONL: one "
                        "{'prompt': ...} object per line (or pass the list itself: json.load(open(path)))"
                    )
                rows.append(row)
        return rows
    if isinstance(prompts, dict):
        # iterating a dict gives its keys: {"prompt": "hi"} would be evaluated as the prompt "prompt"
        raise EvalError(
            f"prompts is a dict (keys {list(prompts)[:3]}): pass a list, e.g. [prompts] for one "
            "{'prompt': ...} record, or [{'id': k, 'prompt': v} for k, v in prompts.items()] for id -> prompt"
        )
    if hasattr(prompts, "column_names") and hasattr(prompts, "__iter__"):  # a datasets.Dataset
        return list(prompts)
    if isinstance(prompts, Iterable):
        return list(prompts)
    raise EvalError(
        f"prompts must be a list of strings or dicts, a JSONL path or a datasets.Dataset, not {type(prompts).__name__}"
    )


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EvalError(
            f"prompt file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): "
            "re-save it as UTF-8, e.g. text = open(path, encoding='latin-1').read(); "
            "open(path, 'w', encoding='utf-8').write(text)"
        ) from None


def _check_text(value: Any, what: str) -> None:
    """Refuse text UTF-8 cannot encode (a lone surrogate, e.g. from a bad decode): the results file could not hold it."""
    if not isinstance(value, str):
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EvalError(
            f"{what} holds a lone surrogate {value[e.start]!r} at character {e.start} (text {value[:40]!r}), "
            "which UTF-8 cannot encode: clean it first, e.g. text.encode('utf-8', 'replace').decode('utf-8')"
        ) from None


def load_prompts(prompts: Any) -> list[dict]:
    """Normalize prompts to ``[{'id', 'prompt', 'reference'}]`` (ids from the data or stable hashes).

    Accepts a list of strings, a list of dicts with ``prompt`` (and optional ``id``, ``reference``),
    a JSONL path, or a ``datasets.Dataset`` with those columns. Repeated prompts without ids get
    ``#2``, ``#3``... suffixes; repeated explicit ids are an error.
    """
    out: list[dict] = []
    seen: dict[str, int] = {}
    for n, row in enumerate(_rows(prompts)):
        if isinstance(row, str):
            row = {"prompt": row}
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise EvalError(f"prompt #{n} must be a string or a dict with a 'prompt' string, got {row!r:.80}")
        if not row["prompt"].strip():
            raise EvalError(f"prompt #{n} is empty ({row['prompt']!r}): drop it or give it text")
        for name in ("prompt", "id", "reference"):
            _check_text(row.get(name), f"prompt #{n}'s {name}")
        if row.get("id") is not None:
            pid = str(row["id"])
            if pid in seen:
                raise EvalError(f"id {pid!r} appears twice (prompts #{seen[pid]} and #{n}): ids must be unique")
        else:
            pid = base = prompt_id(row["prompt"])
            k = 1
            while pid in seen:
                k += 1
                pid = f"{base}#{k}"
        seen[pid] = n
        ref = row.get("reference")
        out.append({"id": pid, "prompt": row["prompt"], "reference": None if ref is None else str(ref)})
    if not out:
        raise EvalError(f"prompts {str(prompts)[:80]!r} is empty: pass at least one prompt")
    return out
