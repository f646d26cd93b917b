"""The engine: everything but the task, the models and the data (README.md, "Layout").
The owner's files reach it only through ``contract.py``."""
