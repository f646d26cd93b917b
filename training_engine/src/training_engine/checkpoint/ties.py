"""Tied (shared) parameters in checkpoints and weight files: stored once, re-tied on load.

A model may use one parameter under several names: a GPT-2's ``lm_head.weight``
is its ``transformer.wte.weight``. ``state_dict()`` lists it under every name;
safetensors refuses tensors that share memory ("Some tensors share memory"), and a
copy per name would store it twice. So a checkpoint keeps the first name
(``named_parameters()``'s, the one the optimizer state is keyed by) and records the
others as ``{alias: kept name}``: ``ties.json`` in a checkpoint, ``"tied"`` in the
metadata of an exported or final ``model.safetensors``. Loading puts the kept tensor
back under every alias, so ``load_state_dict`` (strict) sets each name, and a model
that ties them stays tied. Found generically: names grouped by parameter identity.
docs/checkpoints.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .format import CheckpointError

TIES_FILE = "ties.json"  # in a checkpoint, when its model has tied parameters
METADATA_KEY = "tied"  # in a weight file's safetensors metadata
AC_PREFIX = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper (fsdp.py)


def find(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: kept name}`` of every parameter the model holds under several names."""
    first: dict[int, str] = {}
    ties: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        name = name.replace(AC_PREFIX, "")
        if id(param) in first:
            ties[name] = first[id(param)]
        else:
            first[id(param)] = name
    return ties


def in_state(ties: dict[str, str], state: dict[str, Any]) -> dict[str, str]:
    """The ties whose names are both keys of ``state`` (what a save records)."""
    return {alias: kept for alias, kept in ties.items() if alias in state and kept in state}


def drop_aliases(state: dict[str, Any], ties: dict[str, str]) -> dict[str, Any]:
    """``state`` with each tied tensor under its kept name only."""
    return {name: value for name, value in state.items() if name not in ties}


def restore(state: dict[str, Any], ties: dict[str, str]) -> dict[str, Any]:
    """``state`` with every alias back, as the same tensor as its kept name."""
    out = dict(state)
    for alias, kept in ties.items():
        if alias not in out and kept in out:
            out[alias] = out[kept]
    return out


def to_bytes(ties: dict[str, str]) -> bytes:
    return (json.dumps(ties, indent=1, sort_keys=True) + "\n").encode()


def parse(data: Any, where: str) -> dict[str, str]:
    """A tie map read from a checkpoint or file: names to names, nothing else."""
    if isinstance(data, str | bytes):
        try:
            data = json.loads(data)
        except ValueError as err:
            raise CheckpointError(f"{where}: the tie map is not JSON ({err})") from err
    ok = isinstance(data, dict) and all(
        isinstance(k, str) and isinstance(v, str) and k != v for k, v in data.items()
    )
    if not ok:
        raise CheckpointError(
            f"{where}: the tie map is not a mapping of alias to kept name (strings)"
        )
    return dict(data)


def of_checkpoint(loaded: dict[str, Any], ckpt: Path | str) -> dict[str, str]:
    """The tie map among a checkpoint's parsed files (none: an untied model)."""
    if TIES_FILE not in loaded:
        return {}
    return parse(loaded[TIES_FILE], f"{ckpt}/{TIES_FILE}")


def load_file(path: Path | str) -> dict[str, torch.Tensor]:
    """A ``model.safetensors`` (exported, or a run's final weights) with the aliases
    of tied weights put back: ``model.load_state_dict(load_file(path))``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    tied = metadata.get(METADATA_KEY)
    return restore(state, parse(tied, str(path))) if tied else state


def with_metadata(src: Path, dst: Path, ties: dict[str, str]) -> None:
    """Copy the safetensors file ``src`` to ``dst`` with the tie map added to its
    metadata: the header rewritten, the tensor bytes streamed (no tensor loaded).
    Hand-written: safetensors has no call that changes the metadata of a file."""
    import shutil

    with open(src, "rb") as f_in, open(dst, "wb") as f_out:
        size = int.from_bytes(f_in.read(8), "little")
        header = json.loads(f_in.read(size))
        header["__metadata__"] = {**header.get("__metadata__", {}), METADATA_KEY: json.dumps(ties)}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # offsets are relative to the data: unchanged
        f_out.write(len(text).to_bytes(8, "little") + text)
        shutil.copyfileobj(f_in, f_out, 16 * 2**20)
