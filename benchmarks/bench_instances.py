"""How much sessions of one artifact differ in speed: `--sessions` identical ONNX Runtime sessions of one model,
timed in turn round by round (the harness's interleaved_rounds, order flipped every round), each against the
first with a paired bootstrap interval over rounds. The reason `benchmark.instances` exists (measure.harness).

    python benchmarks/bench_instances.py MODEL.onnx [--batch 1] [--seq 128] [--rounds 40] [--sessions 4]

Inputs come from the model's own input list: integer inputs are ones of [batch, seq], float inputs random
[batch, <its last dim>] (or [batch, seq] when that dim has no size).

Question: how much sessions of one artifact differ in speed (why `benchmark.instances` is 2).
Written up in: docs/measurement.md (attribution against the parent).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimizer.measure.harness import interleaved_rounds  # noqa: E402
from optimizer.runtime.runners.base import Session  # noqa: E402


class OrtSession(Session):
    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run(self, prepared: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, prepared)

    def to_numpy(self, outputs: list[np.ndarray]) -> list[np.ndarray]:
        return outputs


def feed(session: OrtSession, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for i in session.session.get_inputs():
        if "int" in i.type:
            out[i.name] = np.ones((batch, seq), dtype=np.int64)
        else:
            last = i.shape[-1] if isinstance(i.shape[-1], int) else seq
            out[i.name] = rng.standard_normal((batch, last)).astype(np.float32)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--sessions", type=int, default=4)
    args = ap.parse_args()
    sessions = {f"session {k}": OrtSession(args.model) for k in range(args.sessions)}
    x = feed(next(iter(sessions.values())), args.batch, args.seq)
    timed = interleaved_rounds(sessions, {k: [x] for k in sessions}, args.rounds, args.iterations)
    per_round = {k: np.array([np.median(r) for r in rs]) for k, rs in timed.items()}
    first = per_round["session 0"]
    rng = np.random.default_rng(0)
    for name, rounds in per_round.items():
        log_ratio = np.log(first / rounds)  # > 0: this session is faster than session 0
        boot = np.median(log_ratio[rng.integers(0, len(log_ratio), (4000, len(log_ratio)))], axis=1)
        low, high = np.exp(np.quantile(boot, [0.025, 0.975]))
        print(f"{name}: P50 {np.median(rounds):.3f} ms, speed vs session 0 {np.exp(np.median(log_ratio)):.3f}x "
              f"({low:.3f}-{high:.3f})")


if __name__ == "__main__":
    main()
