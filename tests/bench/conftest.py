"""Fixtures shared by the load generator's tests."""

from __future__ import annotations

import pytest

from tests.bench.fake_server import FakeThread


@pytest.fixture(scope="module")
def fake_target():
    """The fake server on its own event loop in a daemon thread; its gRPC target."""
    with FakeThread() as fake:
        yield fake.target
