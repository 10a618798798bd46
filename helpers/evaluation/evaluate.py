"""OOM-safe, resumable evaluation: generate for many prompts as fast as memory allows, lose nothing.

``safe_generate(model, tokenizer, prompts, results="eval.jsonl")`` sorts prompts by token length and
generates them in left-padded batches whose size adapts to memory: an OOM releases what the failed
batch pinned, lowers the token budget (batch x sequence length) to a size between the largest that
ran and the smallest that failed, and retries the same prompts; shorter prompts later get bigger
batches again. A prompt that does not fit even alone is retried with fewer new tokens and recorded
as truncated, never dropped. Every finished sample is appended to a JSONL file and flushed at once;
a rerun skips finished ids and repairs a line torn by a crash.

What it stands on lives in modules of its own and is re-exported here, so ``from helpers.evaluation.evaluate
import X`` works for every name in ``__all__``: reading and checking prompts (:mod:`helpers.evaluation.prompts`),
the crash-safe results file (:mod:`helpers.evaluation.results_file`), the scorers (:mod:`helpers.evaluation.evaluate`), the
batch sizes (the token budget, the starting size and ``batch_cache_key``: :mod:`helpers.evaluation.batching`)
and ``EvalError`` (:mod:`helpers.core.errors`). ``simulated_budget`` (a test double that makes a CPU run
behave like a small GPU) lives in :mod:`helpers.testing`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.arguments import flag, whole_number
from ..core.attention import keep_attention_fused
from ..core.errors import EvalError, FingerprintError, ScoreError
from ..core.memory import allocated, peak_allocated, ram_readout, reserved, reset_peak_allocated
from ..core.reducers import kv_cache_kwargs
from ..core.units import format_bytes
from ..core.vocab import DEFAULTS, ReducerError
from ..loading.fingerprint import describe, identity_changes, model_identity
from ..loading.generation import (
    Generated,
    can_stream,
    check_generate_kwargs,
    context_length,
    encode,
    first_prompt_streamer,
    generate_batch,
    model_device,
    new_tokens_room,
    stop_token_ids,
    token_ids_problem,
)
from ..oom.batch_size import remembered_batch
from ..oom.retry import Attempt, Watch, attempt
from .batching import TokenBudget, batch_cache_key, remember, start_size
from .inputs import batch_media, has_media, prompt_inputs
from .prompts import load_prompts
from .report import EvalReport, mean_of_finite
from .results_file import ResultsFile, ResultsWriteError, made_hash

__all__ = [
    "exact_match",
    "contains_reference",
    "SCORERS",
    "resolve_scorer",
    "score_fields",
    "safe_generate",
    "prompt_hash",
]


# ---------------------------------------------------------------------------------------------
# memory readouts


def _memory(device: torch.device) -> int:
    """GPU bytes held by tensors on every card on CUDA (a model split over two fills both), the process's
    resident RAM elsewhere."""
    if device.type == "cuda":
        return allocated("all")
    return ram_readout().process_rss


def _should_empty_cache(device: torch.device) -> bool:
    """True when much memory sits reserved but unallocated on a card (worth giving back to avoid
    fragmentation OOMs): on any card, since a split model generates on every card it holds layers on."""
    if device.type != "cuda":
        return False
    return any(
        reserved(d) - allocated(d) > max(1 << 30, torch.cuda.get_device_properties(d).total_memory // 4)
        for d in range(torch.cuda.device_count())
    )


# ---------------------------------------------------------------------------------------------
# what made a result (a resume reuses only what this run would make)


def prompt_hash(prompt: str) -> str:
    """The first 16 hex digits of the prompt's SHA-256 (recorded, so a resume never reuses another text's result)."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# safe_generate


