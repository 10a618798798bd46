"""explain_oom on every message form, each cause class, a real CPU OOM; the CLI; the IPython handler."""

from __future__ import annotations

import pytest
import torch

from helpers.core.units import GiB, MiB
from helpers.oom.diagnosis import explain_oom
from helpers.oom.hook import install, uninstall
from helpers.oom.messages import is_oom

CUDA_NOW = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
    "14.75 GiB of which 3.06 MiB is free. Process 2301 has 14.74 GiB memory in use. Including non-PyTorch "
    "memory, this process has 14.73 GiB memory in use. Of the allocated memory 14.59 GiB is allocated by "
    "PyTorch, and 19.42 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is "
    "large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# several processes, device 1, wrapped across lines, KiB and bytes
CUDA_SEVERAL = """CUDA out of memory. Tried to allocate 512.00 KiB. GPU 1 has a total capacity of 79.14 GiB
of which 6.75 MiB is free. Process 4121 has 60.02 GiB memory in use. Process 5533 has 12.00 GiB memory in use.
Process 17 has 7.10 GiB memory in use. Including non-PyTorch memory, this process has 7.10 GiB memory in use.
Of the allocated memory 6.50 GiB is allocated by PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated."""
CUDA_FRAGMENTED = (
    "CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of 14.75 GiB of which "
    "1.10 GiB is free. Including non-PyTorch memory, this process has 13.64 GiB memory in use. Of the allocated "
    "memory 10.80 GiB is allocated by PyTorch, and 2.51 GiB is reserved by PyTorch but unallocated. If reserved "
    "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
)
CUDA_TOO_LARGE = (
    "CUDA out of memory. Tried to allocate 32.00 GiB. GPU 0 has a total capacity of 14.75 GiB of which "
    "14.50 GiB is free. Including non-PyTorch memory, this process has 105.00 MiB memory in use. Of the "
    "allocated memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated."
)
CUDA_LEGACY = (
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 14.76 GiB total capacity; "
    "13.50 GiB already allocated; 5.75 MiB free; 13.80 GiB reserved in total by PyTorch) If reserved memory "
    "is >> allocated memory try setting max_split_size_mb to avoid fragmentation."
)
HIP = (
    "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of "
    "63.98 GiB of which 1.23 GiB is free. Of the allocated memory 60.10 GiB is allocated by PyTorch, and "
    "2.50 GiB is reserved by PyTorch but unallocated."
)
MPS = (
    "RuntimeError: MPS backend out of memory (MPS allocated: 17.80 GB, other allocations: 1.12 GB, max allowed: "
    "18.13 GB). Tried to allocate 256.00 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable "
    "upper limit for memory allocations (may cause system failure)."
)
CPU = (
    "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
    "tried to allocate 281474976710656 bytes. Error code 12 (Cannot allocate memory)"
)
CUDA_ERROR = (
    "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at "
    "some other API call, so the stacktrace below might be incorrect."
)
CUBLAS = "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
CUDNN = "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED"
BNB = (
    "bitsandbytes/functional.py:1042 in dequantize_4bit\nRuntimeError: CUDA out of memory. Tried to allocate "
    "3.00 GiB. GPU 0 has a total capacity of 14.75 GiB of which 1.9 GiB is free."
)
BNB_PAGED = "bitsandbytes paged optimizer: cget_managed_ptr failed: out of memory"
COLAB = "Your session crashed after using all available RAM. If you are interested in access to high-RAM runtimes..."


@pytest.mark.parametrize("text, form", [
    (CUDA_NOW, "cuda"), (CUDA_SEVERAL, "cuda"), (CUDA_LEGACY, "cuda_legacy"), (HIP, "hip"), (MPS, "mps"),
    (CPU, "cpu"), (CUDA_ERROR, "cuda_error"), (CUBLAS, "cublas"), (CUDNN, "cudnn"), (BNB_PAGED, "bitsandbytes"),
    (COLAB, "colab_ram"),
])  # fmt: skip
def test_every_form_is_recognized(text, form):
    report = explain_oom(text)
    assert report.form == form
    assert report.fixes and str(report) and "<div>" in report._repr_html_()


def test_current_cuda_figures():
    r = explain_oom(CUDA_NOW)
    assert (r.device, r.requested, r.free) == (0, 20 * MiB, round(3.06 * MiB))
    assert r.total == round(14.75 * GiB) and r.allocated == round(14.59 * GiB)
    assert r.reserved_unallocated == round(19.42 * MiB)
    assert r.reserved == r.allocated + r.reserved_unallocated
    assert r.processes == [(2301, round(14.74 * GiB))]
    assert r.cause == "steady_state" and r.unknown == []


