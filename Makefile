# Two commands on a fresh machine: `make demo` (run every notebook headless on the tiny model)
# and `make test` (the test suite). Both set up .venv first and are no-ops when nothing changed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.oomkit-installed
BROWSER_STAMP := $(VENV)/.oomkit-browser-installed
CHROMIUM ?= /usr/bin/chromium
TINY   := data/tiny/BUILD.json

.PHONY: setup demo test test-wheel test-compat test-browser bench docs lint format sync-notebooks clean gpu-check gpu-predict gpu-wheels

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, pinned, and the CPU build: PyPI's Linux torch wheel pulls gigabytes of CUDA libraries.
# The +cpu wheel comes from a local wheel cache where there is one, else from PyTorch's CPU index.
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
$(STAMP): requirements.txt pyproject.toml | $(BIN)/python
	@$(BIN)/python -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "oomkit needs Python >= 3.11 (transformers 5 does); run: make PYTHON=python3.11 ...")'
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_CPU)" 2>/dev/null \
		|| $(BIN)/pip install -q "$(TORCH_CPU)" --index-url $(TORCH_CPU_INDEX) --extra-index-url https://pypi.org/simple
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

$(TINY): data/build_tiny_models.py $(wildcard data/corpus/*.txt) $(STAMP)
	$(BIN)/python data/build_tiny_models.py

demo: setup $(TINY)
	$(BIN)/python scripts/run_notebooks.py

# Two workers, one torch thread each (tests/conftest.py): both cores busy without oversubscription; the
# tests of one module share a worker (--dist loadscope --no-loadscope-reorder), so the built wheel (tests/test_wheel.py) is built
# and its notebooks run once; the longest modules start first (tests/conftest.py LONGEST_MODULES).
# TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
test: setup $(TINY)
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

# The built wheel, installed in a fresh virtualenv, runs every notebook from an empty directory, and a pip dry run
# beside Colab's torch (tests/test_wheel.py, marker "wheel": ~2.5 minutes, kept out of make test's quick loop)
test-wheel: setup $(TINY)
	$(BIN)/python -m pytest -q -m wheel tests/test_wheel.py

# The compatibility matrix: the built wheel in fresh virtualenvs cached in ~/.cache/oomkit-compat
# (OOMKIT_COMPAT_CACHE; kept between runs and clones, rebuilt when their requirements change): the
# lowest transformers/accelerate/peft/bitsandbytes that pyproject.toml claims and the newest releases
# (torch 2.13.0 CPU in both), and Colab's stack (Python 3.13, torch 2.11 from PyPI, the install cell);
# a fast CPU test subset and one notebook in each, then a table. `scripts/compat.py matrix colab` runs one.
test-compat: setup $(TINY)
	$(BIN)/python scripts/compat.py matrix

# JupyterLab + headless Chromium (opt-in: `make test` deselects the `browser` marker). Debian's
# Chromium, installed when missing (needs root, as in CI); the whole run is bounded in time.
$(BROWSER_STAMP): requirements-browser.txt $(STAMP)
	$(BIN)/pip install -q -r requirements-browser.txt
	touch $@

# Colab's preinstalled ipywidgets 7.7.1, in a folder the browser test puts first on its kernels'
# PYTHONPATH, and JupyterLab 3.6 with the widget front end that renders 7.x (jupyterlab_widgets 3
# renders only 8.x): the panel and tqdm's bars are checked with both ipywidgets.
IPYWIDGETS7 := $(VENV)/ipywidgets7
LAB3 := $(VENV)/lab3
$(IPYWIDGETS7)/.installed: $(STAMP)
	$(BIN)/pip install -q --no-deps --target $(IPYWIDGETS7) ipywidgets==7.7.1 ipython_genutils==0.2.0
	touch $@

$(LAB3)/.installed:
	$(PYTHON) -m venv $(LAB3)
	$(LAB3)/bin/pip install -q jupyterlab==3.6.8 jupyterlab_widgets==1.1.11
	touch $@

$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium

test-browser: setup $(TINY) $(BROWSER_STAMP) $(IPYWIDGETS7)/.installed $(LAB3)/.installed $(CHROMIUM)
	OOMKIT_CHROMIUM=$(CHROMIUM) OOMKIT_IPYWIDGETS7=$(abspath $(IPYWIDGETS7)) OOMKIT_LAB3_PYTHON=$(abspath $(LAB3))/bin/python timeout --kill-after=30 600 $(BIN)/python -m pytest -q -m browser tests

bench: setup $(TINY)
	@set -e; for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b; done

# docs/benchmarks.md and the README's results table, rendered from bench/results/*.json; the guides'
# example outputs, rendered by running their commands.
docs: setup
	$(BIN)/python scripts/gpu_reestimate.py
	$(BIN)/python scripts/render_benchmarks.py
	$(BIN)/python scripts/render_guides.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check helpers tests bench scripts data

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format helpers tests bench scripts data

# Edit either side of a notebook pair (.ipynb or .py), then sync; outputs are never stored.
sync-notebooks: setup
	$(BIN)/jupytext --sync notebooks/*.py
	$(BIN)/python scripts/strip_notebooks.py notebooks/*.ipynb

clean:
	rm -rf runs data/tiny .compat

# GPU truth (docs/gpu_check.md): every CUDA path on a real GPU capped to a T4, resumable by stage.
# `make gpu-check DRY=1` rehearses every stage on the CPU with the tiny model (CI runs it in the tests).
# On a lent GPU machine without a venv: GPU_PYTHON=python3 make gpu-check STAGES=weights
GPU_PYTHON ?= $(BIN)/python
gpu-check: $(if $(DRY),setup $(TINY))
	$(GPU_PYTHON) scripts/gpu_check.py $(if $(DRY),--dry-run) $(if $(STAGES),--stages $(STAGES)) $(if $(FRESH),--fresh) \
	  $(if $(MODELS),--models $(MODELS))

# The times oomkit predicts for the GPU check's generate and QLoRA cells (T4 and H200 figures), written before
# a GPU measures them: bench/results/gpu/time_predicted.json (no GPU needed)
gpu-predict: setup
	$(BIN)/python scripts/gpu_check.py --predict

# GPU_PY="3.12" narrows the wheels to one Python minor; WITH_MPL=1 adds matplotlib (notebooks stage)
gpu-wheels:
	bash scripts/gpu_wheels.sh
