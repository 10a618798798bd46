#!/usr/bin/env bash
# Fetch the wheels a lent GPU machine lacks (it has torch, transformers, accelerate and peft, and no
# internet) into .whl/ (git-ignored), for `carry: [".whl"]` and an offline install there:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD
# Versions come from requirements.txt; what travels stays under the 64 MiB a call may carry.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
mkdir -p "$dest"
pin() { grep -E "^$1==" requirements.txt | head -n 1; }
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
wanted=(bitsandbytes psutil nvidia-ml-py ipywidgets papermill nbclient nbformat jupytext ipykernel pytest)
for name in "${wanted[@]}"; do
  spec=$(pin "$name"); spec=${spec:-$name}
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dest" "$spec"
done
# small pure-Python needs of those that a bare torch image may lack
for extra in widgetsnbextension jupyterlab_widgets comm entrypoints tenacity ansicolors fastjsonschema \
             jsonschema jsonschema-specifications referencing rpds-py attrs traitlets jupyter_core jupyter_client \
             pyzmq tornado nest_asyncio iniconfig pluggy; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dest" "$extra" || echo "skipped $extra"
done
du -sh "$dest"
size=$(du -sm "$dest" | cut -f1)
if [ "$size" -ge 64 ]; then echo "warning: $dest is ${size} MiB, over the 64 MiB a call may carry" >&2; fi
