"""The spool's files: segment and record format, scanning, reading, the state file.

Theory of operation
-------------------
A spool directory (gateway/spool.py keeps the policy: index, trim, floor,
overflow) holds segment files, a state file and a lock file that one process
holds (:func:`lock_directory`); :class:`FsyncPolicy` says when writes are
forced to disk.  A segment is named by the seq of its first record
(``00000000000000001234.seg``, 20 digits so names sort as numbers) and holds::

    segment := preamble record*
    preamble := magic "DRGSPL" (6) | version u8 | reserved u8 (0)
    record   := length u32 | crc32c u32 | seq u64 | time_us u64 | payload[length]
                (big-endian; the CRC covers seq, time_us and payload: a wrong
                length moves the payload's bounds and so fails the CRC too)

:class:`Segment` is the in-memory index of one segment: its first and last
seq, its size, and a sparse list of ``(seq, offset)`` record starts, one every
:data:`INDEX_INTERVAL` bytes.  :func:`read_segment` starts at the nearest
index entry, so it scans at most that many bytes of headers before the first
record it returns; CRCs are checked on read as well.

:func:`scan_segment` rebuilds a segment's index at start, checking every CRC.
Two kinds of damage:

* a torn tail: the last record is cut short (the file ends inside it), or
  fails its CRC and nothing but zero bytes follows it (a file system that
  extended the file but never wrote the data).  That is what a crash
  mid-write leaves; the tail is truncated away and logged, and the caller is
  told (:func:`scan_directory` reports a torn segment that is not the last one:
  events up to the next segment may be missing).
* a bad record followed by more data: that is not a crash artefact but disk
  corruption.  We refuse to guess which events it held:
  :class:`SpoolCorruptError` names the file and byte offset and the fix.

The state file (``spool.state``, JSON) holds the :class:`Watermarks`; it is
written to a temporary file and renamed, so a crash leaves the old or the new
one, never a mix.

Everything here is synchronous file I/O on the caller's thread.
"""

from __future__ import annotations

import bisect
import enum
import fcntl
import json
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

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
VERSION: Final = 1
SEGMENT_SUFFIX: Final = ".seg"
STATE_FILE: Final = "spool.state"
STATE_VERSION: Final = 1
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

# preamble: magic "DRGSPL" (6) | version u8 | reserved u8 (0)
Preamble = c.Struct(
    "magic" / c.Const(MAGIC),
    "version" / c.Int8ub,
    "reserved" / c.Const(0, c.Int8ub),
).compile()
_PREAMBLE: Final = struct.Struct(">6sBB")
PREAMBLE_SIZE: Final = _PREAMBLE.size
PREAMBLE_BYTES: Final = _PREAMBLE.pack(MAGIC, VERSION, 0)

# record header: length u32 | crc32c u32 | seq u64 | time_us u64, then payload[length]
# The construct definition is the declared layout (tests parse with it); the
# hot paths use the equivalent struct, about ten times faster.
RecordHeader = c.Struct(
    "length" / c.Int32ub,
    "crc" / c.Int32ub,
    "seq" / c.Int64ub,
    "time_us" / c.Int64ub,
).compile()
HEADER_STRUCT: Final = struct.Struct(">IIQQ")
HEADER_SIZE: Final = HEADER_STRUCT.size
_SEQ_TIME: Final = struct.Struct(">QQ")


def record_crc(seq: int, time_us: int, payload: bytes) -> int:
    """The CRC32C a record carries: over seq, time_us (big-endian u64) and payload."""
    return crc32c(payload, crc32c(_SEQ_TIME.pack(seq, time_us)))


