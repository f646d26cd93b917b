"""Classification: a batch is ``(inputs, labels)``, the model returns logits
``(batch, classes)`` as a tensor or as an object with ``.logits`` (a Hugging Face
output). The loss is cross-entropy, logged beside it is the accuracy; ``predict``
gives the most likely class. The training step, the evaluation and the parameter
groups are the defaults (training_engine/task.py's ``TaskDefaults``: override any of them
here). The digits' MLP and CNN train with it (``task=classification``).
"""

from typing import Any

import torch
import torch.nn.functional as F

from ..contract import TaskDefaults


class Classification(TaskDefaults):
    # What ``evaluate`` returns: ``trainer.monitor`` is one of these, or a train/<name>
    # the loop logs (train/loss and loss's logs).
    metrics = ("val/loss", "val/acc")
    top_k = 5  # predict.py's top_k column: the k most probable classes
    # A model's auxiliary loss (an MoE router's load balancing) is added with this
    # weight; None: the model config's router_aux_loss_coef (transformers), else 1.
    aux_loss_coef: float | None = None

    def __init__(self, aux_loss_coef: float | None = None, top_k: int = 5) -> None:
        self.aux_loss_coef, self.top_k = aux_loss_coef, top_k

    def inputs(self, *, batch: Any) -> Any:
        """What the model is called with."""
        return batch[0]

    def targets(self, *, batch: Any) -> torch.Tensor:
        return batch[1]

    def batch_size(self, *, batch: Any) -> tuple[int, int | None]:
        """(samples, tokens) in a batch; tokens is None: a sample is one prediction."""
        return len(self.targets(batch=batch)), None

    def logits(self, output: Any) -> torch.Tensor:
        """The model's logits: its output, or the output's ``.logits``."""
        found = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
        if not isinstance(found, torch.Tensor):
            raise TypeError(
                f"the model returned {type(output).__name__}; {type(self).__name__} expects "
                "logits: a tensor, or an object with a .logits tensor (a Hugging Face output)"
            )
        return found

    def loss(
        self, *, model: torch.nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The objective of one micro-batch, and what to log beside it: the loop averages
        each log over its log window as ``train/<name>``, ``evaluate`` over the
        validation set as ``val/<name>``. Return the loss alone when there is nothing."""
        output, y = self.call_model(model, batch), self.targets(batch=batch)
        out = self.logits(output)
        ce = cross_entropy(out, y)
        logs = {"acc": (out.detach().argmax(dim=-1) == y).float().mean()}
        aux = auxiliary_loss(output)
        if aux is None:
            return ce, logs
        # an MoE: the router's loss joins the objective; both parts are logged
        coef = aux_coefficient(model, self.aux_loss_coef)
        return ce + coef * aux, {**logs, "ce": ce.detach(), "aux_loss": aux.detach()}

    def call_model(self, model: torch.nn.Module, batch: Any) -> Any:
        """The model called on the batch's inputs; a transformers MoE is asked for its
        router logits, without which it computes no load-balancing loss."""
        config = getattr(getattr(model, "module", model), "config", None)
        if getattr(config, "output_router_logits", None) is not None:
            return model(self.inputs(batch=batch), output_router_logits=True)
        return model(self.inputs(batch=batch))

    @torch.no_grad()
    def predict(self, *, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """What predict.py writes per sample, a column each: the class, its
        probability, the ``top_k`` classes (most probable first) and the label."""
        probs = self.logits(model(self.inputs(batch=batch))).float().softmax(dim=-1)
        best, top = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
        return {
            "prediction": top[..., 0],
            "probability": best[..., 0],
            "top_k": top,
            "target": self.targets(batch=batch),
        }


def auxiliary_loss(output: Any) -> torch.Tensor | None:
    """A model's auxiliary loss: its output's ``aux_loss`` (transformers' MoE outputs,
    or a model of yours returning an object or a dict with one); None without."""
    aux = output.get("aux_loss") if isinstance(output, dict) else getattr(output, "aux_loss", None)
    return aux if isinstance(aux, torch.Tensor) else None


def aux_coefficient(model: torch.nn.Module, given: float | None) -> float:
    if given is not None:
        return float(given)
    config = getattr(getattr(model, "module", model), "config", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    return float(coef) if isinstance(coef, int | float) else 1.0


def cross_entropy(out: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Class labels (batch,) or token targets (batch, positions): both flatten to rows."""
    return F.cross_entropy(out.flatten(0, -2), y.flatten(), **kwargs)
