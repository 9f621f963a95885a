"""The ingress: D's active sidecar applies P's stream to D's bus.

Theory of operation
-------------------
D's sidecars listen for the egress.  The active one (:mod:`gateway.roles`)
answers HELLO with D's ``applied[origin incarnation]``, read from the site
state, so a new ingress resumes where the old one stopped; a standby refuses
with a retriable error naming the active ingress, and the egress moves on.
A HELLO from a primary this site was promoted over (R7) or from an
incarnation D has not accepted is refused for good.  The egress takes the
resume point as an ack, so with journals the WELCOME waits, as an ack does,
until D's brokers have on disk what D applied of the stream, and refuses
for now (``NOT_DURABLE``, retriable) when they do not within
:data:`gateway.ackgate.RESUME_WAIT_S`.

Unless the config says ``insecure: true``, a connection is mutual TLS: the
handshake (bounded by :data:`gateway.linkconnect.HANDSHAKE_TIMEOUT_S`) checks
the egress's certificate against the CA, then
:func:`gateway.linkconnect.accept_link` checks that it carries one of the
pinned names (``tls.peer_names``); if not, the egress
gets an ERROR frame (``PEER_NOT_PINNED``) and the connection closes.

Per connection, the reading loop feeds the sans-IO
:class:`protocol.link.LinkReceiver` and hands the admitted events to an
applier task through a bounded channel.  An event's payload is checked
(:mod:`gateway.admission`) without decoding its inner commands and goes to
D's bus as the bytes it came in: the applier multicasts the admitted frames
with ``submit_frames_and_wait`` (batches that arrived meanwhile, in one
round trip) and acks a seq once D's bus applied it and, when D's brokers
keep journals, once it is on a D broker's disk (:mod:`gateway.ackgate`); the
ack then goes out at once.  A resync's chunks go to D's bus as
``ResyncStage`` pieces, each acked once staged, and RESYNC_END as the
``ResyncCommit`` that installs them (acked as an event is).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from cluster.bus import MemberId
from cluster.member import SiteMember
from cluster.state.views import applied
from gateway import resync as rs
from gateway.ackgate import AckGate, DurableWatermark
from gateway.admission import admit_event
from gateway.fencing import PartitionWatch, refusal, resume_from
from gateway.linkconnect import (
    READ_BYTES,
    REFUSAL_GRACE_S,
    accept_link,
    describe_error,
    peer_address,
)
from gateway.linkstatus import LinkStatus
from gateway.recoverypoint import HeartbeatPoster
from gateway.roles import PRIMARY_ROLES, SidecarRole
from gateway.statistics import LinkSection, ingress_link_section
from protocol import cluster as pc
from protocol import link
from protocol.errors import DrgateError, LinkError, RemoteProtocolError

if TYPE_CHECKING:
    from gateway.sidecarconfig import SidecarConfig

log = logging.getLogger("drgate.sidecar")

# The most events D's ingress hands its bus in one round trip (several link
# batches that arrived while the previous round trip ran).
INGRESS_BATCH_COMMANDS = 2000
# Link batches decoded and waiting for the applier: the bound that makes a
# slow D bus backpressure the link (the receiver then stops reading).
APPLY_QUEUE = 8
# How long the loop waits for bytes when the link machine has no deadline.
IDLE_WAIT_S = 1.0

# (the last seq it holds, or a resync piece's index; the admitted events'
# bus frames, or a resync's piece or commit, which goes through D's bus alone)
_Work = tuple[int, list[bytes] | pc.ResyncStage | pc.ResyncCommit]


class Ingress:
    """D's side of the WAN link: a listener, and one :class:`_Connection` per
    accepted socket."""

    def __init__(
        self,
        config: SidecarConfig,
        member: SiteMember,
        *,
        role: Callable[[], SidecarRole],
        active: Callable[[], MemberId | None],
        ssl_context: ssl.SSLContext | None = None,
        pinned: tuple[str, ...] = (),
    ) -> None:
        """With ``ssl_context`` every connection is TLS, and the egress's
        certificate must carry one of the ``pinned`` names."""
        self.config = config
        self.member = member
        self._role = role
        self._active = active
        self._ssl_context = ssl_context
        self._pinned = pinned
        self.status = LinkStatus()
        self.partition = PartitionWatch()  # a second primary knocking (split brain)
        self.heartbeats = HeartbeatPoster(member.post)  # P's position, to D's bus
        self.ingested = 0  # replicated commands applied through this ingress
        self.refused_events = 0  # events a link peer sent that D does not admit
        self.links_up = 0  # accepted link connections open now
        self.link_port: int | None = None  # the bound link port
        # each open connection's receiver, for its statistics
        self._receivers: dict[int, link.LinkReceiver] = {}
        # What D's brokers have on disk; the sidecar's hook says when it moves.
        journaled = member.bus_config.expect_brokers > 0
        self.durable = DurableWatermark((lambda: member.state.durable_cseq) if journaled else None)

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on ``host:port``; started with the bound port."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.link_port = listeners[0].socket.getsockname()[1]
        task_status.started(self.link_port)
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream: trio.abc.Stream) -> None:
        """Serve one connection; its failure is logged, the listener carries on."""
        connection = None
        try:
            if self._ssl_context is not None:
                stream = await accept_link(
                    stream,
                    self._ssl_context,
                    pinned=self._pinned,
                    site=self.config.site,
                    refused=self.status.tls_refused,
                )
            connection = _Connection(self, peer_address(stream))
            await connection.run(stream)
        except Exception as exc:  # one connection failed; the listener carries on
            error = f"ingress: {describe_error(exc)}"
            log.warning("%s", error)
            if connection is None or not connection.refused:
                self.status.last_error = error  # else the refusal's reason stays
        finally:
            if self.links_up == 0:
                self.status.state = "down"  # the last accepted connection ended
            self.status.resync.active = False  # unapplied chunks go with the connection
            await trio.aclose_forcefully(stream)

    # ------------------------------------------------------------------
    # Admission
    # ------------------------------------------------------------------

    def answer_hello(self, receiver: link.LinkReceiver, hello: link.Hello) -> tuple[bytes, bool]:
        """The answer to a HELLO, and whether it accepts the link."""
        site = self.config.site
        # Only the active ingress judges a stream (a standby's state may lag),
        # but any sidecar of a site that is the primary now tells an old one.
        not_active = self.not_active()
        if not_active is not None and self._role() not in PRIMARY_ROLES:
            code = int(link.LinkErrorCode.NOT_ACTIVE)
            return receiver.refuse(code, not_active, retriable=True), False
        if hello.target_cluster != site or hello.origin_cluster != self.config.peer_cluster:
            text = (
                f"this is {site}, expecting a stream from {self.config.peer_cluster}; "
                f"got {hello.origin_cluster} -> {hello.target_cluster}"
            )
            code = int(link.LinkErrorCode.WRONG_CLUSTER)
            return receiver.refuse(code, text, retriable=False), False
        fenced = self.fence_reason(hello)
        if fenced is not None:
            code, text = fenced
            self.status.last_error = f"ingress: refused {hello.origin_cluster}: {text}"
            return receiver.refuse(code, text, retriable=False), False
        if not_active is not None:
            code = int(link.LinkErrorCode.NOT_ACTIVE)
            return receiver.refuse(code, not_active, retriable=True), False
        not_durable = self.durable.resume_refusal(self.member.state, site, hello.origin_cluster)
        if not_durable is not None:
            self.status.last_error = (
                f"ingress: refused {hello.origin_cluster} for now: {not_durable}"
            )
            log.warning("%s", self.status.last_error)
            code = int(link.LinkErrorCode.NOT_DURABLE)
            return receiver.refuse(code, not_durable, retriable=True), False
        resume = resume_from(self.member.state, hello)
        self.status.state, self.status.peer = "up", hello.origin_cluster
        log.info("ingress: link up from %s, resuming after %d", hello.origin_cluster, resume)
        window = min(hello.window_bytes, self.config.link.window_bytes)
        held = rs.welcome_holdings(self.member.state, hello.origin_cluster, resume)
        return receiver.accept(resume, window, trio.current_time(), holdings=held), True

    def not_active(self) -> str | None:
        """Why this sidecar takes no link (it is not the active ingress), or None."""
        role = self._role()
        if role == SidecarRole.INGRESS:
            return None
        active = self._active()
        where = "not known yet" if active is None else f"node {active.node} (bus member {active})"
        site, node = self.config.site, self.config.node
        return f"{site} node {node} is {role}; the active ingress is {where}"

    def fence_reason(self, hello: link.Hello) -> tuple[int, str] | None:
        """Why a stream of ``hello``'s epoch and incarnation is refused
        (:func:`gateway.fencing.refusal`); None to go on.  A refusal of a
        second primary marks the split brain (:attr:`partition`)."""
        refused = refusal(self.member.state, site=self.config.site, hello=hello)
        if refused is None:
            return None
        if refused.partitioned:
            self.partition.refused(hello.origin_cluster)
        return refused.code, refused.text

    def check_piece_staged(self, cmd: pc.ResyncStage) -> None:
        """After D's bus applied a ResyncStage: is it staged (else do not ack)?"""
        self.status.resync.chunks_done = cmd.index + 1
        rs.check_staged(self.member.state, cmd, self.config.site)

    def check_resync_applied(self, cmd: pc.ResyncCommit) -> None:
        """After D's bus applied a ResyncCommit: did it take (else do not ack)?"""
        self.status.resync.active = False
        rs.check_installed(self.member.state, cmd, self.config.site)
        log.info("ingress: resync from %s cut at %d applied", cmd.origin_cluster, cmd.cut)

    # ------------------------------------------------------------------

    def link_statistics(self) -> LinkSection:
        """The ``link`` section of D's statistics."""
        return ingress_link_section(
            state=self.status.state,
            peer=self.status.peer,
            reconnects_total=self.status.reconnects,
            rtt_seconds=self.status.rtt,
            events_received_total=self.ingested,
            receivers=[receiver.statistics() for receiver in self._receivers.values()],
            ended=self.status.ended,
            refused_total=self.refused_events,
            security="insecure" if self._ssl_context is None else "mutual-tls",
            tls_refused=self.status.tls_refused,
            partitioned=self.partition.partitioned(self.member.state),
        )


