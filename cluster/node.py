"""The broker node: site state replicated over the bus, served to AMQP 1.0 clients.

Theory of operation
-------------------
A node holds a :class:`cluster.member.SiteMember` of its site's bus and
observes it.  Everything that changes state (a publish, an acquire, an
accept, a declare) is turned into a command and multicast; nothing changes
the local state directly.  The member's applier applies the stream and tells
the node (:class:`~cluster.member.MemberObserver`) what was applied; the node
acts on the effects that concern it: settle a client's publish, hand an
acquired message to a local consumer, refuse with an AMQP error.  So every
node holds the same state, and a publish is settled only once its command has
come back on the bus, i.e. once it is in every member's state.

Flow control end to end: an AMQP callback submits its command to the
member's bounded channel and waits while it is full, which stops that
connection's pump, which stops granting credit.  Credit on incoming links is
a fixed window of unsettled publishes per link.

Consumers: a consumer's credit becomes ``Acquire(queue, session, consumer,
count)``; the state hands out the first available messages, in stream order,
so two consumers on different nodes never get the same message.  What an
acquire does not get stays asked for in the state (standing demand,
cluster/state/demand.py), which hands each later message to a waiting
consumer as it applies the command that brought it; the node sends it on the
``Delivered`` effect.  A consumer with a selector asks again instead.

Joining: see :mod:`cluster.member` and :mod:`cluster.membership`.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
from proton import Message

from cluster import state as st
from cluster.addresses import Address
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
)
from cluster.amqpauth import AmqpSecurity, Principal
from cluster.amqpserver import serve_amqp
from cluster.amqpvalues import (
    FilterRefusal,
    delivery_bytes,
    encode_annotations,
    selector_filter,
)
from cluster.bus import BusConfig, MemberId, ViewChange, open_bus
from cluster.durability import JournalSettings, NodeJournal
from cluster.member import FORCE_HINT, BusOpener, NullObserver, SiteMember
from cluster.nodestats import broker_statistics
from cluster.selector import SelectorError
from cluster.siteview import (
    admin_commands,
    available,
    describe,
    has_exchange,
    has_queue,
    plain,
    read_only_refusal,
)
from cluster.state.model import TEMPORARY_ARG, session_owner
from cluster.state.persistence import publish_persistent
from cluster.state.selection import matcher
from cluster.statistics import NodeStatistics
from cluster.tls import TlsFiles, server_context
from cluster.webconfig import WebConfig
from protocol import cluster as pc
from protocol.errors import DrgateError
from protocol.modes import REPLICATE_ARG, Role, check_declare_args, declare_refused
from protocol.values import Value

log = logging.getLogger(__name__)

# Unsettled publishes per incoming link: enough to fill a bus frame from one
# busy producer, small enough that a stalled bus stops clients quickly.
PUBLISH_WINDOW = 200
# The AMQP error condition of what a broker refuses in a minority partition.
MINORITY_CONDITION = "amqp:precondition-failed"
# Addresses of the management interface (see docs/broker.md).
ADMIN_ADDRESS = "$drgate.admin"
QUEUES_ADDRESS = "$drgate.queues"
# What a client without the right gets (docs/broker.md, "Users and rights").
UNAUTHORIZED = "amqp:unauthorized-access"
# What a publish beyond the site's memory cap, or a connection beyond the
# node's cap, gets.
RESOURCE_LIMIT = "amqp:resource-limit-exceeded"
# Bytes of message bodies the site's state may hold (every node holds all of
# it, in memory): well below the RAM of a small broker VM, so a site that
# consumers stopped draining refuses publishes instead of dying.
DEFAULT_MAX_SITE_BYTES = 1024**3


# Temporary queues (dynamic nodes) are named this and a UUID: unique in the
# site without asking the others, and visibly the broker's.
TEMPORARY_PREFIX = "$drgate.temp."


# A broker built without a config file (tests) listens on loopback only.
LOOPBACK_AMQP = Address("127.0.0.1", 5672)


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """A broker's settings, built once at start-up (see gateway/config.py)."""

    cluster: str
    node: int
    bus: BusConfig
    amqp: Address = LOOPBACK_AMQP  # the AMQP listener
    tls: TlsFiles | None = None  # mutual TLS for AMQP clients; None: plain TCP
    metrics: Address | None = None  # observability (served by gateway/commands/broker.py)
    metrics_web: WebConfig | None = None  # its TLS and basic auth; None: plain HTTP
    # Users, rights and the connection cap (cluster/amqpauth.py).
    security: AmqpSecurity = field(default_factory=AmqpSecurity)
    max_site_bytes: int = DEFAULT_MAX_SITE_BYTES  # message bodies held in the site state
    # The node's journal (cluster/durability.py); None: the node keeps its
    # state in memory only, and a restart of every node loses it.
    journal: JournalSettings | None = None


