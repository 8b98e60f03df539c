"""INT8 weights on this CPU: the tests' tiny MLP quantized by ONNX Runtime's quantize_dynamic with 8-bit and 7-bit
(reduce_range) weights, per tensor and per channel, each output's cosine against FP32, in one process.

On x86 without VNNI the 8-bit rows lose accuracy (u8s8 kernels saturate); `optimizer` then picks 7-bit weights
(optimizer/runtime/cpu_features.py). Usage: python benchmarks/int8_reduce_range_check.py [--out DIR]

Question: whether 8-bit INT8 weights lose accuracy on x86 without VNNI, and 7-bit (reduce_range) ones do not.
Written up in: docs/quantization.md#int8-on-x86-without-vnni.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

# before onnxruntime.quantization, which puts a module named `optimizer` (ORT's own) on sys.path
from optimizer.runtime.cpu_features import int8_reduce_range  # isort: skip

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.quantization import QuantType, quantize_dynamic

sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import mlp  # noqa: E402 - the tests' model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="folder for the ONNX files (default: a temporary one)")
    args = ap.parse_args()
    folder = args.out or Path(tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = mlp(hidden=256).eval()
    x = torch.randn(8, 4, 16)
    fp32 = folder / "mlp.onnx"
    torch.onnx.export(model, (x,), str(fp32), input_names=["x"], dynamo=False, dynamic_axes={"x": {0: "b"}})
    out = model(x)
    ref = (next(iter(out.values())) if isinstance(out, dict) else out).detach().numpy().ravel()
    print(f"this CPU: {int8_reduce_range()[1]}")
    print("| weights | per tensor | per channel |\n|---|---|---|")
    for reduce in (False, True):
        row = []
        for per_channel in (False, True):
            q = folder / f"mlp_int8_rr{int(reduce)}_pc{int(per_channel)}.onnx"
            quantize_dynamic(str(fp32), str(q), per_channel=per_channel, reduce_range=reduce,
                             weight_type=QuantType.QInt8)
            y = ort.InferenceSession(str(q), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0].ravel()
            row.append(float(y @ ref / np.linalg.norm(y) / np.linalg.norm(ref)))
        print(f"| {'7-bit (reduce_range)' if reduce else '8-bit'} | {row[0]:.5f} | {row[1]:.5f} |")


if __name__ == "__main__":
    main()
