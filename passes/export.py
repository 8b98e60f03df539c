"""Export: PyTorch module -> ONNX graph with torch.onnx.export, then a numeric check against PyTorch.

The exported graph is run by ONNX Runtime with graph optimizations off on every scenario's sample input and
compared with the PyTorch outputs; a cosine below `min_cosine` fails the stage rather than letting a wrong
graph be optimized and benchmarked. Symbolic dims of the recipe's inputs become dynamic axes, so one graph
serves every scenario.
"""

from __future__ import annotations

import io
from typing import Any, Literal

import numpy as np
from pydantic import Field

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassResult
from optimizer.core.quiet import quiet
from optimizer.runtime.errortext import error_line


class ExportConfig(PassConfig):
    exporter: Literal["dynamo", "torchscript"] = Field(
        default="dynamo", description="dynamo: torch.export based (current); torchscript: the legacy tracer"
    )
    opset: int | None = Field(default=None, ge=11, le=23, description="default: the exporter's own")
    dynamic: bool = Field(default=True, description="symbolic input dims become dynamic axes")
    min_cosine: float = Field(default=0.9999, description="reject the export below this cosine vs PyTorch")


def _dynamic_axes(ctx: PassContext) -> dict[str, dict[int, str]]:
    specs = {s.name: s for s in ctx.recipe.inputs}
    axes: dict[str, dict[int, str]] = {}
    for name in ctx.feeds.input_names:
        spec = specs.get(name)
        # Tokenizer inputs without a spec are [batch, seq].
        shape = spec.shape if spec else ["batch", "seq"]
        dyn = {i: d for i, d in enumerate(shape) if isinstance(d, str)}
        if dyn:
            axes[name] = dyn
    return axes


def _dynamic_shapes(inputs: list[str], axes: dict[str, dict[int, str]]) -> tuple[Any, ...]:
    """torch.export's form for a `forward(*args)` wrapper: a one-element tuple (for `args`) holding one entry
    per input; a named Dim is shared by every input that uses it, so the graph keeps the recipe's dim names."""
    import torch

    dims: dict[str, Any] = {}
    per_input = tuple(
        {axis: dims.setdefault(name, torch.export.Dim(name)) for axis, name in axes.get(inp, {}).items()} or None
        for inp in inputs
    )
    return (per_input,)


def _export_sample(ctx: PassContext, axes: dict[str, dict[int, str]]) -> dict[str, np.ndarray]:
    """The largest scenario's input, with dynamic dims of size 1 doubled: exporters specialize size-1 dims."""
    largest = max(ctx.feeds, key=lambda sf: sum(a.size for a in sf.timing.values()))
    sample = dict(largest.timing)
    for name, dims in axes.items():
        for axis in dims:
            if sample[name].shape[axis] == 1:
                sample[name] = np.repeat(sample[name], 2, axis=axis)
    return sample


class ExportPass(Pass[ExportConfig]):
    name = "export"
    summary = "PyTorch -> ONNX (torch.onnx.export), checked against PyTorch on every scenario"
    Config = ExportConfig
    consumes = frozenset({"torch"})
    handles_generation = True
    version = 2  # 2: generation graphs share one weights file

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        import torch

        from optimizer.runtime import onnx_io
        from optimizer.runtime.models import NamedIO, load_module

        cfg = self.config
        if ctx.recipe.workload == "generation":
            from passes.export_generation import export_generation

            out, notes = export_generation(artifact, ctx, cfg.opset, cfg.min_cosine)
            return PassResult(out, modified=True, notes=notes)
        inputs: list[str] = artifact.input_names
        outputs: list[str] = artifact.output_names
        module = NamedIO.wrap(load_module(ctx.recipe), inputs, outputs)
        axes = _dynamic_axes(ctx) if cfg.dynamic else {}
        sample = _export_sample(ctx, axes) if axes else ctx.feeds.by_scenario[ctx.recipe.scenarios[0].name].timing
        args = tuple(torch.from_numpy(sample[n]) for n in inputs)
        dynamo = cfg.exporter == "dynamo"
        shapes = _dynamic_shapes(inputs, axes) if dynamo and axes else None
        tmp = ctx.stage_dir / "export.onnx"
        log = io.StringIO()
        try:
            with quiet(log), torch.no_grad():
                torch.onnx.export(
                    module,
                    args,
                    str(tmp),
                    input_names=inputs,
                    output_names=outputs,
                    opset_version=cfg.opset,
                    dynamo=dynamo,
                    dynamic_shapes=shapes,
                    dynamic_axes=None if dynamo else (axes or None),
                    external_data=False,
                )
        except Exception as e:
            # torch's banner and colour codes out: the line that names the problem (and the user's code line)
            raise PassError(f"torch.onnx.export ({cfg.exporter}) failed: {error_line(str(e), type(e).__name__)}") from e
        # Re-save through one helper so files past 2 GB get external data the same way in every pass.
        model = onnx_io.load(tmp)
        path = ctx.stage_dir / "model.onnx"
        external = onnx_io.save(model, path)
        tmp.unlink()
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
        out = artifact.derive(
            kind="onnx",
            path=path,
            runtime={"graph_optimization_level": "disable_all"},
            exporter=cfg.exporter,
            opset=opset,
            external_data=external,
        )
        check = self._check(module, out, ctx, cfg.min_cosine)
        notes = {
            "exporter": cfg.exporter,
            "opset": opset,
            "dynamic_axes": axes,
            "check": check,
            "log": log.getvalue(),
        }
        return PassResult(out, modified=True, notes=notes)

    def _check(self, module: Any, artifact: Artifact, ctx: PassContext, min_cosine: float) -> dict[str, Any]:
        """Compare ORT (optimizations off) with PyTorch on each scenario's timing input."""
        import torch

        def torch_outputs(feed: dict[str, Any]) -> list[Any]:
            with torch.inference_mode():
                return [t.numpy() for t in module(*(torch.from_numpy(feed[n]) for n in ctx.feeds.input_names))]

        result: dict[str, Any] = {}
        for sf in ctx.feeds:
            check = ctx.check(torch_outputs, artifact, [sf.timing])
            result[sf.scenario.name] = {name: a.to_json() for name, a in check.per_output.items()}
            worst = check.worst(nonfinite_fails=False)
            if worst < min_cosine:
                raise PassError(
                    f"the ONNX graph disagrees with PyTorch on scenario {sf.scenario.name!r}: "
                    f"cosine {worst:.6f} < {min_cosine}"
                )
        return result
