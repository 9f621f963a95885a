"""The bus commands of durable brokers: a node's journal watermark
(``Durable``), a whole-site recovery (``Recovering``, ``RecoveryChunk``,
``ForceRecovery``) and what a joiner's journal holds (``JoinHave``); see
docs/broker.md "Durability" and docs/protocol.md.  Declared like every other
command (protocol/commandcodec.py) and re-exported by :mod:`protocol.cluster`,
where the ``Command`` union and the frame codec are."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from construct import Flag, Int32ub, Int64ub

from protocol.commandcodec import Body, Kind, _command, _CommandBase
from protocol.errors import RemoteProtocolError


# key=""  meta: node u32 | cseq u64
@_command(Kind.DURABLE, meta=[("node", Int32ub), ("cseq", Int64ub)])
@dataclass(frozen=True, slots=True)
class Durable(_CommandBase):
    """Broker ``node`` has every command up to ``cseq`` in its journal on disk:
    the site's durable watermark is the highest any broker reported, and the
    egress forwards nothing above it (what D holds, P can always recover)."""

    node: int
    cseq: int


# key=cluster  meta: node u32 | pid u32 | expect u32 | cseq u64 | incarnation u64 | proposal u64
@_command(
    Kind.RECOVERING,
    key="cluster",
    meta=[
        ("node", Int32ub),
        ("pid", Int32ub),
        ("expect", Int32ub),
        ("cseq", Int64ub),
        ("incarnation", Int64ub),
        ("proposal", Int64ub),
    ],
)
@dataclass(frozen=True, slots=True)
class Recovering(_CommandBase):
    """A broker of a site that starts with no member alive: what its journal
    recovered (``cseq`` 0: nothing), the number of brokers the site waits for,
    and a fresh incarnation to use should no broker recover anything."""

    cluster: str
    node: int
    pid: int
    expect: int
    cseq: int
    incarnation: int
    proposal: int


# key=""  meta: index u32 | final u8
@_command(Kind.RECOVERY_CHUNK, meta=[("index", Int32ub), ("final", Flag)], tail="data")
@dataclass(frozen=True, slots=True)
class RecoveryChunk(_CommandBase):
    """A piece of the recovered state of the broker the recovery chose; at the
    final one every member of the site takes that state, at that point of the
    stream."""

    index: int
    final: bool
    data: Body = b""


# key=cluster  meta: time_us u64
@_command(Kind.FORCE_RECOVERY, key="cluster", meta=[("time_us", Int64ub)])
@dataclass(frozen=True, slots=True)
class ForceRecovery(_CommandBase):
    """An operator's ``drgate recover --force``: a site waiting for its
    brokers' ``Recovering`` reports stops waiting and continues from the most
    advanced of those that reported (the others are gone for good)."""

    cluster: str
    time_us: int


# key=""  meta: node u32 | pid u32 | incarnation u64 | cseq u64
#         tail: ranges (u32 n | n x (queue str16 | first u64 | last u64))
@_command(
    Kind.JOIN_HAVE,
    meta=[("node", Int32ub), ("pid", Int32ub), ("incarnation", Int64ub), ("cseq", Int64ub)],
    tail="ranges",
)
@dataclass(frozen=True, slots=True)
class JoinHave(_CommandBase):
    """A member that joined a live site says what its journal holds, so the
    donor's snapshot can leave out the bodies it has (cluster/membership.py):
    the incarnation and cseq it recovered and, in ``ranges``
    (:func:`pack_have_ranges`), per queue the first and last position of the
    persistent messages it holds.  Incarnation 0 and no ranges: nothing (no
    journal, a sidecar, an admin tool, or a retry after a failed fill)."""

    node: int
    pid: int
    incarnation: int = 0
    cseq: int = 0
    ranges: Body = b""


#   queue length u16 (the name follows) / first u64 | last u64
_HAVE_COUNT = struct.Struct(">I")
_HAVE_NAME = struct.Struct(">H")
_HAVE_RANGE = struct.Struct(">QQ")


def pack_have_ranges(ranges: dict[str, tuple[int, int]]) -> bytes:
    """``JoinHave.ranges`` for ``{queue: (first, last)}``, in the dict's order."""
    out = [_HAVE_COUNT.pack(len(ranges))]
    for queue, (first, last) in ranges.items():
        raw = queue.encode("utf-8")
        out.append(_HAVE_NAME.pack(len(raw)) + raw + _HAVE_RANGE.pack(first, last))
    return b"".join(out)


def have_ranges_untrusted(data: Body) -> dict[str, tuple[int, int]]:
    """``{queue: (first, last)}`` of ``JoinHave.ranges`` (empty bytes: none).
    Fails only with :class:`RemoteProtocolError`."""
    raw = bytes(data)
    if not raw:
        return {}
    try:
        (count,) = _HAVE_COUNT.unpack_from(raw, 0)
        off = _HAVE_COUNT.size
        ranges: dict[str, tuple[int, int]] = {}
        for _ in range(count):
            (n,) = _HAVE_NAME.unpack_from(raw, off)
            off += _HAVE_NAME.size
            if off + n > len(raw):
                raise RemoteProtocolError("JOIN_HAVE ranges: a queue name runs past the end")
            queue = raw[off : off + n].decode("utf-8")
            first, last = _HAVE_RANGE.unpack_from(raw, off + n)
            off += n + _HAVE_RANGE.size
            if first > last:
                raise RemoteProtocolError(f"JOIN_HAVE ranges: queue {queue!r} first > last")
            ranges[queue] = (first, last)
    except (struct.error, UnicodeDecodeError) as exc:
        raise RemoteProtocolError(f"JOIN_HAVE ranges are malformed: {exc}") from exc
    if off != len(raw):
        raise RemoteProtocolError(f"JOIN_HAVE ranges have {len(raw) - off} trailing bytes")
    return ranges