def test_several_processes_odd_units_other_device():
    r = explain_oom(CUDA_SEVERAL)
    assert r.device == 1 and r.requested == 512 * 1024
    assert [pid for pid, _ in r.processes] == [4121, 5533, 17]
    assert r.cause == "held_elsewhere"  # 72 GiB of the card belong to the other two processes
    assert r.held_elsewhere > 70 * GiB
    assert "nvidia-smi" in r.fixes[0]


def test_fragmentation():
    r = explain_oom(CUDA_FRAGMENTED)
    assert r.cause == "fragmentation"
    assert "expandable_segments:True" in r.fixes[0] and "holes" in r.fixes[0]


def test_legacy_fragmentation_and_figures():
    r = explain_oom(CUDA_LEGACY)
    assert (r.requested, r.allocated, r.reserved) == (20 * MiB, round(13.5 * GiB), round(13.8 * GiB))
    assert r.cause == "fragmentation"  # 300 MiB reserved but unused >= 20 MiB asked


def test_request_larger_than_card():
    r = explain_oom(CUDA_TOO_LARGE)
    assert r.cause == "request_too_large"
    assert "never fit" in r.fixes[0]


def test_hip_and_mps():
    hip = explain_oom(HIP)
    assert hip.device == 3 and hip.requested == 2 * GiB and hip.cause == "fragmentation"
    mps = explain_oom(MPS)
    assert mps.requested == 256 * MiB and mps.max_allowed == round(18.13 * GiB)
    assert mps.cause == "steady_state"


def test_system_ram_not_gpu():
    for text in (CPU, COLAB):
        r = explain_oom(text)
        assert r.cause == "system_ram"
    assert explain_oom(CPU).requested == 1 << 48


@pytest.mark.parametrize("text", [CUDA_ERROR, CUBLAS, CUDNN])
def test_library_failures_say_what_is_unknown(text):
    r = explain_oom(text)
    assert r.cause == "library_workspace"
    assert r.requested is None and r.total is None
    assert {"requested", "total", "free"} <= set(r.unknown)
    assert "tried to allocate: unknown" in str(r)  # never an invented figure


def test_bitsandbytes_wrapped_cuda_message():
    r = explain_oom(BNB)
    assert r.form == "cuda" and r.requested == 3 * GiB and r.free == round(1.9 * GiB)
    assert "allocated" in r.unknown


def test_unknown_text():
    r = explain_oom("ValueError: shapes do not match")
    assert r.form == "unknown" and r.cause == "unknown"
    # not dressed up as an OOM with a column of "unknown" figures and "retry with a smaller batch"
    assert r.not_oom and str(r).startswith("Not an out-of-memory error: ValueError: shapes do not match")
    assert "smaller batch" not in str(r) and "Not an out-of-memory error" in r._repr_html_()
    assert not explain_oom(torch.OutOfMemoryError("odd wording")).not_oom
    assert is_oom("CUDA out of memory. Tried to allocate 2.00 GiB") and not is_oom("shapes do not match")


def test_wrapped_exception():
    try:
        try:
            raise torch.OutOfMemoryError(CUDA_FRAGMENTED)
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("generation failed at step 3") from inner
    except RuntimeError as outer:
        r = explain_oom(outer, live=False)
    assert r.form == "cuda" and r.cause == "fragmentation"


def test_a_retry_that_runs_out_again_is_explained_by_its_own_message():
    """The OOM raised while handling an earlier one is the one explained (its figures, its cause), not
    the earlier, larger request that comes last in the chain's text."""
    try:
        try:
            raise torch.OutOfMemoryError(CUDA_TOO_LARGE)  # batch 64: bigger than the card
        except torch.OutOfMemoryError:
            raise torch.OutOfMemoryError(CUDA_FRAGMENTED)  # noqa: B904 - the retry, as user code writes it
    except torch.OutOfMemoryError as e:
        r = explain_oom(e, live=False)
    assert abs(r.requested - 1.95 * GiB) < MiB and r.cause == "fragmentation"


