"""The GPU check's three questions, each answered with figures in one OUT/summary.json (scripts/gpu_check.sh).

  decode        (a) a GPT-2-style decoder (from a config, random weights) at batch 1: the static-cache decode
                step replayed as a CUDA graph vs the same step run eagerly. Whole generations interleaved in
                rounds (ABBA, as the project's harness times stages); TPOT ratio eager/graph as a ratio of
                medians with a 95% bootstrap interval over rounds; tokens identical on both sides, and the eager
                side's agreement with transformers' generate() (at least 0.9, the recipes' floor).
  timing_labels (b) per runtime that ran (PyTorch eager, PyTorch captured, ORT CUDA EP with and without its
                graph, TensorRT with and without a graph), the runner's own numbers for one forward: its CUDA-event
                span, the host time of `run`, and the kernel busy time (CUPTI kernel durations summed, through
                torch.profiler as optimizer/runtime/gpu/kernels.py collects them), with copies apart, so what the
                report calls "GPU time" can be checked against what it is.
  replay_010    (c) every captured graph (PyTorch forward, the static-cache decode step, ORT's, TensorRT's) fed
                three calls in the order 0, 1, 0 of one shape: each call must equal the eager result of its feed.

Every field of summary.json is always present: a figure, or the string "not run: <reason>" (no GPU, no such
runtime, --quick, a check that failed before measuring it, the time limit). The file is rewritten after each
check, so a run stopped by the time limit still leaves every field. Only the standard library is imported at
module level: the skeleton is written even where torch or numpy are missing.

    python scripts/gpu_decisive.py OUT [--quick | --dry-run] [--budget SECONDS]
    python scripts/gpu_decisive.py OUT --record-tests FILE RC   (gpu_check.sh: the gpu-marked tests' last line)

--budget: seconds the checks may start work in (gpu_check.sh: 170 full, 85 quick); past it, "not run: ..."

--dry-run: tiny sizes, every code path once, figures that are not evidence (the script's own test). The
environment variable GPU_CHECK_INJECT=module:function names a function called before the checks that replaces
the device pieces (tests/test_gpu_check.py: fake CUDA events, streams and graphs on the CPU); it returns a
description of what it replaced, which summary.json records as device.fake_device.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "gpu_check/1"
RUNTIMES = ("pytorch_eager", "pytorch_captured", "ort_cuda", "ort_cuda_captured", "tensorrt", "tensorrt_captured")
GRAPHS = ("pytorch_forward", "static_decode", "ort_cuda_graph", "tensorrt_graph")
KERNELS = ("kernels", "launches", "graph_launches", "kernel_busy_ms", "copy_ms")
LIMIT_FILES, LIMIT_BYTES = 4, 256 * 1024  # what comes back from the GPU machine: summary.json + 3 small files


def template() -> dict[str, Any]:
    """Every field of summary.json; None = not filled yet (written as "not run: <the section's reason>")."""
    timing = ("status", "calls", "event_span_ms", "host_ms", "kernel_busy_ms", "copy_ms", "kernels_per_call",
              "launches_per_call", "graph_launches_per_call", "span_over_host", "busy_over_span", "consistent",
              "reading")
    replay = ("status", "agree_0_1_0", "max_abs_error_0_1_0", "tolerance")
    return {
        "schema": SCHEMA,
        "mode": None,
        "verdict": None,
        "seconds": None,
        "device": dict.fromkeys(("gpu", "compute_capability", "memory_gb", "torch", "cuda", "transformers",
                                 "onnxruntime", "ort_cuda_ep", "tensorrt", "fake_device")),
        "decode": {
            **dict.fromkeys(("status", "model", "batch", "prompt_tokens", "new_tokens", "rounds",
                             "generations_per_side", "tpot_eager_p50_ms", "tpot_graph_p50_ms", "tpot_ratio",
                             "tpot_ratio_low", "tpot_ratio_high", "tpot_ratio_interval", "tpot_verdict",
                             "ttft_eager_p50_ms", "ttft_graph_p50_ms", "tokens_identical", "tokens_compared",
                             "distinct_tokens", "hf_generate_agreement", "graphs_captured")),
            "profile_eager": dict.fromkeys(KERNELS),
            "profile_graph": dict.fromkeys(KERNELS),
        },
        "timing_labels": {"model": None, **{r: dict.fromkeys(timing) for r in RUNTIMES}},
        "replay_010": {g: dict.fromkeys(replay) for g in GRAPHS},
        "gpu_tests": None,
    }


def not_run(reason: str) -> str:
    return reason if reason.startswith("not run: ") else f"not run: {reason}"


def fill(node: Any, reason: str) -> Any:
    """node with every None leaf replaced by "not run: reason"."""
    if isinstance(node, dict):
        return {k: fill(v, reason) for k, v in node.items()}
    return not_run(reason) if node is None else node


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": value} for every leaf (tests and the verdict read them)."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(leaves(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: node}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


@dataclass
class Ctx:
    out: Path
    mode: str  # full | quick | dry-run
    deadline: float
    device: str = "cuda"
    fake: str | None = None  # what GPU_CHECK_INJECT replaced, if anything
    closers: list[Any] = field(default_factory=list)  # runner contexts to leave at the end
    trt_engine: Any = None

    @property
    def tiny(self) -> bool:
        return self.mode == "dry-run"

    def left(self) -> float:
        return self.deadline - time.monotonic()


class Summary:
    """summary.json, rewritten whole after every change: each section's unfilled fields say why they are empty."""

    def __init__(self, out: Path, mode: str) -> None:
        self.path = out / "summary.json"
        self.data = template()
        self.data["mode"] = mode
        self.pending = {k: "did not finish: the run stopped before this check (time limit?)" for k in self.data}
        self.start = time.monotonic()

    def section(self, name: str) -> dict[str, Any]:
        return self.data[name]

    def write(self) -> None:
        data = {k: fill(v, self.pending.get(k, "not measured")) for k, v in self.data.items()}
        data["seconds"] = round(time.monotonic() - self.start, 1)
        if self.data["verdict"] is None:
            data["verdict"] = verdict(data)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
        tmp.replace(self.path)  # atomic: a run killed mid-write leaves the previous summary, never half of one

    def say(self, line: str) -> None:
        print(line, flush=True)


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def verdict(data: dict[str, Any]) -> str:
    """"pass" only when every row ran and passed (the gpu-marked tests included); "pass for what ran (...); not run:
    <rows> (<why>)" when some did not run: a verdict never covers a row that did not run. "fail: <rows>" when
    something that ran failed; "not run: <why>" when nothing ran."""
    statuses = {k.removesuffix(".status"): v for k, v in leaves(data).items() if k.endswith("status")}
    if "gpu_tests" in data:
        statuses["gpu_tests"] = data["gpu_tests"]
    failed = [k for k, v in statuses.items() if isinstance(v, str) and v.startswith("fail")]
    if failed:
        return "fail: " + ", ".join(failed)
    passed = [k for k, v in statuses.items() if v == "pass" or (k == "gpu_tests" and _tests_ran(v))]
    if not any(v == "pass" for v in statuses.values()):
        return not_run(str(data["decode"]["status"]).removeprefix("not run: "))
    skipped: dict[str, list[str]] = {}
    for k, v in statuses.items():
        if k not in passed:
            skipped.setdefault(str(v).removeprefix("not run: "), []).append(k)
    if not skipped:
        return "pass"
    why = "; ".join(f"{', '.join(keys)} ({reason})" for reason, keys in skipped.items())
    return f"pass for what ran ({', '.join(passed)}); not run: {why}"


