"""The spool's segment files as one log: appending, rolling, dropping, reading.

Theory of operation
-------------------
:class:`SegmentSet` owns the segment files of a spool directory
(gateway/spoolfile.py: their format) and their in-memory index: the list of
:class:`~gateway.spoolfile.Segment`, their last seqs (for bisect), their
bytes, and the active (last) segment open for append.  It knows nothing of
the floor, the watermark or the bound (gateway/spool.py keeps that policy).

An index changes only after the bytes it describes were written:
:meth:`SegmentSet.write` writes a buffer of encoded records and then indexes
them; a write that fails part-way is cut back off the file (or, if even that
fails, the segment is closed for appending and the next open cuts its torn
tail), so memory never says more than the disk holds.

The egress reads what was just appended, event after event.  The set keeps
the active segment's tail, filled only after its write succeeded: the
offsets of its last :data:`TAIL_RECORDS` records, and the events of the last
:data:`RECENT_BYTES` of them.  A read that starts among those events is
answered from memory (no open, read and CRC check of bytes written a moment
before); one further back in the tail starts at the record it wants, not at
the sparse index's entry up to an index interval of records before it.

Everything is synchronous file I/O on the caller's thread.
"""

from __future__ import annotations

import bisect
import errno
import os
from pathlib import Path

from gateway import spoolfile as sf
from gateway.spoolfile import Event, FsyncPolicy, Segment

# Records of the active segment whose offsets are kept (seq, offset: a few
# hundred KiB of ints): the egress's reads of the live stream start there.
TAIL_RECORDS = 8192
# Bytes of records of the active segment kept as events (the egress's read
# size, REPLAY_BYTES): the live stream is sent from memory.
RECENT_BYTES = 1 << 20


