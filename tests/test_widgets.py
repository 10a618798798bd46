"""The load panel, driven headless: set widget values in Python, check the plan, estimate and verdict."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import helpers.widgets as widgets_mod
from helpers.loading import LoadError
from helpers.widgets import LoadPanel, widgets_available

REPO = Path(__file__).resolve().parents[1]
BIG = "mistralai/Mistral-7B-v0.1"  # shipped config: works offline, only arithmetic


@pytest.fixture
def panel(tiny_llama):
    return LoadPanel(str(tiny_llama), load="nf4", max_new_tokens=64, prompt_tokens=32, widgets=True)


def test_controls_have_stable_labels_for_browser_tests(panel):
    c = panel.controls
    assert c["load"].description == "Load mode" and set(c["load"].options) == {
        "fp32",
        "fp16",
        "bf16",
        "int8",
        "nf4",
        "fp4",
    }
    assert c["double_quant"].description == "Double quant"
    assert c["max_new_tokens"].description == "max_new_tokens"
    assert c["batch_size"].description == "Batch size" and c["prompt_tokens"].description == "Prompt tokens"
    assert c["button"].description == "Load"
    assert "oomkit-verdict" in c["verdict"]._dom_classes and "oomkit-estimate" in c["estimate"]._dom_classes
    assert "oomkit-panel" in c["box"]._dom_classes and "oomkit-load" in c["button"]._dom_classes
    # small generation budgets are reachable on the slider
    s = c["max_new_tokens"]
    assert (s.min, s.max, s.step) == (16, 4096, 16)


def test_setting_widget_values_updates_plan_and_estimate(panel):
    c = panel.controls
    kv_64 = panel.state.estimate.row("kv_cache").bytes
    c["max_new_tokens"].value = 160
    assert panel.plan.max_new_tokens == 160
    kv_160 = panel.state.estimate.row("kv_cache").bytes
    assert kv_160 * (32 + 64) == kv_64 * (32 + 160)  # KV cache grows with prompt + new tokens
    c["batch_size"].value = 4
    assert panel.plan.batch_size == 4 and panel.state.estimate.row("kv_cache").bytes == 4 * kv_160
    nf4_weights = panel.state.estimate.weights
    c["load"].value = "int8"
    assert panel.plan.load == "int8" and panel.state.estimate.load == "int8"
    assert panel.state.estimate.weights > nf4_weights
    assert c["double_quant"].disabled  # only meaningful for 4-bit
    c["load"].value = "nf4"
    assert not c["double_quant"].disabled
    c["double_quant"].value = False
    # tiny layers: the nested state costs more than it saves; either way the estimate follows the checkbox
    assert panel.plan.double_quant is False and panel.state.estimate.weights != nf4_weights
    c["prompt_tokens"].value = 48
    assert panel.plan.prompt_tokens == 48
    # the widgets show the new numbers
    assert "KV cache" in c["estimate"].value and "data-verdict='fits'" in c["verdict"].value


def test_verdict_and_top_fix_follow_the_sliders():
    panel = LoadPanel(BIG, device="t4", load="fp16", batch_size=32, max_new_tokens=2048, widgets=True)
    assert panel.state.verdict == "does not fit"
    html = panel.controls["verdict"].value
    assert "data-verdict='does not fit'" in html and "Top fix" in html and panel.state.suggestion is not None
    assert panel.state.suggestion.saving > 0
    panel.set(load="nf4", batch_size=1, max_new_tokens=256)
    assert panel.state.verdict == "fits" and panel.state.suggestion is None
    assert "data-verdict='fits'" in panel.controls["verdict"].value
    assert panel.plan.load == "nf4" and panel.controls["load"].value == "nf4"


def test_device_size_is_shown_once():
    """A byte-count device has no name: the panel says its size once, a preset keeps its name."""
    from helpers.units import MiB

    panel = LoadPanel(BIG, device=15000 * MiB, load="nf4", widgets=True)
    s = panel.state
    for text in (s.verdict_text(), s.verdict_html(), s.bar_html(), panel.summary()):
        assert text.count("14.65 GiB") == 1, text
    assert "14.65 GiB (headroom" in s.verdict_text() and " on " not in s.verdict_text()
    named = LoadPanel(BIG, device="t4", load="nf4", widgets=False).state
    assert " on t4 (headroom" in named.verdict_text() and "(t4)</div>" in named.bar_html()
    assert " on t4 (headroom" in named.verdict_html()


def test_updates_are_cached_per_setting(panel):
    c = panel.controls
    first = panel.state
    assert not first.cached
    c["max_new_tokens"].value = 256
    c["max_new_tokens"].value = 64
    assert panel.state.cached and panel.state.estimate is first.estimate
    fresh = panel.compute(use_cache=False)
    assert fresh.estimate.total == first.estimate.total and fresh.estimate is not first.estimate


def test_set_rejects_unknown_and_invalid_values(panel):
    with pytest.raises(TypeError, match="unknown panel value"):
        panel.set(lora_rank=8)
    with pytest.raises(ValueError, match="valid: fp32, fp16"):
        panel.set(load="int3")
    assert panel.plan.load == "nf4"


def test_fallback_without_a_front_end_is_a_printed_summary(tiny_llama, capsys):
    assert not widgets_available()  # pytest: no kernel, so the default is the fallback
    panel = LoadPanel(str(tiny_llama), load="int8", max_new_tokens=8, batch_size=2)
    assert panel.controls is None
    assert panel.plan.load == "int8" and panel.plan.max_new_tokens == 8  # the parameters decide
    text = str(panel)
    assert "int8" in text and "FITS" in text and "parameters cell decides" in text
    bundle = panel._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"} and "data-verdict" in bundle["text/html"]
    panel.set(load="nf4")
    assert panel.plan.load == "nf4" and panel.state.estimate.load == "nf4"
    panel.show()
    assert "oomkit load panel" in capsys.readouterr().out


def test_fallback_when_ipywidgets_is_missing(tiny_llama, monkeypatch):
    monkeypatch.setattr(widgets_mod, "_ipywidgets", lambda: None)
    panel = LoadPanel(str(tiny_llama), widgets=True)
    assert panel.controls is None and "text/html" in panel._repr_mimebundle_()


def test_widget_bundle_keeps_a_text_summary(panel):
    bundle = panel._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"].startswith("oomkit load panel")


def test_widget_bundle_with_ipywidgets_7(panel, monkeypatch):
    """ipywidgets 7.7 (Colab's) widgets have no ``_repr_mimebundle_``: the view reference is built as 7.x
    sends it (was: AttributeError on display). The compat matrix's low environment runs this file on 7.7.1."""

    class Widget7:  # the parts of an ipywidgets 7 VBox that display uses
        _view_name = "VBoxView"
        model_id = "abc123"

        def __repr__(self):
            return "VBox(...)"

    monkeypatch.setitem(panel.controls, "box", Widget7())
    bundle = panel._repr_mimebundle_()
    assert bundle[widgets_mod.WIDGET_VIEW_MIME] == {"version_major": 2, "version_minor": 0, "model_id": "abc123"}
    assert bundle["text/plain"].startswith("oomkit load panel")


COLAB_OUTPUT = """
CALLS = []


def enable_custom_widget_manager():
    CALLS.append("enabled")
"""


def test_importing_helpers_in_colab_enables_the_widget_manager(tmp_path):
    """In Colab, ``import helpers`` (every notebook's first cell) turns on the custom widget manager, so
    tqdm's bars render before any panel exists; elsewhere it does nothing."""
    colab = tmp_path / "google" / "colab"
    colab.mkdir(parents=True)
    (tmp_path / "google" / "__init__.py").write_text("")
    (colab / "__init__.py").write_text("")
    (colab / "output.py").write_text(COLAB_OUTPUT)
    code = (
        "import sys; colab = '--colab' in sys.argv\n"
        "if colab: import google.colab\n"
        "if '--shell' in sys.argv:\n"
        "    from IPython.core.interactiveshell import InteractiveShell; InteractiveShell.instance()\n"
        "import helpers\n"
        "from google.colab import output\n"
        "print(output.CALLS, 'torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    env.pop("COLAB_RELEASE_TAG", None)

    def run(*args):
        return subprocess.run(
            [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()

    assert run("--colab", "--shell") == "['enabled'] False"  # and importing helpers still pulls no torch
    assert run("--colab") == "[] False"  # a Colab subprocess (`!python`, a DDP worker): no shell, no widgets
    assert run("--shell") == "[] False"


def test_load_button_loads_the_current_plan(panel):
    panel.set(load="int8")
    panel.controls["button"].click()
    assert panel.error is None and panel.report is not None
    assert panel.report.plan.load == "int8" and abs(panel.report.weights_error) <= 1.0
    assert panel.load() is panel.loaded  # the next cell reuses what the button loaded
    assert not panel.controls["button"].disabled


def test_sliders_after_load_reuse_the_model_and_a_new_mode_frees_the_old_one(panel):
    from helpers.estimator import footprint

    first, _, _ = panel.load()
    panel.set(max_new_tokens=128, batch_size=2)  # a generation budget: no reload
    assert panel.load()[0] is first and panel.plan.max_new_tokens == 128
    held = footprint(first)
    panel.set(load="int8")
    second, _, report = panel.load()
    assert second is not first and report.plan.load == "int8"
    assert footprint(first) < held / 10  # the nf4 weights were released before the int8 load


def test_load_button_with_a_bad_plan_keeps_the_panel_usable(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, '
        '"num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 64}'
    )
    panel = LoadPanel(str(tmp_path), load="fp32", widgets=True, adapter=str(tmp_path / "missing-adapter"))
    panel.controls["button"].click()  # no exception escapes the click handler
    assert isinstance(panel.error, LoadError) and "Adapter file not found" in str(panel.error)
    assert panel.loaded is None and not panel.controls["button"].disabled


def test_cpu_device_and_a_missing_model_path(tiny_llama):
    from helpers.estimator import EstimateError

    panel = LoadPanel(str(tiny_llama), device="cpu", load="fp32", widgets=False)  # was: TypeError on None
    assert panel.state.device == "CPU RAM" and panel.state.verdict == "fits"
    with pytest.raises(EstimateError, match="/no/such/model does not exist"):
        LoadPanel("/no/such/model", widgets=False)


def test_set_past_a_sliders_range_widens_it(panel):
    """set() beyond a slider's range widens the slider (as the constructor does) so widget and plan agree;
    it used to leave the slider at its end while the plan took the value."""
    panel.set(batch_size=128, max_new_tokens=8000)
    c = panel.controls
    assert (c["batch_size"].value, c["max_new_tokens"].value) == (128, 8000) == (panel.plan.batch_size, 8000)
    c["prompt_tokens"].value = 64  # another move keeps both
    assert panel.plan.batch_size == 128 and panel.plan.max_new_tokens == 8000