def _tests_ran(value: Any) -> bool:
    """gpu_tests holds pytest's last line when they ran (a failure is "fail: ...", a skip "not run: ...")."""
    return isinstance(value, str) and not value.startswith(("fail", "not run")) and value != ""


# The GPU machine this project can borrow (docs/gpu.md): what it has decides which rows can run there at all.
GPU_MACHINE = {
    "torch": "PyTorch 2.11 (CUDA 13)",
    "onnxruntime": "onnxruntime 1.30, CPU only",
    "absent": "no TensorRT, Polygraphy or onnxruntime-gpu; only small wheels (tens of MB in all) can be carried "
              "there, which onnxruntime-gpu (~300 MB) and TensorRT (> 1 GB) exceed",
}
_NO_ORT_CUDA = ("the GPU machine has onnxruntime 1.30 for the CPU only (onnxruntime-gpu, ~300 MB, cannot be "
                "carried there)")
_NO_TRT = "the GPU machine has no TensorRT or Polygraphy (TensorRT, > 1 GB, cannot be carried there)"


def gpu_machine_plan() -> dict[str, str]:
    """Row -> "runs" or "not run: <why>", on the borrowed GPU machine (GPU_MACHINE): only the PyTorch CUDA rows."""
    plan = {"decode": "runs", "replay_010.static_decode": "runs", "replay_010.pytorch_forward": "runs",
            "timing_labels.pytorch_eager": "runs", "timing_labels.pytorch_captured": "runs"}
    for key in ("timing_labels.ort_cuda", "timing_labels.ort_cuda_captured", "replay_010.ort_cuda_graph"):
        plan[key] = not_run(_NO_ORT_CUDA)
    for key in ("timing_labels.tensorrt", "timing_labels.tensorrt_captured", "replay_010.tensorrt_graph"):
        plan[key] = not_run(_NO_TRT)
    plan["gpu_tests"] = ("runs (full mode only): the PyTorch CUDA tests; those of ORT's CUDA EP and TensorRT skip "
                         "there, each with its reason")
    return plan


