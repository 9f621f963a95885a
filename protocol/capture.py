"""Capture segments: what a sidecar saw, recorded for analysis after the fact.

Theory of operation
-------------------
A capture segment is one file holding one stream (tapped, forwarded or
ingested) of one sidecar.  It is written append-only and must stay readable
when the writer dies at any byte:

    segment := preamble header-block (string-block | record-block)* [trailer-block]

* The preamble is 8 fixed bytes (magic ``DRGCAP``, version, zero).
* Every block after it is framed the same way, and carries its own CRC32C::

      length u32 | tag u8 | body[length] | crc32c u32
      (big-endian; the CRC covers length, tag and body)

  A reader walks the blocks; a block that does not fit in the remaining bytes
  means the segment was cut there (the writer died): every whole block before
  it is good.  A whole block whose CRC does not match is corruption, not a
  cut, and fails with :class:`RemoteProtocolError`.
* Strings (queue names and rule names) are interned: a string block defines
  the next string id (0, 1, 2, ... in file order) before the first record
  that uses it, so records stay small and mostly fixed-size.
* The trailer counts the records and the bytes before it and gives the end
  time.  A segment with a trailer that agrees with what was read is
  *complete*; one without is *cut*.  Bytes after the trailer are corruption.

The writer batches: :meth:`CaptureWriter.append` encodes into a buffer,
:meth:`CaptureWriter.flush` hands the buffer to the file object in one
write, :meth:`CaptureWriter.close` writes the trailer.  Nothing here opens
files or reads clocks: the caller passes file objects and times in.

Two decoders read the format: :class:`SegmentDecoder` (sans-IO, event per
block, built on the construct definitions; :class:`CaptureReader` wraps it
around a file object) and :func:`scan_segment_untrusted` (bulk, for
analysis: checks every block, returns record offsets and the string table,
and leaves the fixed-size fields to be read in bulk by the caller through
:data:`RECORD_HEAD_FIELDS`).  Tests hold the two to the same answers.
"""

from __future__ import annotations

import enum
import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Final

import construct as c
from crc32c import crc32c

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.exactparse import parse_exact
from protocol.modes import Mode

__all__ = [
    "MAGIC",
    "NO_RULE",
    "RECORD_HEAD_FIELDS",
    "RECORD_HEAD_SIZE",
    "VERSION",
    "CaptureReader",
    "CaptureRecord",
    "CaptureRole",
    "CaptureWriter",
    "RecordFlag",
    "SegmentDecoder",
    "SegmentFlag",
    "SegmentHeader",
    "SegmentScan",
    "SegmentTrailer",
    "Stream",
    "scan_segment_untrusted",
]

MAGIC: Final = b"DRGCAP"
VERSION: Final = 1
NO_RULE: Final = 0xFFFF  # rule id of an event no rule decided (the default mode applied)

# A block longer than this is corruption, not a record: payloads are bus
# commands, which the bus caps well below it.
MAX_BLOCK: Final = 16 * 1024 * 1024

TAG_HEADER: Final = 0x48  # "H"
TAG_STRING: Final = 0x53  # "S"
TAG_RECORD: Final = 0x52  # "R"
TAG_TRAILER: Final = 0x54  # "T"


class Stream(enum.IntEnum):
    """Which stream of a sidecar a segment holds.  Wire values."""

    TAPPED = 1  # every event the tap derived from the site bus (with its rule decision)
    FORWARDED = 2  # events the active egress sent over the WAN link
    INGESTED = 3  # forwarded events the active ingress saw applied by its site's bus

    @property
    def label(self) -> str:
        return self.name.lower()


class CaptureRole(enum.IntEnum):
    """The sidecar's role when the segment was opened.  Wire values."""

    UNKNOWN = 0
    EGRESS = 1  # active egress at the primary site
    INGRESS = 2  # active ingress at the DR site
    STANDBY = 3

    @property
    def label(self) -> str:
        return self.name.lower()


class SegmentFlag(enum.IntFlag):
    PAYLOADS = 1  # records may carry the command's bytes


class RecordFlag(enum.IntFlag):
    PAYLOAD = 1  # the record carries a payload (possibly empty)
    RESYNC = 2  # the event belongs to a resync, not to the live stream


