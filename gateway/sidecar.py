"""The sidecar: tap, spool, egress at P; ingress at D (docs/architecture.md, sections 7, 8).

Theory of operation
-------------------
A sidecar is a passive member of its site's bus (:class:`cluster.node.SiteMember`):
it holds the site state, joins by state transfer like a broker, and
multicasts nothing on the data path.

At P every sidecar taps the stream (:mod:`gateway.tap`) and appends the
replication events to its spool.  The *active egress* is the lowest ready
sidecar of a quorate view; every sidecar computes that from the same stream,
so no election messages exist.  The active egress connects to D's sidecars in
the configured order, and streams its spool from the point D says it has
applied (WELCOME's ``resume_from``).  D's acks trim the spool; the egress
announces the acked point on P's bus (``AckWatermark``, at most once a second)
so the standbys trim theirs.

At D the lowest ready sidecar is the *active ingress*.  It answers HELLO with
D's ``applied[origin incarnation]`` (from the state, so a new ingress resumes
where the old one stopped), multicasts each received event into D's bus, and
acks a sequence number only once its own multicast has come back and been
applied.  A standby refuses a connection with a retriable error naming the
active ingress; the egress moves on to the next address.

A sidecar in a non-quorate view does nothing: no egress, no ingress.
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from cluster.bus import BusConfig, MemberId, ViewChange
from cluster.node import SiteMember
from cluster.state.views import applied
from filters.matcher import RuleSet
from gateway import resync as rs
from gateway.capture import CaptureConfig, CaptureSink, capture_role
from gateway.ruleswatch import POLL_S as RULES_POLL_S
from gateway.ruleswatch import RulesWatcher
from gateway.spool import DEFAULT_SEGMENT_BYTES, Spool
from gateway.tap import ReplEvent, Tap
from protocol import cluster as pc
from protocol import link
from protocol.errors import DrgateError, LinkError, RemoteProtocolError
from protocol.modes import Role

log = logging.getLogger("drgate.sidecar")

# Reconnect backoff: from 0.1 s doubling to 5 s, with +-50 % jitter so that a
# site's worth of reconnects does not arrive in step.
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
CONNECT_TIMEOUT_S = 5.0
# The standbys trim by the announced watermark; once a second is plenty.
WATERMARK_INTERVAL_S = 1.0
# Bytes of spool read per replay step.
REPLAY_BYTES = 1 << 20
READ_BYTES = 1 << 16


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    site: str  # this site's cluster id
    primary: bool  # True at P (tap + egress), False at D (ingress)
    node: int
    bus: BusConfig
    peer_cluster: str  # the other site's cluster id
    peers: tuple[str, ...]  # the other site's sidecar link addresses, in order (P)
    listen: str | None  # link listen address (D)
    spool_dir: str
    spool_max_bytes: int
    fsync: str
    rules: RuleSet
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    metrics: str | None = None
    capture: CaptureConfig | None = None


# The most replicated commands D's ingress hands its bus in one round trip
# (several link batches that arrived while the previous round trip ran).
INGRESS_BATCH_COMMANDS = 2000


def describe_error(exc: BaseException) -> str:
    """One line for a person: the messages of an exception (group)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe_error(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, DrgateError) else str(exc)


