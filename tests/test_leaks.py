"""Leak hunting: census names holders, the detector tells leaks from caches, checks find patterns."""

from __future__ import annotations

import pytest
import torch

from helpers.leaks import allocations as leaks_allocations
from helpers.leaks import census as leaks_census
from helpers.leaks import growth as leaks_growth
from helpers.leaks import patterns as leaks_patterns

# With CUDA the tools measure GPU memory; these tests grow CPU tensors (the cuda tests cover GPUs).
CPU_MEMORY = pytest.mark.skipif(torch.cuda.is_available(), reason="measures CPU memory")


def _grad_tensor():
    w = torch.randn(64, 64, requires_grad=True)
    return (torch.randn(32, 64) @ w).tanh().sum()


def test_census_names_holders_and_counts_views_once():
    big = torch.zeros(1000, 250)  # 1,000,000 bytes
    ns = {"losses": [torch.ones(10) for _ in range(3)], "cache": {"512x512": big}, "view": big[:10]}
    c = leaks_census.census(ns)
    entry = next(e for e in c.entries if e.nbytes == 1_000_000)
    assert entry.shape == (1000, 250)
    assert 'cache["512x512"]' in entry.holders and "view" in entry.holders  # one storage, two names
    assert len([e for e in c.entries if e.nbytes == 1_000_000]) == 1
    assert [e.holder for e in c.held_by("losses")] and c.held_by("losses")[0].holder.startswith("losses[")
    assert c.groups[0].nbytes >= c.groups[-1].nbytes  # largest first
    assert "view" in str(c) and "<table" in c._repr_html_()


def test_census_walks_modules_and_attributes():
    class Trainer:
        def __init__(self):
            self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))

    ns = {"trainer": Trainer()}
    names = {h for e in leaks_census.census(ns).entries for h in e.holders}
    assert "trainer.model[1].weight" in names and "trainer.model[0].bias" in names


def test_graph_activations_are_counted_and_attributed():
    ns = {"losses": []}
    before = leaks_census.census(ns)
    for _ in range(3):
        ns["losses"].append(_grad_tensor())
    after = leaks_census.census(ns)
    d = leaks_census.census_diff(before, after)
    assert d.top_holder == "losses[…] (autograd graph)"
    assert d.new_bytes >= 3 * 32 * 64 * 4  # the saved tanh outputs at least
    assert any(e.grad_fn for e in after.held_by("losses"))


def _run(detector, values):
    return [detector.record(v) for v in values]


def test_detector_flags_steady_growth_and_predicts_oom():
    det = leaks_growth.GrowthDetector(capacity=100 * 2**20)
    flags = _run(det, [10 * 2**20 + i * 2**20 for i in range(20)])
    r = det.report()
    assert r.leaking and flags[-1] and r.detected_at <= 20
    assert 2**20 * 0.9 < r.bytes_per_step < 2**20 * 1.1
    assert r.predicted_oom_step is not None and 85 <= r.predicted_oom_step <= 95  # 71 MiB left at 1 MiB/step
    assert "LEAK" in str(r)


def test_detector_sees_acceleration():
    det = leaks_growth.GrowthDetector(capacity=2**40)
    _run(det, [int(1e6 + 2000 * i * i) for i in range(30)])
    assert det.report().accelerating


@pytest.mark.parametrize(
    "name, values",
    [
        ("flat", [5_000_000] * 30),
        ("warm-up spike", [9_000_000, 9_000_000, 7_000_000, 5_000_000] + [5_000_000] * 26),
        ("cache fills then stays", [5_000_000 + min(i, 8) * 200_000 for i in range(30)]),
        ("noise", [5_000_000 + (i % 3) * 3000 for i in range(30)]),
    ],
)
def test_detector_has_no_false_positive(name, values):
    det = leaks_growth.GrowthDetector()
    assert not any(_run(det, values)), name
    assert not det.report().leaking