_SEGMENT_FLAGS_KNOWN: Final = int(SegmentFlag.PAYLOADS)
RECORD_FLAGS_KNOWN: Final = int(RecordFlag.PAYLOAD | RecordFlag.RESYNC)
MODE_MAX: Final = max(Mode)

# --- wire definitions -------------------------------------------------------

# preamble: magic "DRGCAP" (6) | version u8 | reserved u8 (0)
_PREAMBLE = struct.Struct(">6sBB")
PREAMBLE_SIZE: Final = _PREAMBLE.size

# block frame: length u32 | tag u8 | body[length] | crc32c u32 (over length, tag, body)
_FRAME = struct.Struct(">IB")
_CRC = struct.Struct(">I")
FRAME_OVERHEAD: Final = _FRAME.size + _CRC.size

# header body:
# flags u8 | role u8 | stream u8 | reserved u8 (0) | node u32 | incarnation u64 |
# start_time_us u64 | site: length u8 + utf-8
HeaderBody = c.Struct(
    "flags" / c.Int8ub,
    "role" / c.Int8ub,
    "stream" / c.Int8ub,
    "reserved" / c.Const(0, c.Int8ub),
    "node" / c.Int32ub,
    "incarnation" / c.Int64ub,
    "start_time_us" / c.Int64ub,
    "site" / c.PascalString(c.Int8ub, "utf8"),
    c.Terminated,
).compile()

# string body: text: length u16 + utf-8 (its id is the count of strings before it)
StringBody = c.Struct(
    "text" / c.PascalString(c.Int16ub, "utf8"),
    c.Terminated,
).compile()

# record body (fixed head of 54 bytes, then the variable part):
# wall_time_us u64 | cseq u64 | origin_cseq u64 | origin_incarnation u64 |
# size u32 | wire_size u32 | rule_name u32 (string id) | kind u8 | mode u8 |
# rule_id u16 | flags u8 | queue_count u8 | payload_len u32 |
# queue ids u32 * queue_count | payload[payload_len]
RECORD_HEAD_FIELDS: Final[tuple[tuple[str, str], ...]] = (
    ("wall_time_us", ">u8"),
    ("cseq", ">u8"),
    ("origin_cseq", ">u8"),
    ("origin_incarnation", ">u8"),
    ("size", ">u4"),
    ("wire_size", ">u4"),
    ("rule_name", ">u4"),
    ("kind", "u1"),
    ("mode", "u1"),
    ("rule_id", ">u2"),
    ("flags", "u1"),
    ("queue_count", "u1"),
    ("payload_len", ">u4"),
)
"""The record head's fields in order, as numpy dtype strings, for bulk readers."""

_RECORD_HEAD = struct.Struct(">QQQQIIIBBHBBI")
RECORD_HEAD_SIZE: Final = _RECORD_HEAD.size
# the head's last two fields: queue_count u8 | payload_len u32
_RECORD_LENGTHS = struct.Struct(">BI")

RecordBody = c.Struct(
    "wall_time_us" / c.Int64ub,
    "cseq" / c.Int64ub,
    "origin_cseq" / c.Int64ub,
    "origin_incarnation" / c.Int64ub,
    "size" / c.Int32ub,
    "wire_size" / c.Int32ub,
    "rule_name" / c.Int32ub,
    "kind" / c.Int8ub,
    "mode" / c.Int8ub,
    "rule_id" / c.Int16ub,
    "flags" / c.Int8ub,
    "queue_count" / c.Int8ub,
    "payload_len" / c.Int32ub,
    "queue_ids" / c.Array(c.this.queue_count, c.Int32ub),
    "payload" / c.Bytes(c.this.payload_len),
    c.Terminated,
).compile()

# trailer body: records u64 | bytes u64 (segment bytes before the trailer block) | end_time_us u64
TrailerBody = c.Struct(
    "records" / c.Int64ub,
    "bytes" / c.Int64ub,
    "end_time_us" / c.Int64ub,
    c.Terminated,
).compile()

_U8: Final = 0xFF
_U16: Final = 0xFFFF
_U32: Final = 0xFFFFFFFF
_U64: Final = 0xFFFFFFFFFFFFFFFF

# --- events -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """Who wrote the segment and what it holds."""

    site: str
    node: int
    role: CaptureRole
    stream: Stream
    start_time_us: int
    incarnation: int = 0  # the capturing site's incarnation
    payloads: bool = False  # records may carry payloads


