"""The first oomkit cell: preflight shows each check as it finishes, and imports bitsandbytes (whose import
pulls in torch.compile: seconds, tens of seconds on a busy Colab) only where a check needs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import helpers.environment as environment
from helpers.core.checks import Check
from helpers.environment import preflight

FIRST_CELL = """
import sys
import helpers
from helpers import preflight
report = preflight({model!r}, load={load!r})
print("CHECKS", [c.name for c in report.checks])
print("BNB", "bitsandbytes" in sys.modules)
"""


def first_cell(model: str, load: str) -> str:
    code = textwrap.dedent(FIRST_CELL.format(model=model, load=load))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_a_plan_that_does_not_quantize_never_imports_bitsandbytes(tiny_llama):
    out = first_cell(str(tiny_llama), "auto")  # the tiny model fits a T4 in fp16: nothing to quantize
    assert "BNB False" in out
    assert "'fit'" in out and "'bitsandbytes'" not in out


def test_a_quantized_plan_checks_bitsandbytes(tiny_llama, monkeypatch):
    seen = []
    monkeypatch.setattr(environment, "bitsandbytes_status", lambda device: seen.append(device) or (True, "ok"))
    report = preflight(str(tiny_llama), load="nf4")
    assert seen == ["cpu"] and report.check("bitsandbytes").status == "pass"
    auto = preflight(str(tiny_llama))
    assert seen == ["cpu"] and "bitsandbytes" not in [c.name for c in auto.checks]
    machine = preflight()  # no model named: the whole machine is checked, bitsandbytes included
    assert seen == ["cpu", "cpu"] and machine.check("bitsandbytes").status == "pass"


def test_outside_a_notebook_each_check_prints_before_the_next_runs(tiny_llama, monkeypatch, capsys):
    printed_before_fit = []
    fit_checks = environment.fit_checks

    def slow_fit(*args, **kwargs):
        printed_before_fit.append(capsys.readouterr().out)  # what the user already sees while the fit runs
        return fit_checks(*args, **kwargs)

    monkeypatch.setattr(environment, "fit_checks", slow_fit)
    report = preflight(str(tiny_llama), show=True)
    before, after = printed_before_fit[0], capsys.readouterr().out
    assert before.startswith(f"oomkit preflight for {tiny_llama}: checking")
    assert "] GPU: " in before and "] versions: " in before and "] fit: " not in before
    assert "] fit: " in after and after.rstrip().endswith(str(report).splitlines()[0])


class FakeHandle:
    def __init__(self, shown):
        self.shown = [shown]

    def update(self, obj, raw=False):
        self.shown.append(obj)


def test_in_a_notebook_one_output_grows_row_by_row_and_ends_as_the_report(tiny_llama, monkeypatch):
    import IPython.display

    handles = []

    def display(obj, display_id=False, raw=False):
        handles.append(FakeHandle(obj))
        return handles[-1]

    kernel = type("Kernel", (), {"kernel": object(), "execution_count": 7})()
    monkeypatch.setattr(environment, "ipython", lambda: kernel)
    monkeypatch.setattr(IPython.display, "display", display)
    report = preflight(str(tiny_llama), show=True)
    (handle,) = handles  # one output, updated in place
    assert len(handle.shown) == len(report.checks) + 2  # the empty table, one row per check, the report
    rows = [shown.data.count("<tr>") for shown in handle.shown[:-1]]
    assert rows == sorted(rows) and rows[-1] > rows[0]
    assert "checking the rest" in handle.shown[-2].data
    assert handle.shown[-1] == {"text/plain": str(report), "text/html": report._repr_html_()}
    report._ipython_display_()  # the cell's last line: its live output already is the report
    assert len(handles) == 1
    kernel.execution_count = 8  # `report` in a later cell shows it again
    report._ipython_display_()
    assert len(handles) == 2 and handles[1].shown[0]["text/plain"] == str(report)


def test_the_table_keeps_the_fix_under_the_result_so_a_narrow_column_never_scrolls(tiny_llama):
    report = preflight(str(tiny_llama))
    html = report._table_html()
    assert "<th style='text-align:left'>fix</th>" not in html and html.count("<th") == 3
    gpu = report.check("GPU")
    assert gpu.fix and "<b>fix:</b> No CUDA device" in html
    hostile = Check("x", "warn", "<script>alert(1)</script>", "<img src=x>")
    report.checks.append(hostile)
    assert "<script>" not in report._table_html() and "&lt;img src=x&gt;" in report._table_html()


def test_calibrate_adds_one_speed_line_measured_once(tiny_llama, monkeypatch):
    import helpers.estimator.calibration as calibration

    real = calibration.calibrate
    calls = []
    monkeypatch.setattr(calibration, "calibrate", lambda device=None: calls.append(device) or real(device))
    first = preflight(str(tiny_llama), calibrate=True).check("speed")
    second = preflight(str(tiny_llama), calibrate=True).check("speed")
    assert calls == ["cpu", "cpu"] and first.data == second.data  # the second is the cached measurement
    assert first.summary.startswith("cpu: ") and "later time estimates use it" in first.summary
    assert calibration.cached_calibration("cpu") is not None
