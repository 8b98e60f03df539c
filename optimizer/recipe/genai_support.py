"""What the installed ONNX Runtime GenAI model builder can build: read from its own source, so the recipes we
generate and the genai_build pass's declines follow the version that is installed, not a list kept by hand."""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path

_DISPATCH = re.compile(r'config\.architectures\[0\] == "(\w+)"')


@lru_cache(maxsize=1)
def builder_architectures() -> frozenset[str]:
    """The transformers architectures the installed builder dispatches on (empty when it is not installed)."""
    spec = importlib.util.find_spec("onnxruntime_genai")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    source = Path(next(iter(spec.submodule_search_locations))) / "models" / "builder.py"
    return frozenset(_DISPATCH.findall(source.read_text())) if source.is_file() else frozenset()
