"""The stage cache's integrity: what an earlier run left in a stage folder is reused only while it still matches
what was recorded when it was written. A stage's files must have the sizes and sha256 its stage.json recorded, a
metrics.json must match its checksum and the metrics schema, and the files a recipe reads by path are hashed into
stage 0's key, so a file edited or replaced in place is rebuilt or measured again, never trusted. Artifact paths
are stored relative to their stage folder, so a renamed folder still resolves."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from optimizer.core.artifact import Artifact, file_sha256
from optimizer.core.metrics import StageMetrics, TimedWindow
from optimizer.core.stage import StageRecord, split_legacy_notes
from optimizer.engine import rundir as rd
from optimizer.recipe.schema import OnnxSource, Recipe


def input_files_digest(recipe: Recipe) -> list[str]:
    """sha256 of the files the recipe reads by path (an ONNX source and every external data file its graph
    references, the data file), as `name:digest` lines for stage 0's key: a file replaced in place under the same
    name must not be served from the cache. Files that are not there are left out."""
    named: list[tuple[str, Path]] = []
    if isinstance(recipe.model, OnnxSource):
        from optimizer.runtime import onnx_io

        model = recipe.resolve(recipe.model.path)
        named.append((model.name, model))
        if model.is_file():  # the files its graph references, by location (bounds checked before reading);
            # labelled apart from the old `*.data` glob's entries, so no stage 0 cached without them is reused
            named += [(f"external data {f}", model.parent / f) for f in onnx_io.external_data_files(model)]
    if recipe.data_file:
        data = recipe.resolve(recipe.data_file)
        named.append((data.name, data))
    return [f"{name}:{file_sha256(p)}" for name, p in named if p.is_file()]


def portable(artifact: Artifact, folder: Path) -> dict[str, Any]:
    """Artifact JSON with a path relative to its stage folder (`../02-export/model.onnx` for a stage that refers
    to an earlier stage's files), so a renamed or moved run folder still resolves."""
    d = artifact.to_json()
    if artifact.path is not None and artifact.path.parent == folder:
        d["path"] = artifact.path.name
    elif artifact.path is not None and artifact.path.resolve().is_relative_to(folder.resolve().parent):
        d["path"] = os.path.relpath(artifact.path.resolve(), folder.resolve())
    return d


def relocate(artifact: Artifact, folder: Path) -> Artifact:
    """The artifact read from a stage.json with its relative path (see `portable`) resolved under `folder`."""
    if artifact.path is not None and not artifact.path.is_absolute():
        return artifact.derive(path=Path(os.path.normpath(folder / artifact.path)))
    return artifact


def file_records(artifact: Artifact) -> dict[str, dict[str, Any]]:
    """stage.json's `file_sizes` and `file_sha256` of an artifact's files, as `intact` checks them on reuse."""
    return {
        "file_sizes": {f.name: f.stat().st_size for f in artifact.files() if f.is_file()},
        "file_sha256": {f.name: file_sha256(f) for f in artifact.files() if f.is_file()},
    }


def intact(folder: Path) -> bool:
    """A cached stage folder's artifact files are all there with the sizes and sha256 its stage.json recorded.
    Raises KeyError when its stage.json records no artifact."""
    info = rd.read_json(folder / rd.STAGE_FILE) or {}
    return not rd.changed_files(relocate(Artifact.from_json(info["artifact"]), folder).files(), info)


def restore(rec: StageRecord, folder: Path) -> dict[str, Any]:
    """Fill `rec` from a reused stage folder's stage.json: its artifact, notes, the pass's timed windows and time,
    the cache note it was built with (unless `rec` has one already); status "cached". Returns that stage.json."""
    info = rd.read_json(folder / rd.STAGE_FILE) or {}
    rec.artifact = relocate(Artifact.from_json(info["artifact"]), folder)
    # stage.json of a stage built before the pipeline's keys left the notes: they move to their fields
    rec.notes, legacy = split_legacy_notes(info.get("notes", {}))
    windows = info.get("pass_timed_windows") or legacy.get("pass_timed_windows")
    rec.pass_timed_windows = [TimedWindow.model_validate(w) for w in windows] if windows else None
    rec.cache_note = rec.cache_note or info.get("cache_note") or legacy.get("cache_note")
    rec.pass_seconds, rec.status = info.get("pass_seconds"), "cached"
    return info


def metrics_digest(key: str, saved: dict[str, Any]) -> str:
    """A checksum of a metrics.json's numbers: an edited file is measured again, not trusted."""
    return rd.content_hash(key, saved.get("metrics"), saved.get("bench_seconds"))


def _valid_metrics(metrics: Any) -> bool:
    try:
        StageMetrics.model_validate(metrics)
    except ValidationError:
        return False
    return True


def reusable_metrics(path: Path, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """The metrics.json at `path` when it was measured under `key` and is intact: (its contents, None). When its key
    matches but its checksum or the metrics schema does not hold: (None, why, to follow "metrics.json ").
    Otherwise (missing, unreadable, another key): (None, None)."""
    cached = rd.read_json(path)
    if not cached or cached.get("key") != key:
        return None, None
    if cached.get("digest") != metrics_digest(key, cached):
        return None, "did not match its checksum" if "digest" in cached else "had no checksum (an older version's)"
    if not _valid_metrics(cached.get("metrics")):
        return None, "does not fit the metrics schema"
    return cached, None


def save_metrics(path: Path, key: str, metrics: dict[str, Any], bench_seconds: float | None) -> None:
    """Write metrics.json: the stage's metrics and benchmark time under its measurement key, with their checksum."""
    saved = {"key": key, "metrics": metrics, "bench_seconds": bench_seconds}
    rd.write_json(path, {**saved, "digest": metrics_digest(key, saved)})
