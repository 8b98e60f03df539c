"""Pass registry: name -> "module:Class", imported lazily so that listing passes needs no heavy library."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from optimizer.core.pass_base import Pass

PASSES: dict[str, str] = {
    "export": "passes.export:ExportPass",
    "ort_session": "passes.ort_session:OrtSessionPass",
    "fuse": "passes.fuse:FusePass",
    "ort_transformers": "passes.ort_transformers:OrtTransformersPass",
    "quantize": "passes.quantize.quantize_pass:QuantizePass",
    "static_kv_cache": "passes.static_kv_cache:StaticKVCachePass",
    "cuda_graph": "passes.cuda_graph:CudaGraphPass",
    "tensorrt": "passes.tensorrt:TensorRTPass",
    "substitute": "passes.substitute:SubstitutePass",
    "openvino": "passes.openvino:OpenVinoPass",
    "nncf_int8": "passes.nncf_int8:NncfInt8Pass",
    "genai_build": "passes.genai_build:GenaiBuildPass",
}


class UnknownPass(KeyError):
    def __str__(self) -> str:
        return f"unknown pass {self.args[0]!r} (known: {', '.join(sorted(PASSES))})"


def pass_class(name: str) -> type[Pass]:
    if name not in PASSES:
        raise UnknownPass(name)
    module, cls = PASSES[name].split(":")
    return getattr(importlib.import_module(module), cls)