def safe_generate(
    model,
    tokenizer,
    prompts: Any,
    *,
    max_new_tokens: int = DEFAULTS.max_new_tokens,
    batch_size: int | str = "auto",
    results: str | os.PathLike = "eval_results.jsonl",
    resume: bool = True,
    generation_kwargs: dict | None = None,
    score: str | Callable[[str, str], float] | None = None,
    max_batch_size: int = 64,
    progress: bool = True,
    on_result: Callable[[dict], None] | None = None,
    stream: bool = False,
    kv_cache: str | None = None,
) -> EvalReport:
    """Generate for every prompt without losing a result to an OOM or a crash.

    Args:
        model, tokenizer: a loaded model and its tokenizer (``helpers.load`` sets up padding); for
            Whisper or a VLM, its processor (``helpers.load_processor``).
        prompts: a list of strings, a list of dicts with ``prompt`` (optional ``id``, ``reference``),
            a JSONL path, or a ``datasets.Dataset``; for Whisper dicts with ``audio`` (or ``input_features``),
            for a VLM with ``image`` and ``prompt`` (see :mod:`helpers.evaluation.inputs`).
        max_new_tokens: new tokens per prompt (fewer only when the context or memory forces it; recorded).
        batch_size: ``"auto"`` (find_max_batch_size's cached value, else the estimator's prediction
            on CUDA, else 8), or a starting int; either way it doubles while it fits and shrinks on OOM.
        results: the JSONL file every finished sample is appended to (never the prompt file); it is
            locked for the run, so a second run on it fails at once instead of duplicating results.
            ``~`` is the home folder; a FIFO or a device (/dev/full) is refused.
        resume: skip ids already in ``results`` when the same model made them (name, a sampled
            hash of the weights as loaded, load mode as loaded, adapter content, tokenizer settings:
            :mod:`helpers.loading.fingerprint`), with the same generation settings (objects by content) and
            prompt text; a mismatch is an error naming what changed. False: start the file over;
            ``"force"``: reuse them even when made differently.
        generation_kwargs: passed to ``model.generate`` (greedy by default); objects (a GenerationConfig,
            logits processors) are recorded by content, one with no readable state raises FingerprintError.
            ``stop_strings`` are read with this tokenizer; ``pad_token_id``, ``tokenizer`` and the arguments
            that make generate return scores or hidden states are refused (EvalError), as are more than 128 beams.
        score: ``"exact_match"``, ``"contains"`` or ``fn(output, reference) -> float``, averaged in the
            report; saved outputs without its score (an earlier run's) are scored too. NaN and inf scores
            are left out of the mean and counted (``report.nonfinite_scores``; the report says how many).
        max_batch_size: never batch more prompts than this.
        progress: show a tqdm bar (a widget in notebooks); True or False, anything else is an EvalError.
        on_result: called with each record once it is on disk.
        stream: print the first batch's first answer token by token while it is generated (a long
            batch otherwise shows nothing until it ends).
        kv_cache: the KV cache ``generate`` keeps for this run: ``"fp8"``, ``"int4"``, ``"int2"``
            (quantized) or ``"offload"`` (in RAM); ``None`` keeps the model's own (the one
            ``LoadPlan(kv_cache=...)`` set). Recorded with the generation settings.

    Returns:
        An :class:`EvalReport`.

    A prompt that does not fit in memory even alone with one new token is recorded as failed
    (``error: "does not fit"``, see ``EvalReport.failures``) and the rest goes on.

    Raises:
        EvalError: bad input (no prompts, a prompt longer than the context, an unwritable or locked
            path, results made by another model or settings), raised before any generation.
        ResultsWriteError: a result could not be written (disk full); it carries the unsaved records
            and everything written before it stays in the file.
        ScoreError: after the run, when ``score`` raised: every output is saved, with ``score_error``.
    """
    flag("progress", progress, error=EvalError)  # "no" is truthy: a bar nobody asked for
    items, ids, run = _prepare(
        model, tokenizer, prompts, max_new_tokens, results, resume, generation_kwargs, score, max_batch_size, stream,
        kv_cache,
    )  # fmt: skip
    store, done = _open_results(prompts, results, resume, items)  # locked for the run: a second writer gets an error
    try:
        ids = _pending_ids(run, items, ids, done)  # token ids of what is left only: a resume never re-tokenizes
        report = _generate_pending(
            run, items, ids, store, done, resume, batch_size, max_batch_size, progress, on_result
        )
    finally:
        store.close()
    _finish(report, run, store, items)
    _raise_score_errors(report, run.scorer)
    return report


def _open_results(
    prompts: Any, results: str | os.PathLike, resume, items: list[dict]
) -> tuple[ResultsFile, dict[str, dict]]:
    """The results file, open and locked for the run, and the records it already holds."""
    store = ResultsFile(results)
    _refuse_input_as_results(prompts, store.path)
    store.share(text for it in items for text in (it["id"], it["prompt"], it["reference"]))
    done = store.open(fresh=resume is False)
    store.share(())  # the records hold them now; the lookup table goes
    if store.backup is not None:
        warnings.warn(f"resume=False: the earlier results in {store.path} were moved to {store.backup}", stacklevel=3)
    return store, done


