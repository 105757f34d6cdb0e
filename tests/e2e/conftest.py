"""The end-to-end tests' fleet: every service as a real process on a nats-server of its own."""

from __future__ import annotations

import pytest

from .fleet_harness import Fleet


@pytest.fixture
async def fleet(tmp_path):
    """A started :class:`Fleet` in ``tmp_path``, closed after the test."""
    f = Fleet(tmp_path)
    try:
        await f.start()
        yield f
    finally:
        await f.close()
