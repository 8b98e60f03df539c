"""The thread count every runner uses, so stages differ only by what the passes did."""

from __future__ import annotations

import os
from typing import Any


def target_threads(recipe: Any) -> int:
    threads = recipe.target.threads
    if threads:
        return int(threads)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
