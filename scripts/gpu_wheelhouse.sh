#!/usr/bin/env bash
# Fetch, here, the small pure or cp312 wheels the GPU machine lacks (it has torch, transformers, onnx, onnxruntime,
# numpy; perhaps typer, rich, psutil, pyyaml, nvidia-ml-py; no network), into .whl/ (ignored by git), so that
# scripts/gpu_check.sh can unpack them there (pip --no-index, or unzip where pip is missing) for the gpu-marked
# tests of its full run. Its checks (summary.json) need none of them. Run once before carrying .whl (64 MiB at
# most travel: scipy is the big one, about 35 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" -d .whl)
for pkg in "pydantic>=2.7" pydantic-core annotated-types typing-inspection "platformdirs>=4" onnx-graphsurgeon polygraphy \
  pytest pluggy iniconfig pyyaml scipy; do
  "${PIP[@]}" "$pkg"
done
# pydantic pins one pydantic-core: keep exactly that one.
need=$(unzip -p .whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
if [ -n "$need" ] && ! ls .whl/pydantic_core-"$need"-* >/dev/null 2>&1; then
  rm -f .whl/pydantic_core-*; "${PIP[@]}" "pydantic-core==$need"
fi
ls -la .whl; du -sh .whl
