"""A resync of another site applied here: staged in pieces, installed at one
point of the stream (docs/state.md, "Resync").

Theory of operation
-------------------
A resync snapshot of origin O cut at its cseq C reaches this site's bus as
``ResyncStage`` pieces 0..n-1 and then a ``ResyncCommit`` of n pieces (or,
whole, as one ``ResyncApply``).  Every member decodes each piece into
``state.staged[O]`` (:class:`~cluster.state.model.StagedResync`): the
origin's exchanges, queue declares, bindings and messages, built as the
queues will hold them but apart from them, so no client sees any of it and
each piece costs the applier time in proportion to its own size.  The
commit checks that what is staged is exactly its resync (same incarnation,
cut, epoch and piece count) and then installs it in one step of the
applier: the replicas of O change all at once from the clients' point of
view.  Staging survives a member joining in between (it is part of the
state snapshot), and a piece out of order, a bad piece or a refused one
drops the staging, so the commit that follows installs nothing and the
ingress sees the resync not applied.

What installing does: replicas of O absent from the snapshot are deleted;
``full`` replicas (and a queue changing to ``full``) are deleted and
re-created with the origin's messages and positions; ``enqueue`` and
``wiring`` replicas are kept and their bindings replaced; ``enqueue`` queues
take only messages above their ``high_pos`` mark (so nothing this site's
consumers took comes back), the mark starting again from 0 when the
incarnation is new to this site.  ``applied[incarnation]`` becomes the cut.

**A failback by delta** (cluster/state/switchover.py, ``REJOIN``): the site
that rejoins as the origin's DR site announced what it holds, and the
origin's snapshot carries a ``Keep`` for runs of messages it holds instead
of their ``Enqueue``: staging takes this site's own copies (checked against
the ``Keep``'s digest; one that does not match, or a message gone, drops the
staging like a bad piece).  At the install this site's own queues that the
snapshot names become replicas of the origin first, so they are replaced or
kept like any replica.
"""

from __future__ import annotations

from dataclasses import replace

from cluster.state.digests import kept_digest
from cluster.state.effects import (
    Effects,
    Enqueued,
    Message,
    Outcome,
    ReplicatedOutcome,
    Sender,
)
from cluster.state.merge import admit, record_applied
from cluster.state.model import Queue, SiteState, StagedQueue, StagedResync
from cluster.state.queues import delete_queue, drop_bindings_to
from cluster.state.replica import r_bind, r_exchange_declare, r_queue_declare, replica_of
from cluster.state.switchover import rejoin_done
from protocol.cluster import (
    Bind,
    Command,
    Enqueue,
    ExchangeDeclare,
    Keep,
    QueueDeclare,
    Replicated,
    ResyncApply,
    ResyncCommit,
    ResyncStage,
)
from protocol.errors import DrgateError
from protocol.modes import Mode
from protocol.snapshotrecords import encode_snapshot_record, iter_snapshot_untrusted

# Commands per record when staging is written out again for a joining member.
RECORD_COMMANDS = 1000


def resync_stage(state: SiteState, cmd: ResyncStage, sender: Sender | None, eff: Effects) -> None:
    """Stage piece ``cmd.index`` of a resync (see the module docstring)."""
    origin = cmd.origin_cluster
    refusal = admit(state, origin, cmd.incarnation, cmd.cut, cmd.epoch)
    if refusal is not None:
        state.staged.pop(origin, None)
        eff.append(ReplicatedOutcome(origin, cmd.incarnation, cmd.cut, cmd.epoch, refusal))
        return
    staged = state.staged.get(origin)
    if cmd.index == 0:
        staged = StagedResync(cmd.incarnation, cmd.cut, cmd.epoch)
    elif staged is None or staged.key != (cmd.incarnation, cmd.cut, cmd.epoch, cmd.index):
        state.staged.pop(origin, None)
        state.count("resync_pieces_refused")
        return
    state.count("resync_bytes_staged", len(cmd.records))
    if not stage_records(state, staged, cmd.records):
        state.staged.pop(origin, None)
        return
    staged.pieces += 1
    state.staged[origin] = staged
    state.count("resync_pieces_staged")


