"""Learning-rate schedules, built per optimizer step.

``train.py`` calls ``instantiate(cfg.scheduler)(optimizer, total_steps=...)``,
so every schedule here takes the optimizer and the total number of optimizer
steps; the remaining arguments come from ``configs/scheduler/``.
"""

import functools
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def _constant_factor(step: int) -> float:
    return 1.0


def _warmup_cosine_factor(
    step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float
) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def constant(optimizer: Optimizer, total_steps: int) -> LambdaLR:
    """Keep the optimizer's learning rate."""
    return LambdaLR(optimizer, _constant_factor)


def warmup_cosine(
    optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warm-up for ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""
    # A partial (not a lambda) so that LambdaLR.state_dict() holds plain data only.
    factor = functools.partial(
        _warmup_cosine_factor,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        min_lr_ratio=min_lr_ratio,
    )
    return LambdaLR(optimizer, factor)