@dataclass(slots=True)
class _Consumer:
    link: OutgoingLink
    queue: str
    session: int
    id: int
    acquiring: int = 0  # requested in Acquire commands not yet applied
    withdrawing: bool = False  # a drain's Withdraw is posted, no Acquire since
    unsettled: dict[int, int] = field(default_factory=dict)  # pos -> pos
    # A browser (distribution-mode copy) is sent every message without
    # acquiring it, in position order: ``cursor`` is the last position it
    # went past.  It changes no state, so it is this node's alone.
    browse: bool = False
    cursor: int = 0
    # The JMS selector of its source filter ("" when none) and the messages
    # it selects.  Every Acquire of the consumer carries the text, so that
    # every member acquires the same messages (AcquireMatching).
    selector: str = ""
    match: Callable[[Any], bool] | None = None
    # Up to which position its queue holds nothing it selects, and the
    # releases count at which that was found (a release may change it).
    clear: tuple[int, int] = (0, 0)


Settlement = tuple[str, bool]
"""What a run of outcomes does: ``("accept", _)``, ``("release",
redelivered)`` or ``("modify", _)``."""


def _settlement(outcome: Outcome) -> Settlement:
    """What a client's outcome does: ("accept", _) dequeues (a rejected
    message is dropped too); ("release", False) makes it available again;
    ("modify", _) does too, with what the ``modified`` outcome says."""
    if isinstance(outcome, Accepted | Rejected):
        return ("accept", False)
    if isinstance(outcome, Modified):
        return ("modify", False)
    return ("release", False)


