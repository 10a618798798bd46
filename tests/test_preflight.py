"""Preflight verdicts on simulated machines: readouts are passed in, torch is never patched."""

import json
import subprocess
import sys

import psutil
import pytest

from helpers.core.memory import DiskReadout, GPUProcess, GPUReadout, MemorySnapshot, RAMReadout
from helpers.core.sources import checkpoint_size
from helpers.core.units import GiB, MiB
from helpers.environment import COLAB_GPU_FIX, preflight

VERSIONS = {"torch": "2.13.0", "transformers": "5.23.0", "accelerate": "1.15.0", "peft": "0.21.2",
            "bitsandbytes": "0.50.2", "cuda": "12.4", "python": "3.11.7"}  # fmt: skip
T4_TOTAL = int(14.74 * GiB)


def machine(gpu=True, free=None, reserved=0, processes=None, ram_avail=11 * GiB, disk_free=80 * GiB):
    gpus = []
    if gpu:
        free = T4_TOTAL - reserved - 400 * MiB if free is None else free
        gpus = [GPUReadout(0, "Tesla T4", (7, 5), T4_TOTAL, free, 0, reserved, 0, reserved, processes)]
    return MemorySnapshot(
        "cuda" if gpu else "cpu",
        gpus,
        RAMReadout(int(12.7 * GiB), ram_avail, 1 * GiB, 500 * MiB),
        [DiskReadout("HF cache", "/root/.cache/huggingface/hub", 100 * GiB, disk_free)],
    )


def run(snap, model=None, checkpoint=None, **kw):
    return preflight(
        model, snapshot=snap, package_versions=VERSIONS, bnb=(True, "ok"), colab=True, checkpoint=checkpoint, **kw
    )


def test_no_gpu_on_colab_warns_with_runtime_fix():
    report = run(machine(gpu=False))
    gpu = report.check("GPU")
    assert gpu.status == "warn" and gpu.fix == COLAB_GPU_FIX
    assert report.ok


def test_fresh_t4_passes_and_says_fp16_not_bf16():
    report = run(machine())
    assert report.check("GPU").status == "pass"
    assert report.check("bf16").status == "info" and "fp16" in report.check("bf16").summary
    assert report.check("free GPU memory").status == "pass"
    assert report.status == "pass"


def test_gpu_held_by_previous_kernel_is_named():
    snap = machine(free=T4_TOTAL - 9 * GiB, processes=[GPUProcess(19585, 9 * GiB, "python3")])
    report = run(snap)
    held = report.check("GPU memory held elsewhere")
    assert held.status == "warn" and "19585" in held.summary and "Restart" in held.fix
    assert report.check("free GPU memory").status == "warn"


def test_checkpoint_shard_larger_than_ram_fails_before_the_kernel_dies():
    report = run(machine(ram_avail=3 * GiB), model="some/model", checkpoint=(14 * GiB, 10 * GiB, "hub"))
    ram = report.check("RAM for loading")
    assert ram.status == "fail" and "kernel would die" in ram.summary
    assert not report.ok


def test_sharded_checkpoint_fits_ram_but_warns_about_offload():
    report = run(machine(ram_avail=11 * GiB), model="some/model", checkpoint=(13 * GiB, 5 * GiB, "hub"))
    assert report.check("RAM for loading").status == "warn"


def test_disk_too_small_for_download_fails():
    report = run(machine(disk_free=5 * GiB), model="some/model", checkpoint=(13 * GiB, 5 * GiB, "hub"))
    assert report.check("disk").status == "fail"


def test_missing_bitsandbytes_warns_with_install_line():
    vers = dict(VERSIONS, bitsandbytes=None)
    report = preflight(
        snapshot=machine(), package_versions=vers, bnb=(False, "bitsandbytes is not installed"), colab=True
    )
    assert report.check("versions").status == "warn" and "pip install bitsandbytes" in report.check("versions").fix
    assert report.check("bitsandbytes").status == "warn"


def test_report_renders_as_text_html_and_json():
    report = run(machine(gpu=False))
    assert str(report).startswith("oomkit preflight")
    assert "<table" in report._repr_html_()
    assert json.loads(report.to_json())["checks"][0]["name"] == "GPU"


