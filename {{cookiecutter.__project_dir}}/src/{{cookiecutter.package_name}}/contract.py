"""What the owner's files (``task.py``, ``models/``, ``data/``) use of the engine, and
all they use of it: a model or data function checks its arguments with ``require``
(a bad value is a ``ConfigError``: exit 2 before any work) and a data function
returns ``make_loaders(...)`` (docs/own-model.md, docs/data.md).
"""

from .engine.config import ConfigError, require
from .engine.loaders import DataLoaders, make_loaders

# Data arguments that never change which samples a step sees: a resumed run may change
# them (a data function lists them as its ``resume_may_change``).
LOADER_KEYS = ("num_workers", "pin_memory", "val_batch_size")

__all__ = ["LOADER_KEYS", "ConfigError", "DataLoaders", "make_loaders", "require"]
