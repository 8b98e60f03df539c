"""Reading and writing ONNX files, with external data for models past protobuf's 2 GB limit."""

from __future__ import annotations

import collections
import shutil
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.errors import InputError, OptimizerError

# protobuf refuses messages over 2 GiB; stay clear of it with room for the graph itself.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


def load(path: Path, with_weights: bool = True) -> Any:
    import onnx

    try:
        return onnx.load(str(path), load_external_data=with_weights)
    except Exception as e:  # onnx raises DecodeError, OSError, ValueError... for broken files
        raise OptimizerError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})") from e


def _node_tensors(nodes: Any) -> Iterator[Any]:
    """Tensors held in node attributes (Constant values and the like), subgraphs included."""
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sparse in [*([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []), *attr.sparse_tensors]:
                yield from (sparse.values, sparse.indices)
            for graph in [*([attr.g] if attr.HasField("g") else []), *attr.graphs]:
                yield from _graph_tensors(graph)


def _graph_tensors(graph: Any) -> Iterator[Any]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    yield from _node_tensors(graph.node)


def _external_locations(model: Any) -> dict[str, str]:
    """location -> the first tensor that keeps its data there, for every tensor stored outside the graph file."""
    import onnx

    tensors = [*_graph_tensors(model.graph), *(t for f in model.functions for t in _node_tensors(f.node))]
    found: dict[str, str] = {}
    for t in tensors:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in t.external_data if e.key == "location"), "")
            found.setdefault(location, t.name)
    return found


def external_data_files(path: Path, model: Any | None = None) -> list[str]:
    """The external data files the graph at `path` references (locations relative to its folder, sorted), each
    checked to be a regular file inside that folder before anything reads it: a graph naming `../secret.bin`, an
    absolute path or a symlink would have every copy of the model (and a bundle) carry a file nobody handed over."""
    model = model if model is not None else load(path, with_weights=False)
    folder = path.parent.resolve()
    found = _external_locations(model)
    for location, tensor in sorted(found.items()):
        where = f"{path}: tensor {tensor!r} keeps its data at {location!r}"
        target = folder / location
        if PurePosixPath(location).is_absolute() or not target.resolve().is_relative_to(folder):
            raise InputError(f"{where}, outside the model's folder {folder}: external data must lie in that folder")
        if target.is_symlink():
            raise InputError(f"{where}, a symbolic link: external data must be a regular file in {folder}")
        if not target.is_file():
            raise InputError(f"{where}, which does not exist in {folder}: copy it beside the model")
    return sorted(found)


def copy_model(src: Path, dst: Path) -> list[str]:
    """Copy an ONNX model with the external data files its graph references, each placed where the graph names it
    (relative to dst's folder): a graph copied alone would point at weights that are not there. Returns them."""
    files = external_data_files(src)
    plan = [(src, dst), *((src.parent / f, dst.parent / f) for f in files)]
    for a, b in plan:
        if b.exists() and b.samefile(a):
            continue
        b.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(a, b)
    return files


def model_sha256(path: Path) -> str:
    """sha256 of an ONNX model as a whole: the graph file's, or with external data, of the graph's and every
    data file's (by location), so weights replaced in place in `m.onnx.data` change it too."""
    import hashlib
    import json

    from optimizer.core.artifact import file_sha256

    files = external_data_files(path)
    if not files:
        return file_sha256(path)
    parts = [file_sha256(path), *(f"{f}:{file_sha256(path.parent / f)}" for f in files)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def weight_bytes(model: Any) -> int:
    return sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)


def needs_external_data(model: Any) -> bool:
    """Past the threshold the weights go to a side file: one protobuf message cannot exceed 2 GiB."""
    return weight_bytes(model) >= EXTERNAL_DATA_THRESHOLD


def check(path: Path) -> None:
    """onnx.checker on a file (by path, so models with external data and past 2 GB are checked too)."""
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except (onnx.checker.ValidationError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OptimizerError(f"{path}: fails onnx.checker: {first}") from e


def save(model: Any, path: Path) -> list[str]:
    """Save model to path; returns the external data file names (empty when it fits in one file)."""
    import onnx

    if not needs_external_data(model):
        try:
            onnx.save(model, str(path))
            return []
        except ValueError:  # serialization failed on size after all
            pass
    data = path.name + ".data"
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data)
    return [data]


SHARED_WEIGHTS = "weights.bin"


