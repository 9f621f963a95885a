"""WAN link frames: layout, encoding and the untrusted decoders.

Theory of operation
-------------------
Every frame is a 13-byte header followed by a payload::

    0      2         3      4       5              9              13
    +------+---------+------+-------+--------------+--------------+-----------
    | "DG" | version | type | flags | length (u32) | crc32c (u32) | payload...
    +------+---------+------+-------+--------------+--------------+-----------

All integers are big-endian.  ``version`` is the link's *major* version
(``LINK_VERSION``); a frame of another major version is refused.  ``length`` is
the payload length and is checked against the configured maximum frame size
*before* the payload is buffered.  ``crc32c`` (Castagnoli) covers the first 9
header bytes (magic to length) and then the payload, so a flipped type or
flags bit is caught as well as a damaged payload.  ``flags`` bit 0
(``COMPRESSED``) may be set only on BATCH and RESYNC_CHUNK frames, and only
when their codec field is not ``NONE``; every other bit is reserved and must be
zero.

Each payload format is declared once below as a compiled construct ``Struct``
with its byte layout drawn above it.  Parsed construct containers never leave
this module (their ``_io`` keys stay here): decoders turn them into the frozen
dataclasses below, check enum values explicitly (construct lets unknown values
through as ints) and end every payload with ``Terminated`` so trailing bytes
are refused; they parse with :func:`protocol.exactparse.parse_exact`, so a
string whose length claims more bytes than are left is refused too.  CRCs
are computed beside the structs (``Checksum`` and ``RawCopy`` do not compile).

Functions that decode bytes from the network are named ``*_untrusted`` and
raise only :class:`protocol.errors.RemoteProtocolError`, whose ``code`` is a
:class:`LinkErrorCode`.  Encoders raise :class:`LocalProtocolError` when asked
to encode something the format cannot carry.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import crc32c
import zstandard
from construct import (
    Bytes,
    ConstructError,
    GreedyBytes,
    Int8ub,
    Int16ub,
    Int32ub,
    Int64ub,
    PascalString,
    Prefixed,
    Struct,
    Terminated,
)

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.exactparse import parse_exact
from protocol.link.events import LinkEvent

LINK_MAGIC: Final = b"DG"
# Major version of the link protocol, carried in every frame header.  Peers of
# different major versions cannot talk; minor versions (announced in HELLO and
# WELCOME) only add things a peer uses when both sides announce them.
LINK_VERSION: Final = 1
# Minor 1: every event of a BATCH carries ``prev_seq`` (continuity).
LINK_MINOR: Final = 3
# Minor 2: PING may carry P's time and last seq (the heartbeat of D's recovery
# point), and the PARTITIONED error code; both sent only to a minor-2 peer.
HEARTBEAT_MINOR: Final = 2
# Minor 3: WELCOME may end with the receiver's holdings (protocol/holdings.py:
# a failback by delta); sent only to a minor-3 sender.
HOLDINGS_MINOR: Final = 3
# The oldest minor version this end talks to.  Minor 1 changed the events
# block, which a minor-0 peer would misread; since both ends ship in the same
# release, a minor-0 peer is refused at the handshake (both ends check, so an
# old peer never sees a new BATCH nor sends an old one) rather than served in
# the old layout.
LINK_MINOR_OLDEST: Final = 1

HEADER_SIZE: Final = 13
# 17 MiB: room for one message of the broker's largest size (16 MiB, its
# max-message-size) with its headers, in an event or a resync chunk; far above
# a batch of a few hundred small messages (the usual frame), and small enough
# that one hostile length field cannot make us buffer gigabytes.
DEFAULT_MAX_FRAME_BYTES: Final = 17 * 1024 * 1024

U32_MAX: Final = 2**32 - 1
U64_MAX: Final = 2**64 - 1


class FrameType(enum.IntEnum):
    """Frame type byte.  Wire values: never renumber."""

    HELLO = 1
    WELCOME = 2
    BATCH = 3
    ACK = 4
    PING = 5
    PONG = 6
    RESYNC_BEGIN = 7
    RESYNC_CHUNK = 8
    RESYNC_END = 9
    ERROR = 10


class Codec(enum.IntEnum):
    """Compression of a BATCH events block or a RESYNC_CHUNK's data.  Wire values."""

    NONE = 0
    ZSTD = 1


