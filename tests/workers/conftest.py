"""Fixtures of the worker tests (the suite's own are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.runtime import Worker, started_workers


@pytest.fixture
def workers() -> Iterator[dict[str, Worker]]:
    """Two worker runtimes, wA and wB, served in this process (tests/helpers/runtime.py)."""
    with started_workers() as ws:
        yield ws
