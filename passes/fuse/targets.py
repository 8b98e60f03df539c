"""The targets a fusion rule is declared for (rule.py) and a rule's context knows it is fusing for (context.py):
apart from both so that neither imports the other."""

from __future__ import annotations

from typing import Literal

Target = Literal["cpu", "cuda", "tensorrt"]
ALL_TARGETS: frozenset[Target] = frozenset({"cpu", "cuda", "tensorrt"})
# ORT contrib ops (com.microsoft) run on ORT's CPU and CUDA EPs, not in TensorRT.
CONTRIB_TARGETS: frozenset[Target] = frozenset({"cpu", "cuda"})
