"""CUDA errors that leave the CUDA context unusable, and what to do: restart, not clean up.

After a device-side assert, an illegal memory access or a launch failure every later CUDA call in
the process fails with the same error, so ``cleanup()``, ``empty_cache()`` or a retry cannot help:
only a new process can. :func:`broken_context` recognises such an error; :class:`BrokenContext`
says so, names the menu that restarts (Colab's "Runtime > Restart session", Jupyter's "Kernel >
Restart Kernel") and what survives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

__all__ = ["BROKEN_SIGNATURES", "BrokenContext", "broken_context"]

# lower-case message fragments, each with what it means
BROKEN_SIGNATURES: dict[str, str] = {
    "device-side assert triggered": "a kernel's assert failed (often an index out of range: a token id past "
    "the vocabulary, a label outside the classes)",
    "illegal memory access": "a kernel read or wrote memory it does not own",
    "unspecified launch failure": "a kernel crashed while running",
    "misaligned address": "a kernel accessed memory at a misaligned address",
    "illegal instruction": "a kernel ran an illegal instruction",
    "cudaerrorlaunchfailure": "a kernel crashed while running",
}

SURVIVES = (
    "files: Google Drive, and /content or the working folder (a restart keeps the disk; only "
    "'Disconnect and delete runtime' wipes it), so saved checkpoints, adapters and eval results written "
    "with safe_generate stay"
)
LOST = "every variable, the loaded model and anything not yet written to a file"


def broken_context(error: BaseException | str) -> str | None:
    """The signature ``error`` (or its text, or an exception in its chain) matches, or None."""
    seen, current = set(), error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = (current if isinstance(current, str) else str(current)).lower()
        hit = next((s for s in BROKEN_SIGNATURES if s in text), None)
        if hit is not None:
            return hit
        if isinstance(current, str):
            return None
        current = current.__cause__ or current.__context__
    return None


@dataclass
class BrokenContext:
    """What a CUDA error that breaks the context means, and the restart that is the only way out."""

    signature: str
    message: str
    colab: bool = False

    @property
    def menu(self) -> str:
        return (
            "Runtime > Restart session" if self.colab else "Kernel > Restart Kernel (Colab: Runtime > Restart session)"
        )

    def lines(self) -> list[str]:
        return [
            f"CUDA error: {BROKEN_SIGNATURES[self.signature]}. This process's CUDA context is now unusable: "
            "every later GPU call fails the same way, so a cleanup or retry cannot help.",
            f"Restart: {self.menu}, then rerun the notebook from the top.",
            f"Survives the restart: {SURVIVES}.",
            f"Lost: {LOST}.",
            "To find the line at fault, rerun with CUDA_LAUNCH_BLOCKING=1 set in the first cell (errors are "
            "reported asynchronously, so this traceback may point past it).",
        ]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        first, *rest = self.lines()
        items = "".join(f"<li>{escape(line)}</li>" for line in rest)
        return (
            "<div class='oomkit-broken-cuda' style='font-family:monospace'>"
            f"<b>{escape(first)}</b><ul>{items}</ul>"
            f"<details><summary>message</summary><pre>{escape(self.message[:2000])}</pre></details></div>"
        )
