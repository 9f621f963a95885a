"""Resync snapshots: P's side (take, encode and chunk as the link takes them)
and the bus-member helper the operator commands use (docs/architecture.md,
sections 5-7).

Theory of operation
-------------------
When D's WELCOME says it applied nothing from this incarnation
(``resume_from == 0``), less than the spool reaches back to, or found a gap,
the egress takes a snapshot of the replicated queues from its shadow state
*at its current cseq* (the cut): :func:`plan_snapshot` is synchronous, so the
state cannot move while it is read, and keeps only references (messages are
immutable).  A :class:`SnapshotStream` then encodes the plan lazily, as
records ``u32 length | bus frame of Replicated commands``
(protocol/snapshotrecords.py), one link chunk at a time, when the
link's window has room for it: P holds one chunk beyond the window,
whatever the snapshot's size.  The link carries it as a streamed resync
(RESYNC_BEGIN without totals, CHUNK..., END with them), then the spool's
events above the cut.

D's ingress multicasts each chunk as a ``ResyncStage`` piece and acks it once
D's bus applied it (every member staged it, apart from the queues), and at
RESYNC_END a ``ResyncCommit`` that installs the staged snapshot at one point
of D's stream (``cluster.state.resync``); it acks the cut once that came back
and ``applied[incarnation]`` reached the cut.  A connection lost before then
leaves D's queues unchanged; the next resync starts again from piece 0.

What the snapshot holds: the exchanges, then per queue whose mode is not
``none`` its content (gateway/content.py: declare, bindings, and for ``full``
and ``enqueue`` queues the messages the per-message rules forward).  D
applies ``enqueue`` messages only above its ``high_pos`` mark for the queue,
so nothing D's consumers took comes back.

**A failback by delta** (docs/operations.md): the site the resync goes to
was the primary before a forced failover, and its WELCOME says what it holds
(:func:`holdings_of`, protocol/holdings.py).  The stream then leaves out
what it has: in a ``full`` queue each run of messages it holds becomes one
``Keep`` (positions here and there, count, digest), and an ``enqueue`` queue
carries only the messages it never had (its own messages, which its
consumers may have taken since, are not sent back).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import trio

from cluster.bus import BusConfig, open_bus
from cluster.member import BusOpener, NullObserver, SiteMember
from cluster.state.digests import kept_digest
from cluster.state.effects import Message
from cluster.state.model import Origin, SiteState
from cluster.state.views import applied
from filters.matcher import RuleSet
from gateway.content import QueueContent, queue_content
from protocol import cluster as pc
from protocol.errors import DrgateError, RemoteProtocolError
from protocol.holdings import (
    Held,
    Holdings,
    pack_holdings,
    ranges_of,
    unpack_holdings_untrusted,
)
from protocol.modes import Mode, Role
from protocol.snapshotrecords import encode_snapshot_record, iter_snapshot_untrusted

log = logging.getLogger("drgate.sidecar")

# Bytes of encoded commands per snapshot record (one bus frame): the size the
# bus itself batches to, so decoding one never holds up the applier long.
RECORD_MAX_BYTES = 256 * 1024
RECORD_MAX_COMMANDS = 1000
# Bytes per link resync chunk (and so per ResyncStage on D's bus): an eighth
# of the default 8 MiB window, so the window holds several chunks in flight.
CHUNK_BYTES = 1024 * 1024
# The most messages one Keep stands for (a staging step's work stays small).
KEEP_MAX_MESSAGES = 10_000
# Resyncs by delta (a failback) tried before a whole one: a link lost on the
# way is retried as a delta, a delta D cannot stage is not retried forever.
DELTA_ATTEMPTS = 3
# ERROR code a D ingress sends when P is an incarnation D has not accepted.
# Codes 20-39 are "the operator must look"; 23 is the next free one.
NEW_INCARNATION_CODE = 23


@dataclass(slots=True)
class SnapshotPlan:
    """What a snapshot will hold, read from the state at ``cut`` (references
    only: building it costs a list copy per queue)."""

    cut: int
    incarnation: int
    exchanges: list[pc.ExchangeDeclare]
    queues: list[QueueContent] = field(default_factory=list)

    @property
    def messages(self) -> int:
        return sum(len(q.messages) for q in self.queues)


def plan_snapshot(state: SiteState, rules: RuleSet, *, queues: Sequence[str] = ()) -> SnapshotPlan:
    """The snapshot of what ``rules`` replicate, as of ``state.cseq`` (the cut).

    Synchronous on purpose: the caller must not let the state move while it
    runs.  ``queues`` limits it to those queues (a per-queue resync)."""
    exchanges = [
        pc.ExchangeDeclare(x.name, x.type, dict(x.args))
        for x in state.exchanges.values()
        if not x.predeclared and not queues
    ]
    plan = SnapshotPlan(state.cseq, state.incarnation, exchanges)
    wanted = set(queues)
    for q in state.queues.values():
        if wanted and q.name not in wanted:
            continue
        decision = rules.decide_queue(q.name, q.args)
        if decision.mode != Mode.NONE:
            plan.queues.append(queue_content(state, q, decision))
    return plan


class SnapshotStream:
    """The records of ``plan``, encoded as they are asked for and joined into
    link chunks of about ``chunk_bytes`` (a record is never split, so D can
    read each chunk on its own).  Memory: one chunk, whatever the plan's size."""

    def __init__(
        self,
        plan: SnapshotPlan,
        rules: RuleSet,
        *,
        origin: str,
        epoch: int,
        time_us: int,
        chunk_bytes: int = CHUNK_BYTES,
        holdings: Holdings | None = None,
        peer: str = "",
    ) -> None:
        self.plan = plan
        # What ``peer``, the receiving site, holds (a failback by delta).
        self.holdings = holdings
        self.peer = peer
        self.messages_kept = 0  # messages left out because the peer holds them
        self.bytes_kept = 0  # what their Enqueues would have taken
        self.chunk_bytes = chunk_bytes
        self.record_bytes = min(RECORD_MAX_BYTES, chunk_bytes)
        self.messages_done = 0  # messages encoded so far (progress)
        self.bytes_done = 0
        self.chunks_done = 0
        self._records = self._encode(rules, origin, epoch, time_us)
        self._pending: bytes | None = None  # a record read ahead, for the next chunk
        self.exhausted = False  # every chunk was handed out

    def next_chunk(self) -> bytes | None:
        """The next chunk, or None once the snapshot is all out."""
        parts: list[bytes] = []
        size = 0
        if self._pending is not None:
            parts.append(self._pending)
            size = len(self._pending)
            self._pending = None
        for record in self._records:
            if parts and size + len(record) > self.chunk_bytes:
                self._pending = record
                break
            parts.append(record)
            size += len(record)
        if not parts:
            self.exhausted = True
            return None
        self.chunks_done += 1
        self.bytes_done += size
        return b"".join(parts)

    def summary(self) -> str:
        """What was sent, for the log."""
        kept = (
            f" ({self.messages_kept} held by the peer not sent, {self.bytes_kept} bytes)"
            if self.holdings is not None
            else ""
        )
        return (
            f"{self.chunks_done} chunks, {self.bytes_done} bytes, "
            f"{self.messages_done} messages{kept}"
        )

    def chunks(self) -> Iterator[bytes]:
        """Every chunk, in order."""
        while (chunk := self.next_chunk()) is not None:
            yield chunk

    def _encode(self, rules: RuleSet, origin: str, epoch: int, time_us: int) -> Iterator[bytes]:
        plan = self.plan
        modes: list[Mode] = []
        commands: list[pc.Command] = []
        size = 0

        def record() -> bytes:
            nonlocal size
            replicated = pc.Replicated(
                origin, plan.incarnation, plan.cut, epoch, time_us, tuple(modes), tuple(commands)
            )
            modes.clear()
            commands.clear()
            size = 0
            return encode_snapshot_record([replicated])

        def add(mode: Mode, cmd: pc.Command, nbytes: int = 64) -> bool:
            nonlocal size
            modes.append(mode)
            commands.append(cmd)
            size += nbytes
            return size >= self.record_bytes or len(commands) >= RECORD_MAX_COMMANDS

        for x in plan.exchanges:
            if add(Mode.WIRING, x):
                yield record()
        for q in plan.queues:
            for cmd in q.wiring():
                if add(q.mode, cmd):
                    yield record()
            if self.holdings is not None:
                held = self.holdings.get(q.target, Held())
                for cmd, nbytes in self._delta(q, held, rules):
                    if add(q.mode, cmd, nbytes):
                        yield record()
                continue
            for m in q.messages:
                self.messages_done += 1
                enqueue = q.enqueue(rules, m)
                if enqueue is not None and add(q.mode, enqueue, len(m.body) + 64):
                    yield record()
        if commands:
            yield record()

    def _delta(
        self, q: QueueContent, held: Held, rules: RuleSet
    ) -> Iterator[tuple[pc.Command, int]]:
        """``q``'s messages for a peer that holds ``held`` of it: an
        ``Enqueue`` for each it lacks, a ``Keep`` for each run it holds
        (``full``), nothing for what it has or had (``enqueue``)."""
        run: list[Message] = []
        run_at = (False, 0)  # the run's kind and first position at the peer
        run_bytes = 0

        def keep() -> tuple[pc.Command, int]:
            nonlocal run_bytes
            cmd = pc.Keep(
                q.target, run[0].pos, run_at[1], len(run), run_at[0], run_bytes, kept_digest(run)
            )
            self.messages_kept += len(run)
            self.bytes_kept += run_bytes
            run.clear()
            run_bytes = 0
            return cmd, 64

        for m in q.messages:
            self.messages_done += 1
            enqueue = q.enqueue(rules, m)
            if enqueue is None:
                continue
            # The peer's own message (it came from there), or this site's.
            theirs = q.replica_of == self.peer and m.origin_pos != 0
            replicated, at = (False, m.origin_pos) if theirs else (True, m.pos)
            holds = (theirs or not m.origin_pos) and held.holds(at, replicated=replicated)
            if q.mode != Mode.FULL:
                if not (theirs or holds):
                    yield enqueue, len(m.body) + 64
                continue
            follows = (
                run
                and run_at[0] == replicated
                and m.pos == run[-1].pos + 1
                and at == run_at[1] + len(run)
                and len(run) < KEEP_MAX_MESSAGES
            )
            if run and not (holds and follows):
                yield keep()
            if not holds:
                yield enqueue, len(m.body) + 64
                continue
            if not run:
                run_at = (replicated, at)
            run.append(m)
            _kind, key, rest = pc.encode_command(enqueue)
            run_bytes += len(key) + len(rest)
        if run:
            yield keep()


