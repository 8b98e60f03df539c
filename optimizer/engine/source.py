"""Stage 0: the source model as it is. PyTorch eager FP32 for torch sources; for an ONNX source, the file
run by ONNX Runtime with its optimizations off. It is the reference for accuracy and speed."""

from __future__ import annotations

import inspect
from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.errors import InputError
from optimizer.recipe.schema import SEQ2SEQ_TASKS, OnnxSource, Recipe
from optimizer.runtime.inputs import FeedSet


def _check_torch_inputs(module: Any, names: list[str]) -> None:
    params = inspect.signature(module.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for i, name in enumerate(names):
        if name not in params:
            takes = ", ".join(p for p in params if params[p].kind is not inspect.Parameter.VAR_POSITIONAL)
            raise InputError(
                f"inputs[{i}].name: {name!r} is not an input of {type(module).__name__}.forward (it takes: {takes})"
            )


def _check_sequence_lengths(module: Any, recipe: Recipe) -> None:
    config = getattr(module, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not isinstance(limit, int):
        return
    for i, scen in enumerate(recipe.scenarios):
        if scen.seq > limit:
            raise InputError(
                f"scenarios[{i}].seq: {scen.seq} is longer than the model takes (its positions stop at {limit}); "
                f"use seq <= {limit}"
            )


def _check_data_dtypes(recipe: Recipe, model: Any, feed: dict[str, Any]) -> None:
    from onnx import helper

    for inp in model.graph.input:
        elem = inp.type.tensor_type.elem_type
        if inp.name not in feed or not elem:
            continue
        want = helper.tensor_dtype_to_np_dtype(elem)
        if feed[inp.name].dtype != want:
            raise InputError(f"data_file: {recipe.resolve(recipe.data_file or '')}: array {inp.name!r} is "
                             f"{feed[inp.name].dtype}, but the model takes {inp.name!r} as {want}")


def check_budget_output(recipe: Recipe, artifact: Artifact) -> None:
    """accuracy.output must name an output of stage 0, whose outputs every stage's accuracy is keyed by. Checked
    at load where they are known then (recipe.loading); a PyTorch model's are known here, once it ran."""
    wanted = recipe.accuracy.output
    if wanted is not None and wanted not in artifact.output_names:
        names = ", ".join(map(repr, artifact.output_names))
        raise InputError(f"accuracy.output: {wanted!r} is not an output of the model (outputs: {names})")


def source_artifact(recipe: Recipe, feeds: FeedSet) -> Artifact:
    names = list(feeds.input_names)
    if isinstance(recipe.model, OnnxSource):
        from optimizer.runtime import onnx_io

        path = recipe.resolve(recipe.model.path).resolve()
        model = onnx_io.load(path, with_weights=False)
        external = onnx_io.external_data_files(path, model)  # bounds first: the checker would read them
        onnx_io.check(path)
        graph_inputs = [i.name for i in model.graph.input]
        initializers = {t.name for t in model.graph.initializer}
        needed = [n for n in graph_inputs if n not in initializers]
        for i, name in enumerate(names):
            if name not in graph_inputs:
                raise InputError(f"inputs[{i}].name: {name!r} is not an input of {path.name} (it takes: {needed})")
        missing = [n for n in needed if n not in names]
        if missing:
            raise InputError(f"inputs: {path.name} also needs {missing}; add them to the recipe's inputs")
        if recipe.data_file:  # the file's arrays where the recipe declares no inputs: checked against the graph
            _check_data_dtypes(recipe, model, next(iter(feeds)).timing)
        outputs = [o.name for o in model.graph.output]
        return Artifact(
            "onnx", path, {"graph_optimization_level": "disable_all"}, input_names=names, output_names=outputs,
            external_data=external,  # every later copy of the model (stages, bundles) brings its weights along
        )

    import torch

    from optimizer.runtime.models import discover_outputs, load_module

    module = load_module(recipe)
    _check_torch_inputs(module, names)
    _check_sequence_lengths(module, recipe)
    first = next(iter(feeds)).timing
    if getattr(recipe.model, "task", None) in SEQ2SEQ_TASKS:  # its forward needs decoder inputs: only the loop runs it
        returned = ["generation"]
    else:
        returned = discover_outputs(module, names, [torch.from_numpy(first[n]) for n in names])
    for i, name in enumerate(recipe.outputs or []):
        if name not in returned:
            raise InputError(f"outputs[{i}]: {name!r} is not an output of the model (it returns: {returned})")
    outputs = recipe.outputs or returned
    if recipe.workload == "generation":
        outputs = ["generation"]  # the greedy loop's tokens and per-step logits
    tensors = list(module.parameters()) + list(module.buffers())
    param_bytes = sum(t.numel() * t.element_size() for t in tensors)
    return Artifact(
        "torch", None, input_names=names, output_names=outputs, param_bytes=param_bytes, module=type(module).__name__
    )
