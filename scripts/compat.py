"""The compatibility matrix and the installed-wheel checks (``make test-compat``).

``python scripts/compat.py matrix [ENV ...]`` builds the wheel, installs it into fresh virtualenvs
and, in each, runs a fast CPU subset of the test suite and one notebook from an empty directory:

- ``low``: the lowest transformers / accelerate / peft / bitsandbytes that ``pyproject.toml`` claims;
- ``new``: the newest releases on the index (upgraded on every run);
- ``colab``: Colab's GPU runtime as it is today (``COLAB``: its Python, torch and preinstalled
  packages at their exact versions), then the wheel installed the way the notebooks' first cell does
  it (``pip install "oomkit @ ..."``, dependencies included); the packages Colab ships must not move.
  The tests run a second time with bitsandbytes uninstalled (Colab lacks it until that cell runs).

``low`` and ``new`` keep torch at the CPU wheel ``torch==2.13.0`` (older CPU wheels are not on PyPI;
its Linux wheels there pull gigabytes of CUDA libraries). ``colab`` takes torch 2.11 from PyPI as it
is, CUDA libraries included (a virtualenv of several GB; it runs on the CPU here).

The virtualenvs are cached outside the repository, in ``$OOMKIT_COMPAT_CACHE`` (default
``~/.cache/oomkit-compat``), so they outlive fresh clones on the same machine; each is rebuilt when
its requirements or interpreter change, and a lock keeps two clones from using one at the same time.
The wheel, the test tree, the logs and the notebook runs stay in ``.compat/``. An environment that
cannot be set up here (no Python 3.13, the index unreachable, no disk) is reported in one line as
``n/a`` and does not fail the matrix; a wheel that fails to install into a working environment does.

``python scripts/compat.py notebooks DIR [NAME ...]`` copies ``notebooks/*.ipynb`` into the empty
directory ``DIR`` and executes them there with this interpreter (the tiny model as a parameter, as
``tests/notebook_params`` says), then checks that ``helpers`` came from an installed package. The
installed-wheel tests (``tests/test_wheel.py``) use it too.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".compat"  # this clone's wheel, test trees, logs and notebook runs
# the virtualenvs: outside the repository, so a fresh clone on the same machine reuses them
ENV_CACHE = Path(os.environ.get("OOMKIT_COMPAT_CACHE") or Path.home() / ".cache" / "oomkit-compat")
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

# Colab's GPU runtime (googlecolab/backend-info, 2026-08; issue 36): Python 3.13 and these preinstalled
# packages. Where the freeze names a minor release, the pin is its newest patch on PyPI (checked with
# `pip index versions` in 2026-08; each exists as a wheel for CPython 3.13 on Linux). No bitsandbytes:
# Colab does not preinstall it, so the notebooks' install cell brings it in as an oomkit dependency.
COLAB_PYTHON = "3.13"  # OOMKIT_COLAB_PYTHON names the interpreter; else python3.13 on PATH, else pyenv's
COLAB = {
    "torch": "2.11.0",  # the only 2.11 release; PyPI's Linux wheel brings the CUDA 13 libraries (GBs)
    "transformers": "5.15.1",  # 5.15.0 and 5.15.1 exist
    "accelerate": "1.14.0",  # the only 1.14 release
    "peft": "0.20.0",  # the only 0.20 release
    "ipywidgets": "7.7.1",  # exact in the freeze
    "tqdm": "4.67.3",  # 4.67.0 .. 4.67.3
    "matplotlib": "3.10.9",  # 3.10.0 .. 3.10.9
    "psutil": "5.9.5",  # exact in the freeze
}


# ----------------------------------------------------------------------------- shared steps


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


WHEEL_SOURCES = ("pyproject.toml", "README.md", "helpers")  # what the wheel is built from


def build_wheel(dest: Path, python: str = sys.executable) -> Path:
    """``pip wheel --no-deps --no-build-isolation`` into ``dest``; the path of the oomkit wheel.

    Built from a private copy of the sources: setuptools' build/ and egg-info never land in the
    checkout (a stale build/lib would put deleted modules into the wheel), and builds running at the
    same time (test workers, the matrix) cannot remove each other's files mid-build."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("oomkit-*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="oomkit-wheel-src-") as tmp:
        src = Path(tmp)
        for name in WHEEL_SOURCES:
            if (REPO / name).is_dir():
                shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(REPO / name, src / name)
        run(
            [python, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", dest],
            cwd=dest,
            stdout=subprocess.DEVNULL,
        )
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
    fill = {
        "tiny_llama": str(tiny / "llama"),
        "tiny_qwen2": str(tiny / "qwen2"),
        "tiny_whisper": str(tiny / "whisper"),
        "runs": str(runs),
    }

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


class Unavailable(Exception):
    """The environment cannot be set up on this machine (no interpreter, no index, no disk): why, in one line."""


@dataclass
class Env:
    name: str
    requirements: list[str]  # what pip installs besides the wheel (torch first, pinned)
    upgrade: bool  # re-resolve to the newest releases on every run
    base: str = sys.executable  # the interpreter the virtualenv is made from
    colab: bool = False  # the requirements first, then the wheel as the notebooks' install cell installs it
    missing: str = ""  # why it cannot be built here ("" when it can)
    without: str = ""  # a package to uninstall for a second pass of the tests (what the runtime lacks)

    @property
    def path(self) -> Path:
        return ENV_CACHE / self.name

    @property
    def python(self) -> Path:
        return venv_python(self.path)

    def key(self) -> str:
        identity = [self.requirements, self.colab, interpreter_version(self.base)]
        return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]


