"""Fixtures of the integration tests (the suite's own are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from rallypoint.client.compile import CompiledProgram
from tests.helpers.cluster import STEPS, pipeline_and_digest


@pytest.fixture(scope="module")
def pipeline() -> tuple[CompiledProgram, str]:
    """The 4-stage pipeline of STEPS steps compiled, and its reference digest (made once per session)."""
    return pipeline_and_digest(STEPS)