class LinkErrorCode(enum.IntEnum):
    """Codes carried by ERROR frames and by ``ProtocolError.code`` for link errors.

    1-19: the bytes or the sequence of frames were wrong (a peer bug or
    corruption) or, for ``GAP``, the stream lost events before the link;
    20-39: the handshake was refused for a reason the operator must look at
    or that passes with time.  Wire values: never renumber.
    Unknown codes received from a newer peer are passed up as plain ints.
    """

    BAD_MAGIC = 1
    UNSUPPORTED_VERSION = 2
    BAD_CRC = 3
    TRUNCATED = 4
    OVERSIZE = 5
    UNKNOWN_TYPE = 6
    BAD_FLAGS = 7
    MALFORMED = 8
    BAD_COMPRESSION = 9
    OUT_OF_ORDER = 10
    WRONG_EPOCH = 11
    UNEXPECTED_FRAME = 12
    WINDOW_EXCEEDED = 13
    HEARTBEAT_TIMEOUT = 14
    GAP = 15
    """An event's ``prev_seq`` is above everything the receiver holds: events
    were lost before the link; the sender must resync (retriable)."""
    FORBIDDEN = 16
    """An event the receiver does not admit: not one ``Replicated`` command of
    the accepted origin, incarnation and epoch at the event's own position."""
    STALE_EPOCH = 20
    WRONG_CLUSTER = 21
    NOT_ACTIVE = 22
    INCARNATION_CHANGED = 23
    SHUTTING_DOWN = 24
    PEER_NOT_PINNED = 25
    """The peer's TLS certificate, though signed by the CA, names none of the
    names this side pins (``tls.peer_names``): not retriable, an operator
    must fix a certificate or the pinned names."""
    PARTITIONED = 26
    """Split brain: the receiver's site was promoted over the sender's, which
    still runs as a primary.  Not retriable: both park until an operator
    decides which site stays primary (sent to a sender of minor 2 or later;
    an older one gets ``STALE_EPOCH``)."""
    NOT_DURABLE = 27
    """The receiver applied events of the sender's stream that its brokers
    have not journaled yet (a stopped broker, a slow disk): a WELCOME would
    let the sender drop them from its spool, and a power cut at the
    receiver would lose them.  Retriable (an older sender sees the number)."""
    INTERNAL = 39


_KNOWN_CODES: Final = frozenset(int(c) for c in LinkErrorCode)

FLAG_COMPRESSED: Final = 0x01
KNOWN_FLAGS: Final = FLAG_COMPRESSED
# Codec bit mask offered in HELLO: bit (1 << codec) set when the sender can emit it.
CODECS_ALL: Final = (1 << Codec.NONE) | (1 << Codec.ZSTD)


def remote_error(
    code: LinkErrorCode, message: str, *, retriable: bool = False
) -> RemoteProtocolError:
    """A ``RemoteProtocolError`` carrying a link error code."""
    return RemoteProtocolError(f"{message} [{code.name}]", code=int(code), retriable=retriable)


def check_minor_untrusted(minor: int, peer: str) -> None:
    """Refuse a peer whose announced minor version is older than this end can
    talk to (``UNSUPPORTED_VERSION``, naming both versions).  ``peer`` says
    which end it is, for the message."""
    if minor < LINK_MINOR_OLDEST:
        raise remote_error(
            LinkErrorCode.UNSUPPORTED_VERSION,
            f"the {peer} speaks link version {LINK_VERSION}.{minor}, this end speaks "
            f"{LINK_VERSION}.{LINK_MINOR} and needs {LINK_VERSION}.{LINK_MINOR_OLDEST} or later "
            "(BATCH events carry prev_seq since 1.1): run the same drgate release at both sites",
        )


# ---------------------------------------------------------------------------
# Construct definitions (one per format, compiled once)
# ---------------------------------------------------------------------------

# Frame header, 13 bytes:
# 0       2        3     4      5           9          13
# | magic | version| type| flags| length u32| crc32c u32|
HEADER = Struct(
    "magic" / Bytes(2),
    "version" / Int8ub,
    "type" / Int8ub,
    "flags" / Int8ub,
    "length" / Int32ub,
    "crc" / Int32ub,
).compile()
# The same header for the hot path (parsing only what it needs); a test checks
# that both agree byte for byte.
_HEADER_STRUCT: Final = struct.Struct(">2sBBBII")