def resync_commit(state: SiteState, cmd: ResyncCommit, sender: Sender | None, eff: Effects) -> None:
    """Install the staged resync ``cmd`` ends, if it is exactly that one."""
    origin = cmd.origin_cluster
    staged = state.staged.pop(origin, None)
    refusal = admit(state, origin, cmd.incarnation, cmd.cut, cmd.epoch)
    if refusal is not None:
        eff.append(ReplicatedOutcome(origin, cmd.incarnation, cmd.cut, cmd.epoch, refusal))
        return
    if staged is None and cmd.pieces == 0:
        staged = StagedResync(cmd.incarnation, cmd.cut, cmd.epoch)  # an empty snapshot
    if staged is None or staged.key != (cmd.incarnation, cmd.cut, cmd.epoch, cmd.pieces):
        state.count("resync_commits_refused")
        return
    _install(state, origin, staged, cmd.origin_time_us, eff)


def resync_apply(state: SiteState, cmd: ResyncApply, sender: Sender | None, eff: Effects) -> None:
    """A whole snapshot in one command: staged and installed at once.  A bad
    snapshot changes nothing."""
    origin = cmd.origin_cluster
    refusal = admit(state, origin, cmd.incarnation, cmd.cut, cmd.epoch)
    if refusal is not None:
        eff.append(ReplicatedOutcome(origin, cmd.incarnation, cmd.cut, cmd.epoch, refusal))
        return
    staged = StagedResync(cmd.incarnation, cmd.cut, cmd.epoch)
    if stage_records(state, staged, cmd.snapshot):
        _install(state, origin, staged, cmd.origin_time_us, eff)


# --------------------------------------------------------------------------
# Staging: snapshot records in, and (for a state snapshot) out again
# --------------------------------------------------------------------------


def staged_records(origin: str, staged: StagedResync) -> bytes:
    """``staged`` as snapshot records again (what a joining member restages):
    exchanges, then per queue its declare and messages, then the bindings."""
    records: list[bytes] = []
    modes: list[Mode] = []
    commands: list[Command] = []

    def add(mode: Mode, cmd: Command) -> None:
        modes.append(mode)
        commands.append(cmd)
        if len(commands) >= RECORD_COMMANDS:
            flush()

    def flush() -> None:
        if commands:
            replicated = Replicated(
                origin,
                staged.incarnation,
                staged.cut,
                staged.epoch,
                0,
                tuple(modes),
                tuple(commands),
            )
            records.append(encode_snapshot_record([replicated]))
        modes.clear()
        commands.clear()

    for x in staged.exchanges.values():
        add(Mode.WIRING, x)
    for q in staged.queues.values():
        add(q.mode, q.declare)
        for m in q.messages:
            add(
                q.mode,
                Enqueue(
                    q.declare.queue, m.pos, m.body, m.message_id, m.properties or {}, m.redelivered
                ),
            )
    for b in staged.binds:
        add(Mode.WIRING, b)
    flush()
    return b"".join(records)


def stage_records(state: SiteState, staged: StagedResync, records: bytes | memoryview) -> bool:
    """Decode ``records`` into ``staged``; False (counted) for bad bytes, in
    which case ``staged`` must be dropped."""
    try:
        commands = list(iter_snapshot_untrusted(records))
    except DrgateError:
        state.count("ignored")
        return False
    by_origin: dict[str, dict[int, Message]] = {}  # per queue, for the Keeps
    for record in commands:
        for mode, inner in zip(record.modes, record.commands, strict=False):
            if isinstance(inner, Enqueue):
                q = staged.queues.get(inner.queue)
                if q is None:
                    state.count("replicated_missing_queue")
                    continue
                props = dict(inner.properties) if inner.properties else None
                q.messages.append(
                    Message(
                        inner.pos,
                        bytes(inner.body),
                        inner.message_id,
                        props,
                        int(inner.redelivered),
                        inner.pos,
                    )
                )
            elif isinstance(inner, Keep):
                q = staged.queues.get(inner.queue)
                kept = None if q is None else _kept(state, inner, by_origin)
                if q is None or kept is None:
                    state.count("resync_keep_refused")
                    return False
                q.messages.extend(kept)
                state.count("resync_kept_messages", inner.count)
                state.count("resync_kept_bytes", inner.nbytes)
            elif isinstance(inner, ExchangeDeclare):
                staged.exchanges[inner.exchange] = inner
            elif isinstance(inner, QueueDeclare):
                staged.queues[inner.queue] = StagedQueue(mode, inner)
            elif isinstance(inner, Bind):
                staged.binds.append(inner)
            else:
                state.count("replicated_unsupported")
    return True


