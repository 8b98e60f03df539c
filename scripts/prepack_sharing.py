"""What ONNX Runtime's weight prepacking costs in memory and buys in speed at a real size: a stack of MatMuls in
the shapes of a 0.5B decoder (24 layers, hidden 896, FFN 4864, 2 KV heads of 64, vocab 151936; 2 GB of FP32
weights in one external-data file), N sessions opened over it, each session's resident memory, then M=1 (a decode
step) and M=128 (a prefill) timed, with prepacking (ORT's default: each session packs its own copy of every
MatMul weight) or without (`session.disable_prepacking`: the sessions read the mapped file).

    python scripts/prepack_sharing.py DIR default 2
    python scripts/prepack_sharing.py DIR noprepack 2

Written by hand because it is a probe of ORT's own behaviour, not a feature: the findings are in
docs/measurement.md (real model sizes).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

H, F, L, V, KV = 896, 4864, 24, 151936, 128


def rss_gb() -> float:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1e6


def build(folder: str) -> str:
    path = os.path.join(folder, "m.onnx")
    if os.path.exists(path):
        return path
    rng = np.random.default_rng(0)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def mm(a: str, name: str, k: int, n: int) -> str:
        inits.append(numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32) * 0.02, name))
        nodes.append(helper.make_node("MatMul", [a, name], [name + ".y"]))
        return name + ".y"

    x = "x"
    for layer in range(L):
        q = mm(x, f"l{layer}.q", H, H)
        mm(x, f"l{layer}.kv", H, 2 * KV)
        mm(q, f"l{layer}.o", H, H)
        up = mm(x, f"l{layer}.up", H, 2 * F)
        nodes.append(helper.make_node("Slice", [up, "st", "en", "ax"], [up + ".s"]))
        x = mm(up + ".s", f"l{layer}.down", F, H)
    inits += [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("st", 0), ("en", F), ("ax", -1))]
    mm(x, "head", H, V)
    kept = [f"l{layer}.{n}.y" for layer in range(L) for n in ("kv", "o")]  # outputs, so that no MatMul is dead
    outputs = [helper.make_tensor_value_info("head.y", TensorProto.FLOAT, ["m", V])] + [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in kept]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", H])], outputs,
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path, save_as_external_data=True, location="w.bin", size_threshold=1024)
    print(f"weights: {os.path.getsize(os.path.join(folder, 'w.bin')) / 1e9:.2f} GB", flush=True)
    return path


def main() -> None:
    folder, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.makedirs(folder, exist_ok=True)
    path = build(folder)
    base, sessions = rss_gb(), []
    for i in range(count):
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.log_severity_level = 2, 3
        if mode == "noprepack":
            so.add_session_config_entry("session.disable_prepacking", "1")
        sessions.append(ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]))
        print(f"{mode}: {i + 1} session(s), resident {rss_gb() - base:.2f} GB", flush=True)
    for m in (1, 128):
        x = np.random.default_rng(1).standard_normal((m, H), dtype=np.float32)
        sessions[0].run(["head.y"], {"x": x})
        times = []
        for _ in range(5):
            start = time.perf_counter()
            sessions[0].run(["head.y"], {"x": x})
            times.append(time.perf_counter() - start)
        print(f"{mode}: M={m} best of 5 {min(times) * 1e3:.1f} ms, resident {rss_gb() - base:.2f} GB", flush=True)


if __name__ == "__main__":
    main()
