"""The site bus: one contract (:mod:`cluster.bus.contract`), two backends.

``open_bus(config, role=...)`` joins ``config.group`` on the backend named by
``config.backend`` (``"embedded"`` or ``"corosync"``) and hands out a
:class:`BusMember`; leaving the ``async with`` block leaves the group.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from cluster.bus.contract import (
    BusConfig,
    BusEvent,
    BusMember,
    BusStatistics,
    Delivery,
    MemberId,
    SupportsStatistics,
    ViewChange,
)
from protocol.errors import BusError
from protocol.modes import Role

__all__ = [
    "BACKENDS",
    "BusConfig",
    "BusEvent",
    "BusMember",
    "BusStatistics",
    "Delivery",
    "MemberId",
    "SupportsStatistics",
    "ViewChange",
    "open_bus",
]

BACKENDS = ("embedded", "corosync")


@asynccontextmanager
async def open_bus(config: BusConfig, *, role: Role) -> AsyncIterator[BusMember]:
    """Join the site bus described by ``config``.

    Raises ``BusError`` when the backend is unknown or the engine cannot be
    reached; the member's event stream raises ``BusError`` when the connection
    is lost later.
    """
    if config.backend == "embedded":
        from cluster.bus.embedded import open_embedded_member

        async with open_embedded_member(config, role=role) as member:
            yield member
    elif config.backend == "corosync":
        from cluster.bus.corosync import open_corosync_member

        async with open_corosync_member(config, role=role) as corosync_member:
            yield corosync_member
    else:
        raise BusError(
            f"unknown bus backend {config.backend!r}; valid backends: {', '.join(BACKENDS)}"
        )
