"""The broker node: site state replicated over the bus, served to AMQP 1.0 clients.

Theory of operation
-------------------
A node is a member of its site's bus.  Everything that changes state (a
publish, an acquire, an accept, a declare) is turned into a command and
multicast; nothing changes the local state directly.  One task, the
*applier*, reads the bus stream in agreed order, applies each command to the
state (:func:`cluster.state.apply`) and acts on the effects that concern this
node: settle a client's publish, hand an acquired message to a local consumer,
refuse with an AMQP error.  So every node holds the same state, and a publish
is settled only once its command has come back on the bus, i.e. once it is in
every member's state.

Flow control end to end: commands go through one bounded channel to the
*multicaster* task, which batches them into frames and awaits the bus's
backpressure.  An AMQP callback that cannot put its command in the channel
waits, which stops that connection's pump, which stops granting credit.
Credit on incoming links is a fixed window of unsettled publishes per link.

Consumers: a consumer's credit becomes ``Acquire(queue, session, consumer,
count)``; the state hands out the first available messages, in stream order,
so two consumers on different nodes never get the same message.  When an
acquire finds nothing, the consumer waits for the next enqueue or release on
its queue and asks again.

Joining: see :mod:`cluster.membership`; the node buffers its stream until its
snapshot arrives in ``StateChunk`` commands.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import random
import ssl
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
from proton import Message

from cluster import state as st
from cluster.amqp import (
    ACCEPTED,
    Accepted,
    AmqpConnection,
    InboundDelivery,
    IncomingLink,
    Modified,
    Outcome,
    OutgoingLink,
    Rejected,
    Released,
    serve_amqp,
)
from cluster.bus import BusConfig, Delivery, MemberId, ViewChange, open_bus
from cluster.membership import Membership, Rejoin, SendSnapshot, StartGenesis
from cluster.state.model import SiteState
from protocol import cluster as pc
from protocol.errors import BusError, DrgateError
from protocol.modes import Mode, Role

log = logging.getLogger(__name__)

# Unsettled publishes per incoming link: enough to fill a bus frame from one
# busy producer, small enough that a stalled bus stops clients quickly.
PUBLISH_WINDOW = 200
# Commands per bus frame, and bytes: batching amortises the bus's per-message
# cost (corosync handles ~30k messages/s) without making frames
# so large that they hold up the stream.
FRAME_MAX_COMMANDS = 200
FRAME_MAX_BYTES = 256 * 1024
# Commands waiting for the multicaster: the bound that turns a slow bus into
# backpressure on clients.
COMMAND_QUEUE = 1000
# Snapshot bytes per StateChunk command.
CHUNK_BYTES = 512 * 1024
# The AMQP error condition of what a broker refuses in a minority partition.
MINORITY_CONDITION = "amqp:precondition-failed"
# Addresses of the management interface (see docs/broker.md).
ADMIN_ADDRESS = "$drgate.admin"
QUEUES_ADDRESS = "$drgate.queues"

# Snapshot envelope: node-level header around the state snapshot.
#   cut u64 | ready count u32 | ready (node u32, pid u32)...
_ENVELOPE = struct.Struct(">QI")
_MEMBER = struct.Struct(">II")


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """A broker's settings, built once at start-up (see gateway/config.py)."""

    cluster: str
    node: int
    bus: BusConfig
    amqp_host: str = "127.0.0.1"
    amqp_port: int = 5672
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    metrics: str | None = None  # observability HOST:PORT (served by gateway/commands/broker.py)


@dataclass(slots=True)
class _Consumer:
    link: OutgoingLink
    queue: str
    session: int
    id: int
    acquiring: int = 0  # requested in Acquire commands not yet applied
    unsettled: dict[int, int] = field(default_factory=dict)  # pos -> pos


@dataclass(frozen=True, slots=True)
class _Barrier:
    """Marks a point in the command channel; ``event`` is set once every
    command before it has come back on the bus and been applied here."""

    event: trio.Event