@dataclass(frozen=True, slots=True)
class CaptureRecord:
    """One event as the sidecar saw it.

    ``size`` is the event's encoded bus command size in bytes; ``wire_size`` its
    share of the compressed link batch that carried it (forwarded stream; 0 when
    not known).  ``origin_cseq``/``origin_incarnation`` name the event at its
    origin site on the ingested stream (0 when not applicable).
    """

    wall_time_us: int
    cseq: int
    kind: int
    mode: Mode
    queues: tuple[str, ...] = ()
    size: int = 0
    wire_size: int = 0
    origin_cseq: int = 0
    origin_incarnation: int = 0
    rule_id: int = NO_RULE
    rule_name: str = ""
    resync: bool = False
    payload: bytes | None = None


@dataclass(frozen=True, slots=True)
class SegmentTrailer:
    """What the writer counted when it closed the segment."""

    records: int
    bytes: int  # segment bytes before the trailer block
    end_time_us: int


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()
"""Returned by :meth:`SegmentDecoder.next_event` when it needs more bytes."""

SegmentEvent = SegmentHeader | CaptureRecord | SegmentTrailer

# --- encoding ---------------------------------------------------------------


def _frame(tag: int, body: bytes) -> bytes:
    head = _FRAME.pack(len(body), tag)
    return head + body + _CRC.pack(crc32c(body, crc32c(head)))


def _check_range(name: str, value: int, limit: int) -> None:
    if not 0 <= value <= limit:
        raise LocalProtocolError(f"capture field {name}={value} out of range 0..{limit}")


def encode_preamble() -> bytes:
    return _PREAMBLE.pack(MAGIC, VERSION, 0)


def encode_header(header: SegmentHeader) -> bytes:
    """The header block (without the preamble)."""
    _check_range("node", header.node, _U32)
    _check_range("incarnation", header.incarnation, _U64)
    _check_range("start_time_us", header.start_time_us, _U64)
    site = header.site.encode("utf-8")
    if len(site) > _U8:
        raise LocalProtocolError(f"capture site name is {len(site)} bytes; the limit is 255")
    body = HeaderBody.build(
        {
            "flags": int(SegmentFlag.PAYLOADS) if header.payloads else 0,
            "role": int(header.role),
            "stream": int(header.stream),
            "node": header.node,
            "incarnation": header.incarnation,
            "start_time_us": header.start_time_us,
            "site": header.site,
        }
    )
    return _frame(TAG_HEADER, body)


def encode_string(text: str) -> bytes:
    if len(text.encode("utf-8")) > _U16:
        raise LocalProtocolError(f"capture string of {len(text)} characters exceeds 65535 bytes")
    return _frame(TAG_STRING, StringBody.build({"text": text}))


def encode_record_body(record: CaptureRecord, queue_ids: list[int], rule_name_id: int) -> bytes:
    _check_range("wall_time_us", record.wall_time_us, _U64)
    _check_range("cseq", record.cseq, _U64)
    _check_range("origin_cseq", record.origin_cseq, _U64)
    _check_range("origin_incarnation", record.origin_incarnation, _U64)
    _check_range("size", record.size, _U32)
    _check_range("wire_size", record.wire_size, _U32)
    _check_range("kind", record.kind, _U8)
    _check_range("rule_id", record.rule_id, _U16)
    if len(queue_ids) > _U8:
        raise LocalProtocolError(f"capture record names {len(queue_ids)} queues; the limit is 255")
    payload = record.payload if record.payload is not None else b""
    flags = (RecordFlag.PAYLOAD if record.payload is not None else 0) | (
        RecordFlag.RESYNC if record.resync else 0
    )
    try:
        mode = Mode(record.mode)
    except ValueError:
        raise LocalProtocolError(f"capture record mode {record.mode!r} is not a Mode") from None
    # struct, not RecordBody.build: the writer runs beside the sidecar's data
    # path; tests hold this to the construct definition byte for byte.
    head = _RECORD_HEAD.pack(
        record.wall_time_us,
        record.cseq,
        record.origin_cseq,
        record.origin_incarnation,
        record.size,
        record.wire_size,
        rule_name_id,
        record.kind,
        mode,
        record.rule_id,
        flags,
        len(queue_ids),
        len(payload),
    )
    if queue_ids:
        head += struct.pack(f">{len(queue_ids)}I", *queue_ids)
    return head + payload


