"""preflight opens what load() will open of a local folder: a safetensors header longer than its file, a
truncated shard, a missing shard, a pickle .bin (refused unless allow_pickle) and a pickle that imports
code are each a FAIL with the fix, and load() refuses them with the same words instead of a raw error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.core.errors import LoadRefused
from helpers.environment import preflight
from helpers.loading.checks import PICKLE_FIX, REDOWNLOAD, check_plan, weight_file_check
from helpers.loading.loader import load
from helpers.loading.plan import LoadPlan


@pytest.fixture
def folder(tiny_llama, tmp_path) -> Path:
    """A copy of the tiny Llama's folder, to break."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama, dst)
    return dst


def _sharded(folder: Path) -> list[Path]:
    """Re-save the folder's weights as two shards with an index; the shard paths."""
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, folder / shard, metadata={"format": "pt"})
    weight_map = {k: s for s, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return [folder / s for s in shards]


def _refused_by_load(folder: Path, match: str, **plan) -> None:
    """check_plan and load(check=False) both refuse with the check's words, before transformers opens a file."""
    with pytest.raises(LoadRefused, match=match):
        check_plan(LoadPlan(str(folder), load="fp32", **plan))
    with pytest.raises(LoadRefused, match=match):
        load(str(folder), load="fp32", check=False, **plan)


def test_an_intact_folder_passes(folder):
    check = weight_file_check(str(folder))
    assert check.status == "pass" and "1 safetensors file(s), each complete" in check.summary
    _sharded(folder)
    assert weight_file_check(str(folder)).summary.startswith("2 safetensors file(s)")


def test_a_declared_header_of_2_pow_60_bytes_fails(folder):
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes((2**60).to_bytes(8, "little") + raw[8:])
    check = weight_file_check(str(folder))
    assert check.status == "fail" and "declares a header of 1,152,921,504,606,846,976 bytes" in check.summary
    assert check.fix == REDOWNLOAD
    _refused_by_load(folder, "declares a header of")


def test_a_truncated_shard_fails_and_names_the_shard(folder):
    shards = _sharded(folder)
    raw = shards[1].read_bytes()
    shards[1].write_bytes(raw[:-100])
    check = weight_file_check(str(folder))
    assert check.status == "fail" and shards[1].name in check.summary and "is truncated" in check.summary
    assert "the file holds" in check.summary and check.fix == REDOWNLOAD
    _refused_by_load(folder, "is truncated")


def test_a_header_cut_inside_itself_and_bytes_after_the_data_fail(folder):
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    f.write_bytes(raw[: 8 + n // 2])  # the download stopped inside the header
    assert "declares a header of" in weight_file_check(str(folder)).summary
    f.write_bytes(raw + b"\0" * 16)  # safetensors refuses trailing bytes too
    assert "has bytes after its last tensor" in weight_file_check(str(folder)).summary


def test_a_missing_shard_fails(folder):
    shards = _sharded(folder)
    shards[0].unlink()
    check = weight_file_check(str(folder))
    assert check.status == "fail" and shards[0].name in check.summary and check.fix == REDOWNLOAD


def test_a_pickle_bin_is_refused_unless_allowed(folder):
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    check = weight_file_check(str(folder))
    assert check.status == "fail" and "pytorch_model.bin is a pickle checkpoint" in check.summary
    assert check.fix == PICKLE_FIX and "allow_pickle=True" in check.fix
    _refused_by_load(folder, "is a pickle checkpoint")
    allowed = weight_file_check(str(folder), allow_pickle=True)
    assert allowed.status == "pass" and "pickle (allowed)" in allowed.summary
    check_plan(LoadPlan(str(folder), load="fp32", allow_pickle=True))  # no refusal: plain tensors


class _RunsCode:
    def __reduce__(self):  # unpickling this would call print: code, not weights
        return (print, ("unpickled",))


def test_a_pickle_that_imports_code_is_refused_even_when_pickles_are_allowed(folder):
    (folder / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(2), "x": _RunsCode()}, folder / "pytorch_model.bin")
    check = weight_file_check(str(folder), allow_pickle=True)
    assert check.status == "fail" and "holds code, not only weights: it imports builtins.print" in check.summary
    assert "do not load this file" in check.fix
    _refused_by_load(folder, "holds code", allow_pickle=True)


def test_preflight_shows_the_fail_with_its_fix(folder):
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    report = preflight(str(folder), load="fp32")
    check = report.check("weight files")
    assert check.status == "fail" and "is truncated" in check.summary and not report.ok
    assert "fix: download or copy the checkpoint again" in str(report)
    assert preflight(str(folder), load="fp32", allow_pickle=False).check("weight files").status == "fail"


def test_hub_ids_and_folders_without_weights_are_not_opened(tmp_path):
    assert weight_file_check("Qwen/Qwen2.5-0.5B") is None
    (tmp_path / "config.json").write_text("{}")
    assert weight_file_check(str(tmp_path)) is None


def test_the_cli_fails_a_pickle_folder_unless_allowed(folder, capsys):
    from helpers.cli import main

    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    assert main(["preflight", "--model", str(folder), "--load", "fp32"]) == 1
    assert "pytorch_model.bin is a pickle checkpoint" in capsys.readouterr().out
    main(["preflight", "--model", str(folder), "--load", "fp32", "--allow-pickle"])
    assert "weight files: 1 pickle (allowed) file(s), each complete" in capsys.readouterr().out


def test_a_truncated_pickle_is_refused_when_pickles_are_allowed(folder):
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    raw = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(raw[: len(raw) // 2])  # a zip without its directory
    check = weight_file_check(str(folder), allow_pickle=True)
    assert check.status == "fail" and "cannot be read as a torch checkpoint" in check.summary
    assert check.fix == REDOWNLOAD


def test_a_legacy_pickle_is_left_to_torch_when_pickles_are_allowed(folder):
    """torch.save's pre-zip format cannot be scanned statically: allowed, torch.load's weights_only judges it."""
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert weight_file_check(str(folder), allow_pickle=True).status == "pass"
    assert weight_file_check(str(folder)).status == "fail"
