"""Snapshots of a site's state, and digests for comparing members.

Theory of operation
-------------------
A snapshot is the whole :class:`~cluster.state.model.SiteState` as bytes: what
a donor sends to a joining member (in ``StateChunk`` pieces) and what the
resync and the tests compare.  The encoding is canonical: two states built by
the same history encode to the same bytes, and ``snapshot(restore(b)) == b``.
Derived data (the available-message heap, the limits parsed from arguments,
queue byte totals) is not encoded; :func:`restore_untrusted` rebuilds it.

Layout (all integers big-endian; ``str16`` = u16 length + UTF-8,
``bytes32`` = u32 length + bytes; ``map`` = the bus commands' value map,
written and read by :mod:`protocol.values`' ``pack_value_map`` and
``unpack_value_map_untrusted``)::

    snapshot   := magic "DRGS" | version u16 | reserved u16
                  | cluster str16 | incarnation u64 | cseq u64
                  | rules_cseq u64 | rules bytes32
                  | u16 n | n x (counter str16 | value u64)
                  | u32 n | n x (node u32 | pid u32 | role u8)            ready
                  | u32 n | n x (origin str16 | incarnation u64 | cseq u64
                                 | time_us u64)                         watermarks
                  | u32 n | n x origin
                  | u32 n | n x (origin str16 | name str16)              R6 reported
                  | u32 n | n x exchange
                  | u32 n | n x queue
                  | u32 n | n x session
                  | u32 n | n x staged
                  | epoch u32 | superseded_by str16 | superseded_time_us u64
                  | u32 n | n x guarded queue str16   (this site's own stream)
                  | durable_cseq u64 | recovery_expect u32 | winner u8 [node u32 | pid u32]
                  | u32 n | n x (node u32 | pid u32 | cseq u64 | incarnation u64 | proposal u64)
                  | u32 n | n x (cseq u64 | dropped u8)    whole-site recoveries, oldest
                                                          first (not in version 2)
                  | switchover_to str16 | switchover_time_us u64
                  | u32 n | n x origin str16  (a planned switchover here, and the
                                               origins that handed over to this
                                               site; from version 5)
                  | failback_cseq u64         (a failback waiting for its DR
                                               site; from version 6)
                  | u32 n | n x failback queue str16  (the queues that wait
                                               for it; from version 7)
                  | handover_cseq u64 | swapped u8 | handed_to str16  (a
                                               handover sent, the roles swapped, the
                                               primary swapped with; from version 8)
                  | rejoining str16  (a failback by delta under way; from
                                               version 9)
                  | u32 n | n x waiting       (consumers' standing demand,
                                               cluster/state/demand.py; from
                                               version 10)
    origin     := name str16 | incarnation u64 | epoch u32 | promoted u8
                  | promoted_time_us u64 | last_time_us u64 | last_cseq u64
                  | refused_incarnation u64 | u32 n | n x (incarnation u64 | cseq u64)
    exchange   := name str16 | type u8 | predeclared u8 | replica_origin str16
                  | args map | u32 n | n x (queue str16 | key str16 | args map)
    queue      := name str16 | args map | next_pos u64
                  | replica u8 [origin str16 | mode u8 | high_pos u64]
                  | u32 n | n x message
    message    := pos u64 | origin_pos u64
                  | flags u8 (1 redelivered, 2 has properties, 4 body elided,
                              8 has broker state)
                  | message_id str16 | [properties map]
                  | [delivery_count u32 | annotations bytes32      (flag 8 set)
                     | u32 n | n x (session u64 | consumer u32)]
                  | body bytes32                    (flag 4 clear)
                  | body_len u32 | body_crc32 u32   (flag 4 set: a delta transfer)
    session    := id u64 | u32 n | n x (queue str16 | u32 m | m x (pos u64 | consumer u32))
    waiting    := queue str16 | session u64 | consumer u32 | count u32   (per queue in
                                               the queues' order, then in its round's)
    staged     := origin str16 | incarnation u64 | cut u64 | epoch u32 | pieces u32
                  | records bytes32        (a resync being staged, re-encoded as
                                            snapshot records: cluster.state.resync)

*Delta transfers.*  A donor's snapshot for a joiner that restarted from its
journal (``JoinHave``, cluster/membership.py) leaves out the body of every
persistent message whose queue and position lie in the ranges the joiner
announced (:func:`delta_snapshot`), writing its length and CRC32 instead;
the joiner restores it with ``bodies=`` its recovered state, which fills each
body by (queue, position) and checks both (:class:`ElidedBodyMismatch`
otherwise).  Version 3 added the flag and the whole-site recoveries; a version 2
snapshot (a journal's checkpoint written by an earlier release) reads as it
always did, as a site that had no recovery.

*Broker state of a message.*  Version 4 added flag 8: the delivery count the
brokers added, the annotations of ``modified`` outcomes (an encoded AMQP
map) and the links that called the message undeliverable-here.  A message
with none of them but a delivery count of 1 is written with flag 1 alone, as
versions 2 and 3 wrote a redelivered message (and read it back so: flag 1
is a delivery count of 1).

Every collection is written in its insertion order, which is the same on
every member (the state machine never iterates unordered sets), so the
restored state iterates, and therefore behaves, exactly as the original.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cluster.state.effects import Message
from cluster.state.model import (
    COUNTERS,
    Exchange,
    Origin,
    Queue,
    Recovery,
    Replica,
    Session,
    SiteState,
    StagedResync,
)
from cluster.state.persistence import keeps_body, persistent, queue_durable
from cluster.state.resync import stage_records, staged_records
from protocol.cluster import ExchangeType
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.modes import Mode, Role
from protocol.values import Value, ValueMap, pack_value_map, unpack_value_map_untrusted

MAGIC = b"DRGS"
# 3: whole-site recoveries and the elided-body flag (version 2 reads as a
# site with no recovery and no elided body).  4: a message's broker state
# (flag 8; versions 2 and 3 read as messages without it).  5: a planned
# switchover under way (earlier versions read as none).  6: a failback
# waiting for its DR site (earlier versions read as none).  7: the queues
# that failback waits on (version 6 read as its guarded queues).  8: the
# handover's cseq and the sites' roles swapped (earlier versions: neither).
# 9: a failback by delta under way (earlier versions: none).  10: consumers'
# standing demand (earlier versions: none waiting).
SNAPSHOT_VERSION = 10
_READABLE_VERSIONS = (2, 3, 4, 5, 6, 7, 8, 9, SNAPSHOT_VERSION)

_HEAD = struct.Struct(">4sHH")
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
#   pos u64 | origin_pos u64 | flags u8 | message_id length u16
_MSG = struct.Struct(">QQBH")
#   node u32 | pid u32 | role u8
_READY = struct.Struct(">IIB")
#   pos u64 | consumer u32
_HELD = struct.Struct(">QI")
_WAITING = struct.Struct(">QII")
#   incarnation u64 | cut u64 | epoch u32 | pieces u32
_STAGED = struct.Struct(">QQII")
#   node u32 | pid u32 | cseq u64 | incarnation u64 | proposal u64
_CANDIDATE = struct.Struct(">IIQQQ")

#   body_len u32 | body_crc32 u32   (an elided body)
_ELIDED_BODY = struct.Struct(">II")

_REDELIVERED = 1
_HAS_PROPERTIES = 2
_ELIDED = 4
_BROKER_STATE = 8
_KNOWN_FLAGS = _REDELIVERED | _HAS_PROPERTIES | _ELIDED | _BROKER_STATE
_KNOWN_FLAGS_V3 = _REDELIVERED | _HAS_PROPERTIES | _ELIDED
_KNOWN_FLAGS_V2 = _REDELIVERED | _HAS_PROPERTIES
#   session u64 | consumer u32   (a link that refused a message)
_REFUSER = struct.Struct(">QI")


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


def _str16(out: list[bytes], text: str) -> None:
    raw = text.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise LocalProtocolError(f"name of {len(raw)} bytes cannot be snapshotted (max 65535)")
    out.append(_U16.pack(len(raw)))
    out.append(raw)


def _bytes32(out: list[bytes], data: bytes) -> None:
    out.append(_U32.pack(len(data)))
    out.append(data)


def _map(out: list[bytes], values: ValueMap) -> None:
    out.append(pack_value_map(values))


def _message(out: list[bytes], m: Message, body: bool = True, elide: bool = False) -> None:
    mid = m.message_id.encode("utf-8")
    broker = bool(m.annotations or m.refused or m.delivery_count > 1)
    flags = (
        (_BROKER_STATE if broker else _REDELIVERED if m.delivery_count else 0)
        | (_HAS_PROPERTIES if m.properties is not None else 0)
        | (_ELIDED if elide else 0)
    )
    out.append(_MSG.pack(m.pos, m.origin_pos, flags, len(mid)))
    out.append(mid)
    if m.properties is not None:
        _map(out, m.properties)
    if broker:
        out.append(_U32.pack(m.delivery_count))
        _bytes32(out, m.annotations)
        out.append(_U32.pack(len(m.refused)))
        out.extend(_REFUSER.pack(*link) for link in m.refused)
    if elide:
        out.append(_ELIDED_BODY.pack(len(m.body), zlib.crc32(m.body)))
    elif body:
        out.append(_U32.pack(len(m.body)))
        out.append(m.body)
    else:
        out.append(_U32.pack(0))


HeldRanges = Mapping[str, tuple[int, int]]
"""Per queue, the first and last position of the messages a journal holds."""


@dataclass(frozen=True, slots=True)
class DeltaSnapshot:
    """A snapshot with elided bodies, and what the elision saved."""

    data: bytes
    bodies_elided: int
    bytes_elided: int

    @property
    def full_bytes(self) -> int:
        """The size the same snapshot would have had with every body."""
        return len(self.data) + self.bytes_elided - 4 * self.bodies_elided


def held_ranges(state: SiteState) -> dict[str, tuple[int, int]]:
    """What a node's recovered ``state`` can fill in a delta transfer: per
    durable queue with messages, its first and last position (a journal holds
    the body of every persistent message; the donor elides no other)."""
    ranges: dict[str, tuple[int, int]] = {}
    for q in state.queues.values():
        if q.messages and queue_durable(q):
            ranges[q.name] = (next(iter(q.messages)), next(reversed(q.messages)))
    return ranges


def delta_snapshot(state: SiteState, held: HeldRanges) -> DeltaSnapshot:
    """:func:`snapshot` for a joiner of the same incarnation whose journal
    holds ``held``: the body of every persistent message whose position lies
    in its queue's range is elided.  Positions only grow and a removed message
    never comes back, so the joiner holds each such message (or its queue was
    deleted and declared again, and the CRC check of the fill catches it)."""
    counts = [0, 0]
    blob = _snapshot(state, True, held, counts)
    return DeltaSnapshot(blob, counts[0], counts[1])


def snapshot(state: SiteState, *, transient_bodies: bool = True) -> bytes:
    """The canonical encoding of ``state`` (layout in the module docstring).

    ``transient_bodies=False`` (a journal's checkpoint) writes the messages
    whose bodies a journal does not hold with an empty body
    (:func:`cluster.state.persistence.keeps_body`)."""
    return _snapshot(state, transient_bodies, None, None)


def _snapshot(
    state: SiteState, transient_bodies: bool, elide: HeldRanges | None, counts: list[int] | None
) -> bytes:
    out: list[bytes] = [_HEAD.pack(MAGIC, SNAPSHOT_VERSION, 0)]
    _str16(out, state.cluster)
    out.append(_U64.pack(state.incarnation))
    out.append(_U64.pack(state.cseq))
    out.append(_U64.pack(state.rules_cseq))
    _bytes32(out, state.rules)
    out.append(_U16.pack(len(state.counters)))
    for name, value in state.counters.items():
        _str16(out, name)
        out.append(_U64.pack(value))
    out.append(_U32.pack(len(state.ready)))
    for (node, pid), role in state.ready.items():
        out.append(_READY.pack(node, pid, int(role)))
    out.append(_U32.pack(len(state.watermarks)))
    for origin_name, (inc, cseq, time_us) in state.watermarks.items():
        _str16(out, origin_name)
        out.append(_U64.pack(inc) + _U64.pack(cseq) + _U64.pack(time_us))
    out.append(_U32.pack(len(state.origins)))
    for o in state.origins.values():
        _str16(out, o.name)
        out.append(
            struct.pack(
                ">QIBQQQQI",
                o.incarnation,
                o.epoch,
                int(o.promoted),
                o.promoted_time_us,
                o.last_time_us,
                o.last_cseq,
                o.refused_incarnation,
                len(o.applied),
            )
        )
        for inc, cseq in o.applied.items():
            out.append(_U64.pack(inc) + _U64.pack(cseq))
    out.append(_U32.pack(len(state.reported)))
    for origin_name, name in state.reported:
        _str16(out, origin_name)
        _str16(out, name)
    out.append(_U32.pack(len(state.exchanges)))
    for ex in state.exchanges.values():
        _str16(out, ex.name)
        out.append(bytes((int(ex.type), int(ex.predeclared))))
        _str16(out, ex.replica_origin)
        _map(out, ex.args)
        out.append(_U32.pack(len(ex.bindings)))
        for (queue, key), args in ex.bindings.items():
            _str16(out, queue)
            _str16(out, key)
            _map(out, args)
    out.append(_U32.pack(len(state.queues)))
    for q in state.queues.values():
        _str16(out, q.name)
        _map(out, q.args)
        out.append(_U64.pack(q.next_pos))
        if q.replica is None:
            out.append(b"\x00")
        else:
            out.append(b"\x01")
            _str16(out, q.replica.origin)
            out.append(_U8.pack(int(q.replica.mode)) + _U64.pack(q.replica.high_pos))
        out.append(_U32.pack(len(q.messages)))
        span = None if elide is None else elide.get(q.name)
        if span is not None and counts is not None:
            first, last = span
            for m in q.messages.values():
                held = first <= m.pos <= last and bool(m.body) and persistent(q, m.properties)
                if held:
                    counts[0] += 1
                    counts[1] += len(m.body)
                _message(out, m, elide=held)
        elif transient_bodies:
            for m in q.messages.values():
                _message(out, m)
        else:
            for m in q.messages.values():
                _message(out, m, keeps_body(q, m.properties))
    out.append(_U32.pack(len(state.sessions)))
    for s in state.sessions.values():
        out.append(_U64.pack(s.id) + _U32.pack(len(s.acquired)))
        for qname, holds in s.acquired.items():
            _str16(out, qname)
            out.append(_U32.pack(len(holds)))
            out.extend(_HELD.pack(pos, consumer) for pos, consumer in holds.items())
    out.append(_U32.pack(len(state.staged)))
    for origin_name, staged in state.staged.items():
        _str16(out, origin_name)
        out.append(_STAGED.pack(staged.incarnation, staged.cut, staged.epoch, staged.pieces))
        _bytes32(out, staged_records(origin_name, staged))
    out.append(_U32.pack(state.epoch))
    _str16(out, state.superseded_by)
    out.append(_U64.pack(state.superseded_time_us))
    out.append(_U32.pack(len(state.guarded)))
    for name in state.guarded:
        _str16(out, name)
    out.append(_U64.pack(state.durable_cseq) + _U32.pack(state.recovery_expect))
    if state.recovery_winner is None:
        out.append(b"\x00")
    else:
        out.append(
            b"\x01" + _U32.pack(state.recovery_winner[0]) + _U32.pack(state.recovery_winner[1])
        )
    out.append(_U32.pack(len(state.candidates)))
    for node, candidate in state.candidates.items():
        out.append(_CANDIDATE.pack(node, *candidate))
    out.append(_U32.pack(len(state.recoveries)))
    out.extend(_U64.pack(r.cseq) + _U8.pack(int(r.dropped)) for r in state.recoveries)
    _str16(out, state.switchover_to)
    out.append(_U64.pack(state.switchover_time_us))
    out.append(_U32.pack(len(state.handovers)))
    for name in state.handovers:
        _str16(out, name)
    out.append(_U64.pack(state.failback_cseq))
    out.append(_U32.pack(len(state.failback_queues)))
    for name in state.failback_queues:
        _str16(out, name)
    out.append(_U64.pack(state.handover_cseq) + _U8.pack(int(state.swapped)))
    _str16(out, state.handed_to)
    _str16(out, state.rejoining)
    waiting = [q for q in state.queues.values() if q.waiting]
    out.append(_U32.pack(sum(len(q.waiting) for q in waiting)))
    for q in waiting:
        for (session, consumer), count in q.waiting.items():
            _str16(out, q.name)
            out.append(_WAITING.pack(session, consumer, count))
    try:
        return b"".join(out)
    except TypeError as exc:  # pragma: no cover - a body that is not bytes
        raise LocalProtocolError(f"cannot snapshot: {exc}") from exc


def _broker_state(
    data: bytes, off: int, queue: str
) -> tuple[int, bytes, tuple[tuple[int, int], ...], int]:
    """A message's broker state (flag 8) at ``off``: (delivery count,
    annotations, refusing links, the offset after it)."""
    if off + 8 > len(data):
        raise RemoteProtocolError(f"truncated snapshot: queue {queue!r} is cut short")
    (count,) = _U32.unpack_from(data, off)
    (size,) = _U32.unpack_from(data, off + 4)
    off += 8
    annotations = bytes(data[off : off + size])
    off += size
    if off + 4 > len(data):
        raise RemoteProtocolError(f"truncated snapshot: queue {queue!r} is cut short")
    (n,) = _U32.unpack_from(data, off)
    off += 4
    if off + n * _REFUSER.size > len(data):
        raise RemoteProtocolError(f"truncated snapshot: queue {queue!r} is cut short")
    refused = tuple(_REFUSER.unpack_from(data, off + i * _REFUSER.size) for i in range(n))
    return count, annotations, refused, off + n * _REFUSER.size


def digest(state: SiteState) -> str:
    """sha256 (hex) of the snapshot: equal digests mean equal states."""
    return hashlib.sha256(snapshot(state)).hexdigest()


# --------------------------------------------------------------------------
# Reading (untrusted: a snapshot comes from another member over the bus)
# --------------------------------------------------------------------------


class _Reader:
    __slots__ = ("data", "off")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.off = 0

    def unpack(self, st: struct.Struct) -> tuple[Any, ...]:
        values = st.unpack_from(self.data, self.off)
        self.off += st.size
        return values

    def u8(self) -> int:
        v = self.data[self.off]
        self.off += 1
        return v

    def flag(self, what: str) -> bool:
        v = self.u8()
        if v > 1:
            raise RemoteProtocolError(f"snapshot {what} flag is {v}, not 0 or 1")
        return v == 1

    def u16(self) -> int:
        (v,) = _U16.unpack_from(self.data, self.off)
        self.off += 2
        return int(v)

    def u32(self) -> int:
        (v,) = _U32.unpack_from(self.data, self.off)
        self.off += 4
        return int(v)

    def u64(self) -> int:
        (v,) = _U64.unpack_from(self.data, self.off)
        self.off += 8
        return int(v)

    def raw(self, n: int) -> bytes:
        end = self.off + n
        if end > len(self.data):
            raise RemoteProtocolError(
                f"truncated snapshot: {n} bytes wanted at offset {self.off}, "
                f"{len(self.data) - self.off} left"
            )
        v = self.data[self.off : end]
        self.off = end
        return v

    def str16(self) -> str:
        return self.raw(self.u16()).decode("utf-8")

    def bytes32(self) -> bytes:
        return self.raw(self.u32())

    def map(self) -> dict[str, Value]:
        values, self.off = unpack_value_map_untrusted(self.data, self.off)
        return values


def _restore_waiting(r: _Reader, st: SiteState) -> None:
    for _ in range(r.u32()):
        name = r.str16()
        session, consumer, count = r.unpack(_WAITING)
        q = st.queues.get(name)
        if q is None or session not in st.sessions or count < 1 or (session, consumer) in q.waiting:
            raise RemoteProtocolError(
                f"snapshot: consumer {consumer} of session {session:#x} waits for {count} "
                f"messages of {name!r}, which the snapshot does not allow"
            )
        q.waiting[(session, consumer)] = count
        st.demand[name] = None


class ElidedBodyMismatch(RemoteProtocolError):
    """A delta transfer's elided body is not what the joiner's journal holds
    at that queue and position (or it holds nothing there): the joiner asks
    for a full transfer."""


def restore_untrusted(
    data: bytes | bytearray | memoryview, *, bodies: SiteState | None = None
) -> SiteState:
    """The state a snapshot encodes.  Fails only with
    :class:`RemoteProtocolError` (bad magic or version, truncation, trailing
    bytes, inconsistent contents).  An elided body (a delta transfer) is
    taken from ``bodies`` (the joiner's recovered state) by queue and
    position, and must have the announced length and CRC32; else
    :class:`ElidedBodyMismatch`."""
    try:
        return _restore(_Reader(bytes(data)), bodies)
    except RemoteProtocolError:
        raise
    except (struct.error, IndexError, UnicodeDecodeError, ValueError, KeyError) as exc:
        raise RemoteProtocolError(f"truncated or malformed snapshot: {exc}") from exc


restore: Callable[..., SiteState] = restore_untrusted


def _filled(bodies: SiteState | None, queue: str, pos: int, length: int, crc: int) -> bytes:
    """The body of ``queue``'s message ``pos`` in ``bodies``, if it is the one
    the donor elided."""
    q = None if bodies is None else bodies.queues.get(queue)
    m = None if q is None else q.messages.get(pos)
    if m is None or len(m.body) != length or zlib.crc32(m.body) != crc:
        raise ElidedBodyMismatch(
            f"delta transfer: queue {queue!r} position {pos}: this member's journal "
            f"{'holds no such message' if m is None else 'holds another body'}; "
            "asking the donor for a full transfer"
        )
    return bytes(m.body)


def _restore(r: _Reader, bodies: SiteState | None) -> SiteState:
    magic, version, reserved = r.unpack(_HEAD)
    if magic != MAGIC:
        raise RemoteProtocolError(f"not a drgate state snapshot (magic {magic!r})")
    if version not in _READABLE_VERSIONS:
        raise RemoteProtocolError(
            f"snapshot version {version} is not supported (this member reads "
            f"{', '.join(map(str, _READABLE_VERSIONS))}); run the same drgate release on "
            "every member of a site"
        )
    if reserved:
        raise RemoteProtocolError(f"snapshot reserved field is {reserved:#x}, not 0")
    known_flags = {2: _KNOWN_FLAGS_V2, 3: _KNOWN_FLAGS_V3}.get(version, _KNOWN_FLAGS)
    st = SiteState()
    st.cluster = r.str16()
    st.incarnation = r.u64()
    st.cseq = r.u64()
    st.rules_cseq = r.u64()
    st.rules = r.bytes32()
    counters = dict.fromkeys(COUNTERS, 0)
    for _ in range(r.u16()):
        name = r.str16()
        if name not in COUNTERS:
            raise RemoteProtocolError(f"snapshot has unknown counter {name!r}")
        counters[name] = r.u64()
    st.counters = counters
    for _ in range(r.u32()):
        node, pid, role = r.unpack(_READY)
        st.ready[(node, pid)] = Role(role)
    for _ in range(r.u32()):
        name = r.str16()
        st.watermarks[name] = (r.u64(), r.u64(), r.u64())
    for _ in range(r.u32()):
        o = Origin(r.str16())
        (
            o.incarnation,
            o.epoch,
            promoted,
            o.promoted_time_us,
            o.last_time_us,
            o.last_cseq,
            o.refused_incarnation,
            n,
        ) = r.unpack(struct.Struct(">QIBQQQQI"))
        if promoted > 1:
            raise RemoteProtocolError(f"snapshot origin {o.name!r}: promoted flag is {promoted}")
        o.promoted = promoted == 1
        for _ in range(n):
            inc = r.u64()
            o.applied[inc] = r.u64()
        st.origins[o.name] = o
    for _ in range(r.u32()):
        origin_name = r.str16()
        st.reported[(origin_name, r.str16())] = None
    for _ in range(r.u32()):
        name = r.str16()
        type_ = ExchangeType(r.u8())
        predeclared = r.flag("predeclared")
        replica_origin = r.str16()
        ex = Exchange(name, type_, r.map(), predeclared=predeclared, replica_origin=replica_origin)
        for _ in range(r.u32()):
            queue = r.str16()
            key = r.str16()
            ex.bindings[(queue, key)] = r.map()
        st.exchanges[name] = ex
    data = r.data
    for _ in range(r.u32()):
        name = r.str16()
        args = r.map()
        next_pos = r.u64()
        replica = None
        if r.flag("replica"):
            origin_name = r.str16()
            replica = Replica(origin_name, Mode(r.u8()), r.u64())
        q = Queue(name, args, replica)
        messages = q.messages
        total = 0
        last = 0
        size = len(data)
        unpack_msg = _MSG.unpack_from
        unpack_u32 = _U32.unpack_from
        unpack_map = unpack_value_map_untrusted
        count = r.u32()
        off = r.off
        # The hot loop of a restore: slices, one bound check per message.
        for _ in range(count):
            pos, origin_pos, flags, mid_len = unpack_msg(data, off)
            off += _MSG.size
            if flags & ~known_flags:
                raise RemoteProtocolError(f"snapshot queue {name!r}: message flags {flags:#x}")
            mid = data[off : off + mid_len].decode("utf-8")
            off += mid_len
            props = None
            if flags & _HAS_PROPERTIES:
                props, off = unpack_map(data, off)
            count = flags & _REDELIVERED
            annotations = b""
            refused: tuple[tuple[int, int], ...] = ()
            if flags & _BROKER_STATE:
                count, annotations, refused, off = _broker_state(data, off, name)
            if flags & _ELIDED:
                body_len, crc = _ELIDED_BODY.unpack_from(data, off)
                off += _ELIDED_BODY.size
                body = _filled(bodies, name, pos, body_len, crc)
            else:
                (body_len,) = unpack_u32(data, off)
                off += 4
                body = data[off : off + body_len]
                off += body_len
            if off > size:
                raise RemoteProtocolError(f"truncated snapshot: queue {name!r} is cut short")
            if pos <= last:
                raise RemoteProtocolError(f"snapshot queue {name!r}: positions out of order")
            last = pos
            messages[pos] = Message(pos, body, mid, props, count, origin_pos, annotations, refused)
            total += body_len
        r.off = off
        if next_pos <= last:
            raise RemoteProtocolError(f"snapshot queue {name!r}: next_pos {next_pos} <= {last}")
        q.next_pos = next_pos
        q.bytes = total
        st.queues[name] = q
    for _ in range(r.u32()):
        s = Session(r.u64())
        for _ in range(r.u32()):
            qname = r.str16()
            q = st.queues[qname]
            held: dict[int, int] = {}
            for _ in range(r.u32()):
                pos, consumer = r.unpack(_HELD)
                if pos not in q.messages or pos in q.acquired:
                    raise RemoteProtocolError(
                        f"snapshot session {s.id:#x} holds pos {pos} of {qname!r} inconsistently"
                    )
                q.acquired[pos] = (s.id, consumer)
                held[pos] = consumer
            s.acquired[qname] = held
        st.sessions[s.id] = s
    for _ in range(r.u32()):
        origin_name = r.str16()
        incarnation, cut, epoch, pieces = r.unpack(_STAGED)
        staged = StagedResync(incarnation, cut, epoch)
        if not stage_records(st, staged, r.bytes32()):
            raise RemoteProtocolError(f"snapshot: the resync staged from {origin_name} is corrupt")
        staged.pieces = pieces
        st.staged[origin_name] = staged
    st.epoch = r.u32()
    st.superseded_by = r.str16()
    st.superseded_time_us = r.u64()
    st.guarded = {r.str16(): None for _ in range(r.u32())}
    st.durable_cseq = r.u64()
    st.recovery_expect = r.u32()
    if r.flag("the recovery winner flag"):
        st.recovery_winner = (r.u32(), r.u32())
    for _ in range(r.u32()):
        node, pid, cseq, incarnation, proposal = r.unpack(_CANDIDATE)
        st.candidates[node] = (pid, cseq, incarnation, proposal)
    if version >= 3:
        for count in range(1, r.u32() + 1):
            cseq = r.u64()
            st.recoveries.append(Recovery(count, cseq, r.flag("the recovery's dropped")))
    if version >= 5:
        st.switchover_to = r.str16()
        st.switchover_time_us = r.u64()
        st.handovers = {r.str16(): None for _ in range(r.u32())}
    if version >= 6:
        st.failback_cseq = r.u64()
    if version >= 7:
        st.failback_queues = {r.str16(): None for _ in range(r.u32())}
    elif st.failback_cseq:
        st.failback_queues = dict(st.guarded)  # version 6 waited on the guarded queues
    if version >= 8:
        st.handover_cseq = r.u64()
        st.swapped = r.flag("the roles swapped")
        st.handed_to = r.str16()
    if version >= 9:
        st.rejoining = r.str16()
    if version >= 10:
        _restore_waiting(r, st)
    if r.off != len(data):
        raise RemoteProtocolError(f"snapshot has {len(data) - r.off} trailing bytes")
    for q in st.queues.values():
        q.rebuild_available()
    return st
