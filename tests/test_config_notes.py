"""Reading a config says nothing of transformers' own parsing: transformers 5.x logs "`rope_parameters`'s
high_freq_factor field must be greater than low_freq_factor" while it builds the shipped Llama-4-Scout config
(Meta's file states 1.0 and 1.0; a pink block under fits_table in a notebook, which tries the shipped configs as
smaller models); oomkit's config reading silences it on every path."""

from __future__ import annotations

import json
import logging
import re
import shutil
import warnings

import pytest

from helpers import estimate
from helpers.core.sources import shipped_config
from helpers.estimator.configs import CONFIG_NOTES, config_from_dict, resolve_config

SCOUT = "meta-llama/Llama-4-Scout-17B-16E-Instruct"


@pytest.fixture(autouse=True)
def llama4_known():
    """The lowest transformers of the compat matrix cannot read a Llama 4 config at all (issue 47)."""
    try:
        config_from_dict(json.loads(shipped_config(SCOUT).read_text()), "the shipped Llama-4-Scout config")
    except Exception as e:  # noqa: BLE001 - any refusal: nothing is built, so nothing to silence
        pytest.skip(f"this transformers cannot read a Llama 4 config: {type(e).__name__}")


@pytest.fixture
def heard(capfd):
    """Everything a notebook would show while the block runs: stderr (transformers' handler writes to the fd),
    every transformers log record at WARNING and up, and every Python warning."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    keep = Keep(logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(keep)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def said() -> str:
            out = capfd.readouterr()
            return "\n".join([out.err, *(r.getMessage() for r in records), *(str(w.message) for w in caught)])

        yield said
    logger.removeHandler(keep)


def test_estimating_the_shipped_llama_4_scout_config_prints_nothing(heard, tmp_path):
    # a copy under a new path: the parse is cached per file, and the first parse is the one that spoke
    copy = tmp_path / "config.json"
    shutil.copy(shipped_config(SCOUT), copy)
    assert estimate(str(copy)).params > 0
    assert heard() == ""


def test_every_path_that_reads_a_config_is_quiet(heard, tmp_path):
    d = json.loads(shipped_config(SCOUT).read_text())
    config_from_dict(d, "the Llama-4-Scout dict")  # the hub's config.json, read online
    resolve_config(d)  # a dict passed in
    (tmp_path / "m").mkdir()
    shutil.copy(shipped_config(SCOUT), tmp_path / "m" / "config.json")
    resolve_config(str(tmp_path / "m"))  # a model folder
    assert heard() == ""


def test_the_note_is_transformers_own_and_still_shown_outside_oomkit(heard):
    """The silenced pattern matches what this transformers says when the config is built directly (and the
    file's 1.0 and 1.0 are what it names); other
    releases may not say it at all (then there is nothing to silence)."""
    from transformers import AutoConfig

    d = json.loads(shipped_config(SCOUT).read_text())
    AutoConfig.for_model(d.pop("model_type"), **d)
    text = heard()
    if not text:
        pytest.skip("this transformers builds the Llama-3.1 config without a note")
    assert re.search(CONFIG_NOTES[0], text) and "high_freq_factor=1.0" in text, text
