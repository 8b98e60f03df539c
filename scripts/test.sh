#!/usr/bin/env bash
# Sets up (if needed) and runs the test suite: lint, then pytest. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check optimizer passes scripts tests
lint-imports  # the layers and no-circle contracts in .importlinter
python -m pytest -q "$@"
bash scripts/test_oldest_transformers.sh  # the generation tests on the oldest declared transformers