# HELLO (sender -> receiver, first frame of a connection):
# 0      1        2        3            3+o      4+o          4+o+t
# | minor| codecs | o_len  | origin utf8 | t_len | target utf8 |
# then: incarnation u64 | epoch u32 | resume_point u64 | window_bytes u32
HELLO = Struct(
    "minor" / Int8ub,
    "codecs" / Int8ub,
    "origin_cluster" / PascalString(Int8ub, "utf8"),
    "target_cluster" / PascalString(Int8ub, "utf8"),
    "incarnation" / Int64ub,
    "epoch" / Int32ub,
    "resume_point" / Int64ub,
    "window_bytes" / Int32ub,
    Terminated,
).compile()

# WELCOME (receiver -> sender, answer to HELLO):
# 0      1       2       3            3+o      4+o          4+o+t
# | minor| codec | o_len | origin utf8 | t_len | target utf8 |
# then: incarnation u64 | epoch u32 | resume_from u64 | window_bytes u32
#       | holdings (minor 3, to a minor-3 sender; empty: none)
WELCOME = Struct(
    "minor" / Int8ub,
    "codec" / Int8ub,
    "origin_cluster" / PascalString(Int8ub, "utf8"),
    "target_cluster" / PascalString(Int8ub, "utf8"),
    "incarnation" / Int64ub,
    "epoch" / Int32ub,
    "resume_from" / Int64ub,
    "window_bytes" / Int32ub,
    "holdings" / GreedyBytes,
).compile()

# BATCH (sender -> receiver):
# 0          4              12            20         24      25             29
# | epoch u32| first_seq u64| last_seq u64| count u32| codec | raw_length u32| block...
# ``block`` is the events block, compressed with ``codec``; ``raw_length`` is
# its length once decompressed (bounds decompression).
BATCH = Struct(
    "epoch" / Int32ub,
    "first_seq" / Int64ub,
    "last_seq" / Int64ub,
    "count" / Int32ub,
    "codec" / Int8ub,
    "raw_length" / Int32ub,
    "block" / GreedyBytes,
).compile()
_BATCH_HEAD: Final = struct.Struct(">IQQIBI")

# One event in an (uncompressed) events block, repeated ``count`` times
# (since minor version 1; minor 0 had no prev_seq):
# 0        8             16           24          28
# | seq u64| prev_seq u64| time_us u64| length u32| payload (length bytes)
# ``prev_seq``: the seq of the previous forwarded event of the incarnation (0:
# none), below ``seq``; the receiver refuses an event whose prev_seq it does
# not hold (GAP).
EVENT = Struct(
    "seq" / Int64ub,
    "prev_seq" / Int64ub,
    "time_us" / Int64ub,
    "payload" / Prefixed(Int32ub, GreedyBytes),
).compile()
# The hot path walks the block with this; a test checks it agrees with EVENT.
_EVENT_HEAD: Final = struct.Struct(">QQQI")
EVENT_OVERHEAD: Final = _EVENT_HEAD.size

# ACK (receiver -> sender):
# 0        8
# | seq u64| resync_chunks u32
# ``seq``: every event at or below it is applied at the receiver's site.
# ``resync_chunks``: number of chunks of the current resync applied (0 outside one).
ACK = Struct("seq" / Int64ub, "resync_chunks" / Int32ub, Terminated).compile()

# PING (sender -> receiver) and PONG (the echo):
# 0
# | timestamp_us u64   (the pinger's own clock; echoed unchanged)
PING = Struct("timestamp_us" / Int64ub, Terminated).compile()
PONG = PING
# PING with the origin's position (minor 2, to a receiver that announced it):
# 0                  8                    16
# | timestamp_us u64 | origin_time_us u64 | origin_last_seq u64
# ``origin_time_us``: P's wall clock (µs since the Unix epoch) when it was made;
# ``origin_last_seq``: the seq of P's last spooled event then.
PING_HEARTBEAT = Struct(
    "timestamp_us" / Int64ub, "origin_time_us" / Int64ub, "origin_last_seq" / Int64ub, Terminated
).compile()
PING_HEARTBEAT_SIZE: Final = 24

# RESYNC_BEGIN (sender -> receiver):
# 0          4            12               16              24      26
# | epoch u32| cut_seq u64| total_chunks u32| total_bytes u64| s_len u16| scope utf8
# ``scope``: "" for the whole site, else the one queue being resynced.
RESYNC_BEGIN = Struct(
    "epoch" / Int32ub,
    "cut_seq" / Int64ub,
    "total_chunks" / Int32ub,
    "total_bytes" / Int64ub,
    "scope" / PascalString(Int16ub, "utf8"),
    Terminated,
).compile()

