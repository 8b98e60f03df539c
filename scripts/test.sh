#!/usr/bin/env bash
# Sets up (if needed) and runs the test suite: lint, then pytest. CI runs exactly this, with no arguments.
#   bash scripts/test.sh           everything: lint, the whole suite, the generation tests on the oldest transformers
#   bash scripts/test.sh --fast    lint and the tests not marked slow
# Last measured (2 vCPUs, AMD EPYC Zen 3; the figures and how to remeasure them: docs/status.md): everything 1412 s
# wall (785 passed, 7 skipped, commit 1564784), --fast 48 s wall with setup (commit 1564784). Every pytest run ends
# with its 15 slowest tests (--durations=15), so growth shows in CI's output. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then fast=1; else args+=("$a"); fi
done
bash scripts/setup.sh
. .venv/bin/activate
ruff check optimizer passes scripts benchmarks tests
lint-imports  # the layers and no-circle contracts in .importlinter
mypy  # the packages [tool.mypy] in pyproject.toml names (optimizer/core, engine, recipe)
if [ "$fast" = 1 ]; then
  python -m pytest -q --durations=15 -m "not slow" ${args[@]+"${args[@]}"}
else
  python -m pytest -q --durations=15 ${args[@]+"${args[@]}"}
  bash scripts/test_oldest_transformers.sh  # the generation tests on the oldest declared transformers
fi
