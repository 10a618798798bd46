"""Cleanup really frees: tensors pinned by a stored traceback or by IPython's Out are collected."""

import sys
import weakref

import pytest
import torch

from helpers import cleanup, free, unload
from helpers.cleanup import CleanupReport


def test_cleanup_frees_tensor_held_by_stored_traceback():
    refs = []

    def step():
        activations = torch.ones(1000, 1000)
        refs.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    try:
        step()
    except torch.OutOfMemoryError:
        # what the interactive interpreter and IPython do with an uncaught exception
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
    assert refs[0]() is not None, "the traceback's frame keeps the tensor alive"
    report = cleanup()
    assert refs[0]() is None
    assert "sys.last_traceback" in report.dropped


def test_cleanup_frees_tensor_held_by_ipython_traceback(ipython_shell):
    ipython_shell.run_cell("import torch, weakref\nrefs = []")
    ipython_shell.run_cell(
        "def step():\n"
        "    big = torch.ones(1000, 1000)\n"
        "    refs.append(weakref.ref(big))\n"
        "    torch.empty(1 << 45)\n"  # a real CPU allocation failure
        "step()"
    )
    ref = ipython_shell.user_ns["refs"][0]
    assert ref() is not None
    ipython_shell.run_cell("from helpers import cleanup\nreport = cleanup()")
    assert ref() is None
    assert any("last" in d for d in ipython_shell.user_ns["report"].dropped)


def test_cleanup_frees_tensor_held_by_out(ipython_shell):
    ipython_shell.run_cell("import torch, weakref\nt = torch.ones(1000, 1000)", store_history=True)
    ipython_shell.run_cell("t", store_history=True)  # displayed: now in Out and _
    ipython_shell.run_cell("w = weakref.ref(t)\ndel t", store_history=True)
    w = ipython_shell.user_ns["w"]
    assert w() is not None, "Out keeps the displayed tensor alive"
    ipython_shell.run_cell("from helpers import cleanup\nreport = cleanup()", store_history=True)
    assert w() is None
    assert any(d.startswith("Out") for d in ipython_shell.user_ns["report"].dropped)


def test_free_deletes_names_in_the_notebook_namespace(ipython_shell):
    ipython_shell.run_cell("import torch, weakref\nx = torch.ones(100)\nw = weakref.ref(x)")
    ipython_shell.run_cell("from helpers import free\nr = free('x')")
    assert "x" not in ipython_shell.user_ns
    assert ipython_shell.user_ns["w"]() is None
    assert "del x" in ipython_shell.user_ns["r"].dropped


def test_free_unknown_name_says_how_to_call_it():
    with pytest.raises(NameError, match=r"free\('model'\)"):
        free("nope_not_here", namespace={})


def test_unload_releases_weights_still_referenced_elsewhere(tiny_llama):
    from transformers import AutoModelForCausalLM

    ns = {"model": AutoModelForCausalLM.from_pretrained(tiny_llama)}
    model = ns["model"]
    holder = [model]  # e.g. a Trainer or pipeline that still references the model
    n_before = sum(p.numel() for p in model.parameters())
    assert n_before > 100_000
    report = unload(model, namespace=ns)
    assert "model" not in ns
    assert sum(p.numel() for p in holder[0].parameters()) == 0
    assert "weights" in report.dropped and "del model" in report.dropped
    assert isinstance(report, CleanupReport) and "cleanup:" in str(report)


def test_unload_rejects_non_modules():
    with pytest.raises(TypeError, match="free"):
        unload("model")