# RESYNC_CHUNK (sender -> receiver):
# 0          4      5              9
# | index u32| codec| raw_length u32| data (compressed with codec)
RESYNC_CHUNK = Struct(
    "index" / Int32ub,
    "codec" / Int8ub,
    "raw_length" / Int32ub,
    "data" / GreedyBytes,
).compile()

# RESYNC_END (sender -> receiver):
# 0            8               12
# | cut_seq u64| total_chunks u32| total_bytes u64
RESYNC_END = Struct(
    "cut_seq" / Int64ub,
    "total_chunks" / Int32ub,
    "total_bytes" / Int64ub,
    Terminated,
).compile()

# ERROR (either direction; the sender of it closes the connection after it):
# 0         2              3
# | code u16| retriable u8 | t_len u16| text utf8
ERROR = Struct(
    "code" / Int16ub,
    "retriable" / Int8ub,
    "text" / PascalString(Int16ub, "utf8"),
    Terminated,
).compile()


# ---------------------------------------------------------------------------
# Frames as data
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """First frame of a connection, from the sender (site P's egress)."""

    origin_cluster: str
    target_cluster: str
    incarnation: int
    epoch: int
    resume_point: int
    """The sender can replay every event with a seq above this (its spool floor)."""
    window_bytes: int
    """Window of unacked event bytes the sender proposes."""
    codecs: int = CODECS_ALL
    """Bit mask of codecs the sender can emit (bit ``1 << Codec``)."""
    minor: int = LINK_MINOR


@dataclass(frozen=True, slots=True)
class Welcome:
    """Answer to HELLO: the receiver accepts the stream."""

    origin_cluster: str
    target_cluster: str
    incarnation: int
    epoch: int
    resume_from: int
    """Every event at or below this seq is applied; send only seq > resume_from."""
    window_bytes: int
    codec: Codec = Codec.ZSTD
    minor: int = LINK_MINOR
    holdings: bytes = b""
    """What the receiver holds (protocol/holdings.py), when it rejoins as the
    sender's DR site after a forced failover; empty otherwise."""


@dataclass(frozen=True, slots=True)
class Batch:
    """A run of events, strictly increasing in seq."""

    epoch: int
    events: tuple[LinkEvent, ...]
    codec: Codec = Codec.NONE

    @property
    def first_seq(self) -> int:
        return self.events[0].seq

    @property
    def last_seq(self) -> int:
        return self.events[-1].seq


@dataclass(frozen=True, slots=True)
class Ack:
    seq: int
    resync_chunks: int = 0


@dataclass(frozen=True, slots=True)
class Ping:
    """``origin_time_us`` and ``origin_last_seq`` both set make a minor-2
    heartbeat PING (24 bytes); both None, the 8-byte PING."""

    timestamp_us: int
    origin_time_us: int | None = None
    origin_last_seq: int | None = None


@dataclass(frozen=True, slots=True)
class Pong:
    timestamp_us: int


@dataclass(frozen=True, slots=True)
class ResyncBegin:
    epoch: int
    cut_seq: int
    total_chunks: int
    total_bytes: int
    scope: str = ""


def is_streamed(begin: ResyncBegin) -> bool:
    """A RESYNC_BEGIN of 0 chunks and 0 bytes announces a streamed resync:
    chunks are made as they are sent, and RESYNC_END carries the totals."""
    return begin.total_chunks == 0 and begin.total_bytes == 0


@dataclass(frozen=True, slots=True)
class ResyncChunk:
    index: int
    data: bytes
    codec: Codec = Codec.NONE


@dataclass(frozen=True, slots=True)
class ResyncEnd:
    cut_seq: int
    total_chunks: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class ErrorFrame:
    code: int
    """A :class:`LinkErrorCode` value, or an int unknown to this version."""
    text: str
    retriable: bool = False


Frame = (
    Hello | Welcome | Batch | Ack | Ping | Pong | ResyncBegin | ResyncChunk | ResyncEnd | ErrorFrame
)

