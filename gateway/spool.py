"""The spool: replication events not yet acknowledged by D, on disk.

Theory of operation
-------------------
The spool is an append-only log split into segment files in one directory.
A segment is named by the seq of its first record (``00000000000000001234.seg``,
20 digits so names sort as numbers) and holds::

    segment := preamble record*
    preamble := magic "DRGSPL" (6) | version u8 | reserved u8 (0)
    record   := length u32 | crc32c u32 | seq u64 | time_us u64 | payload[length]
                (big-endian; the CRC covers seq, time_us and payload: a wrong
                length moves the payload's bounds and so fails the CRC too)

Events are ``(seq, time_us, payload)`` with ``seq`` strictly increasing (the
same shape the link carries).  Seqs may have gaps (filtered commands make no
event), so the spool never assumes ``seq + 1`` follows ``seq``.

*Writing.*  :meth:`Spool.append_many` encodes a batch into one buffer and
writes it with as few ``write`` calls as segments it touches.  A segment is
closed (rolled) when the next record would take it past ``segment_bytes``.
The fsync policy (:class:`FsyncPolicy`) says when the data is forced to disk.

*Trimming.*  :meth:`Spool.trim` moves the ack watermark: every segment whose
last seq is at or below it is deleted whole; records at or below it in the
head segment stay on disk but are never read again.

*The floor.*  The spool promises: every event with a seq above ``floor`` is
in the spool (or was never produced).  The floor starts at ``start_after``
for a new directory, rises with :meth:`trim` (D applied everything up to
there) and with an overflow (events up to there were dropped).  The egress
asks :meth:`Spool.needs_resync` with D's resume point: when D's point is below
the floor the spool cannot replay what D is missing and D needs a resync.

*Overflow.*  The spool is bounded by ``max_bytes``.  It never blocks the
producer: when a write would take it past the bound it deletes the OLDEST
segments (keeping the newest events), raises the floor to the last seq they
held, sets ``overflowed`` and counts it.  The floor and the overflow record
are persisted (``spool.state``, written to a temporary file and renamed)
*before* the segments are deleted, so a crash cannot forget that D needs a
resync.  The bound holds on disk at every moment except when the active
segment alone is larger than the room left, so the spool is never larger
than ``max_bytes`` plus one segment.

*Reading.*  :meth:`Spool.read_after` serves replay after a reconnect.  An
in-memory index keeps, per segment, its first and last seq, its size, and
a sparse list of ``(seq, offset)`` record starts, one every
``INDEX_INTERVAL`` bytes; a read bisects to the segment, then to the nearest
index entry, and scans at most ``INDEX_INTERVAL`` bytes of headers before
the first record it returns.  CRCs are checked on read as well.

*Recovery.*  :meth:`Spool.open` on an existing directory scans every segment
once (checking every CRC) to rebuild the index.  Two kinds of damage:

* a torn tail: the last record of a segment is cut short (the file ends
  inside it), or fails its CRC and nothing but zero bytes follows it (a
  file system that extended the file but never wrote the data).  That is
  what a crash mid-write leaves; the tail is truncated away and logged.  If
  it happens in a segment that is not the last one (possible only with
  ``fsync=never`` after a machine crash, which may write pages out of order),
  events after the cut may be missing: the floor rises to the next segment's
  first seq minus one, as for an overflow.
* a bad record followed by more data: that is not a crash artefact but disk
  corruption.  We refuse to guess which events it held: :class:`SpoolCorruptError`
  names the file and byte offset and the fix (move the directory aside; the
  sidecar then starts with an empty spool and the egress resyncs D).

Blocking.  Everything here is synchronous file I/O.  Calls that may block on
the disk: :meth:`Spool.open` (scans every segment), :meth:`append_many`
(writes, and fsyncs under ``batch``/``always``), :meth:`trim` (unlinks files
and rewrites the state file), :meth:`read_after` (reads).  The trio caller
runs large ones with ``trio.to_thread.run_sync``; :meth:`statistics` and
:meth:`needs_resync` touch only memory.  A :class:`Spool` is not thread-safe:
one call at a time.
"""

