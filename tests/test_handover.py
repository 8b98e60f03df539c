"""Issue 28, classes 1, 2, 7 (and export's staging folder, input names with '/', Triton's escaping): a run folder or
a bundle handed over is read from where it lies, checked once, and never followed outside; an export interrupted
or raced leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TESTS, mlp_recipe

from optimizer.core.artifact import file_sha256
from optimizer.core.errors import OptimizerError
from optimizer.deploy.bench import bench_bundle
from optimizer.deploy.export import export_bundle
from optimizer.deploy.triton import triton_config
from optimizer.deploy.verify import verify_bundle
from optimizer.report.history import load_report

ROOT = TESTS.parent


def _compile(data: dict[str, Any], folder: Path) -> Path:
    _compile_recorded(data, folder)
    return folder


def _compile_recorded(data: dict[str, Any], folder: Path) -> int:
    """Compile as `optimizer compile` does (report, history row); returns the run id."""
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import parse_recipe
    from optimizer.report.build import write_report
    from optimizer.report.history import record

    recipe = parse_recipe(data, "recipe.yaml", folder.parent)
    return record(write_report(recipe, Pipeline(recipe, folder).execute(), folder, 0.0))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _compile(mlp_recipe(), tmp_path_factory.mktemp("handover") / "run")


@pytest.fixture
def run(compiled: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(compiled, copy)
    return copy


def _cli(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    env.pop("OPTIMIZER_DEBUG", None)  # the user's view: one line and an exit code
    return subprocess.run([sys.executable, "-m", "optimizer", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300, **kw)


def _report(run: Path) -> dict[str, Any]:
    return json.loads((run / "report.json").read_text())


# ----------------------------------------------------------------- 1: the run's numbers and its exported model


def test_copied_run_folder_exports_its_own_model(run: Path, tmp_path: Path) -> None:
    """report.json names the original folder's files by absolute path; the copy's own files are exported."""
    original = Path(_report(run)["run_dir"])
    assert original != run and (original / "02-ort_session" / "model.onnx").is_file()
    out = export_bundle(load_report(str(run)), "ort_session", "onnx", tmp_path / "b")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["files"]["model.onnx"] == file_sha256(run / "02-ort_session" / "model.onnx")
    assert verify_bundle(out) == []


def test_copied_run_folder_never_reads_the_original(run: Path, tmp_path: Path) -> None:
    """The original folder's model changed after the copy: the copy still exports its own."""
    original = Path(_report(run)["run_dir"])
    backup = tmp_path / "backup.onnx"
    shutil.copyfile(original / "02-ort_session" / "model.onnx", backup)
    try:
        (original / "02-ort_session" / "model.onnx").write_bytes(b"not this one")
        out = export_bundle(load_report(str(run)), "ort_session", "onnx", tmp_path / "b")
    finally:
        shutil.copyfile(backup, original / "02-ort_session" / "model.onnx")
    assert json.loads((out / "manifest.json").read_text())["files"]["model.onnx"] == file_sha256(backup)


def test_changed_artifact_refused(run: Path, tmp_path: Path) -> None:
    model = run / "02-ort_session" / "model.onnx"
    model.write_bytes(model.read_bytes() + b"\0")
    with pytest.raises(OptimizerError, match=r"02-ort_session/model.onnx.*sha256"):
        export_bundle(load_report(str(run)), "ort_session", "onnx", tmp_path / "b")
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_older_run_id_after_recompile_refused(tmp_path: Path) -> None:
    """`export <old id>`: the folder holds another compile's model now (other weights): refused, exit 2."""
    run = tmp_path / "run"
    run_id = _compile_recorded(mlp_recipe(), run)
    _compile(mlp_recipe(model={"source": "factory", "target": "tiny_models:mlp", "kwargs": {"seed": 1}}), run)
    proc = _cli("export", str(run_id), "--stage", "ort_session", "--out", str(tmp_path / "b"))
    assert proc.returncode == 2, proc.stderr
    assert "compiled again" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "b").exists()


# ----------------------------------------------------------------- 2: handed-over files are trusted