def interpreter_version(python: str) -> str:
    if python == sys.executable:
        return sys.version
    try:
        out = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True)
    except OSError:  # not there, not executable
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def colab_python() -> tuple[str, str]:
    """(interpreter, "") for Colab's Python, or ("", why not) when this machine has none."""
    named = os.environ.get("OOMKIT_COLAB_PYTHON")
    found = [named] if named else []
    found += [shutil.which(f"python{COLAB_PYTHON}") or ""]
    found += [str(p) for p in sorted(Path.home().glob(f".pyenv/versions/{COLAB_PYTHON}.*/bin/python{COLAB_PYTHON}"))]
    for python in filter(None, found):
        if interpreter_version(python).startswith(COLAB_PYTHON + "."):
            return python, ""
        if named:
            return "", f"OOMKIT_COLAB_PYTHON={named} is not a working Python {COLAB_PYTHON}"
    return "", f"no Python {COLAB_PYTHON} here (install one, or name it in OOMKIT_COLAB_PYTHON)"


def environments() -> dict[str, Env]:
    python, missing = colab_python()
    return {
        "low": Env("low", [TORCH, *(f"{p}=={v}" for p, v in LOW.items()), *tool_pins()], upgrade=False),
        "new": Env("new", [TORCH, *PACKAGES, *tool_pins()], upgrade=True),
        "colab": Env(
            "colab",
            [*(f"{p}=={v}" for p, v in COLAB.items()), *tool_pins()],
            upgrade=False,
            base=python or sys.executable,
            colab=True,
            missing=missing,
            without="bitsandbytes",  # Colab does not preinstall it
        ),
    }


def last_error(logfile: Path) -> str:
    """The last line pip printed that says what went wrong, shortened."""
    lines = [ln.strip() for ln in logfile.read_text(errors="replace").splitlines() if ln.strip()]
    generic = ("ResolutionImpossible", "for help visit", "resolver does not currently take into account")
    errors = [ln for ln in lines if ln.startswith(("ERROR", "error")) or "Error" in ln]
    errors = [ln for ln in errors if not any(g in ln for g in generic)] or errors
    return (errors or lines or ["no output"])[-1][:200]


def disk_usage(path: Path) -> int:
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True)
    return int(out.stdout.split()[0]) * 1024 if out.returncode == 0 and out.stdout else 0