from __future__ import annotations

import bisect
import enum
import fcntl
import json
import logging
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import construct as c
from crc32c import crc32c

from protocol.errors import DrgateError

__all__ = [
    "DEFAULT_FSYNC",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_SEGMENT_BYTES",
    "FsyncPolicy",
    "Spool",
    "SpoolCorruptError",
    "SpoolError",
    "SpoolStatistics",
]

log = logging.getLogger(__name__)


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
    * ``batch``: one ``fdatasync`` at the end of every :meth:`Spool.append_many`
      (and of a segment when it is rolled): the batch is on disk when the call
      returns.  The default.
    * ``always``: ``fdatasync`` after every record.  Slow; for the paranoid.
    """

    NEVER = "never"
    BATCH = "batch"
    ALWAYS = "always"


# The default is ``batch``: the tap appends one batch per bus delivery, so one
# fdatasync is amortised over many events, and a node's spool then survives
# power loss, which matters when a whole site loses power at once (every
# standby's copy goes at the same moment, and D would otherwise need a full
# resync after the site comes back).  ``always`` costs an fsync per event for
# no gain in what P's brokers were promised (they never wait for the spool).
DEFAULT_FSYNC: Final = FsyncPolicy.BATCH
# 1 GiB: at 200-byte events that is ~4.5 M events, minutes of a busy site's
# traffic during a WAN cut before D needs a resync.
DEFAULT_MAX_BYTES: Final = 1 << 30
# 16 MiB: overflow and trim work by whole segments, so this is their grain
# (1.6 % of the default bound); the scan at start reads one at a time.
DEFAULT_SEGMENT_BYTES: Final = 16 << 20
# One sparse index entry every 64 KiB: a read scans at most that many bytes
# of headers before its first record; the index costs ~16 bytes per 64 KiB.
INDEX_INTERVAL: Final = 64 << 10
# A record longer than this is corruption: payloads are bus commands, which
# the bus caps well below it.
MAX_PAYLOAD: Final = 64 << 20
_U64_MAX: Final = (1 << 64) - 1

MAGIC: Final = b"DRGSPL"
VERSION: Final = 1
SEGMENT_SUFFIX: Final = ".seg"
STATE_FILE: Final = "spool.state"
LOCK_FILE: Final = "spool.lock"

# --- on-disk definitions ------------------------------------------------------

# preamble: magic "DRGSPL" (6) | version u8 | reserved u8 (0)
Preamble = c.Struct(
    "magic" / c.Const(MAGIC),
    "version" / c.Int8ub,
    "reserved" / c.Const(0, c.Int8ub),
).compile()
_PREAMBLE: Final = struct.Struct(">6sBB")
PREAMBLE_SIZE: Final = _PREAMBLE.size
_PREAMBLE_BYTES: Final = _PREAMBLE.pack(MAGIC, VERSION, 0)

# record header: length u32 | crc32c u32 | seq u64 | time_us u64, then payload[length]
# The construct definition is the declared layout (tests parse with it); the
# hot paths use the equivalent struct, ~10x faster.
RecordHeader = c.Struct(
    "length" / c.Int32ub,
    "crc" / c.Int32ub,
    "seq" / c.Int64ub,
    "time_us" / c.Int64ub,
).compile()
_HEADER: Final = struct.Struct(">IIQQ")
HEADER_SIZE: Final = _HEADER.size
_SEQ_TIME: Final = struct.Struct(">QQ")


def record_crc(seq: int, time_us: int, payload: bytes) -> int:
    """The CRC32C a record carries: over seq, time_us (big-endian u64) and payload."""
    return crc32c(payload, crc32c(_SEQ_TIME.pack(seq, time_us)))


def encode_record(seq: int, time_us: int, payload: bytes) -> bytes:
    """One record's bytes."""
    return _HEADER.pack(len(payload), record_crc(seq, time_us, payload), seq, time_us) + payload


def segment_name(first_seq: int) -> str:
    return f"{first_seq:020d}{SEGMENT_SUFFIX}"


