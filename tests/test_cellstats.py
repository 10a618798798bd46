"""Per-cell memory accounting: in-process shell and a real notebook kernel."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
import torch

from helpers.monitoring import cellstats

# With CUDA the tools measure GPU memory; these tests grow CPU tensors (the cuda tests cover GPUs).
CPU_MEMORY = pytest.mark.skipif(torch.cuda.is_available(), reason="measures CPU memory")

REPO = Path(__file__).resolve().parents[1]
GROW = "keep.append(torch.ones(4_000_000))  # 16 MB more on every run"


@pytest.fixture
def shell(ipython_shell):
    ipython_shell.run_cell("%load_ext helpers")
    yield ipython_shell
    ipython_shell.run_cell("%unload_ext helpers")


@CPU_MEMORY
def test_each_cell_gets_a_line_and_growing_reruns_are_flagged(shell, capsys):
    shell.run_cell("import torch\nkeep = []")
    for _ in range(4):
        shell.run_cell(GROW)
    out = capsys.readouterr().out
    recs = cellstats.CellStats.active.records
    assert "[oomkit]" in out and "RAM" in out
    assert recs[-1].growing and recs[-1].growth_per_run >= 8 * 1024 * 1024
    assert "WARN: each of the last" in out


def test_a_cell_that_gives_memory_back_is_not_flagged(shell):
    shell.run_cell("import torch")
    for _ in range(4):
        shell.run_cell("tmp = torch.ones(4_000_000); del tmp")
    assert not any(r.growing for r in cellstats.CellStats.active.records)


def test_oomkit_off_silences_the_line(shell, capsys):
    shell.run_cell("%oomkit off")
    capsys.readouterr()
    n = len(cellstats.CellStats.active.records)
    shell.run_cell("x = 1")
    assert "[oomkit] " not in capsys.readouterr().out.replace("[oomkit] per", "")
    assert len(cellstats.CellStats.active.records) == n
    shell.run_cell("%oomkit on")
    shell.run_cell("y = 2")
    assert len(cellstats.CellStats.active.records) == n + 1


@CPU_MEMORY
def test_in_a_real_kernel(tmp_path):
    """A notebook executed by a Jupyter kernel: %load_ext helpers, a growing cell re-run, %oomkit off."""
    from nbclient import NotebookClient

    cells = [
        f"import sys\nsys.path.insert(0, {str(REPO)!r})",
        "%load_ext helpers",
        "import torch\nkeep = []",
        GROW,
        GROW,
        GROW,
        GROW,
        "%oomkit off",
        "z = 3",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    def text(i):
        return "".join(o.get("text", "") for o in nb.cells[i].outputs if o.get("output_type") == "stream")

    assert "[oomkit]" not in text(2)  # moved no memory worth a line (SHOWN_FROM)
    assert "[oomkit] tensors +" in text(3) or "[oomkit] GPU +" in text(3)
    assert "WARN" not in text(3) and "WARN: each of the last 3 runs" in text(5)
    assert "WARN: each of the last 4 runs" in text(6)
    assert "[oomkit]" not in text(8)


def test_a_peak_reset_during_the_cell_makes_the_peak_a_lower_bound(fake_gpus):
    """A MemoryCallback or safe_generate restarting the peak counters mid-cell: the line says "at least",
    not "under" a figure the cell went far past (13 GiB read as "peak under 4 GiB" before)."""
    import types

    from helpers.core.memory import reset_peak_allocated

    gib = 2**30
    cuda = fake_gpus(1)
    cuda.set(0, 6 * gib)
    cuda.set(0, 2 * gib)
    stats = cellstats.CellStats()
    stats.pre_run_cell(types.SimpleNamespace(raw_cell="trainer.train()"))
    cuda.set(0, 13 * gib)
    cuda.set(0, 3 * gib)
    reset_peak_allocated("all")
    cuda.set(0, 4 * gib)
    cuda.set(0, 2 * gib)
    stats.post_run_cell(types.SimpleNamespace(execution_count=5))
    assert "peak at least 4.00 GiB" in str(stats.records[-1])
    stats.pre_run_cell(types.SimpleNamespace(raw_cell="x = 1"))  # no reset in this one: as before
    stats.post_run_cell(types.SimpleNamespace(execution_count=6))
    assert "peak under 4.00 GiB" in str(stats.records[-1])


def test_gpu_line_reads_change_and_peak():
    rec = cellstats.CellRecord(3, gpu_change=-2 * 2**20, gpu_peak=3 * 2**30, ram_change=0, seconds=1.5)
    assert "GPU -2.00 MiB (peak 3.00 GiB)" in str(rec)
    rec.peak_new = False
    assert "peak under 3.00 GiB" in str(rec)


@pytest.mark.cuda
def test_gpu_accounting_on_cuda(shell):
    shell.run_cell("import torch\nkeep = []")
    for _ in range(3):
        shell.run_cell("keep.append(torch.ones(4_000_000, device='cuda'))")
    rec = cellstats.CellStats.active.records[-1]
    assert rec.gpu_change >= 16_000_000 and rec.gpu_peak >= rec.gpu_change and rec.growing


@CPU_MEMORY
def test_cleanup_and_the_cell_line_give_one_answer_for_what_was_freed(shell, capsys):
    """Issue 44 item 7: ``cleanup()`` said "RAM 0 B freed" while the cell's line said "tensors -8.10 MiB".
    Both now read :func:`helpers.oom.reclaim.held`: the same bytes, freed in one and -change in the other."""
    from helpers.core.units import format_bytes

    shell.run_cell("import torch\nfrom helpers import cleanup")
    shell.run_cell("torch.ones(8_000_000)", store_history=True)  # 32 MB, kept by the output history alone
    capsys.readouterr()
    shell.run_cell("report = cleanup()\nreport", store_history=True)
    out = capsys.readouterr().out
    report, rec = shell.user_ns["report"], cellstats.CellStats.active.records[-1]
    assert report.tensors_freed >= 32_000_000 and rec.tensor_change == -report.tensors_freed
    shown = format_bytes(report.tensors_freed)
    assert f"cleanup: tensors {shown} freed" in str(report) and f"[oomkit] tensors -{shown}" in out
    assert "RAM 0 B freed" not in str(report)


def test_a_cell_that_moves_no_memory_gets_no_line_until_oomkit_all(shell, capsys):
    """Issue 44 item 8: the line stood under 73 of 102 cells; now only under a cell that moved
    ``SHOWN_FROM`` or more, and every cell is still recorded. ``%oomkit all`` brings back every line."""
    shell.run_cell("import torch\nx = 1")
    capsys.readouterr()
    n = len(cellstats.CellStats.active.records)
    shell.run_cell("y = [1, 2, 3]\nprint('plan ready')")
    assert "[oomkit]" not in capsys.readouterr().out and len(cellstats.CellStats.active.records) == n + 1
    shell.run_cell("%oomkit all")
    assert "under every cell" in capsys.readouterr().out
    shell.run_cell("z = 2")
    assert "[oomkit] " in capsys.readouterr().out
    shell.run_cell("%oomkit on")
    assert f"when a cell moves {cellstats.format_bytes(cellstats.SHOWN_FROM)}" in capsys.readouterr().out


def test_what_counts_as_a_meaningful_change():
    """Kept memory, a transient GPU peak above where the cell started, or RAM: any of them past SHOWN_FROM."""
    small, big = cellstats.SHOWN_FROM // 4, cellstats.SHOWN_FROM
    quiet = cellstats.CellRecord(1, gpu_change=small, gpu_peak=2 * small, ram_change=small, seconds=0.1,
                                 gpu_start=small)  # fmt: skip
    assert not quiet.meaningful
    kept = cellstats.CellRecord(1, gpu_change=-big, gpu_peak=big, ram_change=0, seconds=0.1, gpu_start=big)
    peaked = cellstats.CellRecord(1, gpu_change=0, gpu_peak=3 * big, ram_change=0, seconds=0.1, gpu_start=big)
    below = cellstats.CellRecord(1, gpu_change=0, gpu_peak=3 * big, ram_change=0, seconds=0.1, gpu_start=big,
                                 peak_new=False)  # fmt: skip  # an earlier cell's peak, not this one's
    ram = cellstats.CellRecord(1, gpu_change=None, gpu_peak=None, ram_change=big, seconds=0.1, tensor_change=0)
    cpu_kept = cellstats.CellRecord(1, gpu_change=None, gpu_peak=None, ram_change=0, seconds=0.1, tensor_change=big)
    assert kept.meaningful and peaked.meaningful and not below.meaningful and ram.meaningful and cpu_kept.meaningful
