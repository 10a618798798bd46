"""The load panel, driven headless: set widget values in Python, check the plan, estimate and verdict."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import helpers.panels.widgets as widgets_mod
from helpers.core.devices import DEVICES
from helpers.core.errors import LoadError
from helpers.panels.widgets import LoadPanel, widgets_available

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


def test_sliders_shrink_to_the_output_so_their_values_stay_readable(panel):
    """A fixed width pushed the readout past a 760 px window's edge (tests/test_browser.py measures it)."""
    for key in ("max_new_tokens", "batch_size", "prompt_tokens"):
        layout = panel.controls[key].layout
        assert (layout.width, layout.max_width) == ("100%", "480px")


def test_the_panels_shrink_to_a_narrow_column(panel):
    """Under ipywidgets 7.7 a fixed-width bar (420 px) or a dropdown and checkbox side by side (300 px
    each) set the panel's narrowest width, and JupyterLab widened the output past a 420 px column with
    it, cutting off every slider value (tests/test_browser.py measures it with the file browser open)."""
    import re

    fixed = re.compile(r"(?<![-\w])width:\s*(\d+)px")  # a pixel ``width``, not a ``max-width``/``min-width``
    for html in (panel.controls["estimate"].value, panel.controls["verdict"].value):
        wide = [int(px) for px in fixed.findall(html) if int(px) > 100]  # a mark of a few px does no harm
        assert html and not wide, wide
    rows = [r for r in panel.controls["box"].children if hasattr(r, "children") and r.children]
    assert panel.controls["double_quant"] in rows[0].children
    assert all(r.layout.flex_flow == "row wrap" for r in rows)
    assert panel.controls["double_quant"].layout.width == "auto"
    assert panel.controls["load"].layout.max_width == "100%"


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
    from helpers.core.units import MiB

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
    with pytest.raises(ValueError, match="unknown load mode .*; use nf4"):
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


@pytest.mark.bnb
def test_load_button_loads_the_current_plan(panel):
    panel.set(load="int8")
    panel.controls["button"].click()
    assert panel.error is None and panel.report is not None
    assert panel.report.plan.load == "int8" and abs(panel.report.weights_error) <= 1.0
    assert panel.load() is panel.loaded  # the next cell reuses what the button loaded
    assert not panel.controls["button"].disabled


@pytest.mark.bnb
def test_sliders_after_load_reuse_the_model_and_a_new_mode_frees_the_old_one(panel):
    from helpers.estimator.footprint import footprint

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
    from helpers.estimator.rows import EstimateError

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


# -- several GPUs: one bar per GPU ------------------------------------------------------------------
# The panel places a plan as load() does on such a machine: on GPU 0 alone when it fits there (the
# other cards stay free), split with plan_devices when it does not, or across the GPUs asked for (gpus=).

SPLIT_FP16 = {"load": "fp16", "gpus": 2}  # 7B fp16 split across Kaggle's two T4s


def test_a_split_shows_one_bar_per_gpu_and_where_the_layers_go():
    """7B in fp16 split across Kaggle's two T4s: two bars whose weights add up to the whole-model
    estimate, the layer runs in the verdict, and the note that a split is not faster."""
    panel = LoadPanel(BIG, device="kaggle-2xt4", widgets=True, **SPLIT_FP16)
    s, c = panel.state, panel.controls
    assert isinstance(s, widgets_mod.SplitState) and panel.placement is s.placement
    gpus = panel.placement.gpus
    assert len(gpus) == 2 and [g.capacity for g in gpus] == [DEVICES["t4"]["capacity"]] * 2
    single = LoadPanel(BIG, device="t4", load="fp16", widgets=False).state.estimate
    assert sum(g.weights for g in gpus) == s.estimate.weights == single.weights
    assert s.verdict == "fits" and panel.device_label == "kaggle-2xt4" and panel.plan.gpus == 2
    bars = c["estimate"].value
    assert bars.count("class='oomkit-gpu-bar'") == 2 and "data-gpu='0'" in bars and "data-gpu='1'" in bars
    assert "GPU 0: t4, layers 0-15: total" in bars and "GPU 1: t4, layers 16-31: total" in bars
    verdict = c["verdict"].value
    assert "data-verdict='fits'" in verdict and "data-gpus='2'" in verdict
    assert "across 2 GPUs (kaggle-2xt4): layers 0-15 on GPU 0, 16-31 on GPU 1" in verdict
    assert "do not generate faster" in verdict and "Top fix" not in verdict
    # the layer runs the panel names are the device map from_pretrained(device_map="auto") gets
    dm = panel.placement.device_map
    assert {dm[f"model.layers.{i}"] for i in range(16)} == {0}
    assert {dm[f"model.layers.{i}"] for i in range(16, 32)} == {1}


