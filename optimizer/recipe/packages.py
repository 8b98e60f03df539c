"""Where an installed package's files are, found without running its code (recipes name model folders inside
packages). Apart from loading.py so that the runtime's model loader can use it without importing the loader."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dir(name: str) -> Path | None:
    """The folder of an installed package, found without running its code: only the top-level name is looked up
    (finding `a.b` would import `a`), and the rest is followed on disk."""
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    for base in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(base).joinpath(*rest)
        if folder.is_dir():
            return folder
    return None
