"""A load that stayed unquantized says so (issue 44 item 7): notebook 05 on a CPU device map reported its fp32
weights "as nf4 ... +145.83 %" (bitsandbytes leaves the layers a device map puts on the CPU unquantized)."""

from __future__ import annotations

import pytest

from helpers.loading.fingerprint import loaded_mode
from helpers.loading.loader import load
from helpers.loading.plan import LoadPlan
from helpers.loading.report import LoadReport
from helpers.placement.device_plan import plan_devices


@pytest.fixture(scope="module")
def cpu_map_nf4(tiny_llama):
    split = plan_devices(str(tiny_llama), load="nf4", devices="kaggle-2xt4")
    return load(LoadPlan(str(tiny_llama), load="nf4", device_map=split.cpu_device_map()))


def test_nf4_on_a_cpu_device_map_reports_the_dtype_it_loaded_as(cpu_map_nf4):
    model, _, report = cpu_map_nf4
    assert loaded_mode(model) == "fp32"  # one answer: the results' identity says what the report says
    assert report.stayed_unquantized and report.loaded_mode == "fp32" and report.loaded_as == "fp32"
    assert abs(report.weights_error) <= 1.0, str(report)  # compared with the fp32 estimate, not nf4's (+145.83 %)
    text, html = str(report), report._repr_html_()
    assert text.splitlines()[0].startswith(f"loaded {report.plan.model} as fp32 (nf4 asked: stayed unquantized)")
    for shown in (text, html):
        assert "nf4 was asked, but no layer was quantized" in shown and "device map puts on the CPU" in shown
        assert "+145" not in shown and " as nf4" not in shown


def test_a_load_that_quantized_keeps_its_mode_and_says_nothing_more(tiny_llama):
    model, _, report = load(str(tiny_llama), load="nf4")
    assert loaded_mode(model).startswith("nf4") and not report.stayed_unquantized
    assert str(report).startswith(f"loaded {report.plan.model} as nf4 in") and "stayed unquantized" not in str(report)
    assert report.unquantized_note() == ""


def test_a_model_with_nothing_to_quantize_on_a_gpu_says_why(tiny_llama):
    """On a GPU the reason is the model (no linear layer bitsandbytes takes), not the device map; without an
    estimate to re-ask, the difference is unknown rather than the nf4 estimate's."""
    report = LoadReport(LoadPlan(str(tiny_llama), load="int8"), 1 << 20, 3 << 20, 5 << 20, 0.1, {"cuda:0": 3 << 20},
                        loaded_as="fp16")  # fmt: skip
    assert report.stayed_unquantized and "found no linear layer to quantize" in str(report)
    assert report.weights_error is None and "n/a" in str(report) and "+200" not in str(report)


def test_compare_loads_labels_a_mode_that_stayed_unquantized(tiny_llama):
    """compare_loads loads each mode with load(): an nf4 row whose weights stayed fp32 says so, not "nf4"."""
    from helpers.loading.compare import compare_loads

    split = plan_devices(str(tiny_llama), load="nf4", devices="kaggle-2xt4")
    texts = ["The cache keeps keys and values of every past token for each layer."]
    comparison = compare_loads(str(tiny_llama), texts, loads=("fp32", "nf4"), device_map=split.cpu_device_map())
    nf4 = comparison.row("nf4")
    assert nf4.loaded_as == "fp32" and nf4.label == "nf4 (stayed fp32)" and comparison.row("fp32").loaded_as is None
    for shown in (str(comparison), comparison._repr_html_()):
        assert "nf4 (stayed fp32)" in shown and "bitsandbytes quantized no layer" in shown
