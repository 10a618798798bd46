"""explain_oom on real OOM messages copied from public issue trackers (tests/data/oom_messages.jsonl).

Each entry: the text as the reporter pasted it, its source, every figure it states (bytes, 1024-based as
PyTorch prints them, MPS's "GB" included), and the cause where the figures settle it (null otherwise).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from helpers.oom.causes import CAUSES
from helpers.oom.diagnosis import explain_oom
from helpers.oom.messages import is_oom_text

CORPUS = Path(__file__).parent / "data" / "oom_messages.jsonl"
ENTRIES = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]
FIGURES = {
    "requested", "total", "free", "allocated", "reserved", "reserved_unallocated", "this_process",
    "process_cap", "mps_allocated", "other_allocations", "max_allowed", "requested_at_least",
    "kv_cache_needed", "kv_cache_available",
}  # fmt: skip
COUNTS = {"max_seq_len", "kv_cache_tokens", "max_len_that_fits"}  # token counts an entry states (vLLM), not bytes


def _id(entry: dict) -> str:
    return entry["source"].removeprefix("https://github.com/")


def test_the_corpus_is_large_sourced_and_well_formed():
    assert len(ENTRIES) >= 60
    kinds = Counter(e["kind"] for e in ENTRIES)
    assert {"cuda", "rocm", "xpu", "mps", "cpu", "colab", "cublas", "cudnn", "nccl"} <= set(kinds)
    # other frameworks' and runners' memory failures (issue 47 item 5), each in several real messages
    for kind in ("transformers_dispatch", "vllm_kv", "directml", "tensorflow", "jax", "npu"):
        assert kinds[kind] >= 2, kind
    for e in ENTRIES:
        assert e["source"].startswith("https://"), e
        assert set(e["figures"]) <= FIGURES, e["figures"]
        assert all(isinstance(v, int) and v >= 0 for v in e["figures"].values())
        assert e["cause"] is None or e["cause"] in CAUSES
        assert set(e.get("counts", {})) <= COUNTS
    assert len({e["text"] for e in ENTRIES}) == len(ENTRIES)  # no duplicates


@pytest.mark.parametrize("entry", ENTRIES, ids=[_id(e) for e in ENTRIES])
def test_every_real_message_is_read(entry):
    text = entry["text"]
    assert is_oom_text(text)
    report = explain_oom(text)
    assert not report.not_oom and report.form != "unknown"
    for name, expected in entry["figures"].items():
        assert getattr(report, name) == expected, f"{name}: {getattr(report, name)} != {expected}"
    for name, expected in entry.get("counts", {}).items():
        assert getattr(report, name) == expected, f"{name}: {getattr(report, name)} != {expected}"
    if "device" in entry:
        assert report.device == entry["device"]
    if "processes" in entry:
        assert report.processes == [tuple(p) for p in entry["processes"]]
    if entry["cause"] is not None:
        assert report.cause == entry["cause"], report.causes
    assert str(report) and report._repr_html_()
