"""THE task: what a batch is, what the model is called with, the loss of a batch and
what is logged beside it, how the optimizer groups the parameters, the evaluation and
what a prediction is. The training loop, eval.py, predict.py, preflight, the throughput
figures and MLflow's model export ask this module; a new task is an edit here (with a
model in models/ and data in data/) and nowhere else (docs/own-model.md).

The forward contract: the model is called with ``inputs(batch)`` and returns logits,
``(batch, classes)`` or ``(batch, positions, vocab)``, as a tensor or as an object with
``.logits`` (a Hugging Face output). The example is classification (labels
``(batch,)``) and next-token prediction (targets ``(batch, positions)``, shifted by the
data already: a Hugging Face ``labels=`` loss would shift them again); every position
is one prediction.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F

from .contract import average_over_batches, decay_groups

# What ``evaluate`` returns: ``trainer.monitor`` is one of these, or a ``train/<name>``
# the loop logs (train/loss and loss's logs). ``val/ppl`` only for token targets.
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
    """The model's logits: its output, or the output's ``.logits``."""
    found = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if not isinstance(found, torch.Tensor):
        raise TypeError(
            f"the model returned {type(output).__name__}; task.py expects logits: a tensor "
            "(batch, classes) or (batch, positions, vocab), or an object with a .logits "
            "tensor (a Hugging Face output)"
        )
    return found


def cross_entropy(out: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Class labels (batch,) or token targets (batch, positions): both flatten to rows."""
    return F.cross_entropy(out.flatten(0, -2), y.flatten(), **kwargs)


def loss(*, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training objective of one micro-batch, and what to log beside it: the loop
    averages each log over its log window as ``train/<name>``, and ``evaluate`` over
    the validation set as ``val/<name>``. Return the loss alone when there is nothing."""
    out, y = logits(model(inputs(batch=batch))), targets(batch=batch)
    accuracy = (out.detach().argmax(dim=-1) == y).float().mean()
    return cross_entropy(out, y), {"acc": accuracy}


def param_groups(model: torch.nn.Module) -> Any:
    """The optimizer's parameter groups: the optimizer's weight decay on the weights of
    linear and convolution layers, none on biases, norms and embeddings (the standard
    for transformers). ``return model.parameters()`` decays everything alike."""
    return decay_groups(model)


def evaluate(*, model: torch.nn.Module, loader: Any, accelerator: Any) -> dict[str, float]:
    """METRICS over the whole validation set: ``loss`` and its logs, averaged over every
    sample (every token) the same way on any number of processes. Call on every rank."""
    tokens = []  # whether the targets have positions (a language model)

    def weight(batch: Any) -> int:
        samples, counted = batch_size(batch=batch)
        tokens.append(counted is not None)
        return counted or samples

    model.eval()
    means = average_over_batches(lambda b: loss(model=model, batch=b), loader, accelerator, weight)
    model.train()
    metrics = {f"val/{name}": value for name, value in means.items()}
    if any(tokens):  # per-token perplexity
        metrics["val/ppl"] = math.exp(min(metrics["val/loss"], 700.0))
    return metrics


@torch.no_grad()
def predict(*, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """What predict.py writes per sample, a column each: the most likely class; for
    token targets, each sequence's mean loss per token and its perplexity."""
    out, y = logits(model(inputs(batch=batch))), targets(batch=batch)
    if y.dim() == 1:
        return {"prediction": out.argmax(dim=-1), "target": y}
    per_token = cross_entropy(out.float(), y, reduction="none").view(y.shape)
    sequence = per_token.mean(dim=1)
    tokens = torch.full_like(y[:, 0], y.shape[1])
    return {"loss": sequence, "perplexity": sequence.exp(), "tokens": tokens}
