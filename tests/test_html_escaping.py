"""Every HTML view shows text from outside (configs, paths, GPU names, error messages) escaped:
estimating a model before downloading it is the advertised use, so its config.json is untrusted."""

from __future__ import annotations

import json

from helpers.core.memory import DiskReadout, GPUReadout, MemorySnapshot, RAMReadout
from helpers.core.units import GiB, MiB
from helpers.environment import preflight
from helpers.estimator.core import estimate
from helpers.estimator.fitting import fit_one_card as fit
from helpers.oom.batch_size import BatchSearch, Trial

HOSTILE = "<img src=x onerror=alert(1)>"


def _assert_escaped(html: str) -> None:
    assert "<img" not in html, html[:400]
    assert "&lt;img src=x onerror=alert(1)&gt;" in html


def _hostile_config(tmp_path):
    config = {"model_type": HOSTILE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 100, "_name_or_path": HOSTILE}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_estimate_and_fit_escape_a_hostile_config(tmp_path):
    est = estimate(str(_hostile_config(tmp_path)), load="nf4", device="t4")
    assert any(HOSTILE in w for w in est.warnings)  # the hostile model_type is reported...
    _assert_escaped(est._repr_html_())  # ...but never as markup
    _assert_escaped(fit(est, "t4")._repr_html_())


def test_preflight_and_snapshot_escape_names_from_the_machine(tmp_path):
    gpu = GPUReadout(0, HOSTILE, (7, 5), 15 * GiB, 14 * GiB, 0, 0, 0, 0, [])
    snap = MemorySnapshot("cuda", [gpu], RAMReadout(12 * GiB, 11 * GiB, GiB, 500 * MiB),
                          [DiskReadout(HOSTILE, str(tmp_path), 100 * GiB, 50 * GiB)])  # fmt: skip
    _assert_escaped(snap._repr_html_())
    report = preflight(HOSTILE, snapshot=snap, package_versions={}, bnb=(False, HOSTILE), colab=False,
                       checkpoint=(None, None, HOSTILE))  # fmt: skip
    _assert_escaped(report._repr_html_())


def test_batch_search_escapes_the_error_of_a_trial():
    search = BatchSearch(max_ok=1, batch_size=1, trials=[Trial(1, True), Trial(2, False, 0.1, HOSTILE)])
    _assert_escaped(search._repr_html_())
