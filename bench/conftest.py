"""The bench's tests run against a project the template baked: ``BENCH_PROJECT``
names it. The template's own tests (tests/test_bake.py) run them inside the default
bake's suite, in its fresh environment (`make test`); by hand:
``BENCH_PROJECT=build/demo/digit_trainer pytest bench`` (`make demo` bakes it)."""

import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # bench_turns, bench_project: as the bench's scripts see them


def pytest_configure(config: pytest.Config) -> None:
    # The baked project's markers, also when these tests run from the template.
    config.addinivalue_line("markers", "multiprocess: runs several processes")
    config.addinivalue_line("markers", "slow: full-length or repeated runs")


@pytest.fixture
def project() -> Path:
    """The baked project under test (the bench's ``--project``)."""
    where = os.environ.get("BENCH_PROJECT")
    if not where:
        pytest.skip("BENCH_PROJECT=<a baked project> runs it (make test does, in the default bake)")
    return Path(where).resolve()
