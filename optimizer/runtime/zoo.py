"""Small models for smoke runs and tests, usable as `factory` sources (`optimizer.runtime.zoo:resnet`).

`resnet` is torchvision's ResNet (BasicBlock: Conv-BN-ReLU, Conv-BN, residual Add, ReLU), written out here
because torchvision's PyPI wheels do not import beside the CPU build of torch this project installs
("operator torchvision::nms does not exist"). With torchvision installed, `torchvision.models:resnet18`
works as a factory source directly.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers: tuple[int, ...] = (2, 2, 2, 2), width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks: list[nn.Module] = []
        cin = width
        for i, n in enumerate(layers):
            cout = width * 2**i
            for j in range(n):
                blocks.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.blocks(self.stem(pixel_values))
        return {"logits": self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))}


def resnet(layers: tuple[int, ...] = (2, 2, 2, 2), width: int = 64, classes: int = 1000, seed: int = 0) -> nn.Module:
    """ResNet-18 by default; BN statistics randomized so that folding them is a real test."""
    torch.manual_seed(seed)
    model = ResNet(tuple(layers), width, classes)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    return model.eval()
