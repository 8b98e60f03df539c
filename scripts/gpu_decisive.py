"""The decisive GPU checks, most telling first, each bounded and recorded as pass / fail / skip with its numbers.

Run by scripts/gpu_check.sh on a GPU machine (torch with CUDA; TensorRT and onnxruntime-gpu optional). Every
check here would report a wrong number or crash on a first GPU run if the logic it exercises were wrong:
  replay_stream       a captured graph replayed on the stream its CUDA events time (the TensorRT runner's pattern):
                      GPU time of real work, and the wrong pattern (replay elsewhere) shown reading about zero;
  second_feed         a captured PyTorch graph fed a second input of the same shape returns that input's outputs;
  ort_stream          ORT CUDA EP on torch's stream (user_compute_stream): its GPU time is non-zero (needs
                      onnxruntime-gpu);
  static_decode       the gpt2-gen-gpu recipe: static-cache decode eager vs captured, tokens identical, TPOT of
                      each, and kernels / host launches per task from CUPTI (a graph replay is one launch).
Writes OUT/summary.json and prints one line per check.

    python scripts/gpu_decisive.py OUT [--recipe-timeout 240]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def replay_stream() -> dict[str, Any]:
    import torch

    a = torch.randn(4096, 4096, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            a @ a
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = a @ a
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    timed = torch.cuda.Stream()

    def measure(on_timed_stream: bool) -> float:
        torch.cuda.synchronize()
        start.record(timed)
        if on_timed_stream:
            with torch.cuda.stream(timed):
                graph.replay()
        else:
            graph.replay()  # the defect: replays on the current stream, not the one the events are on
        end.record(timed)
        timed.synchronize()
        return float(start.elapsed_time(end))

    right, wrong = measure(True), measure(False)
    torch.cuda.synchronize()
    ok = right > 0.2 and bool(torch.isfinite(out).all())
    return {"ok": ok, "gpu_ms_replay_on_timed_stream": right, "gpu_ms_replay_elsewhere": wrong}


def second_feed() -> dict[str, Any]:
    import numpy as np
    import torch

    from optimizer.runtime.runners.torch_runner import TorchSession

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64).cuda().eval()

    class Wrap(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            return [lin(x)]

    session = TorchSession(Wrap(), ["y"], ["x"], 1, device="cuda", cuda_graph=True)
    rng = np.random.default_rng(0)
    feeds = [rng.normal(size=(4, 64)).astype(np.float32) for _ in range(2)]
    prepared = [session.prepare({"x": f}) for f in feeds]
    worst = 0.0
    for f, p in zip(feeds, prepared, strict=True):
        got = session.to_numpy(session.run(p))[0]
        with torch.inference_mode():
            want = lin(torch.from_numpy(f).cuda()).cpu().numpy()
        worst = max(worst, float(np.abs(got - want).max()))
    return {"ok": worst < 1e-3, "max_abs_error": worst, "graphs": len(session._graphs)}


def ort_stream() -> dict[str, Any]:
    from optimizer.runtime.gpu import ort_cuda_reason

    reason = ort_cuda_reason()
    if reason:
        return {"ok": None, "skip": reason}
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from optimizer.runtime.runners.ort_runner import OrtCudaSession
    from optimizer.runtime.sessions import check_providers, providers_for

    w = numpy_helper.from_array(np.random.default_rng(0).random((2048, 2048)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2048, 2048])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2048, 2048])],
        [w],
    )
    path = Path("/tmp/gpu_check_mm.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    session = ort.InferenceSession(str(path), providers=providers_for({}, "cuda"))
    check_providers(session, "cuda", path)
    s = OrtCudaSession(session, {}, 1)
    p = s.prepare({"x": np.ones((2048, 2048), np.float32)})
    for _ in range(3):
        s.run(p)
    ms = [(s.run(p), s.last_device_ms())[1] for _ in range(5)]
    return {"ok": min(ms) > 0.05, "gpu_ms": ms, "providers": session.get_providers()}


def static_decode(out: Path, timeout: int) -> dict[str, Any]:
    run = out / "gpt2-gen-gpu"
    cmd = [sys.executable, "-m", "optimizer.cli.app", "compile", "recipes/gpt2-gen-gpu.yaml", "--out", str(run),
           "--no-history"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"compile did not finish in {timeout} s"}
    (out / "gpt2-gen-gpu.txt").write_text(proc.stdout + proc.stderr)
    report_path = run / "report.json"
    if not report_path.is_file():
        return {"ok": False, "error": (proc.stderr or proc.stdout)[-800:]}
    report = json.loads(report_path.read_text())
    rows: dict[str, Any] = {}
    for st in report["stages"]:
        m = st.get("metrics") or {}
        for scen, sm in (m.get("scenarios") or {}).items():
            rows.setdefault(st["name"], {})[scen] = {
                "tpot_p50_ms": (sm.get("tpot") or {}).get("p50_ms"),
                "ttft_p50_ms": (sm.get("ttft") or {}).get("p50_ms"),
                "vs_parent": (sm.get("vs_parent") or {}).get("ratio"),
                "kernels/launches": (sm.get("cuda_kernels") or {}).get("kernels"),
                "launches": (sm.get("cuda_kernels") or {}).get("launches"),
            }
        rows.setdefault(st["name"], {})["status"] = st["status"]
        rows[st["name"]]["agreement"] = next(iter((m.get("accuracy") or {}).values()), {}).get("token_agreement")
    graph = rows.get("cuda_graph", {})
    ok = graph.get("status") in ("ran", "cached") and graph.get("agreement") == 1.0
    return {"ok": ok, "stages": rows, "outcome": report["outcome"], "findings": report["findings"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--recipe-timeout", type=int, default=240)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from optimizer.runtime.gpu import cuda_reason

    summary: dict[str, Any] = {}
    checks = [("replay_stream", replay_stream), ("second_feed", second_feed), ("ort_stream", ort_stream)]
    checks.append(("static_decode", lambda: static_decode(args.out, args.recipe_timeout)))
    for name, fn in checks:
        start = time.perf_counter()
        if cuda_reason():
            result: dict[str, Any] = {"ok": None, "skip": cuda_reason()}
        else:
            try:
                result = fn()
            except Exception as e:  # a check that crashes is a failed check, with its error, not a lost run
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result["seconds"] = round(time.perf_counter() - start, 1)
        summary[name] = result
        word = "SKIP" if result["ok"] is None else "PASS" if result["ok"] else "FAIL"
        print(f"{word} {name}: {json.dumps({k: v for k, v in result.items() if k != 'stages'})[:400]}", flush=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
