#!/usr/bin/env bash
# Sets up (if needed) and runs the test suite: lint, then pytest. CI runs exactly this, with no arguments.
#   bash scripts/test.sh           everything: lint, the whole suite, the generation tests on the oldest transformers
#   bash scripts/test.sh --fast    lint and the tests not marked slow (about 2 minutes on 2 cores, the whole suite 45)
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then fast=1; else args+=("$a"); fi
done
bash scripts/setup.sh
. .venv/bin/activate
ruff check optimizer passes scripts tests
lint-imports  # the layers and no-circle contracts in .importlinter
if [ "$fast" = 1 ]; then
  python -m pytest -q -m "not slow" ${args[@]+"${args[@]}"}
else
  python -m pytest -q ${args[@]+"${args[@]}"}
  bash scripts/test_oldest_transformers.sh  # the generation tests on the oldest declared transformers
fi
