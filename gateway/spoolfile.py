"""The spool's files: segment and record format, scanning, reading.

Theory of operation
-------------------
A spool directory (gateway/spool.py keeps the policy: index, trim, floor,
overflow) holds segment files, a state file (gateway/spoolstate.py) and a
lock file that one process holds (:func:`lock_directory`); :class:`FsyncPolicy`
says when writes are forced to disk.  A segment is named by the seq of its
first record (``00000000000000001234.seg``, 20 digits so names sort as
numbers) and holds::

    segment  := preamble record*
    preamble := magic "DRGSPL" (6) | version u8 | reserved u8 (0) | incarnation u64
    record   := length u32 | crc32c u32 | seq u64 | prev_seq u64 | time_us u64
                | payload[length]
                (big-endian; the CRC covers seq, prev_seq, time_us and payload:
                a wrong length moves the payload's bounds and so fails the CRC too)

``incarnation`` is the site's, whose stream numbered the records.
``prev_seq`` is the seq of the event the tap forwarded before this one (or
the join point for the first event after a join): no event lies between
``prev_seq`` and ``seq``.  The records therefore say themselves whether the
spool holds a stretch of the stream without a gap (:class:`Chain`).

:class:`Segment` is the in-memory index of one segment: its first and last
seq, its size, its record count and a sparse list of ``(seq, offset, ordinal)``
record starts, one every :data:`INDEX_INTERVAL` bytes.  :func:`read_segment` starts at the nearest
index entry, so it scans at most that many bytes of headers before the first
record it returns; CRCs are checked on read as well.

:func:`scan_segment` rebuilds a segment's index at start, checking every CRC.
Two kinds of damage:

* a torn tail: the last record is cut short (the file ends inside it), or
  fails its CRC and nothing but zero bytes follows it (a file system that
  extended the file but never wrote the data).  That is what a crash
  mid-write leaves; the tail is truncated away and logged, and the caller is
  told.  A torn segment that is not the last one may have lost events up to
  the next segment: the next record's ``prev_seq`` says exactly which, and
  :class:`Chain` reports them as lost.
* a bad record followed by more data: that is not a crash artefact but disk
  corruption.  We refuse to guess which events it held:
  :class:`SpoolCorruptError` names the file and byte offset and the fix.

Everything here is synchronous file I/O on the caller's thread.
"""

from __future__ import annotations

import bisect
import enum
import fcntl
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import construct as c
from crc32c import crc32c

from protocol.errors import DrgateError

log = logging.getLogger("gateway.spool")

# One sparse index entry every 64 KiB: a read scans at most that many bytes
# of headers before its first record; the index costs ~16 bytes per 64 KiB.
INDEX_INTERVAL: Final = 64 << 10
# A record longer than this is corruption: payloads are bus commands, which
# the bus caps well below it.
MAX_PAYLOAD: Final = 64 << 20
U64_MAX: Final = (1 << 64) - 1

MAGIC: Final = b"DRGSPL"
# 2: the incarnation in the preamble, prev_seq in every record.
VERSION: Final = 2
SEGMENT_SUFFIX: Final = ".seg"
LOCK_FILE: Final = "spool.lock"


class SpoolError(DrgateError):
    """The spool cannot do what was asked (directory in use, order violated...)."""


class SpoolCorruptError(SpoolError):
    """A segment holds bytes that are neither records nor a torn tail.

    ``path`` and ``offset`` say where.
    """

    def __init__(self, path: Path, offset: int, what: str) -> None:
        self.path = path
        self.offset = offset
        super().__init__(
            f"{path}: byte offset {offset}: {what}. The spool is corrupted, not torn by a "
            f"crash. Fix: stop the sidecar, move {path.parent} aside (keep it for "
            "analysis) and restart; the sidecar starts with an empty spool and the "
            "egress resyncs D."
        )


class FsyncPolicy(enum.Enum):
    """When appended events are forced to disk.

    * ``never``: never fsync; the OS writes back when it likes.  A crashed
      sidecar loses nothing (the data is in the page cache); a crashed machine
      may lose the last seconds.  For tmpfs, tests and benchmarks.
    * ``batch``: one ``fdatasync`` at the end of every :meth:`gateway.spool.Spool.append_many`
      (and of a segment when it is rolled): the batch is on disk when the call
      returns.  The default.
    * ``always``: ``fdatasync`` after every record.  Slow; for the paranoid.
    """

    NEVER = "never"
    BATCH = "batch"
    ALWAYS = "always"


def lock_directory(directory: Path) -> int:
    """Take the spool directory's lock for this process; returns the lock file's fd.

    Raises :class:`SpoolError` if another process holds it.
    """
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SpoolError(
            f"{directory}: the spool directory is in use by another process "
            "(another sidecar on this node?). Fix: give each sidecar its own spool "
            "directory, or stop the other one."
        ) from None
    return fd