def delta_holdings(holdings: bytes, attempts: int) -> Holdings | None:
    """The holdings a WELCOME announced, to leave out of the resync; None
    for a whole one: none announced, unreadable, or ``attempts`` resyncs by
    delta did not take already."""
    if not holdings:
        return None
    if attempts >= DELTA_ATTEMPTS:
        log.warning("egress: %d resyncs by delta did not take; sending a whole one", attempts)
        return None
    try:
        return unpack_holdings_untrusted(holdings)
    except RemoteProtocolError as exc:
        log.warning("egress: %s; sending a whole resync", exc)
        return None


def welcome_holdings(state: SiteState, peer: str, resume: int) -> bytes:
    """What a WELCOME to ``peer``'s stream, resuming after ``resume``,
    announces: this site's holdings when it rejoins as ``peer``'s DR site
    and is resynced (a failback by delta), else nothing."""
    if state.rejoining != peer or resume:
        return b""
    return pack_holdings(holdings_of(state, peer))


def holdings_of(state: SiteState, peer: str) -> Holdings:
    """What this site holds, for ``peer``'s resync of it (a failback by
    delta): per queue with messages (not a replica of a third site), the
    positions of its own messages and the origin positions of those it
    holds from ``peer``."""
    holdings: Holdings = {}
    for q in state.queues.values():
        if not q.messages or (q.replica is not None and q.replica.origin != peer):
            continue
        msgs = q.messages.values()
        holdings[q.name] = Held(
            ranges_of(m.pos for m in msgs if not m.origin_pos),
            ranges_of(m.origin_pos for m in msgs if m.origin_pos),
        )
    return holdings


