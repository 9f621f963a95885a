"""AMQP 1.0 listener: Qpid Proton's engine driven sans-IO from trio.

Theory of operation
-------------------
Proton's engine is a byte pump: bytes from the socket go in with
``Transport.push``, bytes for the socket come out with ``pending`` / ``peek`` /
``pop``, what the peer did comes out of a ``Collector`` as events, and
``Transport.tick(now)`` runs the heartbeat and idle-timeout timers with the
time passed in.  This module owns no queue logic: it turns engine events into
calls on an :class:`AmqpHandler` (implemented by the broker node) and gives the
node small objects (:class:`OutgoingLink`, :class:`IncomingLink`,
:class:`InboundDelivery`, :class:`AmqpConnection`) whose methods change the
engine and wake the writer.

One trio task per connection runs the *pump* (pops events, awaits the handler
callbacks one at a time, so a connection's events reach the node in order),
beside three helpers: the *reader* (socket -> ``push``), the *writer* (engine
output -> socket) and the *timer* (``tick``).  Trio is single-threaded, so the
node may call ``send`` / ``flow`` / ``settle`` / ``close`` from any task: each
call changes the engine synchronously and wakes the writer.

Bounds: the reader reads at most ``Transport.capacity()`` bytes (and at most
``READ_BYTES``), the writer writes at most ``WRITE_BYTES`` at a time and waits
for the socket, inbound messages are bounded by ``MAX_MESSAGE_BYTES`` and by
the credit the node grants, outbound ones by the credit the client grants.
The pump awaits each handler callback before it takes the next event, so a
slow node slows its clients instead of buffering for them.

Failure: a client that vanishes (EOF, reset, TLS error, idle timeout) ends its
connection task; the node then hears ``on_link_closed`` for every link it was
told about and not yet told closed, then ``on_connection_closed`` once.
Malformed bytes make Proton close that connection with a transport error
(``amqp:connection:framing-error`` or similar); the server keeps serving.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import cproton
import proton
import trio
from proton import Condition, Delivery, Endpoint, Event, Link, Message, Terminus, Transport
from proton._events import EventType

from cluster.amqpauth import (
    OPEN_RIGHTS,
    Principal,
)
from cluster.amqphandler import AmqpHandler
from cluster.amqpvalues import (
    ACCEPTED,
    RELEASED,
    TERMINAL_STATES,
    Accepted,
    Modified,
    Outcome,
    Rejected,
    Released,
    apply_outcome,
    data_to_py,
    fields_of_message,
    remote_outcome,
    str_keys,
    symbols,
    wrap,
)
from protocol.amqpsections import PublishFields, publish_fields_untrusted, split_message_untrusted
from protocol.errors import DrgateError

__all__ = [
    "ACCEPTED",
    "CREATE_ON_DEMAND",
    "RELEASED",
    "Accepted",
    "AmqpConnection",
    "AmqpHandler",
    "AmqpLinkClosedError",
    "InboundDelivery",
    "IncomingLink",
    "Modified",
    "Outcome",
    "OutgoingLink",
    "Rejected",
    "Released",
]

log = logging.getLogger(__name__)
# The events _dispatch reads the session of.
_SESSION_EVENTS = frozenset({Event.SESSION_REMOTE_OPEN, Event.SESSION_REMOTE_CLOSE})

# Read at most this much per receive: a few frames of Proton's default
# 16 KiB... 64 KiB max frame, small enough to keep one connection from hogging the loop.
READ_BYTES = 64 * 1024
# Write at most this much per send_all: matches the read size; loopback moves
# ~3 GB/s with 64 KiB writes on our machines.
WRITE_BYTES = 64 * 1024
# A whole message larger than this closes its link with
# amqp:link:message-size-exceeded; advertised to clients as max-message-size.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Idle timeout we ask of clients (Proton advertises half of it as our
# heartbeat interval).  A client silent for this long is dropped.
IDLE_TIMEOUT_S = 60.0
# When no timer is pending, re-check at this interval (the peer's idle timeout
# becomes known only after its open frame).
TIMER_POLL_S = 1.0
# Teardown callbacks (on_link_closed / on_connection_closed) get this long
# even when the server is being cancelled.
TEARDOWN_GRACE_S = 5.0
# A client's close is answered once the settlements it sent before it are
# applied at the site (on_close_asked), or after this long if the bus cannot
# apply them (no quorum): a client is not kept from closing for good.
CLOSE_SETTLE_WAIT_S = 10.0
# The container id we announce in our open frame.
CONTAINER_ID = "drgate-broker"
# Source/target capability a client sets to ask that the node be created.
CREATE_ON_DEMAND = "create-on-demand"

_CONNECTION_IDS = itertools.count(1)


class AmqpLinkClosedError(DrgateError):
    """The link (or its connection) is closed; nothing more can be sent on it."""


# ---------------------------------------------------------------------------
# Links and deliveries handed to the node
# ---------------------------------------------------------------------------


class _LinkBase:
    """What both link directions share."""

    def __init__(self, conn: AmqpConnection, pn: Link, terminus: Terminus) -> None:
        self.connection = conn
        self._pn = pn
        self.name: str = pn.name
        self.address: str | None = terminus.address
        self.dynamic: bool = bool(terminus.dynamic)
        self.capabilities: tuple[str, ...] = symbols(data_to_py(terminus.capabilities))
        self.node_properties: dict[str, Any] = str_keys(data_to_py(terminus.properties))
        self.properties: dict[str, Any] = str_keys(pn.remote_properties)
        self._closed = False
        self._reported = False  # handed to the handler
        self._closed_reported = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def create_on_demand(self) -> bool:
        """The client asks that the node be created (capability
        ``create-on-demand``; a dynamic terminus is ``dynamic``)."""
        return CREATE_ON_DEMAND in self.capabilities

    def set_address(self, address: str) -> None:
        """Name the node of a dynamic terminus (the source of an outgoing
        link, the target of an incoming one): the attach answers with it.
        Call in ``on_sender_link`` / ``on_receiver_link``."""
        self.address = address
        terminus = self._pn.source if self._pn.is_sender else self._pn.target
        terminus.address = address

    def declare_arguments(self) -> dict[str, Any]:
        """Queue arguments the client gave: terminus (dynamic-node)
        properties, overridden by link properties of the same key."""
        args = dict(self.node_properties)
        args.update(self.properties)
        return args

    def close(self, condition: str | None = None, description: str = "") -> None:
        """Detach the link, with an AMQP error when ``condition`` is given.

        Called during ``on_*_link`` it refuses the attach (the client sees the
        error on its attach).  Idempotent."""
        if self._closed:
            return
        if condition is not None:
            self._pn.condition = Condition(condition, description or None)
        if self._pn.state & Endpoint.LOCAL_UNINIT:
            # Refusing an attach: answer with an attach that has no terminus
            # on our side (AMQP 1.0 section 2.6.3), then the detach.
            if self._pn.is_sender:
                self._pn.source.type = Terminus.UNSPECIFIED
            else:
                self._pn.target.type = Terminus.UNSPECIFIED
        if not (self._pn.state & Endpoint.LOCAL_CLOSED):
            self._pn.close()
        self._mark_closed()
        self.connection._kick_writer()
        self.connection._wake_pump()

    def _mark_closed(self) -> None:
        self._closed = True


class OutgoingLink(_LinkBase):
    """A link on which the node sends messages to a client (Proton sender).

    ``address`` is the client's source address.  ``send`` respects credit.
    """

    def __init__(self, conn: AmqpConnection, pn: proton.Sender) -> None:
        super().__init__(conn, pn, pn.remote_source)
        self._sender = pn
        self.filter: dict[str, Any] = str_keys(data_to_py(pn.remote_source.filter))
        # The client asked to browse (distribution-mode copy): to see the
        # messages without taking them.
        self.browse: bool = pn.remote_source.distribution_mode == Terminus.DIST_MODE_COPY
        # The client asked for pre-settled (at-most-once) delivery.
        self.presettled: bool = pn.remote_snd_settle_mode == Link.SND_SETTLED
        self._tags = itertools.count(1)
        self._unsettled: dict[bytes, object] = {}
        self._credit_changed = trio.Event()

    @property
    def credit(self) -> int:
        """Messages the client will still take; 0 when closed."""
        return 0 if self._closed else self._sender.credit

    @property
    def drain(self) -> bool:
        """The client asked to drain: send what you have, then ``drained()``."""
        return bool(self._sender.drain_mode)

    def answer_browse(self, browse: bool) -> None:
        """Answer the attach with the distribution mode in force: ``copy``
        when the node browses, else ``move`` (call in ``on_sender_link``)."""
        self._pn.source.distribution_mode = (
            Terminus.DIST_MODE_COPY if browse else Terminus.DIST_MODE_MOVE
        )

    def unsettled_tokens(self) -> list[object]:
        """Tokens sent and not yet settled by the client, in send order."""
        return list(self._unsettled.values())

    async def wait_credit(self) -> None:
        """Wait until credit > 0.  Raises :class:`AmqpLinkClosedError`."""
        while True:
            if self._closed:
                raise AmqpLinkClosedError(f"link {self.name!r} to {self.address!r} is closed")
            if self._sender.credit > 0:
                return
            await self._credit_changed.wait()

    async def send(self, message: Message, token: object) -> None:
        """Wait for credit, then hand ``message`` to the engine.

        Returns once it is written into the engine (not yet on the wire).
        The client's outcome comes back as ``on_outcome(link, token, ...)``;
        on a pre-settled link it comes at once as ACCEPTED.
        Raises :class:`AmqpLinkClosedError` if the link closes meanwhile.
        """
        await self.wait_credit()
        self.send_nowait(message, token)

    def send_nowait(self, message: Message, token: object) -> None:
        """``send`` without waiting: raises :class:`trio.WouldBlock` without
        credit, :class:`AmqpLinkClosedError` when closed."""
        self.send_encoded_nowait(message.encode(), token)

    def send_encoded_nowait(self, encoded: bytes, token: object) -> None:
        """:meth:`send_nowait` of a message already encoded (its bytes go out
        as they are: no decode and encode again)."""
        if self._closed:
            raise AmqpLinkClosedError(f"link {self.name!r} to {self.address!r} is closed")
        if self._sender.credit <= 0:
            raise trio.WouldBlock
        # Through cproton, as the engine's events are read: Proton's Sender
        # would wrap the delivery in a Python object, which a send never
        # reads again, and read its tag back through another conversion.
        tag = str(next(self._tags)).encode()
        sender = self._sender._impl
        dlv = cproton.pn_delivery(sender, tag)
        cproton.pn_link_send(sender, encoded)
        cproton.pn_link_advance(sender)
        if self.presettled:
            cproton.pn_delivery_settle(dlv)
            self.connection._synthetic_outcome(self, token)
        else:
            self._unsettled[tag] = token  # as _outgoing_outcome reads it back
        self.connection._kick_writer()

    def drained(self) -> None:
        """Answer a drain request: the client's remaining credit is spent."""
        if not self._closed:
            self._sender.drained()
            self.connection._kick_writer()

    def _mark_closed(self) -> None:
        super()._mark_closed()
        self._credit_changed.set()

    def _credit_event(self) -> None:
        self._credit_changed.set()
        self._credit_changed = trio.Event()