def installed(python: Path, packages: list[str]) -> dict[str, str | None]:
    code = (
        "import importlib.metadata as m, json\n"
        "def v(p):\n"
        "    try:\n        return m.version(p)\n    except m.PackageNotFoundError:\n        return None\n"
        f"print(json.dumps({{p: v(p) for p in {packages!r}}}))"
    )
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def prepare(env: Env, wheel: Path, log, logfile: Path) -> tuple[str, str]:
    """Create or reuse ``env``'s venv, install the requirements (once) and this build of the wheel.

    Returns (the versions that matter, how the environment was built). Raises :class:`Unavailable`
    when the environment itself cannot be set up here, CalledProcessError when the wheel fails.
    """
    if env.missing:
        raise Unavailable(env.missing)
    stamp = env.path / ".oomkit-compat"
    built = json.loads(stamp.read_text()) if stamp.exists() and stamp.read_text().startswith("{") else {}
    fresh = built.get("key") != env.key()
    pip = [env.python, "-m", "pip", "install", "-q"]
    if fresh:
        started = time.perf_counter()
        shutil.rmtree(env.path, ignore_errors=True)
        env.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            run([env.base, "-m", "venv", env.path], stdout=log, stderr=log)
            if env.colab:  # the runtime as Colab ships it, before oomkit
                run([*pip, *env.requirements], stdout=log, stderr=log)
            else:
                # torch is named with its pin in the same command, so the resolver can never move it; the
                # wheel brings oomkit's other dependencies (the newest its ranges allow)
                run([*pip, *env.requirements, wheel], stdout=log, stderr=log)
        except subprocess.CalledProcessError:
            log.flush()
            shutil.rmtree(env.path, ignore_errors=True)  # half an environment is never reused
            if env.colab:
                raise Unavailable(f"its packages do not install here: {last_error(logfile)}") from None
            raise
        built = {"key": env.key(), "seconds": round(time.perf_counter() - started), "bytes": disk_usage(env.path)}
        built["date"] = time.strftime("%Y-%m-%d %H:%M")
        stamp.write_text(json.dumps(built))
    elif env.upgrade:
        run([*pip, "-U", *env.requirements, wheel], stdout=log, stderr=log)
    how = f"{'built' if fresh else 'cached'}: {built['bytes'] / 1e9:.1f} GB, built in {built['seconds']} s"
    if env.colab:
        # the notebooks' first cell: %pip install -q "oomkit @ git+https://..." (dependencies included,
        # nothing upgraded that is already there); here the same requirement points at the built wheel
        run([*pip, f"oomkit @ {wheel.resolve().as_uri()}"], stdout=log, stderr=log)
        now = installed(env.python, list(COLAB))
        moved = [f"{p} {v} -> {now[p]}" for p, v in COLAB.items() if now[p] != v]
        if moved:
            stamp.unlink()  # rebuilt as Colab ships it on the next run
            raise RuntimeError(f"the install cell replaced Colab's {', '.join(moved)}")
    run([*pip, "--force-reinstall", "--no-deps", wheel], stdout=log, stderr=log)  # this build's files
    found = installed(env.python, ["torch", *PACKAGES])
    versions = " ".join(f"{p} {v or 'absent'}" for p, v in found.items())
    return f"python {interpreter_version(env.base).split()[0]} {versions}", how


def test_tree(env: Env) -> Path:
    """A copy of what the tests need, without ``helpers/``: tests, scripts, pyproject, the tiny models."""
    tree = CACHE / f"{env.name}-tree"
    shutil.rmtree(tree, ignore_errors=True)
    (tree / "data").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", tree)
    shutil.copytree(REPO / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "scripts", tree / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "data" / "build_tiny_models.py", tree / "data")
    shutil.copytree(REPO / "data" / "corpus", tree / "data" / "corpus")
    shutil.copytree(REPO / "data" / "tiny", tree / "data" / "tiny")  # built by the main environment
    return tree


@dataclass
class Row:
    name: str
    result: str  # "ok", "FAILED" or "n/a"
    seconds: float
    what: str  # versions, or why not
    how: str = ""  # how the environment was built, its size
    tests: str = ""
    notebook: str = ""
    log: str = ""


def pytest_counts(output: str) -> str:
    """pytest's closing counts ("212 passed, 4 skipped"), or its last line."""
    lines = [ln.strip("= ") for ln in output.splitlines() if ln.strip()]
    counts = [ln for ln in lines if re.search(r"\d+ (passed|failed|error)", ln)]
    last = (counts or lines or ["no output"])[-1]
    return re.sub(r"(, \d+ warnings?)? in [\d.]+s.*$", "", last)