@dataclass(slots=True)
class _Segment:
    path: Path
    first_seq: int
    last_seq: int
    size: int  # bytes on disk, preamble included
    count: int  # records
    index_seqs: list[int] = field(default_factory=list)  # sparse: seq of a record start
    index_offsets: list[int] = field(default_factory=list)  # ... and its offset
    last_indexed: int = 0  # offset of the last index entry (or the preamble end)

    def note_record(self, seq: int, offset: int) -> None:
        if offset - self.last_indexed >= INDEX_INTERVAL:
            self.index_seqs.append(seq)
            self.index_offsets.append(offset)
            self.last_indexed = offset


@dataclass(frozen=True, slots=True)
class SpoolStatistics:
    """A snapshot for metrics and ``/status``."""

    bytes: int  # on disk, all segments
    segments: int
    records: int  # on disk, including acked ones not yet trimmed away
    first_seq: int | None  # first record on disk
    last_seq: int | None  # last record appended
    floor: int  # every event above it is in the spool
    trimmed_upto: int  # ack watermark
    overflowed: bool  # events D had not applied were dropped; D needs a resync
    needs_resync: bool  # the same, from the spool's point of view (D at its last ack)
    overflow_count: int  # segments dropped because the spool was full (ever)
    overflow_events: int  # events dropped with them (ever, unacked ones only)
    first_lost_seq: int | None  # lowest seq that may have been lost in the current overflow
    lost_upto: int | None  # highest seq lost
    appended: int  # events appended since open
    skipped_acked: int  # appended events at or below the watermark, not stored
    fsyncs: int  # fdatasync calls since open
    max_bytes: int
    fsync: str


