"""The compatibility matrix and the installed-wheel checks (``make test-compat``).

``python scripts/compat.py matrix [ENV ...]`` builds the wheel, installs it into fresh virtualenvs
cached under ``.compat/`` (reused between runs; rebuilt when an environment's spec changes) and, in
each, runs a fast CPU subset of the test suite and one notebook from an empty directory:

- ``low``: the lowest transformers / accelerate / peft / bitsandbytes that ``pyproject.toml`` claims;
- ``new``: the newest releases on the index (upgraded on every run).

Both keep torch at the CPU wheel ``torch==2.13.0``: it is the only torch this machine can install
(older CPU wheels are not on PyPI; its Linux wheels there pull gigabytes of CUDA libraries).

``python scripts/compat.py notebooks DIR [NAME ...]`` copies ``notebooks/*.ipynb`` into the empty
directory ``DIR`` and executes them there with this interpreter (the tiny model as a parameter, as
``tests/notebook_params`` says), then checks that ``helpers`` came from an installed package. The
installed-wheel test (``tests/test_install.py``) uses it too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import venv
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".compat"
TORCH = "torch==2.13.0"  # the CPU wheel; never let pip resolve torch freely (CUDA wheels are gigabytes)
PACKAGES = ["transformers", "accelerate", "peft", "bitsandbytes", "ipywidgets"]

# The lowest releases that pass; pyproject.toml's lower bounds are these (test_install checks they agree).
# transformers < 5.0 lacks quantizers_utils.should_convert_module (the estimator's layout), and 5.0.0
# counts tied embeddings differently (estimates off by the embedding); 5.1.0 passes. accelerate < 1.2
# lacks utils.modeling.get_module_size_with_ties, which transformers 5 imports, and 1.2 lacks
# unwrap_model(keep_torch_compile=), which transformers 5.1's Trainer passes (a TypeError at the first
# training step; 1.3.0 added it, and the training test below runs Trainer). peft 0.18 is the
# oldest transformers 5 accepts. bitsandbytes 0.45 has no CPU kernels (the int8/nf4 tests fail); 0.48 passes
# (0.46 and 0.47 were not tried).
LOW = {
    "transformers": "5.1.0",
    "accelerate": "1.3.0",
    "peft": "0.18.0",
    "bitsandbytes": "0.48.0",
    "ipywidgets": "7.7.1",  # what Colab preinstalls; the panel and tqdm's bars must work with it
}
# Fast CPU subset run in every environment (the full suite runs in the main environment).
TESTS = [
    "tests/test_units.py",
    "tests/test_estimate.py",
    "tests/test_loading.py",
    "tests/test_preflight.py",
    "tests/test_install.py",
    "tests/test_widgets.py",
    # two real Trainer steps, a checkpoint and a rerun: the only Trainer run in the subset
    "tests/test_finetune.py::test_two_real_steps_train_save_and_rerun_as_finished",
]
DESELECT = "not test_cli_json_on_this_machine and not test_cli_unknown_command and not test_importing_helpers_quiets"
NOTEBOOK = "03_safe_eval"  # loads with load(), generates in batches, survives OOMs, resumes
TOOLS = ["pytest", "papermill", "ipykernel", "nbclient", "nbformat"]  # pinned as in requirements.txt
TEST_EXTRAS = ["httpx2"]  # tests/test_loading.py builds hub errors with it
MARKER = "OOMKIT_HELPERS_FROM="


# ----------------------------------------------------------------------------- shared steps


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def build_wheel(dest: Path, python: str = sys.executable) -> Path:
    """``pip wheel --no-deps --no-build-isolation .`` into ``dest``; the path of the oomkit wheel."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("oomkit-*.whl"):
        old.unlink()
    build = REPO / "build"
    if build.exists():  # a stale build/lib would put deleted modules into the wheel
        shutil.rmtree(build)
    run(
        [python, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO), "-w", dest],
        cwd=dest,
        stdout=subprocess.DEVNULL,
    )
    shutil.rmtree(build, ignore_errors=True)
    (wheel,) = dest.glob("oomkit-*.whl")
    return wheel


def venv_python(path: Path) -> Path:
    return path / "bin" / "python"


def site_packages(python: Path | str) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def tool_pins() -> list[str]:
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower()] = f"{name.strip()}=={version.strip()}"
    return [pins[t] for t in TOOLS] + TEST_EXTRAS


