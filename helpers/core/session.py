"""Where the code runs: Colab or not, the IPython shell (if any), the namespace of the notebook that called us."""

from __future__ import annotations

import inspect
import os
import sys

from .arguments import namespace_dict

__all__ = ["ipython", "user_namespace", "caller_namespace", "in_colab", "enable_colab_widgets"]


def in_colab() -> bool:
    """True inside a Google Colab runtime."""
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def in_kaggle() -> bool:
    """True inside a Kaggle notebook session (where only /kaggle/working outlives the session)."""
    return "KAGGLE_KERNEL_RUN_TYPE" in os.environ


def enable_colab_widgets() -> bool:
    """Turn on Colab's custom widget manager; True when it was turned on.

    Colab's front end renders the ipywidgets it preinstalls (7.7) by itself, but ipywidgets 8 (and
    tqdm's bars built with it) only through this manager. ``import helpers`` calls it, so a progress
    bar renders whichever ipywidgets the runtime has, before any panel is built.
    """
    if not in_colab() or ipython() is None:  # a Colab subprocess (`!python`, a DDP worker) shows no widgets
        return False
    try:
        from google.colab import output

        output.enable_custom_widget_manager()
    except Exception:  # an old Colab image without the call: its built-in manager renders ipywidgets 7
        return False
    return True


def ipython():
    """The running IPython shell, or ``None`` (a script, or IPython not installed)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython ships with the notebook stack
        return None
    return get_ipython()


def user_namespace() -> dict:
    """The notebook's variables (IPython's ``user_ns``), or ``{}`` outside IPython."""
    ip = ipython()
    return ip.user_ns if ip is not None else {}


def caller_namespace(namespace: dict | None, depth: int = 2) -> dict:
    """``namespace`` if given, else the globals of whoever called the public function ``depth`` frames
    up; in a notebook that is IPython's ``user_ns`` (which ``Out`` and ``_5`` live in)."""
    if namespace is not None:
        return namespace_dict("namespace", namespace)
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back
        ns = frame.f_globals
    finally:
        del frame
    ip = ipython()
    if ip is not None and ns.get("__name__") == "__main__" and "get_ipython" in ns:
        return ip.user_ns
    return ns
