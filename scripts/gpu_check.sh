#!/usr/bin/env bash
# One prepared command for a GPU machine: the GPU-marked tests, then the GPU recipes end to end, reports into
# the folder given (default: gpu-check/). Runs what the machine has and skips the rest with reasons (no
# TensorRT or onnxruntime-gpu: those stages are skipped and say so). Bounded at 9 minutes
# (the device tool's per-command limit is 10): tests 150 s, then 150 + 120 + 120 s for the recipes.
#   bash scripts/gpu_check.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OPTIMIZER_HISTORY="$out/history.sqlite"
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
# The machine's own torch (CUDA build) must be used: install only what is missing, never torch.
$PY -m pip install -q --no-deps -e . >/dev/null 2>&1 || echo "note: could not pip install -e . (using PYTHONPATH)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY - <<'PY' | tee "$out/device.txt"
import torch, onnxruntime as ort
from optimizer.gpu import cuda_reason, ort_cuda_reason, tensorrt_reason, device_summary
print("device:", device_summary() or cuda_reason())
print("onnxruntime", ort.__version__, ort.get_available_providers())
print("ORT CUDA EP:", ort_cuda_reason() or "available"); print("TensorRT:", tensorrt_reason() or "available")
PY
timeout 150 $PY -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu-tests.txt"
for spec in gpt2-gen-gpu:150 gpt2-gpu:120 minilm-gpu:120; do
  r=${spec%%:*}
  timeout "${spec##*:}" $PY -m optimizer.cli compile "recipes/$r.yaml" --out "$out/$r" --no-history 2>&1 | tee "$out/$r.txt"
done
echo "reports: $out/*/report.md"
