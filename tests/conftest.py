"""Suite-wide settings."""

from __future__ import annotations

import os

import pytest
import trio
from hypothesis import HealthCheck, settings

from tests.support.membus import MemoryBus, MemorySite

# CI explores more examples; a developer's fast run stays fast.
settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
async def memory_site(nursery: trio.Nursery) -> MemorySite:
    """Site members on one in-memory bus (tests/support/membus.py), for tests
    under ``autojump_clock``: ``await memory_site.join(3)`` starts three
    ``SiteMember`` and returns them once every one holds the site state."""
    return MemorySite(MemoryBus(group=MemorySite.cluster), nursery)
