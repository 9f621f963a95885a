"""An in-memory site bus: one hub, members in the same trio run.

Theory of operation
-------------------
``MemoryBus`` is the engine.  Every event (a multicast, a view change) is put,
in one step without a checkpoint, into the event queue of every current
member, so the order in which the hub takes events *is* the agreed order and
every member sees the same events in the same order, views included.  A
member's first event is the view that adds it.

``multicast`` waits until every member's queue has room (the bus runs at the
pace of its slowest reader, as the embedded sequencer does), then delivers:
it returns once the message is queued everywhere, so ``leave`` has nothing
left to send.  View changes never wait for a reader (a member that has left
must not stall the hub); they exceed the queue bound by at most the number of
views.  ``kill`` drops a member without a goodbye: the others see it leave,
its own stream ends with ``BusError`` as a lost connection does.

``quorate`` is true when more than half of ``expected_members`` are members
(always, without an expected size) unless ``set_quorate`` overrides it; a
change posts a view with the same members, as corosync does on a quorum
change.  No sockets and no clock: tests run under ``autojump_clock``.

``open_memory_member(hub)`` is an ``open_bus``-shaped opener on a hub, for
``SiteMember(..., open_member=...)``; ``MemorySite`` starts
``cluster.member.SiteMember`` instances on a hub that way.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import trio

from cluster.bus.contract import BusConfig, BusEvent, BusStatistics, Delivery, MemberId, ViewChange
from cluster.member import NullObserver, SiteMember
from protocol.errors import BusError
from protocol.modes import Role

EVENTS_QUEUE_LIMIT = 128  # as the embedded bus: the bound the contract suite checks


class MemoryBus:
    """The hub of one group.  Members join with :meth:`join`."""

    def __init__(self, *, expected_members: int | None = None, group: str | None = None) -> None:
        self.expected_members = expected_members
        self.group = group  # when set, ``open_memory_member`` refuses other groups
        self._members: dict[MemberId, MemoryMember] = {}
        self._pids = itertools.count(1)
        self._view_id = 0
        self._quorate: bool | None = None
        self._room = trio.Event()
        self._opened: trio.Event | None = None  # set while multicasts are held
        self.held = 0  # multicasts waiting for release()

    @property
    def members(self) -> tuple[MemberId, ...]:
        return tuple(sorted(self._members))

    @property
    def quorate(self) -> bool:
        if self._quorate is not None:
            return self._quorate
        if self.expected_members is None:
            return True
        return 2 * len(self._members) > self.expected_members

    @asynccontextmanager
    async def join(self, node: int, *, role: Role = Role.ADMIN) -> AsyncIterator[MemoryMember]:
        """Join as a member on ``node``; leave on exit.  ``role`` is not the bus's concern."""
        await trio.lowlevel.checkpoint()
        member = MemoryMember(self, MemberId(node, next(self._pids)))
        self._members[member.me] = member
        self._view(joined=(member.me,), left=())
        try:
            yield member
        finally:
            self.remove(member, error=None)

    def kill(self, me: MemberId) -> None:
        """Drop member ``me`` without a goodbye: a process killed, a connection lost."""
        member = self._members.get(me)
        if member is not None:
            self.remove(member, error=BusError(f"member {me} was killed (memory bus)"))

    def set_quorate(self, quorate: bool | None) -> None:
        """Force the quorum state (``None``: back to ``expected_members``); posts a view."""
        self._quorate = quorate
        self._view(joined=(), left=())

    def remove(self, member: MemoryMember, *, error: BusError | None) -> None:
        """Take ``member`` out and post the view: ``error=None`` is a leave (its
        stream ends after what it holds), an error a lost connection."""
        if self._members.pop(member.me, None) is None:
            return
        member._end(error)
        self._view(joined=(), left=(member.me,))
        self._wake_senders()  # its full queue no longer holds anyone up

    def _view(self, *, joined: tuple[MemberId, ...], left: tuple[MemberId, ...]) -> None:
        self._view_id += 1
        view = ViewChange(self._view_id, self.members, joined, left, self.quorate)
        for member in self._members.values():
            member._put(view)

    def hold(self) -> None:
        """Keep every multicast from here on from being delivered (each
        sender waits, counted in ``held``) until :meth:`release`: a bus that
        stalls between a member's send and its delivery."""
        if self._opened is None:
            self._opened = trio.Event()

    def release(self) -> None:
        if self._opened is not None:
            self._opened.set()
            self._opened = None

    async def _multicast(self, sender: MemoryMember, payload: bytes) -> None:
        while self._opened is not None:
            self.held += 1
            try:
                await self._opened.wait()
            finally:
                self.held -= 1
            sender._check()
        while full := {m for m in self._members.values() if m.full}:
            # Backpressure on both sides: the sender waits, the full readers hold it up.
            for member in full | {sender}:
                member._send_waits += 1
            await self._room.wait()
            sender._check()
        delivery = Delivery(sender.me, payload)
        for member in self._members.values():
            member._put(delivery)

    def _wake_senders(self) -> None:
        self._room.set()
        self._room = trio.Event()


