"""helpers.core.vocab: each word defined once. The load-mode table answers what code used to compare names for."""

from __future__ import annotations

import pytest

from helpers.core import vocab
from helpers.core.errors import OomkitError
from helpers.core.vocab import MODES, LoadModeError, load_mode


def test_the_mode_table_is_what_the_word_lists_say():
    assert vocab.LOAD_MODES == ("fp32", "fp16", "bf16", "int8", "nf4", "fp4")  # widest first: dropdown order
    assert vocab.QUANTIZED == ("int8", "nf4", "fp4")
    assert vocab.FOUR_BIT == ("nf4", "fp4")
    assert vocab.HALF == ("fp16", "bf16")
    assert {m: vocab.lighter_load(m) for m in vocab.LOAD_MODES} == {
        "fp32": "fp16", "fp16": "int8", "bf16": "int8", "int8": "nf4", "nf4": None, "fp4": None}  # fmt: skip
    assert vocab.lighter_loads("fp32", bf16=True) == ["bf16", "int8", "nf4"]


@pytest.mark.parametrize(
    ("name", "bits", "weight_bytes", "quantized", "dtype"),
    [("fp32", 32, 4, False, "fp32"), ("bf16", 16, 2, False, "bf16"), ("int8", 8, 1, True, None),
     ("nf4", 4, 0.5, True, None), ("fp4", 4, 0.5, True, None)],
)  # fmt: skip
def test_each_mode_knows_its_bits_bytes_and_dtype(name, bits, weight_bytes, quantized, dtype):
    mode = load_mode(name)
    assert (mode.bits, mode.weight_bytes, mode.quantized, mode.dtype) == (bits, weight_bytes, quantized, dtype)
    assert vocab.DTYPE_BYTES.get(name, weight_bytes) == weight_bytes


def test_the_bitsandbytes_keywords_build_a_real_config():
    from transformers import BitsAndBytesConfig

    nf4 = BitsAndBytesConfig(**MODES["nf4"].bnb)
    assert nf4.load_in_4bit and nf4.bnb_4bit_quant_type == "nf4"
    assert BitsAndBytesConfig(**MODES["fp4"].bnb).bnb_4bit_quant_type == "fp4"
    assert BitsAndBytesConfig(**MODES["int8"].bnb).load_in_8bit
    assert MODES["fp16"].bnb is None


@pytest.mark.parametrize(
    ("value", "says"),
    [("int4", "4-bit is 'nf4' or 'fp4'"), ("8bit", "8-bit is 'int8'"), ("half", "that is 'fp16'"), ("q5", "use nf4")],
)
def test_an_unknown_mode_says_what_to_pass(value, says):
    with pytest.raises(LoadModeError, match="unknown load mode") as e:
        load_mode(value)
    assert says in str(e.value) and "fp16/bf16/fp32" in str(e.value)
    assert isinstance(e.value, OomkitError) and isinstance(e.value, ValueError)


def test_callers_raise_their_own_error_class_with_the_same_words():
    class PlanError(ValueError):
        pass

    with pytest.raises(PlanError, match="unknown load mode 'x'; use nf4"):
        load_mode("x", error=PlanError)
    assert load_mode(" NF4 ") is MODES["nf4"]
    with pytest.raises(LoadModeError):
        load_mode(None)


def test_default_sizes_are_one_value_every_entry_point_starts_from():
    import inspect

    import helpers
    from helpers.estimator.training import LoraTraining

    d = vocab.DEFAULTS
    assert (d.batch_size, d.prompt_tokens, d.max_new_tokens, d.seq_len, d.micro_batch) == (1, 512, 256, 512, 1)
    for fn in (helpers.estimate, helpers.preflight, helpers.plan_devices, helpers.LoadPlan, helpers.LoadPanel):
        params = inspect.signature(fn).parameters
        for name in ("batch_size", "prompt_tokens", "max_new_tokens"):
            assert params[name].default == getattr(d, name), (fn, name)
    assert inspect.signature(helpers.safe_generate).parameters["max_new_tokens"].default == d.max_new_tokens
    assert (LoraTraining().seq_len, LoraTraining().micro_batch) == (d.seq_len, d.micro_batch)
    assert helpers.TrainPlan("m").seq_len == d.seq_len
