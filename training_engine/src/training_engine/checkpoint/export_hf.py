"""``export --format hf``: a checkpoint of a transformers model (model=hf, or a model of
yours that is a ``PreTrainedModel``) as a directory that ``from_pretrained`` reads:
``config.json``, ``model.safetensors`` (shards and ``model.safetensors.index.json``
above ``max_shard_size``) and, when the run had one, the tokenizer (docs/hf.md).

transformers writes the directory itself (``save_pretrained``: its own names, tied
weights stored once); the model is built on the meta device from the run's config,
which may only name targets this project trusts (trust.py), so no weights are
allocated twice.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from ..config import ConfigError, instantiate
from ..fits import model_positions
from ..inference import trusted_config
from ..tokenizer import load_tokenizer, save_for_transformers
from . import format as fmt
from . import sharded, ties


def export_hf(ckpt: Path, out: Path, *, trusted: Any = (), max_shard_size: str = "5GB") -> None:
    """Write ``out`` (replaced whole, never half-written) from the verified ``ckpt``."""
    config = trusted_config(
        fmt.parse_file(fmt.CONFIG, ckpt / fmt.CONFIG),
        ("model", "data"),
        trusted=trusted,
        where=str(ckpt / fmt.CONFIG),
    )
    with torch.device("meta"):
        model = instantiate(OmegaConf.create(config["model"]), what="model")
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ConfigError(
            f"--format hf needs a transformers model (model=hf); {ckpt}'s model is "
            f"{type(model).__name__}: export --format safetensors instead"
        )
    manifest = fmt.read_manifest(ckpt)
    state = (
        sharded.full_model_state(ckpt) if manifest.get("layout") == "sharded" else _weights(ckpt)
    )
    if ties.TIES_FILE in manifest["files"]:  # stored once: every name back for transformers
        tied = ties.parse(fmt.parse_file(ties.TIES_FILE, ckpt / ties.TIES_FILE), str(ckpt))
        state = ties.restore(state, tied)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    data = config.get("data") or {}
    tokenizer = None
    if "tokenizer" in data:  # data=text: its tokenizer file, or bytes
        tokenizer = load_tokenizer(data["tokenizer"], data.get("eos_token", "<|endoftext|>"))
        with_special_ids(model, tokenizer.eos_id)
    try:
        model.save_pretrained(tmp, state_dict=state, max_shard_size=max_shard_size)
        if tokenizer is not None:
            context = model_positions(model) or data.get("seq_len")
            save_for_transformers(tokenizer, tmp, model_max_length=context)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def with_special_ids(model: Any, eos_id: int) -> None:
    """The run's end-of-document id as the exported model's eos, and as its bos and pad
    where the config has none (GPT-2's convention: one ``<|endoftext|>``), in
    ``config.json`` and ``generation_config.json``: transformers' ``generate`` then
    stops where generate.py does."""
    targets = [model.config]
    if getattr(model, "generation_config", None) is not None:
        targets.append(model.generation_config)
    for target in targets:
        target.eos_token_id = eos_id
        for key in ("bos_token_id", "pad_token_id"):
            if getattr(target, key, None) is None:
                setattr(target, key, eos_id)


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(ckpt / fmt.MODEL)