def encode_record(seq: int, time_us: int, payload: bytes) -> bytes:
    """One record's bytes."""
    return (
        HEADER_STRUCT.pack(len(payload), record_crc(seq, time_us, payload), seq, time_us) + payload
    )


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
    index_offsets: list[int] = field(default_factory=list)  # ... and its offset
    last_indexed: int = PREAMBLE_SIZE  # offset of the last index entry (or the preamble end)

    def note_record(self, seq: int, offset: int) -> None:
        """A record of ``seq`` starts at ``offset``: index it if the last entry is far enough."""
        if offset - self.last_indexed >= INDEX_INTERVAL:
            self.index_seqs.append(seq)
            self.index_offsets.append(offset)
            self.last_indexed = offset


# --- scanning (recovery) ------------------------------------------------------

Lost = tuple[int, int]  # first and last seq of a range of events that may be lost


def scan_segment(path: Path) -> tuple[Segment | None, bool]:
    """Index one segment, truncating a torn tail.  Returns (segment or None if empty, torn).

    Raises :class:`SpoolCorruptError` on anything a crash cannot leave.
    """
    data = path.read_bytes()
    named_first = seq_of(path)
    if len(data) < PREAMBLE_SIZE:
        # Created, crashed before the preamble was written.
        return None, bool(data)
    magic, version, _reserved = _PREAMBLE.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise SpoolCorruptError(path, 0, f"not a spool segment (magic {magic!r}, v{version})")
    seg = Segment(path, named_first, named_first, PREAMBLE_SIZE, 0)
    offset = PREAMBLE_SIZE
    end = len(data)
    torn = False
    while offset < end:
        rec_end = _check_record(path, data, offset, seg)
        if rec_end is None:
            torn = True
            _truncate(path, offset, end)
            break
        offset = rec_end
    seg.size = offset
    return (seg if seg.count else None), torn


def scan_directory(directory: Path, trimmed_upto: int) -> tuple[list[Segment], list[Lost]]:
    """Index every segment in ``directory``, in seq order; may take a while (reads them all).

    Truncates torn tails, deletes empty segments and a left-over temporary state
    file.  Returns the segments and the seq ranges above ``trimmed_upto`` that
    may be lost: a torn segment that is not the last one (pages written out of
    order before a machine crash) may have lost the events up to the next
    segment's first seq.  Raises :class:`SpoolCorruptError` on corruption.
    """
    paths = sorted(
        p for p in directory.iterdir() if p.name.endswith(SEGMENT_SUFFIX) and p.is_file()
    )
    (directory / (STATE_FILE + ".tmp")).unlink(missing_ok=True)
    segments: list[Segment] = []
    losses: list[Lost] = []
    for i, path in enumerate(paths):
        seg, torn = scan_segment(path)
        if torn and i < len(paths) - 1:
            first = seg.last_seq + 1 if seg is not None else seq_of(path)
            last = seq_of(paths[i + 1]) - 1
            if last >= first and last > trimmed_upto:
                losses.append((max(first, trimmed_upto + 1), last))
                log.warning(
                    "spool.recover lost=torn-middle-segment file=%s first_seq=%d "
                    "last_seq=%d action=D-needs-resync",
                    path,
                    first,
                    last,
                )
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
    return segments, losses


def _check_record(path: Path, data: bytes, offset: int, seg: Segment) -> int | None:
    """Index the record at ``offset`` and return its end; ``None`` if the tail is torn there."""
    end = len(data)
    if end - offset < HEADER_SIZE:
        return None
    length, crc, seq, time_us = HEADER_STRUCT.unpack_from(data, offset)
    rec_end: int = offset + HEADER_SIZE + length
    if length > MAX_PAYLOAD:
        raise SpoolCorruptError(path, offset, f"record length {length} is impossible")
    if rec_end > end:  # the file ends inside the record: cut mid-write
        return None
    if record_crc(seq, time_us, data[offset + HEADER_SIZE : rec_end]) != crc:
        if rec_end == end or not data[offset:].strip(b"\x00"):
            return None  # a bad last record, or one the file system never wrote
        raise SpoolCorruptError(path, offset, f"CRC mismatch in the record of seq {seq}")
    if seg.count == 0 and seq != seg.first_seq:
        raise SpoolCorruptError(
            path, offset, f"first record has seq {seq}, the file name says {seg.first_seq}"
        )
    if seg.count and seq <= seg.last_seq:
        raise SpoolCorruptError(path, offset, f"seq {seq} after seq {seg.last_seq}")
    seg.note_record(seq, offset)
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