def link_error_in(exc: BaseException) -> LinkError | None:
    """The LinkError an exception is or carries: a link failure raised in a
    nursery's body reaches the caller wrapped in an exception group."""
    if isinstance(exc, LinkError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = link_error_in(inner)
            if found is not None:
                return found
    return None


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class Sidecar(SiteMember):
    role = Role.SIDECAR

    def __init__(self, config: SidecarConfig) -> None:
        super().__init__(config.site, config.bus)
        self.config = config
        self.tap = Tap(config.rules, origin_cluster=config.site)
        self.rules_watch = RulesWatcher(config.rules.path)
        self.spool: Spool | None = None
        self._events: list[ReplEvent] = []
        self._spooled = trio.Event()
        self._role_changed = trio.Event()
        self.link_state = "down"
        self.peer = ""
        self._links_up = 0  # D: accepted link connections open now
        self.last_error = ""
        self.acked_seq = 0
        self.rtt: float | None = None
        self.reconnects = 0
        self.ingested = 0
        self._last_watermark = 0.0
        self._clean_floor = 0
        self._was_minority = False
        self.link_port: int | None = None  # D: the bound link port
        self._sender_stats: Any = None
        # (seq, origin time) of events tapped and not yet acked by D: the lag.
        # Bounded by the spool: an overflow drops its oldest entries too.
        self._unacked: deque[tuple[int, int]] = deque()
        # D: the statistics of each open link connection, by connection.
        self._receiver_stats: dict[int, Any] = {}
        # Link counters of the connections that ended: /status and the
        # metrics add them, so the totals never go back.
        self._ended_links: Counter[str] = Counter()
        # Resync progress (egress: chunks acked; ingress: chunks buffered).
        self.resyncs = 0
        self.resync_active = False
        self.resync_chunks = 0
        self.resync_chunks_done = 0
        self.resync_bytes = 0
        self.resync_messages = 0
        self._resync_cut = 0
        self._refusal = ""  # the last non-retriable refusal by D, until a WELCOME
        self.capture: CaptureSink | None = None
        if config.capture is not None:
            self.capture = CaptureSink(
                config.capture,
                site=config.site,
                node=config.node,
                identity=lambda: (capture_role(self.current_role()), self.state.incarnation),
                rules=lambda: self.tap.rules,
            )

    # ------------------------------------------------------------------
    # Roles
    # ------------------------------------------------------------------

    def current_role(self) -> str:
        if self.membership is None or not self.ready.is_set() or not self.membership.is_ready:
            return "starting"
        if not self.membership.quorate:
            return "minority"
        sidecars = sorted(
            MemberId(node, pid)
            for (node, pid), role in self.state.ready.items()
            if role == Role.SIDECAR and MemberId(node, pid) in self.membership.members
        )
        active = bool(sidecars) and sidecars[0] == self.me
        if self.config.primary:
            return "egress" if active else "standby"
        return "ingress" if active else "ingress-standby"

    def active_sidecar(self) -> MemberId | None:
        if self.membership is None:
            return None
        sidecars = sorted(
            MemberId(node, pid)
            for (node, pid), role in self.state.ready.items()
            if role == Role.SIDECAR and MemberId(node, pid) in self.membership.members
        )
        return sidecars[0] if sidecars else None

    def _roles_may_have_changed(self) -> None:
        self._role_changed.set()
        self._role_changed = trio.Event()

    # ------------------------------------------------------------------
    # The stream (called by the applier, in order; never waits)
    # ------------------------------------------------------------------

    def _after_command(
        self, cmd: pc.Command, effects: Sequence[Any], sender: MemberId, own: bool
    ) -> None:
        if isinstance(cmd, pc.MemberReady):
            self._roles_may_have_changed()
        if not self.config.primary:
            if own and self.capture is not None and isinstance(cmd, pc.Replicated):
                self.capture.ingested(cmd, effects, self.state.cseq)
            return
        if isinstance(cmd, pc.AckWatermark) and self.spool is not None and not own:
            if cmd.origin_cluster == self.config.site:
                self.spool.trim(cmd.cseq)
                self._forget_acked(cmd.cseq)
            return
        event = self.tap.on_command(self.state, cmd, effects, int(time.time() * 1e6))
        if self.capture is not None:
            self.capture.tapped(cmd, effects, event, self.state.cseq, self.tap.rules)
        if event is not None:
            self._events.append(event)

    def _after_frame(self) -> None:
        if not self._events:
            return
        if self.spool is not None:
            self.spool.append_many((e.seq, e.time_us, e.payload) for e in self._events)
            self._unacked.extend((e.seq, e.time_us) for e in self._events)
            while len(self._unacked) > 1 and self.spool.floor >= self._unacked[0][0]:
                self._unacked.popleft()
            self._spooled.set()
            self._spooled = trio.Event()
        self._events.clear()

    def _on_rejoin(self) -> None:
        # The spool holds events numbered by the minority's stream: they mean
        # nothing to the site any more.  It reopens empty after the snapshot.
        if self.spool is not None:
            directory = Path(self.config.spool_dir)
            self.spool.close()
            self.spool = None
            for path in directory.iterdir():
                if path.is_file():
                    path.unlink()
        self._unacked.clear()
        self._events.clear()
        self._roles_may_have_changed()

    def _open_spool(self) -> Spool:
        """The spool, holding every event above the current cseq."""
        return Spool.open(
            self.config.spool_dir,
            max_bytes=self.config.spool_max_bytes,
            # A small spool gets small segments, so an overflow drops little.
            segment_bytes=min(DEFAULT_SEGMENT_BYTES, self.config.spool_max_bytes // 8),
            fsync=self.config.fsync,
            start_after=self.state.cseq,
        )

    def _after_restore(self) -> None:
        if self.spool is not None or not self.ready.is_set():
            return  # the first join: serve() opens the spool
        self.tap.resync_rules(self.state)
        self.spool = self._open_spool()
        self._clean_floor = 0
        self._roles_may_have_changed()

    def _view_seen(self, view: ViewChange) -> None:
        if not view.quorate:
            log.warning("%s", self.minority_text(view))
        elif self.membership is not None and self._was_minority:
            log.info("view quorate again (%d members): roles resume", len(view.members))
        self._was_minority = not view.quorate
        self._roles_may_have_changed()

    def minority_text_now(self) -> str:
        members = () if self.membership is None else self.membership.members
        return self.minority_text(ViewChange(0, members, (), (), False))

    @staticmethod
    def minority_text(view: ViewChange) -> str:
        return (
            f"in a minority partition: the view of {len(view.members)} members is not "
            "quorate, so this sidecar neither forwards nor ingests until the partition heals"
        )

    # ------------------------------------------------------------------
    # Service
    # ------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.capture is not None:
                await nursery.start(self.capture.serve)
            await nursery.start(self.serve_member)
            # Events tapped before the spool opens were part of the snapshot
            # or of the genesis; the spool starts above the current cseq.
            self.tap.resync_rules(self.state)
            self.spool = self._open_spool()
            # A cut that holds nothing to replicate: a D that has applied
            # nothing loses nothing by starting at the spool's floor.
            self._clean_floor = self.spool.floor if not self._replicated_state() else 0
            self._after_frame()
            if self.config.primary:
                nursery.start_soon(self._serve_egress)
                nursery.start_soon(self._watch_rules)
            else:
                assert self.config.listen is not None
                host, port = _split(self.config.listen)
                self.link_port = await nursery.start(self._serve_ingress, host, port)
            log.info("sidecar ready role=%s cseq=%d", self.current_role(), self.state.cseq)
            task_status.started()

    async def _watch_rules(self) -> None:
        """Propose a changed, valid rules file to the site (gateway/ruleswatch.py)."""
        watcher = self.rules_watch
        watcher.start_from()  # the file as loaded; only later edits are proposed
        if self.tap.rules.digest != self.config.rules.digest:
            log.warning(
                "rules: %s differs from the rules in force (version %d, switched at cseq %s); "
                "it is proposed only once it is edited",
                watcher.path,
                self.tap.rules.rules_version,
                self.tap.rules.cseq,
            )
        while True:
            await trio.sleep(RULES_POLL_S)  # polling a file: there is no event to await
            if self.current_role() not in ("egress", "standby"):
                continue  # not from a minority, nor before the state is here
            payload = watcher.poll(self.tap.rules)
            if payload is not None:
                await self.submit(pc.RulesSwitch(payload.to_bytes()))

    def _client_ssl(self) -> ssl.SSLContext | None:
        if self.config.tls_cert is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.config.tls_ca)
        context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        context.check_hostname = False
        return context

    def _server_ssl(self) -> ssl.SSLContext | None:
        if self.config.tls_cert is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.config.tls_ca)
        context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    # ------------------------------------------------------------------
    # Egress (P)
    # ------------------------------------------------------------------

    async def _serve_egress(self) -> None:
        backoff = BACKOFF_MIN_S
        index = 0
        while True:
            if self.current_role() != "egress":
                self.link_state = "down" if self.current_role() != "minority" else "minority"
                await self._role_changed.wait()
                continue
            address = self.config.peers[index % len(self.config.peers)]
            index += 1
            try:
                with trio.move_on_after(CONNECT_TIMEOUT_S) as scope:
                    self.link_state = "connecting"
                    host, port = _split(address)
                    stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
                if scope.cancelled_caught:
                    raise OSError(f"connect to {address} timed out")
                context = self._client_ssl()
                if context is not None:
                    stream = trio.SSLStream(stream, context, server_hostname=host)
                    await stream.do_handshake()
                self.peer = address
                await self._run_egress(stream, address)
                backoff = BACKOFF_MIN_S
            except Exception as exc:  # any failure of one connection: log, back off, retry
                error = f"link to {address}: {describe_error(exc)}"
                link_error = link_error_in(exc)
                refused = link_error is not None and not link_error.retriable
                if refused:
                    # D refused for a reason only an operator can fix (promoted,
                    # new incarnation): keep saying so while standbys answer
                    # "not active", and retry slowly.
                    self._refusal = error
                    backoff = BACKOFF_MAX_S
                if refused or not self._refusal:
                    self.last_error = error
                log.warning("egress: %s", error)
            self.link_state = "down"
            self.resync_active = False  # an unfinished resync starts again from scratch
            self.reconnects += 1
            if self._sender_stats is not None:
                s = self._sender_stats
                self._ended_links.update(
                    bytes_sent_total=s.bytes_raw,
                    bytes_sent_wire_total=s.bytes_sent,
                    batches_sent_total=s.batches,
                    events_sent_total=s.events,
                )
                self._sender_stats = None
            if index % len(self.config.peers) == 0:
                await trio.sleep(backoff * random.uniform(0.5, 1.5))
                backoff = min(BACKOFF_MAX_S, backoff * 2)

    async def _run_egress(self, stream: trio.abc.Stream, address: str) -> None:
        assert self.spool is not None
        sender = link.LinkSender(
            link.SenderConfig(
                origin_cluster=self.config.site,
                target_cluster=self.config.peer_cluster,
                incarnation=self.state.incarnation,
                epoch=self.tap.epoch,
            )
        )
        wake = trio.Event()
        async with stream, trio.open_nursery() as nursery:
            await stream.send_all(sender.start(trio.current_time(), resume_point=self.spool.floor))

            async def reader() -> None:
                nonlocal wake
                while True:
                    data = await stream.receive_some(READ_BYTES)
                    if not data:
                        raise trio.BrokenResourceError(f"{address} closed the link")
                    sender.receive_data(bytes(data))
                    wake.set()

            nursery.start_soon(reader)
            welcomed = False
            last_queued = 0
            while True:
                if self.current_role() != "egress":
                    raise DrgateError("no longer the active egress")
                while True:
                    ev = sender.next_event()
                    if ev is link.NEED_DATA:
                        break
                    if isinstance(ev, link.Welcome):
                        welcomed = True
                        self.link_state = "up"
                        self._refusal = ""
                        last_queued = ev.resume_from
                        # D applied nothing of this incarnation (a new D, or one
                        # that accepted a new incarnation), or less than the
                        # spool reaches back to: a snapshot cut at our cseq.
                        if ev.resume_from == 0 or self.spool.needs_resync(ev.resume_from):
                            last_queued = await self._send_resync(sender, address, ev.resume_from)
                        log.info("egress: link up to %s, resuming after %d", address, last_queued)
                    elif isinstance(ev, link.Acked):
                        if self.resync_active:
                            self.resync_chunks_done = ev.resync_chunks
                            if ev.seq >= self._resync_cut:
                                self.resync_active = False
                                log.info("egress: resync cut at %d applied by D", ev.seq)
                        self.acked_seq = ev.seq
                        self.spool.trim(ev.seq)
                        self._forget_acked(ev.seq)
                        self._announce_watermark()
                    elif isinstance(ev, link.PongReceived):
                        self.rtt = ev.rtt
                    elif isinstance(ev, link.PeerError):
                        raise LinkError(
                            f"{address} refused the link: {ev.text}",
                            code=ev.code,
                            retriable=ev.retriable,
                        )
                    elif isinstance(ev, link.Stalled):
                        raise DrgateError(f"{address} silent for {ev.silent_for:.1f} s")
                    elif isinstance(ev, link.ConnectionClosed):
                        raise DrgateError(f"{address} closed the link")
                if welcomed and not sender.window_full:
                    for seq, time_us, payload in self.spool.read_after(last_queued, REPLAY_BYTES):
                        sender.send_event(link.LinkEvent(seq, time_us, payload))
                        if self.capture is not None:
                            self.capture.forwarded(sender, seq, payload)
                        last_queued = seq
                now = trio.current_time()
                out = sender.data_to_send(now)
                if out:
                    await stream.send_all(out)
                self._sender_stats = sender.statistics()
                if self.capture is not None:
                    self.capture.forwarded_sent(sender, self._sender_stats)
                deadline = sender.tick(trio.current_time())
                wake = trio.Event()
                spooled = self._spooled
                role_changed = self._role_changed
                # (A resync cut may lie above the spool's last event: the cut is
                # a cseq, and not every command makes an event.)
                spool_last = self.spool.statistics().last_seq
                behind = spool_last is not None and spool_last > last_queued
                if behind and welcomed and not sender.window_full:
                    continue
                with trio.move_on_at(deadline if deadline is not None else now + 1.0):
                    async with trio.open_nursery() as waits:

                        async def first(event: trio.Event) -> None:
                            await event.wait()
                            waits.cancel_scope.cancel()

                        waits.start_soon(first, wake)
                        waits.start_soon(first, spooled)
                        waits.start_soon(first, role_changed)

    async def _send_resync(self, sender: link.LinkSender, address: str, resume: int) -> int:
        """Queue a resync snapshot cut at the current cseq; returns the cut."""
        assert self.spool is not None
        plan = rs.plan_snapshot(self.state, self.tap.rules)  # synchronous: the cut
        self._resync_cut = plan.cut
        log.info(
            "egress: D (%s) applied up to %d, spool floor %d: resync cut at %d, %d messages",
            address,
            resume,
            self.spool.floor,
            plan.cut,
            plan.messages,
        )
        records = await rs.encode_snapshot(
            plan,
            self.tap.rules,
            origin=self.config.site,
            epoch=self.tap.epoch,
            time_us=int(time.time() * 1e6),
        )
        chunks = rs.chunk_records(records)
        total = sum(len(c) for c in chunks)
        self.resyncs += 1
        self.resync_active = True
        self.resync_chunks = len(chunks)
        self.resync_chunks_done = 0
        self.resync_bytes += total
        self.resync_messages = plan.messages
        sender.begin_resync(plan.cut, total_chunks=len(chunks), total_bytes=total)
        for chunk in chunks:
            sender.send_chunk(chunk)
        sender.end_resync()
        return plan.cut

    def _replicated_state(self) -> bool:
        """Does the state hold anything the rules replicate (a queue of any
        mode but none, an exchange that is not predeclared)?"""
        for q in self.state.queues.values():
            if self.tap.rules.decide_queue(q.name, q.args).mode.label != "none":
                return True
        return any(not x.predeclared for x in self.state.exchanges.values())

    def _forget_acked(self, seq: int) -> None:
        while self._unacked and self._unacked[0][0] <= seq:
            self._unacked.popleft()

    def lag(self) -> tuple[int, float]:
        """Events tapped and not acked by D, and the age of the oldest in seconds."""
        if not self._unacked:
            return 0, 0.0
        return len(self._unacked), max(0.0, time.time() - self._unacked[0][1] / 1e6)

    def _announce_watermark(self) -> None:
        now = time.monotonic()
        if now - self._last_watermark < WATERMARK_INTERVAL_S:
            return
        self._last_watermark = now
        self._post(
            pc.AckWatermark(
                self.config.site, self.state.incarnation, self.acked_seq, int(time.time() * 1e6)
            )
        )

    # ------------------------------------------------------------------
    # Ingress (D)
    # ------------------------------------------------------------------

    async def _serve_ingress(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle_link, listeners)

    async def _handle_link(self, stream: trio.abc.Stream) -> None:
        context = self._server_ssl()
        try:
            if context is not None:
                stream = trio.SSLStream(stream, context, server_side=True)
                await stream.do_handshake()
            await self._run_ingress(stream)
        except Exception as exc:  # one connection failed; the listener carries on
            self.last_error = f"ingress: {describe_error(exc)}"
            log.warning("%s", self.last_error)
        finally:
            if self._links_up == 0 and self.current_role() == "ingress":
                self.link_state = "down"  # the last accepted connection ended
            self.resync_active = False  # chunks not applied are dropped with the connection
            await trio.aclose_forcefully(stream)

    async def _run_ingress(self, stream: trio.abc.Stream) -> None:
        receiver = link.LinkReceiver(
            link.ReceiverConfig(cluster_id=self.config.site), now=trio.current_time()
        )
        to_apply_send, to_apply = trio.open_memory_channel[tuple[int, list[pc.Command]]](8)
        # The wait for the egress's next bytes; the applier cancels it after
        # an ack, so the ack goes out at once.
        reading: trio.CancelScope | None = None

        async def applier() -> None:
            async for first_seq, first in to_apply:
                last_seq, commands = first_seq, list(first)
                later: tuple[int, list[pc.Command]] | None = None
                if not isinstance(commands[0], pc.ResyncApply):
                    # What else has arrived goes through D's bus in the same
                    # round trip: one wait for all of it, then one ack.
                    while len(commands) < INGRESS_BATCH_COMMANDS:
                        try:
                            seq, more = to_apply.receive_nowait()
                        except trio.WouldBlock:
                            break
                        if isinstance(more[0], pc.ResyncApply):
                            later = (seq, more)
                            break
                        commands.extend(more)
                        last_seq = seq
                for seq, batch in [(last_seq, commands), *([later] if later else [])]:
                    await self.submit_and_wait(*batch)
                    if isinstance(batch[0], pc.ResyncApply):
                        self._check_resync_applied(batch[0])
                    else:
                        self.ingested += len(batch)
                    receiver.ack(seq)
                if reading is not None:
                    reading.cancel()

        collector: rs.ResyncCollector | None = None
        accepted = False  # this connection's HELLO was accepted
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(applier)
                while True:
                    now = trio.current_time()
                    out = receiver.data_to_send(now)
                    if out:
                        await stream.send_all(out)
                    self._receiver_stats[id(receiver)] = receiver.statistics()
                    deadline = receiver.tick(now)
                    data = None
                    # Until bytes come, an ack is made or the link's next deadline.
                    # (A cancelled receive_some consumed nothing.)
                    with trio.move_on_at(deadline if deadline is not None else now + 1.0) as scope:
                        reading = scope
                        data = bytes(await stream.receive_some(READ_BYTES))
                    reading = None
                    if data == b"":
                        raise trio.BrokenResourceError("the egress closed the link")
                    if data:
                        receiver.receive_data(data)
                    if accepted and receiver.hello is not None:
                        # Promoted (or an incarnation switch) while the link is up:
                        # close it with the same error a new HELLO would get.
                        fenced = self._fence_reason(receiver.hello)
                        if fenced is not None:
                            code, text = fenced
                            await stream.send_all(receiver.send_error(code, text, retriable=False))
                            raise LinkError(text, code=code, retriable=False)
                    while True:
                        ev = receiver.next_event()
                        if ev is link.NEED_DATA:
                            break
                        if isinstance(ev, link.Hello):
                            answer, accepted = self._answer_hello(receiver, ev)
                            self._links_up += accepted
                            await stream.send_all(answer)
                        elif isinstance(ev, link.ResyncBegin):
                            hello = receiver.hello
                            assert hello is not None
                            collector = rs.ResyncCollector(
                                hello.origin_cluster,
                                hello.incarnation,
                                ev.epoch,
                                ev.cut_seq,
                                ev.total_bytes,
                            )
                            self.resyncs += 1
                            self.resync_active = True
                            self.resync_chunks = ev.total_chunks
                            self.resync_chunks_done = 0
                            log.info(
                                "ingress: resync from %s cut at %d: %d chunks, %d bytes",
                                hello.origin_cluster,
                                ev.cut_seq,
                                ev.total_chunks,
                                ev.total_bytes,
                            )
                        elif isinstance(ev, link.ResyncChunk):
                            assert collector is not None
                            collector.add(ev.data)
                            self.resync_bytes += len(ev.data)
                            self.resync_chunks_done += 1
                            receiver.ack_chunk()  # buffered; nothing applied before END
                        elif isinstance(ev, link.ResyncEnd):
                            assert collector is not None
                            command = collector.command()
                            collector = None
                            await to_apply_send.send((ev.cut_seq, [command]))
                        elif isinstance(ev, link.EventsReceived):
                            commands: list[pc.Command] = []
                            for event in ev.events:
                                try:
                                    commands.extend(pc.decode_frame_untrusted(event.payload))
                                except RemoteProtocolError as exc:
                                    raise DrgateError(f"bad event {event.seq}: {exc}") from exc
                            if commands:
                                await to_apply_send.send((ev.events[-1].seq, commands))
                        elif isinstance(ev, link.PeerError):
                            raise DrgateError(f"the egress sent an error: {ev.text}")
                        elif isinstance(ev, link.Stalled):
                            raise DrgateError(f"the egress was silent for {ev.silent_for:.1f} s")
                        elif isinstance(ev, link.ConnectionClosed):
                            raise trio.BrokenResourceError("the egress closed the link")
        finally:
            if accepted:
                self._links_up -= 1
            ended = self._receiver_stats.pop(id(receiver), None)
            if ended is not None:
                self._ended_links.update(
                    bytes_received_wire_total=ended.bytes_received,
                    batches_received_total=ended.batches,
                )

    def _check_resync_applied(self, cmd: pc.ResyncApply) -> None:
        """After D's bus applied a ResyncApply: did it take (else do not ack)?"""
        self.resync_active = False
        done = applied(self.state, cmd.origin_cluster, cmd.incarnation)
        if done < cmd.cut:
            origin = self.state.origins.get(cmd.origin_cluster)
            raise DrgateError(
                f"the resync from {cmd.origin_cluster} cut at {cmd.cut} was not applied by "
                f"{self.config.site} (applied {done}; epoch "
                f"{None if origin is None else origin.epoch}, incarnation "
                f"{None if origin is None else origin.incarnation})"
            )
        log.info("ingress: resync from %s cut at %d applied", cmd.origin_cluster, cmd.cut)

    def _answer_hello(self, receiver: link.LinkReceiver, hello: link.Hello) -> tuple[bytes, bool]:
        """The answer to a HELLO, and whether it accepts the link."""
        role = self.current_role()
        if role != "ingress":
            active = self.active_sidecar()
            return receiver.refuse(
                int(link.LinkErrorCode.NOT_ACTIVE),
                f"{self.config.site} node {self.config.node} is {role}; the active ingress is "
                + (
                    "not known yet"
                    if active is None
                    else f"node {active.node} (bus member {active})"
                ),
                retriable=True,
            ), False
        if (
            hello.target_cluster != self.config.site
            or hello.origin_cluster != self.config.peer_cluster
        ):
            return receiver.refuse(
                int(link.LinkErrorCode.WRONG_CLUSTER),
                f"this is {self.config.site}, expecting a stream from {self.config.peer_cluster}; "
                f"got {hello.origin_cluster} -> {hello.target_cluster}",
                retriable=False,
            ), False
        refusal = self._fence(receiver, hello)
        if refusal is not None:
            return refusal, False
        resume = applied(self.state, hello.origin_cluster, hello.incarnation)
        self.link_state = "up"
        self.peer = hello.origin_cluster
        log.info("ingress: link up from %s, resuming after %d", hello.origin_cluster, resume)
        return receiver.accept(resume, hello.window_bytes, trio.current_time()), True

    def _fence(self, receiver: link.LinkReceiver, hello: link.Hello) -> bytes | None:
        """Refuse a HELLO from a primary this site was promoted over (R7) or
        from an incarnation it has not accepted; None to go on."""
        fenced = self._fence_reason(hello)
        if fenced is None:
            return None
        code, text = fenced
        self.last_error = f"ingress: refused {hello.origin_cluster}: {text}"
        return receiver.refuse(code, text, retriable=False)

    def _fence_reason(self, hello: link.Hello) -> tuple[int, str] | None:
        origin = self.state.origins.get(hello.origin_cluster)
        if origin is None:
            return None
        if hello.epoch < origin.epoch or (origin.promoted and hello.epoch == origin.epoch):
            when = time.strftime(
                "%Y-%m-%d %H:%M:%S UTC", time.gmtime(origin.promoted_time_us / 1e6)
            )
            text = (
                f"{self.config.site} was promoted at {when} (epoch {origin.epoch}); it no longer "
                f"accepts {hello.origin_cluster}'s stream of epoch {hello.epoch}. This primary "
                f"is stale: stop it, or make it the DR site of {self.config.site} "
                "(docs/operations.md, 'When the primary comes back')"
            )
            return int(link.LinkErrorCode.STALE_EPOCH), text
        if origin.incarnation not in (0, hello.incarnation):
            text = (
                f"{hello.origin_cluster} is incarnation {hello.incarnation}, but "
                f"{self.config.site} replicates its incarnation {origin.incarnation} "
                f"(applied up to cseq {origin.applied.get(origin.incarnation, 0)}). "
                f"{hello.origin_cluster} restarted from nothing; {self.config.site}'s replicas "
                "are kept as they are. To replace them by the new incarnation's state, run at "
                f"{self.config.site}: drgate resync --accept-incarnation {hello.incarnation} "
                f"--origin {hello.origin_cluster} --config <sidecar.yaml>"
            )
            return rs.NEW_INCARNATION_CODE, text
        return None

    # ------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        spool = self.spool.statistics() if self.spool is not None else None
        stats: dict[str, Any] = {
            "site": self.config.site,
            "node": self.config.node,
            "process": "sidecar",
            "role": self.current_role(),
            "cseq": self.state.cseq,
            "bus": {
                "view_size": 0 if self.membership is None else len(self.membership.members),
                "quorate": True if self.membership is None else self.membership.quorate,
            },
            "rules": {
                "version": self.tap.rules.rules_version,
                "failed_reloads_total": self.tap.rules_failures + self.rules_watch.failures,
                "file_problem": self.rules_watch.problem,
                "digest": self.tap.rules.digest,
            },
            "merge": dict(self.state.counters),
            "last_error": (
                self.minority_text_now()
                if self.current_role() == "minority"
                else self.last_error or self.tap.last_error or self.rules_watch.problem
            ),
        }
        link_stats: dict[str, Any] = {
            "state": self.link_state,
            "peer": self.peer,
            "reconnects_total": self.reconnects,
            "rtt_seconds": self.rtt,
        }
        if self.config.primary:
            stats["tap"] = self.tap.statistics()
            s = self._sender_stats
            last = spool.last_seq if spool is not None and spool.last_seq is not None else 0
            lag_events, lag_seconds = self.lag()
            link_stats.update(
                {
                    "acked_seq": self.acked_seq,
                    "last_seq": last,
                    "lag_events": lag_events,
                    "lag_seconds": lag_seconds,
                }
            )
            ended = self._ended_links
            link_stats.update(
                {
                    "bytes_sent_total": ended["bytes_sent_total"] + (s.bytes_raw if s else 0),
                    "bytes_sent_wire_total": ended["bytes_sent_wire_total"]
                    + (s.bytes_sent if s else 0),
                    "batches_sent_total": ended["batches_sent_total"] + (s.batches if s else 0),
                    "events_sent_total": ended["events_sent_total"] + (s.events if s else 0),
                }
            )
        else:
            open_links = list(self._receiver_stats.values())
            ended = self._ended_links
            link_stats["events_received_total"] = self.ingested
            link_stats["bytes_received_wire_total"] = ended["bytes_received_wire_total"] + sum(
                r.bytes_received for r in open_links
            )
            link_stats["batches_received_total"] = ended["batches_received_total"] + sum(
                r.batches for r in open_links
            )
            if open_links:
                link_stats["acked_seq"] = max(r.acked_seq for r in open_links)
        stats["link"] = link_stats
        stats["resync"] = {
            "active": self.resync_active,
            "total": self.resyncs,
            "progress_ratio": (
                self.resync_chunks_done / self.resync_chunks if self.resync_chunks else 0.0
            ),
            "bytes_total": self.resync_bytes,
            "messages": self.resync_messages,
        }
        if not self.config.primary:
            # Passed through by /status (the resync section is copied whole):
            # what the Pacemaker agent's monitor reads.
            peer = self.state.origins.get(self.config.peer_cluster)
            stats["resync"]["promoted"] = bool(peer is not None and peer.promoted)
            stats["resync"]["epoch"] = 0 if peer is None else peer.epoch
            stats["origins"] = {
                name: rs.origin_summary(o) for name, o in self.state.origins.items()
            }
        if spool is not None:
            stats["spool"] = {
                "bytes": spool.bytes,
                "max_bytes": spool.max_bytes,
                "segments": spool.segments,
                "overflow_total": spool.overflow_count,
                "needs_resync": spool.needs_resync,
                "first_seq": spool.first_seq,
                "last_seq": spool.last_seq,
            }
        return stats
