"""Bad input, as a hostile user or a crashing runtime gives it, through the public API and the CLI.

Every case must end in a clear error raised by oomkit itself (the last frame of the traceback is in
``helpers/``, not inside a library), a message that names the value, or the right result; none may
hang (each runs under an alarm). The families follow issue 16's review; per-module tests hold the
details.
"""

from __future__ import annotations

import math
import signal
import traceback
from pathlib import Path

import pytest

import helpers
from helpers.cli import estimate_main, preflight_main
from helpers.core.units import GiB

HELPERS = Path(helpers.__file__).parent
LIMIT_S = 20


@pytest.fixture
def alarm():
    def hung(*_):
        raise TimeoutError(f"no answer within {LIMIT_S} s: a hang")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(LIMIT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _raised_by_oomkit(e: BaseException) -> bool:
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(HELPERS)


def _bad(tmp_path: Path, tiny: Path) -> dict[str, object]:
    """name -> a call that must fail clearly."""
    not_utf8 = tmp_path / "latin1.jsonl"
    not_utf8.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text("[1, 2]")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "config.json").write_bytes(b"\xff\xfe{")
    return {
        "estimate: load int4": lambda: helpers.estimate("Llama-2-7b-hf", load="int4"),
        "estimate: device 15 (GiB meant)": lambda: helpers.estimate("Llama-2-7b-hf", load="nf4", device=15),
        "estimate: device nan": lambda: helpers.estimate("Llama-2-7b-hf", load="nf4", device=math.nan),
        "estimate: device 10**400": lambda: helpers.estimate("Llama-2-7b-hf", load="nf4", device=10**400),
        "estimate: compute dtype int4": lambda: helpers.estimate("Llama-2-7b-hf", load="nf4", compute_dtype="int4"),
        "estimate: missing path": lambda: helpers.estimate(str(tmp_path / "typo" / "model"), load="nf4"),
        "estimate: config.json holds a list": lambda: helpers.estimate(str(listed), load="nf4"),
        "estimate: config.json not UTF-8": lambda: helpers.estimate(str(garbage), load="nf4"),
        "estimate: batch_size 0": lambda: helpers.estimate("Llama-2-7b-hf", load="nf4", batch_size=0),
        "fit: a model id instead of an estimate": lambda: helpers.fit("Llama-2-7b-hf", "t4"),
        "LoadPlan: load int4": lambda: helpers.LoadPlan("x/y", load="int4"),
        "LoadPlan: unknown field": lambda: helpers.LoadPlan("x/y").replace(max_tokens=5),
        "load: missing local model": lambda: helpers.load(helpers.LoadPlan(str(tmp_path / "nope" / "m"))),
        "TrainPlan: learning rate nan": lambda: helpers.TrainPlan(str(tiny), learning_rate=math.nan),
        "TrainPlan: optimizer adam": lambda: helpers.TrainPlan(str(tiny), optimizer="adam"),
        "load_prompts: a bare string": lambda: helpers.load_prompts("what is a tensor?"),
        "load_prompts: not UTF-8": lambda: helpers.load_prompts(not_utf8),
        "find_max_batch_size: growth 1": lambda: helpers.find_max_batch_size(lambda b: None, growth=1),
        "find_max_batch_size: not callable": lambda: helpers.find_max_batch_size(5),
        "MemoryMonitor: interval nan": lambda: helpers.MemoryMonitor(interval=math.nan),
        "MemoryMonitor: threshold 90 (percent)": lambda: helpers.MemoryMonitor(threshold=90),
        "parse_bytes: 1e400GiB": lambda: helpers.parse_bytes("1e400GiB"),
        "footprint: a model id": lambda: helpers.footprint("Llama-2-7b-hf"),
        "top_allocation_sites: not a pickle": lambda: helpers.top_allocation_sites(not_utf8),
    }


def test_bad_input_gets_a_clear_error_from_oomkit(tmp_path, tiny_llama, alarm):
    unclear = []
    for name, call in _bad(tmp_path, tiny_llama).items():
        try:
            call()
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - the point is to look at whatever comes out
            if not _raised_by_oomkit(e) or not str(e).strip():
                unclear.append(f"{name}: {type(e).__name__} from {traceback.extract_tb(e.__traceback__)[-1].filename}")
        else:
            unclear.append(f"{name}: accepted silently")
    assert not unclear, "\n".join(unclear)


def test_the_cli_answers_bad_input_with_an_exit_code_not_a_traceback(capsys, alarm):
    assert estimate_main(["Llama-2-7b-hf", "--load", "int3"]) == 2
    assert estimate_main(["Llama-2-7b-hf", "--device", "9" * 400 + "GiB"]) == 2
    assert estimate_main(["Llama-2-7b-hf", "--lora", "r=x"]) == 2
    assert preflight_main(["--model", "/nonexistent/typo/model"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err


def test_hostile_text_is_parsed_quickly_and_inputs_are_never_overwritten(tmp_path, tiny_llama, alarm):
    report = helpers.explain_oom("CUDA out of memory. Tried to allocate " + "9" * 100_000)
    assert report is not None
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    model, tokenizer, _ = helpers.load(helpers.LoadPlan(str(tiny_llama), load="fp32"))
    with pytest.raises(helpers.OomkitError):
        helpers.safe_generate(model, tokenizer, prompts, results=prompts, resume=False, progress=False)
    assert prompts.read_text() == '{"id": "a", "prompt": "hi"}\n'  # the input survives
    helpers.unload(model)
    assert helpers.fit(helpers.estimate("Llama-2-7b-hf", load="nf4"), 16 * GiB).fits