# --- on-disk definitions ------------------------------------------------------

# preamble: magic "DRGSPL" (6) | version u8 | reserved u8 (0) | incarnation u64
Preamble = c.Struct(
    "magic" / c.Const(MAGIC),
    "version" / c.Int8ub,
    "reserved" / c.Const(0, c.Int8ub),
    "incarnation" / c.Int64ub,
).compile()
_PREAMBLE: Final = struct.Struct(">6sBBQ")
PREAMBLE_SIZE: Final = _PREAMBLE.size
_PREAMBLE_START: Final = struct.Struct(">6sB")  # what every version shares


def preamble(incarnation: int) -> bytes:
    """A new segment's first bytes."""
    return _PREAMBLE.pack(MAGIC, VERSION, 0, incarnation)


def read_preamble(path: Path) -> tuple[int, int | None] | None:
    """(version, incarnation) of a segment file, incarnation ``None`` for another
    version; ``None`` for a file cut before its preamble ended.  Raises
    :class:`SpoolCorruptError` if it is not a spool segment at all."""
    with open(path, "rb") as f:
        data = f.read(PREAMBLE_SIZE)
    if len(data) < _PREAMBLE_START.size:
        return None
    magic, version = _PREAMBLE_START.unpack_from(data)
    if magic != MAGIC:
        raise SpoolCorruptError(path, 0, f"not a spool segment (magic {magic!r})")
    if version != VERSION:
        return version, None
    if len(data) < PREAMBLE_SIZE:
        return None
    return version, _PREAMBLE.unpack(data)[3]


# record header: length u32 | crc32c u32 | seq u64 | prev_seq u64 | time_us u64,
# then payload[length].  The construct definition is the declared layout (tests
# parse with it); the hot paths use the equivalent struct, about ten times faster.
RecordHeader = c.Struct(
    "length" / c.Int32ub,
    "crc" / c.Int32ub,
    "seq" / c.Int64ub,
    "prev_seq" / c.Int64ub,
    "time_us" / c.Int64ub,
).compile()
HEADER_STRUCT: Final = struct.Struct(">IIQQQ")
HEADER_SIZE: Final = HEADER_STRUCT.size
_SEQ_PREV_TIME: Final = struct.Struct(">QQQ")


def record_crc(seq: int, prev_seq: int, time_us: int, payload: bytes) -> int:
    """The CRC32C a record carries: over seq, prev_seq, time_us (big-endian u64), payload."""
    return crc32c(payload, crc32c(_SEQ_PREV_TIME.pack(seq, prev_seq, time_us)))


def encode_record(seq: int, time_us: int, payload: bytes, prev_seq: int) -> bytes:
    """One record's bytes."""
    crc = record_crc(seq, prev_seq, time_us, payload)
    return HEADER_STRUCT.pack(len(payload), crc, seq, prev_seq, time_us) + payload


def check_event(seq: int, time_us: int, payload: bytes, prev_seq: int, last: int | None) -> None:
    """Raise :class:`SpoolError` unless the event may follow seq ``last``."""
    if last is not None and seq <= last:
        raise SpoolError(
            f"event seq {seq} is not above the last appended seq {last}; "
            "seqs must be strictly increasing"
        )
    if not (0 <= seq <= U64_MAX and 0 <= time_us <= U64_MAX and 0 <= prev_seq < seq):
        raise SpoolError(f"seq {seq}, prev_seq {prev_seq} or time_us {time_us} is wrong")
    if len(payload) > MAX_PAYLOAD:
        raise SpoolError(f"payload of seq {seq} is {len(payload)} bytes, max {MAX_PAYLOAD}")


def segment_name(first_seq: int) -> str:
    return f"{first_seq:020d}{SEGMENT_SUFFIX}"


def seq_of(path: Path) -> int:
    """The first seq a segment file is named by."""
    try:
        return int(path.name[: -len(SEGMENT_SUFFIX)])
    except ValueError:
        raise SpoolCorruptError(path, 0, "segment file name is not a seq") from None


