"""The project's tasks, one class each, picked with ``task=NAME`` (configs/task/)."""
