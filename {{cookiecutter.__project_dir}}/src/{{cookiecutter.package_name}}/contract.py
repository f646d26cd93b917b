"""What the owner's files (``tasks/``, ``models/``, ``data/``, ``callbacks/``) use of the
engine, and all they use of it: a callback subclasses ``Callback``; a task subclasses
``TaskDefaults`` (the interface is ``Task``; its ``training_step`` takes the ``Step``'s
verbs), averages its evaluation with
``average_over_batches`` and groups the parameters with ``decay_groups``; a model or
data function checks its arguments with ``require`` (a bad value is a ``ConfigError``:
exit 2 before any work); a data function returns ``make_loaders(...)``, and text data
tokenizes with ``load_tokenizer``; data that caches what it builds holds ``locked``
meanwhile, so one process of a launch builds and the others read (docs/own-model.md,
docs/data.md).
"""

from .engine.batch_means import average_over_batches
from .engine.callbacks import Callback
from .engine.config import ConfigError, require
from .engine.files import locked
from .engine.loaders import DataLoaders, make_loaders
from .engine.param_groups import decay_groups
from .engine.step import Step
from .engine.task import Task, TaskDefaults
from .engine.tokenizer import load_tokenizer

# Data arguments that never change which samples a step sees: a resumed run may change
# them (a data function lists them as its ``resume_may_change``).
LOADER_KEYS = ("num_workers", "pin_memory", "val_batch_size")

__all__ = [
    "LOADER_KEYS",
    "Callback",
    "ConfigError",
    "DataLoaders",
    "Step",
    "Task",
    "TaskDefaults",
    "average_over_batches",
    "decay_groups",
    "load_tokenizer",
    "locked",
    "make_loaders",
    "require",
]