def print_plan(s: Summary) -> None:
    s.say(f"on the GPU machine ({GPU_MACHINE['torch']}; {GPU_MACHINE['onnxruntime']}; {GPU_MACHINE['absent']}):")
    for key, value in gpu_machine_plan().items():
        shown = "would run" + value.removeprefix("runs") if value.startswith("runs") else value
        s.say(f"  {key:34} {shown}")


# ---------------------------------------------------------------------------------------------------- statistics
def ratio_with_interval(
    slow_rounds: list[list[float]], fast_rounds: list[list[float]], confidence: float = 0.95, resamples: int = 2000
) -> tuple[float, float, float]:
    """slow/fast as the ratio of the medians of all values, with a bootstrap-over-rounds interval of the median
    per-round ratio (the harness's measure.stats.speedup, here without scipy and pydantic, which the GPU machine
    lacks): rounds alternate the two sides, so drift hits both sides of a round alike."""
    import numpy as np

    ratio = float(np.median(np.concatenate(slow_rounds)) / np.median(np.concatenate(fast_rounds)))
    per_round = np.array([np.median(s) for s in slow_rounds]) / np.array([np.median(f) for f in fast_rounds])
    rng = np.random.default_rng(0)
    boot = np.median(per_round[rng.integers(0, len(per_round), size=(resamples, len(per_round)))], axis=1)
    alpha = (1 - confidence) / 2
    low, high = (float(x) for x in np.quantile(boot, [alpha, 1 - alpha]))
    return ratio, min(low, ratio), max(high, ratio)


def kernel_profile(fn: Callable[[], Any], calls: int) -> dict[str, Any]:
    """Per call of fn: kernels, host launches (a graph launch counts one), graph launches, kernel busy ms (the
    kernels' CUPTI durations summed: device time with the launch gaps left out) and copy ms (memcpy/memset),
    from the trace optimizer/runtime/gpu/kernels.py collects."""
    from optimizer.runtime.gpu import kernels

    events = kernels.trace_events(fn, calls, cuda=True)
    counts = kernels.count_trace_events(events, calls)
    if counts["kernels"] == 0:
        raise RuntimeError("the CUDA profiler recorded no kernels (CUPTI tracing unavailable?)")
    busy = sum(float(ev.get("dur", 0)) for ev in events if ev.get("cat") == "kernel") / 1000 / calls
    copies = sum(float(ev.get("dur", 0)) for ev in events if ev.get("cat") in ("gpu_memcpy", "gpu_memset"))
    return {
        "kernels": counts["kernels"],
        "launches": counts["launches"],
        "graph_launches": counts["graph_launches"],
        "kernel_busy_ms": busy,
        "copy_ms": copies / 1000 / calls,
    }


# ---------------------------------------------------------------------------------------------------- models
def decoder(ctx: Ctx) -> tuple[Any, str]:
    """A GPT-2-style causal LM from a config (nothing to download), SDPA attention, fp32, on the device."""
    import torch
    import transformers

    size = (dict(n_layer=2, n_embd=64, n_head=4, vocab_size=500) if ctx.tiny
            else dict(n_layer=6, n_embd=384, n_head=6, vocab_size=8000))
    config = transformers.GPT2Config(n_positions=1024, bos_token_id=0, eos_token_id=0, initializer_range=0.1,
                                     **size)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    desc = (f"gpt2 from config: {size['n_layer']} layers, {size['n_embd']} wide, vocab {size['vocab_size']}, "
            "sdpa, fp32, random weights (initializer_range 0.1)")
    return model.to(ctx.device).eval(), desc


def static_generators(ctx: Ctx, model: Any) -> tuple[Any, Any]:
    """(eager, captured) StaticCacheGenerators over one model."""
    from optimizer.runtime.generation_static import StaticCacheGenerator

    eager = StaticCacheGenerator(model, 1, ctx.device, cuda_graph=False)
    graph = StaticCacheGenerator(model, 1, ctx.device, cuda_graph=ctx.device == "cuda")
    if ctx.fake:
        graph.cuda_graph = True  # fake device on the CPU: capture with the injected CUDAGraph
    return eager, graph


def mlp(ctx: Ctx) -> tuple[Any, dict[str, Any], str]:
    """A small MLP (Linear + ReLU blocks): a few dozen short kernels per call at this size, so launch gaps are a
    visible share of the event span. Its weights also make the ONNX graph ORT and TensorRT run."""
    import torch

    width, layers, batch = (64, 2, 4) if ctx.tiny else (1024, 6, 32)
    torch.manual_seed(0)
    linears = [torch.nn.Linear(width, width) for _ in range(layers)]

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(linears)

        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            for lin in self.layers:
                x = torch.relu(lin(x))
            return [x]

    desc = f"MLP: {layers} x (Linear {width}x{width} + ReLU), batch {batch}, fp32"
    return MLP().to(ctx.device).eval(), {"width": width, "batch": batch, "linears": linears}, desc