FRAME_TYPES: Final[dict[type, FrameType]] = {
    Hello: FrameType.HELLO,
    Welcome: FrameType.WELCOME,
    Batch: FrameType.BATCH,
    Ack: FrameType.ACK,
    Ping: FrameType.PING,
    Pong: FrameType.PONG,
    ResyncBegin: FrameType.RESYNC_BEGIN,
    ResyncChunk: FrameType.RESYNC_CHUNK,
    ResyncEnd: FrameType.RESYNC_END,
    ErrorFrame: FrameType.ERROR,
}


@dataclass(frozen=True, slots=True)
class FrameHeader:
    version: int
    type: FrameType
    flags: int
    length: int
    crc: int


# ---------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------


def frame_bytes(ftype: FrameType, payload: bytes, flags: int = 0) -> bytes:
    """Header + payload, with the CRC32C over header[0:9] and the payload."""
    head = _HEADER_STRUCT.pack(LINK_MAGIC, LINK_VERSION, ftype, flags, len(payload), 0)[:9]
    crc = crc32c.crc32c(payload, crc32c.crc32c(head))
    return head + crc.to_bytes(4, "big") + payload


def pack_events(events: Sequence[LinkEvent]) -> bytes:
    """The uncompressed events block of a BATCH."""
    pack = _EVENT_HEAD.pack
    parts: list[bytes] = []
    for ev in events:
        parts.append(pack(ev.seq, ev.prev_seq, ev.time_us, len(ev.payload)))
        parts.append(ev.payload)
    return b"".join(parts)


def compress(codec: Codec, raw: bytes, compressor: zstandard.ZstdCompressor | None = None) -> bytes:
    if codec is Codec.NONE:
        return raw
    return (compressor or _default_compressor()).compress(raw)


_COMPRESSOR: list[zstandard.ZstdCompressor] = []


def _default_compressor() -> zstandard.ZstdCompressor:
    # Level 1: the link is usually CPU-bound before it is WAN-bound at these
    # sizes, and level 1 already gets most of the ratio on small messages.
    if not _COMPRESSOR:
        _COMPRESSOR.append(zstandard.ZstdCompressor(level=1))
    return _COMPRESSOR[0]


def batch_frame_bytes(
    epoch: int, events: Sequence[LinkEvent], codec: Codec, raw: bytes, block: bytes
) -> bytes:
    """A BATCH frame from an already packed (and possibly compressed) block."""
    if not events:
        raise LocalProtocolError("a BATCH carries at least one event")
    payload = _BATCH_HEAD.pack(epoch, events[0].seq, events[-1].seq, len(events), codec, len(raw))
    flags = FLAG_COMPRESSED if codec is not Codec.NONE else 0
    return frame_bytes(FrameType.BATCH, payload + block, flags)


def encode_frame(frame: Frame, *, compressor: zstandard.ZstdCompressor | None = None) -> bytes:
    """The bytes of one frame.  Compresses BATCH and RESYNC_CHUNK with their codec.

    Raises LocalProtocolError when a field does not fit the format.
    """
    try:
        return _encode(frame, compressor)
    except LocalProtocolError:
        raise
    except (ConstructError, struct.error, ValueError, OverflowError, UnicodeError) as exc:
        raise LocalProtocolError(f"cannot encode {frame!r:.200}: {exc}") from exc


def _encode(frame: Frame, compressor: zstandard.ZstdCompressor | None) -> bytes:
    match frame:
        case Batch():
            _check_increasing(frame.events)
            raw = pack_events(frame.events)
            block = compress(frame.codec, raw, compressor)
            return batch_frame_bytes(frame.epoch, frame.events, frame.codec, raw, block)
        case ResyncChunk():
            data = compress(frame.codec, frame.data, compressor)
            payload = RESYNC_CHUNK.build(
                {
                    "index": frame.index,
                    "codec": frame.codec,
                    "raw_length": len(frame.data),
                    "data": data,
                }
            )
            flags = FLAG_COMPRESSED if frame.codec is not Codec.NONE else 0
            return frame_bytes(FrameType.RESYNC_CHUNK, payload, flags)
        case Hello():
            payload = HELLO.build(_fields(frame))
        case Welcome():
            payload = WELCOME.build(_fields(frame))
        case Ack():
            payload = ACK.build(_fields(frame))
        case Ping(origin_time_us=None, origin_last_seq=None) | Pong():
            payload = PING.build({"timestamp_us": frame.timestamp_us})
        case Ping():
            if frame.origin_time_us is None or frame.origin_last_seq is None:
                raise LocalProtocolError("a heartbeat PING needs both the origin's time and seq")
            payload = PING_HEARTBEAT.build(_fields(frame))
        case ResyncBegin():
            payload = RESYNC_BEGIN.build(_fields(frame))
        case ResyncEnd():
            payload = RESYNC_END.build(_fields(frame))
        case ErrorFrame():
            payload = ERROR.build(
                {"code": frame.code, "retriable": int(frame.retriable), "text": frame.text}
            )
    return frame_bytes(FRAME_TYPES[type(frame)], payload)


