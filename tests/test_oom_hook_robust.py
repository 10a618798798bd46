"""The notebook OOM hook never dies and never hides (issue 31 item 4): an exception whose __str__ raises,
an ExceptionGroup holding an OOM, and a user's own custom exception handler."""

from __future__ import annotations

import sys

import pytest

from helpers.oom.hook import install, uninstall
from helpers.oom.messages import is_oom, oom_in


def test_an_exception_whose_str_raises_leaves_the_hook_installed(ipython_shell, capsys):
    assert install(ipython_shell)
    try:
        ipython_shell.run_cell(
            "class Nasty(MemoryError):\n    def __str__(self):\n        raise ValueError('no str')\nraise Nasty('x')"
        )
        capsys.readouterr()
        handler = ipython_shell.CustomTB
        assert MemoryError in ipython_shell.custom_exceptions  # IPython did not unregister it
        ipython_shell.run_cell("import torch\ntorch.empty(1 << 45)")
        out = capsys.readouterr()
        assert "Cause:" in out.out + out.err  # the next OOM is still diagnosed
        assert ipython_shell.CustomTB is handler
    finally:
        uninstall(ipython_shell)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="ExceptionGroup is Python 3.11+")
def test_an_exception_group_holding_an_oom_is_diagnosed(ipython_shell, capsys):
    oom = MemoryError("out of memory")
    group = ExceptionGroup("tasks", [ValueError("other"), ExceptionGroup("inner", [RuntimeError("x"), oom])])  # noqa: F821
    assert oom_in(group) is oom and is_oom(group)
    assert install(ipython_shell)
    try:
        ipython_shell.user_ns["group"] = group
        ipython_shell.run_cell("raise group")
        out = capsys.readouterr()
        assert "Cause:" in out.out + out.err and "Released what the traceback pinned" in out.out + out.err
    finally:
        uninstall(ipython_shell)


def test_a_users_own_handler_still_gets_its_exceptions(ipython_shell, capsys):
    seen = []

    def mine(shell, etype, value, tb, tb_offset=None):
        seen.append(etype)

    ipython_shell.set_custom_exc((KeyError,), mine)
    try:
        assert install(ipython_shell)
        ipython_shell.run_cell("raise KeyError('k')")
        assert seen == [KeyError]
        ipython_shell.run_cell("import torch\ntorch.empty(1 << 45)")
        assert "Cause:" in "".join(capsys.readouterr())
        uninstall(ipython_shell)
        assert ipython_shell.custom_exceptions == (KeyError,)
    finally:
        ipython_shell.set_custom_exc((), None)
