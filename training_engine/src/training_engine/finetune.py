"""Fine-tuning (``checkpoint.init_from``): a new run (step 0, a fresh optimizer and
schedule) whose model starts from another run's weights. Strict: every key and
shape must match, else a ConfigError before any training. Not strict: the keys
that match in name and shape are loaded; the missing, unexpected and mismatched
ones are reported in the log and in summary.json. Distinct from
``checkpoint.resume``, which continues the same run. docs/lifecycle.md.

``fine_tune`` is the trainer's whole step from the built model to the trained one:
those weights, then ``model.peft``'s adapter (adapters.py), then the fingerprint of
the frozen base that trainable-only checkpoints refer to (checkpoint/base.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import OmegaConf

from . import adapters
from .checkpoint import base
from .config import ConfigError
from .inference import read_first_valid
from .schema import section

log = logging.getLogger(__name__)


def key_report(own: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Keys of the model's state missing from the checkpoint, in the checkpoint
    but not the model, and in both with other shapes."""
    return {
        "missing": sorted(k for k in own if k not in theirs),
        "unexpected": sorted(k for k in theirs if k not in own),
        "mismatched": [
            {"key": k, "checkpoint": list(theirs[k].shape), "model": list(own[k].shape)}
            for k in sorted(own)
            if k in theirs and theirs[k].shape != own[k].shape
        ],
    }


def init_from(checkpoint: Any, *, model: torch.nn.Module) -> dict[str, Any]:
    """Load ``checkpoint.init_from`` into the (unprepared) ``model``; on every
    rank. Returns ``{"init_from": report}`` for summary.json, ``{}`` when unset."""
    checkpoint = section("checkpoint", checkpoint)  # every key (a test may give a few)
    source = checkpoint.init_from
    if not source:
        return {}
    pick, weights = checkpoint.init_from_pick, checkpoint.init_from_weights
    ckpt, theirs, _ = read_first_valid(source, pick, weights)
    own = model.state_dict()
    report = {"source": str(ckpt), "weights": weights, **key_report(own, theirs)}
    differs = report["missing"] or report["unexpected"] or report["mismatched"]
    if differs and checkpoint.init_from_strict:
        raise ConfigError(
            f"checkpoint.init_from={source} does not fit the model (init_from_strict=true): "
            f"missing {report['missing']}, unexpected {report['unexpected']}, mismatched "
            f"{[m['key'] for m in report['mismatched']]}. Use checkpoint.init_from_strict=false "
            "to load only the keys that match"
        )
    skip = set(report["missing"]) | {m["key"] for m in report["mismatched"]}
    model.load_state_dict(
        {k: v for k, v in theirs.items() if k in own and k not in skip}, strict=False
    )
    report["loaded"] = len(own) - len(skip)
    log.info(
        f"init_from {ckpt} ({weights} weights): {report['loaded']} of {len(own)} tensors loaded"
        + (
            f"; missing {report['missing']}, unexpected {report['unexpected']}, mismatched "
            + ", ".join(
                f"{m['key']} {m['checkpoint']} -> {m['model']}" for m in report["mismatched"]
            )
            if differs
            else ""
        )
    )
    return {"init_from": report}


def fine_tune(cfg: Any, model: torch.nn.Module) -> tuple[torch.nn.Module, dict, base.Base | None]:
    """(the model to train, summary.json's ``init_from`` report, the fingerprint of its
    frozen base or None): ``checkpoint.init_from``'s weights loaded into the built
    model, ``model.peft``'s adapter attached (its matrices from the seed). On every
    rank, before any sharding: the frozen tensors are whole."""
    report = init_from(cfg.checkpoint, model=model)
    model = adapters.attach(model, cfg.model.get(adapters.KEY), cfg.seed)
    return model, report, base.fingerprint(model, reference(cfg))


def reference(config: Any) -> dict[str, Any]:
    """What a run's frozen base is built from (base.json's ``reference``): the model's
    node without its adapter, the seed, and init_from's source."""
    node = adapters.base_node(config["model"])
    node = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    checkpoint = config.get("checkpoint") or {}
    return {"model": node, "seed": config.get("seed"), "init_from": checkpoint.get("init_from")}