def _kept(
    state: SiteState, keep: Keep, by_origin: dict[str, dict[int, Message]]
) -> list[Message] | None:
    """This site's copies of the messages ``keep`` stands for, at the
    origin's positions, or None if it does not hold them all as the digest
    says (a message taken or changed since it announced them).
    ``by_origin``: the queues' messages by origin position, as needed."""
    q = state.queues.get(keep.queue)
    if q is None:
        return None
    if keep.replicated:
        index = by_origin.get(keep.queue)
        if index is None:
            index = {m.origin_pos: m for m in q.messages.values() if m.origin_pos}
            by_origin[keep.queue] = index
        held = [index.get(keep.held_pos + i) for i in range(keep.count)]
    else:
        held = [q.messages.get(keep.held_pos + i) for i in range(keep.count)]
    mine = [m for m in held if m is not None]
    if len(mine) != keep.count or kept_digest(mine) != bytes(keep.digest):
        return None
    return [
        Message(keep.pos + i, m.body, m.message_id, m.properties, int(m.redelivered), keep.pos + i)
        for i, m in enumerate(mine)
    ]


def _install(
    state: SiteState, origin: str, staged: StagedResync, time_us: int, eff: Effects
) -> None:
    rejoin_done(state, origin, {q.declare.queue: q.mode for q in staged.queues.values()})
    o = state.origins[origin]
    new_incarnation = staged.incarnation not in o.applied
    for name in [
        n
        for n, x in state.exchanges.items()
        if x.replica_origin == origin and not x.predeclared and n not in staged.exchanges
    ]:
        del state.exchanges[name]
    for x in staged.exchanges.values():
        r_exchange_declare(state, origin, Mode.WIRING, x, eff)
    for q in [q for q in state.queues.values() if q.replica is not None]:
        assert q.replica is not None
        if q.replica.origin != origin:
            continue
        wanted = staged.queues.get(q.name)
        if wanted is None or Mode.FULL in (wanted.mode, q.replica.mode):
            delete_queue(state, q, eff)
        else:
            drop_bindings_to(state, q.name)
            if new_incarnation:
                q.replica.high_pos = 0
    for sq in staged.queues.values():
        r_queue_declare(state, origin, sq.mode, sq.declare, eff)
        replica = replica_of(state, origin, sq.declare.queue)
        if replica is not None:
            _take_messages(state, replica, sq.messages, eff)
        elif sq.messages:
            state.count("replicated_missing_queue")
    for bind in staged.binds:
        r_bind(state, origin, Mode.WIRING, bind, eff)
    record_applied(state, origin, staged.incarnation, staged.cut, staged.epoch, time_us)
    eff.append(
        ReplicatedOutcome(origin, staged.incarnation, staged.cut, staged.epoch, Outcome.APPLIED)
    )


def _take_messages(state: SiteState, q: Queue, msgs: list[Message], eff: Effects) -> None:
    """The staged messages above ``q``'s mark, at once: a ``full`` replica
    keeps the origin's positions, an ``enqueue`` queue appends at its tail."""
    r = q.replica
    assert r is not None
    if not msgs:
        return
    if r.mode in (Mode.WIRING, Mode.NONE):
        state.count("replicated_unsupported", len(msgs))
        return
    fresh = [m for m in msgs if m.origin_pos > r.high_pos]
    state.count("replicated_stale_enqueues", len(msgs) - len(fresh))
    if not fresh:
        return
    if r.mode != Mode.FULL:
        base = q.next_pos
        fresh = [replace(m, pos=base + i) for i, m in enumerate(fresh)]
    state.count("replicated_over_limit", _over_limit(q, fresh))
    q.extend(fresh)
    r.high_pos = fresh[-1].origin_pos
    eff.extend(Enqueued(q.name, m.pos, m.origin_pos) for m in fresh)


def _over_limit(q: Queue, msgs: list[Message]) -> int:
    """How many of ``msgs`` arrive over ``q``'s limits (the origin accepted
    them: limits bind local publishers only, so they are counted, not refused)."""
    over = 0
    if q.max_count is not None:
        over = max(0, min(len(msgs), q.depth + len(msgs) - q.max_count))
    if q.max_size is not None:
        total = q.bytes
        for i, m in enumerate(msgs):
            total += len(m.body)
            if total > q.max_size:
                over = max(over, len(msgs) - i)
                break
    return over
