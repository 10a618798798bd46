"""The live training view: it updates during a real (tiny) run, prints text lines headless, and
ends with one summary line (peak reserved, share of the card, wall time)."""

from __future__ import annotations

from helpers.loading.loader import load
from helpers.training.adapters import prepare_qlora
from helpers.training.data import build_dataset, load_instructions
from helpers.training.finetune import train
from helpers.training.plan import TrainPlan
from helpers.training.view import TrainProgress, TrainView, bounded, format_seconds

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
    assert [s for s, _ in seen[-1].losses] == [1, 2, 3, 4, 5] and "oomkit-loss-line" in seen[-1]._repr_html_()
    assert seen[-1].summary() in seen[-1]._repr_html_()  # the view ends with the summary ...
    assert seen[-1].summary() not in str(result) and "wall time" not in str(result)  # ... said once, not again
    middle = seen[2]
    assert middle.eta is not None and f"step {middle.step}/5" in str(middle) and "ETA" in str(middle)
    html = middle._repr_html_()
    assert "<progress" in html and "tokens/s" in html and "oomkit-table" in html
    # the memory chart grows with the run: one point per step so far, drawn in every update
    assert [s for s, _ in seen[-1].history] == list(range(6)) and all(m > 0 for _, m in seen[-1].history)
    assert len(middle.history) == middle.step + 1 and "<polyline" in html and "process memory per step" in html


def test_headless_train_prints_text_lines_then_one_summary_instead_of_log_dicts(tiny_llama, tmp_path, capsys):
    result = _run(tiny_llama, tmp_path, view="text")
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[oomkit] note:")]
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
    assert (
        "stroke-dasharray" in html
        and "GPU allocated per step: 6.00 GiB now, min 2.00 GiB, max 6.00 GiB of 15.00 GiB" in html
    )
    assert "<svg" not in TrainProgress(step=0, total=10, elapsed=0, steps_done=0, history=history[:1])._repr_html_()


def test_a_long_run_keeps_a_bounded_chart_with_its_first_and_last_step():
    from helpers.training.view import MAX_POINTS

    view = TrainView(lambda p: None)
    for step in range(5 * MAX_POINTS):
        view._history = bounded(view._history, step, step)
    assert len(view._history) <= MAX_POINTS and view._history[0][0] == 0 and view._history[-1][0] == 5 * MAX_POINTS - 1


def _ys(html: str, css: str) -> list[float]:
    line = html.split(f"class='{css}'")[1].split("<polyline points='")[1].split("'")[0]
    return [float(p.split(",")[1]) for p in line.split()]


def test_the_view_draws_a_loss_line_and_a_memory_line_each_with_its_scale():
    """Issue 44 item 4: the loss's history was only in print(result); on a CPU the memory line lay flat on the
    frame's top border (scaled 0 to 1.1 x peak: 1 MiB of change in 1 GiB is invisible) with no scale."""
    mib = 1024**2
    rss = [(0, 1000 * mib), (1, 1001 * mib), (2, 1003 * mib), (3, 1002 * mib)]
    losses = [(1, 2.5), (2, 2.1), (3, 1.7)]
    p = TrainProgress(step=3, total=10, elapsed=3.0, steps_done=3, loss=1.7, process_rss=1002 * mib, history=rss,
                      losses=losses)  # fmt: skip
    html = p._repr_html_()
    assert "loss per step: 1.7000 now, min 1.7000, max 2.5000" in html
    loss = _ys(html, "oomkit-loss-line")
    assert loss[0] < loss[1] < loss[2]  # SVG y grows downward: the falling loss goes down
    memory = _ys(html, "oomkit-sparkline")
    height = 56
    assert min(memory) == 4 and max(memory) == height - 4  # the line spans its own min to max, off the frame
    for css, top, bottom in (
        ("oomkit-loss-line", "2.5000", "1.7000"),
        ("oomkit-sparkline", "1003.00 MiB", "1000.00 MiB"),
    ):
        part = html.split(f"class='{css}'")[1]
        assert f"<span class='oomkit-scale-max'>{top}</span><span class='oomkit-scale-min'>{bottom}</span>" in part


def test_a_flat_line_sits_in_the_middle_and_the_summary_shows_once():
    mib = 1024**2
    p = TrainProgress(step=2, total=2, elapsed=2.0, steps_done=2, process_rss=mib, history=[(0, mib), (1, mib), (2, mib)],
                      finished=True)  # fmt: skip
    html = p._repr_html_()
    assert set(_ys(html, "oomkit-sparkline")) == {28.0}
    assert html.count(p.summary()) == 1 and str(p).count(p.summary()) == 1
