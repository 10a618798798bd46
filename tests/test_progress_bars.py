"""Progress on every long step (issue 44 item 3): watch()'s step counter, answer()'s and the micro-batch search's
bars, a bar that keeps its bar in a narrow column; and find_micro_batch says one number (issue 44 item 7)."""

from __future__ import annotations

import pytest
import torch

from helpers.oom.batch_size import BatchSearch, Trial, find_max_batch_size
from helpers.training.finetune import MicroBatch


class Recorder:
    """Stands in for core.html.progress_bar: what a bar was asked to show."""

    made: list[Recorder] = []

    def __init__(self, total=None, desc="", unit="it", *, disable=False, iterable=None, **kwargs):
        self.total, self.desc, self.unit, self.disable, self.iterable = total, desc, unit, disable, iterable
        self.n, self.postfix, self.closed = 0, [], False
        Recorder.made.append(self)

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.n += 1

    def update(self, n=1):
        self.n += n

    def set_postfix_str(self, text, refresh=True):
        self.postfix.append(text)

    def close(self):
        self.closed = True


@pytest.fixture
def bars(monkeypatch):
    import helpers.leaks.growth as growth
    import helpers.loading.generation as generation
    import helpers.oom.batch_size as batch_size

    Recorder.made = []
    for module in (growth, generation, batch_size):
        monkeypatch.setattr(module, "progress_bar", Recorder)
    return Recorder.made


def test_watch_counts_its_steps_with_the_memory_now(bars):
    from helpers.leaks.growth import watch

    watch(lambda: None, 6, namespace={})
    (counter,) = bars
    assert (counter.desc, counter.total, counter.n, counter.closed, counter.disable) == ("watch", 6, 6, True, False)
    assert len(counter.postfix) == 6 and all(p.endswith("B") for p in counter.postfix)  # a byte figure each step
    watch(lambda: None, 2, namespace={}, progress=False)
    assert bars[-1].disable


def test_watch_closes_its_counter_when_a_step_raises(bars):
    from helpers.leaks.growth import watch

    def step(i):
        if i == 2:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        watch(step, 5, namespace={})
    assert bars[0].n == 2 and bars[0].closed


def test_the_batch_size_search_shows_each_try_when_asked(bars):
    search = find_max_batch_size(lambda b: b <= 5 or (_ for _ in ()).throw(torch.OutOfMemoryError("x")), limit=16,
                                 progress=True)  # fmt: skip
    (bar,) = bars
    assert bar.desc == "batch-size search" and bar.n == len(search.trials) and bar.closed
    assert bar.total == len(search.trials)  # ends full, whatever the bound allowed
    assert any(p.endswith("out of memory") for p in bar.postfix) and any(p.endswith(" ran") for p in bar.postfix)
    find_max_batch_size(lambda b: None, limit=4)
    assert len(bars) == 1  # quiet by default: the benchmark's hundreds of searches print nothing


def test_answer_shows_a_bar_of_its_batches(tiny_llama, bars):
    from helpers.loading.loader import load
    from helpers.training.data import answer

    model, tok, _ = load(str(tiny_llama), load="fp32", check=False)
    answer(model, tok, ["one", "two", "three"], max_new_tokens=2, batch_size=2)
    (bar,) = bars
    assert (bar.desc, bar.total, bar.n, bar.disable) == ("answer", 2, 2, False)


def test_a_notebook_bar_keeps_a_minimum_width_and_wraps_its_figures(monkeypatch):
    import tqdm.auto
    import tqdm.notebook

    from helpers.core.html import BAR_MIN_WIDTH, progress_bar

    monkeypatch.setattr(tqdm.auto, "tqdm", tqdm.notebook.tqdm)
    bar = progress_bar(5, "safe_generate (predicted ~9 min)", "sample")
    try:
        assert bar.container.children[1].layout.min_width == BAR_MIN_WIDTH
        assert bar.container.layout.flex_flow == "row wrap"
    finally:
        bar.close()


def test_find_micro_batch_says_one_number():
    """Issue 44 item 7: the cap 4 ran, so the micro-batch is 4 (no margin); the search's own answer after its
    margin (3) was printed under it as "batch size 3"."""
    search = BatchSearch(max_ok=4, batch_size=3, trials=[Trial(4, True)], limit=4, margin=0.9)
    mb = MicroBatch(micro_batch=4, gradient_accumulation=4, batch_size=16, search=search)
    for shown in (str(mb), mb._repr_html_()):
        assert "micro-batch 4" in shown and "batch size 3" not in shown
    assert "the limit 4 fits" in str(mb)