# --------------------------------------------------------------------------
# D: what the ingress checks of a resync it passed to D's bus
# --------------------------------------------------------------------------


def first_time_us(records: bytes) -> int:
    """P's time of a snapshot's cut: its first record's (0 if it has none;
    a bad piece is refused by every member when staged)."""
    try:
        for first in iter_snapshot_untrusted(records):
            return first.origin_time_us
    except RemoteProtocolError:
        pass
    return 0


def check_staged(state: SiteState, cmd: pc.ResyncStage, site: str) -> None:
    """D's bus applied ``cmd``: raise unless it is staged (then nothing is acked)."""
    staged = state.staged.get(cmd.origin_cluster)
    if staged is None or staged.key != (cmd.incarnation, cmd.cut, cmd.epoch, cmd.index + 1):
        raise DrgateError(
            f"piece {cmd.index} of the resync from {cmd.origin_cluster} cut at {cmd.cut} "
            f"was not staged by {site} (see its counters resync_pieces_refused, r7_fenced, "
            "incarnation_refused); the link restarts"
        )


def check_installed(state: SiteState, cmd: pc.ResyncCommit, site: str) -> None:
    """D's bus applied ``cmd``: raise unless the resync was installed."""
    done = applied(state, cmd.origin_cluster, cmd.incarnation)
    if done < cmd.cut:
        origin = state.origins.get(cmd.origin_cluster)
        raise DrgateError(
            f"the resync from {cmd.origin_cluster} cut at {cmd.cut} was not applied by "
            f"{site} (applied {done}; epoch {None if origin is None else origin.epoch}, "
            f"incarnation {None if origin is None else origin.incarnation})"
        )


