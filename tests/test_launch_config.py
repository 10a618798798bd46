"""The accelerate config and DeepSpeed JSON written from a TrainPlan: read back by accelerate's own config classes,
the DeepSpeed JSON checked against DeepSpeed's documented schema, and DDP and FSDP launched for real on 2 CPU
processes (gloo) through ``accelerate launch`` with the written config."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType
from accelerate.utils.deepspeed import HfDeepSpeedConfig
from conftest import REPO, retry_gloo_connect  # noqa: E402

from helpers.training.distributed import DistributedError, RankReport
from helpers.training.launch_config import launch_plan, launch_qlora, write_launch_config
from helpers.training.plan import TrainPlan

MODEL = "meta-llama/Llama-2-7b-hf"


def _plan(**kw) -> TrainPlan:
    return TrainPlan(**{"model": MODEL, "batch_size": 16, "micro_batch": 2, "seq_len": 512, **kw})


def _accelerate(path: Path) -> ClusterConfig:
    """The config as ``accelerate launch`` reads it (unknown keys and bad enum values raise here)."""
    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig)
    return config


# DeepSpeed's documented config schema (https://www.deepspeed.ai/docs/config-json/), the parts oomkit writes:
# key -> accepted values. DeepSpeed itself is not installed here (and not a requirement), so its DeepSpeedConfig
# class cannot check the file; where it is installed the test below uses that class as well.
DS_TOP = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
          "fp16", "bf16", "zero_optimization", "steps_per_print", "wall_clock_breakdown"}  # fmt: skip
DS_FP16 = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
           "consecutive_hysteresis", "min_loss_scale"}  # fmt: skip
DS_ZERO = {"stage", "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
           "reduce_bucket_size", "contiguous_gradients", "offload_param", "offload_optimizer", "sub_group_size",
           "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
           "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save"}  # fmt: skip
DS_OFFLOAD = {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "ratio", "fast_init"}


def _deepspeed_schema_errors(ds: dict, world: int) -> list[str]:
    """What DeepSpeed's documented schema refuses in ``ds``, ``auto`` resolved as accelerate resolves it."""
    errors = [f"unknown key {k}" for k in set(ds) - DS_TOP]
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    if not all(isinstance(v, int) and v >= 1 for v in (micro, accum)):
        errors.append("micro-batch and accumulation must be positive integers")
    total = micro * accum * world if ds["train_batch_size"] == "auto" else ds["train_batch_size"]
    if total != micro * accum * world:  # DeepSpeed's own rule: train_batch_size = micro × accumulation × world
        errors.append(f"train_batch_size {total} != {micro} × {accum} × {world}")
    for block, allowed in (("fp16", DS_FP16), ("bf16", {"enabled"})):
        errors += [f"{block}.{k} unknown" for k in set(ds[block]) - allowed]
        if not isinstance(ds[block]["enabled"], bool):
            errors.append(f"{block}.enabled must be a bool")
    if ds["fp16"]["enabled"] and ds["bf16"]["enabled"]:
        errors.append("fp16 and bf16 both enabled")
    zero = ds["zero_optimization"]
    errors += [f"zero_optimization.{k} unknown" for k in set(zero) - DS_ZERO]
    if zero["stage"] not in (0, 1, 2, 3):
        errors.append(f"stage {zero['stage']}")
    for key in ("offload_param", "offload_optimizer"):
        if key in zero:
            errors += [f"{key}.{k} unknown" for k in set(zero[key]) - DS_OFFLOAD]
            if zero[key]["device"] not in ("cpu", "nvme", "none"):
                errors.append(f"{key}.device {zero[key]['device']}")
    if "offload_param" in zero and zero["stage"] != 3:
        errors.append("offload_param is ZeRO-3 only")
    return errors