def test_a_plan_that_fits_gpu_0_stays_there_as_load_keeps_it():
    """gpus='auto' (None): a plan that fits one T4 is judged on GPU 0 alone, GPU 1 drawn free, as load()
    places it; the GPUs dropdown splits it; a plan too big for GPU 0 splits by itself."""
    panel = LoadPanel(BIG, device="kaggle-2xt4", load="nf4", widgets=True)
    s, c = panel.state, panel.controls
    assert isinstance(s, widgets_mod.FirstGpuState) and panel.placement is None and s.verdict == "fits"
    assert s.capacity == DEVICES["t4"]["capacity"] and s.headroom == s.capacity - s.estimate.total
    bars = c["estimate"].value
    assert bars.count("class='oomkit-gpu-bar'") == 2 and "GPU 1: t4: free (14.74 GiB)" in bars
    text = s.verdict_text()
    assert text.startswith("FITS on GPU 0 alone (kaggle-2xt4): ")
    assert "GPU 1 stays free (for a second model, or DDP); gpus=2 splits the model across both" in text
    assert "GPU 0: t4: the whole model" in str(panel) and "GPU 1: t4: free" in str(panel)
    gpus = c["gpus"]
    assert (
        gpus.description == "GPUs" and gpus.value is None and list(gpus.options) == [("auto", None), ("1", 1), ("2", 2)]
    )
    gpus.value = 2
    assert panel.plan.gpus == 2 and isinstance(panel.state, widgets_mod.SplitState)
    gpus.value = None
    panel.set(load="fp16", batch_size=16, max_new_tokens=2048)  # 20 GB: not one T4
    assert isinstance(panel.state, widgets_mod.SplitState) and panel.state.verdict == "fits"
    with pytest.raises(ValueError, match="gpus=3: the panel's device has 2 GPUs"):
        panel.set(gpus=3)
    assert "gpus" not in LoadPanel(BIG, device="t4", widgets=True).controls  # one GPU: no such control


def test_gpus_1_that_does_not_fit_says_the_split_would():
    panel = LoadPanel(BIG, device="kaggle-2xt4", load="fp16", batch_size=16, max_new_tokens=2048, gpus=1)
    s = panel.state
    assert isinstance(s, widgets_mod.FirstGpuState) and s.verdict == "does not fit" and s.suggestion is not None
    assert "GPU 1 stays free (gpus=1)" in s.verdict_text()
    assert s.alternative is not None and s.alternative.placement.fits
    assert "Would fit split across 2 GPUs with gpus=2: layers 0-15 on GPU 0, 16-31 on GPU 1" in s.verdict_text()
    html = s.verdict_html()
    assert "DOES NOT FIT</b> on GPU 0 alone" in html and "with gpus=2: layers 0-15" in html


def test_the_text_form_has_a_line_per_gpu():
    panel = LoadPanel(BIG, device="kaggle-2xt4", **SPLIT_FP16)
    lines = [line.strip() for line in str(panel).splitlines()]
    gpu_lines = [line for line in lines if line.startswith("GPU ")]
    assert len(gpu_lines) == 2
    assert gpu_lines[0].startswith("GPU 0: t4, layers 0-15: weights 6.74 GiB, KV cache 48.00 MiB, activations")
    assert gpu_lines[1].startswith("GPU 1: t4, layers 16-31: weights 6.74 GiB")
    assert all(line.endswith("of 14.74 GiB (fits)") for line in gpu_lines)
    assert any(line.startswith("FITS across 2 GPUs (kaggle-2xt4): layers 0-15 on GPU 0") for line in lines)
    assert any("note: " in line and "do not generate faster" in line for line in lines)
    assert repr(panel) == str(panel) and "parameters cell decides" in str(panel)
    html = panel._repr_mimebundle_()["text/html"]
    assert html.count("oomkit-gpu-bar") == 2 and "data-verdict='fits'" in html


