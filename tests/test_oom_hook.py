"""The notebook's OOM hook in place: the HTML card in the failing cell (text outside Jupyter), fixes
that name this notebook's knobs, "restart" for a CUDA error that breaks the context (never a
cleanup), a hook that survives its own failure, and a user's own handler kept working."""

from __future__ import annotations

import pytest

import helpers.oom.diagnosis as diagnosis
from helpers.core.knobs import KNOBS, knob_fixes, register_control, register_knob, smaller
from helpers.oom.diagnosis import explain_oom
from helpers.oom.hook import BrokenContext, broken_context, install, uninstall

STEADY = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 14.75 GiB of which 3.06 MiB "
    "is free. Including non-PyTorch memory, this process has 14.73 GiB memory in use. Of the allocated memory "
    "14.59 GiB is allocated by PyTorch, and 19.42 MiB is reserved by PyTorch but unallocated."
)
ILLEGAL = (
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported at "
    "some other API call, so the stacktrace below might be incorrect."
)


@pytest.fixture
def hooked(ipython_shell):
    assert install(ipython_shell)
    yield ipython_shell
    uninstall(ipython_shell)


def _out(capsys) -> str:
    out = capsys.readouterr()
    return out.out + out.err


def test_fixes_name_the_notebooks_knobs_with_a_value_to_try():
    report = explain_oom(STEADY, namespace={"MAX_NEW_TOKENS": 512, "BATCH_SIZE": 8, "LOAD": "fp16", "x": 1})
    assert report.cause == "steady_state"
    assert report.fixes[0].startswith("This notebook: set BATCH_SIZE = 4 (now 8) in the parameters cell")
    assert any("set MAX_NEW_TOKENS = 256 (now 512)" in f for f in report.fixes[:3])
    assert any("set LOAD = 'int8' (now 'fp16')" in f for f in report.fixes[:3])
    assert explain_oom(STEADY).fixes[0] == explain_oom(STEADY, namespace={}).fixes[0]  # a text: no knobs
    assert not any("This notebook" in f for f in explain_oom(STEADY).fixes)


def test_a_registered_name_and_control_are_used(monkeypatch):
    monkeypatch.setitem(KNOBS, "max_new_tokens", type(KNOBS["max_new_tokens"])("max_new_tokens", ["MAX_NEW_TOKENS"]))
    register_knob("max_new_tokens", "GEN_TOKENS")
    register_control("max_new_tokens", "the load panel's max_new_tokens slider")
    fixes = knob_fixes({"GEN_TOKENS": 300})
    assert fixes == [
        "This notebook: set GEN_TOKENS = 150 (now 300) in the parameters cell or the load panel's max_new_tokens "
        "slider, then rerun: a shorter KV cache"
    ]
    assert smaller("batch_size", 1) is None and smaller("load", "nf4") is None and smaller("micro_batch", True) is None


def test_the_hook_names_the_knob_in_the_failing_cell(hooked, capsys):
    hooked.run_cell("BATCH_SIZE = 16")
    hooked.run_cell(f"import torch\nraise torch.OutOfMemoryError({STEADY!r})")
    assert "set BATCH_SIZE = 8 (now 16)" in _out(capsys)


def test_in_jupyter_the_card_is_html_in_the_cell(hooked, capsys, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(hooked, "kernel", object(), raising=False)
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: shown.append(obj))
    hooked.run_cell("MAX_NEW_TOKENS = 512")
    hooked.run_cell(f"import torch\nraise torch.OutOfMemoryError({STEADY!r})")
    html = shown[0]["text/html"]
    assert "<ol>" in html and "MAX_NEW_TOKENS = 256" in html and "oomkit-table" in html
    out = _out(capsys)
    assert "First fix:" in out and "Fixes, in order" not in out  # the card holds the list; the traceback is short


@pytest.mark.parametrize(
    "message",
    [ILLEGAL, "CUDA error: device-side assert triggered", "CUDA error: unspecified launch failure"],
)
def test_a_broken_cuda_context_is_answered_with_restart_never_a_cleanup(hooked, capsys, monkeypatch, message):
    import helpers.oom.reclaim

    monkeypatch.setattr(helpers.oom.reclaim, "cleanup", lambda *a, **k: pytest.fail("cleanup on a broken context"))
    hooked.run_cell(f"raise RuntimeError({message!r})")
    out = _out(capsys)
    assert "Restart" in out and "Survives the restart" in out and "Drive" in out
    assert "Released what the traceback pinned" not in out


def test_broken_context_is_recognised_through_the_chain_and_in_colab_words():
    try:
        try:
            raise RuntimeError("CUDA error: device-side assert triggered")
        except RuntimeError as inner:
            raise ValueError("evaluation failed") from inner
    except ValueError as outer:
        assert broken_context(outer) == "device-side assert triggered"
    assert broken_context("CUDA out of memory. Tried to allocate 2.00 GiB") is None
    card = BrokenContext("illegal memory access", ILLEGAL, colab=True)
    assert "Restart: Runtime > Restart session" in str(card) and "<details>" in card._repr_html_()
    assert "&lt;x&gt;" in BrokenContext("illegal memory access", "<x>")._repr_html_()


def test_a_failing_hook_shows_the_error_and_stays_installed(hooked, capsys, monkeypatch):
    monkeypatch.setattr(diagnosis, "explain_oom", lambda *a, **k: 1 / 0)  # the hook imports it when an OOM comes
    hooked.run_cell("import torch\nraise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')")
    out = _out(capsys)
    assert "Tried to allocate 2.00 GiB" in out and "unregistering" not in out
    assert RuntimeError in hooked.custom_exceptions
    monkeypatch.undo()
    hooked.run_cell("import torch\nraise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')")
    assert "Fixes, in order" in _out(capsys)  # still on


def test_a_users_own_handler_is_chained_not_replaced(ipython_shell, capsys):
    seen = []

    def mine(shell, etype, value, tb, tb_offset=None):
        seen.append(str(value))
        return ["handled by mine"]

    ipython_shell.set_custom_exc((ValueError,), mine)
    try:
        assert install(ipython_shell)
        ipython_shell.run_cell("raise ValueError('bad row')")
        assert seen == ["bad row"]
        ipython_shell.run_cell(
            "import torch\nraise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')"
        )
        assert "Fixes, in order" in _out(capsys) and seen == ["bad row"]
        assert uninstall(ipython_shell)
        ipython_shell.run_cell("raise ValueError('after')")
        assert seen == ["bad row", "after"] and ipython_shell.custom_exceptions == (ValueError,)
    finally:
        ipython_shell.set_custom_exc((), None)


def test_a_panel_with_widgets_registers_its_controls_for_the_fixes(tiny_llama, monkeypatch):
    from helpers.core.knobs import Knob
    from helpers.panels.widgets import LoadPanel

    monkeypatch.setitem(KNOBS, "max_new_tokens", Knob("max_new_tokens", ["MAX_NEW_TOKENS"]))
    LoadPanel(str(tiny_llama), device="t4", widgets=True)
    assert KNOBS["max_new_tokens"].controls == ["the oomkit load panel's max_new_tokens slider"]
    assert "or the oomkit load panel's max_new_tokens slider" in knob_fixes({"MAX_NEW_TOKENS": 64})[0]
