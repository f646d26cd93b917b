"""The models: the examples (``digits.py``: MLP, CNN; ``gpt.py``) and yours.
Each is a ``configs/model/<name>.yaml`` whose ``_target_`` is here (docs/own-model.md)."""
