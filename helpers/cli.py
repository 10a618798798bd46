"""``python -m helpers COMMAND ...``: the oomkit command line; every command's arguments are parsed here.

Commands import what they run (torch, transformers) only when called, so ``python -m helpers --help``
costs about what ``import torch`` does (tests/test_cli.py holds it to that), as accelerate's CLI does.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import textwrap
from typing import Any

from .core.vocab import DEFAULTS, FITS_TOKENS, LOAD_MODES

__all__ = ["main", "COMMANDS", "WIDTH", "wrap", "budget_line"]

WIDTH = 80  # a terminal's columns: every line the commands print fits them

COMMANDS = {
    "preflight": ("helpers.cli:preflight_main", "check the GPUs, RAM, disk and versions before loading a model"),
    "estimate": ("helpers.cli:estimate_main", "estimate the memory a model needs and whether it fits"),
    "explain": ("helpers.cli:explain_main", "explain an out-of-memory message (stdin or a file)"),
    "fits": ("helpers.cli:fits_main", "what fits for a model: every load mode on a T4, 2xT4, L4, A100 and this GPU"),
}


class _Parser(argparse.ArgumentParser):
    """argparse whose error is one line, what is wrong and where the options are, not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def wrap(text: str, width: int = WIDTH) -> str:
    """``text`` with every line longer than ``width`` wrapped, its continuation indented under it (a table's
    lines, already narrower, stay as they are)."""
    out = []
    for line in str(text).splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip(" ")))
        out += textwrap.wrap(line, width, initial_indent="", subsequent_indent=indent + "    ",
                             break_on_hyphens=False) or [line]  # fmt: skip
    return "\n".join(out)


def _error(e: Exception) -> int:
    """An oomkit refusal on stderr as its own lines (a long one is built as several); exit status 2."""
    print(f"error: {e}", file=sys.stderr)
    return 2


def budget_line(est) -> str:
    """What ``estimate`` assumed the run holds at once, and the options that change it."""
    tr = est.inputs.get("training")
    if tr is not None:
        return (f"assumed: a training step of micro-batch {tr.micro_batch} x {tr.seq_len} tokens "
                "(--lora micro_batch=...,seq_len=...)")  # fmt: skip
    i = est.inputs
    return (f"assumed: batch {i['batch_size']}, {i['prompt_tokens']} prompt + {i['max_new_tokens']} new tokens per "
            "sequence (--batch, --prompt-tokens, --max-new-tokens)")  # fmt: skip


