"""``export --format hf``: a checkpoint of a transformers model (model=hf, or a model of
yours that is a ``PreTrainedModel``) as a directory that ``from_pretrained`` reads:
``config.json``, ``model.safetensors`` (shards and ``model.safetensors.index.json``
above ``max_shard_size``) and, when the run had one, the tokenizer (docs/hf.md).

transformers writes the directory itself (``save_pretrained``: its own names, tied
weights stored once); the model is built on the meta device from the run's config,
which may only name targets this project trusts (trust.py), so no weights are
allocated twice.

A run with an adapter (model.peft) is rebuilt as load_model rebuilds it (its base
checked against the checkpoint's, checkpoint/base.py), then written merged into its
base (peft's ``merge_and_unload``: a plain transformers model) or, with ``adapter``,
as peft's adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
that ``PeftModel.from_pretrained(base, DIR)`` loads. Its base is the run's
``model.pretrained`` directory, named in ``adapter_config.json``; a base built from a
config exists nowhere else, so it is written beside the adapter, in ``base/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from .. import adapters
from ..chat import chat_template
from ..config import ConfigError, instantiate
from ..fits import model_positions
from ..inference import load_checkpoint, trusted_config
from ..tokenizer import load_tokenizer, save_for_transformers
from . import format as fmt
from . import sharded, ties


def export_hf(
    ckpt: Path,
    out: Path,
    *,
    trusted: Any = (),
    max_shard_size: str = "5GB",
    adapter: bool = False,
) -> None:
    """Write ``out`` (replaced whole, never half-written) from the verified ``ckpt``;
    ``adapter``: the adapter directory of a model.peft run (module docstring)."""
    config = trusted_config(
        fmt.parse_file(fmt.CONFIG, ckpt / fmt.CONFIG),
        ("model", "data"),
        trusted=trusted,
        where=str(ckpt / fmt.CONFIG),
    )
    if adapters.settings(config["model"].get(adapters.KEY)) is not None:
        _export_adapted(ckpt, out, config, adapter, max_shard_size)
        return
    if adapter:
        raise ConfigError(
            f"--adapter is not allowed: {ckpt}'s run trained no adapter (model.peft=null); "
            "export it without --adapter"
        )
    with torch.device("meta"):
        model = instantiate(adapters.base_node(OmegaConf.create(config["model"])), what="model")
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
    with _replacing(out) as tmp:
        tokenizer = _tokenizer(config, model)
        model.save_pretrained(tmp, state_dict=state, max_shard_size=max_shard_size)
        _save_tokenizer(tokenizer, config, model, tmp)


def _export_adapted(
    ckpt: Path, out: Path, config: dict, adapter: bool, max_shard_size: str
) -> None:
    """A model.peft run: merged into its base, or (``adapter``) the adapter and its base."""
    from transformers import PreTrainedModel

    peft_model = load_checkpoint(ckpt, model_config=config["model"]).model  # base checked
    base_model = peft_model.get_base_model()
    if not isinstance(base_model, PreTrainedModel):
        raise ConfigError(
            f"--format hf needs a transformers model (model=hf); {ckpt}'s base is "
            f"{type(base_model).__name__}: export --format safetensors instead"
        )
    pretrained = config["model"].get("pretrained")
    with _replacing(out) as tmp:
        tokenizer = _tokenizer(config, base_model)
        if not adapter:
            merged = peft_model.merge_and_unload()  # W + scale * B @ A, the adapter gone
            merged.save_pretrained(tmp, max_shard_size=max_shard_size)
            _save_tokenizer(tokenizer, config, merged, tmp)
            return
        # where PeftModel.from_pretrained's users find the base: the run's own directory,
        # or (built from a config) base/ beside the adapter, named as it will be found
        peft_model.save_pretrained(tmp)  # its base named by the model (a from_config: none)
        _save_tokenizer(tokenizer, config, base_model, tmp)
        where = str(Path(pretrained).resolve()) if pretrained else str(out.resolve() / "base")
        _name_the_base(tmp / "adapter_config.json", where)
        if not pretrained:
            bare = peft_model.unload()  # the base alone: the adapter layers taken out
            bare.save_pretrained(tmp / "base", max_shard_size=max_shard_size)
            _save_tokenizer(tokenizer, config, bare, tmp / "base")


def _name_the_base(path: Path, where: str) -> None:
    """``base_model_name_or_path`` where the base will be found (after the rename)."""
    adapter_config = json.loads(path.read_text())
    adapter_config["base_model_name_or_path"] = where
    path.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _replacing(out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out`` that replaces it whole when the block ends."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenizer(config: dict, model: Any) -> Any:
    """data=text's (and data=chat's) tokenizer, its eos made the model's; None without."""
    data = config.get("data") or {}
    if "tokenizer" not in data:
        return None
    tokenizer = load_tokenizer(data["tokenizer"], data.get("eos_token", "<|endoftext|>"))
    with_special_ids(model, tokenizer.eos_id)
    return tokenizer


def _save_tokenizer(tokenizer: Any, config: dict, model: Any, folder: Path) -> None:
    if tokenizer is None:
        return
    data = config.get("data") or {}
    context = model_positions(model) or data.get("seq_len")
    chat = "chat_template" in data  # data=chat: its template, for apply_chat_template
    template = chat_template(data["chat_template"], data.get("tokenizer")) if chat else None
    save_for_transformers(tokenizer, folder, model_max_length=context, chat_template=template)


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
