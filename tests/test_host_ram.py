"""Host RAM per process before a multi-process launch: every rank loads its own copy."""

from __future__ import annotations

import pytest

import helpers
from helpers.core.devices import MACHINE_RAM
from helpers.core.units import GiB, MiB
from helpers.loading.host_ram import PROCESS_RUNTIME_RAM, RankRamError, rank_ram
from helpers.training.distributed import DistributedError


def _bin_checkpoint(folder, size: int):
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"\0" * size)
    return folder


def test_safetensors_ranks_share_the_page_cache_and_hold_only_their_runtime(tiny_llama):
    r = rank_ram(str(tiny_llama), 2, machine="kaggle-2xt4")
    assert r.checkpoint == 0 and r.per_rank == PROCESS_RUNTIME_RAM
    assert r.total == 2 * PROCESS_RUNTIME_RAM and r.available == MACHINE_RAM["kaggle-2xt4"]
    assert r.fits and r.fix is None and r.check().status == "pass"
    assert "2 processes" in str(r) and "kaggle-2xt4" in str(r)


def test_bin_shards_are_unpickled_once_per_rank_and_the_fix_says_safetensors(tmp_path):
    folder = _bin_checkpoint(tmp_path / "m", 4 * MiB)
    one = rank_ram(str(folder), 1, machine=GiB)
    three = rank_ram(str(folder), 3, machine=GiB)
    assert one.checkpoint == three.checkpoint == int(4 * MiB * 1.2)  # load_checks' pickle copy factor
    assert three.total == 3 * one.per_rank
    tight = rank_ram(str(folder), 3, machine=3 * one.per_rank)  # the OS and the launcher need a share too
    assert not tight.fits and tight.check().status == "fail"
    assert tight.fix.startswith("a safetensors checkpoint") and "2 process(es)" in tight.fix


def test_cpu_offload_counts_per_process_and_fewer_processes_is_offered(tiny_llama):
    r = rank_ram(str(tiny_llama), 4, machine=2 * GiB, offloaded=512 * MiB)
    assert r.per_rank == PROCESS_RUNTIME_RAM + 512 * MiB and not r.fits
    assert "no CPU offload" in r.fix and "instead of 4" in r.fix
    assert "<table" in r._repr_html_() and "fix:" in r._repr_html_()


@pytest.mark.parametrize(("processes", "machine"), [(0, "current"), (True, "current"), (2, "dgx"), (2, -5)])
def test_bad_arguments_say_what_to_pass(tiny_llama, processes, machine):
    with pytest.raises(RankRamError, match="processes is how many|machine is 'current'"):
        rank_ram(str(tiny_llama), processes, machine=machine)


def test_the_written_config_carries_the_check_and_launch_refuses_what_ram_cannot_hold(tiny_llama, tmp_path):
    config = helpers.write_launch_config(helpers.TrainPlan(str(tiny_llama), batch_size=4, micro_batch=1), tmp_path,
                                         devices=2)  # fmt: skip
    assert config.host_ram is not None and config.host_ram.processes == 2 and config.host_ram.fits
    assert "host RAM: 2 processes" in str(config)
    config.host_ram.runtime = 10**15  # a rank that no machine holds: refused before any process starts
    with pytest.raises(DistributedError, match="not launched: 2 processes .* do not fit"):
        helpers.launch_plan(config, "helpers.training.distributed")
