"""`substitute`: the stage's artifact is another ONNX file, run exactly as its input stage runs.

Why a pass: `optimizer compare A B` puts A as stage 0 (an `onnx` source) and B as this stage, so B is timed
interleaved against A by the one harness, its accuracy is judged against A's outputs, and the report explains
the ratio by op type like any pass. The substituted artifact keeps its input's runtime settings (ORT's graph
optimization level, threads, spinning), so both files run under the same session options.

B must take the same inputs (names and dtypes) and give as many outputs, in the same order, as its input stage:
the accuracy check compares outputs by position. `sha256`, when given, pins the file's content (and makes it part
of the stage's cache key, which hashes the config): a file replaced in place is then refused, not reused.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from optimizer.core.artifact import Artifact
from optimizer.core.errors import InputError, PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassResult


class SubstituteConfig(PassConfig):
    path: str = Field(description="the ONNX file that becomes this stage's artifact (relative: to the recipe)")
    sha256: str | None = Field(
        default=None,
        description="the file's sha256 (with external data, onnx_io.model_sha256: of the graph and its data files); "
        "when given, a model that differs fails",
    )


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # numpy's name: float32, int64, ...
    dims: tuple[int | str, ...]  # ints fixed, names symbolic ("?" when the graph names none)


@dataclass(frozen=True)
class GraphIO:
    inputs: list[Tensor]  # graph inputs that are not initializers: what a feed must give
    outputs: list[Tensor]
    external_data: list[str]  # weight files the graph references, beside it
    opset: int | None  # of the default domain


def _tensor(value: Any) -> Tensor:
    import onnx

    t = value.type.tensor_type
    dtype = str(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)) if t.elem_type else "?"
    dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim)
    return Tensor(value.name, dtype, dims)


def graph_io(path: Path) -> GraphIO:
    """An ONNX file's inputs, outputs and external data files (the graph only: weights are not read)."""
    import onnx

    from optimizer.runtime import onnx_io

    model = onnx_io.load(path, with_weights=False)
    inits = {t.name for t in model.graph.initializer}
    external = sorted(
        {
            e.value
            for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL
            for e in t.external_data
            if e.key == "location"
        }
    )
    return GraphIO(
        [_tensor(i) for i in model.graph.input if i.name not in inits],
        [_tensor(o) for o in model.graph.output],
        external,
        next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None),
    )


def io_mismatch(a: GraphIO, b: GraphIO, a_name: str = "A", b_name: str = "B") -> str | None:
    """One line saying how B's inputs or outputs differ from A's (names, dtypes, output count), or None."""
    ai, bi = {t.name: t for t in a.inputs}, {t.name: t for t in b.inputs}
    if set(ai) != set(bi):
        only_a, only_b = sorted(set(ai) - set(bi)), sorted(set(bi) - set(ai))
        return (
            f"input names of {a_name} and {b_name} differ: only {a_name} takes {only_a or '-'}, "
            f"only {b_name} takes {only_b or '-'}"
        )
    dtypes = [f"{n}: {ai[n].dtype} vs {bi[n].dtype}" for n in ai if ai[n].dtype != bi[n].dtype]
    if dtypes:
        return f"input dtypes of {a_name} and {b_name} differ ({'; '.join(dtypes)})"
    if len(a.outputs) != len(b.outputs):
        return (
            f"{a_name} gives {len(a.outputs)} output{'s' if len(a.outputs) != 1 else ''} "
            f"({[t.name for t in a.outputs]}), {b_name} gives "
            f"{len(b.outputs)} ({[t.name for t in b.outputs]}); outputs are compared by position"
        )
    return None


class SubstitutePass(Pass[SubstituteConfig]):
    name = "substitute"
    summary = "the artifact becomes another ONNX file (same session options): `optimizer compare` runs B this way"
    Config = SubstituteConfig
    consumes = frozenset({"onnx"})
    requires = ("onnx",)

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        from optimizer.runtime import onnx_io

        cfg = self.config
        assert artifact.path is not None
        src = ctx.recipe.resolve(cfg.path).resolve()
        if not src.is_file():
            raise InputError(f"substitute.path: no such file: {src}")
        onnx_io.external_data_files(src)  # its data files' bounds, before anything reads them
        if cfg.sha256 is not None and onnx_io.model_sha256(src) != cfg.sha256:
            raise InputError(f"substitute.path: {src} changed since it was named (its sha256 is not {cfg.sha256})")
        onnx_io.check(src)
        mine, theirs = graph_io(src), graph_io(artifact.path)
        why = io_mismatch(theirs, mine, f"the input stage ({artifact.path.name})", src.name)
        if why:
            raise PassError(why)
        path = ctx.stage_dir / "model.onnx"
        shutil.copyfile(src, path)
        for f in mine.external_data:  # the graph names them relative to itself: keep them beside it
            if not (src.parent / f).is_file():
                raise InputError(f"substitute.path: {src} references external data {f!r}, which is missing")
            target = path.parent / f
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src.parent / f, target)
        renamed = [(a.name, b.name) for a, b in zip(theirs.outputs, mine.outputs, strict=True) if a.name != b.name]
        out = artifact.derive(
            path=path, external_data=mine.external_data, output_names=[t.name for t in mine.outputs], exporter=None,
            opset=mine.opset,
        )
        notes: dict[str, Any] = {"source_file": str(src), "sha256": cfg.sha256 or onnx_io.model_sha256(src),
                                 "runtime": dict(artifact.runtime)}
        if renamed:
            notes["outputs_compared_by_position"] = renamed
        return PassResult(out, modified=True, notes=notes)
