"""The broker journal's on-disk format: segments, records, checkpoints.

Theory of operation
-------------------
A broker node journals the commands it applied, in stream order, so that a
checkpoint (a state snapshot at a cseq) plus every journaled command after it
rebuilds the node's state (cluster/journal.py keeps the files and the
policy; docs/protocol.md section 4 documents the layout).  This module only
encodes and decodes bytes: no files, no clock.

A *segment* ``journal-<first_cseq:020d>.log`` is a header and records::

    segment  := segment-header record*
    segment-header := magic "DRGJ" | version u16 | reserved u16 (0) | first_cseq u64
    record   := length u32 | crc32c u32 | first_cseq u64 | count u32 | payload[length]

``crc32c`` (Castagnoli) covers ``first_cseq``, ``count`` and the payload, so a
wrong ``length`` moves the payload's bounds and fails the CRC too.  A record
with ``count`` >= 1 holds a bus frame (protocol/cluster.py) of ``count``
commands, the first of which has cseq ``first_cseq``.  A record with
``count`` 0 is a view change that removed members (``members_left`` of the
state machine, which takes no cseq) at the point before cseq
``first_cseq``; its payload is::

    members-left := n u32 | n x (node u32 | pid u32)

A *checkpoint* ``checkpoint-<cseq:020d>.snap`` is::

    checkpoint := magic "DRGC" | version u16 | reserved u16 (0) | cseq u64
                  | length u64 | crc32c u32 | snapshot[length]

``crc32c`` covers ``cseq``, ``length`` and the snapshot (cluster/state/
snapshots.py), whose own ``cseq`` must be ``cseq``.

Every ``*_untrusted`` function fails only with :class:`RemoteProtocolError`
(the bytes come from a disk that may be damaged).  Record damage has a
subclass, :class:`RecordDamage`, with the byte offset and whether the record
could be a torn tail (``cut``: the bytes end inside it), so the caller can
tell a crash artefact from corruption.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import construct as c
from crc32c import crc32c

from protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "CHECKPOINT_HEADER_SIZE",
    "CHECKPOINT_MAGIC",
    "MAX_RECORD_PAYLOAD",
    "RECORD_HEADER_SIZE",
    "SEGMENT_HEADER_SIZE",
    "SEGMENT_MAGIC",
    "VERSION",
    "CheckpointHeader",
    "CheckpointInfo",
    "JournalRecord",
    "MembersLeft",
    "RecordDamage",
    "RecordHeader",
    "SegmentHeader",
    "checkpoint_crc",
    "checkpoint_name",
    "checkpoint_size",
    "decode_checkpoint_untrusted",
    "decode_members_left_untrusted",
    "decode_segment_header_untrusted",
    "encode_checkpoint_header",
    "encode_members_left",
    "encode_record",
    "encode_segment_header",
    "next_record_untrusted",
    "parse_checkpoint_header_untrusted",
    "record_crc",
    "segment_name",
]

SEGMENT_MAGIC: Final = b"DRGJ"
CHECKPOINT_MAGIC: Final = b"DRGC"
VERSION: Final = 1
# A record longer than this is corruption: a record is one bus frame, and the
# bus caps frames far below it (link frames hold 16 MiB messages).
MAX_RECORD_PAYLOAD: Final = 256 << 20
U64_MAX: Final = (1 << 64) - 1
U32_MAX: Final = (1 << 32) - 1

SEGMENT_PREFIX: Final = "journal-"
SEGMENT_SUFFIX: Final = ".log"
CHECKPOINT_PREFIX: Final = "checkpoint-"
CHECKPOINT_SUFFIX: Final = ".snap"


def segment_name(first_cseq: int) -> str:
    """``journal-<first_cseq:020d>.log``: names sort as numbers."""
    return f"{SEGMENT_PREFIX}{first_cseq:020d}{SEGMENT_SUFFIX}"


def checkpoint_name(cseq: int) -> str:
    """``checkpoint-<cseq:020d>.snap``."""
    return f"{CHECKPOINT_PREFIX}{cseq:020d}{CHECKPOINT_SUFFIX}"


# --- segment header -----------------------------------------------------------

# magic "DRGJ" (4) | version u16 | reserved u16 (0) | first_cseq u64
SegmentHeader = c.Struct(
    "magic" / c.Const(SEGMENT_MAGIC),
    "version" / c.Int16ub,
    "reserved" / c.Const(0, c.Int16ub),
    "first_cseq" / c.Int64ub,
).compile()
_SEGMENT_HEADER: Final = struct.Struct(">4sHHQ")
SEGMENT_HEADER_SIZE: Final = _SEGMENT_HEADER.size


def encode_segment_header(first_cseq: int) -> bytes:
    """A new segment's first bytes."""
    if not 1 <= first_cseq <= U64_MAX:
        raise LocalProtocolError(f"segment first cseq {first_cseq} is out of range")
    return bytes(SegmentHeader.build({"version": VERSION, "first_cseq": first_cseq}))