def mlp_onnx(path: Path, shape: dict[str, Any]) -> Path:
    """The MLP as an ONNX graph (Gemm transB=1 + Relu per layer), same weights, static shapes."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, x = [], [], "x"
    for i, lin in enumerate(shape["linears"]):
        inits += [numpy_helper.from_array(lin.weight.detach().cpu().numpy(), f"w{i}"),
                  numpy_helper.from_array(lin.bias.detach().cpu().numpy(), f"b{i}")]
        nodes += [helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [f"g{i}"], transB=1),
                  helper.make_node("Relu", [f"g{i}"], [y := f"r{i}"])]
        x = y
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    dims = [shape["batch"], shape["width"]]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def mlp_feeds(shape: dict[str, Any]) -> list[dict[str, Any]]:
    import numpy as np

    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(shape["batch"], shape["width"])).astype(np.float32)} for _ in range(2)]


# ---------------------------------------------------------------------------------------------------- sessions
def _recipe(threads: int = 1) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(target=SimpleNamespace(threads=threads, device="cuda"))


def ort_session(ctx: Ctx, onnx_path: Path, captured: bool) -> Any:
    """An OrtCudaSession opened by the project's OrtRunner (its own stream, IO binding; the graph if asked)."""
    from optimizer.core.artifact import Artifact
    from optimizer.runtime.runners.ort_runner import OrtRunner

    artifact = Artifact("onnx", onnx_path, runtime={"cuda_graph": captured}, input_names=["x"], output_names=["y"])
    loader = OrtRunner(artifact, _recipe(), device="cuda").load()
    session = loader.__enter__()
    ctx.closers.append(loader)
    return session


def trt_session(ctx: Ctx, onnx_path: Path, captured: bool) -> Any:
    """A TrtSession over an engine built here from the ONNX graph (TensorRT's own builder: static shapes, no
    profile; FP32 layers at TensorRT's defaults)."""
    import tensorrt as trt

    from optimizer.runtime.runners.trt_runner import TrtSession

    engine = ctx.trt_engine
    if engine is None:
        logger = trt.Logger(trt.Logger.ERROR)
        builder = trt.Builder(logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse(onnx_path.read_bytes()):
            raise RuntimeError("TensorRT cannot parse the ONNX graph: " + str(parser.get_error(0)))
        plan = builder.build_serialized_network(network, builder.create_builder_config())
        if plan is None:
            raise RuntimeError("TensorRT built no engine")
        engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
        ctx.trt_engine = engine
    return TrtSession(engine, {"cuda_graph": captured})


def torch_session(ctx: Ctx, module: Any, captured: bool) -> Any:
    from optimizer.runtime.runners.torch_runner import TorchSession

    session = TorchSession(module, ["y"], ["x"], 1, device=ctx.device, cuda_graph=captured)
    if ctx.fake:
        session.device_time = True  # fake device on the CPU: time with the injected CUDA events
    return session


def span_ms(session: Any) -> float:
    """The runner's own event span of its last run (whatever it names it)."""
    for name in ("last_span_ms", "last_event_span_ms", "last_device_ms"):
        if hasattr(session, name):
            return float(getattr(session, name)())
    raise RuntimeError(f"{type(session).__name__} reports no event span")


# ---------------------------------------------------------------------------------------------------- (c) 0,1,0
def replay_forward(session: Any, reference: Any, feeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Calls 0, 1, 0 of one shape through a captured session; each compared with its feed's eager result."""
    import numpy as np

    wants = [np.asarray(reference({k: v.copy() for k, v in f.items()}), np.float64) for f in feeds]
    prepared = [session.prepare({k: v.copy() for k, v in f.items()}) for f in feeds]  # copies: a CPU tensor
    errors, agree = [], []  # shares its array, and a wrong replay could overwrite it (the fake device)
    for i in (0, 1, 0):
        got = np.asarray(session.to_numpy(session.run(prepared[i]))[0], np.float64)
        want = wants[i]
        tol = 1e-3 * max(1.0, float(np.abs(want).max()))
        errors.append(float(np.abs(got - want).max()))
        agree.append(errors[-1] <= tol)
    return {"status": "pass" if all(agree) else "fail: a call's output is not its own feed's eager output",
            "agree_0_1_0": agree, "max_abs_error_0_1_0": errors, "tolerance": "1e-3 x max(1, |eager|max)"}


def replay_decode(eager: Any, graph: Any, prompts: list[Any], new: int) -> dict[str, Any]:
    """Three generations through the captured decode step, prompts 0, 1, 0 (one shape): tokens and logits equal
    the eager step's."""
    import numpy as np

    agree, errors = [], []
    for i in (0, 1, 0):
        a, b = eager.generate(prompts[i], new), graph.generate(prompts[i], new)
        agree.append(bool(np.array_equal(a.tokens, b.tokens)))
        errors.append(max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())
                          for x, y in zip(a.step_logits, b.step_logits, strict=True)))
    ok = all(agree) and graph.captures == 1
    why = "tokens differ from eager" if not all(agree) else f"{graph.captures} graphs captured for one shape"
    return {"status": "pass" if ok else f"fail: {why}", "agree_0_1_0": agree, "max_abs_error_0_1_0": errors,
            "tolerance": "tokens identical (errors: logits)"}


