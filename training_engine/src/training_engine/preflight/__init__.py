"""Preflight: check the machine and the run before hours of training.

``report.run_preflight`` (the entry point), ``checks`` (devices, memory, disk,
speed, distributed, trackers), ``probe`` (checkpoint round trip and timed steps).
docs/preflight.md.
"""

from .checks import PreflightFailed
from .report import run_preflight

__all__ = ["PreflightFailed", "run_preflight"]