def test_ddp_on_kaggles_two_t4s_writes_what_accelerate_reads(tmp_path):
    written = write_launch_config(_plan(), tmp_path, devices="kaggle-2xt4", strategy="ddp")
    config = _accelerate(written.config_file)
    assert config.distributed_type == DistributedType.MULTI_GPU and config.num_processes == 2
    assert config.mixed_precision == "fp16" and not config.use_cpu  # a T4 is sm_75: no bf16
    assert written.deepspeed_file is None and not (tmp_path / "deepspeed_config.json").exists()
    # batch 16 = micro 2 × accumulation 4 × 2 GPUs
    assert (written.micro_batch, written.accumulation, written.effective_batch) == (2, 4, 16)
    assert written.memory.strategy == "ddp" and written.memory.world_size == 2
    assert written.memory.capacity and written.memory.capacity < 16 * 2**30  # a T4's, to compare against
    text = str(written)
    assert f"accelerate launch --config_file {written.config_file}" in text and "1 machine(s) × 2 GPU" in text


def test_bf16_from_ampere_and_a_plan_asking_bf16_on_a_t4_is_refused(tmp_path):
    written = write_launch_config(_plan(), tmp_path, devices=["a100-80", "a100-80"], strategy="fsdp")
    config = _accelerate(written.config_file)
    assert config.mixed_precision == "bf16" and config.distributed_type == DistributedType.FSDP
    assert config.fsdp_config["fsdp_version"] == 2 and config.fsdp_config["fsdp_offload_params"] is False
    with pytest.raises(DistributedError, match="sm_80"):
        write_launch_config(_plan(precision="bf16"), tmp_path, devices="kaggle-2xt4")


def test_fsdp_shards_where_ddp_replicates(tmp_path):
    ddp = write_launch_config(_plan(load="bf16"), tmp_path / "d", devices=["a100-80"] * 4, strategy="ddp")
    fsdp = write_launch_config(_plan(load="bf16"), tmp_path / "f", devices=["a100-80"] * 4, strategy="fsdp")
    assert fsdp.memory.model_states * 3 < ddp.memory.model_states  # 16Ψ/4 against 16Ψ


@pytest.mark.parametrize(
    ("strategy", "offload", "stage", "where"),
    [("zero2", "optimizer", 2, {"offload_optimizer"}), ("zero3", ["optimizer", "params"], 3,
     {"offload_optimizer", "offload_param"}), ("zero3", None, 3, set())],
)  # fmt: skip
def test_zero_writes_a_deepspeed_json_that_follows_its_schema(tmp_path, strategy, offload, stage, where):
    written = write_launch_config(_plan(), tmp_path, devices="kaggle-2xt4", strategy=strategy, offload=offload)
    config = _accelerate(written.config_file)
    assert config.distributed_type == DistributedType.DEEPSPEED
    assert Path(config.deepspeed_config["deepspeed_config_file"]) == written.deepspeed_file
    ds = json.loads(written.deepspeed_file.read_text())
    assert _deepspeed_schema_errors(ds, written.world_size) == []
    assert ds["zero_optimization"]["stage"] == stage and ds["fp16"]["enabled"] and not ds["bf16"]["enabled"]
    assert {k for k in ds["zero_optimization"] if k.startswith("offload")} == where
    assert all(ds["zero_optimization"][k]["device"] == "cpu" for k in where)
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2 == 16
    assert config.mixed_precision is None  # in the JSON's fp16 block: accelerate refuses it beside a DeepSpeed file
    hf = HfDeepSpeedConfig(str(written.deepspeed_file))  # accelerate's own reader of the DeepSpeed file
    assert hf.is_zero3() == (stage == 3) and hf.is_offload() == bool(where)
    assert written.memory.strategy == strategy and written.memory.world_size == 2
    if importlib.util.find_spec("deepspeed"):  # DeepSpeed's own class, where it is installed
        from deepspeed.runtime.config import DeepSpeedConfig

        DeepSpeedConfig({**ds, "train_batch_size": 16}, world_size=2)


