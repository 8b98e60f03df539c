"""Stage 0's reference outputs on disk (`reference.npz`) and the fingerprint of the feeds they were computed on.
Every later stage's accuracy is measured against these outputs, so the file is written atomically and a damaged one
reads as missing (stage 0 is then measured again), never as partial outputs."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from optimizer.engine import rundir as rd

if TYPE_CHECKING:
    from optimizer.measure.forward import Reference
    from optimizer.runtime.inputs import FeedSet


def feeds_hash(feeds: FeedSet) -> str:
    """A content hash of the recipe's feeds (names, dtypes, shapes and a prefix and sum of each array's bytes): part
    of every stage's cache key, so changed inputs are never served measurements taken on other ones."""
    arrays = [
        (s, i, n, a.dtype.str, a.shape, a.tobytes().hex()[:4096], int(a.sum()) if a.size else 0)
        for s, sf in feeds.by_scenario.items()
        for i, f in enumerate(sf.samples)
        for n, a in f.items()
    ]
    return rd.content_hash(arrays)


def save_reference(path: Path, ref: Reference) -> None:
    """Write stage 0's outputs (scenario -> sample -> outputs) to `path` as an npz keyed `scenario|sample|output`,
    through a temp name opened fresh (never through a link planted there) and renamed into place."""
    arrays: dict[str, Any] = {  # Any: numpy's savez stub would match a value to allow_pickle
        f"{s}|{i}|{j}": o for s, samples in ref.items() for i, outs in enumerate(samples) for j, o in enumerate(outs)
    }
    tmp = path.with_name(".reference.tmp.npz")
    with rd.open_new(tmp) as f:  # never through a link planted at the temp name
        np.savez(f, **arrays)
    tmp.replace(path)


def load_reference(path: Path) -> Reference | None:
    """Stage 0's outputs, or None when the file is missing or cannot be read whole (truncated, not an npz):
    then stage 0 is measured again and writes it anew."""
    if not path.is_file():
        return None
    ref: Reference = {}
    try:
        with np.load(path) as data:
            keys = sorted(data.files, key=lambda k: (k.split("|")[0], int(k.split("|")[1]), int(k.split("|")[2])))
            for key in keys:
                s, i, _ = key.split("|")
                samples = ref.setdefault(s, [])
                if int(i) == len(samples):
                    samples.append([])
                samples[int(i)].append(data[key])
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
        return None
    return ref or None
