"""The load panel's Load button on an out-of-memory error shows the OOM card the notebook's handler shows
(explain_oom's OOMReport, its fixes naming the panel's controls), not one line; other errors stay one line."""

from __future__ import annotations

import pytest
import torch

OOM_TEXT = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 14.74 GiB of which 1.02 GiB "
    "is free. Of the allocated memory 12.10 GiB is allocated by PyTorch"
)


@pytest.fixture
def shown(monkeypatch):
    """What the Load button displays or prints (outside a kernel the Output widget passes both through)."""
    import IPython.display

    out: list = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: out.extend(objs))
    monkeypatch.setattr("builtins.print", lambda *a, **kw: out.append(" ".join(map(str, a))))
    return out


def panel_whose_load_raises(tiny_llama, error: BaseException):
    from helpers.panels.widgets import LoadPanel

    pytest.importorskip("ipywidgets")
    panel = LoadPanel(str(tiny_llama), device="t4", widgets=True)

    def load(**kwargs):
        panel.error = error
        raise error

    panel.load = load
    return panel


def test_an_oom_on_load_shows_the_oom_card(tiny_llama, shown, ipython_shell):
    from helpers.oom.diagnosis import OOMReport

    ipython_shell.user_ns["MAX_NEW_TOKENS"] = 256  # the notebook's knob, which the panel's slider also sets
    panel = panel_whose_load_raises(tiny_llama, torch.OutOfMemoryError(OOM_TEXT))
    panel.controls["button"].click()
    cards = [o for o in shown if isinstance(o, OOMReport)]
    assert len(cards) == 1, shown
    text = str(cards[0])
    assert "Out of memory on GPU 0" in text and "Fixes, in order" in text
    # the notebook's knob first, with the panel's control that sets it (as the cell's own OOM card names them)
    assert "MAX_NEW_TOKENS = 128" in text and "the oomkit load panel's max_new_tokens slider" in text
    assert not any(isinstance(o, str) and o.startswith("Not loaded") for o in shown)
    assert not panel.controls["button"].disabled  # the panel stays usable


def test_another_error_on_load_stays_one_line(tiny_llama, shown):
    panel = panel_whose_load_raises(tiny_llama, ValueError("the folder has no weights"))
    panel.controls["button"].click()
    lines = [o for o in shown if isinstance(o, str) and o.startswith("Not loaded")]
    assert lines == ["Not loaded (ValueError): the folder has no weights"], shown