def _prepare(
    model,
    processor,
    prompts,
    max_new_tokens,
    results,
    resume,
    generation_kwargs,
    score,
    max_batch_size,
    stream,
    kv_cache,
) -> tuple[list[dict], list[list[int]], _Run]:
    """Every check that needs no results file (all before any generation): the prompts, their token ids, the run."""
    tokenizer = getattr(processor, "tokenizer", processor)  # Whisper's or a VLM's processor: its tokenizer decodes
    gen_kwargs = _check_arguments(model, tokenizer, max_new_tokens, max_batch_size, generation_kwargs)
    if kv_cache is not None:
        try:
            gen_kwargs.update(kv_cache_kwargs(kv_cache))
        except ReducerError as e:
            raise EvalError(f"kv_cache: {e}") from None
    _check_results_arguments(results, resume)
    # token ids once (the lengths: sorting, context limits; and the batches), audio and images too; text
    # prompts are tokenized once the results file says which are left (_pending_ids)
    if has_media(prompts):
        items, ids = prompt_inputs(prompts, processor)
    else:
        items, ids = load_prompts(prompts), None
    if not items:
        raise EvalError("no prompts to evaluate: the prompt list (or file) is empty")
    scorer = resolve_scorer(score)
    context = context_length(model, tokenizer)
    if ids is not None:
        _check_context(items, ids, context)
    settings = _settings(model, max_new_tokens, gen_kwargs)
    run = _Run(model, tokenizer, model_device(model), gen_kwargs, settings, max_new_tokens, context, scorer)
    run.scored_by = _scorer_id(scorer)
    run.stream = stream and can_stream(model, gen_kwargs)  # not with beam search or the caller's own streamer
    run.kv_cache = kv_cache
    keep_attention_fused(model)  # a model loaded without load(): its unpadded batches skip the math kernel too
    return items, ids, run


def _pending_ids(run: _Run, items: list[dict], ids: list | None, done: dict[str, dict]) -> list:
    """Token ids per item: computed here for the prompts not finished yet (None for the finished ones),
    whose context is then checked (still before any generation); media prompts come with theirs."""
    if ids is not None:
        return ids
    left = [k for k, it in enumerate(items) if it["id"] not in done or done[it["id"]].get("error")]
    ids = [None] * len(items)
    if not left:
        return ids
    for k, row in zip(left, encode(run.tokenizer, [items[k]["prompt"] for k in left]), strict=True):
        ids[k] = row
    _check_context([items[k] for k in left], [ids[k] for k in left], run.context)
    return ids


def _generate_pending(
    run: _Run,
    items: list[dict],
    ids: list[list[int]],
    store: ResultsFile,
    done: dict[str, dict],
    resume,
    batch_size,
    max_batch_size: int,
    progress: bool,
    on_result,
) -> EvalReport:
    """Generate what the (open, locked) results file does not hold yet; the report of this run so far."""
    failed = {k: r for k, r in done.items() if r.get("error")}  # tried again (memory may be free now)
    done = {k: r for k, r in done.items() if not r.get("error")}
    _check_reuse(done, items, run, resume, store.path)
    pending = [(it, row) for it, row in zip(items, ids, strict=True) if it["id"] not in done]
    report = EvalReport(results_path=store.path, total=len(items), repaired=store.repaired, backup=store.backup)
    report.skipped = len(items) - len(pending)
    longest = max((len(row) for _, row in pending), default=1)
    budget, key = _plan_batches(run, report, batch_size, max_batch_size, len(pending), longest)
    try:
        _Loop(run, pending, store, report, budget, progress, on_result, failed).run()
    finally:
        remember(key, budget, run.max_new_tokens + longest)
    return report


def _check_arguments(model, tokenizer, max_new_tokens, max_batch_size, generation_kwargs) -> dict:
    """Validate what does not depend on the prompts; the generate kwargs (greedy by default)."""
    whole_number("max_new_tokens", max_new_tokens, error=EvalError)
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise EvalError(
            f"max_batch_size must be a positive int (the most prompts in one batch), got {max_batch_size!r}"
        )
    if generation_kwargs is not None and not isinstance(generation_kwargs, dict):
        raise EvalError(
            f"generation_kwargs must be a dict of model.generate arguments, e.g. "
            f"{{'temperature': 0.7, 'do_sample': True}}, got {type(generation_kwargs).__name__}"
        )
    gen_kwargs = {"do_sample": False, **(generation_kwargs or {})}
    check_generate_kwargs(gen_kwargs, EvalError)
    _check_own_kwargs(gen_kwargs)
    for reserved_kw in ("max_new_tokens", "input_ids", "attention_mask"):
        if reserved_kw in gen_kwargs:
            raise EvalError(f"pass {reserved_kw} as safe_generate's argument, not in generation_kwargs")
    if gen_kwargs.get("num_return_sequences", 1) not in (1, None):
        raise EvalError(
            f"generation_kwargs num_return_sequences={gen_kwargs['num_return_sequences']!r}: safe_generate records "
            "one output per prompt id. For several samples per prompt, repeat it under its own ids, e.g. "
            "[{'id': f'{i}#{k}', 'prompt': p} for k in range(2)], with generation_kwargs={'do_sample': True}"
        )
    if (
        not callable(getattr(model, "generate", None))
        or not callable(tokenizer)
        or not hasattr(tokenizer, "pad_token_id")
    ):
        raise EvalError(
            f"safe_generate(model, tokenizer, prompts) needs a causal LM and its tokenizer, got "
            f"{type(model).__name__} and {type(tokenizer).__name__}: pass them in that order, as "
            "helpers.load returns them (model, tokenizer, report)"
        )
    if tokenizer.pad_token_id is None:
        raise EvalError(
            "the tokenizer has no pad token: load with helpers.load, or call "
            "helpers.loading.loader.setup_tokenizer(tokenizer, model) first"
        )
    missing_row = token_ids_problem(model, tokenizer)
    if missing_row:
        raise EvalError(missing_row)
    return gen_kwargs


