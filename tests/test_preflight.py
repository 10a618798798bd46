"""Preflight verdicts on simulated machines: readouts are passed in, torch is never patched."""

import json
import subprocess
import sys

import psutil
import pytest

from helpers.environment import COLAB_GPU_FIX, preflight
from helpers.memory import DiskReadout, GPUProcess, GPUReadout, MemorySnapshot, RAMReadout
from helpers.sources import checkpoint_size
from helpers.units import GiB, MiB

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
