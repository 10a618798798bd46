"""What fits for my model: fits_table(model) and `python -m helpers fits MODEL`."""

from __future__ import annotations

import json

import pytest

from helpers.cli import main
from helpers.core.units import GiB
from helpers.core.vocab import LOAD_MODES
from helpers.placement.device_map import PlacementError
from helpers.placement.fits import ModelFits, fits_table, verdict_fill


@pytest.fixture(scope="module")
def llama7b() -> ModelFits:
    return fits_table("Llama-2-7b-hf", tokens=2048)


def test_every_load_mode_on_every_machine_with_weights_kv_and_total(llama7b):
    assert [r.load for r in llama7b.rows] == list(LOAD_MODES)
    assert llama7b.machines[:5] == ["T4", "2×T4 (Kaggle)", "L4", "A100 40GB", "A100 80GB"]
    fp16 = next(r for r in llama7b.rows if r.load == "fp16")
    nf4 = next(r for r in llama7b.rows if r.load == "nf4")
    assert 12 * GiB < fp16.weights < 13 * GiB and 3 * GiB < nf4.weights < 4 * GiB
    assert fp16.kv_cache == nf4.kv_cache == 1 * GiB  # 2048 tokens x 32 layers x 4096 x 2 (K, V) x 2 bytes
    assert fp16.total > fp16.weights + fp16.kv_cache
    assert str(fp16.cells["T4"]).startswith("tight") and str(nf4.cells["T4"]).startswith("fits")
    assert next(r for r in llama7b.rows if r.load == "fp32").cells["T4"].word == "does not fit"
    assert llama7b.best("T4") == "int8" and llama7b.best("A100 80GB") == "fp32"


def test_more_tokens_mean_a_larger_kv_cache():
    short, long = (
        fits_table("Llama-2-7b-hf", tokens=512, loads=("nf4",)),
        fits_table("Llama-2-7b-hf", tokens=4096, loads=("nf4",)),
    )
    assert long.rows[0].kv_cache == 8 * short.rows[0].kv_cache
    assert "KV @ 4096 tok" in long.header()


def test_it_reads_as_text_markdown_and_coloured_html(llama7b):
    assert str(llama7b).startswith("What fits for") and "tight (96%)" in str(llama7b)
    assert llama7b.markdown().splitlines()[0].startswith("| load | weights | KV @ 2048 tok | total | T4 |")
    html = llama7b._repr_html_()
    for word in ("fits", "tight", "does not fit"):  # a heatmap: each verdict on its level's fill
        assert f"background:{verdict_fill(word)};color:#ffffff" in html
    assert "<td class='oomkit-num' style='text-align:right;white-space:nowrap'>12.55 GiB</td>" in html


def test_a_local_model_folder_works(tiny_llama):
    table = fits_table(str(tiny_llama), tokens=64, loads=("fp16", "nf4"))
    assert all(c.word == "fits" for r in table.rows for c in r.cells.values())


def test_bad_tokens_are_refused():
    with pytest.raises(PlacementError, match="tokens is the sequence length"):
        fits_table("Llama-2-7b-hf", tokens=0)


def test_the_readme_table_without_a_model_is_unchanged():
    assert fits_table().markdown().startswith("| model | load | T4 |")


def test_cli_prints_the_table_and_json(capsys):
    """``python -m helpers fits`` (its entry point is tests/test_cli.py's; here in this process, seconds cheaper)."""
    run = ["fits", "Llama-2-7b-hf", "--tokens", "1024"]
    assert main(run) == 0
    out = capsys.readouterr().out
    assert out.startswith("What fits for") and "KV @ 1024 tok" in out and "nf4" in out
    assert main([*run, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tokens"] == 1024 and [r["load"] for r in data["rows"]] == list(LOAD_MODES)
    assert main([*run[:1], "no/such-model-xyz", "--tokens", "1"]) == 2
    assert "error:" in capsys.readouterr().err