def encode_trailer(trailer: SegmentTrailer) -> bytes:
    _check_range("end_time_us", trailer.end_time_us, _U64)
    body = TrailerBody.build(
        {"records": trailer.records, "bytes": trailer.bytes, "end_time_us": trailer.end_time_us}
    )
    return _frame(TAG_TRAILER, body)


class CaptureWriter:
    """Writes one segment to a binary file object, batching writes.

    :meth:`append` only encodes into a buffer; :meth:`flush` writes the buffer
    in one ``write`` call; :meth:`close` writes the trailer and flushes.  The
    file object is never closed here.  Raises :class:`LocalProtocolError` for a
    record the format cannot hold (a field out of range, a payload in a segment
    opened without payloads).
    """

    def __init__(self, stream: BinaryIO, header: SegmentHeader) -> None:
        self._stream = stream
        self.header = header
        self._strings: dict[str, int] = {}
        self._buffer = bytearray(encode_preamble())
        self._buffer += encode_header(header)
        self._written = 0  # bytes handed to the file object
        self._records = 0
        self._closed = False

    @property
    def records(self) -> int:
        return self._records

    @property
    def size(self) -> int:
        """Bytes of the segment so far, buffered ones included (for rotation)."""
        return self._written + len(self._buffer)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def _intern(self, text: str) -> int:
        sid = self._strings.get(text)
        if sid is None:
            self._buffer += encode_string(text)
            sid = self._strings[text] = len(self._strings)
        return sid

    def append(self, record: CaptureRecord) -> None:
        if self._closed:
            raise LocalProtocolError("append to a closed capture segment")
        if record.payload is not None and not self.header.payloads:
            raise LocalProtocolError(
                "capture record has a payload but the segment was opened without payloads"
            )
        # Encode before interning so that a bad record leaves no orphan strings.
        queue_ids = [self._strings.get(q, -1) for q in record.queues]
        rule_name_id = self._strings.get(record.rule_name, -1)
        if min(queue_ids, default=0) < 0 or rule_name_id < 0:
            encode_record_body(record, [0] * len(queue_ids), 0)  # validation only
            queue_ids = [self._intern(q) for q in record.queues]
            rule_name_id = self._intern(record.rule_name)
        self._buffer += _frame(TAG_RECORD, encode_record_body(record, queue_ids, rule_name_id))
        self._records += 1

    def flush(self) -> None:
        if self._buffer:
            self._stream.write(bytes(self._buffer))
            self._written += len(self._buffer)
            self._buffer.clear()

    def close(self, end_time_us: int) -> SegmentTrailer:
        """Write the trailer and flush.  The segment is complete afterwards."""
        if self._closed:
            raise LocalProtocolError("capture segment closed twice")
        trailer = SegmentTrailer(records=self._records, bytes=self.size, end_time_us=end_time_us)
        self._buffer += encode_trailer(trailer)
        self._closed = True
        self.flush()
        return trailer

    def statistics(self) -> dict[str, int]:
        return {"records": self._records, "bytes": self.size, "buffered_bytes": len(self._buffer)}


# --- decoding ---------------------------------------------------------------


def _error(offset: int, what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"capture segment corrupt at byte {offset}: {what}")


def decode_preamble_untrusted(data: bytes | bytearray | memoryview) -> None:
    magic, version, reserved = _PREAMBLE.unpack_from(data, 0)
    if magic != MAGIC:
        raise _error(0, f"bad magic {bytes(magic)!r} (not a drgate capture segment)")
    if version != VERSION:
        raise _error(6, f"unsupported version {version} (this reader knows {VERSION})")
    if reserved != 0:
        raise _error(7, "reserved preamble byte is not zero")


def _parse(definition: Any, body: bytes, offset: int, what: str) -> Any:
    try:
        return parse_exact(definition, body)
    except (c.ConstructError, struct.error, UnicodeDecodeError, ValueError) as exc:
        raise _error(offset, f"bad {what}: {exc}") from None


def decode_header_body_untrusted(body: bytes, offset: int = 0) -> SegmentHeader:
    parsed = _parse(HeaderBody, body, offset, "header")
    if parsed.flags & ~_SEGMENT_FLAGS_KNOWN:
        raise _error(offset, f"unknown header flags {parsed.flags:#x}")
    try:
        role = CaptureRole(parsed.role)
        stream = Stream(parsed.stream)
    except ValueError as exc:
        raise _error(offset, f"bad header: {exc}") from None
    return SegmentHeader(
        site=parsed.site,
        node=parsed.node,
        role=role,
        stream=stream,
        start_time_us=parsed.start_time_us,
        incarnation=parsed.incarnation,
        payloads=bool(parsed.flags & SegmentFlag.PAYLOADS),
    )