def _fields(frame: Any) -> dict[str, Any]:
    return {name: getattr(frame, name) for name in frame.__slots__}


def _check_increasing(events: Sequence[LinkEvent]) -> None:
    if not events:
        raise LocalProtocolError("a BATCH carries at least one event")
    prev = -1
    for ev in events:
        if ev.seq <= prev:
            raise LocalProtocolError(f"event seq {ev.seq} after {prev}: seqs must increase")
        if not 0 <= ev.prev_seq < ev.seq:
            raise LocalProtocolError(
                f"event seq {ev.seq} names {ev.prev_seq} as its previous forwarded event: "
                "prev_seq must lie below seq"
            )
        prev = ev.seq


# ---------------------------------------------------------------------------
# Decoding (untrusted)
# ---------------------------------------------------------------------------


def decode_header_untrusted(
    data: bytes | bytearray | memoryview, max_frame_bytes: int
) -> FrameHeader:
    """Check and parse a 13-byte frame header.  Refuses an oversize length at once."""
    if len(data) < HEADER_SIZE:
        raise remote_error(LinkErrorCode.TRUNCATED, f"frame header needs 13 bytes, got {len(data)}")
    magic, version, ftype, flags, length, crc = _HEADER_STRUCT.unpack_from(data, 0)
    if magic != LINK_MAGIC:
        raise remote_error(
            LinkErrorCode.BAD_MAGIC, f"bad magic {bytes(magic)!r}, expected {LINK_MAGIC!r}"
        )
    if version != LINK_VERSION:
        raise remote_error(
            LinkErrorCode.UNSUPPORTED_VERSION,
            f"peer speaks link version {version}, this end speaks version {LINK_VERSION}",
        )
    try:
        frame_type = FrameType(ftype)
    except ValueError:
        raise remote_error(LinkErrorCode.UNKNOWN_TYPE, f"unknown frame type {ftype}") from None
    if flags & ~KNOWN_FLAGS:
        raise remote_error(
            LinkErrorCode.BAD_FLAGS, f"unknown flag bits 0x{flags & ~KNOWN_FLAGS:02x}"
        )
    if flags & FLAG_COMPRESSED and frame_type not in (FrameType.BATCH, FrameType.RESYNC_CHUNK):
        raise remote_error(LinkErrorCode.BAD_FLAGS, f"COMPRESSED flag on a {frame_type.name} frame")
    if length > max_frame_bytes:
        raise remote_error(
            LinkErrorCode.OVERSIZE,
            f"{frame_type.name} frame of {length} bytes exceeds the limit of {max_frame_bytes}",
        )
    return FrameHeader(version, frame_type, flags, length, crc)


def check_crc_untrusted(
    head: bytes | bytearray | memoryview, payload: bytes | memoryview, header: FrameHeader
) -> None:
    crc = crc32c.crc32c(payload, crc32c.crc32c(head[:9]))
    if crc != header.crc:
        raise remote_error(
            LinkErrorCode.BAD_CRC,
            f"CRC32C mismatch on a {header.type.name} frame of {header.length} bytes "
            f"(got 0x{header.crc:08x}, computed 0x{crc:08x})",
            retriable=True,
        )