def check_env(env: Env, wheel: Path) -> Row:
    started = time.perf_counter()
    logfile = CACHE / f"{env.name}.log"
    with open(logfile, "w") as log, env_lock(env):
        try:
            versions, how = prepare(env, wheel, log, logfile)
        except Unavailable as e:
            return Row(env.name, "n/a", time.perf_counter() - started, str(e), log=str(logfile))
        except subprocess.CalledProcessError:
            log.flush()
            return Row(
                env.name,
                "FAILED",
                time.perf_counter() - started,
                f"install failed: {last_error(logfile)}",
                log=str(logfile),
            )
        except RuntimeError as e:
            return Row(env.name, "FAILED", time.perf_counter() - started, str(e), log=str(logfile))
        # in a copy of the tests without helpers/: they import helpers from the installed wheel
        tree = test_tree(env)
        tests = run_tests(env, tree, log)
        tmp = CACHE / f"{env.name}-notebooks"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        nb = subprocess.run(
            [env.python, Path(__file__), "notebooks", tmp, NOTEBOOK],
            cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": "", "OOMKIT_TINY": str(tree / "data" / "tiny")},
        )  # fmt: skip
        results = [tests]
        counts = f"{'ok' if tests.returncode == 0 else 'FAILED'}: {pytest_counts(tests.stdout)}"
        if env.without:
            # the same tests once more with the package gone, as a runtime that lacks it has it: the tests
            # that need it skip, the rest pass (the next run's install cell puts it back)
            log.write(f"\n===== the tests again without {env.without}\n")
            log.flush()
            removed = subprocess.run(
                [env.python, "-m", "pip", "uninstall", "-y", "-q", env.without], stdout=log, stderr=log
            )
            results.append(run_tests(env, tree, log) if removed.returncode == 0 else removed)
            again = "ok" if results[-1].returncode == 0 else "FAILED"
            counts += f"; without {env.without} {again}: {pytest_counts(results[-1].stdout or '')}"
    ok = all(r.returncode == 0 for r in results) and nb.returncode == 0
    return Row(
        env.name, "ok" if ok else "FAILED", time.perf_counter() - started, versions, how, counts,
        f"{NOTEBOOK} {'ok' if nb.returncode == 0 else 'FAILED'}", str(logfile),
    )  # fmt: skip


def run_tests(env: Env, tree: Path, log) -> subprocess.CompletedProcess:
    """The CPU test subset in ``tree`` with ``env``'s pytest; its output goes to the log too."""
    log.flush()
    tests = subprocess.run(
        [env.path / "bin" / "pytest", "-q", "-m", "not slow and not cuda", "-k", DESELECT, "-p", "no:cacheprovider", *TESTS],
        cwd=tree, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    log.write(tests.stdout + tests.stderr)
    log.flush()
    return tests


@contextlib.contextmanager
def env_lock(env: Env):
    """One user of a cached environment at a time (two clones running the matrix at once wait here)."""
    ENV_CACHE.mkdir(parents=True, exist_ok=True)
    with open(ENV_CACHE / f"{env.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def matrix(names: list[str]) -> int:
    started = time.perf_counter()
    CACHE.mkdir(exist_ok=True)
    (CACHE / ".gitignore").write_text("*\n")
    wheel = build_wheel(CACHE / "wheels")
    envs = environments()
    unknown = [n for n in names if n not in envs]
    if unknown:
        raise SystemExit(f"unknown environment {', '.join(unknown)}: pick from {', '.join(envs)}")
    print(f"environments cached in {ENV_CACHE} (OOMKIT_COMPAT_CACHE), logs in {CACHE}", flush=True)
    rows = []
    for name in names or list(envs):
        row = check_env(envs[name], wheel)
        rows.append(row)
        print(f"{row.result:6s} {name:5s} {row.seconds:6.0f} s  {row.what}", flush=True)
    print("\n| env | result | time | environment | tests | notebook | versions |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.name} | {r.result} | {r.seconds:.0f} s | {r.how or '-'} | {r.tests or '-'} | {r.notebook or '-'} | {r.what} |"
        )
    failed = [r for r in rows if r.result == "FAILED"]
    for r in failed:
        print(f"{r.name}: see {r.log}")
    na = sum(r.result == "n/a" for r in rows)
    passed = len(rows) - len(failed) - na
    print(
        f"\ncompatibility matrix: {passed} passed, {len(failed)} failed, {na} not available here"
        f" ({time.perf_counter() - started:.0f} s)"
    )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("matrix", help="build the wheel and test it in the cached environments")
    m.add_argument("envs", nargs="*", help="low, new, colab (default: all)")
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