@CPU_MEMORY
def test_watch_finds_a_planted_leak_and_its_holder():
    ns = {"kept": []}
    report = leaks_growth.watch(
        lambda i: ns["kept"].append(torch.zeros(4096)), 16, namespace=ns
    )  # 15: its first verdict
    assert report.leaking and report.suspect == "kept[…]"
    clean = leaks_growth.watch(lambda: torch.zeros(4096).sum(), 16, namespace={"x": 1})
    assert not clean.leaking


def test_watch_keeps_the_measured_steps_when_a_step_raises():
    ns = {"kept": []}

    def step(i):
        if i == 6:
            raise KeyError("label")
        ns["kept"].append(torch.zeros(4096))

    with pytest.raises(KeyError) as e:
        leaks_growth.watch(step, 20, namespace=ns)
    assert len(e.value.watch_report.growth.samples) == 6
    if hasattr(e.value, "add_note"):
        assert "watch: step 6 of 20 raised this; the 6 steps measured before it are in" in e.value.__notes__[0]
    with pytest.raises(TypeError, match="pass the step itself"):
        leaks_growth.watch(torch.zeros(3), 5)
    with pytest.raises(ValueError, match="steps must be a whole number >= 1, got '5'"):
        leaks_growth.watch(lambda: None, "5")


def test_checks_find_each_pattern():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    feats = []
    model[0].register_forward_hook(lambda m, i, o: feats.append(o))
    model(torch.randn(2, 8)).sum().backward()
    model.eval()
    try:
        hidden = torch.zeros(1000)  # noqa: F841 - a local the traceback keeps
        raise ValueError("boom")
    except ValueError as e:
        err = e
    ns = {
        "model": model,
        "feats": feats,
        "val_losses": [_grad_tensor()],
        "errors": [err],
        "cache": {(1, n): torch.zeros(n) for n in range(20)},
    }
    found = leaks_patterns.leak_checks(ns)
    assert {c.name for c in found.problems} == {
        "graph in container",
        "hooks",
        "stored traceback",
        "shape-keyed cache",
        "grads after eval",
    }
    assert found.check("hooks").data["holders"] == ["model[0]"]
    assert found.check("stored traceback").data["holders"] == ["errors"]
    assert found.check("shape-keyed cache").data["holders"] == ["cache"]
    assert found.check("grads after eval").data["holders"] == ["model"]
    assert "val_losses" in found.check("graph in container").data["holders"]
    assert all(c.fix for c in found.problems)
    assert not leaks_patterns.leak_checks({"x": torch.zeros(3), "small": {(1, 2): torch.zeros(2)}}).problems


def test_an_exception_raised_from_another_is_followed_to_the_first_ones_frames():
    def inner():
        big = torch.ones(1 << 20)  # noqa: F841 - pinned by this frame
        raise RuntimeError("inner")

    try:
        try:
            inner()
        except RuntimeError as e:
            raise ValueError("wrapped") from e
    except ValueError as e:
        ns = {"err": e}
    check = leaks_patterns.leak_checks(ns).check("stored traceback")
    assert check.status == "warn" and "err keeps frames alive with 4.00 MiB" in check.summary
    held = [e for e in leaks_census.census(ns).entries if e.nbytes == 4 << 20]
    assert held and "err.__cause__" in held[0].holders[0]


def test_output_history_check_in_ipython(ipython_shell):
    ipython_shell.run_cell("import torch", store_history=True)
    ipython_shell.run_cell("torch.zeros(1000)", store_history=True)
    found = leaks_patterns.leak_checks(ipython_shell.user_ns)
    c = found.check("output history")
    assert c.status == "warn" and c.data["holders"][0].startswith("Out[")
    names = {h for e in leaks_census.census(ipython_shell.user_ns).entries for h in e.holders}
    assert any(n.startswith("Out[") for n in names)