def decode_segment_header_untrusted(data: bytes | memoryview) -> int:
    """The ``first_cseq`` of a segment that starts with ``data``.

    Raises :class:`RemoteProtocolError` for a short header, another magic or
    version, or a reserved field that is not zero.
    """
    if len(data) < SEGMENT_HEADER_SIZE:
        raise RemoteProtocolError(
            f"journal segment header truncated: {len(data)} of {SEGMENT_HEADER_SIZE} bytes"
        )
    magic, version, reserved, first_cseq = _SEGMENT_HEADER.unpack_from(data)
    if magic != SEGMENT_MAGIC:
        raise RemoteProtocolError(f"not a drgate journal segment (magic {bytes(magic)!r})")
    if version != VERSION:
        raise RemoteProtocolError(
            f"journal segment version {version} is not supported (this node reads {VERSION})"
        )
    if reserved:
        raise RemoteProtocolError(f"journal segment reserved field is {reserved:#x}, not 0")
    if first_cseq == 0:
        raise RemoteProtocolError("journal segment first cseq is 0 (cseqs start at 1)")
    return int(first_cseq)


# --- records --------------------------------------------------------------------

# length u32 | crc32c u32 | first_cseq u64 | count u32, then payload[length].
# The construct definition is the declared layout (tests parse with it); the
# hot paths use the equivalent struct.
RecordHeader = c.Struct(
    "length" / c.Int32ub,
    "crc" / c.Int32ub,
    "first_cseq" / c.Int64ub,
    "count" / c.Int32ub,
).compile()
_RECORD_HEADER: Final = struct.Struct(">IIQI")
RECORD_HEADER_SIZE: Final = _RECORD_HEADER.size
_CSEQ_COUNT: Final = struct.Struct(">QI")


def record_crc(first_cseq: int, count: int, payload: bytes | memoryview) -> int:
    """The CRC32C a record carries: over first_cseq u64, count u32 and the payload."""
    return crc32c(payload, crc32c(_CSEQ_COUNT.pack(first_cseq, count)))


def encode_record(first_cseq: int, count: int, payload: bytes) -> bytes:
    """One record's bytes: a frame of ``count`` commands, or (``count`` 0) a
    members-left payload."""
    if len(payload) > MAX_RECORD_PAYLOAD:
        raise LocalProtocolError(
            f"journal record of {len(payload)} bytes is above the limit {MAX_RECORD_PAYLOAD}"
        )
    if not (1 <= first_cseq <= U64_MAX and 0 <= count <= U32_MAX):
        raise LocalProtocolError(f"journal record cseq {first_cseq} or count {count} is wrong")
    crc = record_crc(first_cseq, count, payload)
    return _RECORD_HEADER.pack(len(payload), crc, first_cseq, count) + payload


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One record read back: ``payload`` is a view of the bytes read;
    ``offset`` and ``end`` are its bounds in them."""

    first_cseq: int
    count: int
    payload: memoryview
    offset: int
    end: int


class RecordDamage(RemoteProtocolError):
    """The record at ``offset`` is damaged.  ``cut`` is true when it could be
    a torn tail: the bytes end inside it, or its CRC fails and nothing but
    zero bytes follows its start (a file system that extended the file but
    never wrote the data)."""

    def __init__(self, message: str, *, offset: int, cut: bool) -> None:
        super().__init__(message)
        self.offset = offset
        self.cut = cut


def next_record_untrusted(data: bytes | memoryview, offset: int) -> JournalRecord:
    """The record starting at ``offset`` of ``data``.

    Raises :class:`RecordDamage` (``cut`` true) when ``data`` ends inside it
    or its CRC fails with only zero bytes from ``offset`` or it ends exactly
    at the end of ``data``; (``cut`` false) for an impossible length or a bad
    CRC with more data after it.
    """
    view = memoryview(data)
    end = len(view)
    if end - offset < RECORD_HEADER_SIZE:
        raise RecordDamage(
            f"record header cut short: {end - offset} of {RECORD_HEADER_SIZE} bytes",
            offset=offset,
            cut=True,
        )
    length, crc, first_cseq, count = _RECORD_HEADER.unpack_from(view, offset)
    if length > MAX_RECORD_PAYLOAD:
        raise RecordDamage(f"record length {length} is impossible", offset=offset, cut=False)
    start = offset + RECORD_HEADER_SIZE
    rec_end = start + length
    if rec_end > end:
        raise RecordDamage(
            f"record of {length} bytes cut short: {end - start} present", offset=offset, cut=True
        )
    payload = view[start:rec_end]
    if record_crc(first_cseq, count, payload) != crc:
        cut = rec_end == end or not bytes(view[offset:]).strip(b"\x00")
        raise RecordDamage(
            f"CRC mismatch in the record of cseq {first_cseq}", offset=offset, cut=cut
        )
    if first_cseq == 0:
        raise RecordDamage("record first cseq is 0", offset=offset, cut=False)
    return JournalRecord(first_cseq, count, payload, offset, rec_end)


# --- members-left payload ---------------------------------------------------------

# n u32 | n x (node u32 | pid u32)
MembersLeft = c.PrefixedArray(c.Int32ub, c.Struct("node" / c.Int32ub, "pid" / c.Int32ub))
_U32: Final = struct.Struct(">I")
_MEMBER: Final = struct.Struct(">II")


def encode_members_left(members: Iterable[tuple[int, int]]) -> bytes:
    """The payload of a view-change record: the ``(node, pid)`` that left."""
    pairs = list(members)
    try:
        return _U32.pack(len(pairs)) + b"".join(_MEMBER.pack(n, p) for n, p in pairs)
    except struct.error as exc:
        raise LocalProtocolError(f"cannot journal members {pairs!r}: {exc}") from exc


def decode_members_left_untrusted(payload: bytes | memoryview) -> list[tuple[int, int]]:
    """The ``(node, pid)`` pairs of a view-change record's payload."""
    if len(payload) < _U32.size:
        raise RemoteProtocolError("members-left record shorter than its count")
    (n,) = _U32.unpack_from(payload)
    if len(payload) != _U32.size + n * _MEMBER.size:
        raise RemoteProtocolError(
            f"members-left record of {len(payload)} bytes does not hold {n} members"
        )
    return [
        (int(node), int(pid)) for node, pid in _MEMBER.iter_unpack(memoryview(payload)[_U32.size :])
    ]


