#!/usr/bin/env bash
# Fetch, here, the small pure or cp312 wheels the GPU machine lacks (it has PyTorch 2.11 for CUDA 13, transformers,
# onnx, a CPU-only onnxruntime 1.30, numpy, scipy, pytest, pyyaml; no network), into .whl/ (ignored by git), so that
# scripts/gpu_check.sh can unpack them there (pip --no-index, or unzip where pip is missing) for the gpu-marked
# tests of its full run. Its checks (summary.json) need none of them. Run once before carrying .whl (a few MiB:
# pydantic-core is the big one).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" -d .whl)
# Only what the GPU machine lacks (docs/gpu.md: it has torch 2.11, transformers, onnx, a CPU-only onnxruntime 1.30,
# numpy, scipy, pytest, pluggy, pyyaml, psutil): a copy of a package it has would shadow the image's own, and
# gpu_check.sh unpacks only the wheels whose package is missing there anyway. No polygraphy or onnx-graphsurgeon:
# without TensorRT (> 1 GB, which cannot be carried there) their tests skip regardless.
for pkg in "pydantic>=2.7" pydantic-core annotated-types typing-inspection "platformdirs>=4"; do
  "${PIP[@]}" "$pkg"
done
# pydantic pins one pydantic-core: keep exactly that one.
need=$(unzip -p .whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
if [ -n "$need" ] && ! ls .whl/pydantic_core-"$need"-* >/dev/null 2>&1; then
  rm -f .whl/pydantic_core-*; "${PIP[@]}" "pydantic-core==$need"
fi
ls -la .whl; du -sh .whl
