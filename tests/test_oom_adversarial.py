"""explain_oom on hostile input (issue 16, item 6): every pattern is linear-time and the text examined
is bounded, so nothing hangs. Each case runs in a child process under a hard timeout: a regression
fails here instead of hanging the suite."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CORPUS = Path(__file__).parent / "data" / "oom_messages.jsonl"
REPO = Path(__file__).resolve().parents[1]

# The child builds each input, times explain_oom on it (best of 3, in CPU seconds of its thread) and prints one JSON line per case,
# flushed, so the parent knows which case hung when it has to kill the child.
CHILD = textwrap.dedent(
    """
    import json, sys, time
    from helpers.oom.diagnosis import explain_oom
    texts = [json.loads(line)["text"] for line in open(sys.argv[1], encoding="utf-8")]

    def log(size):
        out, n, i = [], 0, 0
        while n < size:
            out.append(texts[i % len(texts)])
            n += len(out[-1]) + 1
            i += 1
        return "\\n".join(out)

    explain_oom(texts[0])  # imports and compiled patterns out of the timing
    for expr in json.loads(sys.argv[2]):
        text = eval(expr)
        best = float("inf")
        for _ in range(3):
            t0 = time.thread_time()  # CPU time of explain_oom itself: other processes on the machine do not count
            explain_oom(text)
            best = min(best, time.thread_time() - t0)
        print(json.dumps([expr, best]), flush=True)
    """
)

MESSAGES = {
    "20,000 digits": "'1' * 20_000",
    "'Tried to allocate ' + 100,000 nines": "'Tried to allocate ' + '9' * 100_000",
    "100,000 nines and a unit": "'CUDA out of memory. Tried to allocate ' + '9' * 100_000 + '.5 GiB'",
    "digits in every figure": "'CUDA out of memory. Tried to allocate ' + ('1' * 5000 + ' GiB free; ') * 20",
    "1 MB of whitespace": "'CUDA out of memory. Tried to allocate' + ' ' * 1_000_000 + '2.00 GiB'",
    "1 MB of newlines and tabs": "'GPU 0 has a total capacity of' + '\\n\\t' * 500_000",
    "'Tried to allocate' 50,000 times": "'Tried to allocate ' * 50_000",
    "'(GPU 0; ' 50,000 times": "'CUDA out of memory. Tried to allocate 1 GiB ' + '(GPU 0; ' * 50_000",
    "'out of memory' 100,000 times": "'out of memory ' * 100_000",
}
LOGS = {"1 MB": "log(1 << 20)", "2 MB": "log(2 << 20)", "4 MB": "log(4 << 20)", "10 MB": "log(10 << 20)"}


def _times(exprs: list[str], timeout: float = 120) -> dict[str, float]:
    """{expr: seconds}, each case in one child process that is killed if it runs past ``timeout``."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, str(CORPUS), json.dumps(exprs)],
            capture_output=True, text=True, timeout=timeout, cwd=REPO, check=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        done = [json.loads(line)[0] for line in (e.stdout or b"").decode().splitlines()]
        pytest.fail(f"explain_oom({exprs[len(done)]}) did not return within {timeout:.0f} s")
    return dict(json.loads(line) for line in proc.stdout.splitlines())


def test_adversarial_messages_are_read_in_milliseconds():
    times = _times(list(MESSAGES.values()))
    slow = {name: f"{times[expr] * 1000:.1f} ms" for name, expr in MESSAGES.items() if times[expr] >= 0.05}
    assert not slow


def test_logs_of_real_messages_complete_and_grow_linearly():
    """2 MB and 10 MB logs complete; 4 MB takes roughly 4x 1 MB (generous slack: shared CI machines)."""
    times = {name: t for name, t in zip(LOGS, _times(list(LOGS.values())).values(), strict=True)}
    assert times["4 MB"] < 10 * max(times["1 MB"], 0.005), times
    assert times["2 MB"] < 2 and times["10 MB"] < 5, times


def test_the_last_message_of_a_log_is_the_one_explained():
    from helpers.oom.diagnosis import explain_oom

    texts = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    last = next(t for t in texts if "capacty of 12.00 GiB" in t)  # request larger than the card
    report = explain_oom("\n".join(texts * 200 + [last]))
    assert report.cause == "request_too_large" and report.total == 12 * 2**30
