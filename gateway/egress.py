"""The egress: P's active sidecar streams its spool to D over the WAN link.

Theory of operation
-------------------
While this sidecar is the site's egress (:mod:`gateway.roles`), it connects
to D's sidecars in the configured order and runs one link connection at a
time (:meth:`Egress.serve`).  A connection starts with HELLO; D's WELCOME
says what D applied (``resume_from``), and the egress queues the spool's
events after that point, or first a resync snapshot when D applied nothing
of this incarnation or less than the spool reaches back to.  D's acks trim
the spool, and the acked point is announced on P's bus (``AckWatermark``, at
most once a second) so that the standbys trim theirs.

One task per connection reads D's bytes into the sans-IO
:class:`protocol.link.LinkSender`; the connection's loop handles the
sender's events, queues spool events while the window has room, sends what
the sender has to send and then waits in one cancel scope until the link's
next deadline.  Anything that may give it work (bytes from D, events, the
durable watermark, a role change) calls :meth:`Egress.wake`, which cancels
that wait (or, if the loop is busy, makes it skip the next one).  An event
above the durable watermark waits for it: it is not work.

The connection is mutual TLS unless the config says ``insecure: true``
(:func:`open_link`): after the handshake the egress checks that D's
certificate carries one of the pinned names (``tls.peer_names``) and, when
it does not, tells D so in an ERROR frame and refuses the link for good.

A failed connection is logged, kept in ``last_error`` and retried with
jittered exponential backoff; a refusal only an operator can fix (D was
promoted, a new incarnation) is kept while standbys answer "not active",
and retried at the slowest backoff.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from cluster.addresses import Address
from cluster.member import SiteMember
from cluster.state.switchover import handed_over
from gateway import resync as rs
from gateway.ackwatermark import WatermarkAnnouncer
from gateway.capture import CaptureSink
from gateway.linkconnect import READ_BYTES, describe_error, link_error_in, tls_refusal_reason
from gateway.linkstatus import LinkStatus
from gateway.roles import RoleSignal, SidecarRole
from gateway.spool import Spool
from gateway.statistics import LinkSection, egress_link_section
from gateway.supersession import handed_over_text, post_superseded
from gateway.tap import Tap
from protocol import link
from protocol.errors import DrgateError, LinkError

if TYPE_CHECKING:
    from gateway.sidecarconfig import SidecarConfig

log = logging.getLogger("drgate.sidecar")

# Reconnect backoff: from 0.1 s doubling to 5 s, with +-50 % jitter so that a
# site's worth of reconnects does not arrive in step.
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
# How often a parked egress (its site handed over) looks for a failback.
HANDED_OVER_POLL_S = 1.0
# Bytes of spool read per replay step.
REPLAY_BYTES = 1 << 20
# How long the loop waits when the link machine has no deadline.
IDLE_WAIT_S = 1.0

Connector = Callable[[Address], Awaitable[trio.abc.Stream]]


@dataclass(slots=True)
class _Session:
    """One link connection's progress."""

    sender: link.LinkSender
    address: str
    welcomed: bool = False
    last_queued: int = 0  # the highest seq handed to the sender
    resync: rs.SnapshotStream | None = None  # a resync being sent
    held_at: int | None = None  # the durable watermark the next event waits above


