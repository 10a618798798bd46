"""The live training view: it updates during a real (tiny) run, prints text lines headless, and
ends with one summary line (peak reserved, share of the card, wall time)."""

from __future__ import annotations

from helpers.loading.loader import load
from helpers.training.adapters import prepare_qlora
from helpers.training.data import build_dataset, load_instructions
from helpers.training.finetune import train
from helpers.training.plan import TrainPlan
from helpers.training.view import TrainProgress, TrainView, format_seconds

ROWS = load_instructions()[:24]


def _run(tiny_llama, tmp_path, **train_kw):
    plan = TrainPlan(str(tiny_llama), seq_len=64, batch_size=2, micro_batch=2, max_steps=5, save_steps=5,
                     logging_steps=1, output_dir=str(tmp_path / "run"), learning_rate=1e-3, warmup_steps=0, r=4,
                     alpha=8)  # fmt: skip
    model, tok, _ = load(plan.load_plan())
    model, _ = prepare_qlora(model, plan)
    return train(model, tok, plan, build_dataset(tok, ROWS, plan.seq_len), **train_kw)


def test_the_view_updates_during_a_run_and_ends_with_the_summary(tiny_llama, tmp_path):
    seen: list[TrainProgress] = []
    view = TrainView(seen.append, min_interval=0)
    result = _run(tiny_llama, tmp_path, callbacks=[view])
    assert view.updates == len(seen) >= 3  # begin, every step, end
    steps = [p.step for p in seen]
    assert steps == sorted(steps) and steps[-1] == 5 and seen[-1].total == 5
    assert seen[-1].finished and not any(p.finished for p in seen[:-1])
    assert all(p.loss is not None for p in seen[2:])  # the loss logged each step shows from step 1 on
    assert seen[-1].tokens and seen[-1].tokens_per_second > 0  # Trainer counted the input tokens
    assert result.progress is seen[-1]  # the run's result keeps the summary
    assert "wall time" in str(result).splitlines()[-1]
    middle = seen[2]
    assert middle.eta is not None and f"step {middle.step}/5" in str(middle) and "ETA" in str(middle)
    html = middle._repr_html_()
    assert "<progress" in html and "tokens/s" in html and "oomkit-table" in html
    # the memory chart grows with the run: one point per step so far, drawn in every update
    assert [s for s, _ in seen[-1].history] == list(range(6)) and all(m > 0 for _, m in seen[-1].history)
    assert len(middle.history) == middle.step + 1 and "<polyline" in html and "process memory per step" in html


def test_headless_train_prints_text_lines_then_one_summary_instead_of_log_dicts(tiny_llama, tmp_path, capsys):
    result = _run(tiny_llama, tmp_path, view="text")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 0/5") and any(line.startswith("step 5/5") for line in lines)
    assert len(lines) >= 3 and lines[-1] == result.progress.summary() and "wall time" in lines[-1]
    assert not any("{'loss'" in line for line in lines)  # Trainer's raw log dicts give way to the view


def test_train_without_a_view(tiny_llama, tmp_path, capsys):
    assert _run(tiny_llama, tmp_path, view=False).progress is None
    assert "step 0/5" not in capsys.readouterr().out


def test_summary_names_peak_reserved_and_the_share_of_the_card():
    gib = 1024**3
    p = TrainProgress(step=60, total=60, elapsed=192.4, steps_done=60, loss=1.2, tokens=96_000, allocated=5 * gib,
                      peak_allocated=6 * gib, peak_reserved=9 * gib, capacity=15 * gib, device="Tesla T4",
                      finished=True)  # fmt: skip
    assert p.summary() == "peak reserved 9.00 GiB = 60% of the 15.00 GiB card (Tesla T4); wall time 3:12 for 60 steps"
    assert str(p).startswith("trained to step 60/60: peak reserved")
    running = TrainProgress(step=15, total=60, elapsed=30.0, steps_done=10, loss=2.0, tokens=6000)
    assert running.eta == 135.0 and running.tokens_per_second == 200.0
    assert "step 15/60 · 0:30 elapsed, ETA 2:15 · loss 2.0000 · 200 tokens/s" in str(running)
    assert format_seconds(3723) == "1:02:03" and format_seconds(None) == "?"


def test_a_bad_display_is_refused():
    import pytest

    with pytest.raises(ValueError, match="display must be"):
        TrainView("fancy")


def test_in_a_notebook_one_output_is_updated_in_place(monkeypatch):
    import types

    import IPython.display

    import helpers.training.view as train_view

    shown, updates = [], []
    handle = types.SimpleNamespace(update=lambda bundle, raw: updates.append(bundle))
    monkeypatch.setattr(train_view, "ipython", lambda: types.SimpleNamespace(kernel=object()))
    monkeypatch.setattr(IPython.display, "display", lambda bundle, raw, display_id: shown.append(bundle) or handle)
    view = TrainView(min_interval=0)
    for step in range(3):
        view._show(TrainProgress(step=step, total=2, elapsed=step, steps_done=step))
    assert len(shown) == 1 and len(updates) == 2 and view.updates == 3  # one display, updated twice
    assert "<progress value='2' max='2'" in updates[-1]["text/html"] and updates[-1]["text/plain"].startswith(
        "step 2/2"
    )


def test_the_memory_chart_draws_each_point_and_the_cards_limit():
    gib = 1024**3
    history = [(0, 2 * gib), (1, 5 * gib), (2, 6 * gib)]
    p = TrainProgress(step=2, total=10, elapsed=4.0, steps_done=2, allocated=6 * gib, peak_allocated=6 * gib,
                      peak_reserved=7 * gib, capacity=15 * gib, device="Tesla T4", history=history)  # fmt: skip
    html = p._repr_html_()
    points = html.split("<polyline points='")[1].split("'")[0].split()
    assert len(points) == 3 and float(points[0].split(",")[1]) > float(points[2].split(",")[1])  # rises as it grows
    assert "stroke-dasharray" in html and "GPU allocated per step: 6.00 GiB now, peak 6.00 GiB of 15.00 GiB" in html
    assert "<svg" not in TrainProgress(step=0, total=10, elapsed=0, steps_done=0, history=history[:1])._repr_html_()


def test_a_long_run_keeps_a_bounded_chart_with_its_first_and_last_step():
    from helpers.training.view import MAX_POINTS

    view = TrainView(lambda p: None)
    for step in range(5 * MAX_POINTS):
        view._remember(step, step)
    assert len(view._history) <= MAX_POINTS and view._history[0][0] == 0 and view._history[-1][0] == 5 * MAX_POINTS - 1