class BrokerNode(NullObserver):
    """One broker.  ``await nursery.start(node.serve)`` reports the AMQP port."""

    def __init__(self, config: BrokerConfig, *, open_member: BusOpener = open_bus) -> None:
        self.config = config
        self.member = SiteMember(
            config.cluster, config.bus, role=Role.BROKER, observer=self, open_member=open_member
        )
        self._refs = itertools.count(1)
        self._pending: dict[int, InboundDelivery] = {}
        # Publishes of ours submitted and not yet applied: ref -> bytes.
        self._inflight: dict[int, int] = {}
        self._inflight_bytes = 0
        self._held_bytes = (-1, 0)  # (cseq, bytes of bodies in the state at that cseq)
        self._sessions: dict[int, int] = {}  # connection id -> session
        # Connections that sent settlements since their last close was asked.
        self._settled_on: set[int] = set()
        self._consumers: dict[OutgoingLink, _Consumer] = {}
        self._by_consumer_id: dict[int, _Consumer] = {}
        self._consumer_ids = itertools.count(1)
        self._waiting_queues: set[str] = set()
        # Releases seen, per queue, and restores of the state (selector
        # consumers' scans start over after either; see _request).
        self._releases: dict[str, int] = {}
        self._restores = 0
        # Links whose dynamic terminus is a temporary queue: link -> queue.
        self._temporary: dict[OutgoingLink | IncomingLink, str] = {}
        self._admin_lock = trio.Lock()
        self._admin_refusals: list[Any] | None = None
        self._was_minority = False
        self.durability = (
            None
            if config.journal is None
            else NodeJournal(config.journal, self.member, config.node)
        )

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        if self.durability is not None:
            self.durability.recover()
        async with trio.open_nursery() as nursery:
            if self.durability is not None:
                nursery.start_soon(self.durability.run)
            await nursery.start(self.member.serve)
            tls = self.config.tls
            port = await nursery.start(
                functools.partial(
                    serve_amqp,
                    self,
                    self.config.amqp.host,
                    self.config.amqp.port,
                    ssl_context=None if tls is None else server_context(tls),
                    security=self.config.security,
                )
            )
            log.info(
                "broker ready cluster=%s node=%s member=%s amqp=%s",
                self.config.cluster,
                self.config.node,
                self.member.me,
                port,
            )
            task_status.started(port)

    def after_command(
        self, cmd: pc.Command, effects: Sequence[st.Effect], sender: MemberId, own: bool
    ) -> None:
        if self.durability is not None:
            self.durability.after_command(cmd)
        if own and isinstance(cmd, pc.Acquire | pc.AcquireMatching):
            consumer = self._by_consumer_id.get(cmd.consumer)
            if consumer is not None:
                consumer.acquiring = max(0, consumer.acquiring - cmd.count)
        self._on_effects(effects)

    def after_frame(self) -> None:
        if self.durability is not None:
            self.durability.after_frame()
        self._acquire_for_waiting()

    def after_restore(self) -> None:
        self._restores += 1
        if self.durability is not None:
            self.durability.after_restore()

    def after_view(self, view: ViewChange, effects: Sequence[st.Effect]) -> None:
        if self.durability is not None:
            self.durability.after_view(view.left)
        self._on_effects(effects)
        if view.quorate:
            # Consumers held back in a minority partition take messages again.
            self._waiting_queues.update(c.queue for c in self._consumers.values())
            self._acquire_for_waiting()

    def view_seen(self, view: ViewChange) -> None:
        if not view.quorate:
            log.warning("%s", self.minority_refusal())
        elif self._was_minority:
            log.info("view quorate again (%d members): serving clients", len(view.members))
        self._was_minority = not view.quorate

    def on_rejoin(self) -> None:
        # Our publishes in flight were in the dropped stream: none will settle.
        self._inflight.clear()
        self._inflight_bytes = 0
        if self.durability is not None:
            self.durability.on_rejoin()

    def quorate(self) -> bool:
        if self.member.recovering:
            return False
        return self.member.membership is None or self.member.membership.quorate

    def minority_refusal(self) -> str:
        """Why this broker accepts nothing while its view is not quorate: what
        it accepted there would be dropped when the partition heals (the
        majority's state wins, see cluster/membership.py); or while the site
        waits for its brokers' journals."""
        members = 0 if self.member.membership is None else len(self.member.membership.members)
        if self.member.recovering:
            state = self.member.state
            return (
                f"site {self.config.cluster} is recovering from its brokers' journals: "
                f"{len(state.candidates)} of {self.member.bus_config.expect_brokers} brokers "
                "reported; it serves clients once every broker is back (a broker gone for "
                f"good: {FORCE_HINT}; docs/broker.md 'Durability')"
            )
        return (
            f"broker node {self.config.node} of {self.config.cluster} is in a minority partition "
            f"(its view of {members} members is not quorate): it accepts no message and "
            "delivers none until the partition heals; use a broker of the majority"
        )

    # ------------------------------------------------------------------
    # Effects
    # ------------------------------------------------------------------

    def _mine(self, sender: Any) -> bool:
        return self.member.me is not None and (sender.node, sender.pid) == (
            self.member.me.node,
            self.member.me.pid,
        )

    def _mine_session(self, session: int) -> bool:
        me = self.member.me
        return me is not None and session_owner(session) == (me.node, me.pid)

    def _on_effects(self, effects: Sequence[st.Effect]) -> None:
        for effect in effects:
            if isinstance(effect, st.Settled | st.Refused) and self._mine(effect.sender):
                self._inflight_bytes -= self._inflight.pop(effect.ref, 0)
            if isinstance(effect, st.Settled):
                if self._mine(effect.sender):
                    delivery = self._pending.pop(effect.ref, None)
                    if delivery is not None:
                        if self.durability is None or not publish_persistent(
                            self.member.state,
                            effect.queues,
                            {pc.DURABLE_PROPERTY: True} if delivery.fields.durable else None,
                        ):
                            # Nothing of it survives a restart of the site:
                            # no disk to wait for (docs/broker.md "Durability").
                            self._settle_applied(delivery)
                        else:
                            self.durability.settle_when_durable(
                                functools.partial(self._settle_applied, delivery)
                            )
            elif isinstance(effect, st.Refused):
                if self._mine(effect.sender):
                    self._on_refused(effect)
            elif isinstance(effect, st.Delivered):
                consumer = self._by_consumer_id.get(effect.consumer)
                if consumer is not None and consumer.session == effect.session:
                    self._deliver(consumer, effect)
                elif self._mine_session(effect.session):
                    # Its link closed after it asked: back to the queue.
                    self._give_back(
                        effect.queue, effect.session, effect.consumer, effect.message.pos
                    )
            elif isinstance(effect, st.Enqueued | st.Released):
                self._waiting_queues.add(effect.queue)
                if isinstance(effect, st.Released):
                    self._releases[effect.queue] = self._releases.get(effect.queue, 0) + 1
            elif isinstance(effect, st.QueueDeleted):
                self._releases.pop(effect.queue, None)
                for consumer in list(self._consumers.values()):
                    if consumer.queue == effect.queue:
                        consumer.link.close(
                            "amqp:resource-deleted", f"queue {effect.queue!r} was deleted"
                        )

    def _settle_applied(self, delivery: InboundDelivery) -> None:
        # Applied in a minority partition: it will be dropped when the
        # partition heals, so it is not accepted.
        delivery.settle(
            ACCEPTED if self.quorate() else Rejected(MINORITY_CONDITION, self.minority_refusal())
        )
        delivery.link.flow(1)

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
            self._give_back(consumer.queue, consumer.session, consumer.id, msg.pos)
            return
        try:
            consumer.link.send_encoded_nowait(delivery_bytes(msg), msg.pos)
            consumer.unsettled[msg.pos] = msg.pos
        except (trio.WouldBlock, DrgateError):
            # The client took its credit back, or left: give it back at once.
            self._give_back(consumer.queue, consumer.session, consumer.id, msg.pos)

    def _acquire_for_waiting(self) -> None:
        if not self._waiting_queues:
            return
        queues = self._waiting_queues
        self._waiting_queues = set()
        for consumer in list(self._consumers.values()):
            if consumer.queue in queues:
                self._request(consumer)

    def _request(self, consumer: _Consumer) -> None:
        if consumer.browse:
            self._browse(consumer)
            return
        link = consumer.link
        if link.closed or not self.quorate():
            return
        if consumer.match is not None:
            self._request_matching(consumer)
            return
        standing = self._standing(consumer)
        if link.drain:
            # A drain takes what the queue holds now, no more: the standing
            # demand goes (then drained(), once the acquires are applied).
            if standing and not consumer.withdrawing:
                consumer.withdrawing = True  # once, not per credit frame until it applies
                self.member.post(pc.Withdraw(consumer.queue, consumer.session, consumer.id))
            want = min(
                link.credit - consumer.acquiring, available(self.member.state, consumer.queue)
            )
        else:
            # The credit not yet asked for becomes standing demand: what the
            # queue lacks goes to this consumer as it comes, without another
            # acquire (cluster/state/demand.py).  While more is asked for or
            # in the client's hands than would be asked now, a client's
            # top-ups wait to go as one: an acquire per half window.
            want = link.credit - consumer.acquiring - standing
            if want < consumer.acquiring + standing + len(consumer.unsettled):
                return
        if want <= 0:
            return
        consumer.acquiring += want
        consumer.withdrawing = False  # what this asks may stand: a drain withdraws it again
        self.member.post(pc.Acquire(consumer.queue, consumer.session, consumer.id, want))

    def _request_matching(self, consumer: _Consumer) -> None:
        """A consumer with a selector asks for what this node's copy of the
        state says is there: no bus traffic for a queue of messages the
        selector passes over, and each message looked at once until a
        release or a restore.  It keeps no standing demand."""
        assert consumer.match is not None
        want = consumer.link.credit - consumer.acquiring
        if want <= 0 or available(self.member.state, consumer.queue) <= 0:
            return
        generation = self._restores + self._releases.get(consumer.queue, 0)
        start, seen = consumer.clear
        if seen != generation:
            start = 0
        want, clear = self.member.state.queues[consumer.queue].count_matching(
            start, want, consumer.match
        )
        consumer.clear = (clear, generation)
        if want <= 0:
            return
        consumer.acquiring += want
        self.member.post(
            pc.AcquireMatching(
                consumer.queue, consumer.session, consumer.id, want, consumer.selector
            )
        )

    def _standing(self, consumer: _Consumer) -> int:
        """What the state still owes ``consumer`` of its acquires."""
        q = self.member.state.queues.get(consumer.queue)
        return 0 if q is None else q.waiting.get((consumer.session, consumer.id), 0)

    def _give_back(self, queue: str, session: int, consumer: int, pos: int) -> None:
        """A message assigned to a consumer that cannot take it goes back to
        its queue, and the consumer's standing demand with it (or the queue
        would hand it the same message again)."""
        self.member.post(pc.Withdraw(queue, session, consumer))
        self.member.post(pc.Release(queue, session, (pos,), False))

    def _browse(self, consumer: _Consumer) -> None:
        """Send a browser the next messages of its queue, as far as its
        credit goes, acquiring none (docs/broker.md, "Browsing")."""
        credit = consumer.link.credit
        q = self.member.state.queues.get(consumer.queue)
        if credit <= 0 or q is None or consumer.link.closed or not self.quorate():
            return
        messages, consumer.cursor = q.browse(consumer.cursor, credit, consumer.match)
        for msg in messages:
            try:
                consumer.link.send_encoded_nowait(delivery_bytes(msg), msg.pos)
            except (trio.WouldBlock, DrgateError):
                return  # the client left: nothing to give back

    # ------------------------------------------------------------------
    # AMQP handler
    # ------------------------------------------------------------------

    def _session_for(self, conn: AmqpConnection) -> tuple[int, bool]:
        assert self.member.me is not None
        session = self._sessions.get(conn.id)
        if session is not None:
            return session, False
        session = st.session_id(self.member.me.node, self.member.me.pid, conn.id)
        self._sessions[conn.id] = session
        return session, True

    async def _ensure_queue(self, link: OutgoingLink | IncomingLink, address: str) -> bool:
        """The queue or exchange exists, or was created on demand; else the
        link is refused with amqp:not-found."""
        if has_queue(self.member.state, address) or has_exchange(self.member.state, address):
            return True
        if link.create_on_demand:
            args = {k: plain(v) for k, v in link.declare_arguments().items()}
            args.pop(TEMPORARY_ARG, None)  # only a dynamic node makes a temporary queue
            # The state machine refuses the same arguments; checked here so
            # that the client hears why, not that the queue does not exist.
            problem = check_declare_args(args)
            if problem is not None:
                link.close("amqp:invalid-field", declare_refused(address, problem))
                return False
            await self.member.submit_and_wait(pc.QueueDeclare(address, args))
            if has_queue(self.member.state, address):
                return True
        link.close(
            "amqp:not-found",
            f"no queue or exchange named {address!r} at {self.config.cluster}; declare it "
            f"with 'drgate admin add-queue {address}' or attach with the "
            "'create-on-demand' capability",
        )
        return False

    def unauthorized(self, principal: Principal, verb: str, address: str) -> str:
        """Why ``principal`` may not ``verb`` (publish, consume, manage) ``address``,
        and the fix (docs/broker.md, "Users and rights")."""
        users = self.config.security.users_file or "USERS"
        if verb == "manage":
            fix = f"drgate admin user add {principal.name} --admin --file {users}"
            rights = "is not an admin"
        else:
            patterns = principal.publish if verb == "publish" else principal.consume
            fix = f"drgate admin user add {principal.name} --{verb} {address} --file {users}"
            rights = f"has {verb} patterns {', '.join(patterns) or '(none)'}"
        return (
            f"user {principal.name!r} may not {verb} {address!r} at {self.config.cluster} "
            f"node {self.config.node}: it {rights}; to allow it, run '{fix}' (keeping its "
            "other options) and restart the brokers"
        )

    def _authorized(self, link: OutgoingLink | IncomingLink, verb: str, address: str) -> bool:
        """``link``'s client may ``verb`` ``address``; else the link is closed
        with amqp:unauthorized-access."""
        principal = link.connection.principal
        if verb == "manage":
            allowed = principal.admin
        elif verb == "publish":
            allowed = principal.may_publish(address)
        else:
            allowed = principal.may_consume(address)
        if not allowed:
            link.close(UNAUTHORIZED, self.unauthorized(principal, verb, address))
        return allowed

    def memory_refusal(self, size: int) -> str | None:
        """Why a publish of ``size`` bytes would take the site's state beyond
        ``max_site_bytes``; ``None`` when it fits.  Every node holds the same
        state, so every node decides the same way (in-flight publishes of
        this node count too)."""
        state = self.member.state
        if self._held_bytes[0] != state.cseq:
            self._held_bytes = (state.cseq, sum(q.bytes for q in state.queues.values()))
        held = self._held_bytes[1] + self._inflight_bytes
        cap = self.config.max_site_bytes
        if held + size <= cap:
            return None
        return (
            f"site {self.config.cluster} holds {held} bytes of messages, and this one of "
            f"{size} bytes would pass its cap of {cap} ('max_site_bytes' in the broker "
            "config): consume or purge messages, then publish again"
        )

    async def on_sender_link(self, link: OutgoingLink) -> None:
        address = link.address or ""
        if address == QUEUES_ADDRESS:
            self._authorized(link, "manage", address)
            return
        if address and not self._authorized(link, "consume", address):
            return
        if not self.quorate():
            link.close(MINORITY_CONDITION, self.minority_refusal())
            return
        selector = self._selector(link, address)
        if selector is None:
            return
        if link.dynamic:
            address = await self._temporary_queue(link) or ""
            if not address:
                return
        if not address or not await self._ensure_queue(link, address):
            if not address:
                link.close("amqp:invalid-field", "a receiving link must name a queue")
            return
        if not has_queue(self.member.state, address):
            link.close("amqp:not-allowed", f"{address!r} is an exchange; receive from a queue")
            return
        refusal = read_only_refusal(self.member.state, address)
        if refusal is not None:
            link.close(refusal[0], refusal[1])
            return
        session, new = self._session_for(link.connection)
        if new:
            await self.member.submit(pc.SessionOpen(session))
        link.answer_browse(link.browse)
        consumer = _Consumer(
            link,
            address,
            session,
            next(self._consumer_ids),
            browse=link.browse,
            selector=selector,
            match=matcher(selector) if selector else None,
        )
        self._consumers[link] = consumer
        self._by_consumer_id[consumer.id] = consumer

    async def _temporary_queue(self, link: OutgoingLink | IncomingLink) -> str | None:
        """Create the temporary queue of ``link``'s dynamic terminus and name
        it in the attach; ``None`` after refusing the link.  The queue is
        owned by the connection's session: the link's close deletes it, and
        so does the session's end (the connection's, or its broker's, as
        every member applies the SessionClose or the view change).  The
        client's declare arguments are not used: a temporary queue is never
        durable and never replicated (docs/broker.md, "Dynamic nodes")."""
        session, new = self._session_for(link.connection)
        if new:
            await self.member.submit(pc.SessionOpen(session))
        name = f"{TEMPORARY_PREFIX}{uuid.uuid4()}"
        args: dict[str, Value] = {TEMPORARY_ARG: f"{session:#x}", REPLICATE_ARG: "none"}
        await self.member.submit_and_wait(pc.QueueDeclare(name, args))
        if not has_queue(self.member.state, name):
            link.close(
                "amqp:internal-error",
                f"the temporary queue {name!r} for this dynamic node was not created at "
                f"{self.config.cluster} node {self.config.node}; attach again",
            )
            return None
        link.set_address(name)
        self._temporary[link] = name
        return name

    def _selector(self, link: OutgoingLink, address: str) -> str | None:
        """The JMS selector of ``link``'s source ("" for none; the attach
        echoes it, as it is applied), or ``None`` after refusing the link: a
        filter this broker does not apply, or a selector that does not parse
        (docs/broker.md, "Selectors")."""
        try:
            text = (selector_filter(link.filter) or "").strip()
            if text:
                matcher(text)
        except FilterRefusal as refusal:
            link.close(refusal.condition, f"cannot consume from {address!r}: {refusal}")
            return None
        except SelectorError as exc:
            link.close("amqp:invalid-field", f"cannot consume from {address!r}: {exc}")
            return None
        return text

    async def on_receiver_link(self, link: IncomingLink) -> None:
        address = link.address
        if address == ADMIN_ADDRESS:
            if self._authorized(link, "manage", address):
                link.flow(10)
            return
        if address is not None and not self._authorized(link, "publish", address):
            return
        if not self.quorate():
            link.close(MINORITY_CONDITION, self.minority_refusal())
            return
        if link.dynamic:
            if await self._temporary_queue(link) is not None:
                link.flow(PUBLISH_WINDOW)
            return
        if address is not None:
            if not await self._ensure_queue(link, address):
                return
            refusal = read_only_refusal(self.member.state, address)
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
        fields = delivery.fields
        address = link.address or fields.to or ""
        principal = link.connection.principal
        # Stored and passed on as the client sent it (docs/broker.md,
        # "Messages pass through unchanged").
        body = delivery.encoded
        refusal = None
        if not principal.may_publish(address) and self._temporary.get(link) != address:
            refusal = Rejected(UNAUTHORIZED, self.unauthorized(principal, "publish", address))
        elif (too_much := self.memory_refusal(len(body))) is not None:
            refusal = Rejected(RESOURCE_LIMIT, too_much)
        if refusal is not None:
            delivery.settle(refusal)
            link.flow(1)
            return
        if has_exchange(self.member.state, address) and not has_queue(self.member.state, address):
            exchange, key = address, fields.subject or ""
        else:
            exchange, key = "", address
        properties: dict[str, Value] = dict(fields.properties)
        if fields.subject:
            properties.setdefault("subject", fields.subject)
        # The header's durable, in the reserved key only the header sets.
        properties.pop(pc.DURABLE_PROPERTY, None)
        if fields.durable:
            properties[pc.DURABLE_PROPERTY] = True
        ref = next(self._refs)
        self._pending[ref] = delivery
        self._inflight[ref] = len(body)
        self._inflight_bytes += len(body)
        await self.member.submit(
            pc.Publish(
                exchange,
                key,
                body,
                fields.message_id,
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

    async def on_outcomes(
        self, link: OutgoingLink, outcomes: Sequence[tuple[object, Outcome]]
    ) -> None:
        consumer = self._consumers.get(link)
        if consumer is None or consumer.browse:
            return  # a browser's outcomes change nothing: it acquired nothing
        # One command per run of settlements of one kind, in order: a
        # consumer's window of accepts is one Accept on the bus.
        run: list[int] = []
        run_kind: Outcome | Settlement | None = None
        for token, outcome in outcomes:
            if not isinstance(token, int):
                continue
            consumer.unsettled.pop(token, None)
            # Modified outcomes run together only when they say the same.
            kind = outcome if isinstance(outcome, Modified) else _settlement(outcome)
            if kind != run_kind and run:
                await self._submit_settlement(consumer, run_kind, run)
                run = []
            run_kind = kind
            run.append(token)
        if run:
            await self._submit_settlement(consumer, run_kind, run)
        self._settled_on.add(link.connection.id)
        self._request(consumer)  # what it held no longer holds back its top-up

    async def on_close_asked(self, conn: AmqpConnection) -> None:
        # A client that sees its close answered takes its accepts as done: a
        # broker that died after answering must not leave them unapplied
        # (their messages would go to the next consumer again).
        if conn.id in self._settled_on:
            self._settled_on.discard(conn.id)
            await self.member.submit_and_wait()

    async def _submit_settlement(
        self, consumer: _Consumer, kind: Outcome | Settlement | None, positions: list[int]
    ) -> None:
        queue, session, held = consumer.queue, consumer.session, tuple(positions)
        if isinstance(kind, Modified):
            await self.member.submit(
                pc.Modify(
                    queue,
                    session,
                    consumer.id,
                    held,
                    kind.delivery_failed,
                    kind.undeliverable_here,
                    encode_annotations(kind.annotations),
                )
            )
        elif isinstance(kind, tuple) and kind[0] == "accept":
            # A rejected message is discarded (there is no dead-letter queue).
            await self.member.submit(pc.Accept(queue, session, held))
        else:
            await self.member.submit(pc.Release(queue, session, held, False))

    async def on_link_closed(self, link: OutgoingLink | IncomingLink) -> None:
        await self._link_closed(link)
        temporary = self._temporary.pop(link, None)
        if temporary is not None and has_queue(self.member.state, temporary):
            # Its dynamic node goes with it (if the connection ends first,
            # the SessionClose deletes it as well).
            await self.member.submit(pc.QueueDelete(temporary))

    async def _link_closed(self, link: OutgoingLink | IncomingLink) -> None:
        if isinstance(link, OutgoingLink):
            consumer = self._consumers.pop(link, None)
            if consumer is None:
                return
            self._by_consumer_id.pop(consumer.id, None)
            closing: list[pc.Command] = []
            if consumer.acquiring or self._standing(consumer):
                closing.append(pc.Withdraw(consumer.queue, consumer.session, consumer.id))
            if consumer.unsettled:
                # They went out on the wire: the client may have seen them
                # (even after it began to close), so the next consumer is
                # told they may be duplicates.
                closing.append(
                    pc.Release(consumer.queue, consumer.session, tuple(consumer.unsettled), True)
                )
            if closing:
                await self.member.submit(*closing)
        else:
            for ref, delivery in list(self._pending.items()):
                if delivery.link is link:
                    # The command is on its way; its outcome can no longer be told.
                    self._pending.pop(ref, None)

    async def on_connection_closed(self, conn: AmqpConnection) -> None:
        self._settled_on.discard(conn.id)
        session = self._sessions.pop(conn.id, None)
        if session is not None:
            await self.member.submit(pc.SessionClose(session))

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
                await self.member.submit_and_wait(*commands)
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
            "member": str(self.member.me),
            **describe(self.member.state),
        }

    def statistics(self) -> NodeStatistics:
        """A typed snapshot for the observability endpoint (cluster/nodestats.py)."""
        return broker_statistics(self)
