"""Example models for the digits task. Replace with your own; the config keys
under ``configs/model/`` are the constructor's argument names.

``flops_per_sample()`` (optional, for the ``perf/mfu`` metric and preflight's
MFU estimate, see ``throughput.py``): the FLOPs of one training step per sample,
counted as 3 x the forward pass (backward costs about twice the forward),
where a multiply-add is 2 FLOPs. Elementwise work (ReLU, norms) is left out.
"""

import torch
from torch import nn

from ..contract import require


def check_dropout(dropout: float) -> None:
    ok = isinstance(dropout, int | float) and not isinstance(dropout, bool) and 0 <= dropout < 1
    require("model.dropout", dropout, ok, "a number in [0, 1)")


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
        check_dropout(dropout)
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        size = in_features
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.ReLU(), nn.Dropout(dropout)]
            size = width
        layers.append(nn.Linear(size, num_classes))
        self.net = nn.Sequential(*layers)

    def flops_per_sample(self) -> int:
        forward = sum(
            2 * m.in_features * m.out_features for m in self.modules() if isinstance(m, nn.Linear)
        )
        return 3 * forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two 3x3 conv blocks, global average pooling, a linear head.
    ``image_size`` (height = width of the input) only enters ``flops_per_sample``."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        channels: list[int] | tuple[int, ...] = (32, 64),
        dropout: float = 0.1,
        image_size: int = 8,
    ) -> None:
        check_dropout(dropout)
        super().__init__()
        self.image_size = image_size
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

    def flops_per_sample(self) -> int:
        pixels = self.image_size**2  # padding=1 keeps the size through both convs
        forward = 0
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                kernel = m.kernel_size[0] * m.kernel_size[1]
                forward += 2 * kernel * m.in_channels * m.out_channels * pixels
            elif isinstance(m, nn.Linear):
                forward += 2 * m.in_features * m.out_features
        return 3 * forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