def test_a_whole_message_in_a_log_borrows_nothing_from_an_earlier_one():
    """A CUDA OOM after a CPU one is a CUDA OOM; an earlier message's cap is not the last one's."""
    cpu_then_cuda = CPU + "\n...\n" + CUDA_FRAGMENTED
    r = explain_oom(cpu_then_cuda)
    assert r.form == "cuda" and r.cause == "fragmentation"
    capped = CUDA_FRAGMENTED.replace("memory in use.", "memory in use. 7.00 GiB allowed;", 1)
    r = explain_oom(capped + "\n(cap removed, retried)\n" + CUDA_FRAGMENTED)
    assert r.process_cap is None and "process_cap" not in r.causes
    assert explain_oom(capped).process_cap == 7 * GiB


def test_a_live_fragmentation_oom_does_not_send_you_to_restart_for_a_setting_already_in_force(monkeypatch):
    from helpers.core.runtime import RestartCheck
    from helpers.oom import diagnosis as oom_diagnosis

    assert explain_oom(CUDA_FRAGMENTED, live=True).fixes[0].startswith("Set PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(oom_diagnosis, "cuda_initialized", lambda: True)
    monkeypatch.setattr(oom_diagnosis, "needs_restart_for", lambda s: RestartCheck(s, False, "in effect"))
    r = explain_oom(CUDA_FRAGMENTED, live=True)
    assert r.cause == "fragmentation" and r.fixes[0].startswith("expandable_segments:True is already in effect")
    assert not any("restart" in fix for fix in r.fixes)
    assert explain_oom(CUDA_FRAGMENTED).fixes[0].startswith("Set PYTORCH")  # a pasted message: another machine's


def test_traceback_names_read_frames_whose_locals_are_a_proxy():
    """Python 3.13+ gives a function frame's f_locals as a proxy without clear(): explaining a live OOM
    must not fail there (the notebook handler would unregister itself)."""
    import types

    from helpers.oom.diagnosis import _traceback_names

    t = torch.ones(3)
    frame = types.SimpleNamespace(
        f_code=types.SimpleNamespace(co_name="step"), f_locals=types.MappingProxyType({"x": t})
    )
    tb = types.SimpleNamespace(tb_frame=frame, tb_next=None)
    from helpers.leaks.tensors import storage_key

    assert _traceback_names(tb) == {storage_key(t)[0]: "step().x"}


def test_the_notebook_handler_frees_what_an_earlier_oom_in_the_chain_pinned(ipython_shell, capsys):
    assert install(ipython_shell)
    try:
        ipython_shell.run_cell(
            "import torch, weakref\nrefs = []\n"
            "def attempt(n):\n    x = torch.ones(1 << 22)\n    refs.append(weakref.ref(x))\n    torch.empty(n)\n"
            "def retry():\n    try:\n        attempt(1 << 45)\n    except RuntimeError:\n        attempt(1 << 44)\n"
        )
        ipython_shell.run_cell("retry()")
        assert "Released what the traceback pinned" in "".join(capsys.readouterr())
        assert [r() for r in ipython_shell.user_ns["refs"]] == [None, None]
    finally:
        uninstall(ipython_shell)


def _hold_and_fail():
    big = torch.ones(4 * MiB)  # 16 MiB, pinned by this frame when the OOM unwinds
    torch.empty(1 << 45)
    return big


def test_real_cpu_oom_live_report():
    with pytest.raises(RuntimeError) as info:
        _hold_and_fail()
    assert is_oom(info.value)
    r = explain_oom(info.value)
    assert r.form == "cpu" and r.cause == "system_ram" and r.requested == (1 << 45) * 4
    assert r.snapshot is not None
    assert r.tensors[0][0] == "_hold_and_fail().big" and r.tensors[0][1] == 16 * MiB


def test_ipython_handler_in_process(ipython_shell, capsys):
    assert install(ipython_shell)
    try:
        ipython_shell.run_cell(
            "import torch\ndef f():\n    x = torch.ones(1 << 22)\n    torch.empty(1 << 45)\nimport weakref\n"
        )
        ipython_shell.run_cell(
            "def g():\n    global ref\n    x = torch.ones(1 << 22)\n    ref = weakref.ref(x)\n"
            "    torch.empty(1 << 45)\n"
        )
        ipython_shell.run_cell("g()")
        out = capsys.readouterr()
        assert "Cause: system RAM" in out.out + out.err and "Released what the traceback pinned" in out.out + out.err
        assert ipython_shell.user_ns["ref"]() is None  # the tensor the traceback pinned is gone
        ipython_shell.run_cell("raise RuntimeError('shape mismatch')")  # not an OOM: normal traceback
        out = capsys.readouterr()
        assert "shape mismatch" in out.out + out.err and "Cause:" not in out.out + out.err
    finally:
        assert uninstall(ipython_shell)
    assert ipython_shell.custom_exceptions == ()


def test_a_process_cap_is_named_as_the_cause_when_the_card_had_room():
    """torch adds 'X allowed;' when set_per_process_memory_fraction caps the process (real message form)."""
    capped = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 996.00 MiB. GPU 0 has a total capacity "
        "of 79.19 GiB of which 60.06 GiB is free. Including non-PyTorch memory, this process has 15.81 GiB "
        "memory in use. 14.74 GiB allowed; Of the allocated memory 14.44 GiB is allocated by PyTorch, and "
        "59.88 MiB is reserved by PyTorch but unallocated."
    )
    r = explain_oom(capped)
    assert r.cause == "process_cap" and abs(r.process_cap - 14.74 * 2**30) < 2**20
    assert "set_per_process_memory_fraction(1.0)" in r.fixes[0]
    assert ("allowed for this process (its cap)", "14.74 GiB") in r.figures()
    assert "steady_state" in r.causes  # under the cap, the usual fixes still apply
    uncapped = explain_oom(capped.replace("14.74 GiB allowed; ", ""))
    assert uncapped.process_cap is None and "process_cap" not in uncapped.causes
    assert all(label != "allowed for this process (its cap)" for label, _ in uncapped.figures())


