"""Graphs with a precision per node (INT8, FP16, FP32), written two ways from one plan (hybrid_gpu.py).

deploy:   what a GPU runs. FP16 nodes really in float16 (weights stored fp16, a Cast into fp16 where an FP32 tensor
          enters, a Cast back where an FP32 consumer or a graph output needs it, none between adjacent FP16
          nodes); INT8 nodes as symmetric QuantizeLinear/DequantizeLinear on their activation inputs (per-tensor,
          calibrated scale, int8 zero point 0) and int8 weight initializers + DequantizeLinear (per output
          channel): TensorRT's explicit quantization. Types decide precision, every node's float inputs share one
          type: what TensorRT's strongly typed networks and ORT's CUDA provider take as they are.
simulate: the same numerics in FP32, runnable on ORT's CPU provider: INT8 nodes are the same Q/DQ (the CPU
          dequantizes), FP16 nodes keep FP32 kernels but their weights, inputs and outputs are rounded through
          float16 (Cast to float16 and back). Only the accumulation differs (FP32 here, FP16/FP32 on the GPU).
Nodes not in the plan stay FP32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PLANNED_OPS = ("MatMul", "Gemm", "Conv")
FLOAT, FLOAT16, INT8 = 1, 10, 3  # onnx.TensorProto data types
QDQ_OPSET = 13  # per-axis DequantizeLinear


def weight_axis(node: Any) -> int:
    """The output-channel axis of a node's weight (input 1): Conv's dim 0, MatMul's last, Gemm's by transB."""
    if node.op_type == "Conv":
        return 0
    if node.op_type == "Gemm":
        trans = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans else 1
    return -1


@dataclass
class _Writer:
    model: Any
    plan: dict[str, str]
    amax: dict[str, float]
    simulate: bool
    inits: dict[str, Any] = field(default_factory=dict)
    nodes: list[Any] = field(default_factory=list)
    new_inits: list[Any] = field(default_factory=list)
    made: dict[tuple[str, str], str] = field(default_factory=dict)  # (tensor, form) -> its name in that form
    fp16_out: set[str] = field(default_factory=set)  # deploy: original names whose tensor is now `{name}__fp16`
    casts: int = 0

    def _init(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.new_inits.append(numpy_helper.from_array(array, name))
        return name

    def _node(self, op: str, inputs: list[str], output: str, **attrs: Any) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, [output], name=f"{output}__{op}", **attrs))
        self.casts += op == "Cast"
        return output

    def _once(self, tensor: str, form: str, make: Any) -> str:
        key = (tensor, form)
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]

    # ------------------------------------------------------------ the forms a tensor is read in
    def fp32(self, t: str) -> str:
        """t as float32: a Cast back from fp16 (once) when an FP16 node wrote it."""
        if self.simulate or t not in self.fp16_out:
            return t  # simulated FP16 outputs are float32 already (rounded)
        return self._once(t, "fp32", lambda: self._node("Cast", [f"{t}__fp16"], t, to=FLOAT))

    def fp16(self, t: str) -> str:
        if t in self.inits:
            w = self.inits[t].astype(np.float16)
            if self.simulate:
                return self._once(t, "r16", lambda: self._init(f"{t}__r16", w.astype(np.float32)))
            return self._once(t, "w16", lambda: self._init(f"{t}__fp16", w))
        if self.simulate:
            if t in self.fp16_out:
                return t  # already rounded by the FP16 node that wrote it
            return self._once(t, "r16", lambda: self._round(t, f"{t}__r16"))
        if t in self.fp16_out:
            return f"{t}__fp16"
        return self._once(t, "to16", lambda: self._node("Cast", [t], f"{t}__to16", to=FLOAT16))

    def _round(self, t: str, out: str) -> str:
        return self._node("Cast", [self._node("Cast", [t], f"{out}_h", to=FLOAT16)], out, to=FLOAT)

    def qdq_activation(self, t: str) -> str:
        def make() -> str:
            scale = self._init(f"{t}__scale", np.float32(_scale(self.amax.get(t, 0.0))))
            zero = self._init(f"{t}__zero", np.int8(0))
            q = self._node("QuantizeLinear", [self.fp32(t), scale, zero], f"{t}__q")
            return self._node("DequantizeLinear", [q, scale, zero], f"{t}__dq")

        return self._once(t, "qdq", make)

    def qdq_weight(self, t: str, axis: int) -> str:
        def make() -> str:
            w = self.inits[t].astype(np.float32)
            ax = axis % w.ndim
            others = tuple(i for i in range(w.ndim) if i != ax)
            amax = np.abs(w).max(axis=others) if others else np.abs(w)
            scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
            shape = [1] * w.ndim
            shape[ax] = -1
            q = np.clip(np.round(w / scale.reshape(shape)), -127, 127).astype(np.int8)
            names = (f"{t}__int8", f"{t}__wscale", f"{t}__wzero")
            self._init(names[0], q)
            self._init(names[1], scale)
            self._init(names[2], np.zeros(scale.shape, np.int8))
            return self._node("DequantizeLinear", list(names), f"{t}__wdq", axis=ax)

        return self._once(t, f"wqdq{axis}", make)

    # ------------------------------------------------------------ nodes
    def write(self, node: Any) -> None:
        precision = self.plan.get(node.name, "fp32")
        if precision == "int8":
            node.input[:] = [self._int8_input(node, i, t) for i, t in enumerate(node.input)]
        elif precision == "fp16":
            node.input[:] = [self.fp16(t) if t else t for t in node.input]
            if self.simulate:
                outs = list(node.output)
                node.output[:] = [f"{t}__sim" for t in outs]
                self.nodes.append(node)
                for t, raw in zip(outs, node.output, strict=True):
                    self._round(raw, t)
                    self.fp16_out.add(t)
                return
            self.fp16_out.update(node.output)
            node.output[:] = [f"{t}__fp16" for t in node.output]
        else:
            node.input[:] = [self.fp32(t) if t else t for t in node.input]
        self.nodes.append(node)

    def _int8_input(self, node: Any, i: int, t: str) -> str:
        if not t:
            return t
        if node.op_type in ("Gemm", "Conv") and i == 2:
            return self.fp32(t)  # the bias stays FP32: TensorRT folds it into the INT8 kernel's epilogue
        if t in self.inits:
            return self.qdq_weight(t, weight_axis(node) if i == 1 else 0)
        return self.qdq_activation(t)


def _scale(amax: float) -> float:
    return amax / 127.0 if amax > 0 else 1.0


def write(model: Any, plan: dict[str, str], amax: dict[str, float], simulate: bool) -> Any:
    """A copy of `model` with each planned node in its precision (see the module docstring); the FP32 weights
    no node reads any more are dropped."""
    import onnx
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    writer = _Writer(out, plan, amax, simulate)
    writer.inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.data_type == FLOAT}
    for node in graph.node:
        writer.write(node)
    for o in graph.output:
        o.name = writer.fp32(o.name)
    del graph.node[:]
    graph.node.extend(writer.nodes)
    graph.initializer.extend(writer.new_inits)
    used = {t for n in graph.node for t in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.value_info[:]  # intermediate types changed; shape inference writes them anew
    return out


def opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def mixed_float_inputs(model: Any) -> list[str]:
    """Nodes whose float inputs are not all of one float type (after shape inference): what a strongly typed
    TensorRT network refuses. Quantize/DequantizeLinear read an integer tensor with a float scale by design."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)  # not strict: report the mixed node, do not raise
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    types.update({t.name: t.data_type for t in graph.initializer})
    floats = {1, 10, 11, 16}  # float, float16, double, bfloat16
    bad = []
    for node in graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", "Cast"):
            continue
        kinds = {types.get(t) for t in node.input if t and types.get(t) in floats}
        if len(kinds) > 1:
            bad.append(f"{node.name} ({node.op_type}): inputs of types {sorted(k for k in kinds if k)}")
    return bad


def node_flops(node: Any, shapes: dict[str, tuple[int, ...]]) -> int:
    """Multiply-adds x 2 of a MatMul / Gemm / Conv from its measured input and output shapes (0 if unknown)."""
    out = shapes.get(node.output[0])
    a = shapes.get(node.input[0])
    w = shapes.get(node.input[1])
    if out is None or a is None or w is None:
        return 0
    if node.op_type == "Conv":
        return 2 * int(np.prod(out)) * int(np.prod(w[1:]))  # w: [Cout, Cin/group, k...]
    trans_a = node.op_type == "Gemm" and any(x.name == "transA" and x.i for x in node.attribute)
    return 2 * int(np.prod(out)) * int(a[0] if trans_a else a[-1])  # times the reduced dimension K