@dataclass(slots=True)
class _Transfer:
    transfer: int
    chunks: list[bytes] = field(default_factory=list)


class SiteMember:
    """A member of a site's bus holding the whole site state: the stream
    machinery that brokers and sidecars share (multicaster, applier, joining,
    donating).  Subclasses act on what is applied through the hooks
    :meth:`_after_command`, :meth:`_after_frame` and :meth:`_after_view`."""

    role = Role.BROKER

    def __init__(self, cluster: str, bus: BusConfig) -> None:
        self.cluster = cluster
        self.bus_config = bus
        self.state = st.new_state()
        self.me: MemberId | None = None
        self.membership: Membership | None = None
        self._send, self._receive = trio.open_memory_channel[pc.Command | _Barrier](COMMAND_QUEUE)
        self._buffer: list[Delivery | ViewChange] | None = []
        self._transfer: _Transfer | None = None
        self._transfers_sent = itertools.count(1)
        # Commands the applier generates go here when the channel is full: the
        # applier must never wait for the multicaster (which may be waiting
        # for the bus, which waits for us to read).  Bounded by the consumers
        # and snapshots of this node.
        self._spill: list[pc.Command | _Barrier] = []
        self._frames_sent = 0  # own frames multicast
        self._frames_applied = 0  # own frames come back and applied
        self._barrier_events: dict[int, list[trio.Event]] = {}
        self._pending_restore: bytes | None = None
        self._member: Any = None
        self.ready = trio.Event()

    # ------------------------------------------------------------------
    # Service
    # ------------------------------------------------------------------

    async def serve_member(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Join the bus and follow the stream; ready (started) once this
        member holds the site state."""
        async with open_bus(self.bus_config, role=self.role) as member:
            self.me = member.me
            self.membership = Membership(member.me)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._multicaster, member)
                nursery.start_soon(self._applier, member)
                await self.ready.wait()
                task_status.started()

    async def submit(self, *commands: pc.Command) -> None:
        """Queue commands for multicast; waits while the bus is backpressured."""
        for cmd in commands:
            await self._send.send(cmd)

    async def submit_and_wait(self, *commands: pc.Command) -> None:
        """Multicast ``commands`` and wait until they have come back on the
        bus and been applied here (so every member has applied them)."""
        barrier = _Barrier(trio.Event())
        for cmd in commands:
            await self._send.send(cmd)
        await self._send.send(barrier)
        await barrier.event.wait()

    def _post(self, cmd: pc.Command) -> None:
        """Queue a command without waiting (for the applier)."""
        if self._spill:
            self._spill.append(cmd)
            return
        try:
            self._send.send_nowait(cmd)
        except trio.WouldBlock:
            self._spill.append(cmd)

    async def _multicaster(self, member: Any) -> None:
        while True:
            if self._spill:
                item: pc.Command | _Barrier = self._spill.pop(0)
            else:
                item = await self._receive.receive()
            batch: list[pc.Command] = []
            barriers: list[trio.Event] = []
            size = 0
            while True:
                if isinstance(item, _Barrier):
                    barriers.append(item.event)
                    break
                batch.append(item)
                size += len(getattr(item, "body", b""))
                if len(batch) >= FRAME_MAX_COMMANDS or size >= FRAME_MAX_BYTES:
                    break
                if self._spill:
                    item = self._spill.pop(0)
                    continue
                try:
                    item = self._receive.receive_nowait()
                except trio.WouldBlock:
                    break
            self._frames_sent += 1
            if barriers:
                self._barrier_events[self._frames_sent] = barriers
            await member.multicast(pc.encode_frame(batch))

    # ------------------------------------------------------------------
    # The stream
    # ------------------------------------------------------------------

    async def _applier(self, member: Any) -> None:
        assert self.membership is not None
        async for event in member.events():
            if isinstance(event, ViewChange):
                await self._on_view(event)
            else:
                self.membership.on_delivery()
                if self._buffer is not None:
                    self._buffer.append(event)
                    self._maybe_take_snapshot(event)
                    if self._pending_restore is not None:
                        blob, self._pending_restore = self._pending_restore, None
                        await self._finish_restore(blob)
                else:
                    await self._on_delivery(event)
        raise BusError("the site bus ended the stream")

    async def _on_view(self, view: ViewChange) -> None:
        assert self.membership is not None and self.me is not None
        actions = self.membership.on_view(view)
        self._view_seen(view)
        if self._buffer is not None:
            self._buffer.append(view)
        else:
            self._apply_view(view)
        for action in actions:
            if isinstance(action, StartGenesis):
                await self._start_genesis(action)
            elif isinstance(action, SendSnapshot):
                self._send_snapshot(action)
            elif isinstance(action, Rejoin):
                log.warning(
                    "this member was in a minority partition while the site went on: "
                    "dropping its state and joining again by state transfer"
                )
                self._buffer = [view]
                self._transfer = None
                self._on_rejoin()
        if view.left:
            log.info("members left: %s", ", ".join(map(str, view.left)))

    def _apply_view(self, view: ViewChange) -> None:
        effects = st.members_left(self.state, view.left) if view.left else []
        self._after_view(view, effects)

    async def _start_genesis(self, action: StartGenesis) -> None:
        # The whole site starts here with the empty state: apply what we
        # buffered since our join (every member of the cohort has the same).
        buffered = self._buffer or []
        self._buffer = None
        for event in buffered:
            if isinstance(event, ViewChange):
                self._apply_view(event)
            else:
                await self._on_delivery(event)
        if action.announce:
            self._post(pc.Genesis(self.cluster, random.getrandbits(64)))
        self._announce_ready()

    def _announce_ready(self) -> None:
        assert self.me is not None
        self._post(pc.MemberReady(self.role, self.me.node, self.me.pid))
        self.ready.set()

    def _send_snapshot(self, action: SendSnapshot) -> None:
        assert self.membership is not None
        ready = sorted(self.membership.ready)
        header = _ENVELOPE.pack(action.cut, len(ready)) + b"".join(
            _MEMBER.pack(m.node, m.pid) for m in ready
        )
        blob = header + st.snapshot(self.state)
        transfer = next(self._transfers_sent)
        pieces = [blob[i : i + CHUNK_BYTES] for i in range(0, len(blob), CHUNK_BYTES)] or [b""]
        log.info(
            "state transfer to %s: %d bytes in %d chunks, cut at %d events",
            action.target,
            len(blob),
            len(pieces),
            action.cut,
        )
        for index, piece in enumerate(pieces):
            self._post(
                pc.StateChunk(
                    action.target.node,
                    action.target.pid,
                    transfer,
                    index,
                    index == len(pieces) - 1,
                    piece,
                )
            )

    def _maybe_take_snapshot(self, event: Delivery) -> None:
        """While buffering: collect StateChunks addressed to me."""
        assert self.me is not None
        try:
            refs = pc.scan_frame_untrusted(event.payload)
        except DrgateError:
            return
        for ref in refs:
            if ref[0] != pc.Kind.STATE_CHUNK:
                continue
            chunk = pc.decode_ref_untrusted(event.payload, ref)
            assert isinstance(chunk, pc.StateChunk)
            if (chunk.target_node, chunk.target_pid) != (self.me.node, self.me.pid):
                continue
            key = chunk.transfer * 1_000_003 + event.sender.node * 65_537 + event.sender.pid
            if chunk.index == 0:
                self._transfer = _Transfer(key)
            if self._transfer is None or self._transfer.transfer != key:
                continue
            self._transfer.chunks.append(bytes(chunk.data))
            if chunk.final:
                blob = b"".join(self._transfer.chunks)
                self._transfer = None
                self._pending_restore = blob

    async def _finish_restore(self, blob: bytes) -> None:
        assert self.membership is not None and self._buffer is not None
        cut, count = _ENVELOPE.unpack_from(blob)
        offset = _ENVELOPE.size
        ready = set()
        for _ in range(count):
            node, pid = _MEMBER.unpack_from(blob, offset)
            offset += _MEMBER.size
            ready.add(MemberId(node, pid))
        self.state = st.restore_untrusted(blob[offset:])
        # _buffer[0] is the view that (re)joined me; the snapshot covers the
        # ``cut`` events after it.
        buffered = self._buffer[1 + cut :]
        self._buffer = None
        self.membership.on_restored(ready, self.membership.members)
        self._after_restore()
        log.info("state restored: cut at %d events, %d buffered to apply", cut, len(buffered))
        for event in buffered:
            if isinstance(event, ViewChange):
                self._apply_view(event)
            else:
                await self._on_delivery(event)
        self._announce_ready()

    async def _on_delivery(self, event: Delivery) -> None:
        assert self.me is not None and self.membership is not None
        own = event.sender == self.me
        try:
            commands = pc.decode_frame_untrusted(event.payload)
        except DrgateError as exc:
            # Every member refuses the same bytes the same way, so skipping
            # keeps the members identical; say so loudly.
            log.error("undecodable bus frame from %s skipped: %s", event.sender, exc)
            commands = []
        for cmd in commands:
            if isinstance(cmd, pc.MemberReady):
                self.membership.on_member_ready(event.sender)
            effects = st.apply(self.state, cmd, sender=event.sender)
            self._after_command(cmd, effects, event.sender, own)
        if own:
            self._frames_applied += 1
            for waiter in self._barrier_events.pop(self._frames_applied, ()):
                waiter.set()
        self._after_frame()

    # Hooks for subclasses (called by the applier, in stream order; they must
    # not wait: use _post to multicast).

    def _after_command(
        self, cmd: pc.Command, effects: Sequence[Any], sender: MemberId, own: bool
    ) -> None:
        """``cmd`` was applied (its cseq is ``self.state.cseq``)."""

    def _after_frame(self) -> None:
        """Every command of a delivered frame was applied."""

    def _after_view(self, view: ViewChange, effects: Sequence[Any]) -> None:
        """A view change was applied (members that left released their work)."""

    def _view_seen(self, view: ViewChange) -> None:
        """A view change was delivered (also while joining, before it is applied)."""

    def _on_rejoin(self) -> None:
        """The state is stale and will be replaced by a snapshot (see Rejoin)."""

    def _after_restore(self) -> None:
        """A snapshot replaced the state (first join, or a rejoin)."""


class BrokerNode(SiteMember):
    """One broker.  ``await nursery.start(node.serve)`` reports the AMQP port."""

    def __init__(self, config: BrokerConfig) -> None:
        super().__init__(config.cluster, config.bus)
        self.config = config
        self._refs = itertools.count(1)
        self._pending: dict[int, InboundDelivery] = {}
        self._sessions: dict[int, int] = {}  # connection id -> session
        self._consumers: dict[OutgoingLink, _Consumer] = {}
        self._by_consumer_id: dict[int, _Consumer] = {}
        self._consumer_ids = itertools.count(1)
        self._waiting_queues: set[str] = set()
        self._admin_lock = trio.Lock()
        self._admin_refusals: list[Any] | None = None
        self._was_minority = False

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.serve_member)
            port = await nursery.start(
                functools.partial(
                    serve_amqp,
                    self,
                    self.config.amqp_host,
                    self.config.amqp_port,
                    ssl_context=server_ssl_context(self.config),
                )
            )
            log.info(
                "broker ready cluster=%s node=%s member=%s amqp=%s",
                self.config.cluster,
                self.config.node,
                self.me,
                port,
            )
            task_status.started(port)

    def _after_command(
        self, cmd: pc.Command, effects: Sequence[Any], sender: MemberId, own: bool
    ) -> None:
        if own and isinstance(cmd, pc.Acquire):
            consumer = self._by_consumer_id.get(cmd.consumer)
            if consumer is not None:
                consumer.acquiring = max(0, consumer.acquiring - cmd.count)
        self._on_effects(effects)

    def _after_frame(self) -> None:
        self._acquire_for_waiting()

    def _after_view(self, view: ViewChange, effects: Sequence[Any]) -> None:
        self._on_effects(effects)
        if view.quorate:
            # Consumers held back in a minority partition take messages again.
            self._waiting_queues.update(c.queue for c in self._consumers.values())
            self._acquire_for_waiting()

    def _view_seen(self, view: ViewChange) -> None:
        if not view.quorate:
            log.warning("%s", self.minority_refusal())
        elif self._was_minority:
            log.info("view quorate again (%d members): serving clients", len(view.members))
        self._was_minority = not view.quorate

    def quorate(self) -> bool:
        return self.membership is None or self.membership.quorate

    def minority_refusal(self) -> str:
        """Why this broker accepts nothing while its view is not quorate: what
        it accepted there would be dropped when the partition heals (the
        majority's state wins, see cluster/membership.py)."""
        members = 0 if self.membership is None else len(self.membership.members)
        return (
            f"broker node {self.config.node} of {self.config.cluster} is in a minority partition "
            f"(its view of {members} members is not quorate): it accepts no message and "
            "delivers none until the partition heals; use a broker of the majority"
        )

    # ------------------------------------------------------------------
    # Effects
    # ------------------------------------------------------------------

    def _mine(self, sender: Any) -> bool:
        return self.me is not None and (sender.node, sender.pid) == (self.me.node, self.me.pid)

    def _on_effects(self, effects: Sequence[Any]) -> None:
        for effect in effects:
            if isinstance(effect, st.Settled):
                if self._mine(effect.sender):
                    delivery = self._pending.pop(effect.ref, None)
                    if delivery is not None:
                        # Applied in a minority partition: it will be dropped
                        # when the partition heals, so it is not accepted.
                        delivery.settle(
                            ACCEPTED
                            if self.quorate()
                            else Rejected(MINORITY_CONDITION, self.minority_refusal())
                        )
                        delivery.link.flow(1)
            elif isinstance(effect, st.Refused):
                if self._mine(effect.sender):
                    self._on_refused(effect)
            elif isinstance(effect, st.Delivered):
                consumer = self._by_consumer_id.get(effect.consumer)
                if consumer is not None and consumer.session == effect.session:
                    self._deliver(consumer, effect)
            elif isinstance(effect, st.Enqueued | st.Released):
                self._waiting_queues.add(effect.queue)
            elif isinstance(effect, st.QueueDeleted):
                for consumer in list(self._consumers.values()):
                    if consumer.queue == effect.queue:
                        consumer.link.close(
                            "amqp:resource-deleted", f"queue {effect.queue!r} was deleted"
                        )

    def _on_refused(self, effect: Any) -> None:
        if effect.ref:
            delivery = self._pending.pop(effect.ref, None)
            if delivery is not None:
                delivery.settle(Rejected(effect.condition, effect.description))
                delivery.link.flow(1)
        elif effect.session:
            for consumer in list(self._consumers.values()):
                if consumer.session == effect.session and consumer.queue == effect.name:
                    consumer.link.close(effect.condition, effect.description)
        elif self._admin_refusals is not None:
            # A declare, delete or bind of ours: only admin requests send those.
            self._admin_refusals.append(effect)

    def _deliver(self, consumer: _Consumer, effect: Any) -> None:
        msg = effect.message
        if not self.quorate():
            # Acquired just before the view lost quorum: hand it back rather
            # than deliver what the majority may deliver too.
            self._post(pc.Release(consumer.queue, consumer.session, (msg.pos,), False))
            return
        try:
            message = Message()
            message.decode(bytes(msg.body))
        except Exception:  # a body that is not an encoded AMQP message
            message = Message(body=bytes(msg.body))
        if msg.redelivered:
            message.delivery_count = max(1, message.delivery_count or 0)
        try:
            consumer.link.send_nowait(message, msg.pos)
            consumer.unsettled[msg.pos] = msg.pos
        except (trio.WouldBlock, DrgateError):
            # The client took its credit back, or left: give it back at once.
            self._post(pc.Release(consumer.queue, consumer.session, (msg.pos,), False))

    def _acquire_for_waiting(self) -> None:
        if not self._waiting_queues:
            return
        queues = self._waiting_queues
        self._waiting_queues = set()
        for consumer in list(self._consumers.values()):
            if consumer.queue in queues:
                self._request(consumer)

    def _request(self, consumer: _Consumer) -> None:
        want = consumer.link.credit - consumer.acquiring
        if want <= 0 or consumer.link.closed or not self.quorate():
            return
        if available(self.state, consumer.queue) <= 0:
            return
        want = min(want, available(self.state, consumer.queue))
        consumer.acquiring += want
        self._post(pc.Acquire(consumer.queue, consumer.session, consumer.id, want))

    # ------------------------------------------------------------------
    # AMQP handler
    # ------------------------------------------------------------------

    def _session_for(self, conn: AmqpConnection) -> tuple[int, bool]:
        assert self.me is not None
        session = self._sessions.get(conn.id)
        if session is not None:
            return session, False
        session = st.session_id(self.me.node, self.me.pid, conn.id)
        self._sessions[conn.id] = session
        return session, True

    async def _ensure_queue(self, link: OutgoingLink | IncomingLink, address: str) -> bool:
        """The queue or exchange exists, or was created on demand; else the
        link is refused with amqp:not-found."""
        if has_queue(self.state, address) or has_exchange(self.state, address):
            return True
        if link.create_on_demand:
            args = {k: _plain(v) for k, v in link.declare_arguments().items()}
            await self.submit_and_wait(pc.QueueDeclare(address, args))
            if has_queue(self.state, address):
                return True
        link.close(
            "amqp:not-found",
            f"no queue or exchange named {address!r} at {self.config.cluster}; declare it "
            f"with 'drgate admin add-queue {address}' or attach with the "
            "'create-on-demand' capability",
        )
        return False

    async def on_sender_link(self, link: OutgoingLink) -> None:
        address = link.address or ""
        if address == QUEUES_ADDRESS:
            return
        if not self.quorate():
            link.close(MINORITY_CONDITION, self.minority_refusal())
            return
        if not address or not await self._ensure_queue(link, address):
            if not address:
                link.close("amqp:invalid-field", "a receiving link must name a queue")
            return
        if not has_queue(self.state, address):
            link.close("amqp:not-allowed", f"{address!r} is an exchange; receive from a queue")
            return
        refusal = read_only_refusal(self.state, address)
        if refusal is not None:
            link.close(refusal[0], refusal[1])
            return
        session, new = self._session_for(link.connection)
        if new:
            await self.submit(pc.SessionOpen(session))
        consumer = _Consumer(link, address, session, next(self._consumer_ids))
        self._consumers[link] = consumer
        self._by_consumer_id[consumer.id] = consumer

    async def on_receiver_link(self, link: IncomingLink) -> None:
        address = link.address
        if address == ADMIN_ADDRESS:
            link.flow(10)
            return
        if not self.quorate():
            link.close(MINORITY_CONDITION, self.minority_refusal())
            return
        if address is not None:
            if not await self._ensure_queue(link, address):
                return
            refusal = read_only_refusal(self.state, address)
            if refusal is not None:
                link.close(refusal[0], refusal[1])
                return
        link.flow(PUBLISH_WINDOW)

    async def on_message(self, link: IncomingLink, delivery: InboundDelivery) -> None:
        if link.address == ADMIN_ADDRESS:
            await self._on_admin(delivery)
            link.flow(1)
            return
        if not self.quorate():
            delivery.settle(Rejected(MINORITY_CONDITION, self.minority_refusal()))
            link.flow(1)
            return
        message = delivery.message
        address = link.address or message.address or ""
        if has_exchange(self.state, address) and not has_queue(self.state, address):
            exchange, key = address, message.subject or ""
        else:
            exchange, key = "", address
        properties: dict[str, pc.Value] = {}
        if message.properties:
            properties.update({str(k): _plain(v) for k, v in message.properties.items()})
        if message.subject:
            properties.setdefault("subject", message.subject)
        ref = next(self._refs)
        self._pending[ref] = delivery
        await self.submit(
            pc.Publish(
                exchange,
                key,
                message.encode(),
                "" if message.id is None else str(message.id),
                properties,
                ref,
            )
        )

    async def on_credit(self, link: OutgoingLink, credit: int) -> None:
        if link.address == QUEUES_ADDRESS:
            if credit > 0:
                link.send_nowait(Message(body=json.dumps(self.describe())), 0)
            return
        consumer = self._consumers.get(link)
        if consumer is not None:
            self._request(consumer)
            if link.drain and consumer.acquiring == 0:
                link.drained()

    async def on_outcome(self, link: OutgoingLink, token: object, outcome: Outcome) -> None:
        consumer = self._consumers.get(link)
        if consumer is None or not isinstance(token, int):
            return
        consumer.unsettled.pop(token, None)
        if isinstance(outcome, Accepted | Rejected):
            # A rejected message is discarded (there is no dead-letter queue).
            await self.submit(pc.Accept(consumer.queue, consumer.session, (token,)))
        elif isinstance(outcome, Modified):
            await self.submit(
                pc.Release(consumer.queue, consumer.session, (token,), outcome.delivery_failed)
            )
        elif isinstance(outcome, Released):
            await self.submit(pc.Release(consumer.queue, consumer.session, (token,), False))

    async def on_link_closed(self, link: OutgoingLink | IncomingLink) -> None:
        if isinstance(link, OutgoingLink):
            consumer = self._consumers.pop(link, None)
            if consumer is None:
                return
            self._by_consumer_id.pop(consumer.id, None)
            if consumer.unsettled:
                await self.submit(
                    pc.Release(consumer.queue, consumer.session, tuple(consumer.unsettled), False)
                )
        else:
            for ref, delivery in list(self._pending.items()):
                if delivery.link is link:
                    # The command is on its way; its outcome can no longer be told.
                    self._pending.pop(ref, None)

    async def on_connection_closed(self, conn: AmqpConnection) -> None:
        session = self._sessions.pop(conn.id, None)
        if session is not None:
            await self.submit(pc.SessionClose(session))

    # ------------------------------------------------------------------
    # Management
    # ------------------------------------------------------------------

    async def _on_admin(self, delivery: InboundDelivery) -> None:
        try:
            body = delivery.message.body
            if not isinstance(body, str | bytes):
                raise TypeError("the body must be a JSON text")
            request = json.loads(body)
            commands = admin_commands(request)
        except (ValueError, TypeError, KeyError) as exc:
            delivery.settle(Rejected("amqp:invalid-field", f"bad admin request: {exc}"))
            return
        except DrgateError as exc:
            delivery.settle(Rejected("amqp:invalid-field", str(exc)))
            return
        if not self.quorate():
            delivery.settle(Rejected(MINORITY_CONDITION, self.minority_refusal()))
            return
        # One request at a time, so that the refusals collected while it is
        # applied are its own.
        async with self._admin_lock:
            self._admin_refusals = []
            try:
                await self.submit_and_wait(*commands)
                refusals = self._admin_refusals
            finally:
                self._admin_refusals = None
        if refusals:
            first = refusals[0]
            delivery.settle(Rejected(first.condition, first.description))
        else:
            delivery.settle(ACCEPTED)

    def describe(self) -> dict[str, Any]:
        """Queues, exchanges and bindings as this node holds them."""
        return {
            "cluster": self.config.cluster,
            "node": self.config.node,
            "member": str(self.me),
            **describe(self.state),
        }

    def statistics(self) -> dict[str, Any]:
        """A plain snapshot for the observability endpoint (schema: gateway/metrics.py).

        Only plain data: the gateway turns it into Prometheus metrics; this
        module does not import prometheus-client.  A broker has no role, tap,
        link or spool: those sections are absent.
        """
        membership = self.membership
        return {
            "site": self.config.cluster,
            "node": self.config.node,
            "process": "broker",
            "cseq": self.state.cseq,
            "bus": {
                "view_size": 0 if membership is None else len(membership.members),
                "quorate": True if membership is None else membership.quorate,
                "members": len(self.state.ready),
            },
            "merge": dict(self.state.counters),
            "last_error": "" if self.quorate() else self.minority_refusal(),
        }


def admin_commands(request: dict[str, Any]) -> list[pc.Command]:
    """Bus commands for one admin request (the JSON body sent to $drgate.admin)."""
    op = request["op"]
    name = str(request.get("name", ""))
    args = {str(k): _plain(v) for k, v in (request.get("args") or {}).items()}
    if op == "add-queue":
        return [pc.QueueDeclare(name, args)]
    if op == "del-queue":
        return [pc.QueueDelete(name)]
    if op == "purge":
        return [pc.Purge(name)]
    if op == "add-exchange":
        kind = pc.ExchangeType[str(request.get("type", "direct")).upper()]
        return [pc.ExchangeDeclare(name, kind, args)]
    if op == "del-exchange":
        return [pc.ExchangeDelete(name)]
    if op == "bind":
        return [pc.Bind(name, str(request["queue"]), str(request.get("key", "")), args)]
    if op == "unbind":
        return [pc.Unbind(name, str(request["queue"]), str(request.get("key", "")))]
    raise DrgateError(
        f"unknown admin operation {op!r}; valid: add-queue, del-queue, purge, add-exchange, "
        "del-exchange, bind, unbind"
    )


def _plain(value: Any) -> pc.Value:
    """An AMQP value as a bus map value (symbols and other str subclasses
    become str; anything else unsupported becomes its text)."""
    if value is None or isinstance(value, bool | float):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes):
        return bytes(value)
    return str(value)


def server_ssl_context(config: BrokerConfig) -> ssl.SSLContext | None:
    """Mutual TLS for clients when the config names certificate files."""
    if config.tls_cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=config.tls_ca)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