@dataclass(slots=True)
class Segment:
    """The in-memory index of one segment file."""

    path: Path
    first_seq: int
    last_seq: int
    size: int  # bytes on disk, preamble included
    count: int  # records
    index_seqs: list[int] = field(default_factory=list)  # sparse: seq of a record start
    index_offsets: list[int] = field(default_factory=list)  # ... its offset
    index_ordinals: list[int] = field(default_factory=list)  # ... and records before it
    last_indexed: int = PREAMBLE_SIZE  # offset of the last index entry (or the preamble end)

    def note_record(self, seq: int, offset: int, ordinal: int) -> None:
        """Record number ``ordinal`` (from 0), of ``seq``, starts at ``offset``:
        index it if the last entry is far enough."""
        if offset - self.last_indexed >= INDEX_INTERVAL:
            self.index_seqs.append(seq)
            self.index_offsets.append(offset)
            self.index_ordinals.append(ordinal)
            self.last_indexed = offset

    def start_at(self, after: int) -> tuple[int, int]:
        """(offset, ordinal) of the indexed record nearest before the first above ``after``."""
        k = bisect.bisect_right(self.index_seqs, after) - 1
        if k < 0:
            return PREAMBLE_SIZE, 0
        return self.index_offsets[k], self.index_ordinals[k]


class Chain:
    """Follows records in stream order and finds the gaps above a floor.

    ``floor`` first is the spool's; every gap (a record whose ``prev_seq`` is
    above both the floor and the seq before it) is added to ``losses`` and
    raises ``floor`` past it, so the spool holds every event in
    ``(floor, top]``.
    """

    __slots__ = ("floor", "losses", "top")

    def __init__(self, floor: int) -> None:
        self.floor = floor
        self.top = floor  # max(floor, last seq seen)
        self.losses: list[Lost] = []

    def see(self, seq: int, prev_seq: int) -> None:
        if prev_seq > self.top:
            self.losses.append((self.top + 1, prev_seq))
            self.floor = prev_seq
        self.top = max(self.top, seq)


# --- scanning (recovery) ------------------------------------------------------

Lost = tuple[int, int]  # first and last seq of a range of events that may be lost


def segment_paths(directory: Path) -> list[Path]:
    """The segment files of a spool directory, in seq order."""
    return sorted(p for p in directory.iterdir() if p.name.endswith(SEGMENT_SUFFIX) and p.is_file())


def scan_segment(path: Path, chain: Chain) -> tuple[Segment | None, bool]:
    """Index one segment, truncating a torn tail.  Returns (segment or None if empty, torn).

    The caller checked the preamble (:func:`read_preamble`).  Raises
    :class:`SpoolCorruptError` on anything a crash cannot leave.
    """
    data = path.read_bytes()
    named_first = seq_of(path)
    if len(data) < PREAMBLE_SIZE:
        # Created, crashed before the preamble was written.
        return None, bool(data)
    seg = Segment(path, named_first, named_first, PREAMBLE_SIZE, 0)
    offset = PREAMBLE_SIZE
    end = len(data)
    torn = False
    while offset < end:
        rec_end = _check_record(path, data, offset, seg, chain)
        if rec_end is None:
            torn = True
            _truncate(path, offset, end)
            break
        offset = rec_end
    seg.size = offset
    return (seg if seg.count else None), torn


def scan_directory(directory: Path, chain: Chain) -> list[Segment]:
    """Index every segment in ``directory``, in seq order; may take a while (reads them all).

    Truncates torn tails and deletes empty segments.  ``chain`` (opened at the
    spool's floor) collects the gaps: a torn segment that is not the last one
    (pages written out of order before a machine crash) lost the events up to
    the ``prev_seq`` of the next record.  Raises :class:`SpoolCorruptError` on
    corruption.
    """
    segments: list[Segment] = []
    for path in segment_paths(directory):
        seg, _torn = scan_segment(path, chain)
        if seg is None:
            log.warning("spool.recover dropped=empty-segment file=%s", path)
            path.unlink()
            continue
        if segments and seg.first_seq <= segments[-1].last_seq:
            raise SpoolCorruptError(
                path,
                PREAMBLE_SIZE,
                f"first seq {seg.first_seq} is not above the previous segment's last "
                f"seq {segments[-1].last_seq}",
            )
        segments.append(seg)
    for first, last in chain.losses:
        log.warning(
            "spool.recover lost=gap dir=%s first_seq=%d last_seq=%d action=D-needs-resync",
            directory,
            first,
            last,
        )
    return segments