# --------------------------------------------------------------------------
# Operator commands: a short-lived member of a site's bus
# --------------------------------------------------------------------------


class AdminMember(NullObserver):
    """A tool that joins the bus (role ADMIN) by state transfer like a broker,
    so it reads the site state, submits commands and waits until they are
    applied, then leaves.  It needs none of the member's hooks."""

    def __init__(self, cluster: str, bus: BusConfig, *, open_member: BusOpener = open_bus) -> None:
        self.member = SiteMember(
            cluster, bus, role=Role.ADMIN, observer=self, open_member=open_member
        )

    @property
    def state(self) -> SiteState:
        """The site state (replaced on a rejoin: read it through here)."""
        return self.member.state

    async def submit_and_wait(self, *commands: pc.Command) -> int:
        """See :meth:`SiteMember.submit_and_wait`: the cseq by which they were applied."""
        return await self.member.submit_and_wait(*commands)


@contextlib.asynccontextmanager
async def open_admin_member(
    cluster: str, bus: BusConfig, *, join_within_s: float = 30.0, open_member: BusOpener = open_bus
) -> AsyncIterator[AdminMember]:
    """Join ``cluster``'s bus (through ``open_member``: a test's in-memory
    bus); yields once the site state is here."""
    member = AdminMember(cluster, bus, open_member=open_member)
    async with trio.open_nursery() as nursery:
        with trio.move_on_after(join_within_s) as scope:
            await nursery.start(member.member.serve)
        if scope.cancelled_caught:
            nursery.cancel_scope.cancel()
            raise DrgateError(
                f"could not join the bus of {cluster} within {join_within_s:.0f} s "
                f"({bus.backend} {bus.address or bus.group}); is the site running?"
            )
        try:
            yield member
        finally:
            nursery.cancel_scope.cancel()


def origin_summary(origin: Origin | None, now_us: int | None = None) -> dict[str, object]:
    """What D holds of an origin, for people: last applied cseq, its time at
    P, and the RPO a failover now would have."""
    now_us = int(time.time() * 1e6) if now_us is None else now_us
    if origin is None:
        return {"applied_cseq": 0, "origin_time_us": 0, "rpo_seconds": None, "epoch": 0}
    inc = origin.incarnation
    last = origin.last_time_us
    return {
        "incarnation": inc,
        "applied_cseq": origin.applied.get(inc, 0),
        "origin_time_us": last,
        "rpo_seconds": None if not last else max(0.0, (now_us - last) / 1e6),
        "epoch": origin.epoch,
        "promoted": origin.promoted,
        "promoted_time_us": origin.promoted_time_us,
        "refused_incarnation": origin.refused_incarnation,
    }
