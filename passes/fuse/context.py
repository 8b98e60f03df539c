"""What every fusion rule gets: the graph's probe values and the target it fuses for."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from passes.fuse.targets import CONTRIB_TARGETS, Target


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
        """Whether a rule may write com.microsoft ops for this target (GELU picks its op by this)."""
        return self.target in CONTRIB_TARGETS