def notebook_runs(names: list[str] | None, tiny: Path, runs: Path) -> list[tuple[str, str, dict]]:
    """(notebook stem, run name, parameters) from tests/notebook_params, placeholders filled."""
    fill = {"tiny_llama": str(tiny / "llama"), "tiny_qwen2": str(tiny / "qwen2"), "runs": str(runs)}

    def _fill(value):
        if isinstance(value, str):
            return value.format(**fill)  # {repo} / {data} would raise: nothing may come from the repo
        if isinstance(value, list):
            return [_fill(v) for v in value]
        if isinstance(value, dict):
            return {k: _fill(v) for k, v in value.items()}
        return value

    out = []
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        if names and not any(n in nb.stem for n in names):
            continue
        spec = REPO / "tests" / "notebook_params" / f"{nb.stem}.json"
        entries = json.loads(spec.read_text()) if spec.exists() else [{"name": "default", "parameters": {}}]
        out += [(nb.stem, e.get("name", "default"), _fill(e.get("parameters", {}))) for e in entries]
    return out


def run_notebooks_here(
    directory: Path, names: list[str] | None = None, timeout: int = 600, keep_going: bool = False
) -> list[str]:
    """Copy ``notebooks/*.ipynb`` (only those) into the empty ``directory`` and run them there.

    Runs with this interpreter's kernel. Returns one line per run (``ok ...``, or ``FAIL ...`` with
    ``keep_going``); without it, raises on the first failure. Each executed copy gets a last cell
    printing where ``helpers`` was imported from, which must not be this repository.
    """
    directory = directory.resolve()
    if any(directory.iterdir()):
        raise SystemExit(f"{directory} is not empty")
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        shutil.copy(nb, directory / nb.name)
    tiny = Path(os.environ.get("OOMKIT_TINY", REPO / "data" / "tiny"))
    lines = []
    for stem, name, params in notebook_runs(names, tiny, directory):
        try:
            lines.append(_run_one(directory, stem, name, params, timeout))
        except Exception as e:  # papermill's cell error, or the checks below
            if not keep_going:
                raise
            lines.append(f"FAIL {stem}[{name}] {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    return lines


def _run_one(directory: Path, stem: str, name: str, params: dict, timeout: int) -> str:
    """One notebook run in ``directory``: its ``ok`` line, or RuntimeError saying what went wrong."""
    import nbformat
    import papermill

    source = nbformat.read(directory / f"{stem}.ipynb", as_version=4)
    source.cells.append(
        nbformat.v4.new_code_cell(f"import helpers, os\nprint({MARKER!r} + os.path.realpath(helpers.__file__))")
    )
    staged = directory / f".{stem}-{name}.in.ipynb"
    nbformat.write(source, staged)
    output = directory / f"{stem}-{name}.out.ipynb"
    started = time.perf_counter()
    with open(directory / f"{stem}-{name}.log", "w") as log:
        saved, sys.stderr = sys.stderr, log
        try:
            papermill.execute_notebook(
                str(staged), str(output), parameters=params, kernel_name="python3", cwd=str(directory),
                progress_bar=False, execution_timeout=timeout, log_output=False,
            )  # fmt: skip
        finally:
            sys.stderr = saved
    executed = nbformat.read(output, as_version=4)
    text = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", []))
    errors = [o for c in executed.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    origin = next((ln.split(MARKER, 1)[1] for ln in text.splitlines() if MARKER in ln), "?")
    if errors:
        raise RuntimeError(f"{stem}[{name}]: error output {errors[0].get('ename')}: {errors[0].get('evalue')}")
    if origin == "?" or Path(origin).is_relative_to(REPO / "helpers"):
        raise RuntimeError(f"{stem}[{name}]: helpers was imported from {origin}, not from an installed package")
    return f"ok {stem}[{name}] {time.perf_counter() - started:.1f} s helpers from {origin}"


# ----------------------------------------------------------------------------- the matrix


@dataclass
class Env:
    name: str
    requirements: list[str]  # what pip installs besides the wheel (torch first, pinned)
    upgrade: bool  # re-resolve to the newest releases on every run

    @property
    def path(self) -> Path:
        return CACHE / self.name

    @property
    def python(self) -> Path:
        return venv_python(self.path)

    def key(self) -> str:
        return hashlib.sha256(json.dumps([self.requirements, sys.version]).encode()).hexdigest()[:16]


def environments() -> dict[str, Env]:
    return {
        "low": Env("low", [TORCH, *(f"{p}=={v}" for p, v in LOW.items()), *tool_pins()], upgrade=False),
        "new": Env("new", [TORCH, *PACKAGES, *tool_pins()], upgrade=True),
    }


def prepare(env: Env, wheel: Path, log) -> str:
    """Create or reuse ``env``'s venv, install the requirements (once) and this build of the wheel."""
    stamp = env.path / ".oomkit-compat"
    fresh = not (stamp.exists() and stamp.read_text() == env.key())
    if fresh:
        shutil.rmtree(env.path, ignore_errors=True)
        venv.EnvBuilder(with_pip=True).create(env.path)
    pip = [env.python, "-m", "pip", "install", "-q"]
    if fresh or env.upgrade:
        # torch is named with its pin in the same command, so the resolver can never move it; the
        # wheel brings oomkit's other dependencies (the newest its ranges allow)
        run([*pip, *(["-U"] if env.upgrade else []), *env.requirements, wheel], stdout=log, stderr=log)
        stamp.write_text(env.key())
    run([*pip, "--force-reinstall", "--no-deps", wheel], stdout=log, stderr=log)
    found = subprocess.run(
        [
            env.python,
            "-c",
            f"import importlib.metadata as m; print(*(m.version(p) for p in {['torch', *PACKAGES]!r}))",
        ],  # fmt: skip
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return " ".join(f"{p} {v}" for p, v in zip(["torch", *PACKAGES], found))


def test_tree(env: Env) -> Path:
    """A copy of what the tests need, without ``helpers/``: tests, scripts, pyproject, the tiny models."""
    tree = env.path / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    (tree / "data").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", tree)
    shutil.copytree(REPO / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "scripts", tree / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "data" / "build_tiny_models.py", tree / "data")
    shutil.copytree(REPO / "data" / "corpus", tree / "data" / "corpus")
    shutil.copytree(REPO / "data" / "tiny", tree / "data" / "tiny")  # built by the main environment
    return tree


def check_env(env: Env, wheel: Path) -> tuple[bool, str, str, float]:
    started = time.perf_counter()
    env.path.mkdir(parents=True, exist_ok=True)
    logfile = CACHE / f"{env.name}.log"
    with open(logfile, "w") as log:
        try:
            versions = prepare(env, wheel, log)
        except subprocess.CalledProcessError:
            return False, "install failed", str(logfile), time.perf_counter() - started
        # in a copy of the tests without helpers/: they import helpers from the installed wheel
        tree = test_tree(env)
        tests = subprocess.run(
            [env.path / "bin" / "pytest", "-q", "-m", "not slow and not cuda", "-k", DESELECT, "-p", "no:cacheprovider", *TESTS],
            cwd=tree, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": ""},
        )  # fmt: skip
        tmp = CACHE / f"{env.name}-notebooks"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        nb = subprocess.run(
            [env.python, Path(__file__), "notebooks", tmp, NOTEBOOK],
            cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": "", "OOMKIT_TINY": str(tree / "data" / "tiny")},
        )  # fmt: skip
    ok = tests.returncode == 0 and nb.returncode == 0
    what = f"{versions}; tests {'ok' if tests.returncode == 0 else 'FAILED'}, {NOTEBOOK} {'ok' if nb.returncode == 0 else 'FAILED'}"
    return ok, what, str(logfile), time.perf_counter() - started


def matrix(names: list[str]) -> int:
    started = time.perf_counter()
    CACHE.mkdir(exist_ok=True)
    (CACHE / ".gitignore").write_text("*\n")
    wheel = build_wheel(CACHE / "wheels")
    envs = environments()
    rows = []
    for name in names or list(envs):
        ok, what, log, secs = check_env(envs[name], wheel)
        rows.append((name, ok, what, log, secs))
        print(
            f"{'ok    ' if ok else 'FAILED'} {name:4s} {secs:6.1f} s  {what}" + ("" if ok else f"  (see {log})"),
            flush=True,
        )
    failed = sum(not ok for _, ok, *_ in rows)
    print(
        f"\ncompatibility matrix: {len(rows) - failed} passed, {failed} failed ({time.perf_counter() - started:.0f} s)"
    )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("matrix", help="build the wheel and test it in the cached environments")
    m.add_argument("envs", nargs="*", help="low, new (default: both)")
    n = sub.add_parser("notebooks", help="run copies of the notebooks in an empty directory")
    n.add_argument("directory", type=Path)
    n.add_argument("names", nargs="*")
    n.add_argument("--keep-going", action="store_true", help="run every notebook, a FAIL line for each that fails")
    args = parser.parse_args(argv)
    if args.command == "matrix":
        return matrix(args.envs)
    lines = run_notebooks_here(args.directory, args.names or None, keep_going=args.keep_going)
    for line in lines:
        print(line, flush=True)
    return 1 if any(line.startswith("FAIL ") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
