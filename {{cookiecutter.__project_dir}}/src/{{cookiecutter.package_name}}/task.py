"""THE task: what a batch is, the loss of one, the evaluation with its metrics,
and what a prediction is.

The training loop, preflight, throughput, tracking and bench.py ask this module;
for a new task edit it (with ``model.py``/``data.py``) and nothing else. The
example: classification (labels ``(batch,)``) and next-token prediction (targets
``(batch, positions)``); every position is one prediction. README: "Use your own model and data".
"""

import math
from typing import Any

import torch
import torch.nn.functional as F

# What ``evaluate`` returns: ``trainer.monitor`` must be one of these. ``val/ppl``
# (perplexity, exp of the mean loss per token) only for token targets.
METRICS = ("val/loss", "val/acc", "val/ppl")


def inputs(*, batch: Any) -> Any:
    """What the model is called with."""
    return batch[0]


def targets(*, batch: Any) -> torch.Tensor:
    return batch[1]


def batch_size(*, batch: Any) -> tuple[int, int | None]:
    """(samples, tokens) in a batch; tokens is None for a task without positions."""
    y = targets(batch=batch)
    return len(y), (y.numel() if y.dim() > 1 else None)


def logits(output: Any) -> torch.Tensor:
    """The model's scores: its output tensor, or the ``.logits`` of an output object
    (a Hugging Face ``transformers`` model returns a ``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        return output
    found = getattr(output, "logits", None)
    if isinstance(found, torch.Tensor):
        return found
    raise TypeError(
        f"the model returned {type(output).__name__}: expected a tensor of logits "
        "(batch, ..., classes) or an object with a .logits tensor (transformers' ModelOutput)"
    )


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Class labels (batch,) or token targets (batch, positions): both flatten
    to rows of logits."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), **kwargs)


def loss(*, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The training objective of one micro-batch of the train loader."""
    return cross_entropy(logits(model(inputs(batch=batch))), targets(batch=batch))


def predict(*, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """What predict.py writes per sample: the most likely class (per position
    for token targets)."""
    return logits(model(inputs(batch=batch))).argmax(dim=-1)


@torch.no_grad()
def evaluate(*, model: torch.nn.Module, loader: Any, accelerator: Any) -> dict[str, float]:
    """METRICS over the whole validation set, summed across ranks. Call on every rank."""
    model.eval()
    loss_sum = torch.zeros((), device=accelerator.device)
    correct = torch.zeros((), device=accelerator.device)
    count = torch.zeros((), device=accelerator.device)
    for batch in loader:
        scores = logits(model(inputs(batch=batch)))
        scores, y = accelerator.gather_for_metrics((scores, targets(batch=batch)))
        loss_sum += cross_entropy(scores.float(), y, reduction="sum")
        correct += (scores.argmax(dim=-1) == y).sum()
        count += y.numel()
    model.train()
    metrics = {"val/loss": (loss_sum / count).item(), "val/acc": (correct / count).item()}
    if y.dim() > 1:  # a language model: per-token perplexity
        metrics["val/ppl"] = math.exp(metrics["val/loss"])
    return metrics
