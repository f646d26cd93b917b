"""Example models for the digits task. Replace with your own; the config keys
under ``configs/model/`` are the constructor's argument names."""

import torch
from torch import nn


class MLP(nn.Module):
    """Flatten the image, then ``depth`` ReLU layers of ``width`` units with dropout.
    (Two numbers rather than a list of sizes: a sweep can search them.)"""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        width: int = 128,
        depth: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        size = in_features
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.ReLU(), nn.Dropout(dropout)]
            size = width
        layers.append(nn.Linear(size, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two 3x3 conv blocks, global average pooling, a linear head."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        channels: list[int] | tuple[int, ...] = (32, 64),
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_channels
        for out in channels:
            layers += [nn.Conv2d(width, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
            width = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
