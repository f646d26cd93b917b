"""The engine's version (semver), in one place: pyproject.toml reads it, every
checkpoint records it (checkpoint/format.py), RELEASES.md maps it to a commit."""

__version__ = "0.2.0"
