"""Language modelling: a batch is ``(tokens, next tokens)``, both ``(batch, positions)``
(shifted by the data already: a Hugging Face ``labels=`` loss would shift them again),
or ``(tokens, next tokens, position ids)`` for packed documents (data=chat, data=text
with ``packing: documents``; training_engine.packing). The model returns logits ``(batch,
positions, vocab)``.

A target of -100 is not learned (a prompt's tokens, padding): the loss, the accuracy
and the evaluation count the other tokens only, so val/loss and val/ppl are per counted
token. Position ids go to the model as ``position_ids`` (where the documents of a row
begin: each attends to itself only), with ``use_cache=False`` for a transformers model
(it reads them so only without a cache). ``predict`` gives each sequence's mean loss
per counted token. model=gpt and model=hf pick it (``task=language_model``).
"""

import math
from typing import Any

import torch

from .classification import Classification, aux_coefficient, auxiliary_loss, cross_entropy

IGNORE = -100  # a target the loss ignores (training_engine.packing writes it)


class LanguageModel(Classification):
    metrics = ("val/loss", "val/acc", "val/ppl")

    def positions(self, *, batch: Any) -> torch.Tensor | None:
        """The position ids of packed documents, or None (one document per row)."""
        return batch[2] if len(batch) > 2 else None

    def batch_size(self, *, batch: Any) -> tuple[int, int | None]:
        """(sequences, counted tokens): evaluation weighs each batch by its tokens."""
        y = self.targets(batch=batch)
        return len(y), int((y != IGNORE).sum())

    def call_model(self, model: torch.nn.Module, batch: Any) -> Any:
        config = getattr(getattr(model, "module", model), "config", None)
        kwargs: dict[str, Any] = {}
        positions = self.positions(batch=batch)
        if positions is not None:
            kwargs["position_ids"] = positions
            if getattr(config, "use_cache", None) is not None:  # transformers
                kwargs["use_cache"] = False  # packed documents are read without a cache
        if getattr(config, "output_router_logits", None) is not None:  # an MoE's router loss
            kwargs["output_router_logits"] = True
        return model(self.inputs(batch=batch), **kwargs)

    def loss(
        self, *, model: torch.nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Cross-entropy per counted token (-100: not counted), the accuracy beside it; an
        MoE's router loss joins it (Classification.loss)."""
        output, y = self.call_model(model, batch), self.targets(batch=batch)
        out = self.logits(output)
        counted = y != IGNORE
        count = counted.sum().clamp(min=1)  # no host sync; a batch of no targets gives 0
        ce = cross_entropy(out, y, reduction="sum", ignore_index=IGNORE) / count
        right = (out.detach().argmax(dim=-1) == y) & counted
        logs = {"acc": right.sum() / count}
        aux = auxiliary_loss(output)
        if aux is None:
            return ce, logs
        coef = aux_coefficient(model, self.aux_loss_coef)
        return ce + coef * aux, {**logs, "ce": ce.detach(), "aux_loss": aux.detach()}

    def evaluate(self, *, model: torch.nn.Module, loader: Any, accelerator: Any) -> dict:
        metrics = super().evaluate(model=model, loader=loader, accelerator=accelerator)
        # perplexity of the next-token loss alone (an MoE's val/loss adds its router's)
        ce = metrics.get("val/ce", metrics.get("val/loss"))
        if ce is not None:
            metrics["val/ppl"] = math.exp(min(ce, 700.0))
        return metrics

    @torch.no_grad()
    def predict(self, *, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per sequence: its mean loss per counted token, its perplexity, its count."""
        out, y = self.logits(self.call_model(model, batch)), self.targets(batch=batch)
        per_token = cross_entropy(out.float(), y, reduction="none", ignore_index=IGNORE)
        counted = (y != IGNORE).sum(dim=1)
        sequence = per_token.view(y.shape).sum(dim=1) / counted.clamp(min=1)
        return {"loss": sequence, "perplexity": sequence.exp(), "tokens": counted}