def test_external_data_outside_the_run_refused(run: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's secret")
    data = _report(run)
    stage = next(s for s in data["stages"] if s["name"] == "ort_session")
    stage["artifact"]["external_data"] = [os.path.relpath(secret, run / "02-ort_session")]
    (run / "report.json").write_text(json.dumps(data))
    with pytest.raises(OptimizerError, match="external_data"):
        export_bundle(load_report(str(run)), "ort_session", "onnx", tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_artifact_symlinked_outside_refused(run: Path, tmp_path: Path) -> None:
    model = run / "02-ort_session" / "model.onnx"
    elsewhere = tmp_path / "elsewhere.onnx"
    shutil.move(model, elsewhere)
    model.symlink_to(elsewhere)
    with pytest.raises(OptimizerError, match="outside the run folder"):
        export_bundle(load_report(str(run)), "ort_session", "onnx", tmp_path / "b")


@pytest.fixture(scope="module")
def bundle(compiled: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_bundle(load_report(str(compiled)), "ort_session", "onnx", tmp_path_factory.mktemp("b") / "b")


def _tampered(bundle: Path, tmp_path: Path, change: Any) -> Path:
    root = tmp_path / "tampered"
    shutil.copytree(bundle, root)
    manifest = json.loads((root / "manifest.json").read_text())
    change(root, manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_bench_refuses_a_model_outside_the_bundle(bundle: Path, tmp_path: Path) -> None:
    shutil.copyfile(bundle / "model.onnx", tmp_path / "outside.onnx")
    root = _tampered(bundle, tmp_path, lambda r, m: m.update(model="../outside.onnx"))
    with pytest.raises(OptimizerError, match="outside the bundle"):
        bench_bundle(root, 1, 1)
    assert any("outside the bundle" in p for p in verify_bundle(root))


def _drop_input(root: Path) -> None:
    with np.load(root / "reference.npz") as ref:
        arrays = {k: ref[k] for k in ref.files if "/in/" not in k}
    np.savez(root / "reference.npz", **arrays)


MANIFEST_CASES = {
    "no tolerance": (lambda r, m: m.pop("tolerance"), "tolerance"),
    "unknown graph level": (
        lambda r, m: m["runtime"]["onnxruntime_session"].update(graph_optimization_level="turbo"),
        "graph_optimization_level"),
    "threads 100000": (lambda r, m: m["runtime"].update(threads=100_000), "threads"),
    "threads 0": (lambda r, m: m["runtime"].update(threads=0), "threads"),
    "intra_op_threads 100000": (
        lambda r, m: m["runtime"]["onnxruntime_session"].update(intra_op_threads=100_000), "intra_op_threads"),
    "tolerance a string": (lambda r, m: m.update(tolerance={"min_cosine": "x", "max_abs_relative": 1}), "min_cosine"),
}


@pytest.mark.parametrize("case", MANIFEST_CASES, ids=list(MANIFEST_CASES))
def test_bad_manifest_is_one_line_naming_the_field(bundle: Path, tmp_path: Path, case: str) -> None:
    change, field = MANIFEST_CASES[case]
    root = _tampered(bundle, tmp_path, change)
    problems = verify_bundle(root)
    assert len(problems) == 1 and field in problems[0] and "manifest.json" in problems[0], problems
    with pytest.raises(OptimizerError, match=field):
        bench_bundle(root, 1, 1)


def test_reference_without_its_inputs(bundle: Path, tmp_path: Path) -> None:
    root = _tampered(bundle, tmp_path, lambda r, m: None)
    _drop_input(root)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"]["reference.npz"] = file_sha256(root / "reference.npz")
    (root / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_bundle(root)
    assert len(problems) == 1 and "reference.npz" in problems[0] and "x" in problems[0], problems
    with pytest.raises(OptimizerError, match="reference.npz"):
        bench_bundle(root, 1, 1)


def test_bench_refuses_a_changed_model(bundle: Path, tmp_path: Path) -> None:
    root = _tampered(bundle, tmp_path, lambda r, m: (r / "model.onnx").write_bytes(b"x"))
    with pytest.raises(OptimizerError, match="sha256"):
        bench_bundle(root, 1, 1)


# ----------------------------------------------------------------- 3: export's staging folder


def test_export_keeps_a_partial_folder_it_did_not_make(run: Path, tmp_path: Path) -> None:
    mine = tmp_path / ".b.partial"
    mine.mkdir()
    (mine / "keep.txt").write_text("the user's")
    export_bundle(load_report(str(run)), "ort_session", "onnx", tmp_path / "b")
    assert (mine / "keep.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".b.partial", "b", "run"]


# ----------------------------------------------------------------- 7: interruption and races


@pytest.mark.slow
def test_export_imports_no_torch(run: Path, tmp_path: Path) -> None:
    code = ("import sys; from optimizer.cli.app import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('TORCH' if 'torch' in sys.modules else 'NO TORCH', e.code)\n")
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    proc = subprocess.run([sys.executable, "-c", code, "export", str(run), "--stage", "ort_session", "--out",
                           str(tmp_path / "b")], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == "NO TORCH 0", proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.3, 0.8])
def test_ctrl_c_during_export_leaves_nothing(run: Path, tmp_path: Path, delay: float) -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    env.pop("OPTIMIZER_DEBUG", None)
    out = tmp_path / "b"
    cmd = [sys.executable, "-m", "optimizer", "export", str(run), "--stage", "ort_session", "--out", str(out)]
    # a new session; SIGINT is delivered as at a terminal even under `&` because conftest resets an inherited ignore
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True, restore_signals=True)
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".b.") for p in tmp_path.iterdir()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:  # finished before the signal landed: a complete bundle
        assert verify_bundle(out) == []
    else:
        assert proc.returncode == 130, err
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["b", "run"] if proc.returncode == 0 else ["run"])


@pytest.mark.slow
def test_concurrent_exports_into_one_out(run: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    env.pop("OPTIMIZER_DEBUG", None)
    out = tmp_path / "b"
    cmd = [sys.executable, "-m", "optimizer", "export", str(run), "--stage", "ort_session", "--out", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for _ in range(3)]
    results = [(p.wait(timeout=300), p.communicate()[1]) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2, 2], results
    for rc, err in results:
        if rc == 2:
            assert "--out" in err and "model" not in err.lower().replace("--out", ""), err
    assert verify_bundle(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "run"]


def test_export_lock_refuses_while_held(run: Path, tmp_path: Path) -> None:
    from optimizer.deploy.staging import out_lock

    out = tmp_path / "b"
    with out_lock(out), pytest.raises(OptimizerError, match="another export"):
        export_bundle(load_report(str(run)), "ort_session", "onnx", out)
    assert not out.exists()


# ----------------------------------------------------------------- 6: input names with '/'


def _slash_model(folder: Path) -> Path:
    """The corpus's one-MatMul graph whose tensor names hold '/' and ':' (tests/corpus/handover.py)."""
    from corpus.handover import _slash_model as write_slash_model

    path = folder / "slash.onnx"
    write_slash_model(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["onnx", "triton"])
def test_input_name_with_slash_verifies_and_benches(tmp_path: Path, fmt: str) -> None:
    _slash_model(tmp_path)
    data = mlp_recipe(model={"source": "onnx", "path": "slash.onnx"},
                      inputs=[{"name": "input/ids:0", "dtype": "float32", "shape": ["batch", 16]}],
                      passes=[{"type": "ort_session"}])
    run = _compile(data, tmp_path / "run")
    out = export_bundle(load_report(str(run)), "ort_session", fmt, tmp_path / "b")
    assert verify_bundle(out) == []
    assert set(bench_bundle(out, 1, 1)) == {"b1", "b8"}


# ----------------------------------------------------------------- 8: Triton's config.pbtxt


def test_triton_config_escapes_tensor_names(compiled: Path) -> None:
    from google.protobuf import text_encoding

    odd = 'in"put\\x\n'
    text = triton_config('my"model', [{"name": odd, "dtype": "float32", "onnx_type": "FLOAT", "shape": ["batch", 4]}],
                         [{"name": "o", "dtype": "float32", "onnx_type": "FLOAT", "shape": ["batch", 4]}],
                         load_report(str(compiled)), {})
    names = [line.split("name: ", 1)[1] for line in text.splitlines() if line.strip().startswith("name:")]
    assert [text_encoding.CUnescape(n[1:-1]).decode() for n in names] == ['my"model', odd, "o"]
    assert all(n.startswith('"') and n.endswith('"') for n in names)
