"""Checkpoints of the trainable weights only, and the frozen base they stand on
(``checkpoint.weights``; docs/checkpoints.md, docs/finetune.md).

A model most of whose parameters are frozen (``requires_grad=False``: an adapter's
base, model.peft) is saved as its trainable state: every parameter that trains and
every buffer (torch's ``StateDictOptions(ignore_frozen_params=True)``), with their
optimizer state. The frozen rest is not written again and again: ``base.json`` refers
to it, as each frozen tensor's name, shape, dtype and checksum, their total checksum,
and what the run's config builds it from (the model's node, the seed, init_from).
Whoever loads such a checkpoint (resume, load_model, export) rebuilds the base from
the config as the trainer built it and compares checksums first: a base that differs
(another pretrained directory, another seed, a changed model) is refused with exit 2,
naming the tensors, before any weight is loaded or any step runs.

``checkpoint.weights``: ``auto`` (trainable-only when frozen parameters are more than
half of the model's), ``full`` or ``trainable``. The manifest records which
(``weights``); a checkpoint is judged by what it holds either way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from . import checksums
from .format import BASE, CheckpointError, check_base
from .ties import AC_PREFIX

BASE_FILE = BASE
METADATA_KEY = "base"  # in a final model.safetensors of trainable weights: the base.json
WEIGHTS = ("auto", "full", "trainable")
FULL, TRAINABLE = "full", "trainable"


def frozen_names(model: torch.nn.Module) -> set[str]:
    """Every name (tied aliases too) of a parameter that does not train."""
    return {
        name.replace(AC_PREFIX, "")
        for name, param in model.named_parameters(remove_duplicate=False)
        if not param.requires_grad
    }


def resolve(setting: str, model: torch.nn.Module) -> str:
    """``checkpoint.weights`` for this model: ``auto`` is ``trainable`` when the frozen
    parameters are more than half of all (each shared one once)."""
    if setting in (FULL, TRAINABLE):
        return setting
    seen: set[int] = set()
    frozen = total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
            frozen += 0 if param.requires_grad else param.numel()
    return TRAINABLE if total and frozen * 2 > total else FULL


def trainable_state(state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """``state`` (a full state dict of ``model``) without its frozen parameters."""
    frozen = frozen_names(model)
    return {k: v for k, v in state.items() if k not in frozen}


def check_loaded(result: Any, model: torch.nn.Module) -> None:
    """After ``load_state_dict(strict=False)`` of a trainable state: nothing unexpected,
    and nothing missing but frozen parameters (RuntimeError otherwise, as a strict
    load would raise)."""
    frozen = frozen_names(model)  # activation checkpointing's wrapper names: not in them
    missing = [k for k in result.missing_keys if k.replace(AC_PREFIX, "") not in frozen]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"the trainable state does not fit: missing {missing[:5]}, unexpected "
            f"{list(result.unexpected_keys)[:5]}"
        )


@dataclass
class Base:
    """The frozen parameters of a built model, fingerprinted (``fingerprint``)."""

    tensors: dict[str, dict[str, Any]]  # name -> shape, dtype, checksum
    checksum: str
    parameters: int
    bytes: int
    reference: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "checksum": self.checksum,
            "hash": checksums.HASH,
            "parameters": self.parameters,
            "bytes": self.bytes,
            "reference": self.reference,
            "tensors": self.tensors,
        }

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1) + "\n").encode()


def fingerprint(model: torch.nn.Module, reference: dict[str, Any] | None = None) -> Base | None:
    """The frozen parameters of ``model`` (whole, not sharded: before FSDP), each
    shared one once, by name; None when every parameter trains. Reads each frozen
    tensor once (XXH3-128, ~5 GB/s a core)."""
    tensors: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()
    parameters = size = 0
    for name, param in model.named_parameters():  # a tied one under its first name
        if param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        data = param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        tensors[name.replace(AC_PREFIX, "")] = {
            "shape": list(param.shape),
            "dtype": str(param.dtype).removeprefix("torch."),
            checksums.HASH: checksums.digest(data),
        }
        parameters += param.numel()
        size += data.nbytes
    if not tensors:
        return None
    lines = "\n".join(
        f"{n} {t['shape']} {t['dtype']} {t[checksums.HASH]}" for n, t in tensors.items()
    )
    return Base(tensors, checksums.digest(lines.encode()), parameters, size, reference or {})


def parse(data: Any, where: str) -> dict[str, Any]:
    """A ``base.json`` read from a checkpoint (or a final weights file's metadata):
    its checksum and its tensors' entries, checked; CheckpointError otherwise."""
    try:
        return check_base(json.loads(data) if isinstance(data, str | bytes) else data)
    except ValueError as err:  # json's errors are ValueErrors too
        raise CheckpointError(f"{where}: not a base reference ({err})") from None


def differences(ours: Base | None, theirs: dict[str, Any]) -> list[str]:
    """How this run's frozen base differs from the one a checkpoint was trained on."""
    if ours is None:
        count = len(theirs["tensors"])
        return [f"this model has no frozen parameters; the checkpoint's base had {count}"]
    if ours.checksum == theirs["checksum"]:
        return []
    mine, saved = ours.tensors, theirs["tensors"]
    out = [f"{n} is missing here" for n in saved if n not in mine]
    out += [f"{n} is new here" for n in mine if n not in saved]
    for name in (n for n in saved if n in mine):
        a, b = mine[name], saved[name]
        if (a["shape"], a["dtype"]) != (b.get("shape"), b.get("dtype")):
            there = f"{b.get('dtype')} {b.get('shape')}"
            out.append(f"{name} is {a['dtype']} {a['shape']} here, {there} there")
        elif a[checksums.HASH] != b[checksums.HASH]:
            out.append(f"{name} holds other values")
    return out or ["the base's total checksum differs"]


def check(ours: Base | None, theirs: dict[str, Any], where: Path | str) -> None:
    """ConfigError (exit 2) when this run's base is not the one ``where`` was trained
    on: the adapter would be loaded onto other weights."""
    found = differences(ours, theirs)
    if not found:
        return
    more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
    ref = theirs.get("reference") or {}
    built = ", ".join(f"{k}={json.dumps(v)[:200]}" for k, v in ref.items()) or "its config"
    raise ConfigError(
        f"{where} holds trainable weights only, trained on a frozen base that this run's "
        f"base is not ({len(found)} of its tensors differ: {'; '.join(found[:5])}{more}). "
        f"That base was built from {built}, checksum {theirs['checksum']}; this one's is "
        f"{ours.checksum if ours else 'none'}. Give the run the base it was trained on (the "
        "same model.pretrained weights, seed and init_from), or start a new run"
    )