def test_a_split_that_does_not_fit_names_a_fix_checked_as_load_would_place_it():
    """Batch 32 x 4096 tokens: the KV cache pushes layers off the GPUs. The top fix is one that places as
    fitting (not only the two cards' memory added up), and set(**fix.kwargs) applies it."""
    panel = LoadPanel(BIG, device="kaggle-2xt4", load="fp16", batch_size=32, max_new_tokens=4096, widgets=True)
    s = panel.state
    assert s.verdict == "does not fit" and not panel.placement.fits
    assert s.fix is not None and s.fix.result in ("fits", "tight") and s.fix.placement.fits and s.fix.kwargs
    verdict = panel.controls["verdict"].value
    assert "data-verdict='does not fit'" in verdict and f"Top fix: <b>{s.fix.change} (then " in verdict
    assert "no room on the GPUs for" in panel.controls["estimate"].value  # the layers that found no GPU
    assert "no room on the GPUs for" in str(panel)
    panel.set(**s.fix.kwargs)
    assert panel.state.verdict == s.fix.result and panel.placement is s.fix.placement  # planned once
    panel.set(load="fp32", batch_size=1, max_new_tokens=256)  # 28 GB of weights, 29.5 GB of T4s
    assert panel.state.verdict == "does not fit" and panel.state.fix.kwargs == {"load": "fp16"}
    # in fp16 it fits one T4 (tightly), so load() would keep it on GPU 0
    assert "Top fix: load=fp16 (then fits across 2 GPUs)" in panel.state.verdict_text()  # tight on one: split


def test_a_fix_no_candidate_confirms_is_the_placements_advice_escaped(monkeypatch):
    """When none of the estimator's fixes places as fitting, the top fix is plan_devices' own advice, and
    its text (quotes included) is escaped in the HTML."""

    class NoFixes:
        suggestions = []

    monkeypatch.setattr(widgets_mod, "fit_one_card", lambda est, device: NoFixes())
    panel = LoadPanel(BIG, device="kaggle-2xt4", load="fp32", widgets=True)
    fix = panel.state.fix
    assert fix.kwargs == {} and fix.result is None and fix.change == panel.placement.fixes[0]
    assert "load='fp16'" in fix.change and "load='fp16'" in panel.state.verdict_text()
    html = panel.controls["verdict"].value
    assert "load=&#x27;fp16&#x27;" in html and "load='fp16'" not in html


def test_lists_and_dicts_of_gpus_split_as_the_named_set_does():
    from helpers.core.units import GiB

    named = LoadPanel(BIG, device="kaggle-2xt4", **SPLIT_FP16).placement
    listed = LoadPanel(BIG, device=["t4", "t4"], **SPLIT_FP16)
    assert [g.total for g in listed.placement.gpus] == [g.total for g in named.gpus]
    assert "FITS across 2 GPUs: layers" in listed.state.verdict_text()  # no label that only repeats the count
    by_size = LoadPanel(BIG, device={0: 12 * GiB, 1: 12 * GiB}, load="fp16")  # 14 GB: not one 12 GB card
    assert [g.capacity for g in by_size.placement.gpus] == [12 * GiB] * 2
    one = LoadPanel(BIG, device=["t4"], load="nf4").state
    assert isinstance(one, widgets_mod.FirstGpuState) and one.free == [] and one.verdict == "fits"


def test_slider_moves_plan_each_setting_once(monkeypatch):
    calls = []
    real = widgets_mod.decide_placement
    monkeypatch.setattr(widgets_mod, "decide_placement", lambda *a, **k: calls.append(a) or real(*a, **k))
    panel = LoadPanel(BIG, device="kaggle-2xt4", load="nf4", gpus=2, widgets=True)
    first = panel.placement
    slider = panel.controls["max_new_tokens"]
    for value in (512, 1024, 256, 512, 1024, 256):
        slider.value = value
    assert len(calls) == 3 and panel.placement is first and panel.state.cached
    plan = panel.plan.replace(max_new_tokens=1024)
    longer = panel.decision_for(plan, panel.estimate_plan(plan)).plan
    assert [g.kv_cache for g in first.gpus] != [g.kv_cache for g in longer.gpus]


