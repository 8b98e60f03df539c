"""OpenVINO runner (CPU): an IR compiled with the artifact's runtime options (runtime.ov_engine), one infer
request per session. `run` is one synchronous inference on inputs shared with OpenVINO (no copy in the timed call);
outputs are copied out in `to_numpy`, untimed, as for the other runtimes.

With `ov_static_shapes` the session also compiles the IR reshaped to each new input shape it is fed (untimed, in
`prepare`), as a fixed-shape deployment does, up to MAX_STATIC_SHAPES shapes; feeds of further shapes run on the
dynamic-shape model, and `static_shapes()` says which ran how."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.errors import OptimizerError
from optimizer.runtime.runners.base import Runner, Session
from optimizer.runtime.threads import target_threads

MAX_STATIC_SHAPES = 8  # a fixed-shape deployment compiles a few shapes; beyond that the dynamic model runs


@dataclass
class OvFeed:
    """A prepared feed: the infer request of the compiled model that runs it, and its inputs by port index."""

    request: Any
    inputs: dict[int, np.ndarray]


class OvSession(Session):
    def __init__(self, compiled: Any, runtime: dict[str, Any], threads: int, model_path: Path | str | None = None,
                 profile: bool = False) -> None:
        self.compiled = compiled
        self.runtime = runtime
        self.threads = threads
        self.request = compiled.create_infer_request()
        self.input_names = [p.get_any_name() for p in compiled.inputs]
        self.output_names = [p.get_any_name() for p in compiled.outputs]
        self.static = bool(runtime.get("ov_static_shapes"))
        if self.static and model_path is None:
            raise OptimizerError("ov_static_shapes: the session needs the IR's path to reshape it")
        self.model_path = model_path
        self.profile = profile
        self._static_requests: dict[tuple[tuple[int, ...], ...], Any] = {}
        self.dynamic_shapes: set[tuple[tuple[int, ...], ...]] = set()

    def feed_names(self, feed: dict[str, np.ndarray]) -> list[str]:
        """Per input port, the feed's name for it: a port may be named after a node fused into it (an FP16
        graph's input Cast) but keeps every name its tensor had."""
        names = [next((n for n in sorted(p.get_names()) if n in feed), None) for p in self.compiled.inputs]
        missing = [p.get_any_name() for p, n in zip(self.compiled.inputs, names, strict=True) if n is None]
        if missing:
            raise OptimizerError(f"inputs: the OpenVINO model needs {missing} but the recipe gives {sorted(feed)}")
        return names  # type: ignore[return-value]

    def prepare(self, feed: dict[str, np.ndarray]) -> OvFeed:
        inputs = {i: np.ascontiguousarray(feed[n]) for i, n in enumerate(self.feed_names(feed))}
        return OvFeed(self._request_for(inputs), inputs)

    def _request_for(self, inputs: dict[int, np.ndarray]) -> Any:
        """The infer request for these inputs' shapes: a static-shape compile of the IR when the session has
        `ov_static_shapes` and room for another shape, else the dynamic-shape model's."""
        if not self.static:
            return self.request
        key = tuple(tuple(int(d) for d in inputs[i].shape) for i in range(len(inputs)))
        if key in self._static_requests:
            return self._static_requests[key]
        if len(self._static_requests) >= MAX_STATIC_SHAPES:
            self.dynamic_shapes.add(key)
            return self.request
        from optimizer.runtime.ov_engine import compile_model, core

        model = core().read_model(str(self.model_path))
        model.reshape({port: list(shape) for port, shape in zip(model.inputs, key, strict=True)})
        compiled = compile_model(model, self.runtime, self.threads, self.profile)
        self._static_requests[key] = compiled.create_infer_request()
        return self._static_requests[key]

    def static_shapes(self) -> dict[str, Any]:
        """The input shapes that ran on a static-shape compile, and those that ran on the dynamic model."""
        return {"static": [list(map(list, k)) for k in self._static_requests],
                "dynamic": [list(map(list, k)) for k in sorted(self.dynamic_shapes)]}

    def _static_summary(self) -> str:
        shapes = self.static_shapes()
        return (f"compiled per input shape, up to {MAX_STATIC_SHAPES} shapes: {len(shapes['static'])} static, "
                f"{len(shapes['dynamic'])} more shapes ran the dynamic model")

    def run(self, prepared: OvFeed) -> Any:
        return prepared.request.infer(prepared.inputs, share_inputs=True, share_outputs=True)

    def to_numpy(self, outputs: Any) -> list[np.ndarray]:
        # by index: a static-shape compile has ports of its own, in the IR's order
        return [np.array(outputs[i]) for i in range(len(self.compiled.outputs))]

    def describe(self) -> dict[str, Any]:
        from optimizer.runtime.ov_engine import capabilities, openvino_module, precision_ran

        ov = openvino_module()

        precision = precision_ran(self.compiled, self.runtime.get("ov_precision", "default"), capabilities())
        return {
            "runtime": "openvino",
            "openvino": ov.__version__,
            "device": "CPU",
            "precision": precision,
            "performance_hint": str(self.compiled.get_property("PERFORMANCE_HINT")),
            "streams": int(self.compiled.get_property("NUM_STREAMS")),
            "threads": int(self.compiled.get_property("INFERENCE_NUM_THREADS")),
            **({"static_shapes": self._static_summary()} if self.static else {}),
        }


class OvRunner(Runner):
    def _open(self) -> Session:
        from optimizer.runtime.ov_engine import compile_model, openvino_reason

        reason = openvino_reason()
        if reason is not None:
            raise OptimizerError(f"{self.artifact.path}: {reason}")
        if self.target_device != "cpu":
            raise OptimizerError(f"{self.artifact.path}: OpenVINO stages run on the CPU here (target.device: cpu)")
        threads = target_threads(self.recipe)
        return OvSession(compile_model(self.artifact.path, self.artifact.runtime, threads), self.artifact.runtime,
                         threads, model_path=self.artifact.path)


def ov_profile(artifact: Any, recipe: Any, feeds: list[dict[str, np.ndarray]], runs: int = 10) -> list[Any]:
    """Per feed, OpenVINO's performance counters as a RunProfile (ms per layer type per inference, median over
    `runs` after one warm-up; layers executed): a separate compiled model with PERF_COUNT on, so the counters'
    overhead never touches the timed sessions."""
    from optimizer.runtime.ov_engine import compile_model, op_times
    from optimizer.runtime.runners.ort_runner import RunProfile

    compiled = compile_model(artifact.path, artifact.runtime, target_threads(recipe), profile=True)
    session = OvSession(compiled, artifact.runtime, target_threads(recipe), model_path=artifact.path, profile=True)
    out = []
    for feed in feeds:
        prepared = session.prepare(feed)
        request, inputs = prepared.request, prepared.inputs
        request.infer(inputs)
        per_run, executed = [], []
        for _ in range(runs):
            request.infer(inputs)
            ops, count = op_times(request)
            per_run.append(ops)
            executed.append(count)
        keys = {k for run in per_run for k in run}
        medians = {k: float(np.median([run.get(k, 0.0) for run in per_run])) for k in keys}
        ops = dict(sorted(medians.items(), key=lambda kv: (-kv[1], kv[0])))
        out.append(RunProfile(ops=ops, kernels=round(float(np.median(executed)))))
    return out
