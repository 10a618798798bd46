"""The "will it fit" views: time beside memory in the verdict and its fixes, one verdict everywhere, narrow tables.

Every time figure here is :func:`helpers.estimator.timing.estimate_time`'s for the same plan (issue 46 item 3),
and every verdict the placement decision's (issue 44 item 7).
"""

from __future__ import annotations

import pytest

from helpers.estimator.core import estimate
from helpers.estimator.timing import estimate_time, offload_seconds
from helpers.placement.machine_fit import fit


@pytest.fixture(scope="module")
def qwen7b_t4():
    return fit(estimate("Qwen2.5-7B", load="fp16", device="t4"), "t4")


def _decode_seconds(est, device: str) -> float:
    batch = est.inputs["batch_size"]
    return batch / estimate_time(est, device, batches=(batch,)).decode_tokens_per_s[batch]


def test_the_verdict_shows_the_plans_speed_from_estimate_time(qwen7b_t4):
    assert qwen7b_t4.seconds == pytest.approx(_decode_seconds(qwen7b_t4.estimate, "t4"))
    rate = f"~{1 / qwen7b_t4.seconds:,.1f} tokens/s"
    assert f"time: {rate}" in str(qwen7b_t4) and rate in qwen7b_t4._repr_html_()
    assert qwen7b_t4.to_dict()["seconds"] == qwen7b_t4.seconds


def test_each_fix_shows_its_speed_and_how_it_compares(qwen7b_t4):
    by = {s.change: s for s in qwen7b_t4.suggestions}
    int8, nf4 = by["load=int8"], by["load=nf4"]
    assert int8.seconds == pytest.approx(_decode_seconds(int8.estimate, "t4"))
    assert nf4.seconds == pytest.approx(_decode_seconds(nf4.estimate, "t4"))
    assert int8.seconds > qwen7b_t4.seconds and nf4.seconds > qwen7b_t4.seconds  # bitsandbytes' kernels are slower
    slower = int8.seconds / qwen7b_t4.seconds
    assert f"~{1 / int8.seconds:,.1f} tokens/s, {slower:.1f}x slower" in str(qwen7b_t4)
    assert f"{slower:.1f}x slower" in qwen7b_t4._repr_html_()


def test_an_offload_fix_adds_the_pcie_copy_of_its_offloaded_layers(qwen7b_t4):
    off = next(s for s in qwen7b_t4.suggestions if getattr(s, "kind", "") == "offload")
    copied = offload_seconds(off.plan.offloaded("cpu"), off.plan.offloaded("disk"))
    assert copied > 0
    assert off.seconds == pytest.approx(_decode_seconds(off.estimate, "t4") + copied)
    assert f"~{copied * 1000:.0f} ms/token" in off.plan.slowdown  # the placement's own line: the same figure


def test_a_split_runs_at_one_cards_speed():
    from helpers.placement.machine_fit import device_fixes

    est = estimate("Qwen2.5-7B", load="fp32", device="t4")
    (split,) = device_fixes(est, ["t4"] * 4)
    assert split.kind == "split" and split.seconds == pytest.approx(_decode_seconds(est, "t4"))


def test_a_training_plan_is_timed_per_lora_step():
    from helpers.estimator.training import LoraTraining

    est = estimate("Qwen2.5-7B", load="nf4", device="t4", training=LoraTraining(seq_len=4096, micro_batch=8))
    v = fit(est, "t4")
    assert v.seconds == pytest.approx(estimate_time(est, "t4").step_seconds)
    assert "per LoRA step" in v.time
    for s in v.suggestions:
        if s.seconds is not None:
            assert s.seconds == pytest.approx(estimate_time(s.estimate, "t4").step_seconds)


def test_a_byte_budget_is_not_timed():
    v = fit(estimate("Qwen2.5-0.5B", load="fp16", device="t4"), 8 << 30)
    assert v.seconds is None and "time:" not in str(v)


# ----------------------------------------------------------------------------- one verdict per question (issue 44 item 7)