# ---------------------------------------------------------------------------------------------------- (a) decode
def decode_timing(ctx: Ctx, eager: Any, graph: Any, prompts: list[Any], new: int, sec: dict[str, Any]) -> None:
    """Whole generations, ABBA rounds, each side `iterations` generations a round over the same prompts."""
    import numpy as np

    quick = ctx.mode == "quick"
    min_rounds, max_rounds, iterations = (3, 3, 1) if ctx.tiny else (6, 10, 2) if quick else (8, 16, 2)
    cap = time.monotonic() + min(ctx.left() * 0.4, 25 if quick else 45)
    sides = {"eager": eager, "graph": graph}
    for gen in sides.values():  # warm-up (the graph side captures here if it has not yet)
        gen.generate(prompts[0], new, keep_logits=False)
    runs: dict[str, list[list[Any]]] = {"eager": [], "graph": []}
    r = 0
    while r < min_rounds or (r < max_rounds and time.monotonic() < cap):
        for name in ("eager", "graph") if r % 2 == 0 else ("graph", "eager"):
            runs[name].append([sides[name].generate(prompts[(r * iterations + i) % len(prompts)], new,
                                                    keep_logits=False) for i in range(iterations)])
        r += 1
    tpot = {k: [[float(np.median(g.tpot_ms)) for g in rnd] for rnd in v] for k, v in runs.items()}
    ratio, low, high = ratio_with_interval(tpot["eager"], tpot["graph"])
    pairs = [(a.tokens, b.tokens) for ra, rb in zip(runs["eager"], runs["graph"], strict=True)
             for a, b in zip(ra, rb, strict=True)]
    sec.update(
        rounds=r,
        generations_per_side=r * iterations,
        tpot_eager_p50_ms=float(np.median([t for rnd in runs["eager"] for g in rnd for t in g.tpot_ms])),
        tpot_graph_p50_ms=float(np.median([t for rnd in runs["graph"] for g in rnd for t in g.tpot_ms])),
        tpot_ratio=ratio,
        tpot_ratio_low=low,
        tpot_ratio_high=high,
        tpot_ratio_interval="eager/graph TPOT, ratio of medians of per-generation median TPOT; 95% bootstrap "
        "over interleaved (ABBA) rounds of the per-round ratio; > 1: the graph is faster",
        tpot_verdict="graph faster" if low > 1 else "graph slower" if high < 1 else "within noise",
        ttft_eager_p50_ms=float(np.median([g.ttft_ms for rnd in runs["eager"] for g in rnd])),
        ttft_graph_p50_ms=float(np.median([g.ttft_ms for rnd in runs["graph"] for g in rnd])),
        tokens_identical=all(bool(np.array_equal(a, b)) for a, b in pairs),
        tokens_compared=int(sum(a.size for a, _ in pairs)),
        distinct_tokens=int(len(np.unique(np.concatenate([a.ravel() for a, _ in pairs])))),
    )


HF_AGREEMENT_MIN = 0.9  # the recipes' token_agreement floor: fp32 kernels that differ (SDPA with a 4-D mask vs
# generate's own) may flip a near-tie late in a random-weight model; a wrong cache diverges at once (35% on 5.17)


def hf_generate_agreement(model: Any, eager: Any, prompt: Any, new: int) -> float:
    """The share of the eager static-cache tokens that equal transformers' greedy generate() (no early stop at
    EOS), position by position: greedy decoding diverges for good at the first difference."""
    import torch

    ids = torch.from_numpy(prompt).to(next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0)
    want, got = out[:, prompt.shape[1]:].cpu().numpy(), eager.generate(prompt, new).tokens
    return float((want == got).mean()) if want.shape == got.shape else 0.0


