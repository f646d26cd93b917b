"""Checkpoints: atomic, verified, safe to load, and a resume that continues bit-exactly.

``format`` (one checkpoint's files, manifest, verify, safe load), ``folder``
(the checkpoints folder: names, pointers, pruning), ``policy`` (when to save),
``manager`` (saving, what to resume), ``commit`` (the save protocol's writing
half), ``async_save`` (staging, background writer), ``full_state`` (model and
optimizer state gathered to full tensors), ``sharded`` (per-rank DCP safetensors
shards), ``elastic`` (resuming on another number of processes), ``__main__``
(the list/verify/export CLI). docs/checkpoints.md.
"""

from .elastic import plan_grad_accum
from .folder import committed_checkpoints
from .format import CheckpointError, ConfigMismatch, load_tensors_safely, verify_checkpoint
from .full_state import plain_model, save_final_weights
from .manager import CheckpointManager

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ConfigMismatch",
    "committed_checkpoints",
    "load_tensors_safely",
    "plain_model",
    "plan_grad_accum",
    "save_final_weights",
    "verify_checkpoint",
]
