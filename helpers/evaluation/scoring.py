"""Scoring an output against its reference: ``exact_match``, ``contains_reference``, or a function of the caller's.

``SCORERS`` names the built-in ones (``safe_generate(score="exact_match")``); ``resolve_scorer``
turns what ``score=`` was given into a (name, function) pair.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.errors import EvalError

__all__ = ["exact_match", "contains_reference", "SCORERS", "resolve_scorer", "score_fields"]


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