# generate() arguments that change what it returns (an object, not the token ids safe_generate records)
_RETURN_SHAPERS = ("return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                   "output_hidden_states")  # fmt: skip


def _check_own_kwargs(gen_kwargs: dict) -> None:
    """Refuse generate arguments that clash with the ones safe_generate passes itself, or that change what
    generate returns; each would fail inside the first batch with a library traceback."""
    for name, why in (
        ("pad_token_id", "safe_generate pads with the tokenizer's pad token: set tokenizer.pad_token_id instead"),
        ("tokenizer", "safe_generate passes its own tokenizer to generate (stop_strings need it): drop it"),
    ):
        if name in gen_kwargs:
            raise EvalError(f"generation_kwargs {name!r}: {why}")
    shaped = [k for k in _RETURN_SHAPERS if gen_kwargs.get(k)]
    if shaped:
        raise EvalError(
            f"generation_kwargs {', '.join(shaped)}: these make generate return scores or hidden states instead of "
            "token ids, and safe_generate records text; drop them (call model.generate yourself for scores)"
        )
    streamer = gen_kwargs.get("streamer")
    if streamer is not None and not (
        callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))
    ):
        raise EvalError(
            f"generation_kwargs streamer={streamer!r:.40}: a streamer is an object with put() and end(), e.g. "
            "transformers.TextStreamer(tokenizer); or pass stream=True to safe_generate"
        )
    config = gen_kwargs.get("generation_config")
    if config is not None:
        from transformers import GenerationConfig

        if not isinstance(config, GenerationConfig):
            raise EvalError(
                f"generation_kwargs generation_config={config!r:.40}: pass a transformers.GenerationConfig "
                "(e.g. GenerationConfig(do_sample=False)), or its settings themselves as generation_kwargs"
            )


def _check_results_arguments(results: Any, resume: Any) -> None:
    if isinstance(results, bytes) or not isinstance(results, str | os.PathLike) or not str(results).strip():
        raise EvalError(
            f"results must be the path of a JSONL file to append results to, e.g. 'eval_results.jsonl', got {results!r}"
        )
    if not (resume is True or resume is False or resume == "force"):
        raise EvalError(
            f"resume must be True (skip finished ids), False (start the file over) or 'force' (reuse results "
            f"even if made by another model or settings), got {resume!r}"
        )


def _check_context(items: list[dict], ids: list[list[int]], context: int | None) -> None:
    """Refuse (before any generation) prompts that leave no room for one new token in the context."""
    if context is None:
        return
    too_long = [
        (it["id"], len(row)) for it, row in zip(items, ids, strict=True) if new_tokens_room(context, len(row), 1) < 1
    ]
    if too_long:
        shown = ", ".join(f"{i} ({n} tokens)" for i, n in too_long[:5])
        raise EvalError(
            f"{len(too_long)} prompt(s) do not leave room for one new token in the model's "
            f"{context}-token context: {shown}. Shorten or drop them"
        )


def _refuse_input_as_results(prompts: Any, results: Path) -> None:
    """Never append to (or, with resume=False, empty) the prompt file itself."""
    if isinstance(prompts, str | os.PathLike) and results.exists():
        with contextlib.suppress(OSError):
            if os.path.samefile(prompts, results):
                raise EvalError(
                    f"results={str(results)!r} is the prompt file: safe_generate appends to results (and "
                    f"resume=False would empty it); pass another path, e.g. {str(results.with_suffix(''))!r} "
                    "+ '.results.jsonl'"
                )


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


_NO_EFFECT_ON_OUTPUT = {"streamer"}  # generate kwargs that only watch a generation


