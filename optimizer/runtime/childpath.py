"""The import path a child Python process gets (the memory probe, `ctx.map`'s workers).

A child imports with this process's sys.path so that what this process can import (a factory model's module on a
path a test or notebook added, or in the folder optimizer/recipe/factory.py found it in) the child can too. But
`import onnxruntime.quantization` (or .transformers) appends onnxruntime's transformers folder, which holds an
`optimizer.py`: a child that has not yet imported our `optimizer` package would import that module instead
("'optimizer' is not a package"). So our root goes first and that folder is left out (onnxruntime adds it back
itself in a child that imports it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds optimizer/ and passes/


def _shadows_us(entry: str) -> bool:
    """A folder whose optimizer.py would be imported as our package (onnxruntime/transformers, for one)."""
    return os.path.realpath(entry) != os.path.realpath(ROOT) and os.path.isfile(os.path.join(entry, "optimizer.py"))


def child_sys_path(paths: list[str] | None = None) -> list[str]:
    """sys.path for a child: our root first, the working directory for "", no folder that shadows `optimizer`."""
    out = [ROOT]
    for p in sys.path if paths is None else paths:
        entry = p or os.getcwd()
        if entry not in out and not _shadows_us(entry):
            out.append(entry)
    return out


def child_env(paths: list[str] | None = None) -> dict[str, str]:
    """os.environ with PYTHONPATH set to child_sys_path() (for subprocess.run)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(child_sys_path(paths))}
