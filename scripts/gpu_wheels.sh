#!/usr/bin/env bash
# Fetch the wheels a lent GPU machine lacks (it has torch, transformers, accelerate and peft, no
# internet, and a Python minor nobody knows in advance) into .whl/ (git-ignored), for
# `carry: [".whl", "data/tiny/llama", "data/tiny/qwen2"]` and an offline install there BY NAME, so pip picks the wheel that
# matches the machine's Python (docs/gpu_check.md):
#   python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir \
#     --target /tmp/site -r .whl/py$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])').txt
#   export PYTHONPATH=/tmp/site:$PWD
# (.whl/py3.X.txt names what was fetched for that minor: one name pip cannot match fails them all)
# Pure and abi3 wheels are fetched once; binary ones once per Python minor in GPU_PY (default
# 3.10-3.13). The bitsandbytes wheel is repacked without its ROCm, XPU and CUDA 11.8/12.1/12.4
# libraries (kept: CPU, CUDA 12.6, 12.8, 13.0, 13.2; on an older CUDA set BNB_CUDA_VERSION=126).
# Fails when .whl/ + the two decoder tiny models (the GPU check and notebooks use only those) + the tracked files would pass LIMIT_MIB (a call carries 64 MiB).
# matplotlib (~20 MiB a Python minor with pillow, fonttools, kiwisolver) comes only with
# WITH_MPL=1, meant with a single GPU_PY (the minor the preflight call printed): the notebooks stage
# needs it, no other stage does.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
read -r -a pythons <<<"${GPU_PY:-3.10 3.11 3.12 3.13}"
limit=${LIMIT_MIB:-55}
rm -rf "$dest" && mkdir -p "$dest"
pin() { grep -E "^$1==" requirements.txt | head -n 1 || true; }
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
           --platform linux_x86_64 --platform any)
# what the harness, the cuda tests and the notebooks import, and everything they need that a bare
# torch + transformers + accelerate + peft image may lack (checked against the dependency metadata)
wanted=(bitsandbytes psutil nvidia-ml-py pytest iniconfig pluggy exceptiongroup tomli
        ipywidgets widgetsnbextension jupyterlab_widgets comm
        ipython ipython_pygments_lexers decorator jedi parso matplotlib-inline pexpect ptyprocess prompt_toolkit
        wcwidth pygments stack_data asttokens executing pure_eval traitlets typing_extensions
        ipykernel debugpy nest-asyncio2 jupyter_client jupyter_core python-dateutil six pyzmq tornado platformdirs
        papermill nbclient nbformat jupytext mdit-py-plugins markdown-it-py mdurl entrypoints tenacity ansicolors
        fastjsonschema jsonschema jsonschema-specifications referencing rpds-py attrs
        pyyaml click requests urllib3 certifi charset-normalizer idna packaging)
if [ "${WITH_MPL:-0}" = 1 ]; then wanted+=(matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing); fi
fetch() {  # fetch NAME PYTHON: the pinned version, else the newest that supports that Python
  local spec
  spec=$(pin "$1"); spec=${spec:-$1}
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$2" --implementation cp \
    "${platforms[@]}" -d "$dest" "$spec" 2>/dev/null ||
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$2" --implementation cp \
      "${platforms[@]}" -d "$dest" "$1" 2>/dev/null
}
missing=()
for py in "${pythons[@]}"; do
  : >"$dest/py$py.txt"
  for name in "${wanted[@]}"; do
    if fetch "$name" "$py"; then echo "$name" >>"$dest/py$py.txt"; else missing+=("$name for $py"); fi
  done
done

# bitsandbytes: drop the libraries no lent H100/H200 with a CUDA 12.6+ torch loads (saves ~23 MiB)
python3 - "$dest" <<'EOF'
import pathlib, re, sys, zipfile

drop = re.compile(r"bitsandbytes/libbitsandbytes_(rocm\d+|xpu\d+|cuda11\d|cuda12[0-5])\.(so|dll|dylib)$")
for whl in pathlib.Path(sys.argv[1]).glob("bitsandbytes-*.whl"):
    tmp = whl.with_suffix(".tmp")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for item in src.infolist():
            if drop.search(item.filename):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not drop.search(line.split(",")[0])).encode()
            out.writestr(item, data, compress_type=zipfile.ZIP_DEFLATED)
    kept = sorted(n.split("_", 1)[1] for n in zipfile.ZipFile(tmp).namelist() if "libbitsandbytes_" in n)
    tmp.replace(whl)
    print(f"repacked {whl.name}: {whl.stat().st_size / 2**20:.1f} MiB, libraries {', '.join(kept)}")
EOF

[ ${#missing[@]} -eq 0 ] || echo "not available (built into that Python, or dropped support): ${missing[*]}"
whl=$(du -sb "$dest" | cut -f1)
tiny=$(du -scbL data/tiny/llama data/tiny/qwen2 2>/dev/null | tail -n 1 | cut -f1 || echo 0)
repo=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
total=$(( (whl + tiny + repo) / 1048576 ))
echo "$(ls "$dest"/*.whl | wc -l) wheels for Python ${pythons[*]}: .whl $((whl / 1048576)) MiB" \
  "+ data/tiny/{llama,qwen2} $((tiny / 1048576)) MiB + repo $((repo / 1048576)) MiB = ${total} MiB (limit ${limit} MiB)"
if [ "$total" -ge "$limit" ]; then
  echo "error: the carried set is ${total} MiB, over ${limit} MiB (a call carries 64 MiB): narrow GPU_PY" \
       "to the machine's Python minor or drop WITH_MPL" >&2
  exit 1
fi
