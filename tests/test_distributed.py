"""training_memory against the ZeRO paper's and DeepSpeed's formulas; a real 2-process gloo DDP QLoRA run."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from conftest import GLOO_CONNECT  # noqa: E402

from helpers.estimator.configs import resolve_config
from helpers.training import distributed
from helpers.training.distributed import DistributedError, largest_layer_params, launch, run_ddp_qlora, training_memory

MODEL = "meta-llama/Llama-2-7b-hf"
PSI = 6_738_415_616  # Llama-2-7b's published parameter count (the hub's safetensors metadata)


def _err(got: int, want: float) -> float:
    return abs(got - want) / want


@pytest.mark.parametrize("n", [2, 4, 8])
def test_model_states_follow_the_zero_paper(n):
    """Rajbhandari et al. 2020, mixed-precision Adam (K=12): DDP 16Ψ, ZeRO-1 4Ψ+12Ψ/N, ZeRO-2 2Ψ+14Ψ/N,
    ZeRO-3/FSDP 16Ψ/N (+ the gathered largest layer)."""
    largest = largest_layer_params(resolve_config(MODEL)[0])
    want = {"ddp": 16 * PSI, "zero1": 4 * PSI + 12 * PSI / n, "zero2": 2 * PSI + 14 * PSI / n,
            "zero3": 16 * PSI / n, "fsdp": 16 * PSI / n}  # fmt: skip
    for strategy, formula in want.items():
        mem = training_memory(MODEL, strategy=strategy, world_size=n)
        assert mem.params == PSI
        assert _err(mem.model_states, formula) < 0.01, strategy
        if strategy in ("zero3", "fsdp"):
            assert mem.bytes("working") == 4 * largest


@pytest.mark.parametrize("n", [2, 8])
def test_deepspeed_estimators(n):
    """deepspeed.runtime.zero's estimate_zero2/zero3_model_states_mem_needs (cpu_offload=False), as published."""
    largest = largest_layer_params(resolve_config(MODEL)[0])
    z2 = training_memory(MODEL, strategy="zero2", world_size=n)
    z3 = training_memory(MODEL, strategy="zero3", world_size=n)
    assert _err(z2.deepspeed_gpu_bytes, 2 * PSI + 18 * PSI / n) < 0.01
    assert _err(z3.deepspeed_gpu_bytes, 4 * largest + 18 * PSI / n) < 0.01
    # our rows differ from DeepSpeed's by its fp32 gradient partition only (4Ψ/N)
    assert _err(z2.deepspeed_gpu_bytes - z2.model_states, 4 * PSI / n) < 0.01
    deepspeed = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    _, gpu = deepspeed.estimate_zero2_model_states_mem_needs(PSI, num_gpus_per_node=n, cpu_offload=False)
    assert _err(z2.deepspeed_gpu_bytes, gpu) < 0.01


