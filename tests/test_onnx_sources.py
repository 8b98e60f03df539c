"""ONNX sources as users have them (issue 28, class 6): weights in an external data file beside the graph
(`m.onnx` + `m.onnx.data`, the normal form past 2 GB) work in every stage and in `optimizer compare`; the bytes
of those files are part of the cache key; a location outside the model's folder is refused in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FAST_BENCH, mlp_recipe, write_recipe
from onnx import TensorProto, helper, numpy_helper
from test_recipe import run_cli

from optimizer.cli.app import main
from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import parse_recipe

BENCH = ",".join(f"{k}={v}" for k, v in FAST_BENCH.items())
WIDTH = 32


def external_model(folder: Path, name: str = "m.onnx", location: str | None = None, seed: int = 0) -> Path:
    """x [batch, 32] -> MatMul -> Relu -> MatMul, every weight in one external data file (`<name>.data`)."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / 4, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / 4, "w2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
         helper.make_node("Relu", ["h"], ["r"], name="relu"),
         helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        [w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    if location and "/" in location:
        (folder / location).parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location or f"{name}.data", size_threshold=0)
    return path


def set_location(path: Path, location: str) -> None:
    """Point every external tensor of the graph at `location` (the file itself is not touched)."""
    from corpus.sources import _point_at

    _point_at(path, location)


def onnx_source(path: Path, passes: list[dict]) -> dict:
    return mlp_recipe(
        model={"source": "onnx", "path": str(path)},
        inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", WIDTH]}],
        passes=passes,
    )


def execute(data: dict, out: Path) -> dict[str, object]:
    records = Pipeline(parse_recipe(data, "<test>", out.parent), out).execute()
    return {r.name: r for r in records}


EVERY_PASS = [{"type": "export"}, {"type": "ort_session"}, {"type": "fuse"},
              {"type": "quantize", "config": {"mode": "int8_dynamic"}}]


@pytest.mark.slow
@pytest.mark.parametrize("location", [None, "weights/m.bin"], ids=["beside", "subfolder"])
def test_external_data_source_through_every_pass(tmp_path: Path, location: str | None) -> None:
    model = external_model(tmp_path / "model", location=location)
    records = execute(onnx_source(model, EVERY_PASS), tmp_path / "out")
    assert records["export"].status == "skipped"
    for name in ("source", "ort_session", "fuse", "quantize"):
        rec = records[name]
        assert rec.status in ("ran", "unchanged"), (name, rec.reason)
    assert records["source"].artifact.external_data == [location or "m.onnx.data"]
    ort = records["ort_session"]
    assert ort.metrics["accuracy"]["y"]["max_abs"] < 1e-4
    for f in ort.artifact.files():  # the stage folder holds a complete model: graph and weights
        assert f.is_file() and (tmp_path / "out") in f.parents, f
    assert records["quantize"].metrics["accuracy"]["y"]["cosine"] > 0.99


@pytest.mark.slow
def test_every_quantize_mode_reads_the_sources_external_data(tmp_path: Path) -> None:
    """Each straight from stage 0: the source's graph is never copied without the weights it names (hybrid with
    nothing within budget keeps the input as it is)."""
    model = external_model(tmp_path / "model", location="weights/m.bin")
    modes = ["int8_static", "fp16", "weight_only", "hybrid"]
    passes = [{"type": "quantize", "name": m, "from": "source", "config": {"mode": m}} for m in modes]
    data = onnx_source(model, passes)
    data["accuracy"] = {"metric": "cosine", "min": 0.99999999, "samples": 2}  # hybrid: no INT8 set within budget
    records = execute(data, tmp_path / "out")
    for m in modes:
        assert records[m].status == "ran", (m, records[m].reason)
        path = records[m].artifact.path
        assert path.parent.name.endswith(m) and (tmp_path / "out") in path.parents
    assert records["hybrid"].notes["int8_nodes"] == []
    assert not list((tmp_path / "out").rglob("m.bin")), "the source's weights copied along were left behind"


