#!/usr/bin/env bash
# On a lent GPU machine (no internet): install from the carried .whl/ (`make gpu-wheels` here) only
# the packages its image lacks, into /tmp/site, so the image's own torch stack is never shadowed.
# Then: export PYTHONPATH=/tmp/site:$PWD (docs/gpu_check.md).
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ ! -f ".whl/py$py.txt" ]; then
  echo "no wheels for Python $py in .whl/: run 'GPU_PY=$py make gpu-wheels' on the dev machine and carry .whl" >&2
  exit 1
fi
norm() { tr 'A-Z_.' 'a-z--'; }
have=$(python3 -m pip list --format=freeze 2>/dev/null | cut -d= -f1 | norm)
need=()
while read -r name; do
  [ -n "$name" ] || continue
  grep -qx "$(norm <<<"$name")" <<<"$have" || need+=("$name")
done <".whl/py$py.txt"
if [ ${#need[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir \
    --target /tmp/site "${need[@]}"
fi
echo "gpu_setup: Python $py; installed from .whl: ${need[*]:-nothing}"