def test_negative_max_new_tokens_is_rejected():
    with pytest.raises(ValueError, match="max_new_tokens"):
        run(machine(), max_new_tokens=-1)
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number >= 0, got '64'"):
        run(machine(), max_new_tokens="64")


def test_checkpoint_size_of_local_dir(tiny_llama):
    total, largest, source = checkpoint_size(str(tiny_llama))
    assert total == (tiny_llama / "model.safetensors").stat().st_size == largest
    assert source == "local safetensors files"


def test_missing_local_path_and_bad_cli_load_say_so(capsys):
    from helpers.cli import preflight_main as main

    total, largest, source = checkpoint_size("/no/such/model")
    assert total is None and "/no/such/model does not exist" in source and "hub" not in source
    with pytest.raises(SystemExit) as e:
        main(["--load", "int4"])
    assert e.value.code == 2 and "--load 'int4': use auto, fp32, fp16" in capsys.readouterr().err


@pytest.mark.bnb
def test_real_machine_bitsandbytes_runs_on_cpu():
    report = preflight()
    assert report.check("bitsandbytes").status == "pass"


def test_cli_json_on_this_machine():
    out = subprocess.run(
        [sys.executable, "-m", "helpers", "preflight", "--json"], capture_output=True, text=True, check=True
    ).stdout
    data = json.loads(out)
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["GPU"]["status"] == "warn" and "T4 GPU" in checks["GPU"]["fix"]
    ram = data["snapshot"]["ram"]
    assert ram["total"] == psutil.virtual_memory().total
    assert abs(ram["available"] - psutil.virtual_memory().available) < 1 * GiB
    assert {d["label"] for d in data["snapshot"]["disks"]} == {"HF cache", "working dir"}