def test_current_with_two_gpus_splits_and_escapes_their_names(fake_gpus):
    hostile = "Tesla T4 <img src=x onerror=alert(1)>"
    fake_gpus(2, DEVICES["t4"]["capacity"], name=hostile)
    panel = LoadPanel(BIG, device="current", load="fp16", batch_size=16, max_new_tokens=2048, widgets=True)
    assert isinstance(panel.state, widgets_mod.SplitState) and len(panel.placement.gpus) == 2
    assert panel.state.verdict == "fits" and "across 2 GPUs (this machine)" in panel.state.verdict_text()
    assert hostile in str(panel)  # the text form shows the name as the driver reports it...
    for html in (panel.controls["estimate"].value, panel.controls["verdict"].value):
        assert "<img" not in html  # ...the HTML never as markup
    assert "&lt;img src=x onerror=alert(1)&gt;" in panel.controls["estimate"].value
    panel.set(load="nf4", batch_size=1, max_new_tokens=256)  # fits GPU 0: its name is escaped there too
    assert isinstance(panel.state, widgets_mod.FirstGpuState)
    assert "<img" not in panel.controls["estimate"].value and "&lt;img" in panel.controls["estimate"].value


def test_current_with_one_gpu_keeps_the_single_bar(fake_gpus):
    fake_gpus(1, DEVICES["t4"]["capacity"])
    panel = LoadPanel(BIG, device="current", load="nf4", widgets=False)
    assert type(panel.state) is widgets_mod.PanelState and panel.placement is None
    assert panel.state.capacity == DEVICES["t4"]["capacity"]
    # a card reporting a T4's capacity to the byte is a T4: its hint names Kaggle's pair
    assert widgets_mod.multi_gpu_set("current") == "kaggle-2xt4"
    panel.set(load="fp16", batch_size=32, max_new_tokens=2048)
    assert panel.state.verdict == "does not fit" and panel.state.alternative.how == "device='kaggle-2xt4'"


def test_one_gpu_that_does_not_fit_says_whether_its_multi_gpu_set_would():
    """A Colab T4 user whose plan does not fit hears that Kaggle's 2xT4 would hold it (split), and how to ask."""
    assert widgets_mod.multi_gpu_set("t4") == "kaggle-2xt4" and widgets_mod.multi_gpu_set("L4") == "2xl4"
    assert widgets_mod.multi_gpu_set("a100-80") == "2xa100-80"  # the smallest set of that GPU
    assert widgets_mod.multi_gpu_set("rtx3090") is None and widgets_mod.multi_gpu_set(16 * 2**30) is None
    panel = LoadPanel(BIG, device="t4", load="fp16", batch_size=32, max_new_tokens=2048, widgets=True)
    alt = panel.state.alternative
    assert panel.state.verdict == "does not fit" and alt is not None and alt.how == "device='kaggle-2xt4'"
    assert alt.placement.fits and panel.placement is None  # a hint: the panel still judges one T4
    hint = "Would fit split across 2 GPUs with device='kaggle-2xt4': layers 0-15 on GPU 0, 16-31 on GPU 1"
    assert hint in panel.state.verdict_text() and hint in str(panel)
    html = panel.controls["verdict"].value
    assert "class='oomkit-alternative'" in html and "device=&#x27;kaggle-2xt4&#x27;" in html
    panel.set(load="fp32", max_new_tokens=4096)  # too big for two T4s as well: no hint
    assert panel.state.verdict == "does not fit" and panel.state.alternative is None
    panel.set(load="nf4", batch_size=1, max_new_tokens=256)  # fits one T4: no hint
    assert panel.state.alternative is None and "Would fit" not in panel.controls["verdict"].value


def test_a_t4_panel_does_not_call_fitting_what_load_would_refuse_as_an_offload(tmp_path):
    """A 13B int8 estimate fits a T4, but the placement from_pretrained computes leaves layers for the CPU:
    load() refuses it, so the panel says does not fit, and why, in its text and HTML."""
    from helpers.placement.device_plan import reference_configs

    reference_configs()["Llama-2-13b"].save_pretrained(tmp_path)  # a config-only folder: nothing to download
    panel = LoadPanel(str(tmp_path), device="t4", load="int8", widgets=True)
    assert panel.state.verdict == "does not fit"
    assert "leaves" in str(panel.state.alternative) and "load='nf4'" in str(panel.state.alternative)
    assert "load() refuses it" in panel.controls["verdict"].value
    panel.set(load="nf4")
    assert panel.state.verdict == "fits" and panel.state.alternative is None


