"""Example models for the digits task. Replace with your own; the config keys
under ``configs/model/`` are the constructor's argument names."""

import torch
from torch import nn


class MLP(nn.Module):
    """Flatten the image, then ``len(hidden_sizes)`` ReLU layers with dropout."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden_sizes: list[int] | tuple[int, ...] = (128, 128),
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    @property
    def flops_per_sample(self) -> int:
        """Training FLOPs per sample (forward + backward): 6 per linear weight."""
        return 6 * sum(m.weight.numel() for m in self.net if isinstance(m, nn.Linear))

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