def test_cli_unknown_command_fails_clearly():
    r = subprocess.run([sys.executable, "-m", "helpers", "frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown command" in r.stderr


def test_a_model_that_cannot_be_found_or_read_fails_preflight(tmp_path, capsys):
    from helpers.cli import preflight_main

    garbage = tmp_path / "model"
    garbage.mkdir()
    (garbage / "config.json").write_text("{not json")
    for model in (str(tmp_path / "typo" / "model"), str(garbage)):
        report = run(machine(), model)
        assert report.check("model").status == "fail" and not report.ok, model
        assert "spelling" in report.check("model").fix
    assert preflight_main(["--model", str(garbage)]) == 1  # a script or CI step stops on a failed check


def test_a_7b_model_on_a_cpu_runtime_stops_at_preflight_with_the_menu_path(tiny_llama):
    from helpers.environment import PreflightFailed

    report = run(machine(gpu=False), "meta-llama/Llama-2-7b-hf", checkpoint=(13 * GiB, 10 * GiB, "hub"))
    needed = report.check("GPU needed")
    assert needed.status == "fail" and needed.fix == COLAB_GPU_FIX
    with pytest.raises(PreflightFailed, match="(?s)GPU needed.*Runtime > Change runtime type > T4"):
        report.raise_for_failures()
    tiny = run(machine(gpu=False), str(tiny_llama))  # the tiny model runs anywhere
    tiny.raise_for_failures()
    assert "GPU needed" not in {c.name for c in tiny.checks}


def test_a_safetensors_shard_is_memory_mapped_and_only_a_shard_past_free_ram_fails():
    # CodeLlama-7B on a free Colab: 9.9 GB + 3.5 GB safetensors shards, about 11 GiB of RAM free
    mapped = run(
        machine(ram_avail=11 * GiB), model="some/model", checkpoint=(13 * GiB, 10 * GiB, "hub safetensors files")
    )
    assert mapped.check("RAM for loading").status != "fail"
    pickled = run(machine(ram_avail=11 * GiB), model="some/model", checkpoint=(13 * GiB, 10 * GiB, "hub .bin files"))
    assert pickled.check("RAM for loading").status == "fail"
    past = run(machine(ram_avail=9 * GiB), model="some/model", checkpoint=(13 * GiB, 10 * GiB, "hub safetensors files"))
    assert past.check("RAM for loading").status == "fail"


# -- several GPUs (Kaggle's "GPU T4 x2") ------------------------------------------------------


def t4(index, free=None, processes=None, name="Tesla T4", capability=(7, 5), total=T4_TOTAL):
    free = total - 400 * MiB if free is None else free
    return GPUReadout(index, name, capability, total, free, 0, 0, 0, 0, processes)


def two_gpus(*gpus):
    """Kaggle's machine: two T4s (or the readouts given), 29 GiB of RAM."""
    gpus = gpus or (t4(0), t4(1))
    ram = RAMReadout(31 * GiB, 29 * GiB, 1 * GiB, 500 * MiB)
    return MemorySnapshot("cuda", list(gpus), ram, [DiskReadout("HF cache", "/kaggle/hf", 100 * GiB, 60 * GiB)])


def test_two_gpus_are_both_named_and_checked():
    report = run(two_gpus())
    gpu = report.check("GPU")
    assert gpu.status == "pass" and gpu.data["indices"] == [0, 1]
    assert gpu.summary == "2 GPUs: Tesla T4 ×2, 14.74 GiB each, compute capability 7.5"
    assert report.check("bf16").status == "info" and "fp16" in report.check("bf16").summary
    for i in (0, 1):
        free = report.check(f"GPU {i} free memory")
        assert free.status == "pass" and free.data["index"] == i
    assert report.status == "pass"


def test_mixed_gpus_are_each_named_and_bf16_needs_all_of_them():
    a100 = t4(0, name="NVIDIA A100-SXM4-40GB", capability=(8, 0), total=40 * GiB)
    report = run(two_gpus(a100, t4(1)))
    summary = report.check("GPU").summary
    assert "GPU 0 NVIDIA A100-SXM4-40GB (40.00 GiB, compute capability 8.0)" in summary
    assert "GPU 1 Tesla T4 (14.74 GiB, compute capability 7.5)" in summary
    bf16 = report.check("bf16")
    assert bf16.status == "info" and "GPU 1 (sm_75) has no bf16" in bf16.summary and "GPU 0" not in bf16.summary
    both = run(two_gpus(a100, t4(1, name="NVIDIA A100-SXM4-40GB", capability=(8, 0), total=40 * GiB)))
    assert both.check("bf16").status == "pass" and "A100-SXM4-40GB ×2" in both.check("GPU").summary


def test_a_process_on_gpu_1_warns_naming_gpu_1():
    held = t4(1, free=T4_TOTAL - 9 * GiB, processes=[GPUProcess(19585, 9 * GiB, "python3")])
    report = run(two_gpus(t4(0), held))
    warn = report.check("GPU 1 memory held elsewhere")
    assert warn.status == "warn" and "PID 19585 python3" in warn.summary and "GPU 1" in warn.fix
    assert warn.data == {"bytes": 9 * GiB, "index": 1}
    assert report.check("GPU 1 free memory").status == "warn"
    assert report.check("GPU 0 free memory").status == "pass"
    assert "GPU 0 memory held elsewhere" not in {c.name for c in report.checks}
    assert "[WARN] GPU 1 memory held elsewhere: 9.00 GiB" in str(report)


def test_llama_7b_fp16_fits_across_two_t4s_but_not_one():
    # 4096 new tokens: 15.4 GiB on one T4 (14.35 GiB usable), half of it on each of two
    kw = dict(model="Llama-2-7b-hf", checkpoint=(13 * GiB, 10 * GiB, "hub"), load="fp16", max_new_tokens=4096)
    one = run(machine(), **kw).check("fit")
    assert one.status == "fail" and "does not fit" in one.summary
    report = run(two_gpus(), **kw)
    fit = report.check("fit")
    assert fit.status == "pass" and "fits across 2 GPUs" in fit.summary and report.ok
    assert "GPU 0 7.90 GiB of 14.35 GiB, GPU 1 7.90 GiB of 14.35 GiB" in fit.summary
    assert "on GPU 0 alone 15.35 GiB: does not fit" in fit.summary and "max_new_tokens=4096)) splits it" in fit.fix
    shares = fit.data["gpus"]
    assert fit.data["split"] and [s["index"] for s in shares] == [0, 1]
    assert sum(s["layers"] for s in shares) == 32 and all(0 < s["total"] < s["capacity"] for s in shares)
    assert sum(s["weights"] for s in shares) == fit.data["weights"]
    note = report.check("GPU split")
    assert note.status == "info" and "do not generate faster" in note.summary


def test_auto_on_two_t4s_keeps_fp16_split_instead_of_nf4_on_one():
    """fp16 is tight on one T4 at 256 new tokens: one T4 gets nf4 (as before), two T4s fp16 split."""
    kw = dict(model="Llama-2-7b-hf", checkpoint=(13 * GiB, 10 * GiB, "hub"))
    assert run(machine(), **kw).check("fit").data["load"] == "nf4"
    fit = run(two_gpus(), **kw).check("fit")
    assert fit.status == "pass" and fit.data["load"] == "fp16" and fit.data["split"]
    assert "[one GPU: fp16 13.39 GiB, nf4 4.52 GiB]" in fit.summary


def test_a_small_model_stays_on_gpu_0_and_says_gpu_1_is_free():
    report = run(two_gpus(), "openai-community/gpt2", checkpoint=(500 * MiB, 500 * MiB, "hub"), load="fp16")
    fit = report.check("fit")
    assert fit.status == "pass" and "on GPU 0 Tesla T4 (14.35 GiB usable): fits (GPU 1 stays free)" in fit.summary
    assert "split" not in fit.data and "GPU split" not in {c.name for c in report.checks}


def test_a_model_too_big_for_two_gpus_does_not_fit_with_a_fix(tmp_path):
    # Llama-3.1-8B in fp32: 29.9 GiB of weights, 28.7 GiB on both T4s; fp16 splits
    fit = run(two_gpus(), "Llama-3.1-8B", checkpoint=(32 * GiB, 5 * GiB, "hub"), load="fp32").check("fit")
    assert fit.status == "fail" and "does not fit across 2 GPUs" in fit.summary
    assert "weights alone (29.92 GiB)" in fit.summary and fit.fix == "load=fp16: fits across 2 GPUs"
    # Llama-2-70B: neither fp16 nor nf4 fits both T4s; the fix is load()'s: a smaller model, or the CPU offload
    # load() takes with allow_offload (the RAM holds it)
    from helpers.placement.device_plan import reference_configs

    reference_configs()["Llama-2-70b"].save_pretrained(tmp_path)
    report = run(two_gpus(), str(tmp_path), checkpoint=(130 * GiB, 10 * GiB, "local"))
    fit = report.check("fit")
    assert fit.status == "fail" and fit.data["load"] == "nf4" and not report.ok
    assert "does not fit across 2 GPUs" in fit.summary
    assert fit.fix.startswith("a smaller model: ") and fit.fix.endswith(
        "; or accept the slowdown: LoadPlan(..., allow_offload=True)"
    )


def test_one_gpu_and_cpu_read_as_before():
    report = run(machine(), "Llama-2-7b-hf", checkpoint=(13 * GiB, 10 * GiB, "hub"))
    assert report.check("GPU").summary == "Tesla T4, compute capability 7.5, 14.74 GiB"
    assert report.check("GPU").data == {"index": 0} and report.check("free GPU memory").data == {
        "free": T4_TOTAL - 400 * MiB
    }
    fit = report.check("fit")
    assert "on Tesla T4 (14.35 GiB usable): fits [fp16 13.39 GiB, nf4 4.52 GiB]" in fit.summary
    assert fit.fix == "load with nf4 (fp16 needs 13.39 GiB)" and "split" not in fit.data
    cpu = run(machine(gpu=False), "Llama-2-7b-hf", checkpoint=(13 * GiB, 10 * GiB, "hub")).check("fit")
    assert "on a T4 (14.74 GiB; no GPU here, so checked against Colab's): fits" in cpu.summary


def test_cli_text_and_json_on_two_t4s(monkeypatch, capsys):
    import helpers.environment as environment
    from helpers.cli import preflight_main

    monkeypatch.setattr(environment, "take_snapshot", two_gpus)
    monkeypatch.setattr(environment, "checkpoint_size", lambda model: (13 * GiB, 10 * GiB, "hub safetensors files"))
    monkeypatch.setattr(environment, "bitsandbytes_status", lambda device: (True, f"quantizes on {device}"))
    assert preflight_main(["--model", "meta-llama/Llama-2-7b-hf"]) == 0
    text = capsys.readouterr().out
    assert "[ok  ] GPU: 2 GPUs: Tesla T4 ×2" in text and "[ok  ] GPU 1 free memory: 14.35 GiB" in text
    assert "load=fp16 and max_new_tokens=256" in text and "fits across 2 GPUs" in text
    assert "[info] GPU split:" in text
    assert preflight_main(["--model", "meta-llama/Llama-2-7b-hf", "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert [g["index"] for g in checks["fit"]["data"]["gpus"]] == [0, 1]


def test_two_gpu_report_escapes_names_from_the_machine():
    hostile = "<img src=x onerror=alert(1)>"
    report = run(two_gpus(t4(0), t4(1, name=hostile)), "Llama-2-7b-hf", checkpoint=(13 * GiB, 10 * GiB, "hub"))
    html = report._repr_html_()
    assert hostile not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_a_model_still_loaded_is_named_when_the_next_only_fits_after_unloading_it():
    """Preflight counts this process's own tensors as usable (unloading gives them back); load() reads
    free memory. With a 7B from an earlier cell still on the T4, the next 7B 'fits' only after the
    first is unloaded: say so, instead of a pass that load() then refuses."""
    held, kw = 11 * GiB, dict(model="Llama-2-7b-hf", checkpoint=(13 * GiB, 10 * GiB, "hub"), load="nf4")
    snap = machine(free=T4_TOTAL - held - 400 * MiB, reserved=held)
    snap.gpus[0].allocated = held
    report = run(snap, **kw)
    fit_check = report.check("fit")
    assert fit_check.status == "warn" and fit_check.data["held"] == {0: held}
    assert "already holds 11.00 GiB" in fit_check.summary and "load() would refuse it now" in fit_check.summary
    assert "unload(model)" in fit_check.fix
    light = machine(free=T4_TOTAL - 1 * GiB - 400 * MiB, reserved=1 * GiB)
    light.gpus[0].allocated = 1 * GiB  # 1 GiB held: the nf4 7B still fits beside it
    assert run(light, **kw).check("fit").status == "pass"


def _holding(index: int, held: int) -> GPUReadout:
    """A T4 on which this process still holds ``held`` bytes of tensors (an earlier model)."""
    g = t4(index, free=T4_TOTAL - held - 400 * MiB)
    g.allocated = g.reserved = held
    return g


def test_on_two_gpus_a_model_still_on_gpu_0_makes_load_split_what_would_stay_there():
    """2×T4, GPU 0 holding 11 GiB: counting it as free, an nf4 7B stays on GPU 0; load() reads free
    memory and would split it. Preflight says that, not "would refuse"."""
    kw = dict(model="Llama-2-7b-hf", checkpoint=(13 * GiB, 10 * GiB, "hub"), load="nf4")
    check = run(two_gpus(_holding(0, 11 * GiB), t4(1)), **kw).check("fit")
    assert check.status == "warn" and check.data["held"] == {0: 11 * GiB}
    assert "load() would split it across 2 GPUs now instead of keeping it on GPU 0" in check.summary
    assert "would refuse" not in check.summary and "unload(model)" in check.fix


def test_on_two_gpus_a_split_that_only_fits_after_unloading_is_not_a_pass():
    """An earlier model holds 8 GiB on each T4: fp16 7B 'fits across 2 GPUs' only if it is unloaded
    first; load() would refuse it with 6.35 GiB free on each."""
    kw = dict(model="Llama-2-7b-hf", checkpoint=(13 * GiB, 10 * GiB, "hub"), load="fp16")
    check = run(two_gpus(_holding(0, 8 * GiB), _holding(1, 8 * GiB)), **kw).check("fit")
    assert check.status == "warn" and "fits across 2 GPUs" in check.summary
    assert "load() would refuse it now" in check.summary and check.data["held"] == {0: 8 * GiB, 1: 8 * GiB}
    fresh = run(two_gpus(), **kw).check("fit")
    assert fresh.status == "pass" and "held" not in fresh.data


def test_a_plan_too_big_for_colabs_t4_names_kaggles_2xt4_when_it_holds_it(tmp_path):
    """Llama-2-7B fp16 with 4096 new tokens needs 15.4 GiB: not one T4, but split over Kaggle's free
    2×T4 it fits; the fix offers that beside quantizing. A model too big for both gets no such hint."""
    kw = dict(model="Llama-2-7b-hf", checkpoint=(13 * GiB, 10 * GiB, "hub"), load="fp16", max_new_tokens=4096)
    check = run(machine(), **kw).check("fit")
    assert check.status == "fail" and check.data["kaggle_2xt4"] == "fp16"
    assert "Kaggle's free 2×T4 holds it with load='fp16'" in check.fix and "gpus=2" in check.fix
    assert check.fix.index("load=") < check.fix.index("Kaggle")  # quantizing on this T4 comes first
    from helpers.placement.device_plan import reference_configs

    reference_configs()["Llama-2-70b"].save_pretrained(tmp_path)
    huge = run(machine(), model=str(tmp_path), checkpoint=(130 * GiB, 10 * GiB, "local"), load="fp16").check("fit")
    assert huge.status == "fail" and "Kaggle" not in (huge.fix or "") and "kaggle_2xt4" not in huge.data


CODELLAMA = "codellama/CodeLlama-7b-hf"


def test_the_fit_line_takes_the_batch_and_prompt_the_panel_and_load_use(monkeypatch, capsys):
    """CodeLlama-7B fp16 at batch 4 × (512 + 256) tokens is 14.72 GiB: the fit line says so (preflight could only
    check batch 1, 13.41 GiB tight, while the panel after it said DOES NOT FIT); the CLI takes the same."""
    from helpers import estimate

    ckpt = (13 * GiB, 10 * GiB, "hub")
    one = run(machine(), CODELLAMA, checkpoint=ckpt, load="fp16").check("fit")
    four = run(machine(), CODELLAMA, checkpoint=ckpt, load="fp16", batch_size=4).check("fit")
    assert one.data["total"] < four.data["total"] == estimate(CODELLAMA, load="fp16", batch_size=4).total
    assert four.status == "fail" and "with load=fp16, batch_size=4, prompt_tokens=512 and max_new_tokens=256" in (
        four.summary
    )
    longer = run(machine(), CODELLAMA, checkpoint=ckpt, load="nf4", prompt_tokens=4096).check("fit")
    assert longer.data["total"] == estimate(CODELLAMA, load="nf4", prompt_tokens=4096, compute_dtype="fp16").total
    for bad in ({"batch_size": 0}, {"prompt_tokens": "512"}, {"batch_size": True}):
        with pytest.raises(ValueError, match="must be a whole number >= 1"):
            run(machine(), **bad)
    import helpers.environment as environment
    from helpers.cli import preflight_main

    seen = {}
    monkeypatch.setattr(environment, "fit_checks", lambda model, **kw: seen.update(kw) or [])
    monkeypatch.setattr(environment, "checkpoint_size", lambda model: ckpt)
    preflight_main(["--model", CODELLAMA, "--batch", "4", "--prompt-tokens", "768"])
    assert seen["batch_size"] == 4 and seen["prompt_tokens"] == 768
    with pytest.raises(SystemExit):
        preflight_main(["--batch", "0"])
    assert "--batch and --prompt-tokens must be >= 1" in capsys.readouterr().err


def test_the_fit_line_and_fit_current_say_the_same_of_the_card(fake_gpus):
    """Another process holds 3.1 GiB of the T4: preflight judges what is usable now (does not fit), fit(est,
    "current") the card's whole memory (tight). The fit line says both, and what holds the difference."""
    from helpers import estimate, fit
    from helpers.core.memory import snapshot

    cuda = fake_gpus(1, T4_TOTAL)
    cuda.others[0] = int(3.1 * GiB)
    est = estimate(CODELLAMA, load="fp16", device="current")
    assert fit(est, "current").verdict == "tight"
    report = run(snapshot(processes=False), CODELLAMA, checkpoint=(13 * GiB, 10 * GiB, "hub"), load="fp16")
    line = report.check("fit")
    assert line.data["verdict"] == "does not fit" and line.data["card_verdict"] == fit(est, "current").verdict
    assert ": does not fit now (tight on the card's 14.74 GiB, which fit(est, 'current') measures against; " in (
        line.summary
    )
    assert "3.10 GiB held by other processes leave 11.64 GiB usable)" in line.summary
    assert line.fix.startswith("free what other processes hold on the GPU")
    # nothing held elsewhere: one verdict, no note
    cuda.others[0] = 0
    line = run(snapshot(processes=False), CODELLAMA, checkpoint=(13 * GiB, 10 * GiB, "hub"), load="fp16").check("fit")
    assert "card_verdict" not in line.data and "fit(est, 'current')" not in line.summary
