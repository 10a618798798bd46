"""The first oomkit cell imports only what its answer needs (issue 44 item 3): ``import helpers`` and
``%load_ext helpers`` import no torch, preflight shows its first lines (GPU, versions, RAM, disk) before anything
imports torch, and a plan that quantizes nothing never imports bitsandbytes. Counted in fresh processes, since
this one has imported everything; the time it saves is bench/first_cell.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import helpers.core.memory as memory
import helpers.environment as environment
from helpers.core.checks import Check
from helpers.core.units import GiB, MiB

REPO = Path(__file__).resolve().parents[1]
HEAVY = ["torch", "transformers", "bitsandbytes", "matplotlib", "ipywidgets", "peft", "accelerate"]


def fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter with an IPython shell up (a kernel before its first cell); the JSON
    it prints on its last line."""
    head = "import json, sys\nfrom IPython.core.interactiveshell import InteractiveShell\n"
    head += "shell = InteractiveShell.instance()\n"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", head + textwrap.dedent(code)], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_load_ext_helpers_and_a_cell_without_torch_import_nothing_heavy():
    got = fresh(f"""
        import helpers
        after_import = [m for m in {HEAVY!r} if m in sys.modules]
        shell.run_line_magic("load_ext", "helpers")
        after_ext = [m for m in {HEAVY!r} if m in sys.modules]
        shell.run_cell("x = [0] * 10")  # the per-cell line reads memory around it: without importing torch
        after_cell = [m for m in {HEAVY!r} if m in sys.modules]
        shell.run_cell("from helpers import snapshot\\nstart = snapshot()")  # notebooks 01, 02, 03, 06 begin so
        after_snapshot = [m for m in {HEAVY!r} if m in sys.modules]
        handled = shell.custom_exceptions
        print(json.dumps({{"import": after_import, "ext": after_ext, "cell": after_cell, "snapshot": after_snapshot,
                          "hook": [t.__name__ for t in handled]}}))
    """)
    assert got["import"] == [] and got["ext"] == [] and got["cell"] == [] and got["snapshot"] == []
    assert {"RuntimeError", "MemoryError"} <= set(got["hook"])  # torch.OutOfMemoryError is a RuntimeError


def test_preflight_shows_gpu_versions_ram_and_disk_before_anything_imports_torch(tiny_llama):
    got = fresh(f"""
        import io, os
        seen = []

        class Screen(io.StringIO):
            def write(self, text):
                if text.startswith("["):
                    seen.append([text.split(":")[0], "torch" in sys.modules])
                    if "disk:" in text:  # the lines that need no torch are out: stop before the rest
                        sys.__stdout__.write(json.dumps({{"seen": seen, "build": build}}) + "\\n")
                        sys.__stdout__.flush()
                        os._exit(0)
                return super().write(text)

        from helpers.core.memory import torch_build
        build = torch_build()
        assert "torch" not in sys.modules
        sys.stdout = Screen()
        shell.run_line_magic("load_ext", "helpers")
        shell.run_cell("from helpers import preflight\\npreflight({str(tiny_llama)!r}, load='fp16', show=True)")
        sys.__stdout__.write(json.dumps({{"seen": seen, "build": build}}) + "\\n")
    """)
    names = [name.split("] ")[1] for name, _ in got["seen"]]
    assert names[0] == "GPU" and {"versions", "RAM for loading", "disk"} <= set(names)
    assert not any(torch for _, torch in got["seen"])
    import torch

    # torch's build read from its version.py without importing it: what torch itself says
    assert got["build"] == {"cuda": torch.version.cuda, "hip": torch.version.hip}


def test_only_a_plan_that_quantizes_runs_the_bitsandbytes_check(tiny_llama, monkeypatch):
    """bitsandbytes' import pulls in torch.compile (seconds): an fp16 plan never imports it."""
    ran = []
    monkeypatch.setattr(environment, "bitsandbytes_status", lambda device: ran.append(device) or (True, "ok"))
    for load in ("fp16", "nf4"):  # the fit line says which load the plan ends up with
        fit = Check("fit", "pass", f"fits with load={load}", data={"load": load})
        monkeypatch.setattr(environment, "fit_checks", lambda model, fit=fit, **kw: [fit])
        report = environment.preflight(str(tiny_llama), load=load)
        assert ("bitsandbytes" in [c.name for c in report.checks]) == (load == "nf4")
    assert ran == ["cpu"]


