"""The spool: replication events not yet acknowledged by D, on disk.

Theory of operation
-------------------
An append-only log of events ``(seq, time_us, payload)``, split into segment
files in one directory (gateway/spoolfile.py: format, scan, read, recovery).
Seqs strictly increase and may have gaps (filtered commands make no event).

*Writing.*  :meth:`Spool.append_many` encodes a batch into one buffer and
writes it with as few ``write`` calls as segments it touches, rolling a
segment when the next record would take it past ``segment_bytes``; the
:class:`FsyncPolicy` says when the data is forced to disk.

*Trimming.*  :meth:`Spool.trim` moves the ack watermark: every segment whose
last seq is at or below it is deleted whole; records at or below it in the
head segment stay on disk but are never read again.

*The floor.*  Every event with a seq above ``floor`` is in the spool (or was
never produced).  The floor starts at ``start_after`` for a new directory and
rises with :meth:`trim` and with an overflow.  When D's resume point is below
it, :meth:`Spool.needs_resync` says the spool cannot replay what D misses.

*Overflow.*  The spool is bounded by ``max_bytes`` and never blocks the
producer: a write that would pass the bound first deletes the OLDEST segments
(never the active one), raises the floor to the last seq they held, sets
``overflowed`` and counts it.  The floor and the overflow record are persisted
(``spool.state``, write-and-rename) *before* the segments are deleted, so a
crash cannot forget that D needs a resync.  The spool is never larger than
``max_bytes`` plus one segment.

*Reading.*  :meth:`Spool.read_after` bisects the segments by last seq, then
reads from the nearest sparse index entry of the first one.

*Recovery.*  :meth:`Spool.open` scans every segment (every CRC), truncating
a torn tail.  A torn segment that is not the last one (``fsync=never`` and a
machine crash) may have lost events up to the next segment: the floor rises
past them, as for an overflow.  Corruption raises :class:`SpoolCorruptError`.

*Where it runs.*  Everything is synchronous file I/O on the caller's thread,
and the sidecar calls it all on the trio thread: ``append_many`` in the
applier's after-frame hook (synchronously, in stream order), ``trim`` on D's
acks and the ack watermark, ``read_after`` in the egress loop, ``open`` at
start (after a rejoin the directory is empty).  One thread owning the spool
keeps its invariants without locks: the in-memory index, updated as a batch
is encoded, is never seen ahead of the write that follows in the same call
(a failed write raises out of it); the egress reads only written events, so D
cannot ack past one in flight; and a slow disk slows the applier instead of
filling a queue that would have to drop events (the applier hook cannot
wait).  The price is an event-loop stall per call, measured by
bench/spool_bench.py (ext4 on a virtual disk, 200-byte events; p50 / p99 with
the disk to itself, then with other processes' tests loading it):

    append_many fsync=batch, 1 to 100 events  0.11-0.3 / 0.3-1.8 ms; loaded 0.7-1 / 9 ms
                             1000 events      1 / 2-3.5 ms;          loaded 1.9 / 11 ms
    append_many fsync=never, 100 events       70 / 105-280 µs
    trim (rewrites spool.state), batch        0.4-0.9 / 0.8-1.3 ms;  loaded 2-3 / 12-15 ms
    read_after, p50: 100 newest events        80 µs; a 1 MiB replay page 2.5 ms
    open: the scan, per 45 MB spooled         120-150 ms
    trio.to_thread.run_sync(no-op)            43-66 µs / 0.1-1.2 ms

A hop costs a third to a half of a small batch's fdatasync and would free the
loop only for the rest; even the loaded worst cases (tens of ms) are far
below the link's ping (5 s) and heartbeat timeout (15 s).  The way out, if
they ever matter, is a writer task that owns the spool and takes appends and
trims in stream order through a channel (group-committing what queued up).
:meth:`Spool.statistics`, :attr:`Spool.floor` and
:meth:`Spool.needs_resync` touch only memory.  Not thread-safe: one call at
a time.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gateway import spoolfile as sf
from gateway.spoolfile import Event, FsyncPolicy, Segment, SpoolCorruptError, SpoolError, Watermarks

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
        self._segments: list[Segment] = []
        self._last_seqs: list[int] = []  # mirror of segment.last_seq, for bisect
        self._fd: int | None = None  # the active (last) segment, open for append
        self._dir_fd: int | None = None
        self._lock_fd: int | None = None
        self._bytes = 0
        self._marks = Watermarks(floor=0, trimmed_upto=0)  # persisted in spool.state
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
        if segment_bytes < sf.PREAMBLE_SIZE + sf.HEADER_SIZE:
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
            spool._lock_fd = sf.lock_directory(path)
            spool._dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            marks = sf.load_state(path)
            spool._marks = marks or Watermarks(floor=start_after, trimmed_upto=start_after)
            spool._recover()
            if marks is None:  # the floor of a new spool is a promise: keep it across restarts
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

    # --- persisted state --------------------------------------------------------

    def _save_state(self) -> None:
        sync = self._fdatasync if self.fsync is not FsyncPolicy.NEVER else None
        sf.save_state(self.directory, self._marks, sync)
        self._sync_dir()

    # --- recovery ---------------------------------------------------------------

    def _recover(self) -> None:
        self._segments, losses = sf.scan_directory(self.directory, self._marks.trimmed_upto)
        self._last_seqs = [seg.last_seq for seg in self._segments]
        self._bytes = sum(seg.size for seg in self._segments)
        for first, last in losses:  # treated as an overflow
            self._record_loss(first, last, events=0)
        if self._segments:
            self._last_seq = self._segments[-1].last_seq
            self._fd = os.open(self._segments[-1].path, os.O_WRONLY | os.O_APPEND)
        # Segments wholly acked before a crash between trim's state write and unlink.
        self._delete_acked()
        if losses:
            self._save_state()
        log.info(
            "spool.open dir=%s segments=%d bytes=%d first_seq=%s last_seq=%s floor=%d",
            self.directory,
            len(self._segments),
            self._bytes,
            self._segments[0].first_seq if self._segments else None,
            self._last_seq,
            self._marks.floor,
        )

    # --- writing ----------------------------------------------------------------

    def append(self, seq: int, time_us: int, payload: bytes) -> None:
        """Append one event (see :meth:`append_many`)."""
        self.append_many(((seq, time_us, payload),))

    def append_many(self, events: Iterable[Event]) -> None:
        """Append events in order; may block (write, and fsync per policy).

        Seqs must be strictly increasing and above the last appended one, else
        :class:`SpoolError` (nothing of the batch after the bad event is written).
        Events at or below the ack watermark are not stored (already applied at D)
        and are counted as ``skipped_acked``.  Never blocks for space: a full spool
        drops its oldest segments (see the module docstring).
        """
        pending = bytearray()
        always = self.fsync is FsyncPolicy.ALWAYS
        pack, crc, header_size = sf.HEADER_STRUCT.pack, sf.record_crc, sf.HEADER_SIZE
        try:
            for seq, time_us, payload in events:
                if self._last_seq is not None and seq <= self._last_seq:
                    raise SpoolError(
                        f"{self.directory}: event seq {seq} is not above the last appended "
                        f"seq {self._last_seq}; seqs must be strictly increasing"
                    )
                if not 0 <= seq <= sf.U64_MAX or not 0 <= time_us <= sf.U64_MAX:
                    raise SpoolError(f"seq {seq} or time_us {time_us} is not a u64")
                if len(payload) > sf.MAX_PAYLOAD:
                    raise SpoolError(
                        f"payload of seq {seq} is {len(payload)} bytes, max {sf.MAX_PAYLOAD}"
                    )
                if seq <= self._marks.trimmed_upto:
                    self._skipped += 1
                    continue
                rec_len = header_size + len(payload)
                seg = self._segments[-1] if self._fd is not None else None
                if seg is None or (
                    seg.count > 0 and seg.size + len(pending) + rec_len > self.segment_bytes
                ):
                    self._write(pending)
                    pending.clear()
                    self._roll(seq)
                    seg = self._segments[-1]
                seg.note_record(seq, seg.size + len(pending))
                pending += pack(len(payload), crc(seq, time_us, payload), seq, time_us)
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
        path = self.directory / sf.segment_name(first_seq)
        self._make_room(sf.PREAMBLE_SIZE)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        os.write(fd, sf.PREAMBLE_BYTES)
        self._fd = fd
        seg = Segment(path, first_seq, first_seq, sf.PREAMBLE_SIZE, 0)
        self._segments.append(seg)
        self._last_seqs.append(first_seq)
        self._bytes += sf.PREAMBLE_SIZE
        self._dirty = True
        self._sync_dir()

    def _make_room(self, incoming: int) -> None:
        """Drop the oldest segments (never the active one) so ``incoming`` bytes fit."""
        dropped = False
        while self._bytes + incoming > self.max_bytes and len(self._segments) > 1:
            seg = self._segments[0]
            trimmed = self._marks.trimmed_upto
            if seg.last_seq > trimmed:
                # Unacked events go: persist the loss before the data disappears.
                lost_events = seg.count  # upper bound when the head is partly acked
                self._record_loss(max(seg.first_seq, trimmed + 1), seg.last_seq, lost_events)
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
        m = self._marks
        if m.lost_upto is None or m.lost_upto <= m.trimmed_upto:
            m.first_lost_seq = first  # a new overflow episode
        m.lost_upto = last if m.lost_upto is None else max(m.lost_upto, last)
        m.floor = max(m.floor, last)
        m.overflow_count += 1
        m.overflow_events += events

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
        if upto_seq <= self._marks.trimmed_upto:
            return 0
        self._marks.trimmed_upto = upto_seq
        self._marks.floor = max(self._marks.floor, upto_seq)
        self._save_state()
        return self._delete_acked()

    def mark_resynced(self, upto_seq: int) -> None:
        """D was brought to ``upto_seq`` by a resync snapshot: trim, and clear the overflow."""
        self.trim(upto_seq)

    def _delete_acked(self) -> int:
        deleted = 0
        while self._segments and self._segments[0].last_seq <= self._marks.trimmed_upto:
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
        return self._marks.floor

    @property
    def overflowed(self) -> bool:
        """Events D had not applied were dropped, and D has not been resynced past them."""
        lost = self._marks.lost_upto
        return lost is not None and self._marks.trimmed_upto < lost

    def needs_resync(self, resume_point: int) -> bool:
        """True when the spool cannot replay every event after D's ``resume_point``."""
        return resume_point < self._marks.floor

    # --- reading ------------------------------------------------------------------

    def read_after(self, seq: int, max_bytes: int = 1 << 20) -> list[Event]:
        """Events with a seq above ``seq`` (and above the ack watermark), in order; may block.

        Returns at least one event when there is one, and stops before the
        records' bytes (headers included) would pass ``max_bytes``.  An empty
        list means nothing newer is spooled.  Raises :class:`SpoolCorruptError`
        if a record read back fails its CRC.
        """
        after = max(seq, self._marks.trimmed_upto)
        i = bisect.bisect_right(self._last_seqs, after)
        out: list[Event] = []
        budget = max_bytes
        while i < len(self._segments) and (budget > 0 or not out):
            seg = self._segments[i]
            budget = sf.read_segment(seg, after, budget, out)
            i += 1
        return out

    # --- statistics ---------------------------------------------------------------

    def statistics(self) -> SpoolStatistics:
        """A snapshot; touches only memory."""
        return SpoolStatistics(
            bytes=self._bytes,
            segments=len(self._segments),
            records=sum(s.count for s in self._segments),
            first_seq=self._segments[0].first_seq if self._segments else None,
            last_seq=self._last_seq,
            floor=self._marks.floor,
            trimmed_upto=self._marks.trimmed_upto,
            overflowed=self.overflowed,
            needs_resync=self.needs_resync(self._marks.trimmed_upto),
            overflow_count=self._marks.overflow_count,
            overflow_events=self._marks.overflow_events,
            first_lost_seq=self._marks.first_lost_seq if self.overflowed else None,
            lost_upto=self._marks.lost_upto,
            appended=self._appended,
            skipped_acked=self._skipped,
            fsyncs=self._fsyncs,
            max_bytes=self.max_bytes,
            fsync=self.fsync.value,
        )