class IncomingLink(_LinkBase):
    """A link on which a client sends messages to the node (Proton receiver).

    ``address`` is the client's target address (``None``: anonymous relay).
    """

    def __init__(self, conn: AmqpConnection, pn: proton.Receiver) -> None:
        super().__init__(conn, pn, pn.remote_target)
        self._receiver = pn

    @property
    def credit(self) -> int:
        """Credit granted and not yet used by the client."""
        return 0 if self._closed else self._receiver.credit

    def flow(self, credit: int) -> None:
        """Grant ``credit`` more messages to the client.  No-op when closed."""
        if self._closed or credit <= 0:
            return
        self._receiver.flow(credit)
        self.connection._kick_writer()


class InboundDelivery:
    """A whole message received on an :class:`IncomingLink`, to be settled.

    ``encoded`` is the message as the client sent it, checked by
    :func:`protocol.amqpsections.split_message_untrusted`: what the broker
    stores and passes on, byte for byte.  ``fields`` are what the broker
    reads of it (durable, id, to, subject, application properties), read
    from those bytes, or from Proton's decoding when a field has a type the
    fast reading leaves to Proton; ``message`` is Proton's decoding, made
    when first asked for (the admin requests' bodies).  ``presettled`` is
    true when the client sent it at-most-once; settling it then only frees
    it.
    """

    __slots__ = ("_dlv", "_message", "_settled", "encoded", "fields", "link", "presettled")

    def __init__(
        self,
        link: IncomingLink,
        dlv: Delivery,
        encoded: bytes,
        fields: PublishFields,
        message: Message | None = None,
        *,
        presettled: bool,
    ) -> None:
        self.link = link
        self._dlv = dlv
        self.encoded = encoded
        self.fields = fields
        self._message = message
        self.presettled = presettled
        self._settled = False

    @property
    def message(self) -> Message:
        if self._message is None:
            self._message = Message()
            self._message.decode(self.encoded)
        return self._message

    @property
    def settled(self) -> bool:
        return self._settled

    def settle(self, outcome: Outcome) -> None:
        """Tell the client ``outcome`` and settle.  Idempotent; a no-op once
        the link or connection is gone (the client already counts the message
        as in doubt)."""
        if self._settled:
            return
        self._settled = True
        if self.link.connection.closed:
            return
        if not self.presettled:
            apply_outcome(self._dlv, outcome)
        self._dlv.settle()
        self.link.connection._kick_writer()