def _check_record(path: Path, data: bytes, offset: int, seg: Segment, chain: Chain) -> int | None:
    """Index the record at ``offset`` and return its end; ``None`` if the tail is torn there."""
    end = len(data)
    if end - offset < HEADER_SIZE:
        return None
    length, crc, seq, prev_seq, time_us = HEADER_STRUCT.unpack_from(data, offset)
    rec_end: int = offset + HEADER_SIZE + length
    if length > MAX_PAYLOAD:
        raise SpoolCorruptError(path, offset, f"record length {length} is impossible")
    if rec_end > end:  # the file ends inside the record: cut mid-write
        return None
    if record_crc(seq, prev_seq, time_us, data[offset + HEADER_SIZE : rec_end]) != crc:
        if rec_end == end or not data[offset:].strip(b"\x00"):
            return None  # a bad last record, or one the file system never wrote
        raise SpoolCorruptError(path, offset, f"CRC mismatch in the record of seq {seq}")
    if seg.count == 0 and seq != seg.first_seq:
        raise SpoolCorruptError(
            path, offset, f"first record has seq {seq}, the file name says {seg.first_seq}"
        )
    if seg.count and seq <= seg.last_seq:
        raise SpoolCorruptError(path, offset, f"seq {seq} after seq {seg.last_seq}")
    if prev_seq >= seq:
        raise SpoolCorruptError(path, offset, f"seq {seq} says it follows seq {prev_seq}")
    chain.see(seq, prev_seq)
    seg.note_record(seq, offset, seg.count)
    seg.count += 1
    seg.last_seq = seq
    return rec_end


def _truncate(path: Path, torn_at: int, end: int) -> None:
    log.warning(
        "spool.recover truncated=torn-tail file=%s offset=%d dropped_bytes=%d",
        path,
        torn_at,
        end - torn_at,
    )
    with open(path, "r+b") as f:
        f.truncate(torn_at)
        os.fsync(f.fileno())


# --- reading ------------------------------------------------------------------

Event = tuple[int, int, bytes, int]  # seq, time_us, payload, prev_seq


def read_segment(
    seg: Segment, after: int, budget: int, out: list[Event], *, start: int | None = None
) -> int:
    """Append to ``out`` the events of ``seg`` above ``after``; returns the budget left.

    Reads from ``start``, the offset of a record at or before the first above
    ``after`` (default: the sparse index's nearest).  Stops (returning 0)
    before a record's bytes (header included) would pass ``budget``, unless
    ``out`` is empty.  Raises :class:`SpoolCorruptError` if a record read back
    fails its CRC or the file is shorter than indexed.
    """
    offset = seg.start_at(after)[0] if start is None else start
    end = seg.size
    chunk = max(INDEX_INTERVAL, min(budget, 8 << 20)) + INDEX_INTERVAL
    with open(seg.path, "rb", buffering=0) as f:
        while offset < end:
            f.seek(offset)
            want = min(chunk, end - offset)
            data = f.read(want)
            if len(data) < want:  # (a record cut off here would be re-read forever)
                raise SpoolCorruptError(
                    seg.path, offset + len(data), "segment shorter than indexed"
                )
            if len(data) < HEADER_SIZE:
                raise SpoolCorruptError(seg.path, offset, "record runs past the end")
            pos = 0
            while pos + HEADER_SIZE <= len(data):
                length, crc, rseq, prev, time_us = HEADER_STRUCT.unpack_from(data, pos)
                rec_end = pos + HEADER_SIZE + length
                if rec_end > len(data):
                    if offset + rec_end > end:
                        raise SpoolCorruptError(seg.path, offset + pos, "record runs past the end")
                    if pos == 0:  # a record larger than the chunk
                        chunk = HEADER_SIZE + length
                    break
                if rseq > after:
                    if out and HEADER_SIZE + length > budget:
                        return 0
                    payload = data[pos + HEADER_SIZE : rec_end]
                    if record_crc(rseq, prev, time_us, payload) != crc:
                        raise SpoolCorruptError(
                            seg.path, offset + pos, f"CRC mismatch reading seq {rseq}"
                        )
                    out.append((rseq, time_us, payload, prev))
                    budget -= HEADER_SIZE + length
                    if budget <= 0:
                        return 0
                pos = rec_end
            offset += pos
    return budget


def first_above(seg: Segment, after: int) -> tuple[int, int]:
    """(records of ``seg`` at or below ``after``, time_us of the first record above it).

    Reads headers from the nearest index entry (at most :data:`INDEX_INTERVAL`
    bytes and one record); ``seg`` must hold a record above ``after``.
    """
    offset, ordinal = seg.start_at(after)
    with open(seg.path, "rb", buffering=0) as f:
        while offset < seg.size:
            f.seek(offset)
            want = min(INDEX_INTERVAL + HEADER_SIZE, seg.size - offset)
            data = f.read(want)
            if len(data) < want:
                raise SpoolCorruptError(
                    seg.path, offset + len(data), "segment shorter than indexed"
                )
            pos = 0
            while pos + HEADER_SIZE <= len(data):
                length, _crc, seq, _prev, time_us = HEADER_STRUCT.unpack_from(data, pos)
                if seq > after:
                    return ordinal, time_us
                ordinal += 1
                pos += HEADER_SIZE + length
            if not pos:  # less than a record header left before the indexed end
                break
            offset += pos
    raise SpoolCorruptError(seg.path, offset, f"no record above seq {after} where indexed")