def check_decode(ctx: Ctx, s: Summary, state: dict[str, Any]) -> None:
    import numpy as np

    sec = s.section("decode")
    model, desc = decoder(ctx)
    prompt_len, new = (16, 8) if ctx.tiny else (128, 32 if ctx.mode == "quick" else 64)
    sec.update(model=desc, batch=1, prompt_tokens=prompt_len, new_tokens=new)
    rng = np.random.default_rng(0)
    vocab = int(model.config.vocab_size)
    prompts = [rng.integers(1, vocab, size=(1, prompt_len)).astype(np.int64) for _ in range(4)]
    eager, graph = static_generators(ctx, model)
    state.update(model=model, eager=eager, graph=graph, prompts=prompts, new=new)

    # (c) first: the decisive correctness check, and it captures the shape the timing replays
    s.pending["replay_010"] = "did not finish: stopped in the static-cache decode check"
    rep = s.section("replay_010")["static_decode"]
    try:
        rep.update(replay_decode(eager, graph, prompts, new))
    except Exception as e:
        rep["status"] = f"fail: {_first_line(e)}"
        traceback.print_exc()
    s.write()

    decode_timing(ctx, eager, graph, prompts, new, sec)
    sec["graphs_captured"] = graph.captures
    sec["hf_generate_agreement"] = hf_generate_agreement(model, eager, prompts[1], new)
    s.write()
    if ctx.mode == "quick":
        for side in ("profile_eager", "profile_graph"):
            sec[side] = fill(sec[side], "--quick (kernel profiles are part of the full run)")
    else:
        for side, gen in (("profile_eager", eager), ("profile_graph", graph)):
            try:
                prof = kernel_profile(lambda g=gen: g.generate(prompts[0], new, keep_logits=False), 1)
                sec[side].update(prof)
            except Exception as e:
                sec[side] = fill(sec[side], f"the kernel profile failed: {_first_line(e)}")
    agreement = sec["hf_generate_agreement"] >= HF_AGREEMENT_MIN
    ok = sec["tokens_identical"] and agreement and graph.captures == 1
    why = ("captured tokens differ from eager" if not sec["tokens_identical"]
           else f"eager static-cache tokens agree with generate() below {HF_AGREEMENT_MIN}" if not agreement
           else f"{graph.captures} graphs captured for one shape")
    sec["status"] = "pass" if ok else f"fail: {why}"


# ---------------------------------------------------------------------------------------------------- (b), (c)
def measure_labels(session: Any, prepared: Any, calls: int, profiled: int) -> dict[str, Any]:
    """Per call: the runner's event span, host time of `run` (which waits for the device), kernel busy time."""
    import numpy as np

    for _ in range(3):
        session.run(prepared)
    spans, hosts = [], []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        session.run(prepared)
        hosts.append((time.perf_counter_ns() - t0) / 1e6)
        spans.append(span_ms(session))
    prof = kernel_profile(lambda: session.run(prepared), profiled)
    span, host, busy = float(np.median(spans)), float(np.median(hosts)), prof["kernel_busy_ms"]
    consistent = busy <= span * 1.05 + 0.02 and span <= host * 1.05 + 0.05
    if not consistent:
        reading = "inconsistent: kernel busy > event span or span > host time (events on the wrong stream?)"
    elif span >= 0.9 * host and busy < 0.5 * span:
        reading = "span ~ host time and mostly not kernels: the events bracket host work or launch gaps"
    elif busy < 0.5 * span:
        reading = "span mostly launch gaps: launch-bound (kernel busy is the device time)"
    else:
        reading = "span ~ kernel busy: the event span is device time"
    return {
        "status": "pass" if consistent else "fail: " + reading,
        "calls": calls,
        "event_span_ms": span,
        "host_ms": host,
        "kernel_busy_ms": busy,
        "copy_ms": prof["copy_ms"],
        "kernels_per_call": prof["kernels"],
        "launches_per_call": prof["launches"],
        "graph_launches_per_call": prof["graph_launches"],
        "span_over_host": span / host if host else not_run("a host time of zero"),
        "busy_over_span": busy / span if span else not_run("an event span of zero"),
        "consistent": consistent,
        "reading": reading,
    }