def _settings(model, max_new_tokens: int, gen_kwargs: dict) -> dict:
    """Every generation setting as JSON (objects by content; the model's own GenerationConfig too,
    since generate falls back on it): a resume reuses only results made with the same."""
    settings = {"max_new_tokens": max_new_tokens}
    for k, v in gen_kwargs.items():
        if k not in _NO_EFFECT_ON_OUTPUT:
            settings[k] = describe(v, f"generation_kwargs[{k!r}]")
    config = getattr(model, "generation_config", None)
    if config is not None:
        settings["model.generation_config"] = describe(config, "model.generation_config")
    return settings


def _context_mismatch(rec: dict, run: _Run) -> str | None:
    """Why the model or settings that made ``rec`` are not this run's (None when they are)."""
    changes = identity_changes(rec.get("model"), run.model_id)
    old = rec.get("settings") if isinstance(rec.get("settings"), dict) else {}
    for key in sorted(set(old) | set(run.settings), key=str):
        if _canon(old.get(key)) != _canon(run.settings.get(key)):
            changes.append(
                f"other settings: {key} {_canon(old.get(key))[:120]} (this run: {_canon(run.settings.get(key))[:120]})"
            )
    return "; ".join(changes) or None


def _same_prompt(rec: dict, item: dict) -> bool:
    if "prompt" in rec:
        return rec["prompt"] == item["prompt"]
    return rec.get("prompt_hash") == prompt_hash(item["prompt"])  # a record that kept only the hash


def _mismatches(done: dict[str, dict], items: list[dict], run: _Run) -> list[tuple[str, str]]:
    """(id, why) for each finished record this run would not have made. The model and settings are
    compared once per header (``made``), not once per record; files from before headers once per
    distinct pair (equal copies are one object once read)."""
    verdicts: dict[Any, str | None] = {run.made: None}
    problems = []
    for it in items:
        rec = done.get(it["id"])
        if rec is None:
            continue
        if not _same_prompt(rec, it):
            problems.append((it["id"], "another prompt text under the same id"))
            continue
        # a header's hash; else (the format before headers) the pair's objects, shared when equal (results_file)
        key = rec.get("made") or (id(rec.get("model")), id(rec.get("settings")))
        if key not in verdicts:
            verdicts[key] = _context_mismatch(rec, run)
        if verdicts[key]:
            problems.append((it["id"], verdicts[key]))
    return problems


def _check_reuse(done: dict[str, dict], items: list[dict], run: _Run, resume, path: Path) -> None:
    """Finished records are skipped only when this model, these settings and this prompt text made them."""
    problems = _mismatches(done, items, run)
    if not problems:
        return
    by_reason: dict[str, list[str]] = {}
    for i, why in problems:  # one model change affects every id: said once, not per id
        by_reason.setdefault(why, []).append(str(i))
    shown = "; ".join(
        f"id {', '.join(ids[:3])}{' ...' if len(ids) > 3 else ''}: {why}" for why, ids in list(by_reason.items())[:3]
    )[:1500]
    message = f"{path} holds results for {len(problems)} of these prompt ids made differently ({shown})"
    if resume == "force":
        warnings.warn(f"{message}; reused anyway (resume='force')", stacklevel=3)
        return
    raise EvalError(
        f"{message}: they would be reused as this run's. Pass results= a new file to keep both, "
        f"resume=False to redo {path.name} from scratch, or resume='force' to reuse them anyway"
    )


@dataclass
class _Run:
    """What every batch of one ``safe_generate`` call shares."""

    model: Any
    tokenizer: Any
    device: torch.device
    gen_kwargs: dict
    settings: dict
    max_new_tokens: int
    context: int | None
    scorer: tuple[str, Callable[[str, str], float]] | None
    stop: set[int] = field(default_factory=set)
    model_id: dict = field(default_factory=dict)
    made: str = ""  # the hash of settings and model identity the results file's header holds them under
    scored_by: str | None = None  # "<name>:<hash of the scorer's code>", kept with each score it gives
    stream: bool = False  # print the first batch's first answer as it is generated
    kv_cache: str | None = None  # the KV cache kind asked for: sizes the estimate's start and the cache key

    def __post_init__(self) -> None:
        self.stop = stop_token_ids(self.model, self.tokenizer)
        self.model_id = model_identity(self.model, self.tokenizer)
        self.made = made_hash(self.settings, self.model_id)

    def record(self, item: dict, prompt_tokens: int, new: int, **fields: Any) -> dict:
        """A result record's common fields (what made it, for which prompt) and ``fields``."""
        return {
            "id": item["id"],
            "prompt": item["prompt"],
            "reference": item["reference"],
            **fields,
            "prompt_tokens": prompt_tokens,
            "max_new_tokens": new,
            "settings": self.settings,  # written once in the file's header for "made" (results_file)
            "model": self.model_id,
            "made": self.made,
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }

    def cap(self, prompt_tokens: int) -> int:
        """New tokens a prompt of this length may get (the context may allow fewer than asked)."""
        return new_tokens_room(self.context, prompt_tokens, self.max_new_tokens)


