#!/usr/bin/env bash
# The prepared device check (issue 21): the cuda-marked kernel tests, then benchmarks/gpu_check.py
# (decode steps vs the bandwidth floor, prefill tokens/s, graphs on/off). Runs from the source
# tree with the machine's own torch and Triton, no install and no network; about 8 minutes at
# most on an H200 (each part has its own time limit).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]       # on the GPU machine; OUT_DIR defaults to $OUT or .
#   bash benchmarks/gpu_check.sh --vendor-pytest # here, before: copies pytest (pure Python) into
#                                                # benchmarks/results/gpu_check_site for a machine without it
#   bash benchmarks/gpu_check.sh --dry-run       # anywhere: the driver's tiny CPU run, no tests
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
SITE=benchmarks/results/gpu_check_site

if [[ "${1:-}" == "--vendor-pytest" ]]; then
  src="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$SITE"
  for pkg in pytest _pytest pluggy iniconfig packaging pygments py.py; do cp -r "$src/$pkg" "$SITE/"; done
  du -sh "$SITE"
  exit 0
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${1:-}" == "--dry-run" ]]; then
  exec "$PY" benchmarks/gpu_check.py --dry-run --out "${OUT:-/tmp}/gpu_check_dry.json"
fi
OUT_DIR="${1:-${OUT:-.}}"
mkdir -p "$OUT_DIR"
"$PY" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import triton; print("triton", triton.__version__)
except ImportError:
    print("triton: not installed (kernel rows fall back to the references)")
PY
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>/dev/null

if ! "$PY" -c "import pytest" 2>/dev/null && [[ -d "$SITE" ]]; then
  export PYTHONPATH="$PYTHONPATH:$PWD/$SITE"
fi
if "$PY" -c "import pytest" 2>/dev/null; then
  echo "== cuda tests: kernels, then the engine's equivalence family (limit 150 s)"
  timeout 150 "$PY" -m pytest -q -rs -p no:cacheprovider -o addopts="" -m cuda tests/engine/kernels \
    tests/engine/test_cuda_equivalence.py \
    --junitxml="$OUT_DIR/gpu_check_tests.xml" 2>&1 | tail -40
  echo "cuda tests exit status: ${PIPESTATUS[0]}"
else
  echo "== cuda tests skipped: no pytest on this machine (bash benchmarks/gpu_check.sh --vendor-pytest first)"
fi

echo "== gpu_check.py (limit 300 s; no new row after 240 s)"
timeout 300 "$PY" benchmarks/gpu_check.py --budget-s 240 --out "$OUT_DIR/gpu_check.json"
echo "gpu_check.py exit status: $?"