def check_forward(ctx: Ctx, s: Summary) -> None:
    """PyTorch eager and captured, then ORT's CUDA EP and TensorRT where present, on one MLP: (b) per runtime
    (full mode), (c) per captured graph."""
    import tempfile

    import torch

    from optimizer.runtime import gpu

    labels, replay = s.section("timing_labels"), s.section("replay_010")
    module, shape, desc = mlp(ctx)
    labels["model"] = desc
    feeds = mlp_feeds(shape)
    calls, profiled = (5, 2) if ctx.tiny else (50, 10)

    def torch_ref(feed: dict[str, Any]) -> Any:
        with torch.inference_mode():
            return module(torch.from_numpy(feed["x"]).to(ctx.device))[0].float().cpu().numpy()

    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))  # the ONNX graph: outside OUT, removed at the end
    onnx_path: Path | None = None
    ort_reason = gpu.ort_cuda_reason()
    trt_reason = gpu.tensorrt_reason()
    plan: list[tuple[str, str | None, Callable[[bool], Any], str]] = [
        ("pytorch", None, lambda c: torch_session(ctx, module, c), "pytorch_forward"),
        ("ort_cuda", ort_reason, lambda c: ort_session(ctx, onnx_path, c), "ort_cuda_graph"),
        ("tensorrt", trt_reason, lambda c: trt_session(ctx, onnx_path, c), "tensorrt_graph"),
    ]
    for runtime, reason, open_session, graph_key in plan:
        eager_key = "pytorch_eager" if runtime == "pytorch" else runtime
        keys = (eager_key, f"{runtime}_captured")
        if reason is not None:
            for key in keys:
                labels[key] = fill(labels[key], reason)
            replay[graph_key] = fill(replay[graph_key], reason)
            continue
        if ctx.left() < 15:
            for key in keys:
                labels[key] = fill(labels[key], "the time budget was spent before this runtime")
            replay[graph_key] = fill(replay[graph_key], "the time budget was spent before this runtime")
            continue
        try:
            if onnx_path is None and runtime != "pytorch":
                onnx_path = mlp_onnx(tmp / "mlp.onnx", shape)
            eager = open_session(False)
            ref = (torch_ref if runtime == "pytorch"
                   else lambda f, e=eager: e.to_numpy(e.run(e.prepare(f)))[0])
            captured = open_session(True)
            replay[graph_key].update(replay_forward(captured, ref, feeds))
            s.write()
            if ctx.mode == "quick":
                continue
            for key, session in zip(keys, (eager, captured), strict=True):
                try:
                    labels[key].update(measure_labels(session, session.prepare(feeds[0]), calls, profiled))
                except Exception as e:
                    labels[key] = fill({**labels[key], "status": f"fail: {_first_line(e)}"},
                                       f"the measurement failed: {_first_line(e)}")
                    traceback.print_exc()
                s.write()
        except Exception as e:
            traceback.print_exc()
            for node in (*(labels[k] for k in keys), replay[graph_key]):
                if node["status"] is None:
                    node["status"] = f"fail: {_first_line(e)}"
            for key in keys:
                labels[key] = fill(labels[key], f"{runtime} failed before measuring: {_first_line(e)}")
            replay[graph_key] = fill(replay[graph_key], f"{runtime} failed before measuring: {_first_line(e)}")
        s.write()
    shutil.rmtree(tmp, ignore_errors=True)
    if ctx.mode == "quick":
        s.data["timing_labels"] = fill(labels, "--quick (event span vs host vs kernel busy is the full run's)")


# ---------------------------------------------------------------------------------------------------- main
def device_facts(ctx: Ctx, s: Summary) -> str | None:
    """Fill `device`; the reason no CUDA device is usable, or None."""
    import importlib.metadata as md

    from optimizer.runtime import gpu

    dev = s.section("device")
    # onnxruntime-gpu installs the same module as onnxruntime, under its own distribution name
    for name, dists in (("torch", ["torch"]), ("transformers", ["transformers"]),
                        ("onnxruntime", ["onnxruntime-gpu", "onnxruntime"])):
        for dist in dists:
            try:
                dev[name] = f"{dist} {md.version(dist)}" if name == "onnxruntime" else md.version(dist)
                break
            except md.PackageNotFoundError:
                dev[name] = not_run(f"{dists[-1]} is not installed")
    dev["fake_device"] = ctx.fake or False
    reason = gpu.cuda_reason()
    dev["ort_cuda_ep"] = not_run(gpu.ort_cuda_reason()) if gpu.ort_cuda_reason() else "available"
    dev["tensorrt"] = not_run(gpu.tensorrt_reason()) if gpu.tensorrt_reason() else "available"
    if reason is None and not ctx.fake:
        import torch

        props = torch.cuda.get_device_properties(0)
        dev.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                   memory_gb=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    elif ctx.fake:
        for k in ("gpu", "compute_capability", "memory_gb", "cuda"):
            dev[k] = not_run(f"a fake device ({ctx.fake})")
    return reason