def _plan_batches(
    run: _Run, report: EvalReport, batch_size, max_batch_size: int, pending: int, longest: int
) -> tuple[TokenBudget, tuple]:
    """The token budget the first batch starts from, and the cache key it is remembered under."""
    if run.device.type == "cuda":
        reset_peak_allocated("all")
    key = batch_cache_key(run.model, run.max_new_tokens, run.kv_cache)
    limit = max(1, min(max_batch_size, pending or 1))
    start, source = start_size(
        run.model, batch_size, key=key, prompt_tokens=longest, max_new_tokens=run.max_new_tokens, limit=limit,
        kv_cache=run.kv_cache,
    )  # fmt: skip
    budget = TokenBudget(start, limit)
    report.started_from = f"{start} ({source})"
    cached = remembered_batch(key) if batch_size == "auto" else None
    if cached is not None and cached.first_failed and not cached.limit_bound:  # a real OOM, not a search's limit
        # the bound a previous search (or run) found still holds unless memory got tighter
        seq0 = longest + run.max_new_tokens
        budget.ok, budget.fail = start * seq0, max(cached.first_failed, start + 1) * seq0
    return budget, key


class _Loop:
    """The batches of one run: longest prompts first, sizes from the token budget, OOMs retried."""

    def __init__(
        self, run: _Run, pending: list, store: ResultsFile, report: EvalReport, budget, progress, on_result, failed
    ):
        # longest first: the tightest batches come first, so memory limits are found early and
        # later (shorter) batches grow; similar lengths together waste little compute on padding
        self.pending = sorted(pending, key=lambda p: -len(p[1]))
        self.run_, self.store, self.report, self.budget = run, store, report, budget
        self.progress, self.on_result = progress, on_result
        self.failed_before: dict[str, dict] = failed  # failure records of earlier runs, by id
        self.i = 0
        self.single_retries = 0
        self.shrink_new: int | None = None  # fewer new tokens for a single prompt that does not fit
        self.streamed = not run.stream  # True once a streamed batch finished (or when none should stream)

    def run(self) -> None:
        from ..core.html import progress_bar  # keeps its bar in a narrow column

        self.bar = progress_bar(total=len(self.pending), desc="safe_generate", unit="sample", disable=not self.progress)
        self.started = time.perf_counter()
        self.peak = _memory(self.run_.device)
        try:
            while self.i < len(self.pending):
                batch, new, seq = self._next_batch()
                watch = Watch()  # the batch's input: alive after an OOM = the failed call is still pinned
                result = attempt(self._generate, batch, new, watch, watch=watch, device=self.run_.device)
                if result.ok:
                    self._after_success(batch, new, seq, result)
                else:
                    self._after_oom(len(batch), new, seq, result)
        finally:
            self.report.seconds = time.perf_counter() - self.started
            self.report.peak_memory = self.peak
            self.bar.close()

    def _next_batch(self) -> tuple[list, int, int]:
        """The next prompts, their new-token count and sequence length (prompt + new tokens)."""
        cap, pending, i = self.run_.cap, self.pending, self.i
        first_len = len(pending[i][1])
        new = cap(first_len)
        if self.shrink_new is not None:
            new = min(new, self.shrink_new)
        seq = first_len + new
        size = self.budget.size_for(seq) if self.shrink_new is None else 1
        batch = [pending[i]]
        # the same new-token budget for the whole batch (context-capped prompts go on their own)
        while len(batch) < size and i + len(batch) < len(pending) and cap(len(pending[i + len(batch)][1])) >= new:
            batch.append(pending[i + len(batch)])
        return batch, new, seq

    def _generate(self, batch: list, new: int, watch: Watch) -> Generated:
        run = self.run_
        streamer = {}
        if not self.streamed:  # until a batch succeeds: an OOM'd attempt's partial answer is streamed again
            streamer["streamer"] = first_prompt_streamer(run.tokenizer, "streaming the first batch's first answer:")
        return generate_batch(
            run.model,
            run.tokenizer,
            [row for _, row in batch],
            media=batch_media([it for it, _ in batch]),
            max_new_tokens=new,
            stop=run.stop,
            watch=watch,
            **streamer,
            **run.gen_kwargs,
        )

    def _after_oom(self, size: int, new: int, seq: int, result: Attempt) -> None:
        self.report.full_collections += result.collected
        self.report.cache_empties += 1
        if size == 1 and self.single_retries >= 1 and new <= 1:
            self._does_not_fit(result)  # not even one new token fits alone: recorded, the rest goes on
            return
        self.report.oom_retries += 1
        self.report.oom_timeline.append((time.perf_counter() - self.started, size))
        if size > 1:
            self.budget.after_oom(size, seq)
        elif self.single_retries < 1:
            self.single_retries += 1  # maybe a transient spike: try once more as is, the cache now empty
        else:
            self.shrink_new = new // 2  # it does not fit alone: fewer new tokens, recorded as truncated

    def _does_not_fit(self, result: Attempt) -> None:
        item, row = self.pending[self.i]
        rec = self.run_.record(item, len(row), 1, output=None, error="does not fit", detail=result.error)
        earlier = self.failed_before.get(item["id"])
        same = earlier is not None and _same_prompt(earlier, item) and _context_mismatch(earlier, self.run_) is None
        if same and earlier.get("error") == rec["error"]:
            self.report.failed_again += 1  # already on record, made the same way: one line per failure
        else:
            _write(self.store, [rec], self.report)
        self.report.failures.append(rec)
        self.i += 1
        self.single_retries, self.shrink_new = 0, None
        self.bar.update(1)

    def _after_success(self, batch: list, new: int, seq: int, result: Attempt) -> None:
        size = len(batch)
        self.streamed = True
        self.budget.after_success(size, seq)
        records = _records(self.run_, batch, result.value, new, result.elapsed, memory=self.shrink_new is not None)
        _write(self.store, records, self.report)
        report = self.report
        report.done += len(records)
        report.new_tokens += sum(r["new_tokens"] for r in records)
        report.truncated += sum(r["truncated"] for r in records)
        self.i += size
        self.single_retries, self.shrink_new = 0, None
        self._progress(size)
        if self.on_result is not None:
            for rec in records:
                self.on_result(rec)

    def _progress(self, size: int) -> None:
        device, report = self.run_.device, self.report
        report.batch_sizes.append(size)
        mem = _memory(device)
        self.peak = max(self.peak, mem)
        report.timeline.append((time.perf_counter() - self.started, size, mem))
        if _should_empty_cache(device):
            torch.cuda.empty_cache()
            report.cache_empties += 1
        self.bar.update(size)
        elapsed = time.perf_counter() - self.started
        self.bar.set_postfix_str(
            f"batch {size}, {report.new_tokens / max(elapsed, 1e-9):.0f} tok/s, {format_bytes(mem)}", refresh=False
        )