def save_shared(models: dict[str, Any], folder: Path, inline_below: int = 1024, align: int = 4096) -> list[str]:
    """Save several graphs (file name -> model, or the Path of an ONNX file to read) over one external-data
    file: a tensor whose bytes another graph already wrote is written once and referenced by both. The prefill
    and decode graphs of a decoder hold the same weights; saved apart they double its size on disk. Offsets are
    page-aligned, so ONNX Runtime can map the file instead of copying it. A graph given by path is read when its
    turn comes and dropped once saved, so at most one graph's weights are in memory at a time (two 2.4 GB graphs
    of a 0.5B decoder held at once were 5 GB of the compile's peak). Returns the side files written
    ([SHARED_WEIGHTS] or nothing)."""
    import gc
    import hashlib

    import onnx
    from onnx import external_data_helper, numpy_helper

    written: dict[bytes, tuple[int, int]] = {}
    data_path = folder / SHARED_WEIGHTS
    with data_path.open("wb") as data:
        for name in list(models):
            model = load(models[name]) if isinstance(models[name], Path) else models[name]
            for tensor in model.graph.initializer:
                if not tensor.HasField("raw_data"):  # typed fields (float_data...): external data needs raw bytes
                    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
                raw = tensor.raw_data
                if len(raw) < inline_below:
                    continue
                key = hashlib.sha256(raw).digest()
                if key not in written:
                    data.write(b"\0" * (-data.tell() % align))
                    written[key] = (data.tell(), len(raw))
                    data.write(raw)
                offset, length = written[key]
                external_data_helper.set_external_data(tensor, SHARED_WEIGHTS, offset, length)
                tensor.ClearField("raw_data")
                tensor.data_location = onnx.TensorProto.EXTERNAL
            data.flush()
            onnx.save(model, str(folder / name))
            del model
            models[name] = None  # the caller's reference too: one graph's weights in memory at a time
            gc.collect()
    if not written:
        data_path.unlink()
        return []
    return [SHARED_WEIGHTS]


def op_histogram(path: Path) -> dict[str, int]:
    """Count of nodes by op type (domain-qualified when not the default domain), subgraphs included."""
    model = load(path, with_weights=False)
    counts: collections.Counter[str] = collections.Counter()

    def walk(graph: Any) -> None:
        for node in graph.node:
            key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            counts[key] += 1
            for attr in node.attribute:
                if attr.g is not None and attr.g.node:
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)

    walk(model.graph)
    return dict(counts.most_common())


def graph_stats(artifact: Artifact) -> dict[str, Any]:
    if artifact.kind == "openvino" and artifact.path is not None:
        from optimizer.runtime.ov_engine import ir_op_types

        hist = ir_op_types(artifact.path)
        return {"nodes": sum(hist.values()), "op_types": hist}
    if artifact.kind != "onnx" or artifact.path is None:
        return {}
    hist = op_histogram(artifact.path)
    return {"nodes": sum(hist.values()), "op_types": hist}


SCOPE_KEY = "pkg.torch.onnx.name_scopes"


def node_scopes(model: Any) -> dict[str, str]:
    """node name -> the PyTorch module it came from (from the dynamo exporter's name_scopes metadata: a list of
    module names; any other value, which a file may hold, is ignored)."""
    import ast

    out = {}
    for node in model.graph.node:
        for prop in node.metadata_props:
            if prop.key == SCOPE_KEY:
                try:
                    scopes = ast.literal_eval(prop.value)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    continue
                # a hint, never a requirement: anything but the exporter's list of module names is ignored
                if not isinstance(scopes, list | tuple) or not all(isinstance(s, str) for s in scopes):
                    continue
                modules = [s for s in scopes[:-1] if s]
                if modules:
                    out[node.name] = modules[-1]
    return out


def carry_metadata(src: Any, dst: Any) -> None:
    """Copy node metadata (module scopes) from src to dst by node name; a new node named `<old>_<suffix>`
    inherits the metadata of <old>, so fused nodes still say which module they came from."""
    by_name = {n.name: list(n.metadata_props) for n in src.graph.node if n.metadata_props}
    for node in dst.graph.node:
        if node.metadata_props:
            continue
        name = node.name
        while name and name not in by_name and "_" in name:
            name = name.rsplit("_", 1)[0]
        for prop in by_name.get(name, []):
            node.metadata_props.add(key=prop.key, value=prop.value)
