#!/usr/bin/env bash
# A virtual environment of its own (.venv-optimum) for scripts/compare_optimum.py: optimum-onnx pins transformers
# below 4.58, while the project's .venv has transformers 5. The CPU build of torch is pinned (an unpinned torch
# pulls a multi-GB CUDA build); our package is not installed there: the script puts the repository on sys.path
# and needs only its light dependencies (numpy, onnxruntime, pydantic, pyyaml, scipy). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-optimum/bin/python ] || "$PY" -m venv .venv-optimum
. .venv-optimum/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q "optimum-onnx[onnxruntime]" optimum "transformers<4.58" onnxruntime pydantic pyyaml scipy
python -c "import torch, transformers, optimum.onnxruntime, onnxruntime; print('optimum venv ok: torch', \
torch.__version__, '| transformers', transformers.__version__, '| onnxruntime', onnxruntime.__version__)"