def test_top_allocation_sites_groups_by_user_line():
    # innermost first, as PyTorch records them; C++ frames come from source paths such as /pytorch/c10/...
    frames_user = [
        {"filename": "/pytorch/c10/cuda/CUDACachingAllocator.cpp", "line": 1077, "name": "malloc"},
        {"filename": "/x/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
        {"filename": "/content/train.py", "line": 12, "name": "step"},
    ]
    snap = {
        "segments": [
            {
                "blocks": [
                    {"size": 4096, "state": "active_allocated", "frames": frames_user},
                    {"size": 4096, "state": "active_allocated", "frames": frames_user},
                    {"size": 1 << 20, "state": "inactive", "frames": frames_user},
                    {"size": 512, "state": "active_allocated", "frames": []},
                ]
            }
        ]
    }
    sites = leaks_allocations.top_allocation_sites(snap)
    assert sites.sites[0] == ("/content/train.py:12 step", 8192, 2)
    assert sites.total == 8192 + 512


@pytest.mark.cuda
def test_record_allocations_on_cuda(tmp_path):
    path = tmp_path / "snap.pickle"
    with leaks_allocations.record_allocations(path) as rec:
        kept = [torch.zeros(1 << 20, device="cuda") for _ in range(4)]
    assert path.exists() and rec.sites.total >= 4 * 4 * (1 << 20)
    assert any("test_leaks.py" in s for s, _, _ in rec.sites.sites)
    assert max(rec.timeline().allocated) >= 4 * 4 * (1 << 20)
    assert "data:image/png;base64," in rec._repr_html_()
    del kept


def _fake_trace_snapshot() -> dict:
    """device_traces as torch.cuda.memory._snapshot() writes them (see torch/cuda/_memory_viz.py)."""
    train = [{"filename": "/content/train.py", "line": 12, "name": "step"}]
    evil = [{"filename": "/content/<b>x</b>.py", "line": 3, "name": "<script>"}]
    lib = [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 9, "name": "linear"}]
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 1 << 21, "frames": []},
        {"action": "alloc", "addr": 0, "size": 4096, "frames": lib + train},
        {"action": "alloc", "addr": 4096, "size": 4096, "frames": train},
        {"action": "alloc", "addr": 8192, "size": 1024, "frames": evil},
        {"action": "free_requested", "addr": 0, "size": 4096, "frames": []},
        {"action": "free_completed", "addr": 0, "size": 4096, "frames": []},
        {"action": "alloc", "addr": 0, "size": 512, "frames": evil},
    ]
    return {"segments": [], "device_traces": [[], trace]}


def test_allocation_timeline_from_a_fake_snapshot():
    from helpers.leaks.allocations import allocation_timeline

    tl = allocation_timeline(_fake_trace_snapshot())
    assert tl.device == 1  # the first trace with events
    assert tl.allocated == [4096, 8192, 9216, 5120, 5632]
    assert tl.top[0] == ("/content/train.py:12 step", 8192) and tl.top[1][1] == 1536
    assert tl.sites[3] is None  # a free
    assert "peak 9.00 KiB" in str(tl)
    ax = tl.plot().axes[0]
    gids = [c.get_gid() for c in ax.collections]
    assert gids == [f"site:{s}" for s, _ in tl.top]
    assert len({tuple(c.get_facecolor()[0][:3]) for c in ax.collections}) == 2  # one colour per site
    assert [len(c.get_offsets()) for c in ax.collections] == [2, 2]


def test_recording_renders_its_timeline_inline(tmp_path):
    from helpers.leaks.allocations import _Recording  # noqa: PLC2701 - the object record_allocations yields

    snap = _fake_trace_snapshot()
    rec = _Recording(tmp_path / "snap.pickle")
    assert "recording to" in rec._repr_html_()
    with pytest.raises(RuntimeError, match="after"):
        rec.plot()
    rec.snapshot, rec.sites = snap, leaks_allocations.top_allocation_sites(snap)
    html = rec._repr_html_()
    assert "data:image/png;base64," in html and "<script>" not in html
    assert "allocation events" in str(rec)
    assert rec.plot().axes[0].get_xlabel() == "allocation event"


