"""Checkpoints: atomic, verified, safe to load, and a resume that continues bit-exactly.

The save path: ``manager`` (when to save, staging the state; restoring), ``save``
(write, manifest, commit, pointers, prune; sync or in the background) and
``folder`` (the checkpoints folder: names, pointers, what pruning removes).
``format`` (the file names, manifest, verify, safe load), ``policy`` (when to
save), ``resume`` (the one plan of where a launch continues), ``full_state`` /
``sharded`` / ``ties`` (what the model and optimizer state is, full or per-rank
shards, tied parameters once), ``elastic`` (resuming on another number of
processes), ``__main__`` (the list/verify/export CLI). docs/checkpoints.md.
"""

from .folder import committed_checkpoints
from .format import CheckpointError, ConfigMismatch, load_tensors_safely, verify_checkpoint
from .full_state import final_weights_problem, plain_model, save_final_weights
from .manager import CheckpointManager
from .resume import ResumePlan, plan_resume

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ConfigMismatch",
    "ResumePlan",
    "committed_checkpoints",
    "final_weights_problem",
    "load_tensors_safely",
    "plain_model",
    "plan_resume",
    "save_final_weights",
    "verify_checkpoint",
]
