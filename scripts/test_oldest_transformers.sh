#!/usr/bin/env bash
# The generation tests again, against the oldest transformers pyproject.toml declares (the model's forward took
# its KV cache as `past_key_values` there, `cache` from 5.24: runtime.generation.cache_keyword reads which).
# That version goes into its own folder (.transformers-oldest/, put first on PYTHONPATH), with the hub client it
# needs; everything else comes from .venv. scripts/test.sh runs this after the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# The floor as pyproject declares it ("transformers>=X"), read without tomllib so this runs on Python 3.10 too.
oldest=$(python -c "import re;print(re.search(r'\"transformers>=([0-9.]+)', open('pyproject.toml').read()).group(1))")
target=.transformers-oldest
if [ "$(PYTHONPATH=$target python -c 'import transformers;print(transformers.__version__)' 2>/dev/null)" != "$oldest" ]; then
  rm -rf "$target"
  pip install -q --no-deps --target "$target" "transformers==$oldest" "huggingface-hub>=1.5,<2" httpx httpcore
fi
PYTHONPATH=$target python -c "import transformers; print('transformers', transformers.__version__, '(the oldest declared)')"
PYTHONPATH=$target python -m pytest -q -p no:cacheprovider tests/test_generation.py \
  -k "torch_and_onnx_loops or static_cache_loop or cache_keyword" "$@"
