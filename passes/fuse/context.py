"""What every fusion rule gets: the graph's probe values and the target it fuses for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx_graphsurgeon as gs

Target = Literal["cpu", "cuda", "tensorrt"]


@dataclass
class RuleContext:
    target: Target
    opset: int
    feed: dict[str, np.ndarray]
    values: dict[str, np.ndarray]  # probe values of the input graph's tensors, by name

    def shape(self, t: gs.Tensor) -> tuple[int, ...] | None:
        if isinstance(t, gs.Constant):
            return tuple(t.values.shape)
        v = self.values.get(t.name)
        if v is None:
            v = self.feed.get(t.name)
        return None if v is None else tuple(v.shape)

    @property
    def contrib_ok(self) -> bool:
        """ORT contrib ops (com.microsoft) run on ORT's CPU and CUDA EPs, not in TensorRT."""
        return self.target in ("cpu", "cuda")
