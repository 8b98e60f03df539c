"""The inputs of a model that has no config.json, for auto.py: read from an ONNX graph (names, dtypes, symbolic
dims, the vocabulary an index input gathers from) or from a PyTorch factory's module (its forward's parameter names
and its first layer's shape), checked by running the module once on what was inferred."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimizer.core.errors import OptimizerError
from optimizer.recipe.factory import load_factory

ONNX_DTYPES = {1: "float32", 10: "float16", 7: "int64", 6: "int32", 9: "bool"}  # onnx.TensorProto values
SPATIAL = 224  # symbolic height/width of an image input


@dataclass
class InputFacts:
    inputs: list[dict[str, Any]]
    dims: dict[str, int] = field(default_factory=dict)  # symbolic dims beyond batch and seq, bound in scenarios
    uses_seq: bool = False
    max_seq: int | None = None
    has_conv: bool = False
    notes: list[str] = field(default_factory=list)
    hf_config: dict[str, Any] | None = None  # a factory returning a transformers model: its config
    hf_class: str | None = None  # ... its class name
    hf_main_input: str | None = None  # ... and the input its forward takes first (main_input_name)


def _fail(model: str, message: str) -> OptimizerError:
    return OptimizerError(f"--model {model}: {message}")


# ------------------------------------------------------------------ ONNX
def _gathered_vocab(graph: Any, init_dims: dict[str, list[int]]) -> dict[str, int]:
    """input name -> rows of the initializer a Gather indexes with it (an embedding table: the index range)."""
    out: dict[str, int] = {}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[0] in init_dims:
            dims = init_dims[node.input[0]]
            if dims:
                out.setdefault(node.input[1], int(dims[0]))
    return out


def onnx_facts(path: Path, model: str) -> InputFacts:
    import onnx

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as e:  # onnx raises DecodeError, OSError, ValueError... for a file that is not a model
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise _fail(model, f"not a readable ONNX file ({first[:200]})") from None
    init_dims = {i.name: list(i.dims) for i in graph.initializer}
    real = [i for i in graph.input if i.name not in init_dims]
    if not real:
        raise _fail(model, "the ONNX graph has no inputs to feed")
    vocab = _gathered_vocab(graph, init_dims)
    names: dict[str, str] = {}  # the graph's symbolic dim -> the recipe's dim name
    facts = InputFacts(inputs=[], has_conv=any(n.op_type in ("Conv", "ConvTranspose") for n in graph.node))
    for value in real:
        tt = value.type.tensor_type
        if not value.type.HasField("tensor_type") or tt.elem_type not in ONNX_DTYPES:
            tensor = value.type.HasField("tensor_type")
            what = onnx.TensorProto.DataType.Name(tt.elem_type) if tensor else "not a tensor"
            raise _fail(model, f"input {value.name!r} is {what}: recipes feed {', '.join(ONNX_DTYPES.values())}")
        dtype = ONNX_DTYPES[tt.elem_type]
        rank = len(tt.shape.dim)
        shape: list[int | str] = []
        for axis, dim in enumerate(tt.shape.dim):
            if dim.HasField("dim_value"):
                shape.append(int(dim.dim_value))
                continue
            key = dim.dim_param or f"{value.name}:{axis}"  # an unnamed dynamic dim is its own
            if key not in names:
                names[key] = _dim_name(key, axis, rank, dtype, set(names.values()))
            shape.append(names[key])
        spec: dict[str, Any] = {"name": value.name, "dtype": dtype, "shape": shape}
        if dtype in ("int64", "int32"):
            if value.name in vocab:
                spec["range"] = [0, vocab[value.name]]
            elif "mask" in value.name.lower():
                spec["fill"] = "ones"
            else:  # nothing says how large an index may be: the smallest values are valid for any table
                spec["range"] = [0, 2]
                facts.notes.append(f"input {value.name!r}: no embedding table found, generated values in [0, 2)")
        facts.inputs.append(spec)
    for dim in names.values():
        if dim not in ("batch", "seq"):
            facts.dims[dim] = SPATIAL if dim in ("height", "width") else 1
    facts.uses_seq = "seq" in names.values()
    facts.max_seq = 128  # the graph does not say how long a sequence may be: the common length
    shapes = ", ".join(f"{i['name']} {i['dtype']} {i['shape']}" for i in facts.inputs)
    facts.notes.insert(0, f"ONNX graph {path.name}: inputs {shapes}")
    if facts.dims:
        facts.notes.append(f"other symbolic dims bound to {facts.dims}: edit the scenarios' `dims` to taste")
    return facts


def _dim_name(key: str, axis: int, rank: int, dtype: str, taken: set[str]) -> str:
    if axis == 0:
        return "batch"
    if rank == 4 and dtype.startswith("float") and axis in (2, 3):
        return "height" if axis == 2 else "width"
    if "seq" not in taken:  # the first dynamic dim past the batch: a sequence in every graph seen so far
        return "seq"
    base = re.sub(r"\W+", "_", key).strip("_") or f"dim{axis}"
    return base if base not in taken | {"batch", "seq"} else f"{base}_{len(taken)}"


# ------------------------------------------------------------------ module:function
def _first_layer(module: Any) -> Any:
    import torch

    kinds = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm)
    return next((m for m in module.modules() if isinstance(m, kinds)), None)


def _input_from_layer(name: str, layer: Any) -> tuple[dict[str, Any], str]:
    import torch

    if isinstance(layer, torch.nn.Conv2d):
        shape: list[int | str] = ["batch", layer.in_channels, SPATIAL, SPATIAL]
        return {"name": name, "dtype": "float32", "shape": shape, "range": [-1, 1]}, "Conv2d"
    if isinstance(layer, torch.nn.Conv1d):
        return {"name": name, "dtype": "float32", "shape": ["batch", layer.in_channels, "seq"]}, "Conv1d"
    if isinstance(layer, torch.nn.Embedding):
        spec = {"name": name, "dtype": "int64", "shape": ["batch", "seq"], "range": [0, layer.num_embeddings]}
        return spec, "Embedding"
    if isinstance(layer, torch.nn.LayerNorm):
        return {"name": name, "dtype": "float32", "shape": ["batch", "seq", layer.normalized_shape[-1]]}, "LayerNorm"
    return {"name": name, "dtype": "float32", "shape": ["batch", layer.in_features]}, "Linear"


def factory_facts(model: str) -> InputFacts:
    """Build the module once (seeded, as the pipeline does) and read its inputs from forward and its first layer."""
    import torch

    try:
        fn = load_factory(model)
    except OptimizerError as e:
        raise _fail(model, str(e)) from None
    torch.manual_seed(0)
    module = fn()
    if not isinstance(module, torch.nn.Module):
        raise _fail(model, f"{model}() returned {type(module).__name__}, not a torch.nn.Module")
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_dict"):  # a transformers model: its config says the rest
        return InputFacts(inputs=[], hf_config=config.to_dict(), hf_class=type(module).__name__,
                          hf_main_input=getattr(module, "main_input_name", None),
                          notes=[f"{model}() is a {type(module).__name__}"])
    params = [
        p.name for p in inspect.signature(module.forward).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    layer = _first_layer(module)
    if len(params) != 1 or layer is None:
        why = f"forward takes {len(params)} inputs ({', '.join(params)})" if len(params) != 1 else "no Conv, Linear, " \
            "Embedding or LayerNorm layer to read an input shape from"
        raise _fail(model, f"cannot infer the inputs: {why}; write the recipe's `inputs` by hand")
    spec, what = _input_from_layer(params[0], layer)
    shape = [1 if d == "batch" else 8 if d == "seq" else d for d in spec["shape"]]
    dtype = getattr(torch, spec["dtype"])
    probe = torch.zeros(shape, dtype=dtype)
    try:
        with torch.no_grad():
            module.eval()(probe)
    except Exception as e:  # the guess did not fit: say what was tried
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise _fail(model, f"inferred input {params[0]} {spec['dtype']} {shape} from its first {what} layer, but "
                           f"forward failed on it ({first[:200]}); write the recipe's `inputs` by hand") from None
    facts = InputFacts(inputs=[spec], uses_seq="seq" in spec["shape"],
                       has_conv=any(isinstance(m, torch.nn.Conv2d) for m in module.modules()))
    facts.notes.append(f"{model}: input {params[0]} {spec['dtype']} {spec['shape']} from its first {what} layer")
    return facts
