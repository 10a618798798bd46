"""Where the code runs: the IPython shell (if any) and the namespace of the notebook that called us."""

from __future__ import annotations

import inspect

__all__ = ["ipython", "user_namespace", "caller_namespace"]


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
        return namespace
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
