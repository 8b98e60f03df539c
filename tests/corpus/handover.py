"""Adversarial cases of issue 28 (handover); see tests/corpus/adversarial.py.

R3.1: a run's numbers and its exported model part ways (a copied folder, a folder compiled again, a changed file):
held when export ships the files of the folder it is given, as the run recorded them, or refuses in one line.
R3.2: handed-over files trusted (report.json naming files outside the run, manifests asking for files outside the
bundle, no tolerance, unknown options, 100,000 threads, a reference without its inputs): held when export, verify
and bench refuse in one line and read nothing outside. R3.3 (export's part): a `.<out>.partial` of the user's is
kept. R3.6 (export's part): an input named `input/ids:0` gives a bundle that verifies and benches. R3.7: Ctrl-C
during export and a second export into one --out: held when nothing is left and the second is refused. R3.8
(export's part): Triton's config.pbtxt escapes tensor names.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optimizer.core.errors import OptimizerError

from .adversarial import Shared

RUN = "R3.1 run and exported model part ways"
HANDED = "R3.2 handed-over files trusted"
PATHS = "R3.3 paths not meant"
SOURCES = "R3.6 models users really have"
RACES = "R3.7 interruption and races"
NUMBERS = "R3.8 numbers other tools cannot read"


def _export(run: Path, out: Path, stage: str = "ort_session", fmt: str = "onnx") -> Path:
    from optimizer.deploy.export import export_bundle
    from optimizer.report.history import load_report

    return export_bundle(load_report(str(run)), stage, fmt, out)


def _refuses(fn: Callable[[], Any], words: str, leaves: Path | None = None) -> bool | str:
    """Held when fn raises our one-line error containing `words` and `leaves` (the --out) was not written."""
    try:
        fn()
    except OptimizerError as e:
        if words not in str(e) or "\n" in str(e):
            return f"refused, but said: {e}"
        return True if leaves is None or not leaves.exists() else f"{leaves} was written"
    return "accepted"


def _copy_run(r: Shared, name: str) -> Path:
    dest = r.work / name
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(r.run, dest)
    return dest


def _edit_report(run: Path, stage: str, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads((run / "report.json").read_text())
    change(next(s for s in data["stages"] if s["name"] == stage)["artifact"])
    (run / "report.json").write_text(json.dumps(data))


def run_cases(r: Shared) -> None:
    from optimizer.core.artifact import file_sha256

    def copied_exports_its_own() -> bool | str:
        run = _copy_run(r, "copied")
        model = run / "02-ort_session" / "model.onnx"
        original = r.run / "02-ort_session" / "model.onnx"
        saved = original.read_bytes()
        original.write_bytes(b"the original folder's file, changed")  # must not be what the copy exports
        try:
            out = _export(run, r.work / "copied-bundle")
        finally:
            original.write_bytes(saved)
        shipped = json.loads((out / "manifest.json").read_text())["files"]["model.onnx"]
        return True if shipped == file_sha256(model) else "exported another folder's model"

    def changed_file() -> bool | str:
        run = _copy_run(r, "changed")
        model = run / "02-ort_session" / "model.onnx"
        model.write_bytes(model.read_bytes() + b"\0")
        return _refuses(lambda: _export(run, r.work / "changed-bundle"), "sha256", r.work / "changed-bundle")

    def compiled_again() -> bool | str:
        run = _copy_run(r, "again")
        info = json.loads((run / "02-ort_session" / "stage.json").read_text())
        info["key"] = "0" * 16  # another compile's stage in this folder now
        (run / "02-ort_session" / "stage.json").write_text(json.dumps(info))
        return _refuses(lambda: _export(run, r.work / "again-bundle"), "compiled again", r.work / "again-bundle")

    def stage_json_gone() -> bool | str:
        run = _copy_run(r, "nostage")
        (run / "02-ort_session" / "stage.json").unlink()
        return _refuses(lambda: _export(run, r.work / "nostage-bundle"), "stage.json", r.work / "nostage-bundle")

    r.out.add(RUN, "copied run folder, original changed", copied_exports_its_own)
    r.out.add(RUN, "artifact changed after the run", changed_file)
    r.out.add(RUN, "folder compiled again since the report", compiled_again)
    r.out.add(RUN, "stage.json removed", stage_json_gone)


def run_bound_cases(r: Shared) -> None:
    secret = r.work / "secret.txt"
    secret.write_text("not the run's")

    def report_names(label: str, change: Callable[[dict[str, Any]], None], words: str) -> None:
        def go() -> bool | str:
            run = _copy_run(r, "named")
            _edit_report(run, "ort_session", change)
            out = r.work / "named-bundle"
            return _refuses(lambda: _export(run, out), words, out)

        r.out.add(HANDED, label, go)

    up = os.path.relpath(secret, r.work / "named" / "02-ort_session")
    report_names("report.json external_data ../", lambda a: a.update(external_data=[up]), "external_data")
    report_names("report.json external_data absolute", lambda a: a.update(external_data=[str(secret)]),
                 "external_data")
    report_names("report.json artifact path elsewhere", lambda a: a.update(path=str(secret)), "no stage folder")
    report_names("report.json decode ../", lambda a: a.update(decode=up), "decode")

    def symlinked() -> bool | str:
        run = _copy_run(r, "linked")
        model = run / "02-ort_session" / "model.onnx"
        model.unlink()
        model.symlink_to(secret)
        return _refuses(lambda: _export(run, r.work / "linked-bundle"), "outside the run folder",
                        r.work / "linked-bundle")

    r.out.add(HANDED, "artifact a symlink out of the run", symlinked)


def _tampered(r: Shared, change: Callable[[Path, dict[str, Any]], None]) -> Path:
    root = r.work / "tampered"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(r.bundle, root)
    manifest = json.loads((root / "manifest.json").read_text())
    change(root, manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def bundle_cases(r: Shared) -> None:
    from optimizer.deploy.bench import bench_bundle
    from optimizer.deploy.verify import verify_bundle

    (r.work / "outside.onnx").write_bytes((r.bundle / "model.onnx").read_bytes())

    def both_refuse(change: Callable[[Path, dict[str, Any]], None], words: str) -> Callable[[], bool | str]:
        def go() -> bool | str:
            root = _tampered(r, change)
            problems = verify_bundle(root)
            if len(problems) != 1 or words not in problems[0]:
                return f"verify: {problems}"
            return _refuses(lambda: bench_bundle(root, 1, 1), words)

        return go

    def drop_inputs(root: Path, m: dict[str, Any]) -> None:
        import numpy as np

        with np.load(root / "reference.npz") as ref:
            kept = {k: ref[k] for k in ref.files if "/in/" not in k}
        np.savez(root / "reference.npz", **kept)
        from optimizer.core.artifact import file_sha256

        m["files"]["reference.npz"] = file_sha256(root / "reference.npz")

    ort = "onnxruntime_session"
    cases: dict[str, tuple[Callable[[Path, dict[str, Any]], None], str]] = {
        "bench a model outside the bundle": (lambda root, m: m.update(model="../outside.onnx"), "outside"),
        "manifest without tolerance": (lambda root, m: m.pop("tolerance"), "tolerance"),
        "tolerance min_cosine a string": (lambda root, m: m["tolerance"].update(min_cosine="high"), "min_cosine"),
        "unknown graph optimization level": (
            lambda root, m: m["runtime"][ort].update(graph_optimization_level="turbo"), "graph_optimization_level"),
        "threads 100000": (lambda root, m: m["runtime"].update(threads=100_000), "threads"),
        "threads -1": (lambda root, m: m["runtime"].update(threads=-1), "threads"),
        "intra_op_threads 100000": (lambda root, m: m["runtime"][ort].update(intra_op_threads=100_000),
                                    "intra_op_threads"),
        "execution_mode unknown": (lambda root, m: m["runtime"][ort].update(execution_mode="warp"), "execution_mode"),
        "no runtime": (lambda root, m: m.pop("runtime"), "runtime"),
        "reference without its inputs": (drop_inputs, "reference.npz"),
        "bench a changed model": (lambda root, m: (root / "model.onnx").write_bytes(b"x"), "sha256"),
    }
    for label, (change, words) in cases.items():
        r.out.add(HANDED, label, both_refuse(change, words))


def partial_case(r: Shared) -> None:
    def kept() -> bool | str:
        mine = r.work / ".partial-case.partial"
        mine.mkdir(parents=True, exist_ok=True)
        (mine / "keep.txt").write_text("the user's")
        _export(r.run, r.work / "partial-case")
        return True if (mine / "keep.txt").is_file() else "deleted the user's .partial folder"

    r.out.add(PATHS, "export beside a .<out>.partial of the user's", kept)


def race_cases(r: Shared) -> None:
    from optimizer.deploy.staging import out_lock
    from optimizer.deploy.verify import verify_bundle

    def held_lock() -> bool | str:
        out = r.work / "locked"
        with out_lock(out):
            held = _refuses(lambda: _export(r.run, out), "another export")
        return held if held is not True or not out.exists() else f"{out} left behind"

    def ctrl_c() -> bool | str:
        box = r.work / "sigint"
        shutil.rmtree(box, ignore_errors=True)
        box.mkdir()
        out = box / "b"
        env = {k: v for k, v in os.environ.items() if k != "OPTIMIZER_DEBUG"}
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2] / "tests"), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "optimizer", "export", str(r.run), "--stage", "ort_session", "--out", str(out)]
        # a session of its own, default signal dispositions: SIGINT arrives as a terminal's Ctrl-C does
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True, restore_signals=True)
        deadline = time.monotonic() + 120
        while not any(p.name.startswith(".b.") for p in box.iterdir()) and proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                return "export never started writing"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        left = sorted(p.name for p in box.iterdir())
        if proc.returncode == 130 and not left:
            return True
        if proc.returncode == 0 and left == ["b"] and verify_bundle(out) == []:
            return True  # it had finished: a complete bundle
        return f"exit {proc.returncode}, left {left}: {err.strip()[-200:]}"

    r.out.add(RACES, "second export into a held --out", held_lock)
    r.out.add(RACES, "Ctrl-C during export", ctrl_c)


def name_cases(r: Shared) -> None:
    from optimizer.deploy.bench import bench_bundle
    from optimizer.deploy.triton import triton_config
    from optimizer.deploy.verify import verify_bundle
    from optimizer.report.history import load_report

    def slash_input(fmt: str) -> Callable[[], bool | str]:
        def go() -> bool | str:
            from optimizer.engine.pipeline import Pipeline
            from optimizer.recipe.loading import parse_recipe
            from optimizer.report.build import write_report

            folder = r.work / f"slash-{fmt}"
            folder.mkdir(parents=True, exist_ok=True)
            _slash_model(folder / "slash.onnx")
            data = copy.deepcopy(r.base)
            data.update(model={"source": "onnx", "path": "slash.onnx"}, passes=[{"type": "ort_session"}],
                        inputs=[{"name": "input/ids:0", "dtype": "float32", "shape": ["batch", 16]}])
            recipe = parse_recipe(data, "slash.yaml", folder)
            write_report(recipe, Pipeline(recipe, folder / "run").execute(), folder / "run", 0.0)
            out = _export(folder / "run", folder / "bundle", fmt=fmt)
            problems = verify_bundle(out)
            if problems:
                return f"verify: {problems}"
            return True if bench_bundle(out, 1, 1) else "bench timed nothing"

        return go

    def escaped() -> bool | str:
        from google.protobuf import text_encoding

        odd = 'in"put\\'
        tensor = {"name": odd, "dtype": "float32", "onnx_type": "FLOAT", "shape": ["batch", 16]}
        text = triton_config("m", [tensor], [{**tensor, "name": "o"}], load_report(str(r.run)), {})
        line = next(x for x in text.splitlines() if "in\\" in x)
        got = text_encoding.CUnescape(line.split("name: ", 1)[1][1:-1]).decode()
        return True if got == odd else f"config.pbtxt reads back {got!r}"

    r.out.add(SOURCES, "input named input/ids:0, onnx bundle", slash_input("onnx"))
    r.out.add(SOURCES, "input named input/ids:0, triton bundle", slash_input("triton"))
    r.out.add(NUMBERS, "Triton tensor name with a quote and a backslash", escaped)


def one_matmul_model(path: Path, input_name: str, output_name: str = "y") -> None:
    """A one-MatMul graph x [batch, 16] -> [batch, 4] with these tensor names, whatever they hold."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [16, 4], np.random.default_rng(0).random(64).tolist())
    graph = helper.make_graph(
        [helper.make_node("MatMul", [input_name, "w"], [output_name])], "g",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["batch", 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def _slash_model(path: Path) -> None:
    """Input and output names holding '/' and ':' (as TensorFlow's converters name them)."""
    one_matmul_model(path, "input/ids:0", "out/logits:0")


def add_cases(r: Shared) -> None:
    r.work.mkdir(parents=True, exist_ok=True)
    run_cases(r)
    run_bound_cases(r)
    bundle_cases(r)
    partial_case(r)
    race_cases(r)
    name_cases(r)
