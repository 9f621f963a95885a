"""Resync snapshots: P's side (take and chunk), D's side (collect), and the
bus-member helper the operator commands use (docs/architecture.md, sections 5-7).

Theory of operation
-------------------
When D's WELCOME says it applied nothing from this incarnation
(``resume_from == 0``) or less than the spool reaches back to, the egress
takes a snapshot of the replicated queues from its shadow state *at its
current cseq* (the cut): that is synchronous, so the state cannot move while
it is read; messages are immutable, so only references are kept.  It then
encodes the snapshot (with checkpoints, off the applier's path) as records
``u32 length | bus frame of Replicated commands`` (``protocol.cluster``'s
snapshot format), cuts the byte string into link chunks at record
boundaries and sends RESYNC_BEGIN / CHUNK... / END, then the spool's events
above the cut.

The ingress buffers the chunks (in memory, bounded by
:data:`RESYNC_MAX_BYTES`, acking each chunk as buffered: nothing is applied
yet) and at RESYNC_END multicasts one ``ResyncApply`` command holding the
whole snapshot.  Every D member applies it at that one point of D's stream
(``cluster.state.replica.resync_apply``), and the ingress acks the cut once
it has come back and ``applied[incarnation]`` reached the cut.  A connection
lost before that leaves D unchanged; the next connection starts again from
scratch.

What the snapshot holds: the exchanges, then per queue whose mode is not
``none`` its content (gateway/content.py: declare, bindings, and for ``full``
and ``enqueue`` queues the messages the per-message rules forward).  D
applies ``enqueue`` messages only above its ``high_pos`` mark for the queue,
so nothing D's consumers took comes back.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import trio

from cluster.bus import BusConfig
from cluster.member import NullObserver, SiteMember
from cluster.state.model import Origin, SiteState
from filters.matcher import RuleSet
from gateway.content import QueueContent, queue_content
from protocol import cluster as pc
from protocol.errors import DrgateError, LinkError
from protocol.modes import Mode, Role

# Bytes of encoded commands per snapshot record (one bus frame): the size the
# bus itself batches to, so decoding one never holds up the applier long.
RECORD_MAX_BYTES = 256 * 1024
RECORD_MAX_COMMANDS = 1000
# Bytes per link resync chunk: an eighth of the default 8 MiB window, so the
# window holds several chunks in flight.
CHUNK_BYTES = 1024 * 1024
# The largest snapshot an ingress buffers.  The whole snapshot travels as one
# ResyncApply bus command, and the embedded bus refuses frames above 64 MiB.
RESYNC_MAX_BYTES = 60 * 1024 * 1024
# Messages encoded between two checkpoints while a snapshot is encoded.
ENCODE_STEP = 2000
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


async def encode_snapshot(
    plan: SnapshotPlan, rules: RuleSet, *, origin: str, epoch: int, time_us: int
) -> list[bytes]:
    """The snapshot records (see module docstring), with a checkpoint every
    :data:`ENCODE_STEP` messages."""
    records: list[bytes] = []
    modes: list[Mode] = []
    commands: list[pc.Command] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if commands:
            replicated = pc.Replicated(
                origin, plan.incarnation, plan.cut, epoch, time_us, tuple(modes), tuple(commands)
            )
            records.append(pc.encode_snapshot_record([replicated]))
        modes.clear()
        commands.clear()
        size = 0

    def add(mode: Mode, cmd: pc.Command, nbytes: int = 64) -> None:
        nonlocal size
        modes.append(mode)
        commands.append(cmd)
        size += nbytes
        if size >= RECORD_MAX_BYTES or len(commands) >= RECORD_MAX_COMMANDS:
            flush()

    for x in plan.exchanges:
        add(Mode.WIRING, x)
    done = 0
    for q in plan.queues:
        for cmd in q.wiring():
            add(q.mode, cmd)
        for m in q.messages:
            enqueue = q.enqueue(rules, m)
            if enqueue is not None:
                add(q.mode, enqueue, len(m.body) + 64)
            done += 1
            if done % ENCODE_STEP == 0:
                await trio.lowlevel.checkpoint()
    flush()
    return records


def chunk_records(records: Sequence[bytes], chunk_bytes: int = CHUNK_BYTES) -> list[bytes]:
    """Records joined into link chunks of about ``chunk_bytes`` (a record is
    never split, so D may concatenate chunks back into a snapshot)."""
    chunks: list[bytes] = []
    pending: list[bytes] = []
    size = 0
    for record in records:
        if pending and size + len(record) > chunk_bytes:
            chunks.append(b"".join(pending))
            pending, size = [], 0
        pending.append(record)
        size += len(record)
    if pending:
        chunks.append(b"".join(pending))
    return chunks


# --------------------------------------------------------------------------
# D: collecting a resync
# --------------------------------------------------------------------------


class ResyncCollector:
    """The chunks of one resync, held until RESYNC_END (bounded)."""

    def __init__(self, origin: str, incarnation: int, epoch: int, cut: int, total: int) -> None:
        if total > RESYNC_MAX_BYTES:
            raise LinkError(
                f"a resync of {total} bytes from {origin} exceeds this ingress's limit of "
                f"{RESYNC_MAX_BYTES} bytes; replicate fewer messages (rules), or drain P's "
                "queues, then reconnect"
            )
        self.origin = origin
        self.incarnation = incarnation
        self.epoch = epoch
        self.cut = cut
        self.total = total
        self.chunks: list[bytes] = []
        self.received = 0

    def add(self, data: bytes) -> None:
        self.chunks.append(data)
        self.received += len(data)

    def command(self) -> pc.ResyncApply:
        """The ``ResyncApply`` to multicast; its time is the origin's time of the
        cut, read from the first record."""
        snapshot = b"".join(self.chunks)
        time_us = 0
        for first in pc.iter_snapshot_untrusted(snapshot):
            time_us = first.origin_time_us
            break
        return pc.ResyncApply(
            self.origin, self.incarnation, self.cut, self.epoch, time_us, snapshot
        )


# --------------------------------------------------------------------------
# Operator commands: a short-lived member of a site's bus
# --------------------------------------------------------------------------


class AdminMember(NullObserver):
    """A tool that joins the bus (role ADMIN) by state transfer like a broker,
    so it reads the site state, submits commands and waits until they are
    applied, then leaves.  It needs none of the member's hooks."""

    def __init__(self, cluster: str, bus: BusConfig) -> None:
        self.member = SiteMember(cluster, bus, role=Role.ADMIN, observer=self)

    @property
    def state(self) -> SiteState:
        """The site state (replaced on a rejoin: read it through here)."""
        return self.member.state

    async def submit_and_wait(self, *commands: pc.Command) -> None:
        """See :meth:`SiteMember.submit_and_wait`."""
        await self.member.submit_and_wait(*commands)


@contextlib.asynccontextmanager
async def open_admin_member(
    cluster: str, bus: BusConfig, *, join_within_s: float = 30.0
) -> AsyncIterator[AdminMember]:
    """Join ``cluster``'s bus; yields once the site state is here."""
    member = AdminMember(cluster, bus)
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
