"""The moments of a run's life, named once, in the order a run passes them.

``reached(moment, step)`` is called at each of them by the code that walks through it
(claim.py, preflight, the trainer's loop and its end, a save). Here it does nothing:
the fault-injection tests (engine_tests/train_with_faults.py) replace it to stop a
process exactly there, and their fault matrix (engine_tests/test_fault_matrix.py)
takes its rows from these tuples, so a moment added here is a moment tested. A
moment of a save is ``SAVE``'s; the watchdog's phases (watchdog.PHASES) are among
``LIFE``. docs/recovery.md, "What a fault at each moment leaves".
"""

from __future__ import annotations

# A run's life: the moments a fault can come at, in order.
LIFE = (
    "claim",  # the run dir locked and decided, the attempt staged (claim.py)
    "preflight",  # preflight's round trip: its restore point saved (preflight/probe.py)
    "first_step",  # the first optimizer step of an attempt done (the watchdog's first_step)
    "step",  # a later optimizer step done, not yet logged or saved (the watchdog's step)
    "eval",  # an evaluation done and logged, its step not yet saved (the watchdog's eval)
    "save",  # a checkpoint on its way to disk: SAVE's moments (the watchdog's save)
    "final_checkpoint",  # the end: the last checkpoint committed, nothing else yet
    "final_weights",  # model.safetensors written, not yet renamed into place
    "trackers",  # the final weights in place; the trackers not yet finished
    "summary",  # summary.json (the commit record) written, not yet renamed into place
    "exit",  # everything committed; the process group and the process about to end
)
# The moments of a save (checkpoint/save.py): a kill at each leaves an older checkpoint.
SAVE = ("between_files", "before_rename", "before_pointers", "pruning")


def reached(moment: str, step: int | None = None) -> None:
    """The run is at ``moment`` (of ``LIFE`` or ``SAVE``), after optimizer step
    ``step`` where it has one. A no-op: only the fault-injection tests replace it."""
