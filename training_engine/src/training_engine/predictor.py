"""A trained classifier with what inference needs beside its weights: the class names
(the run's classes.json) and the preprocessing (the run's data config, read by its
data option's ``files`` reader: size, channels, mean, std), for a notebook or a
service. docs/lifecycle.md.

    from training_engine.predictor import load_predictor
    predictor = load_predictor("runs/exp1")
    predictor.predict(["cat.png", "new/"])   # one dict per file, most probable first
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from . import trust
from .classes import read_classes, run_dir_of
from .data_files import read_files
from .inference import TRUST_IN_CALL, load_checkpoint


@dataclass
class Predictor:
    model: torch.nn.Module  # eval mode, on the CPU (move it with .to())
    classes: list[str] | None  # None: the run kept no class names (indices then)
    data: DictConfig  # the run's data config: its preprocessing keys
    checkpoint: Path

    @torch.no_grad()
    def predict(
        self, files: str | Sequence[str], *, top_k: int = 5, batch_size: int = 64
    ) -> list[dict[str, Any]]:
        """For each file (a path, a folder of them, a glob, or a list): its ``path``,
        ``class`` (the name; the index without names), ``probability`` and ``top_k``,
        a list of (class, probability), most probable first."""
        dataset = read_files(self.data, files)
        device = next(self.model.parameters()).device
        rows: list[dict[str, Any]] = []
        paths = iter(dataset.paths)
        for inputs, _ in DataLoader(dataset, batch_size=batch_size):
            output = self.model(inputs.to(device))
            logits = output if isinstance(output, torch.Tensor) else output.logits
            probs = logits.float().softmax(dim=-1).cpu()
            best, top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
            for p, t in zip(best.tolist(), top.tolist(), strict=True):
                names = [self.name(i) for i in t]
                rows.append(
                    {
                        "path": str(next(paths)),
                        "class": names[0],
                        "probability": p[0],
                        "top_k": list(zip(names, p, strict=True)),
                    }
                )
        return rows

    def name(self, index: int) -> str | int:
        classes = self.classes
        return classes[index] if classes and 0 <= index < len(classes) else index


def load_predictor(
    path: str | Path, pick: str = "best", weights: str = "raw", trusted: Any = ()
) -> Predictor:
    """``load_model``'s model (``path``, ``pick``, ``weights``, ``trusted`` as there)
    with the run's class names and preprocessing. Only the data option's function
    is looked up (trusted like the model's); its augmentation is never built."""
    loaded = load_checkpoint(path, pick, weights, trusted=trusted)
    data = trust.literal(loaded.config).get("data") or {}
    trust.check_targets(
        {"_target_": data.get("_target_")},
        trusted=list(trusted or ()),
        where=f"{loaded.checkpoint / 'config.json'} (data)",
        hint=TRUST_IN_CALL,
    )
    return Predictor(
        model=loaded.model,
        classes=read_classes(run_dir_of(loaded.checkpoint)),
        data=OmegaConf.create(data),
        checkpoint=loaded.checkpoint,
    )
