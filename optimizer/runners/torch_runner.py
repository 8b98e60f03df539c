"""PyTorch eager runner (stage 0, the reference). FP32, inference mode, the recipe's thread count."""

from __future__ import annotations

from typing import Any

import numpy as np

from optimizer.runners.base import Runner, Session
from optimizer.threads import target_threads


class TorchSession(Session):
    def __init__(self, module: Any, output_names: list[str], input_names: list[str], threads: int) -> None:
        self.module = module
        self.output_names = output_names
        self.input_names = input_names
        self.threads = threads

    def prepare(self, feed: dict[str, np.ndarray]) -> Any:
        import torch

        return [torch.from_numpy(np.ascontiguousarray(feed[n])) for n in self.input_names]

    def run(self, prepared: Any) -> Any:
        import torch

        with torch.inference_mode():
            return self.module(*prepared)

    def to_numpy(self, outputs: Any) -> list[np.ndarray]:
        return [o.detach().cpu().numpy() for o in outputs]

    def describe(self) -> dict[str, Any]:
        import torch

        return {
            "runtime": "pytorch-eager",
            "torch": torch.__version__,
            "threads": self.threads,
            "dtype": "fp32",
        }


class TorchRunner(Runner):
    def _open(self) -> Session:
        import torch

        from optimizer.models import NamedIO, load_module

        threads = target_threads(self.recipe)
        torch.set_num_threads(threads)
        inputs = self.artifact.meta["input_names"]
        outputs = self.artifact.meta["output_names"]
        module = NamedIO.wrap(load_module(self.recipe), inputs, outputs)
        return TorchSession(module, outputs, inputs, threads)
