"""The training engine: everything a baked project runs but does not own (run dir,
checkpoints, resume, parallel, trackers, seeding, preflight, recovery). A project's
own files reach it only through their ``contract.py``; ``python -m training_engine
eject`` copies it into a project that wants to own it."""

from .version import __version__

__all__ = ["__version__"]