def test_the_estimators_fixes_follow_a_steady_state_diagnosis():
    """Given the estimate of what ran, its fit() suggestions for the memory this process had come after
    the general fixes (before, the lookup of a FIX_LADDER that never existed always gave nothing)."""
    from helpers.estimator.core import estimate

    est = estimate("Qwen/Qwen2.5-7B", load="fp16", device="t4")
    plain, guided = explain_oom(CUDA_NOW), explain_oom(CUDA_NOW, memory_estimate=est)
    extra = guided.fixes[len(plain.fixes) :]
    assert guided.fixes[: len(plain.fixes)] == plain.fixes and extra
    assert all(x.startswith("From the estimate of Qwen/Qwen2.5-7B: ") for x in extra)
    assert any("load=nf4" in x or "load=int8" in x for x in extra)  # a 7B model in fp16 on a 14.75 GiB card
    assert "From the estimate" not in str(explain_oom(CPU, memory_estimate=est))  # system RAM: not its fixes
    with pytest.raises(TypeError, match="MemoryEstimate"):
        explain_oom(CUDA_NOW, memory_estimate="Qwen/Qwen2.5-7B")


SPLIT_GPU1 = (
    "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 1 has a total capacity of 15.00 GiB of which "
    "600.00 MiB is free. Including non-PyTorch memory, this process has 14.40 GiB memory in use. Of the "
    "allocated memory 13.90 GiB is allocated by PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated."
)


def _split_machine(fake_gpus, monkeypatch, gpu0_free: int):
    import helpers.core.memory

    monkeypatch.setattr(helpers.core.memory, "nvml_handle", lambda index: (None, None))  # no driver here
    cuda = fake_gpus(2, 15 * GiB)
    cuda.set(0, 15 * GiB - gpu0_free)
    cuda.set(1, int(13.9 * GiB), 14 * GiB)
    return cuda


def test_a_card_that_ran_out_while_the_other_has_room_says_move_the_work(fake_gpus, monkeypatch):
    """device_map='auto' on Kaggle's 2×T4 fills GPU 0 first: here GPU 1 ran out during generation
    while GPU 0 has 6 GiB free. The first fix is to spread the work, not to quantize."""
    _split_machine(fake_gpus, monkeypatch, gpu0_free=6 * GiB)
    report = explain_oom(torch.OutOfMemoryError(SPLIT_GPU1))
    assert report.device == 1 and report.cause == "other_gpu_room"
    assert report.other_gpus == [(0, 6 * GiB)]
    assert "gpus=2" in report.fixes[0]
    assert "device_map='sequential'" in report.fixes[1] and "GPU 1's cap at least 2.00 GiB" in report.fixes[1]
    assert "go to GPU 0" in report.fixes[1] and "device_map={'': 0}" in report.fixes[2]
    assert "steady_state" in report.causes  # still there, after it
    text = str(report)
    assert "Out of memory on GPU 1" in text and "free on GPU 0 now: 6.00 GiB" in text
    assert "free on GPU 0 now" in report._repr_html_() and report.to_dict()["other_gpus"] == [(0, 6 * GiB)]


