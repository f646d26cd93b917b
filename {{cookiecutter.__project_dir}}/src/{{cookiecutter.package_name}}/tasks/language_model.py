"""Language modelling: a batch is ``(tokens, next tokens)``, both ``(batch, positions)``
(shifted by the data already: a Hugging Face ``labels=`` loss would shift them again),
and every position is one prediction. The model returns logits ``(batch, positions,
vocab)``. The evaluation adds the per-token perplexity; ``predict`` gives each
sequence's mean loss per token. model=gpt and model=hf pick it (``task=language_model``).
"""

import math
from typing import Any

import torch

from .classification import Classification, cross_entropy


class LanguageModel(Classification):
    metrics = ("val/loss", "val/acc", "val/ppl")

    def batch_size(self, *, batch: Any) -> tuple[int, int | None]:
        """(sequences, tokens): evaluation weighs each batch by its tokens."""
        y = self.targets(batch=batch)
        return len(y), y.numel()

    def evaluate(self, *, model: torch.nn.Module, loader: Any, accelerator: Any) -> dict:
        metrics = super().evaluate(model=model, loader=loader, accelerator=accelerator)
        # perplexity of the next-token loss alone (an MoE's val/loss adds its router's)
        ce = metrics.get("val/ce", metrics.get("val/loss"))
        if ce is not None:
            metrics["val/ppl"] = math.exp(min(ce, 700.0))
        return metrics

    @torch.no_grad()
    def predict(self, *, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per sequence: its mean loss per token, its perplexity and its token count."""
        out, y = self.logits(model(self.inputs(batch=batch))), self.targets(batch=batch)
        per_token = cross_entropy(out.float(), y, reduction="none").view(y.shape)
        sequence = per_token.mean(dim=1)
        tokens = torch.full_like(y[:, 0], y.shape[1])
        return {"loss": sequence, "perplexity": sequence.exp(), "tokens": tokens}