def decode_frame_untrusted(
    data: bytes | bytearray | memoryview, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> Frame:
    """Decode exactly one complete frame (no more, no fewer bytes)."""
    header = decode_header_untrusted(data, max_frame_bytes)
    total = HEADER_SIZE + header.length
    if len(data) < total:
        raise remote_error(
            LinkErrorCode.TRUNCATED,
            f"{header.type.name} frame needs {total} bytes, got {len(data)}",
        )
    if len(data) > total:
        raise remote_error(
            LinkErrorCode.MALFORMED,
            f"{len(data) - total} trailing bytes after a {header.type.name} frame",
        )
    payload = bytes(data[HEADER_SIZE:total])
    check_crc_untrusted(data, payload, header)
    return decode_payload_untrusted(header, payload, max_frame_bytes=max_frame_bytes)


# A stream's zstd decompression context, or None for a new one.
Zstd = zstandard.ZstdDecompressor | None


def decode_payload_untrusted(
    header: FrameHeader,
    payload: bytes,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    zstd: Zstd = None,
) -> Frame:
    """Decode a frame's payload, its header and CRC already checked.
    ``zstd``: the decompression context to use (a connection keeps one:
    making one costs 8 µs, twenty times decompressing a small batch)."""
    name = header.type.name
    try:
        return _decode_payload(header, payload, max_frame_bytes, zstd)
    except RemoteProtocolError:
        raise
    except (
        ConstructError,
        struct.error,
        UnicodeError,
        ValueError,
        IndexError,
        OverflowError,
    ) as exc:
        raise remote_error(LinkErrorCode.MALFORMED, f"malformed {name} payload: {exc}") from None


def _decode_payload(header: FrameHeader, payload: bytes, max_frame_bytes: int, zstd: Zstd) -> Frame:
    ftype = header.type
    compressed = bool(header.flags & FLAG_COMPRESSED)
    if ftype is FrameType.BATCH:
        return _decode_batch(payload, compressed, max_frame_bytes, zstd)
    if ftype is FrameType.RESYNC_CHUNK:
        c = parse_exact(RESYNC_CHUNK, payload)
        codec = _codec(c["codec"], compressed, "RESYNC_CHUNK")
        data = _decompress(codec, c["data"], c["raw_length"], max_frame_bytes, zstd)
        return ResyncChunk(index=c["index"], data=data, codec=codec)
    if ftype is FrameType.HELLO:
        c = parse_exact(HELLO, payload)
        return Hello(
            origin_cluster=c["origin_cluster"],
            target_cluster=c["target_cluster"],
            incarnation=c["incarnation"],
            epoch=c["epoch"],
            resume_point=c["resume_point"],
            window_bytes=c["window_bytes"],
            codecs=c["codecs"],
            minor=c["minor"],
        )
    if ftype is FrameType.WELCOME:
        c = parse_exact(WELCOME, payload)
        return Welcome(
            origin_cluster=c["origin_cluster"],
            target_cluster=c["target_cluster"],
            incarnation=c["incarnation"],
            epoch=c["epoch"],
            resume_from=c["resume_from"],
            window_bytes=c["window_bytes"],
            codec=_codec(c["codec"], False, "WELCOME"),
            minor=c["minor"],
            holdings=c["holdings"],
        )
    if ftype is FrameType.ACK:
        c = parse_exact(ACK, payload)
        return Ack(seq=c["seq"], resync_chunks=c["resync_chunks"])
    if ftype is FrameType.PING:
        if len(payload) == PING_HEARTBEAT_SIZE:
            c = parse_exact(PING_HEARTBEAT, payload)
            return Ping(c["timestamp_us"], c["origin_time_us"], c["origin_last_seq"])
        return Ping(timestamp_us=parse_exact(PING, payload)["timestamp_us"])
    if ftype is FrameType.PONG:
        return Pong(timestamp_us=parse_exact(PONG, payload)["timestamp_us"])
    if ftype is FrameType.RESYNC_BEGIN:
        c = parse_exact(RESYNC_BEGIN, payload)
        return ResyncBegin(
            epoch=c["epoch"],
            cut_seq=c["cut_seq"],
            total_chunks=c["total_chunks"],
            total_bytes=c["total_bytes"],
            scope=c["scope"],
        )
    if ftype is FrameType.RESYNC_END:
        c = parse_exact(RESYNC_END, payload)
        return ResyncEnd(
            cut_seq=c["cut_seq"], total_chunks=c["total_chunks"], total_bytes=c["total_bytes"]
        )
    c = parse_exact(ERROR, payload)
    if c["retriable"] not in (0, 1):
        raise remote_error(
            LinkErrorCode.MALFORMED, f"ERROR retriable byte {c['retriable']} is not 0 or 1"
        )
    code = c["code"]
    if code in _KNOWN_CODES:
        code = LinkErrorCode(code)  # else: a code from a newer peer, passed up as an int
    return ErrorFrame(code=code, text=c["text"], retriable=bool(c["retriable"]))


def _codec(value: int, compressed_flag: bool, where: str) -> Codec:
    try:
        codec = Codec(value)
    except ValueError:
        raise remote_error(LinkErrorCode.MALFORMED, f"unknown codec {value} in {where}") from None
    if where != "WELCOME" and compressed_flag != (codec is not Codec.NONE):
        raise remote_error(
            LinkErrorCode.BAD_FLAGS,
            f"{where}: COMPRESSED flag is {'set' if compressed_flag else 'clear'} "
            f"but the codec is {codec.name}",
        )
    return codec


def _decompress(
    codec: Codec, data: bytes, raw_length: int, max_frame_bytes: int, zstd: Zstd
) -> bytes:
    if codec is Codec.NONE:
        if len(data) != raw_length:
            raise remote_error(
                LinkErrorCode.MALFORMED,
                f"raw_length {raw_length} but {len(data)} uncompressed bytes",
            )
        return data
    if raw_length > max_frame_bytes:
        raise remote_error(
            LinkErrorCode.OVERSIZE,
            f"compressed block expands to {raw_length} bytes, above the limit of {max_frame_bytes}",
        )
    try:
        size = zstandard.frame_content_size(data)
        if size != raw_length:
            raise remote_error(
                LinkErrorCode.BAD_COMPRESSION,
                f"zstd frame declares {size} bytes, raw_length says {raw_length}",
            )
        out = (zstd or zstandard.ZstdDecompressor()).decompress(data, max_output_size=raw_length)
    except zstandard.ZstdError as exc:
        raise remote_error(LinkErrorCode.BAD_COMPRESSION, f"zstd: {exc}") from None
    if len(out) != raw_length:
        raise remote_error(
            LinkErrorCode.BAD_COMPRESSION,
            f"decompressed to {len(out)} bytes, expected {raw_length}",
        )
    return out


def _decode_batch(payload: bytes, compressed: bool, max_frame_bytes: int, zstd: Zstd) -> Batch:
    if len(payload) < _BATCH_HEAD.size:
        raise remote_error(
            LinkErrorCode.MALFORMED, f"BATCH payload of {len(payload)} bytes is too short"
        )
    epoch, first, last, count, codec_value, raw_length = _BATCH_HEAD.unpack_from(payload, 0)
    codec = _codec(codec_value, compressed, "BATCH")
    block = _decompress(codec, payload[_BATCH_HEAD.size :], raw_length, max_frame_bytes, zstd)
    if count == 0:
        raise remote_error(LinkErrorCode.MALFORMED, "BATCH with no events")
    if count * EVENT_OVERHEAD > len(block):
        raise remote_error(
            LinkErrorCode.MALFORMED, f"BATCH count {count} cannot fit {len(block)} bytes"
        )
    events = unpack_events_untrusted(block, count)
    if events[0].seq != first or events[-1].seq != last:
        raise remote_error(
            LinkErrorCode.MALFORMED,
            f"BATCH says seq {first}..{last} but carries {events[0].seq}..{events[-1].seq}",
        )
    return Batch(epoch=epoch, events=events, codec=codec)


def unpack_events_untrusted(block: bytes, count: int) -> tuple[LinkEvent, ...]:
    """Split an uncompressed events block into ``count`` events, seqs strictly
    increasing, each ``prev_seq`` below its ``seq``."""
    unpack = _EVENT_HEAD.unpack_from
    size = EVENT_OVERHEAD
    end = len(block)
    pos = 0
    prev = -1
    out: list[LinkEvent] = []
    append = out.append
    for _ in range(count):
        if pos + size > end:
            raise remote_error(
                LinkErrorCode.MALFORMED, f"events block truncated after {len(out)} events"
            )
        seq, prev_seq, time_us, length = unpack(block, pos)
        pos += size
        if pos + length > end:
            raise remote_error(
                LinkErrorCode.MALFORMED, f"event seq {seq} claims {length} bytes, {end - pos} left"
            )
        if seq <= prev:
            raise remote_error(
                LinkErrorCode.OUT_OF_ORDER, f"event seq {seq} after seq {prev} in one batch"
            )
        if prev_seq >= seq:
            raise remote_error(
                LinkErrorCode.MALFORMED,
                f"event seq {seq} names {prev_seq} as its previous forwarded event",
            )
        prev = seq
        append(LinkEvent(seq, time_us, block[pos : pos + length], prev_seq=prev_seq))
        pos += length
    if pos != end:
        raise remote_error(
            LinkErrorCode.MALFORMED, f"{end - pos} trailing bytes after {count} events"
        )
    return tuple(out)
