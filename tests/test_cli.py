"""``python -m helpers``: every command parsed in helpers/cli.py; ``--help`` imports nothing heavy."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from test_oom import CPU, CUDA_FRAGMENTED

from helpers.cli import COMMANDS, explain_main, main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True)


# what ``--help`` must not import: torch alone takes seconds (why a CLI's help is compared with ``import torch``,
# as accelerate does); that it costs less is this test's, counted in modules, not timed
HEAVY = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "numpy", "matplotlib", "ipywidgets", "IPython")


def test_help_imports_nothing_heavy():
    probe = ("import runpy, sys; sys.argv = ['helpers', '--help']\ntry: runpy.run_module('helpers', run_name='__main__')\n"
             f"except SystemExit: pass\nprint('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))")  # fmt: skip
    out = _run("-c", probe).stdout
    assert "python -m helpers COMMAND" in out and "HEAVY []" in out


@pytest.mark.parametrize(("command", "option"), [("preflight", "--model"), ("estimate", "--lora"),
                                                 ("explain", "--json"), ("fits", "--tokens")])  # fmt: skip
def test_each_command_lists_its_options(command, option, capsys):
    assert command in COMMANDS
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0 and option in capsys.readouterr().out


def test_an_unknown_command_or_option_says_what_to_do(capsys):
    assert main(["estmate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'estmate'" in err and "estimate" in err
    with pytest.raises(SystemExit) as done:
        main(["fits", "Llama-2-7b-hf", "--tokns", "5"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "unrecognized arguments: --tokns" in err
    assert err.count("\n") == 1 and "see python -m helpers fits --help" in err  # one line, not the usage block


def test_explain_reads_a_file_the_argument_or_stdin(tmp_path, monkeypatch, capsys):
    path = tmp_path / "log.txt"
    path.write_text("some training log\n" + CUDA_FRAGMENTED + "\n")
    out = _run("-m", "helpers", "explain", str(path), "--json").stdout
    assert json.loads(out)["cause"] == "fragmentation"
    monkeypatch.setattr(sys, "stdin", io.StringIO(CPU))
    assert explain_main([]) == 0 and "system RAM" in capsys.readouterr().out
    assert explain_main([str(tmp_path / "missing")]) == 2 and "cannot read" in capsys.readouterr().err
    # the message pasted as the argument is read as the message, not as a file name
    assert explain_main([CUDA_FRAGMENTED]) == 0 and "Out of memory" in capsys.readouterr().out
    assert explain_main(["oom.txt"]) == 2 and "the message itself in quotes, or pipe it in" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO("   "))
    assert explain_main([]) == 2 and "no message given" in capsys.readouterr().err


# ----------------------------------------------------------------------------- an 80-column terminal (issue 44 item 10)


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants as hub_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


def _within_80(text: str) -> None:
    assert text.strip() and max(map(len, text.splitlines())) <= 80, max(text.splitlines(), key=len)


def test_estimate_prints_within_80_columns_with_the_budget_it_assumed(capsys):
    assert main(["estimate", "Qwen2.5-7B", "--load", "fp16", "--device", "t4", "--batch", "2",
                 "--prompt-tokens", "300", "--max-new-tokens", "100"]) == 1  # fmt: skip
    out = capsys.readouterr().out
    _within_80(out)
    assert "assumed: batch 2, 300 prompt + 100 new tokens per sequence" in out
    fix = out[out.index("offload ") :].split("\n  fix ")[0]  # the long offload fix, wrapped under its number
    assert fix.count("\n") >= 2 and all(line.startswith("      ") for line in fix.splitlines()[1:])


def test_fits_prints_within_80_columns_with_the_verdict_words(capsys):
    assert main(["fits", "Qwen2.5-7B"]) == 0
    out = capsys.readouterr().out
    _within_80(out)
    assert "does not fit" in out and "fits (59%)" in out and " no " not in out
    assert "decode tokens/s" in out


def test_the_offline_error_is_lines_not_one_wall(offline, capsys):
    assert main(["estimate", "someone/Unshipped-7B"]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) >= 4 and "Offline or private?" in err and "  Qwen/Qwen2.5-0.5B" in err
    assert all(len(line) <= 80 for i, line in enumerate(lines) if i != 1)  # the reason: one line, as it came


def test_offline_an_instruct_id_is_answered_from_its_base_and_a_guess_keeps_the_size(offline, capsys):
    from helpers.estimator.configs import suggest_shipped

    assert main(["estimate", "Qwen/Qwen2.5-7B-Instruct", "--load", "nf4"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert out.startswith("Qwen/Qwen2.5-7B-Instruct (config unreadable here: its base Qwen/Qwen2.5-7B's shipped")
    assert "7,615,616,512 parameters" in out  # the 7B's own count, not a 1.5B's
    assert suggest_shipped("meta-llama/Llama-2-7b-chat-hf") == "meta-llama/Llama-2-7b-hf"
    assert suggest_shipped("mistralai/Mistral-7B-Instruct-v0.2") == "mistralai/Mistral-7B-v0.1"
    assert suggest_shipped("Qwen/Qwen2.5-3B") is None  # no 3B ships: no 1.5B offered instead
    assert main(["estimate", "mistralai/Mistral-7B-Instruct-v0.2"]) == 2
    assert "Did you mean 'mistralai/Mistral-7B-v0.1'" in capsys.readouterr().err