Event = tuple[int, int, bytes]


def read_segment(seg: Segment, after: int, budget: int, out: list[Event]) -> int:
    """Append to ``out`` the events of ``seg`` above ``after``; returns the budget left.

    Stops (returning 0) before a record's bytes (header included) would pass
    ``budget``, unless ``out`` is empty.  Raises :class:`SpoolCorruptError` if
    a record read back fails its CRC or the file is shorter than indexed.
    """
    k = bisect.bisect_right(seg.index_seqs, after) - 1
    offset = seg.index_offsets[k] if k >= 0 else PREAMBLE_SIZE
    end = seg.size
    chunk = max(INDEX_INTERVAL, min(budget, 8 << 20)) + INDEX_INTERVAL
    with open(seg.path, "rb", buffering=0) as f:
        while offset < end:
            f.seek(offset)
            data = f.read(min(chunk, end - offset))
            if not data:
                raise SpoolCorruptError(seg.path, offset, "segment shorter than indexed")
            pos = 0
            while pos + HEADER_SIZE <= len(data):
                length, crc, rseq, time_us = HEADER_STRUCT.unpack_from(data, pos)
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
                    if record_crc(rseq, time_us, payload) != crc:
                        raise SpoolCorruptError(
                            seg.path, offset + pos, f"CRC mismatch reading seq {rseq}"
                        )
                    out.append((rseq, time_us, payload))
                    budget -= HEADER_SIZE + length
                    if budget <= 0:
                        return 0
                pos = rec_end
            offset += pos
    return budget


# --- the state file -------------------------------------------------------------


@dataclass(slots=True)
class Watermarks:
    """What the spool persists in ``spool.state`` (see gateway/spool.py for the meaning)."""

    floor: int  # every event above it is in the spool
    trimmed_upto: int  # ack watermark
    lost_upto: int | None = None  # highest seq an overflow dropped
    first_lost_seq: int | None = None  # lowest seq of the current overflow episode
    overflow_count: int = 0  # segments dropped because the spool was full (ever)
    overflow_events: int = 0  # events dropped with them (ever)


def load_state(directory: Path) -> Watermarks | None:
    """The persisted watermarks, or ``None`` for a new spool.

    Raises :class:`SpoolCorruptError` if the file cannot be read as a state.
    """
    state_path = directory / STATE_FILE
    try:
        text = state_path.read_text()
    except FileNotFoundError:
        return None
    try:
        state = json.loads(text)
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unknown version {state.get('version')!r}")
        return Watermarks(
            floor=int(state["floor"]),
            trimmed_upto=int(state["trimmed_upto"]),
            lost_upto=_int_or_none(state["lost_upto"]),
            first_lost_seq=_int_or_none(state["first_lost_seq"]),
            overflow_count=int(state["overflow_count"]),
            overflow_events=int(state["overflow_events"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise SpoolCorruptError(state_path, 0, f"unreadable state file ({exc})") from None


def _int_or_none(value: Any) -> int | None:
    if value is None:
        return None
    return int(value)


def save_state(directory: Path, marks: Watermarks, sync: Callable[[int], None] | None) -> None:
    """Write ``marks`` to a temporary file, ``sync(fd)`` it if given, and rename it in place.

    The caller syncs the directory afterwards if the rename must survive a power loss.
    """
    tmp = directory / (STATE_FILE + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, json.dumps({"version": STATE_VERSION, **asdict(marks)}).encode() + b"\n")
        if sync is not None:
            sync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / STATE_FILE)