# ----------------------------------------------------------------------
# Read-only queries of the state, for attach-time checks and listings.
# The state machine re-checks everything when the command is applied; these
# only let a client hear "no" at attach rather than at its first message.
# ----------------------------------------------------------------------


def has_queue(state: SiteState, name: str) -> bool:
    return name in state.queues


def has_exchange(state: SiteState, name: str) -> bool:
    return name in state.exchanges


def available(state: SiteState, queue: str) -> int:
    q = state.queues.get(queue)
    return 0 if q is None else q.available_count()


def read_only_refusal(state: SiteState, queue: str) -> tuple[str, str] | None:
    """``(condition, description)`` when R3 makes ``queue`` read-only here."""
    q = state.queues.get(queue)
    if q is None or q.replica is None or q.replica.mode != Mode.FULL:
        return None
    origin = state.origins.get(q.replica.origin)
    if origin is not None and origin.promoted:
        return None
    return (
        "amqp:not-allowed",
        f"queue {queue!r} is a read-only replica of site {q.replica.origin!r} (mode full) "
        "while replication is active; to use it here, promote this site (drgate promote)",
    )


def describe(state: SiteState) -> dict[str, Any]:
    queues = []
    for q in state.queues.values():
        queues.append(
            {
                "name": q.name,
                "depth": q.depth,
                "acquired": len(q.acquired),
                "bytes": q.bytes,
                "digest": st.queue_digest(state, q.name),
                "args": {k: v if not isinstance(v, bytes) else v.hex() for k, v in q.args.items()},
                "replica": None
                if q.replica is None
                else {"origin": q.replica.origin, "mode": q.replica.mode.label},
            }
        )
    exchanges = []
    for x in state.exchanges.values():
        exchanges.append(
            {
                "name": x.name,
                "type": x.type.name.lower(),
                "bindings": [{"queue": qn, "key": key} for qn, key in x.bindings],
            }
        )
    return {
        "incarnation": state.incarnation,
        "cseq": state.cseq,
        "queues": queues,
        "exchanges": exchanges,
        "digest": st.digest(state),
    }
