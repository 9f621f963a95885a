"""A member of a site's bus holding the whole site state: the core brokers,
sidecars and the admin tools share.

Theory of operation
-------------------
Everything that changes the site state is a command multicast on the bus;
nothing changes the local state directly.  Two tasks make a member:

* the *multicaster* takes commands from one bounded channel, batches them
  into frames (:data:`FRAME_MAX_COMMANDS`, :data:`FRAME_MAX_BYTES`) and awaits
  the bus's backpressure.  :meth:`SiteMember.submit` waits for room in the
  channel, so a slow bus stops whoever submits.  Frames encoded elsewhere
  (D's ingress relays the events P encoded) go through the same channel as
  they are, joined but never decoded
  (:meth:`SiteMember.submit_frames_and_wait`): every member decodes what it
  applies anyway;
* the *applier* reads the bus stream in agreed order and applies each command
  to the state (:func:`cluster.state.apply`), then tells the
  :class:`MemberObserver` (the broker, the sidecar) what was applied, in
  stream order.

The applier never waits on the multicaster: the multicaster may be waiting
for the bus, which waits for the applier to read.  So what the applier (an
observer's hook) sends goes through :meth:`SiteMember.post`, which puts it in
the channel or, when the channel is full, in a spill queue the multicaster
empties first.  What bounds the spill: the member's own ``Genesis`` and
``MemberReady`` (one each per join), and what the observers post, each bounded
by its observer (a broker's ``Acquire`` and ``Release`` by the credit its
consumers gave, a sidecar's ``AckWatermark`` by one a second).  A snapshot
donation, the one thing whose size is the state's, is not posted: a task per
joiner sends its chunks and waits for room in the channel like any submitter.

Joining (:mod:`cluster.membership`): a joiner multicasts ``JoinHave`` (what
its journal holds) and buffers its stream until a donor's snapshot arrives in
``StateChunk`` commands, restores it and applies what it buffered after the
cut.  The donor leaves out the persistent bodies the joiner's journal holds
(:func:`cluster.state.delta_snapshot`); the joiner fills them from its
recovered state, or, when one does not match, asks again with an empty
``JoinHave`` and takes a full snapshot.  Ready (:attr:`SiteMember.ready`) once it holds
the site state.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from cluster import state as st
from cluster.bus import BusConfig, BusMember, Delivery, MemberId, ViewChange, open_bus
from cluster.membership import (
    Action,
    AnnounceHave,
    Membership,
    Rejoin,
    SendSnapshot,
    SnapshotAssembly,
    StartGenesis,
)
from cluster.state.effects import Effect
from cluster.state.persistence import TransientDropped, take_recovery
from protocol import cluster as pc
from protocol.errors import BusError, DrgateError
from protocol.modes import Role

log = logging.getLogger(__name__)

# Commands per bus frame, and bytes: batching amortises the bus's per-message
# cost (corosync handles ~30k messages/s) without making frames so large that
# they hold up the stream.
FRAME_MAX_COMMANDS = 200
FRAME_MAX_BYTES = 256 * 1024
# Commands waiting for the multicaster: the bound that turns a slow bus into
# backpressure on clients.
COMMAND_QUEUE = 1000
# Snapshot bytes per StateChunk command.
CHUNK_BYTES = 512 * 1024
# The largest JoinHave's ranges: a journal with more queues than fit (about
# 2,000 of 20-byte names) announces nothing and takes a full transfer, so a
# JoinHave stays a small command in one frame.
JOIN_HAVE_MAX_BYTES = 64 * 1024

# Snapshot envelope: member-level header around the state snapshot.
#   cut u64 | ready count u32 | ready (node u32, pid u32)...
_ENVELOPE = struct.Struct(">QI")
_MEMBER = struct.Struct(">II")


# The operator's way out when a broker of a recovering site is gone for good
# (docs/broker.md, "Durability"): in every message that says the site waits.
FORCE_HINT = (
    "drgate recover --force --config <a broker's or sidecar's config> continues from "
    "those that reported"
)


def recovery_progress(state: st.SiteState) -> str:
    """Who reported what to a site waiting for its brokers' journals, for
    people: ``2 of 3 brokers reported (node 1 cseq 900, node 3 cseq 400)``."""
    reports = ", ".join(
        f"node {node} cseq {report[1]}" for node, report in sorted(state.candidates.items())
    )
    return f"{len(state.candidates)} of {state.recovery_expect} brokers reported" + (
        f" ({reports})" if reports else ""
    )


class MemberObserver(Protocol):
    """What a :class:`SiteMember` tells its owner, from the applier, in stream
    order.  No hook may wait: to multicast, use :meth:`SiteMember.post`."""

    def after_command(
        self, cmd: pc.Command, effects: Sequence[Effect], sender: MemberId, own: bool
    ) -> None:
        """``cmd`` from ``sender`` was applied (its cseq is the state's cseq);
        ``own`` when this member multicast it."""

    def after_frame(self) -> None:
        """Every command of a delivered frame was applied."""

    def after_view(self, view: ViewChange, effects: Sequence[Effect]) -> None:
        """A view change was applied (members that left released their work)."""

    def view_seen(self, view: ViewChange) -> None:
        """A view change was delivered (also while joining, before it is applied)."""

    def on_rejoin(self) -> None:
        """The state is stale and will be replaced by a snapshot (see Rejoin)."""

    def after_restore(self) -> None:
        """A snapshot replaced the state (first join, or a rejoin)."""


class NullObserver:
    """A :class:`MemberObserver` that ignores everything: a member that only
    reads the state and submits (an admin tool) uses it as it is; an owner
    needing a few hooks subclasses it and overrides those."""

    def after_command(
        self, cmd: pc.Command, effects: Sequence[Effect], sender: MemberId, own: bool
    ) -> None:
        pass

    def after_frame(self) -> None:
        pass

    def after_view(self, view: ViewChange, effects: Sequence[Effect]) -> None:
        pass

    def view_seen(self, view: ViewChange) -> None:
        pass

    def on_rejoin(self) -> None:
        pass

    def after_restore(self) -> None:
        pass


class _Applied:
    """Set once the own frame that carries it has come back on the bus and
    been applied here, with the state's cseq then (that frame's last
    command's)."""

    __slots__ = ("_event", "cseq")

    def __init__(self) -> None:
        self._event = trio.Event()
        self.cseq = 0

    def set(self, cseq: int) -> None:
        self.cseq = cseq
        self._event.set()

    async def wait(self) -> int:
        await self._event.wait()
        return self.cseq


@dataclass(frozen=True, slots=True)
class _Encoded:
    """A bus frame encoded elsewhere, multicast as it is, alone; ``done``, if
    any, is set once it has come back on the bus and been applied here."""

    frame: bytes
    done: _Applied | None


@dataclass(slots=True)
class TransferTotals:
    """State transfers this member sent and took since it started."""

    donations: int = 0  # snapshots sent to joiners
    bytes_sent: int = 0  # their bytes
    bytes_saved: int = 0  # bytes left to the joiners' journals
    bodies_left: int = 0  # message bodies left to the joiners' journals
    restores: int = 0  # snapshots taken
    bytes_received: int = 0
    fallbacks: int = 0  # deltas this member's journal could not fill


@dataclass(frozen=True, slots=True)
class _Barrier:
    """Marks a point in the command channel; ``event`` is set once every
    command before it has come back on the bus and been applied here."""

    event: _Applied


class BusOpener(Protocol):
    """What joins a bus: :func:`cluster.bus.open_bus`, or a test's in-memory bus."""

    def __call__(
        self, config: BusConfig, *, role: Role
    ) -> contextlib.AbstractAsyncContextManager[BusMember]: ...


class SiteMember:
    """A member of ``cluster``'s bus holding the whole site state.

    ``await nursery.start(member.serve)`` joins the bus and returns once the
    state is here.  ``state`` is replaced by a snapshot on a (re)join: read
    it through the member, never keep it.
    """

    def __init__(
        self,
        cluster: str,
        bus: BusConfig,
        *,
        role: Role,
        observer: MemberObserver,
        open_member: BusOpener = open_bus,
    ) -> None:
        self.cluster = cluster
        self._open_member = open_member
        self.bus_config = bus
        self.role = role
        self.state = st.new_state()
        self.me: MemberId | None = None
        self.membership: Membership | None = None
        self.ready = trio.Event()
        self._observer = observer
        self._send, self._receive = trio.open_memory_channel[pc.Command | _Barrier | _Encoded](
            COMMAND_QUEUE
        )
        # What post() could not put in the channel (bounds: module docstring).
        self._spill: collections.deque[pc.Command] = collections.deque()
        self._buffer: list[Delivery | ViewChange] | None = []
        self._assembly: SnapshotAssembly | None = None
        self._transfers_sent = itertools.count(1)
        self._frames_sent = 0  # own frames multicast
        self._frames_applied = 0  # own frames come back and applied
        self._barrier_events: dict[int, list[_Applied]] = {}
        self._pending_restore: bytes | None = None
        self._last_have: pc.JoinHave | None = None  # said again at each view while waiting
        self._restore_at_genesis = False  # an in-memory site started over (_start_over)
        self._nursery: trio.Nursery | None = None
        # The frame whose commands the observer's hooks are told of, as the
        # bus delivered it (a journal keeps these bytes: cluster/durability.py).
        self.delivered_frame = b""
        # Whole-site recovery (bus.expect_brokers > 0): the state this member's
        # journal recovered (its owner sets it before serve), whether it is
        # being sent to the site, and the chunks of the chosen one.
        self.recovered: st.SiteState | None = None
        self._recovery_sent = False
        self._recovery_chunks: list[bytes] = []
        # What the whole-site recovery dropped as transient (None: no recovery).
        self.recovery_dropped: TransientDropped | None = None
        self.site_live = trio.Event()  # the state has an incarnation (not recovering)
        # The recovered state a delta transfer's elided bodies come from (set
        # when this member announces what it has; None after a fallback).
        self._have_from: st.SiteState | None = None
        self.transfers = TransferTotals()

    # ------------------------------------------------------------------
    # Service
    # ------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join the bus and follow the stream; started once this member holds
        the site state.  Raises ``BusError`` when the bus is lost."""
        async with self._open_member(self.bus_config, role=self.role) as member:
            self.me = member.me
            self.membership = Membership(member.me)
            self._assembly = SnapshotAssembly(member.me)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._multicaster, member)
                nursery.start_soon(self._applier, member)
                await self.ready.wait()
                task_status.started()

    async def submit(self, *commands: pc.Command) -> None:
        """Queue commands for multicast; waits while the bus is backpressured.
        With room in the channel it does not yield: the commands a caller
        submits in one pass (the publishes of one socket read) are all queued
        before the multicaster runs, so they leave in one frame."""
        for cmd in commands:
            await self._queue(cmd)

    async def _queue(self, item: pc.Command | _Barrier | _Encoded) -> None:
        try:
            self._send.send_nowait(item)
        except trio.WouldBlock:
            await self._send.send(item)

    async def submit_and_wait(self, *commands: pc.Command) -> int:
        """Multicast ``commands`` and wait until they have come back on the
        bus and been applied here (so every member has applied them); returns
        the cseq by which they all were (the last command of their frame)."""
        barrier = _Barrier(_Applied())
        for cmd in commands:
            await self._queue(cmd)
        await self._queue(barrier)
        return await barrier.event.wait()

    async def submit_frames_and_wait(self, frames: Sequence[bytes]) -> int:
        """Multicast the commands of ``frames`` (encoded bus frames, e.g.
        admitted link events), in order, without decoding them, and wait until
        they have come back on the bus and been applied here.  They are joined
        into bus frames of at most :data:`FRAME_MAX_COMMANDS` commands and
        :data:`FRAME_MAX_BYTES` bytes; each member decodes them when it
        applies them, and skips a frame that does not decode, as any other.
        The frames must be well formed as far as the scan goes
        (:func:`protocol.cluster.scan_frame_untrusted`).  Returns the cseq of
        the last command applied (D's ingress acks once that is durable)."""
        joined = pc.join_frames(frames, max_commands=FRAME_MAX_COMMANDS, max_bytes=FRAME_MAX_BYTES)
        if not joined:
            return self.state.cseq
        done = _Applied()
        for i, frame in enumerate(joined):
            await self._queue(_Encoded(frame, done if i == len(joined) - 1 else None))
        return await done.wait()

    def post(self, cmd: pc.Command) -> None:
        """Queue a command for multicast without ever waiting (for the
        applier's hooks, and anyone who must not wait): into the channel when
        it has room and nothing is spilled, else into the spill, which the
        multicaster empties before the channel, so a spilled command may
        overtake commands waiting in the channel.  What bounds the spill:
        the module docstring."""
        if self._spill:
            self._spill.append(cmd)
            return
        try:
            self._send.send_nowait(cmd)
        except trio.WouldBlock:
            self._spill.append(cmd)

    def _next_nowait(self) -> pc.Command | _Barrier | _Encoded:
        """The next command to multicast: the spill first; WouldBlock if none."""
        if self._spill:
            return self._spill.popleft()
        return self._receive.receive_nowait()

    async def _multicaster(self, member: BusMember) -> None:
        carried: pc.Command | _Barrier | _Encoded | None = None  # taken, not yet sent
        while True:
            if carried is not None:
                item, carried = carried, None
            else:
                try:
                    item = self._next_nowait()
                except trio.WouldBlock:
                    item = await self._receive.receive()
            if isinstance(item, _Encoded):
                await self._multicast(member, item.frame, [] if item.done is None else [item.done])
                continue
            batch: list[pc.Command] = []
            barriers: list[_Applied] = []
            size = 0
            while True:
                if isinstance(item, _Barrier):
                    barriers.append(item.event)
                    break
                batch.append(item)
                size += len(getattr(item, "body", b""))
                if len(batch) >= FRAME_MAX_COMMANDS or size >= FRAME_MAX_BYTES:
                    break
                try:
                    item = self._next_nowait()
                except trio.WouldBlock:
                    break
                if isinstance(item, _Encoded):
                    carried = item  # the batch before it goes first
                    break
            await self._multicast(member, pc.encode_frame(batch), barriers)

    async def _multicast(self, member: BusMember, frame: bytes, barriers: list[_Applied]) -> None:
        self._frames_sent += 1
        if barriers:
            self._barrier_events[self._frames_sent] = barriers
        await member.multicast(frame)

    # ------------------------------------------------------------------
    # The stream
    # ------------------------------------------------------------------

    async def _applier(self, member: BusMember) -> None:
        assert self.membership is not None
        async for event in member.events():
            if isinstance(event, ViewChange):
                self._on_view(event)
            else:
                self.membership.on_delivery()
                if self._buffer is not None:
                    self._buffer.append(event)
                    self._maybe_take_snapshot(event)
                    if self._pending_restore is not None:
                        blob, self._pending_restore = self._pending_restore, None
                        self._finish_restore(blob)
                else:
                    self._on_delivery(event)
        raise BusError("the site bus ended the stream")

    def _on_view(self, view: ViewChange) -> None:
        assert self.membership is not None and self._assembly is not None
        actions = self.membership.on_view(view)
        self._observer.view_seen(view)
        if self._buffer is not None:
            self._buffer.append(view)
        else:
            self._apply_view(view)
        for action in actions:
            if isinstance(action, Rejoin):
                log.warning(
                    "this member was in a minority partition while the site went on: "
                    "dropping its state and joining again by state transfer"
                )
                self._buffer = [view]
                self._assembly.reset()
                self._have_from = None
                self._observer.on_rejoin()
                self._post_join_have({})
            else:
                self._act(action)
        if view.left:
            log.info("members left: %s", ", ".join(map(str, view.left)))

    def _act(self, action: Action) -> None:
        """Do what the membership said (all but ``Rejoin``, which needs its view)."""
        if isinstance(action, StartGenesis):
            if action.start_over:
                self._start_over()
            self._start_genesis(action)
        elif isinstance(action, SendSnapshot):
            self._send_snapshot(action)
        elif isinstance(action, AnnounceHave) and action.again:
            assert self._last_have is not None
            self.post(self._last_have)
        elif isinstance(action, AnnounceHave):
            self._announce_have()

    def _start_over(self) -> None:
        """Nobody in the view holds the site state (cluster/membership.py,
        "Start over", or a rejoiner's elders all left): the site starts as
        after a whole-site restart.  The
        state this member held, stale or not, is set aside: a broker offers it
        to the site's recovery when it is ahead of its journal."""
        self.offer_held(self.state)
        log.warning(
            "nobody in this member's view holds site %s's state (a partition left no side "
            "with quorum, or the members that held it left before a transfer): the site "
            "starts again as after a whole-site restart (%s)",
            self.cluster,
            "its brokers' journals and states are the candidates"
            if self.bus_config.expect_brokers > 0
            else "in memory only: its state is lost and it starts as a new incarnation",
        )
        self.state = st.new_state()
        # In memory only, the lowest member's Genesis starts the new state; a
        # sidecar reopens its spool then, as after a restore.
        self._restore_at_genesis = self.bus_config.expect_brokers == 0
        self._recovery_sent = False
        self._pending_restore = None
        self._have_from = None
        assert self._assembly is not None
        self._assembly.reset()
        if self._buffer is None:  # held the state until now: nothing buffered to replay
            self._buffer = []
        self._observer.on_rejoin()

    def offer_held(self, held: st.SiteState) -> None:
        """A broker's candidate for its site's recovery is the state it held,
        when that is ahead of what its journal recovered at its start (the
        journal grew since: what it held is the freshest it has)."""
        got = self.recovered
        ahead = got is None or got.incarnation != held.incarnation or held.cseq >= got.cseq
        if self.role == Role.BROKER and held.incarnation != 0 and ahead:
            self.recovered = held

    def _apply_view(self, view: ViewChange) -> None:
        effects = st.members_left(self.state, view.left) if view.left else []
        self._observer.after_view(view, effects)

    def _start_genesis(self, action: StartGenesis) -> None:
        # The whole site starts here with the empty state: apply what we
        # buffered since our join (every member of the cohort has the same).
        buffered = self._buffer or []
        self._buffer = None
        for event in buffered:
            if isinstance(event, ViewChange):
                self._apply_view(event)
            else:
                self._on_delivery(event, live=False)
        if self.bus_config.expect_brokers > 0:
            self._report_recovered()
        elif action.announce:
            self.post(pc.Genesis(self.cluster, random.getrandbits(64)))
        self._announce_ready()

    @property
    def recovering(self) -> bool:
        """The site started with no member alive and waits for its brokers'
        journals (nothing may be served from this empty state)."""
        return self.bus_config.expect_brokers > 0 and self.state.incarnation == 0

    def _report_recovered(self) -> None:
        """A broker tells the site what its journal recovered (docs/broker.md,
        "Durability"); other members only wait."""
        if self.role != Role.BROKER or self.me is None:
            return
        got = self.recovered
        cseq, incarnation = (0, 0) if got is None else (got.cseq, got.incarnation)
        log.info(
            "site %s starts with no member alive: this broker recovered cseq %d; waiting for "
            "%d brokers' reports (a broker gone for good: %s)",
            self.cluster,
            cseq,
            self.bus_config.expect_brokers,
            FORCE_HINT,
        )
        self.post(
            pc.Recovering(
                self.cluster,
                self.me.node,
                self.me.pid,
                self.bus_config.expect_brokers,
                cseq,
                incarnation,
                random.getrandbits(63) | 1,
            )
        )

    def _after_recovering(self) -> None:
        """After a report (or the operator's ``ForceRecovery``): say how far
        the wait is; the chosen broker sends its recovered state to the site."""
        winner = self.state.recovery_winner
        if winner is None and self.state.incarnation == 0:
            log.info("recovery: %s; waiting (%s)", recovery_progress(self.state), FORCE_HINT)
        if winner is None or self.me is None or self._recovery_sent:
            return
        if winner != (self.me.node, self.me.pid) or self.recovered is None:
            return
        self._recovery_sent = True
        if st.recovery_loses_history(self.state):
            # Another broker may have had more on disk, and D may hold it: the
            # site goes on as a new incarnation (this broker's proposal).
            self.recovered.incarnation = self.state.candidates[winner[0]][3]
            log.warning(
                "recovery: chosen without every broker's journal (forced, or an empty one): "
                "site %s continues as a new incarnation %#x; its DR site resyncs once its "
                "operator accepts it",
                self.cluster,
                self.recovered.incarnation,
            )
        blob = st.snapshot(self.recovered)
        log.info(
            "recovery: this broker's journal (cseq %d) is the most advanced: sending it to the "
            "site (%d bytes)",
            self.recovered.cseq,
            len(blob),
        )
        assert self._nursery is not None
        self._nursery.start_soon(self._send_recovered, blob)

    async def _send_recovered(self, blob: bytes) -> None:
        last = max(0, len(blob) - 1) // CHUNK_BYTES
        for index in range(last + 1):
            piece = blob[index * CHUNK_BYTES : (index + 1) * CHUNK_BYTES]
            await self._send.send(pc.RecoveryChunk(index, index == last, piece))

    def _take_recovery_chunk(self, cmd: pc.RecoveryChunk, sender: MemberId) -> None:
        """Every member takes the chosen broker's state at the final chunk."""
        winner = self.state.recovery_winner
        if winner is None or (sender.node, sender.pid) != winner:
            return
        if cmd.index == 0:
            self._recovery_chunks = []
        self._recovery_chunks.append(bytes(cmd.data))
        if not cmd.final:
            return
        blob, self._recovery_chunks = b"".join(self._recovery_chunks), []
        live_ready = self.state.ready  # the members of this bus, ready before the chunk
        self.state = st.restore_untrusted(blob)
        self.recovered = None
        # What a restart of the whole site does not keep goes here, at this
        # point of the stream, on every member alike; the state records it.
        self.recovery_dropped = take_recovery(self.state)
        self.state.ready.update(live_ready)
        log.info(
            "recovery: site %s continues from node %d's journal at cseq %d (incarnation %#x); "
            "transient state dropped: %d messages, queues %s, exchanges %s; %d messages that "
            "consumers held before the restart are back in their queues",
            self.cluster,
            winner[0],
            self.state.cseq,
            self.state.incarnation,
            sum(self.recovery_dropped.messages.values()),
            list(self.recovery_dropped.queues),
            list(self.recovery_dropped.exchanges),
            sum(self.recovery_dropped.released.values()),
        )
        self._observer.after_restore()

    def _announce_ready(self) -> None:
        assert self.me is not None
        self.post(pc.MemberReady(self.role, self.me.node, self.me.pid))
        self.ready.set()

    def _announce_have(self) -> None:
        """Joined a live site: say what this broker's journal holds, so the
        donor leaves out the bodies it can fill."""
        have_from = self.recovered if self.role == Role.BROKER else None
        ranges = {} if have_from is None else st.held_ranges(have_from)
        self._have_from = have_from if ranges else None
        self._post_join_have(ranges)

    def _post_join_have(self, ranges: dict[str, tuple[int, int]]) -> None:
        assert self.me is not None
        packed = pc.pack_have_ranges(ranges) if ranges else b""
        if len(packed) > JOIN_HAVE_MAX_BYTES:
            log.warning(
                "the journal holds %d queues, more than a JoinHave announces (%d bytes of "
                "ranges, at most %d): taking a full state transfer",
                len(ranges),
                len(packed),
                JOIN_HAVE_MAX_BYTES,
            )
            packed, self._have_from = b"", None
        got = self._have_from
        self._last_have = pc.JoinHave(
            self.me.node,
            self.me.pid,
            0 if got is None else got.incarnation,
            0 if got is None else got.cseq,
            packed,
        )
        self.post(self._last_have)

    def _delta_for(self, action: SendSnapshot) -> st.DeltaSnapshot:
        """The snapshot for ``action``'s joiner: a delta when its journal is of
        this incarnation (:func:`cluster.state.delta_snapshot`)."""
        have = action.have
        ranges: dict[str, tuple[int, int]] = {}
        if have is not None and have.incarnation == self.state.incarnation != 0:
            try:
                ranges = pc.have_ranges_untrusted(have.ranges)
            except DrgateError as exc:
                log.warning("JoinHave of %s refused, sending everything: %s", action.target, exc)
        return st.delta_snapshot(self.state, ranges)

    def _send_snapshot(self, action: SendSnapshot) -> None:
        """Cut a snapshot here, in the stream; a task sends it (not posted:
        its size is the state's)."""
        assert self.membership is not None and self._nursery is not None
        ready = sorted(self.membership.ready)
        header = _ENVELOPE.pack(action.cut, len(ready)) + b"".join(
            _MEMBER.pack(m.node, m.pid) for m in ready
        )
        delta = self._delta_for(action)
        blob = header + delta.data
        chunks = max(1, -(-len(blob) // CHUNK_BYTES))
        log.info(
            "state transfer to %s: delta of %d bytes, %d bodies left to its journal (a full "
            "transfer would have been %d bytes); %d chunks, cut at %d events",
            action.target,
            len(blob),
            delta.bodies_elided,
            len(header) + delta.full_bytes,
            chunks,
            action.cut,
        )
        totals = self.transfers
        totals.donations += 1
        totals.bytes_sent += len(blob)
        totals.bytes_saved += delta.full_bytes - len(delta.data)
        totals.bodies_left += delta.bodies_elided
        self._nursery.start_soon(self._donate, action.target, next(self._transfers_sent), blob)

    async def _donate(self, target: MemberId, transfer: int, blob: bytes) -> None:
        """Send one snapshot in StateChunk commands, waiting for room in the
        channel: one chunk's copy at a time besides the snapshot itself."""
        last = max(0, len(blob) - 1) // CHUNK_BYTES
        for index in range(last + 1):
            piece = blob[index * CHUNK_BYTES : (index + 1) * CHUNK_BYTES]
            await self._send.send(
                pc.StateChunk(target.node, target.pid, transfer, index, index == last, piece)
            )

    def _maybe_take_snapshot(self, event: Delivery) -> None:
        """While buffering: collect the StateChunks addressed to me, and note
        the JoinHave of other joiners (I may donate to them once ready)."""
        assert self._assembly is not None and self.membership is not None
        try:
            refs = pc.scan_frame_untrusted(event.payload)
        except DrgateError:
            return
        haves: list[pc.JoinHave] = []
        for ref in refs:
            if ref[0] == pc.Kind.MEMBER_READY:
                self.membership.on_member_ready(event.sender)
            elif ref[0] == pc.Kind.JOIN_HAVE:
                with contextlib.suppress(DrgateError):
                    have = pc.decode_ref_untrusted(event.payload, ref)
                    assert isinstance(have, pc.JoinHave)
                    haves.append(have)
            elif ref[0] == pc.Kind.STATE_CHUNK:
                chunk = pc.decode_ref_untrusted(event.payload, ref)
                assert isinstance(chunk, pc.StateChunk)
                blob = self._assembly.on_chunk(event.sender, chunk)
                if blob is not None:
                    self._pending_restore = blob
        for have in haves:  # after the whole frame, as a member that applies it
            # Not ready: nothing to donate yet, but nobody may be.
            for action in self.membership.on_join_have(event.sender, have):
                self._act(action)
            if self._buffer is None:  # the site started over here
                return

    def _finish_restore(self, blob: bytes) -> None:
        assert self.membership is not None and self._buffer is not None
        cut, count = _ENVELOPE.unpack_from(blob)
        offset = _ENVELOPE.size
        ready = set()
        for _ in range(count):
            node, pid = _MEMBER.unpack_from(blob, offset)
            offset += _MEMBER.size
            ready.add(MemberId(node, pid))
        held = self.state  # a rejoiner's stale state, until the snapshot replaces it
        try:
            self.state = st.restore_untrusted(blob[offset:], bodies=self._have_from)
        except st.ElidedBodyMismatch as exc:
            # Keep buffering from the join view: the donor counts the next cut
            # from there too.
            log.warning("%s", exc)
            self.transfers.fallbacks += 1
            self._have_from = None
            self._post_join_have({})
            return
        self._have_from = None
        self.transfers.restores += 1
        self.transfers.bytes_received += len(blob)
        # _buffer[0] is the view that (re)joined me; the snapshot covers the
        # ``cut`` events after it.
        buffered = self._buffer[1 + cut :]
        # My own frames the snapshot covers (my JoinHave) count as applied.
        self._skip_own(self._buffer[1 : 1 + cut])
        self._buffer = None
        self.membership.on_restored(ready, self.membership.members)
        if self.state.incarnation != 0:
            self.site_live.set()
        self._observer.after_restore()
        log.info(
            "state restored: %d bytes, cut at %d events, %d buffered to apply",
            len(blob),
            cut,
            len(buffered),
        )
        for event in buffered:
            if isinstance(event, ViewChange):
                self._apply_view(event)
            else:
                self._on_delivery(event, live=False)
        if self.recovering:  # joined a site still waiting for its brokers
            self.offer_held(held)
            self._report_recovered()
        self._announce_ready()

    def _skip_own(self, covered: Sequence[Delivery | ViewChange]) -> None:
        """Frames of mine that a snapshot covers: applied as far as the
        barriers go (they come back in order)."""
        for event in covered:
            if isinstance(event, Delivery) and event.sender == self.me:
                self._frames_applied += 1
                for waiter in self._barrier_events.pop(self._frames_applied, ()):
                    waiter.set(self.state.cseq)

    def _on_delivery(self, event: Delivery, *, live: bool = True) -> None:
        """Apply one delivered frame; ``live`` when it is delivered now (not a
        replay of buffered events, whose JoinHave the membership noted at
        their delivery)."""
        assert self.me is not None and self.membership is not None
        own = event.sender == self.me
        self.delivered_frame = event.payload
        try:
            commands = pc.decode_frame_untrusted(event.payload)
        except DrgateError as exc:
            # Every member refuses the same bytes the same way, so skipping
            # keeps the members identical; say so loudly.
            log.error("undecodable bus frame from %s skipped: %s", event.sender, exc)
            commands = []
        haves: list[pc.JoinHave] = []
        for cmd in commands:
            if isinstance(cmd, pc.MemberReady):
                self.membership.on_member_ready(event.sender, live=live)
            elif isinstance(cmd, pc.JoinHave):
                haves.append(cmd)
            effects = st.apply(self.state, cmd, sender=event.sender)
            if isinstance(cmd, pc.Recovering | pc.ForceRecovery):
                self._after_recovering()
            elif isinstance(cmd, pc.RecoveryChunk):
                self._take_recovery_chunk(cmd, event.sender)
            elif self._restore_at_genesis and isinstance(cmd, pc.Genesis):  # rare: flag first
                self._restore_at_genesis = False
                self._observer.after_restore()
            if self.state.incarnation != 0 and not self.site_live.is_set():
                self.site_live.set()
            self._observer.after_command(cmd, effects, event.sender, own)
        for have in haves if live else ():
            # After the whole frame: the snapshot is cut here.
            for action in self.membership.on_join_have(event.sender, have):
                self._act(action)
        if own:
            self._frames_applied += 1
            for waiter in self._barrier_events.pop(self._frames_applied, ()):
                waiter.set(self.state.cseq)
        self._observer.after_frame()
