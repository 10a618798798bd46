"""Which weight files a checkpoint's size counts: only those transformers' from_pretrained would read."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import constants as hub_constants
from transformers.modeling_utils import _get_resolved_checkpoint_files

from helpers.core.memory import DiskReadout, MemorySnapshot, RAMReadout
from helpers.core.sources import (
    SourceError,
    checkpoint_size,
    hub_weight_files,
    shipped_config,
    shipped_configs,
    weight_files,
)
from helpers.core.units import GiB, MiB
from helpers.estimator.core import estimate
from helpers.loading.checks import check_ram_for_loading

GB = 10**9  # hub sizes are in decimal units
REPO = Path(__file__).resolve().parents[1]

COLAB_RAM = RAMReadout(int(12.7 * GiB), 11 * GiB, 1 * GiB, 500 * MiB)  # a fresh free Colab runtime


def colab() -> MemorySnapshot:
    return MemorySnapshot(
        "cuda", [], COLAB_RAM, [DiskReadout("HF cache", "/root/.cache/huggingface/hub", 100 * GiB, 80 * GiB)]
    )


def sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that takes no disk (a stand-in for a 14 GB consolidated.safetensors)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def index(folder: Path, name: str, shards: list[str]) -> None:
    """A ``*.index.json`` mapping one tensor to each shard, as save_pretrained writes it."""
    weight_map = {f"layer{i}.weight": shard for i, shard in enumerate(shards)}
    (folder / name).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def resolved_by_transformers(folder: Path) -> list[Path]:
    """The files from_pretrained itself resolves for a local folder (what weight_files must mirror)."""
    files, _ = _get_resolved_checkpoint_files(str(folder), None, None, None, None, False)
    return [Path(f) for f in files]


def test_a_consolidated_file_beside_the_checkpoint_neither_fails_preflight_nor_refuses_the_load(tmp_path, tiny_llama):
    # Mistral-7B-Instruct-v0.3 ships a 14.5 GB consolidated.safetensors for mistral-inference beside the
    # HF shards; Meta's repos keep their own weights under original/. transformers reads neither.
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    sparse(model / "consolidated.safetensors", 40 * GiB)
    sparse(model / "original" / "consolidated.00.pth", 40 * GiB)
    size = (model / "model.safetensors").stat().st_size
    assert checkpoint_size(str(model)) == (size, size, "local safetensors files")
    check_ram_for_loading(str(model), colab())  # raised LoadRefused: "the largest weight file is 40.00 GiB"


LAYOUTS = {  # folder contents -> what from_pretrained reads
    "single safetensors + consolidated": (["model.safetensors", "consolidated.safetensors"], ["model.safetensors"]),
    "shards + consolidated + original/": (
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors",
         "original/model.safetensors", ("model.safetensors.index.json", ["model-00001-of-00002.safetensors",
                                                                         "model-00002-of-00002.safetensors"])],
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
    ),
    "single file wins over an index": (
        ["model.safetensors", "model-00001-of-00001.safetensors", ("model.safetensors.index.json", ["model-00001-of-00001.safetensors"])],
        ["model.safetensors"],
    ),
    "safetensors win over .bin": (["model.safetensors", "pytorch_model.bin"], ["model.safetensors"]),
    ".bin + training_args.bin": (["pytorch_model.bin", "training_args.bin", "optimizer.bin"], ["pytorch_model.bin"]),
    "sharded .bin": (
        ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "training_args.bin",
         ("pytorch_model.bin.index.json", ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"])],
        ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_files_are_the_files_transformers_resolves(tmp_path, layout):
    files, expected = LAYOUTS[layout]
    for f in files:
        if isinstance(f, tuple):
            index(tmp_path, *f)
        else:
            sparse(tmp_path / f, 1 * MiB)
    assert weight_files(tmp_path) == [tmp_path / f for f in expected] == resolved_by_transformers(tmp_path)
    total, largest, source = checkpoint_size(str(tmp_path))
    assert (total, largest) == (len(expected) * MiB, MiB)
    assert source == ("local safetensors files" if expected[0].endswith(".safetensors") else "local .bin files")


def test_a_sharded_checkpoint_saved_by_transformers_counts_its_shards_only(tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(tmp_path, max_shard_size="1MB")
    sparse(tmp_path / "consolidated.safetensors", 40 * GiB)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and weight_files(tmp_path) == shards == resolved_by_transformers(tmp_path)
    total, largest, _ = checkpoint_size(str(tmp_path))
    assert total == sum(s.stat().st_size for s in shards) and largest == max(s.stat().st_size for s in shards)


def test_config_transformers_weights_names_the_file_to_load(tmp_path, tiny_llama):
    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "transformers_weights": "weights.safetensors"}))
    assert weight_files(tmp_path) == [tmp_path / "weights.safetensors"]


def test_a_folder_without_loadable_weights_says_what_it_holds(tmp_path):
    sparse(tmp_path / "consolidated.safetensors", 40 * GiB)
    with pytest.raises(
        SourceError, match=r"none of model.safetensors, .* is in .*consolidated.safetensors.*does not load"
    ):
        weight_files(tmp_path)
    total, largest, source = checkpoint_size(str(tmp_path))  # size unknown: preflight says so, refuses nothing
    assert total is None and largest is None and "transformers would not find the weights" in source
    check_ram_for_loading(str(tmp_path), colab())


def test_an_index_naming_a_missing_shard_says_the_download_is_incomplete(tmp_path):
    sparse(tmp_path / "model-00001-of-00002.safetensors", MiB)
    index(
        tmp_path,
        "model.safetensors.index.json",
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
    )
    with pytest.raises(
        SourceError, match="lists model-00002-of-00002.safetensors, missing from .*download the checkpoint again"
    ):
        weight_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(SourceError, match="has no weight_map"):
        weight_files(tmp_path)


# -- hub listings (sizes from the file list, nothing downloaded) --------------------------------

MISTRAL_V03 = {  # mistralai/Mistral-7B-Instruct-v0.3's root and sizes, about
    "config.json": 601, "consolidated.safetensors": int(14.5 * GB), "params.json": 202,
    "model-00001-of-00003.safetensors": int(4.95 * GB), "model-00002-of-00003.safetensors": int(5.0 * GB),
    "model-00003-of-00003.safetensors": int(4.55 * GB), "model.safetensors.index.json": 23950,
    "tokenizer.model.v3": 587404, "tokenizer.json": 1961548,
}  # fmt: skip


def fake_hub(monkeypatch, listing: dict[str, int | None]) -> None:
    siblings = [SimpleNamespace(rfilename=name, size=size) for name, size in listing.items()]
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **kw: SimpleNamespace(siblings=siblings))


def test_a_hub_repo_with_consolidated_weights_counts_the_hf_shards_only(monkeypatch):
    fake_hub(monkeypatch, MISTRAL_V03)
    total, largest, source = checkpoint_size("mistralai/Mistral-7B-Instruct-v0.3")
    assert (total, largest, source) == (
        int(4.95 * GB) + int(5.0 * GB) + int(4.55 * GB),
        int(5.0 * GB),
        "hub safetensors files",
    )
    check_ram_for_loading("mistralai/Mistral-7B-Instruct-v0.3", colab())  # refused: "the largest file is 14 GiB"


@pytest.mark.parametrize(
    "names, expected",
    [
        (["model.safetensors", "original/model.safetensors", "consolidated.safetensors"], ["model.safetensors"]),
        (["model.safetensors.index.json", "model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors",
          "original/model-00001-of-00002.safetensors", "model.fp16-00001-of-00002.safetensors"],
         ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]),
        (["pytorch_model.bin", "training_args.bin", "model.safetensors.fp16"], ["pytorch_model.bin"]),
        (["pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
          "training_args.bin"], ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]),
        (["model.safetensors", "pytorch_model.bin"], ["model.safetensors"]),
    ],
)  # fmt: skip
def test_hub_weight_files_follow_transformers_names(names, expected):
    assert hub_weight_files(names) == expected


def test_a_hub_repo_transformers_cannot_load_gives_no_size(monkeypatch):
    fake_hub(monkeypatch, {"consolidated.safetensors": 14 * GB, "original/model.safetensors": 14 * GB})
    total, _, source = checkpoint_size("someone/raw-weights")
    assert total is None and "none of model.safetensors" in source and "at the repo's root" in source
    fake_hub(monkeypatch, {"model.safetensors.index.json": 100, "weights-1.safetensors": 5 * GB})
    total, _, source = checkpoint_size("someone/odd-shards")
    assert total is None and "no shards named like" in source and "local folder" in source
    fake_hub(monkeypatch, {"model.safetensors": None})
    assert checkpoint_size("someone/no-sizes") == (None, None, "the hub gives no size for model.safetensors")


# -- shipped configs: every notebook's default model works offline ----------------------------

NOTEBOOK_DEFAULTS = sorted(
    {
        m
        for nb in sorted((REPO / "notebooks").glob("*.py"))
        for m in re.findall(r'^MODEL = "([^"]+)"', nb.read_text(), re.M)
    }
)
# Instruct variants shipped as their base's config: the same weights' shapes, fine-tuned. Only the fields
# listed differ (from the hub's config.json); none of them changes a tensor's shape.
DERIVED = {
    "codellama/CodeLlama-7b-Instruct-hf": ("codellama/CodeLlama-7b-hf", {}),
    "Qwen/Qwen2.5-1.5B-Instruct": ("Qwen/Qwen2.5-1.5B", {"eos_token_id": 151645, "max_window_layers": 21}),
}


def test_every_notebook_default_model_ships_its_config_and_estimates_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert "codellama/CodeLlama-7b-Instruct-hf" in NOTEBOOK_DEFAULTS and len(NOTEBOOK_DEFAULTS) >= 3
    for model in NOTEBOOK_DEFAULTS:
        assert shipped_config(model) == shipped_configs().get(model) is not None, f"ship {model}'s config.json"
        assert estimate(model, load="nf4").params > 0


@pytest.mark.parametrize("model", DERIVED)
def test_a_derived_config_differs_from_its_base_only_in_what_the_hub_config_says(model):
    base, changes = DERIVED[model]
    expected = {**json.loads(shipped_configs()[base].read_text()), "_name_or_path": model, **changes}
    assert json.loads(shipped_configs()[model].read_text()) == expected
    assert estimate(model, load="fp16").params == estimate(base, load="fp16").params


def test_the_no_config_help_names_the_model_and_every_shipped_config():
    from helpers import no_config_help, shipped_configs

    text = no_config_help("someone/Unshipped-7B")
    assert text.startswith("No estimate for 'someone/Unshipped-7B'") and "local folder holding config.json" in text
    assert all(hub_id in text for hub_id in shipped_configs())


def test_persistent_files_go_to_kaggle_working_on_kaggle(monkeypatch, tmp_path):
    import helpers.core.sources as sources

    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    assert sources.persistent_path("adapter") == Path("adapter")
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")  # what Kaggle's notebook sessions set
    assert sources.persistent_path("adapter") == Path("/kaggle/working/adapter")
    assert sources.persistent_path("adapter", default_dir=tmp_path) == tmp_path / "adapter"  # a chosen folder wins
    assert sources.persistent_path(tmp_path / "mine.jsonl") == tmp_path / "mine.jsonl"