class Egress:
    """P's side of the WAN link.  ``spool`` is read at every step, since a
    rejoin replaces the spool; ``role`` is this sidecar's current role."""

    def __init__(
        self,
        config: SidecarConfig,
        member: SiteMember,
        tap: Tap,
        *,
        spool: Callable[[], Spool | None],
        role: Callable[[], SidecarRole],
        roles: RoleSignal,
        connect: Connector,
        capture: CaptureSink | None = None,
    ) -> None:
        self.config = config
        self.member = member
        self.tap = tap
        self._spool = spool
        self._role = role
        self._roles = roles
        self._connect = connect
        self.capture = capture
        self.status = LinkStatus()
        self.acked_seq = 0
        self._refusal = ""  # the last non-retriable refusal by D, until a WELCOME
        self._delta_attempts = 0  # resyncs by delta since D acked a cut (rs.delta_holdings)
        self.partitioned = False  # that refusal says D is a primary too (split brain)
        self._force_resync = False  # D found a gap: resync until a cut is acked
        self._resync_requested = False  # resync on the link that is up
        self.gaps = 0  # gaps D reported
        self._sender: link.LinkSender | None = None  # the link up's, for its statistics
        self._watermark = WatermarkAnnouncer(member, config.site)
        self._waiting: trio.CancelScope | None = None
        self._woken = False
        self.peers = config.peers  # D's sidecars, in order (set_peers)
        self._peer_dropped = False  # the peer of the link up is no longer listed

    def request_resync(self) -> None:
        """The tap left a gap (a command too big for an event, or one it could
        not tap): resync D now, on the link as it is, and on the next one
        until a cut is acked."""
        self._force_resync = True
        self._resync_requested = True
        self.wake()

    def wake(self) -> None:
        """Something may have given the connection work: stop waiting."""
        self._woken = True
        if self._waiting is not None:
            self._waiting.cancel()

    # ------------------------------------------------------------------
    # Connections
    # ------------------------------------------------------------------

    async def serve(self) -> None:
        """Run the link whenever this sidecar is the egress; never returns."""
        backoff = BACKOFF_MIN_S
        index = 0
        while True:
            role = self._role()
            if role != SidecarRole.EGRESS:
                self.status.state = "minority" if role == SidecarRole.MINORITY else "down"
                await self._roles.wait()
                continue
            if handed_over(self.member.state):
                self._parked()
                await trio.sleep(HANDED_OVER_POLL_S)
                continue
            peers = self.peers  # re-read at each attempt (set_peers)
            peer = peers[index % len(peers)]
            address = str(peer)
            index += 1
            try:
                # A refusal for good stays the link's state until a WELCOME.
                self.status.state = "refused" if self._refusal else "connecting"
                stream = await self._connect(peer)
                self.status.peer = address
                await self._run(stream, address)
                backoff = BACKOFF_MIN_S
            except Exception as exc:  # any failure of one connection: log, back off, retry
                if self._failed(address, exc):
                    backoff = BACKOFF_MAX_S
            self._ended()
            if index % len(peers) == 0:
                await trio.sleep(backoff * random.uniform(0.5, 1.5))
                backoff = min(BACKOFF_MAX_S, backoff * 2)

    def set_peers(self, peers: tuple[Address, ...]) -> None:
        """D's sidecars are now ``peers`` (the config was edited): tried from
        the next attempt on; a link to a peer no longer listed is ended."""
        self.peers = peers
        if self.status.state == "up" and self.status.peer not in {str(p) for p in peers}:
            self._peer_dropped = True
            self.wake()

    def _failed(self, address: str, exc: Exception) -> bool:
        """Record a failed connection; True when D refused it for good."""
        error = f"link to {address}: {describe_error(exc)}"
        reason = tls_refusal_reason(exc)
        if reason is not None:
            self.status.tls_refused[reason] += 1
        link_error = link_error_in(exc)
        refused = link_error is not None and not link_error.retriable
        # D was promoted over this site: a split brain (PARTITIONED), or an
        # older D that says only STALE_EPOCH.
        code = None if link_error is None else link_error.code
        if code in (link.LinkErrorCode.STALE_EPOCH, link.LinkErrorCode.PARTITIONED):
            self._superseded(error)
        if refused:
            # D refused for a reason only an operator can fix (promoted, new
            # incarnation): keep saying so while standbys answer "not active".
            self._refusal = error
            self.partitioned = code == link.LinkErrorCode.PARTITIONED
        if refused or not self._refusal:
            self.status.last_error = error
        log.warning("egress: %s", error)
        return refused

    def _ended(self) -> None:
        self.status.state = "refused" if self._refusal else "down"
        self.status.resync.active = False  # an unfinished resync starts again from scratch
        self.status.reconnects += 1
        sender, self._sender = self._sender, None
        if sender is not None:
            s = sender.statistics()
            self.status.ended.update(
                bytes_sent_total=s.bytes_raw,
                bytes_sent_wire_total=s.bytes_sent,
                batches_sent_total=s.batches,
                events_sent_total=s.events,
            )

    def _superseded(self, error: str) -> None:
        """D was promoted over this site (gateway/supersession.py)."""
        state = self.member.state
        if state.superseded_by:
            return
        if self.config.zombie_guard != "off" or state.switchover_to == self.config.peer_cluster:
            post_superseded(self.member, self.config, self.tap.rules, error)

    def _parked(self) -> None:
        """This site handed its role over in a planned switchover: D is the
        primary, not a second one, so the egress does not dial it (a refused
        HELLO would tell D of a split brain) until a failback sets a new epoch."""
        self.status.state = "refused"
        self.status.last_error = handed_over_text(self.config.site, self.member.state)

    def _spool_now(self) -> Spool:
        spool = self._spool()
        if spool is None:
            raise DrgateError("the spool is being replaced (the sidecar rejoins its site)")
        return spool

    async def _run(self, stream: trio.abc.Stream, address: str) -> None:
        sender = link.LinkSender(
            self.config.link.sender_config(
                self.config.site,
                self.config.peer_cluster,
                incarnation=self.member.state.incarnation,
                epoch=self.tap.epoch,
            )
        )
        session = _Session(sender, address)
        self._sender = sender
        floor = self._spool_now().floor
        async with stream, trio.open_nursery() as nursery:
            await stream.send_all(sender.start(trio.current_time(), resume_point=floor))
            nursery.start_soon(self._read, stream, sender, address)
            while True:
                self._woken = False
                if self._role() != SidecarRole.EGRESS:
                    raise DrgateError("no longer the active egress")
                if self._peer_dropped:
                    self._peer_dropped = False
                    raise DrgateError(f"{address} is no longer among the config's peers")
                if self.tap.epoch != sender.config.epoch:
                    raise DrgateError(f"this site's epoch is now {self.tap.epoch}: reconnecting")
                await self._handle_events(session)
                if self._resync_requested and session.welcomed and session.resync is None:
                    session.last_queued = self._begin_resync(session, self.acked_seq)
                self._queue_resync(session)
                self._queue_events(session)
                now = trio.current_time()
                # P's clock and position, for the next PING (D's recovery point).
                sender.announce(time_us=_now_us(), last_seq=self._spool_now().held_upto)
                out = sender.data_to_send(now)
                if self.capture is not None:
                    # Stamped before the bytes leave: over a short link D may
                    # apply them before this task runs again.
                    self.capture.forwarded_sent(sender, sender.statistics())
                if out:
                    await stream.send_all(out)
                deadline = self._watermark.due(self.acked_seq, sender.tick(trio.current_time()))
                if self._woken or self._has_more(session):
                    await trio.lowlevel.checkpoint()
                    continue
                with trio.move_on_at(deadline if deadline is not None else now + IDLE_WAIT_S) as w:
                    self._waiting = w
                    await trio.sleep_forever()
                self._waiting = None

    async def _read(self, stream: trio.abc.Stream, sender: link.LinkSender, address: str) -> None:
        while True:
            data = await stream.receive_some(READ_BYTES)
            if not data:
                raise trio.BrokenResourceError(f"{address} closed the link")
            sender.receive_data(bytes(data))
            self.wake()

    def _has_more(self, session: _Session) -> bool:
        """Spooled events wait and the window has room.  (A resync cut may lie
        above the spool's last event: the cut is a cseq, and not every command
        makes an event.)"""
        if not session.welcomed or session.sender.window_full:
            return False
        if session.resync is not None:
            waiting = session.resync.exhausted and self._durable_limit() < session.resync.plan.cut
            return session.sender.queued == 0 and not waiting
        durable = self._durable_limit()
        if session.held_at == durable:
            return False
        last = self._spool_now().last_seq  # not statistics(): this runs at every wake
        return last is not None and min(last, durable) > session.last_queued

    def _durable_limit(self) -> int:
        """The highest seq that may cross (journaled brokers: the durable watermark)."""
        if self.member.bus_config.expect_brokers == 0:
            return 2**64
        return self.member.state.durable_cseq

    def _queue_events(self, session: _Session) -> None:
        if not session.welcomed or session.sender.window_full or session.resync is not None:
            return
        spool = self._spool_now()
        durable = self._durable_limit()
        session.held_at = None
        for seq, time_us, payload, prev_seq in spool.read_after(session.last_queued, REPLAY_BYTES):
            if seq > durable:
                session.held_at = durable  # not on any broker's disk yet
                break
            session.sender.send_event(link.LinkEvent(seq, time_us, payload, prev_seq=prev_seq))
            if self.capture is not None:
                self.capture.forwarded(session.sender, seq, payload)
            session.last_queued = seq

    async def _handle_events(self, session: _Session) -> None:
        address = session.address
        while True:
            ev = session.sender.next_event()
            if ev is link.NEED_DATA:
                return
            if isinstance(ev, link.Welcome):
                await self._welcomed(session, ev)
            elif isinstance(ev, link.Acked):
                self._acked(ev)
            elif isinstance(ev, link.PongReceived):
                self.status.rtt = ev.rtt
            elif isinstance(ev, link.PeerError):
                if ev.code == link.LinkErrorCode.GAP:
                    self._gap_reported(address, ev.text)
                raise LinkError(
                    f"{address} refused the link: {ev.text}", code=ev.code, retriable=ev.retriable
                )
            elif isinstance(ev, link.Stalled):
                raise DrgateError(f"{address} silent for {ev.silent_for:.1f} s")
            elif isinstance(ev, link.ConnectionClosed):
                raise DrgateError(f"{address} closed the link")

    def _gap_reported(self, address: str, text: str) -> None:
        """D refused a discontinuity: events it needs are not in this spool
        (lost below the link), so the next connection resyncs."""
        self.gaps += 1
        self._force_resync = True
        log.error("egress: %s found a gap in the stream (%s); resyncing it", address, text)

    async def _welcomed(self, session: _Session, ev: link.Welcome) -> None:
        session.welcomed = True
        self.status.state = "up"
        self._refusal = ""
        self.partitioned = False
        session.last_queued = ev.resume_from
        # D applied up to resume_from, and (journaled D) has it on disk: as
        # good as an ack (a converged link may never carry another one).
        self._acked_up_to(ev.resume_from)
        # D applied nothing of this incarnation (a new D, or one that accepted
        # a new incarnation), less than the spool reaches back to, or found a
        # gap in what the spool sent: a snapshot cut at our cseq.
        spool = self._spool_now()
        if self._force_resync or ev.resume_from == 0 or spool.needs_resync(ev.resume_from):
            session.last_queued = self._begin_resync(session, ev.resume_from, ev.holdings)
        log.info("egress: link up to %s, resuming after %d", session.address, session.last_queued)

    def _acked(self, ev: link.Acked) -> None:
        resync = self.status.resync
        if resync.active:
            resync.chunks_done = ev.resync_chunks
            if ev.seq >= resync.cut:
                resync.active = False
                self._force_resync = False
                self._delta_attempts = 0
                log.info("egress: resync cut at %d applied by D", ev.seq)
        self._acked_up_to(ev.seq)

    def _acked_up_to(self, seq: int) -> None:
        self.acked_seq = seq
        self._spool_now().trim(seq)
        self._watermark.announce(self.acked_seq)

    def _begin_resync(self, session: _Session, resume: int, holdings: bytes = b"") -> int:
        """Start a resync snapshot cut at the current cseq; returns the cut.
        Its chunks are made as the window takes them (:meth:`_queue_resync`).
        ``holdings``: what D holds (a failback by delta), left out of it."""
        self._resync_requested = False
        state, rules = self.member.state, self.tap.rules
        plan = rs.plan_snapshot(state, rules)  # synchronous: the cut
        log.info(
            "egress: D (%s) applied up to %d, spool floor %d: resync cut at %d, %d messages",
            session.address,
            resume,
            self._spool_now().floor,
            plan.cut,
            plan.messages,
        )
        session.resync = rs.SnapshotStream(
            plan,
            rules,
            origin=self.config.site,
            epoch=self.tap.epoch,
            time_us=_now_us(),
            holdings=rs.delta_holdings(holdings, self._delta_attempts),
            peer=self.config.peer_cluster,
        )
        if session.resync.holdings is not None:
            self._delta_attempts += 1  # until D acknowledges a cut
        self.status.resync.begin(chunks=0, cut=plan.cut)
        self.status.resync.messages = plan.messages
        session.sender.begin_resync(plan.cut)
        return plan.cut

    def _queue_resync(self, session: _Session) -> None:
        """The resync's next chunk, when the sender has sent what it had and
        the window has room: P holds one chunk beyond the window."""
        stream = session.resync
        sender = session.sender
        if stream is None or sender.window_full or sender.queued:
            return
        chunk = stream.next_chunk()
        if chunk is None and self._durable_limit() < stream.plan.cut:
            return  # all sent; the cut must be on a broker's disk before END

        if chunk is None:
            sender.end_resync()
            session.resync = None
            log.info("egress: resync cut at %d sent: %s", stream.plan.cut, stream.summary())
            return
        sender.send_chunk(chunk)
        progress = self.status.resync
        progress.bytes_total += len(chunk)
        progress.chunks = stream.chunks_done
        progress.messages_done = stream.messages_done
        progress.messages_kept, progress.bytes_kept = stream.messages_kept, stream.bytes_kept

    # ------------------------------------------------------------------

    def link_statistics(self) -> LinkSection:
        """The ``link`` section of P's statistics."""
        spool = self._spool()
        spooled = None if spool is None else spool.statistics()
        # A standby's spool is trimmed by the active egress's watermarks.
        acked = max(self.acked_seq, 0 if spooled is None else spooled.trimmed_upto)
        return egress_link_section(
            state=self.status.state,
            peer=self.status.peer,
            reconnects_total=self.status.reconnects,
            rtt_seconds=self.status.rtt,
            acked_seq=acked,
            lag=lag(spool, acked, time.time()),
            spool=spooled,
            sender=None if self._sender is None else self._sender.statistics(),
            ended=self.status.ended,
            gaps_total=self.gaps,
            superseded_by=self.member.state.superseded_by,
            failback_wait_cseq=self.member.state.failback_cseq,
            security="insecure" if self.config.tls is None else "mutual-tls",
            tls_refused=self.status.tls_refused,
            partitioned=self.partitioned,
        )


def lag(spool: Spool | None, acked_seq: int, now_s: float) -> tuple[int, float]:
    """Events spooled and not acked by D, and the age of the oldest in seconds
    (its origin time to ``now_s``): from the spool's index, so bounded memory."""
    events, oldest_us = (0, None) if spool is None else spool.lag(acked_seq)
    if oldest_us is None:
        return 0, 0.0
    return events, max(0.0, now_s - oldest_us / 1e6)


def _now_us() -> int:
    return int(time.time() * 1e6)
