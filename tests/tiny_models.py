"""Small PyTorch models for tests, loaded through the recipe's `factory` source (module:function)."""

from __future__ import annotations

import torch


class MLP(torch.nn.Module):
    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, classes)
        )

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.net(x)}


def mlp(seed: int = 0, **kwargs: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MLP(**kwargs)


class DataDependent(torch.nn.Module):
    """Branches on a tensor's value: torch.export cannot trace it, so the export stage fails."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return y.nonzero().float().sum(0)
        return y


def data_dependent() -> torch.nn.Module:
    torch.manual_seed(0)
    return DataDependent()


def not_a_module() -> str:
    return "this is not a model"


def unseeded_mlp() -> torch.nn.Module:
    """Random weights from whatever state torch's generator is in: a factory as users often write them."""
    return MLP()