class MemoryMember:
    """A member of a :class:`MemoryBus` (the ``BusMember`` contract)."""

    def __init__(self, hub: MemoryBus, me: MemberId) -> None:
        self.me = me
        self._hub = hub
        self._queue: collections.deque[BusEvent] = collections.deque()
        self._arrived = trio.Event()
        self._send_lock = trio.Lock()  # multicasts are queued in call order
        self._ended = False
        self._error: BusError | None = None
        self._queued_max = 0
        self._delivered = 0
        self._multicast = 0
        self._send_waits = 0

    @property
    def full(self) -> bool:
        return len(self._queue) >= EVENTS_QUEUE_LIMIT

    async def multicast(self, payload: bytes) -> None:
        async with self._send_lock:
            self._check()
            await self._hub._multicast(self, bytes(payload))
            self._multicast += 1

    def events(self) -> AsyncIterator[BusEvent]:
        return self  # the one stream: the member is its own iterator

    async def leave(self) -> None:
        await trio.lowlevel.checkpoint()
        self._hub.remove(self, error=None)

    def statistics(self) -> BusStatistics:
        return BusStatistics(
            events_queued=len(self._queue),
            events_queued_max=self._queued_max,
            events_queue_limit=EVENTS_QUEUE_LIMIT,
            delivered=self._delivered,
            multicast=self._multicast,
            send_waits=self._send_waits,
        )

    def __aiter__(self) -> MemoryMember:
        return self

    async def __anext__(self) -> BusEvent:
        await trio.lowlevel.checkpoint()  # before taking: a cancel loses no event
        while not self._queue:
            if self._ended:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._arrived = trio.Event()
            await self._arrived.wait()
        was_full = self.full
        event = self._queue.popleft()
        if was_full:
            self._hub._wake_senders()
        return event

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self._ended:
            raise BusError(f"member {self.me} has left the bus; it cannot multicast")

    def _put(self, event: BusEvent) -> None:
        self._queue.append(event)
        if isinstance(event, Delivery):
            self._delivered += 1
        self._queued_max = max(self._queued_max, len(self._queue))
        self._arrived.set()

    def _end(self, error: BusError | None) -> None:
        self._ended = True
        self._error = error
        if error is not None:
            self._queue.clear()  # a lost connection: what was not read is gone
        self._arrived.set()


def open_memory_member(
    hub: MemoryBus,
) -> Callable[..., AbstractAsyncContextManager[MemoryMember]]:
    """An ``open_bus``-shaped opener on ``hub``: ``opener(config, *, role)``
    joins as ``config.node``."""

    def open_bus(config: BusConfig, *, role: Role) -> AbstractAsyncContextManager[MemoryMember]:
        if hub.group is not None and config.group != hub.group:
            raise BusError(f"this memory bus serves group {hub.group!r}, not {config.group!r}")
        return hub.join(config.node, role=role)

    return open_bus


class MemorySite:
    """``cluster.member.SiteMember`` instances on one hub."""

    cluster = "site-p"
    READY_TIMEOUT_S = 30.0  # virtual seconds under autojump_clock: a hang fails at once

    def __init__(self, hub: MemoryBus, nursery: trio.Nursery) -> None:
        self.hub = hub
        self.members: list[SiteMember] = []
        self._nursery = nursery
        self._scopes: dict[int, trio.CancelScope] = {}
        self._nodes = itertools.count(1)

    async def join(self, count: int = 1) -> list[SiteMember]:
        """Start ``count`` members at once; return them when all are ready."""
        opener = open_memory_member(self.hub)
        joining = [
            SiteMember(
                self.cluster,
                BusConfig("memory", self.cluster, next(self._nodes)),
                role=Role.BROKER,
                observer=NullObserver(),
                open_member=opener,
            )
            for _ in range(count)
        ]
        for member in joining:
            self._scopes[id(member)] = scope = trio.CancelScope()
            self._nursery.start_soon(self._serve, member, scope)
        with trio.fail_after(self.READY_TIMEOUT_S):
            for member in joining:
                await member.ready.wait()
        self.members += joining
        return joining

    def stop(self, member: SiteMember) -> None:
        """End ``member``'s task: it leaves the bus as its process would on exit."""
        self._scopes.pop(id(member)).cancel()
        self.members.remove(member)

    @staticmethod
    async def _serve(member: SiteMember, scope: trio.CancelScope) -> None:
        with scope:
            await member.serve()
