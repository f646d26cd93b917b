"""Checkpoints: atomic, verified, safe to load, and a resume that continues bit-exactly.

``format`` (one checkpoint's files, manifest, verify, safe load), ``folder``
(the checkpoints folder: names, pointers, pruning), ``policy`` (when to save),
``resume`` (the one plan of where a launch continues), ``manager`` (saving,
restoring), ``commit`` (the save protocol's writing half), ``async_save``
(staging, background writer), ``full_state`` (model and optimizer state
gathered to full tensors), ``sharded`` (per-rank DCP safetensors shards),
``elastic`` (resuming on another number of processes), ``__main__`` (the
list/verify/export CLI). docs/checkpoints.md.
"""

from .folder import committed_checkpoints
from .format import CheckpointError, ConfigMismatch, load_tensors_safely, verify_checkpoint
from .full_state import plain_model, save_final_weights
from .manager import CheckpointManager
from .resume import ResumePlan, plan_resume

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ResumePlan",
    "ConfigMismatch",
    "committed_checkpoints",
    "load_tensors_safely",
    "plain_model",
    "plan_resume",
    "save_final_weights",
    "verify_checkpoint",
]
