"""The stage cache's integrity checks (engine.stage_cache) and stage 0's reference file (engine.reference_files),
on their own: no model is built or run, the files are written by the test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.core.stage import StageRecord
from optimizer.engine import rundir as rd
from optimizer.engine import stage_cache
from optimizer.engine.reference_files import load_reference, save_reference

METRICS = {"accuracy": {}, "within_budget": True, "budget": "cosine 1.0000 >= 0.99", "scenarios": {}}


def test_the_reference_file_round_trips_in_sample_order(tmp_path: Path) -> None:
    """Twelve samples: sample 10 must come back after sample 9, not after sample 1 (the keys sort as numbers)."""
    rng = np.random.default_rng(0)
    ref = {
        "b1": [[rng.standard_normal((1, 4)).astype(np.float32), np.full((1, 2), i, np.int64)] for i in range(12)],
        "b8": [[rng.standard_normal((8, 4)).astype(np.float32)]],
    }
    path = tmp_path / "reference.npz"
    save_reference(path, ref)
    back = load_reference(path)
    assert back is not None and sorted(back) == ["b1", "b8"]
    assert [int(outs[1][0, 0]) for outs in back["b1"]] == list(range(12))
    for scen, samples in ref.items():
        for outs, outs_back in zip(samples, back[scen], strict=True):
            assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(outs, outs_back, strict=True))
    assert not (tmp_path / ".reference.tmp.npz").exists()


def test_a_missing_or_truncated_reference_reads_as_none(tmp_path: Path) -> None:
    path = tmp_path / "reference.npz"
    assert load_reference(path) is None
    save_reference(path, {"b1": [[np.arange(1000, dtype=np.float32)]]})
    path.write_bytes(path.read_bytes()[:200])
    assert load_reference(path) is None


def test_metrics_are_reused_only_with_their_key_checksum_and_schema(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    assert stage_cache.reusable_metrics(path, "k1") == (None, None)  # none saved
    stage_cache.save_metrics(path, "k1", METRICS, 1.5)
    saved, why = stage_cache.reusable_metrics(path, "k1")
    assert why is None and saved is not None
    assert saved["metrics"] == METRICS and saved["bench_seconds"] == 1.5
    assert stage_cache.reusable_metrics(path, "k2") == (None, None)  # another measurement's key

    data = json.loads(path.read_text())
    data["bench_seconds"] = 0.1  # a number nobody measured
    path.write_text(json.dumps(data))
    assert stage_cache.reusable_metrics(path, "k1") == (None, "did not match its checksum")
    del data["digest"]
    path.write_text(json.dumps(data))
    assert stage_cache.reusable_metrics(path, "k1") == (None, "had no checksum (an older version's)")

    data["metrics"] = {**METRICS, "within_budget": "maybe"}
    data["digest"] = stage_cache.metrics_digest("k1", data)
    path.write_text(json.dumps(data))
    assert stage_cache.reusable_metrics(path, "k1") == (None, "does not fit the metrics schema")


def _stage_folder(folder: Path) -> Path:
    """A stage folder as the pipeline writes it: a model file, stage.json with a relative path and the checksums."""
    folder.mkdir()
    model = folder / "model.onnx"
    model.write_bytes(b"0123456789")
    artifact = Artifact("onnx", model)
    info = {"key": "k", "artifact": stage_cache.portable(artifact, folder), "notes": {"fused": 3},
            "pass_seconds": 2.5, **stage_cache.file_records(artifact)}
    rd.write_json(folder / rd.STAGE_FILE, info)
    return model


def test_a_stage_folder_is_intact_until_a_file_changes_in_place(tmp_path: Path) -> None:
    model = _stage_folder(tmp_path / "02-fuse")
    assert json.loads((tmp_path / "02-fuse" / rd.STAGE_FILE).read_text())["artifact"]["path"] == "model.onnx"
    assert stage_cache.intact(tmp_path / "02-fuse")
    model.write_bytes(b"0123456780")  # same size, other bytes
    assert not stage_cache.intact(tmp_path / "02-fuse")
    model.unlink()
    assert not stage_cache.intact(tmp_path / "02-fuse")


def test_a_renamed_stage_folder_restores_its_record(tmp_path: Path) -> None:
    _stage_folder(tmp_path / ".building-02-fuse")
    folder = (tmp_path / ".building-02-fuse").rename(tmp_path / "02-fuse")
    rec = StageRecord(2, "fuse", "fuse", "export")
    info = stage_cache.restore(rec, folder)
    assert rec.status == "cached" and rec.pass_seconds == 2.5 and info["key"] == "k"
    assert rec.artifact is not None and rec.artifact.path == folder / "model.onnx"
    assert stage_cache.intact(folder)