def usage() -> str:
    lines = ["usage: python -m helpers COMMAND [options]", "", "commands:"]
    lines += [f"  {name:10s} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "python -m helpers COMMAND --help for a command's options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, func = COMMANDS[name][0].split(":")
    return getattr(importlib.import_module(module_name), func)(rest) or 0


def preflight_main(argv: list[str] | None = None) -> int:
    parser = _Parser(
        prog="python -m helpers preflight",
        description="Check every GPU, RAM, disk and versions before loading a model; with --model, whether it "
        "fits one GPU or, on a machine with several (Kaggle's 2×T4), split across them as device_map='auto' "
        "splits it.",
    )
    parser.add_argument("--model", help="hub id or local path of the model you plan to load")
    parser.add_argument("--load", default="auto", help=f"load mode: auto, {', '.join(LOAD_MODES)}")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    parser.add_argument(
        "--batch", type=int, default=DEFAULTS.batch_size, help="sequences generated at once (sizes the KV cache)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULTS.prompt_tokens, help="prompt length in tokens")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="accept a local pickle .bin checkpoint (loading a pickle can run code the file holds)")  # fmt: skip
    args = parser.parse_args(argv)
    from .environment import preflight

    if args.max_new_tokens < 0:
        parser.error("--max-new-tokens must be >= 0")
    if args.batch < 1 or args.prompt_tokens < 1:
        parser.error("--batch and --prompt-tokens must be >= 1")
    if args.load not in ("auto", *LOAD_MODES):
        parser.error(f"--load {args.load!r}: use auto, {', '.join(LOAD_MODES)}")
    try:
        report = preflight(args.model, load=args.load, max_new_tokens=args.max_new_tokens, batch_size=args.batch,
                           prompt_tokens=args.prompt_tokens, allow_pickle=args.allow_pickle,
                           show=not args.json)  # each check's line as it finishes, then the verdict  # fmt: skip
    except ValueError as e:  # oomkit's refusals of an argument (ArgumentError is a ValueError)
        return _error(e)
    if args.json:
        print(report.to_json())
    return 0 if report.ok else 1  # a failed check stops a script or CI step, as it should


def _parse_lora(text: str):
    """``--lora r=16,seq_len=1024`` as a :class:`~helpers.LoraTraining`."""
    from .estimator.rows import EstimateError
    from .estimator.training import LoraTraining

    kw: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        if "=" not in part:
            raise EstimateError(f"--lora takes key=value pairs like r=16,optimizer=adamw_8bit, got {part!r}")
        k, v = part.split("=", 1)
        k = k.strip().replace("-", "_")
        fields = {f.name: f for f in dataclasses.fields(LoraTraining)}
        if k not in fields:
            raise EstimateError(f"unknown --lora key {k!r}; use {', '.join(fields)}")
        try:
            if k in ("r", "alpha", "seq_len", "micro_batch"):
                kw[k] = int(v)
            elif k == "lora_dropout":
                kw[k] = float(v)
        except ValueError:
            raise EstimateError(
                f"--lora {k}={v!r}: {k} takes a {'number' if k == 'lora_dropout' else 'whole number'}"
                f", e.g. {'lora_dropout=0.05' if k == 'lora_dropout' else k + '=16'}"
            ) from None
        if k in ("r", "alpha", "seq_len", "micro_batch", "lora_dropout"):
            continue
        if k == "gradient_checkpointing":
            word = v.strip().lower()
            if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise EstimateError(f"--lora gradient_checkpointing={v!r}: use true or false")
            kw[k] = word in ("1", "true", "yes", "on")
        elif k == "targets":
            kw[k] = v if v == "all-linear" else v.split("+")
        else:
            kw[k] = v
    return LoraTraining(**kw)


def estimate_main(argv: list[str] | None = None) -> int:
    from .core.devices import DEFAULT_DEVICE, DEVICE_SETS, DEVICES, device_set
    from .core.sources import shipped_configs

    parser = _Parser(
        prog="python -m helpers estimate",
        description="Estimate the GPU memory a model needs and whether it fits (reads only config.json).",
        epilog="Exit status: 0 it fits (or is tight) on the device, or no device to fit against; 1 it does not "
        f"fit, so a script or CI step stops before a launch that would run out of memory; 2 bad input. "
        f"Offline configs: {', '.join(shipped_configs())}",
    )
    parser.add_argument("model", help="hub id, shipped config name (e.g. Llama-2-7b-hf), folder or config.json")
    parser.add_argument("--load", default="auto", help=f"{', '.join(LOAD_MODES)} or auto (default)")
    parser.add_argument("--no-double-quant", action="store_true", help="4-bit without double quantization")
    parser.add_argument("--compute-dtype", default="auto")
    parser.add_argument("--batch", type=int, default=DEFAULTS.batch_size)
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULTS.prompt_tokens)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    parser.add_argument("--lora", metavar="K=V,...", help="estimate a LoRA training step, e.g. r=16,seq_len=1024")
    parser.add_argument("--full", action="store_true", help="estimate a full fine-tuning step")
    parser.add_argument(
        "--device",
        default=DEFAULT_DEVICE,
        help=f"{', '.join(DEVICES)}, a machine ({', '.join(DEVICE_SETS)}), current, or bytes like 24GiB",
    )
    parser.add_argument("--json", action="store_true", help="print the breakdown and verdict as JSON")
    args = parser.parse_args(argv)
    from .core.units import parse_bytes
    from .estimator.core import estimate
    from .estimator.rows import EstimateError
    from .estimator.training import FullTraining
    from .placement.machine_fit import fit

    try:
        device: Any = args.device
        machine = device if device_set(device) else None  # estimated on its first card, fit() splits over all
        device = device_set(device)[0] if machine else device
        if device.lower() not in DEVICES and device.lower() not in ("current", "cpu"):
            try:
                device = parse_bytes(device)
            except ValueError:
                pass  # _device() explains the valid names
        if args.lora is not None and args.full:
            raise EstimateError("--lora and --full each estimate one kind of training step: pass one of them")
        training = _parse_lora(args.lora) if args.lora is not None else (FullTraining() if args.full else None)
        est = estimate(args.model, load=args.load, double_quant=not args.no_double_quant,
                       compute_dtype=args.compute_dtype, batch_size=args.batch, prompt_tokens=args.prompt_tokens,
                       max_new_tokens=args.max_new_tokens, training=training, device=device)  # fmt: skip
        verdict = fit(est, machine or device) if est.capacity else None
    except (EstimateError, ValueError) as e:
        return _error(e)
    if args.json:
        out = est.to_dict()
        out["fit"] = verdict.to_dict() if verdict else None
        print(json.dumps(out, indent=2, default=str))
    else:
        print(wrap(est.details()))  # the command asked for the breakdown: every row, not the notebook's short form
        print(wrap(budget_line(est)))
        if verdict:  # the estimate printed its time line: the verdict's own would repeat it
            print(wrap("\n".join(verdict.lines(time=False))))
    return 1 if verdict is not None and not verdict.fits else 0  # guards a launch like preflight's exit code


def fits_main(argv: list[str] | None = None) -> int:
    """``python -m helpers fits MODEL [--tokens N] [--batch B] [--markdown | --json]``."""
    from .core.sources import shipped_configs

    parser = _Parser(
        prog="python -m helpers fits",
        description="Every load mode's weights, KV cache and total, and whether it fits a T4, Kaggle's 2xT4, an L4, "
        "an A100 40/80 GB and this GPU (reads only config.json).",
        epilog=f"Offline configs: {', '.join(shipped_configs())}",
    )
    parser.add_argument("model", help="hub id, shipped config name (e.g. Llama-2-7b-hf), folder or config.json")
    parser.add_argument(
        "--tokens", type=int, default=FITS_TOKENS, help=f"tokens per sequence, prompt + answer (default {FITS_TOKENS})"
    )
    parser.add_argument("--batch", type=int, default=DEFAULTS.batch_size)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args(argv)
    from .estimator.rows import EstimateError
    from .placement.fits import fits_table

    try:
        table = fits_table(args.model, tokens=args.tokens, batch_size=args.batch)
    except (EstimateError, ValueError) as e:
        return _error(e)
    if args.json:
        print(json.dumps(dataclasses.asdict(table), indent=2, default=str))
    else:
        print(table.markdown() if args.markdown else wrap(table))
    return 0


def _message(source: str | None) -> str | None:
    """The OOM text ``explain`` was given: a file's contents, the message pasted as the argument, or stdin;
    None (after saying why on stderr) when a named file cannot be read."""
    if source and source != "-" and not os.path.exists(source):
        from .oom.messages import is_oom_text

        if " " in source or is_oom_text(source):
            return source  # the message pasted as the argument, not a file name
    if source and source != "-":
        from .core.arguments import regular_file

        try:
            regular_file(source, "the file", OSError)
        except OSError as e:
            print(f"cannot read {source}: {e}", file=sys.stderr)
            return None
        try:
            with open(source, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError as e:
            print(f"cannot read {source}: {e.strerror}. Pass a file holding the message, the message itself in "
                  "quotes, or pipe it in: ... | python -m helpers explain", file=sys.stderr)  # fmt: skip
            return None
    if sys.stdin.isatty():
        print("paste the error message, then Ctrl-D", file=sys.stderr)
    return sys.stdin.read()


def explain_main(argv: list[str] | None = None) -> int:
    """``python -m helpers explain [FILE] [--json]``: explain an OOM message from a file, the argument or stdin.
    Exit status 0 when the message was read as an OOM form, 1 when not, 2 on bad input."""
    parser = _Parser(
        prog="python -m helpers explain", description="Explain an out-of-memory message: cause, figures, fixes."
    )
    parser.add_argument(
        "file", nargs="?", help="a file holding the message or log, or the message itself in quotes (default: stdin)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    text = _message(args.file)
    if text is None:
        return 2
    if not text.strip():
        print("no message given: pass a file or pipe the error text in", file=sys.stderr)
        return 2
    from .oom.diagnosis import explain_oom

    report = explain_oom(text)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0 if report.form != "unknown" else 1