class Spool:
    """The on-disk spool.  Open with :meth:`open`; close with :meth:`close`.

    See the module docstring for the format and the guarantees.
    """

    def __init__(self, directory: Path, *, max_bytes: int, segment_bytes: int, fsync: FsyncPolicy):
        # Use Spool.open(); this only sets fields.
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self._segments: list[_Segment] = []
        self._last_seqs: list[int] = []  # mirror of segment.last_seq, for bisect
        self._fd: int | None = None  # the active (last) segment, open for append
        self._dir_fd: int | None = None
        self._lock_fd: int | None = None
        self._bytes = 0
        self._floor = 0
        self._trimmed_upto = 0
        self._lost_upto: int | None = None
        self._first_lost_seq: int | None = None
        self._overflow_count = 0
        self._overflow_events = 0
        self._last_seq: int | None = None
        self._appended = 0
        self._skipped = 0
        self._fsyncs = 0
        self._dirty = False  # written since the last fsync of the active segment

    # --- lifecycle ------------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        fsync: FsyncPolicy | str = DEFAULT_FSYNC,
        start_after: int = 0,
    ) -> Spool:
        """Open (creating if needed) the spool in ``directory``; may block (scans segments).

        ``start_after`` is the floor of a *new* spool: it holds every event above
        it (a fresh sidecar passes the cseq its state transfer was cut at).  An
        existing spool keeps its persisted floor.  ``max_bytes`` must be at least
        twice ``segment_bytes``, so an overflow keeps at least one full segment.

        Raises :class:`SpoolError` if another process has the directory open,
        :class:`SpoolCorruptError` on corruption (not on a torn tail).
        """
        if segment_bytes < PREAMBLE_SIZE + HEADER_SIZE:
            raise ValueError(f"segment_bytes={segment_bytes} is too small")
        if max_bytes < 2 * segment_bytes:
            raise ValueError(
                f"max_bytes={max_bytes} must be at least twice segment_bytes={segment_bytes}"
            )
        policy = FsyncPolicy(fsync)
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        spool = cls(path, max_bytes=max_bytes, segment_bytes=segment_bytes, fsync=policy)
        try:
            spool._lock()
            spool._dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            spool._floor = start_after
            spool._trimmed_upto = start_after
            fresh = not (path / STATE_FILE).exists()
            spool._load_state()
            spool._recover()
            if fresh:  # the floor of a new spool is a promise: keep it across restarts
                spool._save_state()
        except BaseException:
            spool.close()
            raise
        return spool

    def close(self) -> None:
        """Flush (per policy) and release the directory.  Idempotent."""
        if self._fd is not None:
            if self._dirty and self.fsync is not FsyncPolicy.NEVER:
                self._fdatasync(self._fd)
            os.close(self._fd)
            self._fd = None
        for name in ("_dir_fd", "_lock_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _lock(self) -> None:
        self._lock_fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SpoolError(
                f"{self.directory}: the spool directory is in use by another process "
                "(another sidecar on this node?). Fix: give each sidecar its own spool "
                "directory, or stop the other one."
            ) from None

    # --- persisted state --------------------------------------------------------

    def _load_state(self) -> None:
        state_path = self.directory / STATE_FILE
        try:
            text = state_path.read_text()
        except FileNotFoundError:
            return
        try:
            state = json.loads(text)
            if state.get("version") != 1:
                raise ValueError(f"unknown version {state.get('version')!r}")
            self._floor = int(state["floor"])
            self._trimmed_upto = int(state["trimmed_upto"])
            self._lost_upto = None if state["lost_upto"] is None else int(state["lost_upto"])
            first_lost = state["first_lost_seq"]
            self._first_lost_seq = None if first_lost is None else int(first_lost)
            self._overflow_count = int(state["overflow_count"])
            self._overflow_events = int(state["overflow_events"])
        except (ValueError, KeyError, TypeError) as exc:
            raise SpoolCorruptError(state_path, 0, f"unreadable state file ({exc})") from None

    def _save_state(self) -> None:
        state = {
            "version": 1,
            "floor": self._floor,
            "trimmed_upto": self._trimmed_upto,
            "lost_upto": self._lost_upto,
            "first_lost_seq": self._first_lost_seq,
            "overflow_count": self._overflow_count,
            "overflow_events": self._overflow_events,
        }
        tmp = self.directory / (STATE_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, json.dumps(state).encode() + b"\n")
            if self.fsync is not FsyncPolicy.NEVER:
                self._fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.directory / STATE_FILE)
        self._sync_dir()

    # --- recovery ---------------------------------------------------------------

    def _recover(self) -> None:
        paths = sorted(
            p for p in self.directory.iterdir() if p.name.endswith(SEGMENT_SUFFIX) and p.is_file()
        )
        (self.directory / (STATE_FILE + ".tmp")).unlink(missing_ok=True)
        state_changed = False
        for i, path in enumerate(paths):
            is_last = i == len(paths) - 1
            seg, torn = self._scan_segment(path)
            if torn and not is_last:
                # Pages written out of order before a machine crash: events between
                # this cut and the next segment may be gone. Treat as an overflow.
                first = seg.last_seq + 1 if seg is not None else _seq_of(path)
                last = _seq_of(paths[i + 1]) - 1
                if last >= first and last > self._trimmed_upto:
                    self._record_loss(max(first, self._trimmed_upto + 1), last, events=0)
                    state_changed = True
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
            if self._segments and seg.first_seq <= self._segments[-1].last_seq:
                raise SpoolCorruptError(
                    path,
                    PREAMBLE_SIZE,
                    f"first seq {seg.first_seq} is not above the previous segment's last "
                    f"seq {self._segments[-1].last_seq}",
                )
            self._segments.append(seg)
            self._last_seqs.append(seg.last_seq)
            self._bytes += seg.size
        if self._segments:
            self._last_seq = self._segments[-1].last_seq
            self._fd = os.open(self._segments[-1].path, os.O_WRONLY | os.O_APPEND)
        # Segments wholly acked before a crash between trim's state write and unlink.
        self._delete_acked()
        if state_changed:
            self._save_state()
        log.info(
            "spool.open dir=%s segments=%d bytes=%d first_seq=%s last_seq=%s floor=%d",
            self.directory,
            len(self._segments),
            self._bytes,
            self._segments[0].first_seq if self._segments else None,
            self._last_seq,
            self._floor,
        )

    def _scan_segment(self, path: Path) -> tuple[_Segment | None, bool]:
        """Index one segment, truncating a torn tail.  Returns (segment or None if empty, torn)."""
        data = path.read_bytes()
        named_first = _seq_of(path)
        if len(data) < PREAMBLE_SIZE:
            # Created, crashed before the preamble was written.
            return None, bool(data)
        magic, version, _reserved = _PREAMBLE.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise SpoolCorruptError(path, 0, f"not a spool segment (magic {magic!r}, v{version})")
        seg = _Segment(path, named_first, named_first, PREAMBLE_SIZE, 0)
        seg.last_indexed = PREAMBLE_SIZE
        offset = PREAMBLE_SIZE
        end = len(data)
        prev: int | None = None
        torn_at: int | None = None
        while offset < end:
            if end - offset < HEADER_SIZE:
                torn_at = offset
                break
            length, crc, seq, time_us = _HEADER.unpack_from(data, offset)
            rec_end = offset + HEADER_SIZE + length
            if length > MAX_PAYLOAD:
                raise SpoolCorruptError(path, offset, f"record length {length} is impossible")
            if rec_end > end:  # the file ends inside the record: cut mid-write
                torn_at = offset
                break
            payload = data[offset + HEADER_SIZE : rec_end]
            if record_crc(seq, time_us, payload) != crc:
                if rec_end == end or _all_zero(data, offset):
                    torn_at = offset
                    break
                raise SpoolCorruptError(path, offset, f"CRC mismatch in the record of seq {seq}")
            if prev is None and seq != named_first:
                raise SpoolCorruptError(
                    path, offset, f"first record has seq {seq}, the file name says {named_first}"
                )
            if prev is not None and seq <= prev:
                raise SpoolCorruptError(path, offset, f"seq {seq} after seq {prev}")
            seg.note_record(seq, offset)
            seg.count += 1
            seg.last_seq = seq
            prev = seq
            offset = rec_end
        if torn_at is not None:
            log.warning(
                "spool.recover truncated=torn-tail file=%s offset=%d dropped_bytes=%d",
                path,
                torn_at,
                end - torn_at,
            )
            with open(path, "r+b") as f:
                f.truncate(torn_at)
                os.fsync(f.fileno())
        seg.size = offset
        if seg.count == 0:
            return None, torn_at is not None
        return seg, torn_at is not None

    # --- writing ----------------------------------------------------------------

    def append(self, seq: int, time_us: int, payload: bytes) -> None:
        """Append one event (see :meth:`append_many`)."""
        self.append_many(((seq, time_us, payload),))

    def append_many(self, events: Iterable[tuple[int, int, bytes]]) -> None:
        """Append events in order; may block (write, and fsync per policy).

        Seqs must be strictly increasing and above the last appended one, else
        :class:`SpoolError` (nothing of the batch after the bad event is written).
        Events at or below the ack watermark are not stored (already applied at D)
        and are counted as ``skipped_acked``.  Never blocks for space: a full spool
        drops its oldest segments (see the module docstring).
        """
        pending = bytearray()
        always = self.fsync is FsyncPolicy.ALWAYS
        try:
            for seq, time_us, payload in events:
                if self._last_seq is not None and seq <= self._last_seq:
                    raise SpoolError(
                        f"{self.directory}: event seq {seq} is not above the last appended "
                        f"seq {self._last_seq}; seqs must be strictly increasing"
                    )
                if not 0 <= seq <= _U64_MAX or not 0 <= time_us <= _U64_MAX:
                    raise SpoolError(f"seq {seq} or time_us {time_us} is not a u64")
                if len(payload) > MAX_PAYLOAD:
                    raise SpoolError(
                        f"payload of seq {seq} is {len(payload)} bytes, max {MAX_PAYLOAD}"
                    )
                if seq <= self._trimmed_upto:
                    self._skipped += 1
                    continue
                rec_len = HEADER_SIZE + len(payload)
                seg = self._segments[-1] if self._fd is not None else None
                if seg is None or (
                    seg.count > 0 and seg.size + len(pending) + rec_len > self.segment_bytes
                ):
                    self._write(pending)
                    pending.clear()
                    self._roll(seq)
                    seg = self._segments[-1]
                seg.note_record(seq, seg.size + len(pending))
                pending += _HEADER.pack(
                    len(payload), record_crc(seq, time_us, payload), seq, time_us
                )
                pending += payload
                seg.count += 1
                seg.last_seq = seq
                self._last_seqs[-1] = seq
                self._last_seq = seq
                self._appended += 1
                if always:
                    self._write(pending)
                    pending.clear()
                    self._sync_active()
        finally:
            self._write(pending)
        if self.fsync is FsyncPolicy.BATCH:
            self._sync_active()

    def _write(self, data: bytearray) -> None:
        """Write ``data`` at the end of the active segment, making room first."""
        if not data:
            return
        assert self._fd is not None
        self._make_room(len(data))
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        view.release()
        self._bytes += len(data)
        self._segments[-1].size += len(data)
        self._dirty = True

    def _roll(self, first_seq: int) -> None:
        """Close the active segment and start a new one named ``first_seq``."""
        if self._fd is not None:
            if self._dirty and self.fsync is not FsyncPolicy.NEVER:
                self._fdatasync(self._fd)
            os.close(self._fd)
            self._fd = None
            self._dirty = False
        path = self.directory / segment_name(first_seq)
        self._make_room(PREAMBLE_SIZE)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        os.write(fd, _PREAMBLE_BYTES)
        self._fd = fd
        seg = _Segment(path, first_seq, first_seq, PREAMBLE_SIZE, 0)
        seg.last_indexed = PREAMBLE_SIZE
        self._segments.append(seg)
        self._last_seqs.append(first_seq)
        self._bytes += PREAMBLE_SIZE
        self._dirty = True
        self._sync_dir()

    def _make_room(self, incoming: int) -> None:
        """Drop the oldest segments (never the active one) so ``incoming`` bytes fit."""
        dropped = False
        while self._bytes + incoming > self.max_bytes and len(self._segments) > 1:
            seg = self._segments[0]
            if seg.last_seq > self._trimmed_upto:
                # Unacked events go: persist the loss before the data disappears.
                lost_events = seg.count  # upper bound when the head is partly acked
                self._record_loss(
                    max(seg.first_seq, self._trimmed_upto + 1), seg.last_seq, lost_events
                )
                self._save_state()
                log.warning(
                    "spool.overflow dropped_segment=%s first_seq=%d last_seq=%d "
                    "max_bytes=%d action=D-needs-resync",
                    seg.path.name,
                    seg.first_seq,
                    seg.last_seq,
                    self.max_bytes,
                )
            self._drop_head()
            dropped = True
        if dropped:
            self._sync_dir()

    def _record_loss(self, first: int, last: int, events: int) -> None:
        if self._lost_upto is None or self._lost_upto <= self._trimmed_upto:
            self._first_lost_seq = first  # a new overflow episode
        self._lost_upto = last if self._lost_upto is None else max(self._lost_upto, last)
        self._floor = max(self._floor, last)
        self._overflow_count += 1
        self._overflow_events += events

    def _drop_head(self) -> None:
        seg = self._segments.pop(0)
        self._last_seqs.pop(0)
        self._bytes -= seg.size
        seg.path.unlink(missing_ok=True)

    def _sync_active(self) -> None:
        if self._fd is not None and self._dirty:
            self._fdatasync(self._fd)
            self._dirty = False

    def _fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)
        self._fsyncs += 1

    def _sync_dir(self) -> None:
        if self.fsync is not FsyncPolicy.NEVER and self._dir_fd is not None:
            os.fsync(self._dir_fd)

    # --- acks and resync ----------------------------------------------------------

    def trim(self, upto_seq: int) -> int:
        """D applied every event up to ``upto_seq``: raise the watermark; may block.

        Deletes every segment whose last seq is at or below it (the active one
        too: the next append starts a new segment).  Returns how many segments
        were deleted.  A lower ``upto_seq`` than the current watermark is ignored.
        """
        if upto_seq <= self._trimmed_upto:
            return 0
        self._trimmed_upto = upto_seq
        self._floor = max(self._floor, upto_seq)
        self._save_state()
        return self._delete_acked()

    def mark_resynced(self, upto_seq: int) -> None:
        """D was brought to ``upto_seq`` by a resync snapshot: trim, and clear the overflow."""
        self.trim(upto_seq)

    def _delete_acked(self) -> int:
        deleted = 0
        while self._segments and self._segments[0].last_seq <= self._trimmed_upto:
            if len(self._segments) == 1 and self._fd is not None:
                os.close(self._fd)
                self._fd = None
                self._dirty = False
            self._drop_head()
            deleted += 1
        if deleted:
            self._sync_dir()
        return deleted

    @property
    def floor(self) -> int:
        """Every event with a seq above this is in the spool."""
        return self._floor

    @property
    def overflowed(self) -> bool:
        """Events D had not applied were dropped, and D has not been resynced past them."""
        return self._lost_upto is not None and self._trimmed_upto < self._lost_upto

    def needs_resync(self, resume_point: int) -> bool:
        """True when the spool cannot replay every event after D's ``resume_point``."""
        return resume_point < self._floor

    # --- reading ------------------------------------------------------------------

    def read_after(self, seq: int, max_bytes: int = 1 << 20) -> list[tuple[int, int, bytes]]:
        """Events with a seq above ``seq`` (and above the ack watermark), in order; may block.

        Returns at least one event when there is one, and stops before the
        records' bytes (headers included) would pass ``max_bytes``.  An empty
        list means nothing newer is spooled.  Raises :class:`SpoolCorruptError`
        if a record read back fails its CRC.
        """
        after = max(seq, self._trimmed_upto)
        i = bisect.bisect_right(self._last_seqs, after)
        out: list[tuple[int, int, bytes]] = []
        budget = max_bytes
        while i < len(self._segments) and (budget > 0 or not out):
            seg = self._segments[i]
            budget = self._read_segment(seg, after, budget, out)
            i += 1
        return out

    def _read_segment(
        self, seg: _Segment, after: int, budget: int, out: list[tuple[int, int, bytes]]
    ) -> int:
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
                    length, crc, rseq, time_us = _HEADER.unpack_from(data, pos)
                    rec_end = pos + HEADER_SIZE + length
                    if rec_end > len(data):
                        if offset + rec_end > end:
                            raise SpoolCorruptError(
                                seg.path, offset + pos, "record runs past the end"
                            )
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

    # --- statistics ---------------------------------------------------------------

    def statistics(self) -> SpoolStatistics:
        """A snapshot; touches only memory."""
        return SpoolStatistics(
            bytes=self._bytes,
            segments=len(self._segments),
            records=sum(s.count for s in self._segments),
            first_seq=self._segments[0].first_seq if self._segments else None,
            last_seq=self._last_seq,
            floor=self._floor,
            trimmed_upto=self._trimmed_upto,
            overflowed=self.overflowed,
            needs_resync=self.needs_resync(self._trimmed_upto),
            overflow_count=self._overflow_count,
            overflow_events=self._overflow_events,
            first_lost_seq=self._first_lost_seq if self.overflowed else None,
            lost_upto=self._lost_upto,
            appended=self._appended,
            skipped_acked=self._skipped,
            fsyncs=self._fsyncs,
            max_bytes=self.max_bytes,
            fsync=self.fsync.value,
        )


def _seq_of(path: Path) -> int:
    """The first seq a segment file is named by."""
    try:
        return int(path.name[: -len(SEGMENT_SUFFIX)])
    except ValueError:
        raise SpoolCorruptError(path, 0, "segment file name is not a seq") from None


def _all_zero(data: bytes, start: int) -> bool:
    """Whether ``data[start:]`` is only zero bytes (a tail the file system never wrote)."""
    return not data[start:].strip(b"\x00")
