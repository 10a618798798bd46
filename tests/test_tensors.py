"""The one live-tensor walk: graphs' activations counted, a huge graph walked safely and said to be cut."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from helpers.leaks.tensors import MAX_GRAPH_NODES, largest_tensors, live_storages, tensor_bytes


def test_activations_kept_by_a_graph_are_counted_once():
    x = torch.ones(256, requires_grad=True)
    before = tensor_bytes()
    y = (x * 2).exp()  # exp saves its output for backward: a tensor no variable names
    assert tensor_bytes() - before >= y.numel() * 4
    del y


def test_largest_tensors_names_what_it_is_given():
    big = torch.zeros(1 << 20)
    (name, nbytes, desc), *_ = largest_tensors(1, {id(big): "big"})
    assert (name, nbytes) == ("big", 4 << 20) and "float32" in desc


def test_freeing_a_50k_node_graph_after_a_census_does_not_crash():
    """PyTorch 2.13 segfaults freeing a ~50,000-node graph whose deep end Python touched: the walk
    stops at MAX_GRAPH_NODES, and the census says so. In a subprocess, so a crash fails the test."""
    code = textwrap.dedent("""
        import torch
        from helpers.leaks.census import census
        x = torch.ones(4, requires_grad=True)
        y = x
        for _ in range(50_000):
            y = y * 1.0001
        report = census({"y": y})
        assert any("autograd graphs walked up to" in n for n in report.notes), report.notes
        del y, report
        print("freed")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "freed" in out.stdout, (out.returncode, out.stderr[-1500:])


def test_walks_of_a_chain_that_keeps_growing_stay_within_the_budget():
    """A leak such as `total += loss` grows one chain across steps, walked at every step by the growth
    detector: the wrappers from earlier walks count, so the chain never holds too many to free."""
    code = textwrap.dedent("""
        import torch
        from helpers.leaks.tensors import tensor_bytes
        x = torch.ones(4, requires_grad=True)
        y = x
        for step in range(5):
            for _ in range(15_000):
                y = y * 1.0001
            tensor_bytes()
        del y
        print("freed")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "freed" in out.stdout, (out.returncode, out.stderr[-1500:])


def test_stats_say_how_much_of_the_graphs_was_walked():
    x = torch.ones(4, requires_grad=True)
    y = x
    for _ in range(MAX_GRAPH_NODES + 10):
        y = y + 1
    stats: dict = {}
    live_storages(stats)
    assert stats["graph_truncated"] and stats["graph_nodes"] <= MAX_GRAPH_NODES
    del y