def test_gpus_1_on_two_cards_refuses_what_load_would_refuse_as_an_offload():
    panel = LoadPanel("Qwen/Qwen2.5-7B", device="kaggle-2xt4", load="fp16", gpus=1, widgets=False)
    assert panel.state.verdict == "does not fit" and "load() refuses it" in str(panel.state.alternative)


def test_a_panel_given_a_config_object_says_how_to_pass_it():
    from helpers.placement.device_plan import reference_configs

    with pytest.raises(TypeError, match="save_pretrained"):
        LoadPanel(reference_configs()["Llama-2-7b"], device="t4", widgets=False)


# -- the KV cache kind: a control like the others ---------------------------------------------------


def test_kv_cache_dropdown_changes_the_estimate_and_the_plan():
    from helpers.loading.plan import LoadPlan

    kw = dict(load="nf4", batch_size=8, max_new_tokens=4096, prompt_tokens=4096)
    panel = LoadPanel(BIG, device="t4", widgets=True, **kw)
    c = panel.controls
    assert c["kv_cache"].description == "KV cache" and panel.plan.kv_cache == "dynamic"
    assert [v for _, v in c["kv_cache"].options] == ["dynamic", "fp8", "int4", "int2", "offload"]
    dynamic = panel.state.estimate
    c["kv_cache"].value = "offload"
    assert panel.plan.kv_cache == "offload" and panel.state.estimate.load == "nf4"
    want = LoadPlan(BIG, kv_cache="offload", **kw).estimate("t4")
    assert panel.state.estimate.total == want.total < dynamic.total
    assert panel.state.estimate.row("kv_cache").bytes < dynamic.row("kv_cache").bytes
    assert "offloaded: +" in c["notes"].value  # the cache in RAM, and what it costs per token
    panel.set(kv_cache="dynamic")
    assert panel.state.cached and panel.state.estimate is dynamic
    assert LoadPanel(BIG, device="t4", kv_cache="offload", widgets=False).plan.kv_cache == "offload"


def test_a_kv_cache_that_cannot_run_here_says_why(tiny_llama, monkeypatch):
    import helpers.core.reducers as reducers

    real = reducers.installed
    monkeypatch.setattr(reducers, "installed", lambda m: False if m in ("optimum.quanto", "hqq") else real(m))
    panel = LoadPanel(str(tiny_llama), device="t4", load="nf4", widgets=True)
    labels = {v: label for label, v in panel.controls["kv_cache"].options}
    assert labels["int4"] == "int4 (not here)" and labels["dynamic"] == "dynamic"
    assert panel.controls["notes"].value == ""
    panel.controls["kv_cache"].value = "int4"  # estimated all the same, with the reason beside it
    assert panel.plan.kv_cache == "int4" and panel.state.estimate.row("kv_cache.residual") is not None
    assert "needs optimum-quanto or hqq" in panel.controls["notes"].value and "optimum-quanto" in str(panel)
    cpu = LoadPanel(str(tiny_llama), device="cpu", load="fp32", kv_cache="offload", widgets=False)
    assert "there is no CUDA GPU here" in str(cpu)  # compared with this machine's RAM: nothing to offload to


def test_kv_cache_on_a_split_says_the_split_plans_the_default_cache():
    panel = LoadPanel(BIG, device="kaggle-2xt4", widgets=False, **SPLIT_FP16)
    panel.set(kv_cache="fp8")
    assert panel.placement is not None and widgets_mod.NOT_SPLIT in str(panel)


def test_reducers_table_prices_each_kv_cache_kind():
    panel = LoadPanel(BIG, device="t4", load="nf4", batch_size=4, max_new_tokens=4096, widgets=False)
    table = panel.reducers()
    totals = {change: est.total for change, est, _ in table.rows}
    assert list(totals) == [f"kv_cache={k}" for k in ("dynamic", "fp8", "int4", "int2", "offload")]
    assert totals["kv_cache=dynamic"] == panel.state.estimate.total > totals["kv_cache=fp8"] > totals["kv_cache=int4"]
    assert "PCIe" in str(table) and "<table" in table._repr_html_()
