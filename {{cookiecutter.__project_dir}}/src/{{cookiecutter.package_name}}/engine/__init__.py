"""The engine: everything but the task, the models and the data (docs/layout.md).
The owner's files reach it only through ``contract.py``."""