# ---------------------------------------------------------------------------
# One connection
# ---------------------------------------------------------------------------


class AmqpConnection:
    """One client connection: its engine and the tasks that move its bytes.

    ``peer`` is the remote address; ``peer_certificate`` the client's TLS
    certificate as ``ssl.SSLObject.getpeercert()`` returns it (``None``
    without TLS); ``principal`` the authenticated client and its rights
    (:mod:`cluster.amqpauth`), ``identity`` its name.  With ``refusal``
    (condition, description) the connection is closed with that error as
    soon as the client opens it (the connection cap).
    """

    def __init__(
        self,
        handler: AmqpHandler,
        stream: trio.abc.Stream,
        *,
        peer: str,
        peer_certificate: dict[str, Any] | None = None,
        principal: Principal = OPEN_RIGHTS,
        refusal: tuple[str, str] | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.id = next(_CONNECTION_IDS)
        self.peer = peer
        self.peer_certificate = peer_certificate
        self.principal = principal
        self.identity = principal.name
        self.refusal = refusal
        self.remote_container: str | None = None
        self.remote_condition: tuple[str, str] | None = None  # (name, description)
        self.transport_error: tuple[str, str] | None = None
        self._handler = handler
        self._stream = stream
        self._transport = Transport(Transport.SERVER)
        self._transport.idle_timeout = idle_timeout_s
        # No SASL layer: cluster.amqpauth ran SASL before any byte got here.
        self._transport.max_frame_size = READ_BYTES
        self._conn = proton.Connection()
        self._collector = proton.Collector()
        self._conn.collect(self._collector)
        self._transport.bind(self._conn)
        self._links: dict[tuple[str, bool], OutgoingLink | IncomingLink] = {}
        self._synthetic: list[tuple[OutgoingLink, object]] = []
        self._wake = trio.Event()
        self._write_wanted = trio.Event()
        self._done = trio.Event()
        self._pumped = trio.Event()  # set after each pump cycle
        self._reader_waiting = False  # for _pumped: the engine takes no input
        self.closed = False
        self.statistics_messages_in = 0
        self.statistics_messages_out = 0
        self.statistics_pump_cycles = 0  # passes over the engine's events

    def __repr__(self) -> str:
        return f"AmqpConnection(id={self.id}, peer={self.peer!r})"

    # -- node-facing ------------------------------------------------------

    def close(self, condition: str | None = None, description: str = "") -> None:
        """Close the connection (with an AMQP error when ``condition`` is set)."""
        if self.closed:
            return
        if condition is not None:
            self._conn.condition = Condition(condition, description or None)
        self._conn.close()
        self._kick_writer()
        self._wake_pump()

    def links(self) -> list[OutgoingLink | IncomingLink]:
        return list(self._links.values())

    # -- internal wiring --------------------------------------------------

    def _kick_writer(self) -> None:
        self._write_wanted.set()

    def _wake_pump(self) -> None:
        self._wake.set()

    def _finish(self) -> None:
        self._done.set()
        self._wake.set()
        self._write_wanted.set()

    def _synthetic_outcome(self, link: OutgoingLink, token: object) -> None:
        self._synthetic.append((link, token))
        self._wake_pump()

    # -- the tasks ----------------------------------------------------------

    async def run(self, received: bytes = b"") -> None:
        """Serve until the connection ends; never raises for peer faults.
        ``received``: bytes already read from the stream (after SASL)."""
        if received:
            try:
                self._transport.push(received)
            except (proton.TransportException, OverflowError) as exc:
                log.info("amqp conn=%d peer=%s bad input: %s", self.id, self.peer, exc)
            self._wake_pump()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_loop)
                nursery.start_soon(self._write_loop)
                nursery.start_soon(self._timer_loop)
                await self._pump_loop()
                nursery.cancel_scope.cancel()
        finally:
            self.closed = True
            with trio.move_on_after(TEARDOWN_GRACE_S) as scope:
                scope.shield = True
                await self._teardown()

    async def _teardown(self) -> None:
        for link in list(self._links.values()):
            link._mark_closed()
            await self._report_link_closed(link)
        try:
            await self._handler.on_connection_closed(self)
        except Exception:
            log.exception("amqp conn=%d handler on_connection_closed failed", self.id)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self._stream.aclose()
        self._links.clear()
        log.info("amqp conn=%d peer=%s closed error=%s", self.id, self.peer, self.transport_error)

    async def _read_loop(self) -> None:
        while True:
            try:
                capacity = self._transport.capacity()
            except proton.TransportException:
                capacity = -1
            if capacity < 0:
                return  # tail closed: the engine takes no more input
            if capacity == 0:
                # The engine holds unprocessed input: wait for the pump.
                self._wake_pump()
                self._reader_waiting = True
                await self._pumped.wait()
                self._reader_waiting = False
                continue
            try:
                data = await self._stream.receive_some(min(capacity, READ_BYTES))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                log.info("amqp conn=%d peer=%s read failed: %s", self.id, self.peer, exc)
                data = b""
            if not data:
                self._transport.close_tail()
                self._wake_pump()
                self._kick_writer()
                return
            try:
                self._transport.push(bytes(data))
            except (proton.TransportException, OverflowError) as exc:
                log.info("amqp conn=%d peer=%s bad input: %s", self.id, self.peer, exc)
            # The pump kicks the writer if the input made output: one task
            # step fewer per read than kicking it here as well.
            self._wake_pump()

    async def _write_loop(self) -> None:
        while True:
            await self._write_wanted.wait()
            self._write_wanted = trio.Event()
            while True:
                try:
                    pending = self._transport.pending()
                except proton.TransportException:
                    pending = -1
                if pending < 0:
                    # Head closed and all output written: this connection is over.
                    self._finish()
                    return
                if pending == 0:
                    break
                data = self._transport.peek(min(pending, WRITE_BYTES))
                if not data:
                    break
                try:
                    await self._stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    log.info("amqp conn=%d peer=%s write failed: %s", self.id, self.peer, exc)
                    self._finish()
                    return
                self._transport.pop(len(data))
            # A pump pass costs a task step: worth it for a reader waiting on
            # input capacity, or for events the pump acts on (writing may
            # end the output).  A settlement made from another task leaves
            # only PN_TRANSPORT ("output to write"), which the pump ignores:
            # waking it for that cost a pass per settled publish.
            if self._events_waiting() or self._reader_waiting:
                self._wake_pump()

    def _events_waiting(self) -> bool:
        """Whether the collector holds an event other than PN_TRANSPORT
        (those at its head are dropped: the writer has just acted on them)."""
        collector = self._collector._impl
        while True:
            impl = cproton.pn_collector_peek(collector)
            if cproton.isnull(impl):
                return False
            if cproton.pn_event_type(impl) != cproton.PN_TRANSPORT:
                return True
            cproton.pn_collector_pop(collector)

    def _has_output(self) -> bool:
        """Bytes to write, or the end of the output to reach (the writer
        finishes the connection then)."""
        try:
            return bool(self._transport.pending())
        except proton.TransportException:
            return True

    async def _timer_loop(self) -> None:
        while True:
            now = trio.current_time()
            deadline = self._transport.tick(now)
            self._kick_writer()
            self._wake_pump()
            await trio.sleep_until(deadline if deadline > 0 else now + TIMER_POLL_S)

    async def _pump_loop(self) -> None:
        while not self._done.is_set():
            await self._wake.wait()
            self._wake = trio.Event()
            self.statistics_pump_cycles += 1
            try:
                await self._process_events()
            except _HandlerFailed as exc:
                log.error(
                    "amqp conn=%d peer=%s handler failed, closing connection",
                    self.id,
                    self.peer,
                    exc_info=exc.__cause__,
                )
                self._conn.condition = Condition(
                    "amqp:internal-error", "the broker failed handling this connection"
                )
                self._conn.close()
            # The writer wakes the pump after each pass: kicking it with
            # nothing to write kept an idle connection spinning a core.
            if self._has_output():
                self._kick_writer()
            self._pumped.set()
            self._pumped = trio.Event()

    async def _call(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await fn(*args)
        except trio.Cancelled:
            raise
        except Exception as exc:
            raise _HandlerFailed from exc

    async def _process_events(self) -> None:
        # Settlements in a row on one link go to the handler together; any
        # other event first hands over those before it (order is kept).
        batch: list[tuple[object, Outcome]] = []
        batch_link: OutgoingLink | None = None
        while True:
            settled: tuple[OutgoingLink, object, Outcome] | None = None
            if self._synthetic:
                link, token = self._synthetic.pop(0)
                settled = (link, token, ACCEPTED)
            else:
                event = self._next_event()
                if event is None:
                    break
                kind, pn_session, pn_link, pn_delivery = event
                if kind == Event.DELIVERY and pn_delivery is not None and pn_link is not None:
                    owner = self._links.get((pn_link.name, bool(pn_link.is_sender)))
                    if isinstance(owner, OutgoingLink):
                        outcome = self._outgoing_outcome(owner, pn_delivery)
                        if outcome is None:
                            continue
                        settled = (owner, *outcome)
            if settled is not None:
                if batch_link is not settled[0] and batch_link is not None:
                    await self._call(self._handler.on_outcomes, batch_link, batch)
                    batch = []
                batch_link = settled[0]
                batch.append(settled[1:])
                continue
            if batch_link is not None:
                await self._call(self._handler.on_outcomes, batch_link, batch)
                batch, batch_link = [], None
            await self._dispatch(kind, pn_session, pn_link, pn_delivery)
        if batch_link is not None:
            await self._call(self._handler.on_outcomes, batch_link, batch)

    def _next_event(
        self,
    ) -> tuple[EventType, proton.Session | None, Link | None, Delivery | None] | None:
        """The next engine event's type and what it refers to, popped.

        Proton's ``Collector.peek`` wraps every object an event may refer
        to (its context, delivery, link, session, connection, transport):
        six wrappers per delivery, a tenth of a publish's cost in the
        broker.  This wraps the delivery and its link, and the session only
        for the session events, which are all that :meth:`_dispatch` reads."""
        impl = cproton.pn_collector_peek(self._collector._impl)
        if cproton.isnull(impl):
            return None
        kind = EventType.TYPES[cproton.pn_event_type(impl)]
        # Resolve what the event refers to before popping it (pop frees it).
        pn_delivery: Delivery | None = wrap(Delivery, cproton.pn_event_delivery(impl))
        pn_link: Link | None = (
            pn_delivery.link if pn_delivery is not None else wrap(Link, cproton.pn_event_link(impl))
        )
        pn_session: proton.Session | None = None
        if kind in _SESSION_EVENTS:
            pn_session = wrap(proton.Session, cproton.pn_event_session(impl))
        self._collector.pop()
        return kind, pn_session, pn_link, pn_delivery

    async def _before_answering_close(self) -> None:
        with trio.move_on_after(CLOSE_SETTLE_WAIT_S):
            await self._call(self._handler.on_close_asked, self)

    async def _dispatch(
        self,
        kind: Any,
        pn_session: proton.Session | None,
        pn_link: Link | None,
        pn_delivery: Delivery | None,
    ) -> None:
        if kind == Event.CONNECTION_REMOTE_OPEN:
            self.remote_container = self._conn.remote_container
            self._conn.container = CONTAINER_ID
            self._conn.open()
            if self.refusal is not None:
                self._conn.condition = Condition(*self.refusal)
                self._conn.close()
        elif kind == Event.CONNECTION_REMOTE_CLOSE:
            cond = self._conn.remote_condition
            if cond is not None:
                self.remote_condition = (str(cond.name), cond.description or "")
            if not (self._conn.state & Endpoint.LOCAL_CLOSED):
                await self._before_answering_close()
                self._conn.close()
        elif kind == Event.SESSION_REMOTE_OPEN and pn_session is not None:
            if pn_session.state & Endpoint.LOCAL_UNINIT:
                pn_session.open()
        elif kind == Event.SESSION_REMOTE_CLOSE and pn_session is not None:
            if not (pn_session.state & Endpoint.LOCAL_CLOSED):
                await self._before_answering_close()
                pn_session.close()
            for key, link in list(self._links.items()):
                if link._pn.session == pn_session:
                    link._mark_closed()
                    del self._links[key]
                    await self._report_link_closed(link)
        elif kind == Event.LINK_REMOTE_OPEN and pn_link is not None:
            await self._on_link_remote_open(pn_link)
        elif kind == Event.LINK_REMOTE_CLOSE and pn_link is not None:
            key = (pn_link.name, bool(pn_link.is_sender))
            gone = self._links.pop(key, None)
            if not (pn_link.state & Endpoint.LOCAL_CLOSED):
                await self._before_answering_close()
                pn_link.close()
            if gone is not None:
                gone._mark_closed()
                await self._report_link_closed(gone)
        elif kind == Event.LINK_FLOW and pn_link is not None:
            flowed = self._links.get((pn_link.name, bool(pn_link.is_sender)))
            if isinstance(flowed, OutgoingLink) and not flowed.closed:
                flowed._credit_event()
                await self._call(self._handler.on_credit, flowed, pn_link.credit)
        elif kind == Event.DELIVERY and pn_delivery is not None and pn_link is not None:
            owner = self._links.get((pn_link.name, bool(pn_link.is_sender)))
            if isinstance(owner, IncomingLink):
                await self._on_incoming_delivery(owner, pn_delivery)
            elif not pn_delivery.settled:
                # A delivery on a link we already closed: free it.
                pn_delivery.settle()
        elif kind == Event.TRANSPORT_ERROR:
            cond = self._transport.condition
            if cond is not None:
                self.transport_error = (str(cond.name), cond.description or "")
            log.info(
                "amqp conn=%d peer=%s transport error %s", self.id, self.peer, self.transport_error
            )
        elif kind == Event.TRANSPORT_CLOSED:
            self._finish()

    async def _on_link_remote_open(self, pn_link: Link) -> None:
        link: OutgoingLink | IncomingLink
        if pn_link.is_sender:
            assert isinstance(pn_link, proton.Sender)
            pn_link.source.copy(pn_link.remote_source)
            pn_link.target.copy(pn_link.remote_target)
            pn_link.snd_settle_mode = pn_link.remote_snd_settle_mode
            link = OutgoingLink(self, pn_link)
        else:
            assert isinstance(pn_link, proton.Receiver)
            pn_link.source.copy(pn_link.remote_source)
            pn_link.target.copy(pn_link.remote_target)
            pn_link.max_message_size = MAX_MESSAGE_BYTES
            link = IncomingLink(self, pn_link)
        self._links[(link.name, bool(pn_link.is_sender))] = link
        link._reported = True
        if isinstance(link, OutgoingLink):
            await self._call(self._handler.on_sender_link, link)
        else:
            await self._call(self._handler.on_receiver_link, link)
        if link.closed:
            self._links.pop((link.name, bool(pn_link.is_sender)), None)
            await self._report_link_closed(link)
        elif pn_link.state & Endpoint.LOCAL_UNINIT:
            pn_link.open()
            if isinstance(link, OutgoingLink) and pn_link.credit > 0:
                # Credit that came with the attach.
                await self._call(self._handler.on_credit, link, pn_link.credit)

    def _outgoing_outcome(self, link: OutgoingLink, dlv: Delivery) -> tuple[object, Outcome] | None:
        """The token and outcome of a delivery the client settled (settled
        here too), or None for an update that settles nothing of ours."""
        raw = dlv.tag
        tag = raw.encode() if isinstance(raw, str) else bytes(raw)
        token = link._unsettled.get(tag, _MISSING)
        if token is _MISSING:
            if dlv.settled:
                dlv.settle()
            return None
        if dlv.remote_state in TERMINAL_STATES or dlv.settled:
            outcome = remote_outcome(dlv)
            del link._unsettled[tag]
            dlv.settle()
            return token, outcome
        return None

    async def _on_incoming_delivery(self, link: IncomingLink, dlv: Delivery) -> None:
        # The delivery's state is read through cproton, as the events are
        # (each of Proton's properties is a Python call around the same one).
        impl = dlv._impl
        if cproton.pn_delivery_aborted(impl):
            dlv.settle()
            link._receiver.advance()
            return
        if not cproton.pn_delivery_readable(impl):
            return  # an update on a delivery we already passed on
        pending = cproton.pn_delivery_pending(impl)
        if cproton.pn_delivery_partial(impl):
            if pending > MAX_MESSAGE_BYTES:
                link.close(
                    "amqp:link:message-size-exceeded",
                    f"message on link to {link.address!r} exceeds {MAX_MESSAGE_BYTES} bytes",
                )
            return
        data = bytes(link._receiver.recv(pending) or b"")
        presettled = bool(cproton.pn_delivery_settled(impl))
        link._receiver.advance()
        msg: Message | None = None
        try:
            # The strict walk first: it names what is wrong, and Proton's
            # decoder takes what it cannot represent (a second data
            # section, a footer) without a word.
            fields = publish_fields_untrusted(split_message_untrusted(data))
            if fields is None:  # a field of a type only Proton reads
                msg = Message()
                msg.decode(data)
                fields = fields_of_message(msg)
        except Exception as exc:  # ours, or Proton's MessageException or DataException
            if not presettled:
                apply_outcome(dlv, Rejected("amqp:decode-error", f"undecodable message: {exc}"))
            dlv.settle()
            return
        self.statistics_messages_in += 1
        delivery = InboundDelivery(link, dlv, data, fields, msg, presettled=presettled)
        await self._call(self._handler.on_message, link, delivery)

    async def _report_link_closed(self, link: OutgoingLink | IncomingLink) -> None:
        if not link._reported or link._closed_reported:
            return
        link._closed_reported = True
        try:
            await self._handler.on_link_closed(link)
        except Exception:
            log.exception("amqp conn=%d handler on_link_closed failed", self.id)


class _HandlerFailed(Exception):
    """A handler callback raised; ``__cause__`` holds what."""


_MISSING = object()
