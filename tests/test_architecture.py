"""The architecture holds: layers and no import circles (import-linter, plus a whole-graph cycle check with
imports inside functions), passes served by their context, and errors of our own code never hidden."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import mlp_recipe, write_recipe

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import Pass, PassContext, PassResult
from optimizer.engine.pipeline import Pipeline
from optimizer.engine.triage import is_our_bug
from optimizer.recipe.loading import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def import_cycles() -> list[list[str]]:
    """Strongly connected components of more than one module in the graph of our imports: imports made inside
    functions count, and so do those under `if TYPE_CHECKING:` (they never run, but a circle of names is still a
    circle a reader has to untangle)."""
    import grimp

    graph = grimp.build_graph("optimizer", "passes", exclude_type_checking_imports=False, cache_dir=None)
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    return out


def test_no_import_circle_among_our_modules() -> None:
    assert import_cycles() == []


def test_import_linter_contracts_hold() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in proc.stdout


def test_the_architecture_picture_is_the_code_s() -> None:
    proc = subprocess.run([sys.executable, "scripts/architecture_graph.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- passes raise plain errors; bugs are not hidden
class FailingPass(Pass):
    """Fails the way the test asks: a PassError, a bug of ours, or an error raised inside a library."""

    name = "failing"
    summary = "test pass"
    how = "pass_error"

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        if FailingPass.how == "pass_error":
            raise PassError("the graph has no outputs")
        if FailingPass.how == "our_bug":
            Artifact.from_json({"missing": "kind"})  # a KeyError raised in optimizer/core/artifact.py
        if FailingPass.how == "wrapped_bug":
            try:
                artifact.derive(no_such_field=1)  # a TypeError dataclasses raises on our call: a bug of ours
            except TypeError as e:
                raise PassError("could not derive the artifact") from e
        import onnx

        onnx.checker.check_model(onnx.ModelProto())  # raised inside onnx: a library refusing the model
        raise AssertionError("unreachable")


def _compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, debug: bool) -> list[Any]:
    from optimizer.core import registry

    monkeypatch.setitem(registry.PASSES, "failing", "test_architecture:FailingPass")
    monkeypatch.setattr(FailingPass, "how", how)
    data = mlp_recipe(passes=[{"type": "export"}, {"type": "failing"}], scenarios=[{"name": "b1", "batch": 1}])
    recipe = load_recipe(write_recipe(tmp_path, data))
    return Pipeline(recipe, tmp_path / "out", measure=False, debug=debug).execute()


@pytest.mark.slow
def test_the_pipeline_names_the_stage_of_a_plain_pass_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _compile(tmp_path, monkeypatch, "pass_error", debug=True)
    failed = records[-1]
    assert failed.status == "failed" and failed.reason == "the graph has no outputs"
    assert "PassError: stage 'failing' failed (after source, export): the graph has no outputs" in (
        failed.traceback or ""
    )
    assert "traceback" not in failed.notes  # the pipeline's account is the stage's field, the notes the pass's


@pytest.mark.slow
def test_a_bug_of_ours_raises_under_debug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeyError, match="kind"):
        _compile(tmp_path, monkeypatch, "our_bug", debug=True)


@pytest.mark.slow
def test_a_bug_of_ours_is_a_failed_stage_for_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _compile(tmp_path, monkeypatch, "our_bug", debug=False)
    assert records[-1].status == "failed" and records[-1].reason.startswith("KeyError")
    assert records[1].ok  # what ran before stays


@pytest.mark.slow
def test_a_library_error_fails_the_stage_even_under_debug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _compile(tmp_path, monkeypatch, "library", debug=True)
    assert records[-1].status == "failed" and records[-1].reason.startswith("ValidationError")


@pytest.mark.slow
def test_a_bug_of_ours_wrapped_in_a_pass_error_raises_under_debug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(PassError, match="could not derive"):
        _compile(tmp_path, monkeypatch, "wrapped_bug", debug=True)
    (tmp_path / "users").mkdir()
    records = _compile(tmp_path / "users", monkeypatch, "wrapped_bug", debug=False)
    assert records[-1].status == "failed" and records[-1].reason == "could not derive the artifact"


def test_is_our_bug_reads_the_innermost_frame_that_is_ours_or_a_model_library_s() -> None:
    # Each call must raise (pytest.raises fails the test if it does not), and is_our_bug must then say whose it is.
    with pytest.raises(KeyError) as raised:
        {}["x"]  # noqa: B018 - raised in this test file: neither ours nor a model library's
    assert not is_our_bug(raised.value)
    with pytest.raises(KeyError) as raised:
        Artifact.from_json({})  # KeyError inside optimizer/core/artifact.py
    assert is_our_bug(raised.value)
    with pytest.raises(TypeError) as raised:
        Artifact("onnx", None).derive(nope=1)  # raised inside dataclasses, called from our code
    assert is_our_bug(raised.value)
    with pytest.raises(OSError) as raised:
        Artifact("onnx", Path("/nonexistent/m.onnx")).size_bytes()  # the machine's: no such file
    assert not is_our_bug(raised.value)


# ---------------------------------------------------------------- the services a pass gets from its context
def _context(tmp_path: Path) -> tuple[PassContext, Artifact]:
    from optimizer.measure.services import MeasureServices

    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe(scenarios=[{"name": "b1", "batch": 1}])))
    records = Pipeline(recipe, tmp_path / "out", measure=False).execute()
    exported = records[1].artifact
    assert exported is not None
    from optimizer.runtime.inputs import build_feeds

    feeds = build_feeds(recipe, 2)
    return PassContext(recipe, "t", tmp_path, feeds, MeasureServices()), exported


@pytest.mark.slow
def test_ctx_check_compares_through_the_accuracy_implementation(tmp_path: Path) -> None:
    ctx, exported = _context(tmp_path)
    same = ctx.check(exported, exported)
    assert set(same.per_output) == {"logits"} and same.worst() == pytest.approx(1.0)
    with ctx.session(exported) as session:
        outputs = [session.to_numpy(session.run(session.prepare(f))) for f in ctx.all_samples()]
    flipped = ctx.check([[-o for o in outs] for outs in outputs], exported)
    assert flipped.worst() == pytest.approx(-1.0)
    assert flipped.per_output["logits"].samples == len(ctx.all_samples())


@pytest.mark.slow
def test_ctx_time_is_the_interleaved_harness(tmp_path: Path) -> None:
    ctx, exported = _context(tmp_path)
    timed = ctx.time(exported, exported)
    assert timed.rounds == ctx.recipe.benchmark.rounds and 0.2 < timed.ratio < 5
    assert timed.low <= timed.ratio <= timed.high