def _check_record_length(body: bytes, offset: int) -> None:
    # The scan's checks, in the same order, so both readers give the same error.
    if len(body) < RECORD_HEAD_SIZE:
        raise _error(offset, "record shorter than its head")
    count, payload_len = _RECORD_LENGTHS.unpack_from(body, RECORD_HEAD_SIZE - 5)
    if len(body) != RECORD_HEAD_SIZE + 4 * count + payload_len:
        raise _error(offset, "record length disagrees with its head")


def _check_record_head(
    offset: int, mode: int, flags: int, payload_len: int, payloads: bool
) -> None:
    if mode > MODE_MAX:
        raise _error(offset, f"unknown mode {mode}")
    if flags & ~RECORD_FLAGS_KNOWN:
        raise _error(offset, f"unknown record flags {flags:#x}")
    if flags & RecordFlag.PAYLOAD:
        if not payloads:
            raise _error(offset, "record has a payload in a segment without payloads")
    elif payload_len:
        raise _error(offset, "payload bytes without the payload flag")


class SegmentDecoder:
    """Sans-IO decoder of one segment: bytes in, events out.

    Feed bytes with :meth:`receive_data`; call :meth:`next_event` until it
    returns :data:`NEED_DATA`.  Events are the :class:`SegmentHeader` (first),
    each :class:`CaptureRecord`, and the :class:`SegmentTrailer` (last).  At
    the end of the file call :meth:`end_of_data`: it returns ``True`` when the
    segment was complete and ``False`` when it was cut (a partial block or no
    trailer).  Corruption raises :class:`RemoteProtocolError`, and only that.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._start = 0  # index in _buf of the next unread byte
        self._offset = 0  # segment offset of _buf[0]
        self._header: SegmentHeader | None = None
        self._preamble = False
        self._strings: list[str] = []
        self._records = 0
        self._trailer: SegmentTrailer | None = None

    @property
    def header(self) -> SegmentHeader | None:
        return self._header

    @property
    def trailer(self) -> SegmentTrailer | None:
        return self._trailer

    @property
    def records(self) -> int:
        return self._records

    @property
    def offset(self) -> int:
        """Segment offset just after the last whole block decoded."""
        return self._offset + self._start

    def receive_data(self, data: bytes) -> None:
        if self._start > 65536:
            del self._buf[: self._start]
            self._offset += self._start
            self._start = 0
        self._buf += data

    def next_event(self) -> SegmentEvent | _NeedData:
        while True:
            buf = self._buf
            pos = self._start
            avail = len(buf) - pos
            if not self._preamble:
                if avail < PREAMBLE_SIZE:
                    if avail and not MAGIC.startswith(bytes(buf[pos : pos + min(avail, 6)])):
                        raise _error(0, "bad magic (not a drgate capture segment)")
                    return NEED_DATA
                decode_preamble_untrusted(buf)
                self._preamble = True
                self._start += PREAMBLE_SIZE
                continue
            if avail == 0:
                return NEED_DATA
            if self._trailer is not None:
                raise _error(self.offset, "bytes after the trailer")
            if avail < _FRAME.size:
                return NEED_DATA
            length, tag = _FRAME.unpack_from(buf, pos)
            block_offset = self.offset
            if length > MAX_BLOCK:
                raise _error(block_offset, f"block length {length} exceeds {MAX_BLOCK}")
            end = pos + _FRAME.size + length
            if len(buf) < end + _CRC.size:
                return NEED_DATA
            (crc,) = _CRC.unpack_from(buf, end)
            if crc32c(memoryview(buf)[pos:end]) != crc:
                raise _error(block_offset, "CRC32C mismatch")
            body = bytes(buf[pos + _FRAME.size : end])
            self._start = end + _CRC.size
            event = self._block(tag, body, block_offset)
            if event is not None:
                return event

    def _block(self, tag: int, body: bytes, offset: int) -> SegmentEvent | None:
        if self._header is None:
            if tag != TAG_HEADER:
                raise _error(offset, f"expected the header block, found tag {tag:#x}")
            self._header = decode_header_body_untrusted(body, offset)
            return self._header
        if tag == TAG_STRING:
            self._strings.append(_parse(StringBody, body, offset, "string").text)
            return None
        if tag == TAG_RECORD:
            return self._record(body, offset)
        if tag == TAG_TRAILER:
            parsed = _parse(TrailerBody, body, offset, "trailer")
            if parsed.records != self._records or parsed.bytes != offset:
                raise _error(
                    offset,
                    f"trailer counts {parsed.records} records in {parsed.bytes} bytes, "
                    f"read {self._records} records in {offset} bytes",
                )
            self._trailer = SegmentTrailer(parsed.records, parsed.bytes, parsed.end_time_us)
            return self._trailer
        raise _error(offset, f"unknown block tag {tag:#x}")

    def _record(self, body: bytes, offset: int) -> CaptureRecord:
        assert self._header is not None
        _check_record_length(body, offset)
        p = _parse(RecordBody, body, offset, "record")
        _check_record_head(offset, p.mode, p.flags, p.payload_len, self._header.payloads)
        strings = self._strings
        try:
            queues = tuple(strings[i] for i in p.queue_ids)
            rule_name = strings[p.rule_name]
        except IndexError:
            raise _error(offset, "record uses an undefined string id") from None
        self._records += 1
        return CaptureRecord(
            wall_time_us=p.wall_time_us,
            cseq=p.cseq,
            kind=p.kind,
            mode=Mode(p.mode),
            queues=queues,
            size=p.size,
            wire_size=p.wire_size,
            origin_cseq=p.origin_cseq,
            origin_incarnation=p.origin_incarnation,
            rule_id=p.rule_id,
            rule_name=rule_name,
            resync=bool(p.flags & RecordFlag.RESYNC),
            payload=p.payload if p.flags & RecordFlag.PAYLOAD else None,
        )

    def end_of_data(self) -> bool:
        """No more bytes will come: ``True`` if the segment is complete, ``False`` if cut."""
        return self._trailer is not None and self._start == len(self._buf)


class CaptureReader:
    """Iterates the records of one segment read from a binary file object.

    Construction reads the header (``header`` is ``None`` when the segment was
    cut before its header was whole).  Iterating yields every whole record;
    afterwards ``complete`` tells a closed segment from a cut one and
    ``trailer`` holds the writer's counts.  Corruption raises
    :class:`RemoteProtocolError`.
    """

    def __init__(self, stream: BinaryIO, *, chunk_size: int = 1 << 16) -> None:
        self._stream = stream
        self._chunk = chunk_size
        self._decoder = SegmentDecoder()
        self._eof = False
        self._pending: SegmentEvent | None = None
        self.complete = False
        self.header: SegmentHeader | None = None
        first = self._next()
        if isinstance(first, SegmentHeader):
            self.header = first
        elif first is not None:  # pragma: no cover - the decoder yields the header first
            self._pending = first

    @property
    def trailer(self) -> SegmentTrailer | None:
        return self._decoder.trailer

    @property
    def cut(self) -> bool:
        """``True`` once iteration ended without a trailer."""
        return self._eof and not self.complete

    @property
    def records(self) -> int:
        return self._decoder.records

    def _next(self) -> SegmentEvent | None:
        while True:
            event = self._decoder.next_event()
            if not isinstance(event, _NeedData):
                return event
            if self._eof:
                return None
            data = self._stream.read(self._chunk)
            if not data:
                self._eof = True
                self.complete = self._decoder.end_of_data()
                if self._decoder.trailer is not None and not self.complete:
                    raise _error(self._decoder.offset, "bytes after the trailer")
                continue
            self._decoder.receive_data(data)

    def __iter__(self) -> Iterator[CaptureRecord]:
        while True:
            event = self._pending if self._pending is not None else self._next()
            self._pending = None
            if event is None:
                return
            if isinstance(event, CaptureRecord):
                yield event


# --- bulk scan --------------------------------------------------------------


@dataclass(slots=True)
class SegmentScan:
    """What :func:`scan_segment_untrusted` found in a whole segment.

    ``record_offsets[i]`` is the offset in the scanned bytes of record i's body;
    its fixed head has the layout :data:`RECORD_HEAD_FIELDS`, followed by its
    queue ids (u32 big-endian string ids) and payload.  ``strings`` resolves
    string ids.  ``cut_at`` is the offset of the first byte not read as a whole
    block when the segment is cut.
    """

    header: SegmentHeader | None
    trailer: SegmentTrailer | None
    complete: bool
    cut_at: int | None
    strings: list[str] = field(default_factory=list)
    record_offsets: array = field(default_factory=lambda: array("Q"))

    @property
    def records(self) -> int:
        return len(self.record_offsets)


def scan_segment_untrusted(data: bytes) -> SegmentScan:
    """Check every block of a whole segment and locate its records.

    Checks exactly what :class:`SegmentDecoder` checks (framing, CRC, the
    record head's mode, flags, lengths and string ids, the trailer's counts),
    without building an object per record.  Raises :class:`RemoteProtocolError`
    for corruption; a cut segment is a normal result (``complete`` false).
    """
    size = len(data)
    scan = SegmentScan(header=None, trailer=None, complete=False, cut_at=None)
    if size < PREAMBLE_SIZE:
        if not MAGIC.startswith(data[:6]):
            raise _error(0, "bad magic (not a drgate capture segment)")
        scan.cut_at = 0
        return scan
    decode_preamble_untrusted(data)
    mv = memoryview(data)
    pos = PREAMBLE_SIZE
    frame_unpack = _FRAME.unpack_from
    crc_unpack = _CRC.unpack_from
    tail_unpack = struct.Struct(">IBBHBBI").unpack_from
    frame_size = _FRAME.size
    head_size = RECORD_HEAD_SIZE
    offsets = scan.record_offsets
    append = offsets.append
    strings = scan.strings
    payloads = False
    mode_max = int(MODE_MAX)
    flags_known = RECORD_FLAGS_KNOWN
    while pos < size:
        if scan.trailer is not None:
            raise _error(pos, "bytes after the trailer")
        if size - pos < frame_size:
            scan.cut_at = pos
            return scan
        length, tag = frame_unpack(data, pos)
        if length > MAX_BLOCK:
            raise _error(pos, f"block length {length} exceeds {MAX_BLOCK}")
        end = pos + frame_size + length
        if end + 4 > size:
            scan.cut_at = pos
            return scan
        if crc32c(mv[pos:end]) != crc_unpack(data, end)[0]:
            raise _error(pos, "CRC32C mismatch")
        start = pos + frame_size
        if tag == TAG_RECORD and scan.header is not None:
            if length < head_size:
                raise _error(pos, "record shorter than its head")
            # the head's tail: rule_name, kind, mode, rule_id, flags, queue_count, payload_len
            rule_name, _, mode, _, flags, count, payload_len = tail_unpack(data, start + 40)
            if length != head_size + 4 * count + payload_len:
                raise _error(pos, "record length disagrees with its head")
            if (
                mode > mode_max
                or flags & ~flags_known
                or (flags & 1 and not payloads)
                or (not flags & 1 and payload_len)
            ):
                _check_record_head(pos, mode, flags, payload_len, payloads)
            defined = len(strings)
            if rule_name >= defined:
                raise _error(pos, "record uses an undefined string id")
            if count:
                q = start + head_size
                for qid in struct.unpack_from(f">{count}I", data, q):
                    if qid >= defined:
                        raise _error(pos, "record uses an undefined string id")
            append(start)
        elif tag == TAG_STRING and scan.header is not None:
            strings.append(_parse(StringBody, bytes(mv[start:end]), pos, "string").text)
        elif scan.header is None:
            if tag != TAG_HEADER:
                raise _error(pos, f"expected the header block, found tag {tag:#x}")
            scan.header = decode_header_body_untrusted(bytes(mv[start:end]), pos)
            payloads = scan.header.payloads
        elif tag == TAG_TRAILER:
            parsed = _parse(TrailerBody, bytes(mv[start:end]), pos, "trailer")
            if parsed.records != len(offsets) or parsed.bytes != pos:
                raise _error(
                    pos,
                    f"trailer counts {parsed.records} records in {parsed.bytes} bytes, "
                    f"read {len(offsets)} records in {pos} bytes",
                )
            scan.trailer = SegmentTrailer(parsed.records, parsed.bytes, parsed.end_time_us)
        else:
            raise _error(pos, f"unknown block tag {tag:#x}")
        pos = end + 4
    scan.complete = scan.trailer is not None
    if not scan.complete:
        scan.cut_at = pos
    return scan