def _records(run: _Run, batch: list, gen: Generated, new: int, seconds: float, *, memory: bool) -> list[dict]:
    """The result records of one finished batch."""
    size = len(batch)
    records = []
    for (it, row), count, text in zip(batch, gen.new_tokens, gen.texts, strict=True):
        truncated = new < run.max_new_tokens
        rec = run.record(
            it,
            len(row),
            new,
            output=text,
            new_tokens=count,
            truncated=truncated,
            truncated_reason=("memory" if memory else "context") if truncated else None,
            batch_size=size,
            seconds=round(seconds / size, 6),
        )
        if run.scorer is not None and it["reference"] is not None:
            rec.update(score_fields(run.scorer, text, it["reference"]))  # a raising scorer loses no output
            rec["scored_by"] = run.scored_by
        records.append(rec)
    return records


def _write(store: ResultsFile, records: list[dict], report: EvalReport) -> None:
    """The whole batch goes to disk before anything else can interrupt (a callback, Ctrl-C)."""
    for k, rec in enumerate(records):
        try:
            store.append(rec, sync=False)  # flush each; fsync once per batch (they finished together)
            if k == len(records) - 1:
                store.sync()
        except OSError as e:
            raise ResultsWriteError(
                f"could not write the result for {rec['id']} to {store.path}: {e.strerror or e}. "
                f"{report.done + k} results of this run (and {report.skipped} earlier ones) are safe in "
                "the file; the unsaved ones are in this error's .unsaved. Free disk space or pick another "
                "results path, then rerun with resume=True: finished samples are skipped",
                records[k:],
            ) from e