def test_a_snapshot_pickle_that_would_run_code_is_refused(tmp_path):
    import pickle

    from helpers.leaks.allocations import SnapshotError, top_allocation_sites

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "shared_snapshot.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "payload": Evil()}))
    with pytest.raises(SnapshotError, match="not a plain memory snapshot.*trusted=True"):
        top_allocation_sites(path)
    assert not marker.exists()  # nothing ran
    plain = tmp_path / "plain.pickle"
    block = {"state": "active_allocated", "size": 1024, "frames": [{"filename": "train.py", "line": 3, "name": "f"}]}
    plain.write_bytes(pickle.dumps({"segments": [{"blocks": [block]}]}))
    assert top_allocation_sites(plain).total == 1024


def test_leak_views_escape_holder_names():
    hostile = "<img src=x onerror=alert(1)>"
    # large enough to be among the top rows whatever tensors earlier tests in this process left alive
    ns = {hostile: [torch.ones(1 << 22, requires_grad=True) * 2 for _ in range(2)]}
    for view in (leaks_census.census(ns), leaks_patterns.leak_checks(ns)):
        html = view._repr_html_()
        assert "<img" not in html and "&lt;img" in html, type(view).__name__


def test_the_oom_forecast_on_two_cards_uses_the_fuller_card_that_holds_the_run(fake_gpus):
    """A split model leaking on 2×T4: it runs out when the first card it uses fills. GPU 0 has 2 GiB
    of room, GPU 1 11 GiB: the forecast counts 2 GiB. A card the run does not touch cannot take the growth."""
    gib, mib = 2**30, 2**20
    cuda = fake_gpus(2, 15 * gib)
    cuda.set(0, 12 * gib, 12 * gib)
    cuda.others[0] = 1 * gib  # 2 GiB free on GPU 0
    cuda.set(1, 4 * gib, 5 * gib)  # 10 GiB free + 1 GiB cached on GPU 1
    level = [0]

    def grow():
        level[0] += 100 * mib
        return level[0]

    det = leaks_growth.GrowthDetector(warmup=1, window=4, measure=grow)
    for _ in range(10):
        det.record()
    assert abs(det.report().predicted_oom_step - (10 + 2 * gib / (100 * mib))) <= 1  # ~20 steps, not ~113
    cuda.set(0, 0, 0)  # the run on GPU 1 alone: GPU 0's room cannot take its growth
    assert abs(det.report().predicted_oom_step - (10 + 11 * gib / (100 * mib))) <= 1


def test_a_leak_on_the_second_card_is_seen_by_default(fake_gpus):
    """The default measure reads every card: a split model keeping its losses (on the last card) grows GPU 1
    while GPU 0, the current card, stays flat."""
    cuda = fake_gpus(2, 15 * 2**30)
    cuda.set(0, 3 * 2**30)
    det = leaks_growth.GrowthDetector(warmup=1, window=4)
    for step in range(10):
        cuda.set(1, 2**30 + step * 100 * 2**20)
        det.record()
    assert det.report().leaking and 0.9 * 100 * 2**20 < det.report().bytes_per_step < 1.1 * 100 * 2**20


def test_a_dead_weakref_proxy_in_the_namespace_is_walked_past():
    """isinstance() on a dead proxy raises ReferenceError: the census and the checks must not."""
    import weakref

    class Node:
        pass

    parent, node = Node(), Node()
    node.parent = weakref.proxy(parent)
    node.data = torch.ones(1024)
    del parent
    ns = {"node": node}
    assert any("node.data" in h for e in leaks_census.census(ns).entries for h in e.holders)
    leaks_patterns.leak_checks(ns)