def run_checks(ctx: Ctx, s: Summary) -> None:
    try:
        reason = device_facts(ctx, s)
    except Exception as e:  # torch or numpy missing or broken: every device field says so
        reason = f"the device could not be read: {_first_line(e)}"
    s.data["device"] = fill(s.data["device"], reason or "unknown")
    if reason is not None:
        for k in ("decode", "timing_labels", "replay_010"):
            s.pending[k] = reason
        s.write()
        s.say(f"NOT RUN: {reason}")
        return
    state: dict[str, Any] = {}
    s.pending["timing_labels"] = "did not finish: stopped in the decode check"
    try:
        check_decode(ctx, s, state)
    except Exception as e:
        traceback.print_exc()
        s.data["decode"]["status"] = s.data["decode"]["status"] or f"fail: {_first_line(e)}"
        s.data["decode"] = fill(s.data["decode"], f"the decode check failed: {_first_line(e)}")
        rep = s.data["replay_010"]
        rep["static_decode"] = fill(rep["static_decode"], f"the decode check failed: {_first_line(e)}")
    s.pending["decode"] = "not measured"
    s.write()
    s.say(f"decode: {s.data['decode']['status']}")
    s.pending["timing_labels"] = s.pending["replay_010"] = "did not finish: stopped in the forward checks"
    try:
        check_forward(ctx, s)
    except Exception as e:
        traceback.print_exc()
        for sec in ("timing_labels", "replay_010"):
            s.data[sec] = fill(s.data[sec], f"the forward checks failed: {_first_line(e)}")
    for closer in ctx.closers:
        closer.__exit__(None, None, None)
    s.pending["timing_labels"] = s.pending["replay_010"] = "not measured"
    for k, v in leaves({"timing_labels": s.data["timing_labels"], "replay_010": s.data["replay_010"]}).items():
        if k.endswith(".status"):
            s.say(f"{k.removesuffix('.status')}: {v}")


def missing_wheels(wheels: list[Path]) -> list[Path]:
    """The wheels whose distribution this interpreter lacks (gpu_check.sh unpacks only those: a carried copy of a
    package the machine has would shadow the image's own, PYTHONPATH coming before site-packages)."""
    import importlib.metadata as md
    import re

    out = []
    for wheel in wheels:
        dist = re.sub(r"[-_.]+", "-", Path(wheel).name.split("-")[0]).lower()
        try:
            md.distribution(dist)
        except md.PackageNotFoundError:
            out.append(Path(wheel))
    return out


def record_tests(out: Path, log: Path, rc: int, reason: str | None = None) -> None:
    """gpu_check.sh: the gpu-marked tests' outcome into summary.json (their last line, or why they did not run)."""
    path = out / "summary.json"
    data = json.loads(path.read_text())
    if reason is not None:
        data["gpu_tests"] = not_run(reason)
        path.write_text(json.dumps(data, indent=1) + "\n")
        return
    text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    last = text[-1] if text else ""
    if rc == 5:  # pytest: no tests collected
        data["gpu_tests"] = not_run(f"no gpu-marked tests were collected ({last})")
    elif rc == 124:
        data["gpu_tests"] = f"fail: stopped at the time limit ({last})"
    elif rc == 0 or (text and ("passed" in last or "skipped" in last) and "failed" not in last and "error" not in last):
        data["gpu_tests"] = last or "pass"
    else:
        data["gpu_tests"] = f"fail: rc {rc}: {last}"
    if data["gpu_tests"].startswith("fail"):
        before = str(data.get("verdict", ""))
        data["verdict"] = before + ", gpu_tests" if before.startswith("fail") else "fail: gpu_tests"
    path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("out", type=Path)
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="(a) and (c) only")
    group.add_argument("--dry-run", action="store_true", help="tiny sizes: every code path once, no evidence")
    ap.add_argument("--budget", type=float, default=None, help="seconds the checks may take (then: not run)")
    ap.add_argument("--tests-skipped", default=None, help="why the gpu-marked tests do not run (gpu_check.sh)")
    ap.add_argument("--record-tests", nargs=2, metavar=("LOG", "RC"), default=None)
    ap.add_argument("--tests-not-run", default=None, metavar="REASON", help="gpu_tests: why they did not run")
    ap.add_argument("--missing-wheels", nargs="*", default=None, metavar="WHEEL",
                    help="print the wheels whose distribution is not installed here (gpu_check.sh), then exit")
    args = ap.parse_args(argv)
    if args.missing_wheels is not None:
        print("\n".join(str(w) for w in missing_wheels([Path(w) for w in args.missing_wheels])))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.record_tests or args.tests_not_run:
        log, rc = args.record_tests or ("", "0")
        record_tests(args.out, Path(log), int(rc), args.tests_not_run)
        return 0
    mode = "quick" if args.quick else "dry-run" if args.dry_run else "full"
    budget = args.budget if args.budget is not None else {"full": 170.0, "quick": 90.0, "dry-run": 90.0}[mode]
    ctx = Ctx(args.out, mode, time.monotonic() + budget)
    s = Summary(args.out, mode)
    s.data["gpu_tests"] = not_run(args.tests_skipped or "gpu_check.sh runs them after this script")
    s.write()  # the skeleton first: every field present even if what follows is killed
    inject = os.environ.get("GPU_CHECK_INJECT")
    if inject:
        module, _, fn = inject.partition(":")
        ctx.fake = str(getattr(importlib.import_module(module), fn)())
        ctx.device = "cpu"
    print_plan(s)  # what the borrowed GPU machine can run at all, and why not the rest
    run_checks(ctx, s)
    s.write()
    s.say(f"verdict: {json.loads(s.path.read_text())['verdict']}  ({s.path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