def _finish(report: EvalReport, run: _Run, store: ResultsFile, items: list[dict]) -> None:
    """Peak memory, every record for these prompts (in prompt order) and the mean scores."""
    if run.device.type == "cuda":
        report.peak_memory = peak_allocated("all")  # a split model: its cards' peaks added up
        report.memory_kind = "GPU allocated"  # the report and its plot name the figure they show
        if torch.cuda.device_count() > 1:  # what to hold against one card's size
            report.peak_by_gpu = {d: peak_allocated(d) for d in range(torch.cuda.device_count())}
    finished = store.records  # read once at open(), then each appended record: no second read
    mine = [finished[it["id"]] for it in items if it["id"] in finished]
    for it, r in zip([it for it in items if it["id"] in finished], mine, strict=True):
        if r.get("reference") != it["reference"] and not r.get("error"):  # corrected since: its scores are stale
            r["reference"] = it["reference"]
            r.pop("score", None)
            r.pop("score_error", None)
    report.records = [r for r in mine if not r.get("error")]
    report.failures = [r for r in mine if r.get("error")]
    if run.scorer is not None:
        _score_unscored(report.records, run.scorer, run.scored_by)
        name = run.scorer[0]
        values = [r["score"][name] for r in report.records if name in (r.get("score") or {})]
        if values:
            report.scores[name], report.nonfinite_scores[name] = mean_of_finite(values)


def _scorer_id(scorer: tuple[str, Callable[[str, str], float]] | None) -> str | None:
    """``"<name>:<hash of the function's code, defaults, closure and globals>"``: a score made by another
    version of a same-named function is made again (None: no scorer; one that cannot be fingerprinted
    gets a hash of its name and id, so it rescores in each new process)."""
    if scorer is None:
        return None
    name, fn = scorer
    try:
        text = _canon(describe(fn, "score"))
    except FingerprintError:
        text = f"{name} {id(fn)} {os.getpid()}"
    return f"{name}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _score_unscored(
    records: list[dict], scorer: tuple[str, Callable[[str, str], float]], scored_by: str | None = None
) -> None:
    """Score (in the report) saved outputs this scorer has no score for: an earlier run's, ones it raised
    on, and ones another version of the scorer (same name, other code) scored; never generating again."""
    name = scorer[0]
    for r in records:
        if r.get("reference") is None:
            continue
        if name in (r.get("score") or {}) and (scored_by is None or r.get("scored_by") == scored_by):
            continue
        fields = score_fields(scorer, r["output"], r["reference"])
        errors = {k: v for k, v in (r.get("score_error") or {}).items() if k != name}
        stale = {k: v for k, v in (r.get("score") or {}).items() if k != name}  # another version's: replaced
        r["score"] = {**stale, **fields.get("score", {})}
        r["score_error"] = {**errors, **fields.get("score_error", {})}
        r["scored_by"] = scored_by
        for key in ("score", "score_error"):
            if not r[key]:
                del r[key]


def _raise_score_errors(report: EvalReport, scorer) -> None:
    """After the run (every output saved): the score function raised on some records."""
    name = scorer[0] if scorer is not None else None
    failed = [r for r in report.records if name in (r.get("score_error") or {})]
    if not failed:
        return
    first = failed[0]
    raise ScoreError(
        f"the score function {name!r} raised on {len(failed)} of {len(report.records)} samples (first, id "
        f"{first['id']}: {first['score_error'][name]}). Their outputs are saved in {report.results_path} with "
        "score_error; this error's .report holds the run. Fix the function and rerun with the same results "
        "file: nothing is generated again, the saved outputs are scored",
        report,
    )


# ----------------------------------------------------------------------------- scoring an output against its reference


def _norm(text: str) -> str:
    return " ".join(text.lower().split()).strip(" .!?")


def exact_match(output: str, reference: str) -> float:
    """1.0 when the output equals the reference (case, surrounding spaces and final punctuation ignored)."""
    return float(_norm(output) == _norm(reference))


def contains_reference(output: str, reference: str) -> float:
    """1.0 when the (normalized) reference appears in the output."""
    return float(_norm(reference) in _norm(output))


SCORERS: dict[str, Callable[[str, str], float]] = {"exact_match": exact_match, "contains": contains_reference}


def score_fields(scorer: tuple[str, Callable[[str, str], float]], output: str, reference: str) -> dict:
    """What scoring adds to a record: ``{"score": {name: value}}``, or ``{"score_error": {name: why}}``
    when the function raised or returned no number (the output is kept either way)."""
    name, fn = scorer
    try:
        return {"score": {name: float(fn(output, reference))}}
    except Exception as e:  # the caller's code: any error, kept with the record instead of losing the batch
        return {"score_error": {name: f"{type(e).__name__}: {e}"[:500]}}


def resolve_scorer(score) -> tuple[str, Callable[[str, str], float]] | None:
    """``score=`` as (name, function): a name in ``SCORERS``, a function (named by its ``__name__``), or None."""
    if score is None:
        return None
    if isinstance(score, str):
        if score not in SCORERS:
            raise EvalError(
                f"unknown score {score!r}: use one of {', '.join(SCORERS)} or a function(output, reference)"
            )
        return score, SCORERS[score]
    if callable(score):
        return getattr(score, "__name__", "score"), score
    raise EvalError("score must be None, a name in SCORERS, or a function(output, reference) -> float")
