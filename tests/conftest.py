"""The suite runs on as many pytest-xdist workers as the machine has cores (``-n auto`` in
pyproject.toml), each test file on one worker (its module fixtures built once).

A test marked ``alone`` measures the machine (``autopar calibrate``'s timings), which other
work on the cores would distort: it runs with no other worker's test running. Every test
holds a shared lock on one file for the run, from the first fixture it sets up to its
teardown; an ``alone`` test holds it exclusively.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: nothing else runs
        return (yield)
    path = os.path.join(tempfile.gettempdir(), f"autopar-tests-{run}.lock")
    alone = item.get_closest_marker("alone") is not None
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            return (yield)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