def test_estimate_fits_and_preflight_give_one_verdict_for_qwen7b_fp16_on_a_t4(capsys):
    """The estimate fits the card (14.69 of 14.74 GiB) but transformers' placement leaves a layer for the CPU,
    which load() refuses: fit(), `estimate` (exit 1), `fits` and preflight all say it does not fit."""
    from helpers.cli import main
    from helpers.core.vocab import DOES_NOT_FIT
    from helpers.environment import preflight
    from helpers.placement.fits import fits_table

    v = fit(estimate("Qwen2.5-7B", load="fp16", device="t4"), "t4")
    assert v.verdict == DOES_NOT_FIT and "CPU RAM" in v.note
    assert main(["estimate", "Qwen2.5-7B", "--load", "fp16", "--device", "t4"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    row = next(r for r in fits_table("Qwen2.5-7B", loads=("fp16",)).rows)
    assert row.cells["T4"].word == DOES_NOT_FIT
    assert preflight("Qwen2.5-7B", load="fp16").check("fit").status == "fail"


def test_a_machine_that_splits_it_says_so_in_every_view():
    """Kaggle's 2×T4: load() splits the fp16 7B over both cards; fit() and the fits table say the same."""
    from helpers.placement.fits import fits_table

    v = fit(estimate("Qwen2.5-7B", load="fp16", device="t4"), "kaggle-2xt4")
    assert v.fits and v.where.startswith("split over 2 GPUs")
    cell = next(r for r in fits_table("Qwen2.5-7B", loads=("fp16",)).rows).cells["2×T4 (Kaggle)"]
    assert (cell.word, cell.share) == (v.verdict, v.placed_bytes / v.capacity)


def test_tokens_past_the_context_do_not_fit(tiny_llama):
    """The demo's 512 + 64 tokens on the 512-context tiny model: the estimate's note and fit() agree."""
    from helpers.core.vocab import DOES_NOT_FIT
    from helpers.placement.fits import fits_table

    est = estimate(str(tiny_llama), load="fp16", device="t4", prompt_tokens=512, max_new_tokens=64)
    assert any("past this model's context of 512" in w for w in est.warnings)
    v = fit(est, "t4")
    assert v.verdict == DOES_NOT_FIT and "past this model's context of 512" in v.note
    assert v.suggestions and all(s.estimate.inputs["prompt_tokens"] + s.estimate.inputs["max_new_tokens"] <= 512
                                 for s in v.suggestions)  # fmt: skip
    assert fit(est.replace(prompt_tokens=448), "t4").verdict != DOES_NOT_FIT  # 512 tokens: within it
    table = fits_table(str(tiny_llama), tokens=576, loads=("fp16",))
    assert all(c.word == DOES_NOT_FIT for c in table.rows[0].cells.values())


def test_fixes_that_still_do_not_fit_come_last_greyed_and_labelled(qwen7b_t4):
    from helpers.core.vocab import FITS

    words = [s.verdict_on(qwen7b_t4.capacity) for s in qwen7b_t4.suggestions]
    assert FITS in words and words != [FITS] * len(words)
    first_not = next(i for i, w in enumerate(words) if w != FITS)
    assert all(w != FITS for w in words[first_not:])  # none that fits ranks after one that does not
    html = qwen7b_t4._repr_html_()
    assert html.count("still does not fit") == len(words) - first_not
    assert html.count("opacity:0.6") == 3 * (len(words) - first_not)  # each cell of those rows greyed
    lines = str(qwen7b_t4).splitlines()
    assert all("still does not fit" in line for line in lines[-(len(words) - first_not) :])


# ----------------------------------------------------------------------------- narrow columns (issue 44 item 1)


def test_the_fixes_table_is_three_wrapping_columns(qwen7b_t4):
    html = qwen7b_t4._repr_html_()
    table = html[html.index("<table") :]
    assert table.count("<th") == 3  # #, change, once made: the detail folded, nothing cut to "fi"
    assert "<details><summary>where, cost</summary>" in table and "overflow-wrap:anywhere" in table
    assert "white-space:nowrap" not in table.split("</caption>", 1)[1]  # every cell may wrap


def test_the_fits_grid_has_machines_as_rows_and_escapes_names(tmp_path, tiny_llama):
    import shutil

    from helpers.placement.fits import FITS_DEVICES, fits_table

    odd = tmp_path / "<b>model"
    shutil.copytree(tiny_llama, odd)
    html = fits_table(str(odd), tokens=64, loads=("fp16", "nf4"))._repr_html_()
    assert "<b>model" not in html.replace("<b>What", "") and "&lt;b&gt;model" in html
    grid = html[html.index("class='oomkit-fits oomkit-heatmap'") :]
    assert grid.count("<tr>") == 1 + len(FITS_DEVICES)  # the header, then one row per machine
    assert "padding:2px 3px" in html and "white-space:nowrap" not in grid.split("</tr>", 1)[1]


# ----------------------------------------------------------------------------- checkpoints saved quantized


def test_fits_table_estimates_a_prequantized_repo_as_saved():
    from helpers.placement.fits import fits_table

    table = fits_table("Qwen/Qwen3-8B-FP8")
    assert [r.load for r in table.rows] == ["fp8 as saved"]
    est = estimate("Qwen/Qwen3-8B-FP8", load="auto", device=None, prompt_tokens=768 - 256, max_new_tokens=256)
    assert table.rows[0].total == est.total
    assert table.rows[0].cells["A100 80GB"].word == "fits"
    assert "fp8 as saved" in str(table) and max(map(len, str(table).splitlines())) <= 80


def test_the_spill_fix_never_offers_another_load_mode_to_a_repo_saved_quantized():
    from helpers.placement.decision import spill_fix

    fix = spill_fix(estimate("Qwen/Qwen3-8B-FP8", load="auto", device="t4"))
    assert "int8" not in fix and "load='nf4'" in fix and "original (unquantized)" in fix
    assert spill_fix(estimate("Qwen2.5-7B", load="fp16", device="t4")).startswith("load='int8'")


def test_the_readme_table_is_a_heatmap_of_few_columns_and_fits_80_columns():
    from helpers.placement.fits import fits_table, verdict_fill

    table = fits_table(loads=("nf4", "fp16"), machines={"T4": ["t4"], "2×T4": "kaggle-2xt4"})
    html = table._repr_html_()
    grid = html[html.index("<table") :]
    assert grid.count("<tr>") == 1 + 3 * 2 and grid.split("</tr>", 1)[0].count("<th") == 3  # model/load x 2 machines
    assert f"background:{verdict_fill('does not fit')}" in grid and "class='oomkit-heat'" in grid
    assert max(map(len, str(table).splitlines())) <= 80
    assert table.cell("Llama-2-70b", "fp16", "T4") == "does not fit"


def test_a_fits_cell_under_the_card_never_reads_100_percent():
    from helpers.placement.fits import FitsCell

    assert str(FitsCell("tight", 0.996)) == "tight (99%)"  # was "tight (100%)" at 99.6 %
    assert str(FitsCell("fits", 0.5)) == "fits (50%)"
