"""mxfp4 and fp8 checkpoints kept packed read their weights from the hub repo's safetensors headers when
online (issue 47 item 1), against the local fake hub of test_hub_headers: as stored, exact, and equal to
the config's formula on a regular layout; a dequantized path asks for no header."""

from __future__ import annotations

import math

import torch
from safetensors.torch import save_file
from test_hub_headers import _repo, hub  # noqa: F401 - the fake hub fixture, reused
from test_prequantized_formats import GPT_OSS, QWEN3_FP8, _meta_model

import helpers.estimator.kernel_paths as KP
from helpers.estimator.core import estimate
from helpers.estimator.hub_headers import HEADER_NOTE


def _mxfp4_state() -> dict:
    """gpt-oss as OpenAI stores it: each fused expert tensor as ``_blocks`` (two fp4 values a byte) and
    ``_scales`` (one uint8 per 32 values), everything else bf16."""
    _, model = _meta_model(GPT_OSS)
    state = {}
    for name, p in model.named_parameters():
        if ".experts." in name and not name.endswith("bias"):
            state[name + "_blocks"] = torch.zeros(p.numel() // 2, dtype=torch.uint8)
            state[name + "_scales"] = torch.zeros(p.numel() // 32, dtype=torch.uint8)
        else:
            state[name] = torch.zeros(p.shape, dtype=torch.bfloat16)
    return state


def _fp8_state() -> dict:
    """Qwen3-FP8 as stored: every linear but lm_head in fp8 with an fp32 scale per 128 x 128 block."""
    _, model = _meta_model(QWEN3_FP8)
    linears = {n + ".weight": m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    state = {}
    for name, p in model.named_parameters():
        if name in linears:
            out, inp = p.shape
            state[name] = torch.zeros(p.shape, dtype=torch.float8_e4m3fn)
            state[name + "_scale_inv"] = torch.zeros(math.ceil(out / 128), math.ceil(inp / 128), dtype=torch.float32)
        else:
            state[name] = torch.zeros(p.shape, dtype=torch.bfloat16)
    return state


def _stored(state: dict, pick) -> int:
    return sum(t.numel() * t.element_size() for k, t in state.items() if pick(k, t))


def test_mxfp4_kept_packed_reads_the_headers(hub, monkeypatch):  # noqa: F811 - the fixture
    monkeypatch.setattr(KP, "mxfp4_software", lambda: (True, True))
    folder = _repo(hub, "someone/tiny-gpt-oss", GPT_OSS)
    state = _mxfp4_state()
    save_file(state, folder / "model.safetensors")
    est = estimate("someone/tiny-gpt-oss", device="t4")
    assert est.load == "mxfp4"
    assert any("model.safetensors" in r for r in hub.requests)
    assert est.row("weights.quantized").bytes == _stored(state, lambda k, t: k.endswith("_blocks"))
    assert est.row("weights.quant_state").bytes == _stored(state, lambda k, t: k.endswith("_scales"))
    assert HEADER_NOTE in est.row("weights.quantized").note
    # the expert biases are held in fp32 whatever is stored; the rest in the T4's fp16: as the formula says
    assert est.weights == estimate(GPT_OSS, device="t4").weights


def test_fp8_kept_packed_reads_the_headers(hub):  # noqa: F811 - the fixture
    folder = _repo(hub, "someone/tiny-qwen3-fp8", QWEN3_FP8)
    state = _fp8_state()
    save_file(state, folder / "model.safetensors")
    est = estimate("someone/tiny-qwen3-fp8", device="h100")
    assert est.load == "fp8"
    assert est.row("weights.quantized").bytes == _stored(state, lambda k, t: t.dtype == torch.float8_e4m3fn)
    assert est.row("weights.quant_state").bytes == _stored(state, lambda k, t: k.endswith("_scale_inv"))
    assert HEADER_NOTE in est.row("weights.quant_state").note
    assert est.weights == estimate(QWEN3_FP8, device="h100").weights


def test_a_dequantized_path_asks_for_no_header(hub):  # noqa: F811 - the fixture
    folder = _repo(hub, "someone/tiny-qwen3-fp8", QWEN3_FP8)
    save_file(_fp8_state(), folder / "model.safetensors")
    est = estimate("someone/tiny-qwen3-fp8", device="t4")  # no fp8 matmuls on a T4: dequantized to bf16
    assert est.load == "bf16"
    assert not any("safetensors" in r for r in hub.requests)


def test_a_repo_without_safetensors_falls_back_to_the_formula_with_a_note(hub):  # noqa: F811 - the fixture
    _repo(hub, "someone/tiny-qwen3-fp8-bin", QWEN3_FP8)
    est = estimate("someone/tiny-qwen3-fp8-bin", device="h100")
    assert est.weights == estimate(QWEN3_FP8, device="h100").weights
    assert any("weights counted from the config" in w for w in est.warnings)
