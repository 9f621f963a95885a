"""The site bus contract: what every backend promises (docs/architecture.md, section 4).

A member joins one group and gets one stream of events in agreed order:
``Delivery`` for each multicast message (its own included) and ``ViewChange``
whenever the membership changes.  Every member that survives a view change
sees it at the same point of its stream and sees the same messages in the
same order between view changes.  ``multicast`` returns once the message
is queued in the member's bounded send buffer, in call order, and waits
while that buffer is full (backpressure): nothing is buffered without bound.
A member's own delivery of a message confirms it; ``leave`` sends the
buffer first.  A lost
connection to the engine (corosync or the sequencer) ends the stream with
:class:`protocol.errors.BusError`.

Roles and readiness are not part of the bus: the application announces them
with a bus command of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from cluster.addresses import Address


@dataclass(frozen=True, slots=True, order=True)
class MemberId:
    """One member of a group: the node it runs on and a process number."""

    node: int  # site node id (corosync nodeid; embedded: from the caller)
    pid: int  # corosync: the CPG pid; embedded: the sequencer's connection number

    def __str__(self) -> str:
        return f"{self.node}.{self.pid}"


@dataclass(frozen=True, slots=True)
class Delivery:
    """A message, delivered in agreed order."""

    sender: MemberId
    payload: bytes  # exactly what was multicast (reassembled if chunked)


@dataclass(frozen=True, slots=True)
class ViewChange:
    """The membership changed (or, corosync only, the quorum state did)."""

    view_id: int  # increases with each view change a member sees
    members: tuple[MemberId, ...]  # sorted ascending
    joined: tuple[MemberId, ...]
    left: tuple[MemberId, ...]
    quorate: bool


BusEvent = Delivery | ViewChange


@dataclass(frozen=True, slots=True)
class BusConfig:
    """How to join a site bus."""

    backend: str  # "embedded" | "corosync"
    group: str
    node: int  # this node's id (embedded needs it; corosync reads its own nodeid and checks)
    address: Address | None = None  # embedded: the sequencer
    # embedded: the site's bus key (cluster/bus/auth.py); corosync
    # authenticates nodes with its own authkey (totem.keyfile) instead.
    key_file: str | None = None
    # The site's brokers keep journals (cluster/journal.py): a site that starts
    # with no member alive waits for this many brokers to report what they
    # recovered, and continues from the most advanced (0: a site in memory,
    # which starts from nothing).  Every member of the site says the same.
    expect_brokers: int = 0
    # corosync: the network namespace its daemon serves, when not the host's
    # (the lab's nodes); the admin commands join from inside it (gateway/netns.py).
    netns: str | None = None


@dataclass(frozen=True, slots=True)
class BusStatistics:
    """A snapshot of a member's buffers (for metrics and the backpressure tests).

    ``events_queued`` is what waits for the application to read it now;
    ``events_queued_max`` is the most that ever waited; ``events_queue_limit``
    is the bound neither can exceed.  ``send_waits`` counts backpressure on
    either side: the times ``multicast`` had to wait for the bus, and the
    times the member stopped taking events from the bus because its queue
    was full (the bus then waits for the reader).
    """

    events_queued: int
    events_queued_max: int
    events_queue_limit: int
    delivered: int
    multicast: int
    send_waits: int
    pending_reassembly_bytes: int = 0


class BusMember(Protocol):
    """A joined member.  Obtained from :func:`cluster.bus.open_bus`."""

    me: MemberId

    async def multicast(self, payload: bytes) -> None:
        """Send ``payload`` to every member (this one included); waits under backpressure.

        Returns once ``payload`` is queued (not yet delivered); raises
        ``BusError`` when the connection to the bus is lost.
        """
        ...

    def events(self) -> AsyncIterator[BusEvent]:
        """The one event stream; its first event is the ViewChange that includes ``me``."""
        ...

    async def leave(self) -> None:
        """Leave the group, after sending what ``multicast`` queued.

        The stream ends after the events already received.
        """
        ...


@runtime_checkable
class SupportsStatistics(Protocol):
    """Backends also expose :class:`BusStatistics` (not part of ``BusMember``)."""

    def statistics(self) -> BusStatistics: ...