def test_qlora_replicates_the_4bit_base_under_ddp():
    one = training_memory(MODEL, strategy="single", qlora=True)
    ddp = training_memory(MODEL, strategy="ddp", world_size=2, qlora=True)
    fsdp = training_memory(MODEL, strategy="fsdp", world_size=2, qlora=True, quant_storage_sharded=True)
    base = one.bytes("weights")
    assert ddp.bytes("weights") == base and abs(fsdp.bytes("weights") - base // 2) <= 4  # each row halved
    assert ddp.trainable < ddp.params // 100 and "replicated" in ddp.notes[0]
    assert ddp.bytes("comm") == ddp.bytes("training.gradients") > 0


def test_bad_inputs():
    with pytest.raises(DistributedError, match="unknown strategy"):
        training_memory(MODEL, strategy="zero4", world_size=2)
    with pytest.raises(DistributedError, match="one GPU"):
        training_memory(MODEL, strategy="single", world_size=2)


# The forking launcher a notebook starts: notebook 05 runs it, tests/test_wheel.py checks its ranks


@pytest.mark.slow
def test_ddp_through_torchrun(tiny_llama, tmp_path):
    """The launcher a notebook falls back to once CUDA is initialised: torchrun on python -m helpers.training.distributed."""
    run = run_ddp_qlora(str(tiny_llama), tmp_path, num_processes=2, via="subprocess", steps=3, seq_len=32)
    assert len(run.ranks) == 2 and run.in_sync and run.loss_fell


def _thread_from(module: str, stop: threading.Event) -> threading.Thread:
    """A running thread whose code lives in ``module`` (as a kernel's IOPub thread lives in ipykernel.iostream)."""

    def wait() -> None:
        stop.wait(30)

    wait.__module__ = module
    t = threading.Thread(target=wait, name=f"from {module}", daemon=True)
    t.start()
    return t


def test_a_notebook_kernels_own_threads_leave_the_forking_launcher_chosen():
    """A Jupyter kernel always runs ~9 threads (IOPub, Heartbeat, history saver ...): they do not count as
    threads a fork could deadlock on, so launch(via="auto") forks there; a thread of anyone else's still does."""
    stop = threading.Event()
    try:
        kernel = [_thread_from(m, stop) for m in ("ipykernel.iostream", "IPython.core.history", "google.colab._x")]
        assert not {t.name for t in kernel} & set(distributed.other_threads())
        via, why = distributed.choose_launcher()
        if not torch.cuda.is_available():  # another test's thread (tqdm's monitor) may run: never a kernel one
            assert via == "debug" or ("threads" in why and not any(t.name in why for t in kernel)), why
        sampler = _thread_from("helpers.monitoring.monitor", stop)
        assert sampler.name in distributed.other_threads()
        via, why = distributed.choose_launcher()
        assert via == "subprocess" and "from helpers.monitoring.monitor" in why and "are running" in why
    finally:
        stop.set()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: bitsandbytes initializes no CUDA there")
def test_without_a_gpu_an_imported_bitsandbytes_still_lets_the_debug_launcher_fork():
    """preflight() imports bitsandbytes; on a CPU runtime that must not send notebook 05's DDP to torchrun."""
    import bitsandbytes  # noqa: F401

    via, why = distributed.choose_launcher()
    assert "bitsandbytes" not in why and (via == "debug" or "threads" in why)


def test_torchrun_refuses_what_its_processes_cannot_import_before_starting_them(monkeypatch):
    def my_step():
        pass

    with pytest.raises(DistributedError, match="defined inside another function.*move it into a module"):
        launch(my_step, via="subprocess")
    my_step.__module__, my_step.__qualname__ = "__main__", "my_step"  # as a notebook cell defines it
    with pytest.raises(DistributedError, match=r"my_step is defined in __main__.*via='subprocess'") as e:
        launch(my_step, via="subprocess")
    assert "from my_steps import my_step" in str(e.value) and "notebook_launcher" in str(e.value)
    # auto picks torchrun when a fork is unsafe, and says why in the refusal
    monkeypatch.setattr(distributed, "choose_launcher", lambda: ("subprocess", "CUDA is initialized in this process"))
    with pytest.raises(DistributedError, match=r"torchrun launch \(CUDA is initialized in this process\)"):
        launch(my_step)
    with pytest.raises(DistributedError, match=r"passes args as JSON .*\(a path as str\(path\)\)"):
        launch(json.loads, (Path("x"),), via="subprocess")
    with pytest.raises(DistributedError, match="unknown launcher 'fork'"):
        launch(json.loads, via="fork")


def test_a_failed_torchrun_run_quotes_the_ranks_error_not_torchruns_summary():
    lines = [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "helpers/training/distributed.py", line 400, in _main',
        "[rank0]: AttributeError: module '__main__' has no attribute 'my_step'",
        "[rank1]: AttributeError: module '__main__' has no attribute 'my_step'",
        "E1123 18:34:55 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "Root Cause (first observed failure):",
    ]
    text = distributed._failure("__main__:my_step", 1, lines)
    assert text.startswith("torchrun running __main__:my_step on each process exited with status 1: AttributeError: "
                           "module '__main__' has no attribute 'my_step'\n")  # fmt: skip
    assert text.count("AttributeError") == 3  # once said, and in the ranks' last lines
    assert "ChildFailedError" not in text and "Root Cause" not in text
    interleaved = [
        "json.decoder.JSONDecodeError:  Expecting value: line 1",
        "json.decoder.JSONDecodeError: Expecting value: line 1",
    ]
    text = distributed._failure("json:loads", 1, interleaved)  # two ranks' lines that met mid-line in the pipe
    assert "exited with status 1: json.decoder.JSONDecodeError: Expecting value: line 1\n" in text


@pytest.mark.slow
def test_a_failing_torchrun_run_is_a_distributed_error(capfd):
    """Each rank runs json.loads('{bad'): torchrun fails, and launch says what the ranks raised (it was a bare
    CalledProcessError naming only the command); the ranks' output is one progress line, which ends saying so."""
    with pytest.raises(DistributedError, match="exited with status 1: json.decoder.JSONDecodeError: Expecting"):
        launch(json.loads, ("{bad",), num_processes=2, via="subprocess")
    err = capfd.readouterr().err
    final = err.split("\r")[-1]  # one line, redrawn: its last state
    assert err.count("\n") == 1 and final.startswith("torchrun, 2 processes: ") and "exited with status 1" in final


@pytest.mark.slow
def test_in_a_real_notebook_kernel_a_notebook_function_runs_on_every_rank(tmp_path):
    """A function defined in a notebook cell, launched from a real ipykernel (nine threads of its own): forked by
    accelerate's launcher, it runs on both ranks (torchrun was chosen, and failed in every child)."""
    from jupyter_client.manager import start_new_kernel

    repo = str(Path(__file__).resolve().parents[1])
    km, kc = start_new_kernel(kernel_name="python3", env={**os.environ, "PYTHONPATH": repo}, cwd=repo)
    code = f"""
import os, threading
import torch
from helpers.training import distributed
from helpers.training.distributed import launch
def my_step(out):
    import torch.distributed as dist
    open(os.path.join(out, f"rank{{dist.get_rank()}}"), "w").close()
assert threading.active_count() > 5, threading.enumerate()  # the kernel's own threads
assert distributed.choose_launcher()[0] == ("notebook" if torch.cuda.is_available() else "debug")
for attempt in range(3):  # gloo's rendezvous on localhost fails about one run in 15 here, kernel or not
    try:
        launch(my_step, ({str(tmp_path)!r},), num_processes=2)
        break
    except Exception as e:
        if {GLOO_CONNECT!r} not in str(e) or attempt == 2:
            raise
"""
    try:
        reply = kc.execute_interactive(code, timeout=180, output_hook=lambda msg: None)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