def test_no_move_hint_when_the_other_card_is_full_or_the_text_is_all_there_is(fake_gpus, monkeypatch):
    _split_machine(fake_gpus, monkeypatch, gpu0_free=300 * MiB)  # less than the 1 GiB asked for
    full = explain_oom(torch.OutOfMemoryError(SPLIT_GPU1))
    assert full.cause == "steady_state" and "other_gpu_room" not in full.causes
    assert full.other_gpus == [(0, 300 * MiB)]  # the figure is still shown
    _split_machine(fake_gpus, monkeypatch, gpu0_free=6 * GiB)
    pasted = explain_oom(SPLIT_GPU1)  # a message pasted from a log: nothing live to compare
    assert pasted.cause == "steady_state" and pasted.other_gpus == []
    too_big = SPLIT_GPU1.replace("Tried to allocate 1.00 GiB", "Tried to allocate 20.00 GiB")
    one_tensor = explain_oom(torch.OutOfMemoryError(too_big))  # a second card cannot hold one huge tensor
    assert one_tensor.cause == "request_too_large" and "other_gpu_room" not in one_tensor.causes


def test_the_move_hint_comes_after_causes_that_moving_layers_cannot_fix(fake_gpus, monkeypatch):
    _split_machine(fake_gpus, monkeypatch, gpu0_free=6 * GiB)
    held = (
        "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 1 has a total capacity of 15.00 GiB of which 600.00 MiB "
        "is free. Process 77 has 9.00 GiB memory in use. Including non-PyTorch memory, this process has 5.40 GiB "
        "memory in use. Of the allocated memory 4.90 GiB is allocated by PyTorch, and 100.00 MiB is reserved by "
        "PyTorch but unallocated."
    )  # another process holds 9 GiB of GPU 1: moving layers is not the first fix
    report = explain_oom(torch.OutOfMemoryError(held))
    assert report.causes[:2] == ["held_elsewhere", "other_gpu_room"]
    fragmented = SPLIT_GPU1.replace("and 100.00 MiB is reserved", "and 3.80 GiB is reserved")
    assert explain_oom(torch.OutOfMemoryError(fragmented)).causes.index("fragmentation") < (
        explain_oom(torch.OutOfMemoryError(fragmented)).causes.index("other_gpu_room")
    )


def test_no_move_hint_for_an_error_that_is_not_an_oom_or_under_ddp(fake_gpus, monkeypatch):
    _split_machine(fake_gpus, monkeypatch, gpu0_free=6 * GiB)
    illegal = explain_oom(RuntimeError("CUDA error: an illegal memory access was encountered on GPU 1"))
    assert illegal.not_oom and "other_gpu_room" not in illegal.causes
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun: GPU 0 is another rank's card
    ddp = explain_oom(torch.OutOfMemoryError(SPLIT_GPU1))
    assert ddp.cause == "steady_state" and ddp.other_gpus == []


def test_the_other_cards_room_counts_this_process_cache_there(fake_gpus, monkeypatch):
    cuda = _split_machine(fake_gpus, monkeypatch, gpu0_free=200 * MiB)
    cuda.reserved[0] += 2 * GiB  # 2 GiB cached on GPU 0, holding no tensor: this process can use it
    cuda.others[0] = -2 * GiB  # (the fake's free stays at 200 MiB)
    report = explain_oom(torch.OutOfMemoryError(SPLIT_GPU1))
    assert report.other_gpus == [(0, 200 * MiB + 2 * GiB)] and report.cause == "other_gpu_room"


def test_the_cpu_demos_oom_card_reads_like_a_t4s():
    """simulated_budget's OOM is the only card a CPU user meets: it names the batch and the length, never
    "not a memory shortage" (it used to ask for a PiB, which reads as a corrupted size)."""
    import torch

    from helpers import explain_oom, simulated_budget

    class Model:
        def generate(self, input_ids=None, max_new_tokens=0):
            return input_ids

    model = Model()
    with simulated_budget(model, tokens=2048), pytest.raises(torch.OutOfMemoryError) as caught:
        model.generate(input_ids=torch.zeros(8, 512, dtype=torch.long), max_new_tokens=64)
    report = explain_oom(caught.value, namespace={"BATCH_SIZE": 8, "MAX_NEW_TOKENS": 64})
    text = str(report)
    assert "corrupted" not in text and "NCCL" not in text and "GPU capacity: 14.74 GiB" in text
    assert "BATCH_SIZE = 4" in text and "MAX_NEW_TOKENS = 32" in text
