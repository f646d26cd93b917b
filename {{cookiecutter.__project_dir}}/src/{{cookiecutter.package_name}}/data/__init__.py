"""The data: the examples (``digits.py``, ``tokens.py``, ``hf.py``, ``images.py``, ``text.py``,
``chat.py``)
and yours. Each is a ``configs/data/<name>.yaml`` whose ``_target_`` is a function
returning ``contract.make_loaders(...)`` (docs/data.md)."""
