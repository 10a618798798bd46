"""Published benchmark figures were measured on the code as it is now.

Each ``bench/results/<name>.json`` records the git blob hash of every file its figures are about
(``bench/_common.py``'s ``MEASURES`` and the bench itself). When one of them changed after the run,
the README and docs/benchmarks.md would publish a figure of older code: this fails until the bench
is rerun. GPU results (``bench/results/gpu/``) are not rerun here: they name the commit they ran at.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def _common():
    spec = importlib.util.spec_from_file_location("oomkit_bench_common", BENCH / "_common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BENCHES = sorted(p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def test_every_bench_says_what_it_measures_and_has_results():
    common = _common()
    assert sorted(common.MEASURES) == BENCHES, "add the bench's measured paths to MEASURES in bench/_common.py"
    assert sorted(p.stem for p in (BENCH / "results").glob("*.json")) == BENCHES


@pytest.mark.parametrize("name", BENCHES)
def test_published_figures_were_measured_on_the_code_as_it_is_now(name):
    recorded = json.loads((BENCH / "results" / f"{name}.json").read_text()).get("source")
    if recorded is None:  # measured before results recorded their source: shown, until the bench is rerun
        pytest.skip(f"bench/results/{name}.json predates source tracking: rerun python bench/{name}.py (issue 32)")
    common = _common()
    assert recorded["measures"] == [*common.MEASURES[name], f"bench/{name}.py"], (
        f"MEASURES changed since bench/results/{name}.json was written: rerun python bench/{name}.py"
    )
    stale = common.stale_files(recorded)
    assert not stale, (
        f"bench/results/{name}.json was measured before these files changed: {', '.join(stale)}. Rerun "
        f"`python bench/{name}.py`, then `make docs`, and commit the new figures with the change"
    )


def test_a_changed_added_or_removed_file_is_named():
    common = _common()
    measures = ["helpers/core/memory.py", "helpers/leaks"]
    files = common.source_hashes(measures)
    data = (REPO / "helpers/core/memory.py").read_bytes()
    assert files["helpers/core/memory.py"] == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's
    assert "helpers/leaks/census.py" in files and not any("__pycache__" in f for f in files)
    assert common.stale_files({"measures": measures, "files": files}) == []
    edited = {**files, "helpers/core/memory.py": "0" * 40}
    gone = {f: h for f, h in files.items() if f != "helpers/leaks/census.py"}
    extra = {**files, "helpers/leaks/old.py": "1" * 40}
    assert common.stale_files({"measures": measures, "files": edited}) == ["helpers/core/memory.py"]
    assert common.stale_files({"measures": measures, "files": gone}) == ["helpers/leaks/census.py"]
    assert common.stale_files({"measures": measures, "files": extra}) == ["helpers/leaks/old.py"]
    with pytest.raises(FileNotFoundError, match="not in the repository"):
        common.source_hashes(["helpers/no_such_module.py"])


@pytest.mark.parametrize("name", BENCHES)
def test_every_name_a_bench_imports_from_helpers_exists(name):
    """A bench that cannot start publishes nothing: every ``from helpers... import X`` it makes resolves
    (checked without running it; monitor_overhead once failed to start after MemoryCallback moved)."""
    import ast
    import importlib

    tree = ast.parse((BENCH / f"{name}.py").read_text())
    missing = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "helpers"
        for alias in node.names
        if not hasattr(importlib.import_module(node.module), alias.name)
        and importlib.util.find_spec(f"{node.module}.{alias.name}") is None
    ]
    assert not missing, f"bench/{name}.py imports names that are gone: {missing}"
