"""Adversarial cases of issue 28 (sources); see tests/corpus/adversarial.py."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from .adversarial import Shared

KIND = "R3.6 models users really have"
WIDTH = 16


def _external_model(folder: Path, location: str = "m.onnx.data") -> Path:
    """x [batch, 16] -> MatMul -> Relu -> MatMul, named nodes, every weight in one external data file: the form of
    any model past 2 GB, made small."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), f"w{i}") for i in (1, 2)]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), helper.make_node("Relu", ["h"], ["r"], name="r"),
         helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])], weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (folder / location).parent.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=location,
                    size_threshold=0)
    return path


def _point_at(path: Path, location: str) -> None:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save(model, str(path))


def _recipe(r: Shared, model: Path, passes: list[dict[str, Any]]) -> dict[str, Any]:
    data = copy.deepcopy(r.base)
    data.update(model={"source": "onnx", "path": str(model)}, passes=passes,
                inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", WIDTH]}])
    return data


def _execute(data: dict[str, Any], out: Path) -> dict[str, Any]:
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import parse_recipe

    return {rec.name: rec for rec in Pipeline(parse_recipe(data, "adversarial.yaml", out.parent), out).execute()}


def _all_ran(records: dict[str, Any], *names: str) -> bool | str:
    bad = [f"{n}: {records[n].status} ({records[n].reason})" for n in names
           if records[n].status not in ("ran", "unchanged")]  # unchanged: fuse found nothing to fuse, and says so
    return True if not bad else "; ".join(bad)


def add_cases(r: Shared) -> None:
    r.work.mkdir(parents=True, exist_ok=True)
    _external_data_cases(r)


def _external_data_cases(r: Shared) -> None:
    work = r.work / "external"

    def every_stage(location: str) -> bool | str:
        folder = work / f"every-{location.replace('/', '-')}"
        model = _external_model(folder / "model", location)
        passes = [{"type": "ort_session"}, {"type": "fuse"}, {"type": "quantize", "config": {"mode": "int8_dynamic"}},
                  {"type": "quantize", "name": "kept", "from": "source", "config": {"mode": "hybrid"}}]
        data = _recipe(r, model, passes)
        data["accuracy"] = {"metric": "cosine", "min": 0.99999999, "samples": 2}  # hybrid keeps its input as it is
        return _all_ran(_execute(data, folder / "out"), "source", "ort_session", "fuse", "quantize", "kept")

    r.out.add(KIND, "m.onnx + m.onnx.data through every pass", lambda: every_stage("m.onnx.data"))
    r.out.add(KIND, "external data in a subfolder (weights/m.bin)", lambda: every_stage("weights/m.bin"))

    def replaced_weights(location: str) -> bool | str:
        folder = work / f"cache-{location}"
        model = _external_model(folder / "model", location)
        data, out = _recipe(r, model, [{"type": "ort_session"}]), folder / "out"
        _execute(data, out)
        weights = folder / "model" / location
        weights.write_bytes(bytes(reversed(weights.read_bytes())))  # same size, same graph file
        again = _execute(data, out)
        return _all_ran(again, "source", "ort_session")

    # optimum's name: the key once hashed only `*.data` beside the model (tests cover m.onnx.data too)
    r.out.add(KIND, "weights replaced in m.onnx_data: not served from cache", lambda: replaced_weights("m.onnx_data"))

    def refused(where: str) -> bool | str:
        folder = work / f"refused-{where}"
        model = _external_model(folder / "model")
        secret = folder / "secret.bin"
        secret.write_bytes((folder / "model" / "m.onnx.data").read_bytes())
        location = {"parent": "../secret.bin", "absolute": str(secret), "symlink": "link.bin"}[where]
        if where == "symlink":
            os.symlink(secret, folder / "model" / "link.bin")
        _point_at(model, location)
        source = _execute(_recipe(r, model, [{"type": "ort_session"}]), folder / "out")["source"]
        named = "'w1'" in (source.reason or "") and repr(location) in (source.reason or "")
        if source.status == "failed" and source.error_kind == "input" and named:
            return True
        return f"stage 0 {source.status}: {source.reason}"

    for where in ("parent", "absolute", "symlink"):
        r.out.add(KIND, f"external data location outside the model's folder ({where})", lambda w=where: refused(w))

    def compared() -> bool | str:
        from optimizer.engine.compare import compare_recipe, file_side

        folder = work / "compare"
        a, b = _external_model(folder / "a"), _external_model(folder / "b")
        recipe, _ = compare_recipe(file_side("A", str(a)), file_side("B", str(b)), bench=dict(r.base["benchmark"]),
                                   threads=1)
        first = _execute_recipe(recipe, folder / "out")
        weights = folder / "b" / "m.onnx.data"
        weights.write_bytes(bytes(reversed(weights.read_bytes())))
        recipe, _ = compare_recipe(file_side("A", str(a)), file_side("B", str(b)), bench=dict(r.base["benchmark"]),
                                   threads=1)
        again = _execute_recipe(recipe, folder / "out")
        return _all_ran(first, "source", "a", "b") is True and again["b"].status == "ran" or (
            f"first: {_all_ran(first, 'source', 'a', 'b')}; B after its weights changed: {again['b'].status}")

    r.out.add(KIND, "compare A B with external data; B's weights replaced", compared)

    def bundled() -> bool | str:
        from optimizer.deploy.export import export_bundle
        from optimizer.deploy.verify import verify_bundle
        from optimizer.engine.pipeline import Pipeline
        from optimizer.recipe.loading import parse_recipe
        from optimizer.report.build import write_report

        folder = work / "bundle"
        model = _external_model(folder / "model", "weights/m.bin")
        recipe = parse_recipe(_recipe(r, model, [{"type": "ort_session"}]), "adversarial.yaml", folder)
        report = write_report(recipe, Pipeline(recipe, folder / "out").execute(), folder / "out", 0.0)
        problems = [p for stage in ("source", "ort_session")
                    for p in verify_bundle(export_bundle(report, stage, "onnx", folder / f"bundle-{stage}"))]
        return True if not problems else "; ".join(problems)

    r.out.add(KIND, "export of an external-data source verifies", bundled)


def _execute_recipe(recipe: Any, out: Path) -> dict[str, Any]:
    from optimizer.engine.pipeline import Pipeline

    return {rec.name: rec for rec in Pipeline(recipe, out).execute()}
