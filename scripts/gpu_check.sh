#!/usr/bin/env bash
# One prepared command for a GPU machine: the decisive checks first (scripts/gpu_decisive.py: graph replay on the
# timed stream, a second feed of a captured shape, ORT on torch's stream, static-cache decode eager vs captured
# with tokens, TPOT and kernel/launch counts), then the GPU-marked tests, then one recipe. Each step is bounded
# (about 8 minutes in all; the device tool allows 10); OUT/summary.json and OUT/summary.txt say pass / fail / skip.
# The machine lacks pip access and a few packages: `bash scripts/gpu_wheelhouse.sh` here first, carry `.whl`.
#   bash scripts/gpu_check.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OPTIMIZER_HISTORY="$out/history.sqlite"
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if ls .whl/*.whl >/dev/null 2>&1; then  # the machine's own torch stays: only the missing small packages
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY - <<'PY' | tee "$out/device.txt"
import torch, onnxruntime as ort
from optimizer.runtime.gpu import cuda_reason, ort_cuda_reason, tensorrt_reason, device_summary
print("device:", device_summary() or cuda_reason())
print("onnxruntime", ort.__version__, ort.get_available_providers())
print("ORT CUDA EP:", ort_cuda_reason() or "available"); print("TensorRT:", tensorrt_reason() or "available")
PY
timeout 300 $PY scripts/gpu_decisive.py "$out" --recipe-timeout 240 2>&1 | tee "$out/summary.txt"
timeout 100 $PY -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -15 | tee "$out/gpu-tests.txt"
timeout 80 $PY -m optimizer.cli.app compile recipes/gpt2-gpu.yaml --out "$out/gpt2-gpu" --no-history 2>&1 \
  | tail -40 | tee "$out/gpt2-gpu.txt"
echo "summary: $out/summary.json; reports: $out/*/report.md"
