#!/usr/bin/env bash
# Builds llama-cpp-python (llama.cpp and its Python binding) into .venv from its source distribution, for
# scripts/compare_llamacpp.py: the engine CPU users run LLMs with, as the yardstick. Not part of scripts/setup.sh:
# it compiles llama.cpp (GGML_NATIVE: for this machine's CPU), which takes minutes on 2 cores. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
if python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
  echo "llama-cpp-python $VERSION already built"; exit 0
fi
start=$(date +%s)
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python -m pip install -q --no-binary llama-cpp-python "llama-cpp-python==$VERSION" "gguf>=0.17"
echo "llama-cpp-python $VERSION built in $(( $(date +%s) - start )) s"
