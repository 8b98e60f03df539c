"""Strict JSON: the one way this tool writes JSON that others read (report.json, metrics.json, manifest.json...).

Python's json writes inf and NaN as `Infinity` and `NaN`, which are not JSON: parsers in other languages (and
`jq`) reject the whole file. Non-finite floats are written as null instead, and the dump runs with
allow_nan=False, so a value that slips past the conversion fails loudly where it is written, not in a reader.
What a null means for a field (e.g. an interval too few calls could bound) is said in the report's JSON Schema.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float (Python's or numpy's) replaced by None; numpy scalars and arrays
    become Python numbers and lists, tuples become lists (as JSON has them)."""
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):  # without importing numpy here
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def strict_json_dumps(data: Any, **kwargs: Any) -> str:
    """json.dumps of `finite(data)` that refuses NaN/inf; other objects (paths) are written as their str."""
    return json.dumps(finite(data), allow_nan=False, default=str, **kwargs)