def test_multi_node_writes_the_main_machine_and_counts_every_gpu(tmp_path):
    written = write_launch_config(_plan(), tmp_path, devices="kaggle-2xt4", strategy="zero3", num_machines=2,
                                  machine_rank=1, main_process_ip="10.0.0.1", main_process_port=29500)  # fmt: skip
    config = _accelerate(written.config_file)
    assert (config.num_machines, config.machine_rank, config.num_processes) == (2, 1, 4)
    assert (config.main_process_ip, config.main_process_port) == ("10.0.0.1", 29500)
    assert written.memory.world_size == 4 and (written.micro_batch, written.accumulation) == (2, 2)
    one = write_launch_config(_plan(), tmp_path / "one", devices="kaggle-2xt4", strategy="zero3")
    assert written.memory.model_states < one.memory.model_states  # sharded over 4 GPUs, not 2
    assert "2 machine(s) × 2 GPU" in str(written) and "machine_rank" in str(written)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "zero1"}, "unknown strategy 'zero1'"),
        ({"strategy": "ddp", "offload": "optimizer"}, "DDP .* offloads nothing"),
        ({"strategy": "zero2", "offload": "params"}, "ZeRO-2 does not partition parameters"),
        ({"strategy": "fsdp", "offload": "optimizer"}, "FSDP offloads the parameters"),
        ({"strategy": "zero3", "offload": "disk"}, "unknown offload 'disk'"),
        ({"num_machines": 2}, "main_process_ip"),
        ({"num_machines": 2, "machine_rank": 2, "main_process_ip": "h", "main_process_port": 1}, "ranks are 0 to 1"),
        ({"main_process_port": 70000}, "TCP port"),
        ({"devices": 0}, "whole number >= 1"),
        ({"devices": "cpu"}, "devices: "),
    ],
)
def test_what_cannot_work_is_refused_before_anything_is_written(tmp_path, kwargs, match):
    with pytest.raises(DistributedError, match=match):
        write_launch_config(_plan(), tmp_path, **kwargs)
    assert not list(tmp_path.iterdir())


def test_a_plan_without_a_micro_batch_is_refused(tmp_path):
    with pytest.raises(DistributedError, match="find_micro_batch"):
        write_launch_config(_plan(micro_batch=None), tmp_path)


def test_more_processes_than_gpus_on_a_gpu_machine_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DistributedError, match="devices=2 but this machine has 1 GPU"):
        write_launch_config(_plan(), tmp_path, devices=2)


