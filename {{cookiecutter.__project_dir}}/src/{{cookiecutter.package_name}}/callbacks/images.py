"""The first validation images beside the model's predictions, at every evaluation, for
image classification (``callbacks=prediction_grid``): one grid image (``val/predictions``,
each image's border green where the prediction is right, red where it is wrong) to every
tracker that takes images, and the labels as a text (``val/predictions``). ``image_shape``
says how an input row is an image (the digits' MLP reads 64 values: [1, 8, 8]).
"""

from typing import Any

import torch

from ..contract import Callback


class PredictionGrid(Callback):
    def __init__(self, *, image_shape: list[int], count: int = 16, columns: int = 8) -> None:
        self.shape, self.count, self.columns = tuple(image_shape), count, columns

    @torch.no_grad()
    def on_eval_end(self, run: Any, metrics: dict[str, float]) -> None:
        batch = next(iter(run.extras["val_loader"]))
        inputs = run.task.inputs(batch=batch)[: self.count]
        model = run.model
        model.eval()
        predicted = run.task.logits(model(inputs)).argmax(dim=-1)
        model.train()
        labels = run.task.targets(batch=batch)[: self.count]
        run.media.image("val/predictions", self.grid(inputs, predicted == labels), step=run.step)
        pairs = ", ".join(f"{int(p)}/{int(y)}" for p, y in zip(predicted, labels, strict=True))
        run.media.text("val/predictions", f"predicted/label: {pairs}", step=run.step)

    def grid(self, inputs: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        """(3, H, W) in [0, 1]: the images in rows of ``columns``, each in a 1-pixel
        border that says whether its prediction was right."""
        images = inputs.float().reshape(-1, *self.shape)
        low = images.amin(dim=(1, 2, 3), keepdim=True)
        high = images.amax(dim=(1, 2, 3), keepdim=True)
        images = ((images - low) / (high - low).clamp_min(1e-8)).expand(-1, 3, -1, -1)
        n, _, h, w = images.shape
        rows = -(-n // self.columns)
        grid = torch.zeros(3, rows * (h + 2), self.columns * (w + 2))
        for i in range(n):
            r, c = divmod(i, self.columns)
            cell = grid[:, r * (h + 2) : (r + 1) * (h + 2), c * (w + 2) : (c + 1) * (w + 2)]
            cell[:] = torch.tensor([0.0, 0.8, 0.0] if right[i] else [0.9, 0.0, 0.0]).view(3, 1, 1)
            cell[:, 1:-1, 1:-1] = images[i].cpu()
        return grid