class FakeNVML(types.ModuleType):
    """pynvml over a list of cards: (name, uuid, total, reserved, free, capability, mig)."""

    class NVMLError(Exception):
        pass

    nvmlMemory_v2 = 2

    def __init__(self, cards):
        super().__init__("pynvml")
        self.cards = cards

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.cards[i]

    def nvmlDeviceGetName(self, h):
        return h[0].encode()

    def nvmlDeviceGetUUID(self, h):
        return h[1]

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        return types.SimpleNamespace(total=h[2], reserved=h[3], free=h[4])

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return h[5]

    def nvmlDeviceGetMigMode(self, h):
        if h[6] is None:
            raise self.NVMLError("not supported")
        return [h[6], h[6]]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [types.SimpleNamespace(pid=1, usedGpuMemory=300 * MiB)]


T4 = ("Tesla T4", "GPU-aaaa", 15 * GiB, 258 * MiB, 14 * GiB, (7, 5), None)
L4 = ("NVIDIA L4", "GPU-bbbb", 23 * GiB, 400 * MiB, 22 * GiB, (8, 9), 0)


@pytest.fixture
def driver(monkeypatch):
    """NVML over given cards, and a CUDA build of torch as its version.py says."""

    def use(cards, visible=None, order=None):
        monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(cards))
        monkeypatch.setattr(memory, "torch_build", lambda: {"cuda": "12.4", "hip": None})
        for name, value in (("CUDA_VISIBLE_DEVICES", visible), ("CUDA_DEVICE_ORDER", order)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        return memory.driver_gpu_readouts()

    return use


def test_gpus_from_the_driver_are_what_cuda_reports_before_this_process_holds_anything(driver):
    (g,) = driver([T4])
    assert (g.index, g.name, g.capability) == (0, "Tesla T4", (7, 5))
    assert g.total == 15 * GiB - 258 * MiB and g.free == 14 * GiB  # the driver's reserve is not the card's
    assert (g.allocated, g.reserved) == (0, 0) and g.processes[0].used == 300 * MiB
    assert not g.supports_bf16


def test_cuda_visible_devices_picks_and_orders_the_cards_as_cuda_does(driver):
    assert [g.name for g in driver([T4, T4], visible="1")] == ["Tesla T4"]
    assert [g.name for g in driver([T4, L4], visible="GPU-bb,GPU-aa", order="PCI_BUS_ID")] == ["NVIDIA L4", "Tesla T4"]
    assert driver([T4], visible="") is None and driver([T4], visible="MIG-1234") is None  # CUDA's rules: ask torch
    assert driver([T4, L4]) is None  # different cards in CUDA's fastest-first order: only torch knows it
    assert driver([L4[:6] + (1,)]) is None  # a MIG slice


def test_a_cpu_build_of_torch_sees_no_gpu_whatever_the_driver_says(driver, monkeypatch):
    driver([T4])
    monkeypatch.setattr(memory, "torch_build", lambda: {"cuda": None, "hip": None})
    assert memory.driver_gpu_readouts() == []
    monkeypatch.setattr(memory, "torch_build", lambda: {"cuda": None, "hip": "6.0"})
    assert memory.driver_gpu_readouts() is None  # ROCm: torch reads it


@pytest.mark.cuda
def test_on_a_real_gpu_the_driver_readout_is_what_torch_reads_after_it():
    """Before torch: the cards from NVML; after it, torch's own: same cards, capability, total (the driver's
    reserve taken off), and free memory within the CUDA context torch's readout has paid by then."""
    got = fresh("""
        from helpers.core.memory import driver_gpu_readouts
        early = driver_gpu_readouts()
        assert "torch" not in sys.modules
        import torch
        late = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            late.append([p.name, [p.major, p.minor], total, free])
        print(json.dumps({"early": [[g.name, list(g.capability), g.total, g.free] for g in early or []],
                          "driver": early is not None, "late": late}))
    """)
    assert got["driver"] and len(got["early"]) == len(got["late"])
    for (name, cap, total, free), (t_name, t_cap, t_total, t_free) in zip(got["early"], got["late"]):
        assert (name, cap) == (t_name, t_cap)
        assert abs(total - t_total) <= 0.01 * t_total
        assert 0 <= free - t_free <= 2 * GiB  # torch's readout paid this process's CUDA context
