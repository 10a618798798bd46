"""The OOM handler in a real Jupyter kernel: a notebook that runs out of memory for real gets its memory back."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]

CELLS = [
    "%load_ext helpers",
    "import psutil, torch, weakref\n"
    "def train_step():\n"
    "    global ref, rss_held\n"
    "    activations = torch.ones(64 << 20)  # 256 MiB held by this frame when the OOM unwinds\n"
    "    ref = weakref.ref(activations)\n"
    "    rss_held = psutil.Process().memory_info().rss\n"
    "    return torch.empty(1 << 45)  # a real CPU allocation failure",
    "train_step()",
    "print('FREED', ref() is None)\nprint('RSS_DROP_MIB', (rss_held - psutil.Process().memory_info().rss) >> 20)",
    "%unload_ext helpers",
    "train_step()",
    "print('KEPT', ref() is not None)",
]


def _run(tmp_path: Path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{env_path}" if env_path else str(REPO)
    try:
        NotebookClient(
            nb, timeout=120, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    finally:
        os.environ["PYTHONPATH"] = env_path
    return nb


def _text(cell) -> str:
    out = []
    for o in cell.outputs:
        out += o.get("traceback", []) + [
            o.get("text", ""),
            o.get("evalue", ""),
            o.get("data", {}).get("text/plain", ""),
        ]
    return "\n".join(out)


def test_handler_in_real_kernel_frees_what_the_traceback_pinned(tmp_path):
    nb = _run(tmp_path)
    oom = nb.cells[2]
    error = [o for o in oom.outputs if o.output_type == "error"]
    assert error, "the OOM must still show as the cell's error (so Run all stops there)"
    text = _text(oom)
    assert "DefaultCPUAllocator" in text  # the short traceback
    assert "Cause: system RAM, not GPU memory, ran out" in text  # the diagnosis above it
    cards = [o.data["text/html"] for o in oom.outputs if o.output_type == "display_data"]
    assert cards and "<ol>" in cards[0] and "What the message says" in cards[0]  # the HTML card, in the cell
    assert "Released what the traceback pinned" in text  # the readout
    after = _text(nb.cells[3])
    assert "FREED True" in after  # the 256 MiB tensor the traceback pinned is gone
    drop = int(after.split("RSS_DROP_MIB")[1].split()[0])
    assert drop >= 200, f"RSS dropped only {drop} MiB"
    # uninstalled: the default traceback (no diagnosis) and the frames keep their tensors, as before
    assert "Cause:" not in _text(nb.cells[5]) and "DefaultCPUAllocator" in _text(nb.cells[5])
    assert "KEPT True" in _text(nb.cells[6])
