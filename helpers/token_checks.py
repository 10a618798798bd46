"""Token ids the model has no embedding row for: a clear error before ``generate`` or ``Trainer`` raise a raw
``IndexError: index out of range in self`` from inside the embedding.

The usual cause: ``tokenizer.add_special_tokens({"pad_token": "[PAD]"})`` (advice found in many guides)
without ``model.resize_token_embeddings(len(tokenizer))``: the new id is one past the last row, and every
padded batch looks it up.
"""

from __future__ import annotations

__all__ = ["embedding_rows", "token_ids_problem"]


def embedding_rows(model) -> int | None:
    """The rows of the model's input embedding (the ids it can look up); None when it has none to read."""
    try:
        emb = model.get_input_embeddings()
        rows = getattr(emb, "num_embeddings", None) or emb.weight.shape[0]
    except (AttributeError, NotImplementedError, TypeError, IndexError):
        return None
    return int(rows) if isinstance(rows, int) and rows > 0 else None


def token_ids_problem(model, tokenizer) -> str | None:
    """Why the tokenizer's special tokens (pad, eos, bos) cannot be looked up in ``model``; None when they can."""
    rows = embedding_rows(model)
    if rows is None:
        return None
    for kind in ("pad", "eos", "bos"):
        tid = getattr(tokenizer, f"{kind}_token_id", None)
        if isinstance(tid, int) and not isinstance(tid, bool) and tid >= rows:
            token = getattr(tokenizer, f"{kind}_token", None)
            return (
                f"the tokenizer's {kind} token {token!r} is id {tid}, but the model's embedding has {rows} rows "
                f"(ids 0-{rows - 1}): the token was added to the tokenizer without resizing the model, and "
                "looking it up would fail inside the model. Call model.resize_token_embeddings(len(tokenizer)) "
                "after adding it (before preparing LoRA), or pad with a token the model has: "
                "tokenizer.pad_token = tokenizer.eos_token"
            )
    return None