class SegmentSet:
    """The segments of one spool directory, oldest first."""

    def __init__(self, directory: Path, fsync: FsyncPolicy, dir_fd: int) -> None:
        self.directory = directory
        self.fsync = fsync
        self.dir_fd = dir_fd
        self.segments: list[Segment] = []
        self.last_seqs: list[int] = []  # mirror of segment.last_seq, for bisect
        self.fd: int | None = None  # the active (last) segment, open for append
        self.bytes = 0
        self.last_seq: int | None = None
        self.appended = 0
        self.fsyncs = 0
        self.dirty = False  # written since the last fsync of the active segment
        # The tail: (seq, offset) of the last records written to _tail_of, and
        # the events of the last of them (_tail_events[i] is the record of
        # _tail_seqs[len(_tail_seqs) - len(_tail_events) + i]), their bytes.
        self._tail_of: Segment | None = None
        self._tail_seqs: list[int] = []
        self._tail_offsets: list[int] = []
        self._tail_events: list[Event] = []
        self._tail_event_bytes = 0

    def adopt(self, segments: list[Segment]) -> None:
        """Take the segments a scan found; the last one becomes the active one."""
        self.segments = segments
        self.last_seqs = [seg.last_seq for seg in segments]
        self.bytes = sum(seg.size for seg in segments)
        if segments:
            self.last_seq = segments[-1].last_seq
            self.fd = os.open(segments[-1].path, os.O_WRONLY | os.O_APPEND)

    def forget(self) -> None:
        """Close and forget every segment, leaving the files (to be set aside)."""
        self.close_active()
        self.segments, self.last_seqs, self.bytes, self.last_seq = [], [], 0, None

    @property
    def active(self) -> Segment | None:
        return self.segments[-1] if self.fd is not None else None

    @property
    def records(self) -> int:
        return sum(s.count for s in self.segments)

    # --- writing ----------------------------------------------------------------

    def write(self, pending: bytearray, notes: list[tuple[int, int]], events: list[Event]) -> None:
        """Write ``pending`` (the records of ``notes``: (seq, offset), encoding
        ``events``) at the end of the active segment, then index them, and
        clear all three.  Raises the write's ``OSError`` after cutting off what
        part of it reached the file."""
        if not pending:
            return
        assert self.fd is not None
        seg = self.segments[-1]
        try:
            with memoryview(pending) as whole:
                done = 0
                while done < len(whole):
                    done += os.write(self.fd, whole[done:])
        except OSError:
            self._cut_partial(seg)
            raise
        for seq, offset in notes:
            seg.note_record(seq, offset, seg.count)
            seg.count += 1
        self._note_tail(seg, notes, events, len(pending))
        seg.last_seq = self.last_seqs[-1] = self.last_seq = notes[-1][0]
        self.appended += len(notes)
        self.bytes += len(pending)
        seg.size += len(pending)
        self.dirty = True
        pending.clear()
        notes.clear()
        events.clear()

    def _note_tail(
        self, seg: Segment, notes: list[tuple[int, int]], events: list[Event], size: int
    ) -> None:
        if self._tail_of is not seg:
            self._tail_of, self._tail_seqs, self._tail_offsets = seg, [], []
            self._tail_events, self._tail_event_bytes = [], 0
        self._tail_seqs += [seq for seq, _ in notes]
        self._tail_offsets += [offset for _, offset in notes]
        self._tail_events += events
        self._tail_event_bytes += size
        if len(self._tail_seqs) > 2 * TAIL_RECORDS:
            del self._tail_seqs[:-TAIL_RECORDS], self._tail_offsets[:-TAIL_RECORDS]
        kept = self._tail_events
        if self._tail_event_bytes > 2 * RECENT_BYTES or len(kept) > len(self._tail_seqs):
            drop, left = 0, self._tail_event_bytes
            while left > RECENT_BYTES or len(kept) - drop > len(self._tail_seqs):
                left -= sf.HEADER_SIZE + len(kept[drop][2])
                drop += 1
            del kept[:drop]
            self._tail_event_bytes = left

    def _read_recent(self, seg: Segment, after: int, max_bytes: int) -> list[Event] | None:
        """The events of ``seg`` above ``after`` within ``max_bytes`` (as
        :func:`gateway.spoolfile.read_segment` counts), from memory; None
        unless the tail's events hold the first of them."""
        seqs, events = self._tail_seqs, self._tail_events
        if self._tail_of is not seg or not events:
            return None
        k = bisect.bisect_right(seqs, after)
        first = len(seqs) - len(events)  # where the events begin in the tail
        if k < first or (k == 0 and len(seqs) < seg.count):
            return None  # it starts in records that are on disk only
        out: list[Event] = []
        budget = max_bytes
        for event in events[k - first :]:
            size = sf.HEADER_SIZE + len(event[2])
            if out and size > budget:
                break
            out.append(event)
            budget -= size
            if budget <= 0:
                break
        return out

    def _tail_start(self, seg: Segment, after: int) -> int | None:
        """Where the first record of ``seg`` above ``after`` starts, if the
        tail index covers it (it holds a contiguous run up to the last record)."""
        seqs = self._tail_seqs
        if self._tail_of is not seg or not seqs or seqs[0] > after:
            return None
        k = bisect.bisect_right(seqs, after)
        return self._tail_offsets[k] if k < len(seqs) else seg.size

    def _cut_partial(self, seg: Segment) -> None:
        try:
            assert self.fd is not None
            os.ftruncate(self.fd, seg.size)
        except OSError:
            self.close_active(sync=False)  # the next open cuts the torn tail

    def roll(self, first_seq: int, incarnation: int) -> None:
        """Close the active segment and start a new one named ``first_seq``."""
        self.close_active()
        path = self.directory / sf.segment_name(first_seq)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        try:
            if os.write(fd, sf.preamble(incarnation)) != sf.PREAMBLE_SIZE:
                raise OSError(errno.ENOSPC, "short write of a segment preamble")
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self.fd = fd
        self.segments.append(Segment(path, first_seq, first_seq, sf.PREAMBLE_SIZE, 0))
        self.last_seqs.append(first_seq)
        self.bytes += sf.PREAMBLE_SIZE
        self.dirty = True
        self.sync_dir()

    def drop_empty_active(self) -> None:
        """A segment rolled for a batch that failed holds nothing: drop it (its name would lie)."""
        if self.fd is not None and self.segments[-1].count == 0:
            self.close_active(sync=False)
            seg = self.segments.pop()
            self.last_seqs.pop()
            self.bytes -= seg.size
            seg.path.unlink(missing_ok=True)

    def drop_head(self) -> Segment:
        """Delete the oldest segment (closing it if it is the active one)."""
        if len(self.segments) == 1:
            self.close_active()
        seg = self.segments.pop(0)
        self.last_seqs.pop(0)
        self.bytes -= seg.size
        seg.path.unlink(missing_ok=True)
        return seg

    def drop_through(self, seq: int) -> int:
        """Delete every segment whose last seq is at or below ``seq``; how many."""
        deleted = 0
        while self.segments and self.segments[0].last_seq <= seq:
            self.drop_head()
            deleted += 1
        if deleted:
            self.sync_dir()
        return deleted

    def close_active(self, *, sync: bool = True) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if sync and self.dirty and self.fsync is not FsyncPolicy.NEVER:
                self.fdatasync(fd)
        finally:
            os.close(fd)
            self.dirty = False

    def sync_active(self) -> None:
        if self.fd is not None and self.dirty:
            self.fdatasync(self.fd)
            self.dirty = False

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)
        self.fsyncs += 1

    def sync_dir(self) -> None:
        if self.fsync is not FsyncPolicy.NEVER:
            os.fsync(self.dir_fd)

    # --- reading ------------------------------------------------------------------

    def read_after(self, after: int, max_bytes: int) -> list[Event]:
        """Events above ``after``, at least one if any, within ``max_bytes`` of records."""
        i = bisect.bisect_right(self.last_seqs, after)
        if i == len(self.segments) - 1:
            recent = self._read_recent(self.segments[i], after, max_bytes)
            if recent is not None:
                return recent
        out: list[Event] = []
        budget = max_bytes
        while i < len(self.segments) and (budget > 0 or not out):
            seg = self.segments[i]
            start = self._tail_start(seg, after)
            budget = sf.read_segment(seg, after, budget, out, start=start)
            i += 1
        return out

    def count_after(self, after: int) -> tuple[int, int | None]:
        """(records above ``after``, time_us of the first), or ``(0, None)``."""
        i = bisect.bisect_right(self.last_seqs, after)
        if i == len(self.segments):
            return 0, None
        below, time_us = sf.first_above(self.segments[i], after)
        return sum(s.count for s in self.segments[i:]) - below, time_us