@pytest.mark.slow
@pytest.mark.parametrize("location", ["m.onnx.data", "m.onnx_data"])  # torch's name, optimum's name
def test_external_data_bytes_are_in_the_cache_key(tmp_path: Path, location: str) -> None:
    model = external_model(tmp_path / "model", location=location)
    data = onnx_source(model, [{"type": "ort_session"}])
    first = execute(data, tmp_path / "out")
    assert [r.status for r in first.values()] == ["ran", "ran"]
    again = execute(data, tmp_path / "out")
    assert [r.status for r in again.values()] == ["cached", "cached"]
    weights = tmp_path / "model" / location
    size = weights.stat().st_size
    weights.write_bytes(bytes(reversed(weights.read_bytes())))  # other weights, same size, same graph file
    assert weights.stat().st_size == size
    changed = execute(data, tmp_path / "out")
    assert [r.status for r in changed.values()] == ["ran", "ran"], [(r.name, r.status) for r in changed.values()]
    assert changed["source"].key != first["source"].key and changed["ort_session"].key != first["ort_session"].key


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink", "missing"])
def test_external_data_outside_the_models_folder_is_refused(tmp_path: Path, where: str) -> None:
    model = external_model(tmp_path / "model")
    secret = tmp_path / "secret.bin"
    secret.write_bytes((tmp_path / "model" / "m.onnx.data").read_bytes())
    location = {"parent": "../secret.bin", "absolute": str(secret), "symlink": "link.bin", "missing": "gone.bin"}[where]
    if where == "symlink":
        os.symlink(secret, tmp_path / "model" / "link.bin")
    set_location(model, location)
    records = execute(onnx_source(model, [{"type": "ort_session"}]), tmp_path / "out")
    source = records["source"]
    assert source.status == "failed" and records["ort_session"].status == "not run"
    assert "\n" not in source.reason and str(model) in source.reason, source.reason
    assert "'w1'" in source.reason and repr(location) in source.reason, source.reason
    assert "Traceback" not in source.reason and "ValidationError" not in source.reason, source.reason
    assert source.error_kind == "input"  # a usage error: compile and compare exit 2


@pytest.mark.slow
def test_compile_and_compare_refuse_data_outside_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = external_model(tmp_path / "good")
    bad = external_model(tmp_path / "bad")
    (tmp_path / "secret.bin").write_bytes((tmp_path / "bad" / "m.onnx.data").read_bytes())
    set_location(bad, "../secret.bin")
    recipe = write_recipe(tmp_path, onnx_source(bad, [{"type": "ort_session"}]))
    proc = run_cli("compile", str(recipe), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "'../secret.bin'" in proc.stderr and "outside the model's folder" in proc.stderr, proc.stderr
    for a, b in ((bad, good), (good, bad)):
        code, _, err = run_compare(capsys, str(a), str(b), "--out", str(tmp_path / "cmp"), "--bench", BENCH)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "'../secret.bin'" in err and "outside the model's folder" in err, err


def run_compare(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(["compare", *args])
    out = capsys.readouterr()
    return int(exited.value.code or 0), out.out, out.err


@pytest.mark.slow
def test_compare_models_with_external_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = external_model(tmp_path / "a", seed=0)
    b = external_model(tmp_path / "b", seed=0)
    out = tmp_path / "cmp"
    args = (str(a), str(b), "--out", str(out), "--bench", BENCH, "--threads", "1", "--format", "json")
    code, stdout, err = run_compare(capsys, *args)  # default level: A gets an ort_session stage first
    assert code == 0, err
    s = json.loads(stdout)
    assert s["accuracy"]["y"]["max_abs"] < 1e-5, s["accuracy"]
    # B's weights replaced in place (same size): B is built and measured again, not served from the cache.
    other = external_model(tmp_path / "other", seed=1).with_suffix(".onnx.data")  # same shapes, other weights
    (tmp_path / "b" / "m.onnx.data").write_bytes(other.read_bytes())
    code, stdout, err = run_compare(capsys, *args)
    assert code == 0, err
    stages = {st["name"]: st for st in json.loads((out / "report.json").read_text())["stages"]}
    assert stages["a"]["status"] == "cached" and stages["b"]["status"] == "ran", stages["b"]["status"]
    assert json.loads(stdout)["accuracy"]["y"]["max_abs"] > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("location", [None, "weights/m.bin"], ids=["beside", "subfolder"])
def test_bundles_of_an_external_data_source_carry_the_weights(tmp_path: Path, location: str | None) -> None:
    from optimizer.deploy.export import export_bundle
    from optimizer.deploy.verify import verify_bundle
    from optimizer.report.build import write_report

    model = external_model(tmp_path / "model", location=location)
    data = onnx_source(model, [{"type": "ort_session"}])
    recipe = parse_recipe(data, "<test>", tmp_path)
    report = write_report(recipe, Pipeline(recipe, tmp_path / "out").execute(), tmp_path / "out", 0.0)
    for stage in ("source", "ort_session"):
        bundle = export_bundle(report, stage, "onnx", tmp_path / f"bundle-{stage}")
        assert (bundle / (location or "m.onnx.data")).is_file(), sorted(p.name for p in bundle.rglob("*"))
        assert verify_bundle(bundle) == [], stage