def test_a_gpu_config_is_not_launched_on_a_cpu_machine(tmp_path, monkeypatch):
    written = write_launch_config(_plan(), tmp_path, devices="kaggle-2xt4", strategy="zero2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DistributedError, match="written for GPUs and this machine has none"):
        launch_plan(written, "helpers.training.distributed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(DistributedError, match="pip install deepspeed"):
            launch_plan(written, "helpers.training.distributed")


def _launch_tiny(tiny_llama, tmp_path, strategy: str, load: str) -> tuple[list[RankReport], float]:
    """Write the config for 2 CPU processes and launch the DDP QLoRA worker through it; the ranks' reports."""
    plan = TrainPlan(str(tiny_llama), load=load, batch_size=4, micro_batch=2, seq_len=32, r=8)
    written = write_launch_config(plan, tmp_path / "config", devices=2, strategy=strategy)
    assert written.on_cpu and _accelerate(written.config_file).num_processes == 2
    started = time.perf_counter()

    def once():
        return retry_gloo_connect(lambda: launch_qlora(written, str(tiny_llama), tmp_path / "ranks", timeout=150,
                                                       steps=4, seq_len=32, micro_batch=2, r=8, learning_rate=1e-3,
                                                       load=load))  # fmt: skip

    try:
        run = once()
    except DistributedError as e:
        # 2 full-suite runs of 6 (2026-11-28) hung here until the timeout, with no rank error; run alone it takes
        # ~10 s and the cause is not found yet: one more try, as for gloo's connect error, and the stopped ranks'
        # stacks (faulthandler, in the error) shown as a warning so the next hang says where it was
        if "ran past timeout" not in str(e):
            raise
        warnings.warn(f"the launch hung and was retried; where its ranks were: {e}", stacklevel=1)
        run = once()
    return run.ranks, time.perf_counter() - started


DEFAULT_PORT = 29500  # accelerate launch's and notebook_launcher's


def test_a_one_machine_launch_meets_on_a_free_port_and_a_written_port_is_kept(tmp_path):
    """Two launches starting together both found 29500 free and met in one rendezvous (a launch here hung
    for 120 s while notebook 05 launched beside it); each now names a port the OS just handed out."""
    plan = TrainPlan("Qwen/Qwen2.5-0.5B", load="nf4", batch_size=4, micro_batch=2, seq_len=32)
    one = write_launch_config(plan, tmp_path / "one", devices=2)
    cmd = one.command("helpers.training.distributed")
    port = int(cmd[cmd.index("--main_process_port") + 1])
    assert port != DEFAULT_PORT and 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: nothing listens there
    fixed = write_launch_config(plan, tmp_path / "fixed", devices=2, main_process_port=29611)
    assert "--main_process_port" not in fixed.command("helpers.training.distributed")  # the config's own port
    assert _accelerate(fixed.config_file).main_process_port == 29611


# DDP through the written config: notebook 05 launches it, tests/test_wheel.py checks its ranks


@pytest.mark.slow
def test_fsdp_launches_through_accelerate_with_the_written_config(tiny_llama, tmp_path):
    """FSDP2 (fully_shard) over gloo on CPU: LoRA on an fp32 base (a 4-bit base needs quant_storage to shard)."""
    ranks, _ = _launch_tiny(tiny_llama, tmp_path, "fsdp", "fp32")
    assert [r.rank for r in ranks] == [0, 1] and {r.backend for r in ranks} == {"gloo"}
    assert all(r.losses[-1] < r.losses[0] and r.peak_rss > 0 for r in ranks)  # the written FSDP config launched
    assert abs(ranks[0].checksum - ranks[1].checksum) < 1e-6 * ranks[0].checksum  # the full adapters agree
    if {r.distributed_type for r in ranks} == {"MULTI_CPU"}:
        pytest.skip(
            "the FSDP config launched and trained on 2 gloo processes, but not sharded: accelerate's "
            "AcceleratorState (accelerate/state.py) turns ACCELERATE_USE_FSDP into DistributedType.FSDP only for "
            "MULTI_GPU/NPU/XPU/... processes; CPU processes stay MULTI_CPU, so prepare() wraps the model in DDP"
        )
    assert {r.distributed_type for r in ranks} == {"FSDP"}


@pytest.mark.slow
def test_a_launch_past_its_timeout_is_stopped_and_said(tmp_path):
    """A rank that hangs (here: sleeps) is stopped at the timeout, with a DistributedError naming it."""
    written = write_launch_config(_plan(), tmp_path, devices=1, strategy="ddp")
    started = time.perf_counter()
    with pytest.raises(DistributedError, match="ran past timeout=3 s"):
        launch_plan(written, "helpers.training.distributed", ["time:sleep", "[3600]"], timeout=3)
    # stopped, not waited for: far under the rank's hour of sleep (a hang guard, not a speed target)
    assert time.perf_counter() - started < 600


def test_a_rank_stopped_by_sigterm_writes_where_it_was(tmp_path):
    """What a launch stopped at its timeout shows (its error keeps the last lines): each rank, terminated,
    writes its stack. Waited for the rank to be running (not a fixed time: a busy machine starts it late)."""
    (tmp_path / "rank_target.py").write_text(
        "import sys, time\n"
        "def ready_then_sleep():\n"
        "    print('ready', file=sys.stderr, flush=True)\n"
        "    time.sleep(3600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    cmd = [sys.executable, "-m", "helpers.training.distributed", "rank_target:ready_then_sleep", "[]"]
    rank = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert rank.stderr.readline().strip() == "ready"
        rank.terminate()
        rest = rank.stderr.read()
    finally:
        rank.kill()
        rank.wait()
    assert "in ready_then_sleep" in rest and "in _main" in rest, rest


@pytest.mark.slow
def test_a_failing_rank_becomes_a_distributed_error_with_its_exception(tmp_path):
    written = write_launch_config(_plan(), tmp_path, devices=1, strategy="ddp")
    with pytest.raises(DistributedError, match="ModuleNotFoundError.*no_such_module"):
        launch_plan(written, "helpers.training.distributed", ["no_such_module:f", "[]"], timeout=600)


def test_accelerates_deepspeed_plugin_takes_the_written_files(tmp_path, monkeypatch):
    """What ``accelerate launch`` does with a DEEPSPEED config, short of starting DeepSpeed: it passes the
    accelerate config's DeepSpeed fields (and mixed_precision, when the YAML sets it) to the ranks, whose
    DeepSpeedPlugin refuses any that the JSON should own, then reads stage, offload and batch from the JSON."""
    from accelerate.utils import DeepSpeedPlugin

    written = write_launch_config(_plan(), tmp_path, devices="kaggle-2xt4", strategy="zero3", offload="params")
    config = _accelerate(written.config_file)
    fields = list(config.deepspeed_config) + (["mixed_precision"] if config.mixed_precision else [])
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(fields).lower())
    plugin = DeepSpeedPlugin(hf_ds_config=config.deepspeed_config["deepspeed_config_file"])
    assert plugin.zero_stage == 3 and plugin.offload_param_device == "cpu"
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == written.accumulation
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join([*fields, "mixed_precision"]))
    with pytest.raises(ValueError, match="will be ignored"):  # the check a mixed_precision in the YAML would fail
        DeepSpeedPlugin(hf_ds_config=config.deepspeed_config["deepspeed_config_file"])


def test_accelerates_fsdp_plugin_takes_the_written_fsdp_config(tmp_path):
    """The fsdp_config's values as accelerate's FullyShardedDataParallelPlugin checks them (accelerate launch
    hands them to the ranks as FSDP_* variables: the key without ``fsdp_``, offload_params as cpu_offload)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    written = write_launch_config(
        _plan(load="bf16"), tmp_path, devices="kaggle-2xt4", strategy="fsdp", offload="params"
    )
    fsdp = {k.removeprefix("fsdp_"): v for k, v in _accelerate(written.config_file).fsdp_config.items()}
    fsdp["cpu_offload"], fsdp["fsdp_version"] = fsdp.pop("offload_params"), fsdp.pop("version")
    plugin = FullyShardedDataParallelPlugin(**fsdp)
    assert plugin.fsdp_version == 2 and plugin.cpu_offload and plugin.reshard_after_forward


def test_offload_moves_states_off_the_gpu_figure(tmp_path):
    """ZeRO-3 with the optimizer and parameters in CPU RAM: the per-GPU bytes drop by exactly those states."""
    plan = _plan(load="bf16")
    kept = write_launch_config(plan, tmp_path / "k", devices="kaggle-2xt4", strategy="zero3")
    moved = write_launch_config(
        plan, tmp_path / "m", devices="kaggle-2xt4", strategy="zero3", offload=["optimizer", "params"]
    )
    states = moved.memory.bytes("states.optimizer") + moved.memory.bytes("states.params")
    assert kept.offloaded_bytes == 0 and moved.offloaded_bytes == states > 0
    assert moved.gpu_bytes == kept.gpu_bytes - states
    assert "per process in CPU RAM (optimizer and params)" in str(moved)


def test_an_offloaded_qlora_optimizer_leaves_the_gpu_for_cpu_ram(tmp_path):
    """The adapters' optimizer states are what ZeRO's offload moves (the estimator's rows under QLoRA)."""
    plan = TrainPlan("meta-llama/Llama-2-7b-hf", batch_size=16, micro_batch=2)
    config = write_launch_config(plan, tmp_path, devices="kaggle-2xt4", strategy="zero3", offload="optimizer")
    moved = config.memory.state_bytes("optimizer")
    assert moved > 0 and config.offloaded_bytes == moved
    assert config.gpu_bytes == config.memory.total - moved