# --- checkpoints ---------------------------------------------------------------------

# magic "DRGC" (4) | version u16 | reserved u16 (0) | cseq u64 | length u64 | crc32c u32
CheckpointHeader = c.Struct(
    "magic" / c.Const(CHECKPOINT_MAGIC),
    "version" / c.Int16ub,
    "reserved" / c.Const(0, c.Int16ub),
    "cseq" / c.Int64ub,
    "length" / c.Int64ub,
    "crc" / c.Int32ub,
).compile()
_CHECKPOINT_HEADER: Final = struct.Struct(">4sHHQQI")
CHECKPOINT_HEADER_SIZE: Final = _CHECKPOINT_HEADER.size
_CSEQ_LENGTH: Final = struct.Struct(">QQ")


def checkpoint_crc(cseq: int, snapshot: bytes | memoryview, crc: int = 0) -> int:
    """The CRC32C of a checkpoint: over cseq u64, length u64 and the snapshot."""
    return crc32c(snapshot, crc32c(_CSEQ_LENGTH.pack(cseq, len(snapshot)), crc))


def encode_checkpoint_header(cseq: int, snapshot: bytes | memoryview) -> bytes:
    """The header that goes before ``snapshot`` in a checkpoint file."""
    if not 0 <= cseq <= U64_MAX:
        raise LocalProtocolError(f"checkpoint cseq {cseq} is out of range")
    return _CHECKPOINT_HEADER.pack(
        CHECKPOINT_MAGIC, VERSION, 0, cseq, len(snapshot), checkpoint_crc(cseq, snapshot)
    )


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A checkpoint header's fields."""

    cseq: int
    length: int
    crc: int


def parse_checkpoint_header_untrusted(data: bytes | memoryview) -> CheckpointInfo:
    """The fields of a checkpoint header (the first bytes of ``data``)."""
    if len(data) < CHECKPOINT_HEADER_SIZE:
        raise RemoteProtocolError(
            f"checkpoint header truncated: {len(data)} of {CHECKPOINT_HEADER_SIZE} bytes"
        )
    magic, version, reserved, cseq, length, crc = _CHECKPOINT_HEADER.unpack_from(data)
    if magic != CHECKPOINT_MAGIC:
        raise RemoteProtocolError(f"not a drgate journal checkpoint (magic {bytes(magic)!r})")
    if version != VERSION:
        raise RemoteProtocolError(
            f"checkpoint version {version} is not supported (this node reads {VERSION})"
        )
    if reserved:
        raise RemoteProtocolError(f"checkpoint reserved field is {reserved:#x}, not 0")
    return CheckpointInfo(int(cseq), int(length), int(crc))


def checkpoint_size(info: CheckpointInfo) -> int:
    """The bytes of the whole checkpoint file ``info`` describes."""
    return CHECKPOINT_HEADER_SIZE + info.length


def decode_checkpoint_untrusted(data: bytes | memoryview) -> tuple[int, memoryview]:
    """``(cseq, snapshot bytes)`` of a whole checkpoint file.

    Raises :class:`RemoteProtocolError` for a bad header, a length that does
    not match the bytes present, or a CRC mismatch.  The snapshot itself is
    decoded by ``cluster.state.restore_untrusted``.
    """
    info = parse_checkpoint_header_untrusted(data)
    view = memoryview(data)
    if len(view) != checkpoint_size(info):
        raise RemoteProtocolError(
            f"checkpoint of cseq {info.cseq} says {info.length} snapshot bytes, "
            f"{len(view) - CHECKPOINT_HEADER_SIZE} present"
        )
    snapshot = view[CHECKPOINT_HEADER_SIZE:]
    if checkpoint_crc(info.cseq, snapshot) != info.crc:
        raise RemoteProtocolError(f"CRC mismatch in the checkpoint of cseq {info.cseq}")
    return info.cseq, snapshot
