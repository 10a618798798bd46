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

# The child builds each input as bench/oom_parse_cost.py does (the same hostile messages, the same logs of the
# corpus's real messages), runs explain_oom on it and prints one JSON line per case (its cause, the request it
# read, the length of its text), flushed, so the parent knows which case hung when it has to kill the child.
# How long each case takes is the bench's (a timing is a bench row, not a test).
CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, "bench")
    from oom_parse_cost import CORPUS, MESSAGES, log
    from helpers.oom.diagnosis import explain_oom
    texts = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    for case in json.loads(sys.argv[1]):
        kind, arg = case.split(":", 1)
        text = MESSAGES[arg] if kind == "message" else log(texts, int(arg))
        if kind == "tail":
            text = text[-20_000:]
        report = explain_oom(text)
        print(json.dumps([case, report.cause, report.requested, len(str(report))]), flush=True)
    """
)

# What each of the bench's hostile messages is answered: (cause, the request read). Figures are read only within
# a message's bounds, so a number 1 MB after "Tried to allocate" or with 100,000 digits is not a request.
ANSWERS = {
    "20,000 digits": ("unknown", None),
    "'Tried to allocate ' + 100,000 nines": ("unknown", None),
    "100,000 nines and a unit": ("steady_state", None),
    "digits in every figure": ("steady_state", None),
    "1 MB of whitespace": ("steady_state", None),
    "1 MB of newlines and tabs": ("unknown", None),
    "'Tried to allocate' 50,000 times": ("unknown", None),
    "'(GPU 0; ' 50,000 times": ("steady_state", 1 << 30),
    "'out of memory' 100,000 times": ("unknown", None),
}
LOG_SIZES = [1 << 20, 4 << 20, 10 << 20]


def _answers(cases: list[str], timeout: float = 240) -> dict[str, list]:
    """{case: [cause, requested, report length]}, all cases in one child process, killed past ``timeout``:
    a hang guard (a backtracking pattern on these inputs runs for hours), not a speed target."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(cases)],
            capture_output=True, text=True, timeout=timeout, cwd=REPO, check=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        done = [json.loads(line)[0] for line in (e.stdout or b"").decode().splitlines()]
        pytest.fail(f"explain_oom({cases[len(done)]}) did not return within {timeout:.0f} s")
    return {line[0]: line[1:] for line in map(json.loads, proc.stdout.splitlines())}


def test_hostile_messages_complete_with_the_right_answer_and_a_short_report():
    answers = _answers([f"message:{name}" for name in ANSWERS])
    assert {case.removeprefix("message:"): tuple(a[:2]) for case, a in answers.items()} == ANSWERS
    assert max(a[2] for a in answers.values()) < 2000  # the input is never echoed whole


def test_long_logs_of_real_messages_complete_and_are_answered_from_their_end():
    """A 10 MB log is answered as its last 20,000 characters are: the text examined is bounded."""
    answers = _answers([f"{kind}:{size}" for kind in ("log", "tail") for size in LOG_SIZES])
    for size in LOG_SIZES:
        assert answers[f"log:{size}"] == answers[f"tail:{size}"], size


def test_the_last_message_of_a_log_is_the_one_explained():
    from helpers.oom.diagnosis import explain_oom

    texts = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    last = next(t for t in texts if "capacty of 12.00 GiB" in t)  # request larger than the card
    report = explain_oom("\n".join(texts * 200 + [last]))
    assert report.cause == "request_too_large" and report.total == 12 * 2**30


def test_a_pasted_generate_frame_counts_only_as_a_whole_word():
    """The "in generate" search runs on a literal (a leading \\b made it scan every input whole) and checks the
    word boundaries itself: "in generated" or "within generate" is no generate() frame."""
    from helpers.oom.diagnosis import explain_oom

    msg = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    assert explain_oom(f'  File "x.py", line 3, in generate\n{msg}').generating
    assert explain_oom(f"in generate\n{msg}").generating
    for frame in ("in generated", "xin generate", "_in generate", "within generate"):
        assert not explain_oom(f'  File "x.py", line 3, {frame}\n{msg}').generating, frame