class _Connection:
    """One accepted link connection: the reading loop and its applier."""

    def __init__(self, ingress: Ingress, peer: str = "") -> None:
        self.ingress = ingress
        self.peer = peer  # the remote address, for the logs
        self.receiver = link.LinkReceiver(
            ingress.config.link.receiver_config(ingress.config.site), now=trio.current_time()
        )
        self.to_apply_send, self.to_apply = trio.open_memory_channel[_Work](APPLY_QUEUE)
        self.acks = AckGate(ingress.durable, self._ack)
        # The wait for the egress's next bytes; the applier cancels it after
        # an ack, so the ack goes out at once.
        self.reading: trio.CancelScope | None = None
        self.resync: link.ResyncBegin | None = None  # the resync being received
        self.resync_time_us = 0
        self.accepted = False  # this connection's HELLO was accepted
        self.refused = False  # its HELLO was refused (the peer then closes)

    async def run(self, stream: trio.abc.Stream) -> None:
        ingress = self.ingress
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._applier)
                nursery.start_soon(self.acks.serve)
                await self._serve_link(stream)
        except* RemoteProtocolError as group:
            first = group.exceptions[0]
            assert isinstance(first, RemoteProtocolError)
            await self._refuse(stream, first)
            raise
        finally:
            if self.accepted:
                ingress.links_up -= 1
            if ingress._receivers.pop(id(self), None) is not None:
                ended = self.receiver.statistics()  # as it ended, the gap included
                ingress.status.ended.update(
                    bytes_received_wire_total=ended.bytes_received,
                    batches_received_total=ended.batches,
                    gaps_total=ended.gaps,
                )

    async def _serve_link(self, stream: trio.abc.Stream) -> None:
        """The reading loop: send what the receiver has, read, hand events up."""
        receiver = self.receiver
        self.ingress._receivers[id(self)] = receiver
        while True:
            now = trio.current_time()
            out = receiver.data_to_send(now)
            if out:
                await stream.send_all(out)
            await self._receive(stream, receiver.tick(now), now)
            await self._check_fenced(stream)
            await self._handle_events(stream)

    async def _refuse(self, stream: trio.abc.Stream, exc: RemoteProtocolError) -> None:
        """Tell the egress why the link ends (a gap in the stream makes P
        resync); a peer that does not take the bytes within the grace period
        is not waited for."""
        with trio.move_on_after(REFUSAL_GRACE_S):
            error = self.receiver.send_error(exc.code, str(exc), retriable=exc.retriable)
            await stream.send_all(error)

    async def _receive(self, stream: trio.abc.Stream, deadline: float | None, now: float) -> None:
        """Until bytes come, an ack is made or the link's next deadline.
        (A cancelled receive_some consumed nothing.)"""
        data = None
        # At least once a second, to notice a promotion or a role change.
        wake = now + IDLE_WAIT_S if deadline is None else min(deadline, now + IDLE_WAIT_S)
        with trio.move_on_at(wake) as scope:
            self.reading = scope
            data = bytes(await stream.receive_some(READ_BYTES))
        self.reading = None
        if data == b"":
            raise trio.BrokenResourceError("the egress closed the link")
        if data:
            self.receiver.receive_data(data)

    async def _check_fenced(self, stream: trio.abc.Stream) -> None:
        """Promoted (or an incarnation switch), or no longer the active
        ingress (a lower node restarted), while the link is up: close it with
        the same error a new HELLO would get."""
        hello = self.receiver.hello
        if not self.accepted or hello is None:
            return
        fenced = self.ingress.fence_reason(hello)
        not_active = self.ingress.not_active()
        if not_active is not None:
            fenced = int(link.LinkErrorCode.NOT_ACTIVE), not_active
        if fenced is not None:
            code, text = fenced
            retriable = not_active is not None
            await stream.send_all(self.receiver.send_error(code, text, retriable=retriable))
            raise LinkError(text, code=code, retriable=retriable)

    async def _handle_events(self, stream: trio.abc.Stream) -> None:
        receiver, ingress = self.receiver, self.ingress
        while True:
            ev = receiver.next_event()
            if ev is link.NEED_DATA:
                return
            if isinstance(ev, link.Hello):
                await ingress.durable.wait_resume(lambda: ingress.member.state, ev.origin_cluster)
                answer, self.accepted = ingress.answer_hello(receiver, ev)
                self.refused = not self.accepted
                ingress.links_up += self.accepted
                await stream.send_all(answer)
            elif isinstance(ev, link.ResyncBegin):
                self._resync_begin(ev)
            elif isinstance(ev, link.ResyncChunk):
                await self.to_apply_send.send((ev.index, self._resync_piece(ev)))
            elif isinstance(ev, link.ResyncEnd):
                await self.to_apply_send.send((ev.cut_seq, self._resync_commit(ev)))
            elif isinstance(ev, link.EventsReceived):
                await self._events_received(ev)
            elif isinstance(ev, link.Heartbeat) and receiver.hello is not None:
                ingress.heartbeats.heard(receiver.hello, ev, trio.current_time())
            elif isinstance(ev, link.PeerError):
                raise DrgateError(f"the egress sent an error: {ev.text}")
            elif isinstance(ev, link.Stalled):
                raise DrgateError(f"the egress was silent for {ev.silent_for:.1f} s")
            elif isinstance(ev, link.ConnectionClosed):
                raise trio.BrokenResourceError("the egress closed the link")

    def _resync_begin(self, ev: link.ResyncBegin) -> None:
        hello = self.receiver.hello
        assert hello is not None
        self.resync = ev
        self.ingress.status.resync.begin(chunks=ev.total_chunks, cut=ev.cut_seq)
        log.info("ingress: resync from %s cut at %d begins", hello.origin_cluster, ev.cut_seq)

    def _resync_piece(self, ev: link.ResyncChunk) -> pc.ResyncStage:
        """The chunk as a piece D's members stage (acked once staged)."""
        hello, begin = self.receiver.hello, self.resync
        assert hello is not None and begin is not None
        self.ingress.status.resync.bytes_total += len(ev.data)
        if ev.index == 0:
            self.resync_time_us = rs.first_time_us(ev.data)
        return pc.ResyncStage(
            hello.origin_cluster, hello.incarnation, begin.cut_seq, begin.epoch, ev.index, ev.data
        )

    def _resync_commit(self, ev: link.ResyncEnd) -> pc.ResyncCommit:
        """What installs the staged pieces at one point of D's stream, with
        the time of the cut at P (read from the first piece)."""
        hello, begin = self.receiver.hello, self.resync
        assert hello is not None and begin is not None
        self.resync = None
        origin, cut = hello.origin_cluster, ev.cut_seq
        log.info(
            "ingress: resync from %s cut at %d received: %d chunks, %d bytes; installing",
            *(origin, cut, ev.total_chunks, ev.total_bytes),
        )
        time_us = self.resync_time_us
        return pc.ResyncCommit(
            origin, hello.incarnation, cut, begin.epoch, time_us, ev.total_chunks
        )

    async def _events_received(self, ev: link.EventsReceived) -> None:
        hello = self.receiver.hello
        assert hello is not None
        frames: list[bytes] = []
        for event in ev.events:
            try:
                frames.append(admit_event(hello, event))
            except RemoteProtocolError as exc:
                self.ingress.refused_events += 1
                text = "ingress: refused an event from %s (%s): %s"
                log.error(text, hello.origin_cluster, self.peer, exc)
                raise
        if frames:
            await self.to_apply_send.send((ev.events[-1].seq, frames))

    async def _applier(self) -> None:
        """Apply, then ack: each seq once D's bus applied it, and what D's
        brokers journal once it is on one's disk (the gate)."""
        member = self.ingress.member
        async for first in self.to_apply:
            for seq, work in self._gather(first):
                if isinstance(work, list):
                    cseq = await member.submit_frames_and_wait(work)
                    self._check_applied(seq)
                    self.ingress.ingested += len(work)
                elif isinstance(work, pc.ResyncStage):
                    await member.submit_and_wait(work)
                    self.ingress.check_piece_staged(work)
                    self.receiver.ack_chunk()
                    self._ack_made()
                    continue
                else:
                    cseq = await member.submit_and_wait(work)
                    self.ingress.check_resync_applied(work)
                self.acks.applied(seq, cseq)

    def _ack(self, seq: int) -> None:
        self.receiver.ack(seq)
        self._ack_made()

    def _ack_made(self) -> None:
        """Stop waiting for the egress's bytes when the ack changes what the
        reading loop waits for (its timer starts, or it is due now); while
        the ack timer runs, the wait already ends when it runs out."""
        if self.reading is not None and self.receiver.ack_due_changed():
            self.reading.cancel()

    def _check_applied(self, seq: int) -> None:
        """Ack nothing D did not apply: the events up to ``seq`` went through
        D's bus in order, so D's watermark for the origin must have reached
        ``seq`` (a fencing or an incarnation switch in between leaves it
        lower: the link stops, and the next HELLO is refused with the reason)."""
        hello = self.receiver.hello
        assert hello is not None
        done = applied(self.ingress.member.state, hello.origin_cluster, hello.incarnation)
        if done < seq:
            raise DrgateError(
                f"events up to {seq} from {hello.origin_cluster} were not applied by "
                f"{self.ingress.config.site} (it applied up to {done}); nothing after {done} "
                "is acked, and the link restarts"
            )

    def _gather(self, first: _Work) -> list[_Work]:
        """``first`` and what else has arrived, to go through D's bus in one
        round trip (one wait, one ack); a resync's piece or commit goes alone."""
        last_seq, work = first
        if not isinstance(work, list):
            return [first]
        frames = list(work)
        while len(frames) < INGRESS_BATCH_COMMANDS:
            try:
                seq, more = self.to_apply.receive_nowait()
            except trio.WouldBlock:
                break
            if not isinstance(more, list):
                return [(last_seq, frames), (seq, more)]
            frames.extend(more)
            last_seq = seq
        return [(last_seq, frames)]
