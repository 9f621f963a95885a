"""The spool: replication events not yet acknowledged by D, on disk.

Theory of operation
-------------------
An append-only log of events ``(seq, time_us, payload, prev_seq)``, split into
segment files in one directory (gateway/spoolfile.py: format, scan, read;
gateway/spoolsegments.py: the files as one log; gateway/spoolstate.py: the
state file and the directory's provenance).  Seqs
strictly increase and may have gaps (filtered commands make no event);
``prev_seq`` is the seq of the event forwarded before (the tap's), so the
records say where the stream is whole.

*The floor.*  Every event with a seq above ``floor`` is in the spool, up to
the last one appended: the spool holds ``(floor, held_upto]`` without a gap.
The floor rises with :meth:`trim`, an overflow, a failed write, a gap (a
record whose ``prev_seq`` is above what the spool holds) and a join point
above what the spool holds; each rise is persisted (``spool.state``) before
anything depends on it.  When D's resume point is below the floor,
:meth:`Spool.needs_resync` says the spool cannot replay what D misses: a
resync, never silence.

*Provenance.*  :meth:`Spool.open` takes the site's ``incarnation``, the
join point (``start_after``, the cseq the sidecar's state was cut at) and the
site's whole-site ``recoveries``.  A directory of another incarnation, of
another format, or holding events above the join point or above a recovery
it did not see (another history) is set aside, never replayed, and a new
spool begins at the join point; an existing spool opened with a join point
above its floor raises its floor to it (the events in between went by while
this sidecar was down).

*Writing.*  :meth:`Spool.append_many` encodes a batch and writes it with as
few ``write`` calls as segments it touches, rolling a segment when the next
record would take it past ``segment_bytes``; the :class:`FsyncPolicy` says
when the data is forced to disk.  The in-memory index changes only after a
write succeeded.  A write that fails for the disk (full, quota, file size,
I/O error) never raises: the partial record is cut off, the floor rises to
the last seq of the batch, the failure is counted (``write_errors``) and
logged once per outage, and the sidecar goes on; D resyncs if it needs those
events.

*Trimming.*  :meth:`Spool.trim` moves the ack watermark: every segment whose
last seq is at or below it is deleted whole; records at or below it in the
head segment stay on disk but are never read again.  The watermark is
persisted before a segment goes and at close, not at every ack: after a crash
the spool replays from an older one records D skips as applied.

*Overflow.*  The spool is bounded by ``max_bytes`` and never blocks the
producer: a write that would pass the bound first deletes the OLDEST segments
(never the active one), raises the floor to the last seq they held, sets
``overflowed`` and counts it; the floor is persisted before the segments are
deleted.  The spool is never larger than ``max_bytes`` plus one segment.

*Reading.*  :meth:`Spool.read_after` bisects the segments by last seq, then
reads from the nearest sparse index entry of the first one (the live
stream's last records: from memory).  :meth:`Spool.lag` counts the unacked
records from the per-segment counts and the index, so memory does not grow
with the backlog.

*Recovery.*  :meth:`Spool.open` scans every segment (every CRC), truncating
a torn tail and following the ``prev_seq`` chain: a gap (a torn segment that
is not the last, after ``fsync=never`` and a machine crash) raises the floor
past it.  Corruption raises :class:`SpoolCorruptError`.

*Where it runs.*  Everything is synchronous file I/O on the trio thread, in
the callers' order: ``append_many`` in the applier's after-frame hook,
``trim`` on D's acks and the ack watermark, ``read_after`` in the egress
loop, ``open`` at start and after a rejoin.  One thread owning the spool
keeps its invariants without locks, the egress reads only written events (D
cannot ack past one in flight), and a slow disk slows the applier instead of
filling a queue that would have to drop events.  The stalls this costs are
milliseconds (bench/spool_bench.py lists them), far below the link's ping
(5 s); the way out, if they ever matter, is a writer task that owns the
spool.  The properties and :meth:`Spool.statistics` touch only memory.  Not
thread-safe: one call at a time.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Final

from gateway import spoolfile as sf
from gateway import spoolstate as ss
from gateway.spoolfile import Event, FsyncPolicy, SpoolCorruptError, SpoolError
from gateway.spoolsegments import SegmentSet
from gateway.spoolstate import SpoolStatistics, Watermarks

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
# Failures of the disk, not of the code: a write that fails with one of these
# costs D a resync, never the sidecar's life.
DISK_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


class Spool:
    """The on-disk spool (module docstring).  Open with :meth:`open`; close with :meth:`close`."""

    def __init__(self, directory: Path, *, max_bytes: int, segment_bytes: int, fsync: FsyncPolicy):
        # Use Spool.open(); this only sets fields.
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self._log: SegmentSet | None = None
        self._lock_fd: int | None = None
        self._marks = Watermarks(floor=0, trimmed_upto=0)  # persisted in spool.state
        self._skipped = 0
        self._batch_last: int | None = None  # last seq taken from the batch being appended
        self._write_errors = 0
        self._failing = False  # in a disk outage (logged once)
        self._state_unsaved = False  # the marks changed and could not be persisted
        self._trim_unsaved = False  # trim moved the watermark; not persisted yet
        self.written_under: int | None = None  # recoveries seen by what open found (open)

    @property
    def _segs(self) -> SegmentSet:
        assert self._log is not None, "the spool is closed"
        return self._log

    # --- lifecycle ------------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        fsync: FsyncPolicy | str = DEFAULT_FSYNC,
        incarnation: int | None = None,
        start_after: int | None = None,
        recoveries: Sequence[int] | None = None,
    ) -> Spool:
        """Open (creating if needed) the spool in ``directory``; may block (scans segments).

        ``incarnation`` is the site's (``None``: whatever the spool holds, to
        inspect it; a new spool records 0).  ``start_after`` is the join point:
        the spool holds every event above it from now on (``None``: keep the
        persisted floor).  ``recoveries``: the cseq each whole-site recovery
        continued from, oldest first (``None``: not checked).  Content of
        another incarnation or format, or above the join point or a recovery
        it missed, is set aside (gateway/spoolstate.py; :attr:`written_under`
        says how many recoveries it had seen); a join point above the floor
        raises the floor.  ``max_bytes`` must be at least twice
        ``segment_bytes``, so an overflow keeps at least one full segment.

        Raises :class:`SpoolError` if another process has the directory open,
        :class:`SpoolCorruptError` on corruption (not on a torn tail).
        """
        if segment_bytes < sf.PREAMBLE_SIZE + sf.HEADER_SIZE:
            raise ValueError(f"segment_bytes={segment_bytes} is too small")
        if max_bytes < 2 * segment_bytes:
            raise ValueError(f"max_bytes={max_bytes} is below twice segment_bytes={segment_bytes}")
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        policy = FsyncPolicy(fsync)
        spool = cls(path, max_bytes=max_bytes, segment_bytes=segment_bytes, fsync=policy)
        try:
            spool._lock_fd = sf.lock_directory(path)
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            spool._log = SegmentSet(path, policy, dir_fd)
            spool._load(incarnation, start_after, recoveries)
        except BaseException:
            spool.close()
            raise
        return spool

    def close(self) -> None:
        """Flush (per policy) and release the directory.  Idempotent."""
        if self._log is not None and self._trim_unsaved:
            self._try_save_state()
        log_, self._log = self._log, None
        try:
            if log_ is not None:
                log_.close_active()
        finally:
            if log_ is not None:
                os.close(log_.dir_fd)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- opening ----------------------------------------------------------------

    def _load(
        self, incarnation: int | None, start_after: int | None, recoveries: Sequence[int] | None
    ) -> None:
        marks, why = ss.provenance(self.directory, incarnation)
        label = "unknown" if marks is None else str(marks.incarnation)
        self.written_under = None if marks is None or why else marks.recovery
        if marks is not None and not why:
            self._marks = marks
            self._recover()
            why = ss.lost_history(marks, self.held_upto, start_after, recoveries)
            if why:
                self._segs.forget()
        if why:
            ss.set_aside(self.directory, label, why)
            self._segs.sync_dir()
        if marks is None or why:  # a new spool: its floor is a promise kept across restarts
            self._marks = Watermarks(start_after or 0, start_after or 0, incarnation or 0)
        changed = self._marks.join(self.directory, start_after, recoveries)
        if marks is None or why or changed:
            self._save_state()
        s = self.statistics()
        log.info(
            "spool.open dir=%s incarnation=%d segments=%d bytes=%d last_seq=%s floor=%d",
            *(self.directory, s.incarnation, s.segments, s.bytes, s.last_seq, s.floor),
        )

    def _recover(self) -> None:
        chain = sf.Chain(self._marks.floor)
        self._segs.adopt(sf.scan_directory(self.directory, chain))
        for first, last in chain.losses:
            self._marks.lose(first, last)
        # Segments wholly acked before a crash between trim's state write and unlink.
        self._segs.drop_through(self._marks.trimmed_upto)
        if chain.losses:
            self._save_state()

    # --- persisted state --------------------------------------------------------

    def _save_state(self) -> None:
        segs = self._segs
        sync = segs.fdatasync if self.fsync is not FsyncPolicy.NEVER else None
        ss.save_state(self.directory, self._marks, sync)
        segs.sync_dir()
        self._state_unsaved = self._trim_unsaved = False

    def _try_save_state(self) -> bool:
        """Persist the marks; on a disk failure, count it and retry after the next write."""
        try:
            self._save_state()
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise
            self._state_unsaved = True
            self._disk_failed(exc, ss.STATE_FILE)
            return False
        return True

    # --- writing ----------------------------------------------------------------

    def append(self, seq: int, time_us: int, payload: bytes, prev_seq: int) -> None:
        """Append one event (see :meth:`append_many`)."""
        self.append_many(((seq, time_us, payload, prev_seq),))

    def append_many(self, events: Iterable[Event]) -> None:
        """Append ``(seq, time_us, payload, prev_seq)`` events in order; may block
        (write, and fsync per policy).

        Seqs must be strictly increasing and above the last appended one, and
        ``prev_seq`` below ``seq``, else :class:`SpoolError` (the batch before the
        bad event is written).  Events at or below the ack watermark are not
        stored (already applied at D) and are counted as ``skipped_acked``.
        Never blocks for space (a full spool drops its oldest segments) and never
        raises for a failing disk (see the module docstring).
        """
        it = iter(events)
        self._batch_last = None
        try:
            self._append_all(it)
            if self.fsync is FsyncPolicy.BATCH:
                self._segs.sync_active()
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise
            self._write_failed(exc, it)
            return
        if self._state_unsaved and not self._try_save_state():
            return
        if self._failing:
            self._failing = False
            log.warning(
                "spool.write recovered dir=%s errors=%d", self.directory, self._write_errors
            )

    def _append_all(self, it: Iterator[Event]) -> None:
        segs = self._segs
        pending = bytearray()
        notes: list[tuple[int, int]] = []  # (seq, offset) of the records in pending
        written: list[Event] = []  # and the events they encode
        always = self.fsync is FsyncPolicy.ALWAYS
        pack, crc, header_size = sf.HEADER_STRUCT.pack, sf.record_crc, sf.HEADER_SIZE
        for seq, time_us, payload, prev_seq in it:
            last = notes[-1][0] if notes else segs.last_seq
            try:
                sf.check_event(seq, time_us, payload, prev_seq, last)
            except SpoolError:
                self._flush(pending, notes, written)
                raise
            self._batch_last = seq
            if seq <= self._marks.trimmed_upto:
                self._skipped += 1
                continue
            top = max(self._marks.floor, last or 0)
            if prev_seq > top:  # the events in between never reached the spool
                self._flush(pending, notes, written)
                self._marks.lose(top + 1, prev_seq)
                log.warning("spool.append gap first_seq=%d last_seq=%d", top + 1, prev_seq)
                self._try_save_state()
            rec_len = header_size + len(payload)
            seg = segs.active
            if seg is None or (
                (seg.count or notes) and seg.size + len(pending) + rec_len > self.segment_bytes
            ):
                self._flush(pending, notes, written)
                self._make_room(sf.PREAMBLE_SIZE)
                segs.roll(seq, self._marks.incarnation)
                seg = segs.segments[-1]
            notes.append((seq, seg.size + len(pending)))
            written.append((seq, time_us, payload, prev_seq))
            pending += pack(
                len(payload), crc(seq, prev_seq, time_us, payload), seq, prev_seq, time_us
            )
            pending += payload
            if always:
                self._flush(pending, notes, written)
                segs.sync_active()
        self._flush(pending, notes, written)

    def _flush(self, pending: bytearray, notes: list[tuple[int, int]], events: list[Event]) -> None:
        if pending:
            self._make_room(len(pending))
            self._segs.write(pending, notes, events)

    def _write_failed(self, exc: OSError, rest: Iterator[Event]) -> None:
        """The disk failed a write: the batch's events are lost for D."""
        last = self._batch_last
        for event in rest:  # the events after the failed one are lost too
            last = event[0]
        self._write_errors += 1
        self._segs.drop_empty_active()
        if last is not None and last > self._marks.floor:
            self._marks.lose(self.held_upto + 1, last)
        self._disk_failed(exc, f"the batch up to seq {last}")
        self._try_save_state()

    def _disk_failed(self, exc: OSError, what: str) -> None:
        if self._failing:
            return
        self._failing = True
        log.error(
            "spool.write failed dir=%s what=%s error=%s floor=%d action=D-resyncs-if-needed. "
            "Fix: free space on (or repair) the file system of %s; the spool resumes by itself",
            *(self.directory, what, os.strerror(exc.errno or 0), self._marks.floor, self.directory),
        )

    def _make_room(self, incoming: int) -> None:
        """Drop the oldest segments (never the active one) so ``incoming`` bytes fit."""
        segs = self._segs
        dropped = False
        while segs.bytes + incoming > self.max_bytes and len(segs.segments) > 1:
            seg = segs.segments[0]
            trimmed = self._marks.trimmed_upto
            if seg.last_seq > trimmed:
                # Unacked events go: persist the loss before the data disappears.
                self._marks.lose(max(seg.first_seq, trimmed + 1), seg.last_seq, seg.count)
                self._save_state()
                log.warning(
                    "spool.overflow dropped_segment=%s first_seq=%d last_seq=%d "
                    "max_bytes=%d action=D-needs-resync",
                    *(seg.path.name, seg.first_seq, seg.last_seq, self.max_bytes),
                )
            elif self._trim_unsaved:
                self._save_state()  # the watermark that lets this segment go
            segs.drop_head()
            dropped = True
        if dropped:
            segs.sync_dir()

    # --- acks and resync ----------------------------------------------------------

    def trim(self, upto_seq: int) -> int:
        """D applied every event up to ``upto_seq``: raise the watermark; may block.

        Deletes every segment whose last seq is at or below it (the active one
        too), once the watermark is persisted; returns how many.  A lower
        ``upto_seq`` than the current watermark is ignored.
        """
        if upto_seq <= self._marks.trimmed_upto:
            return 0
        self._marks.trimmed_upto = upto_seq
        self._marks.floor = max(self._marks.floor, upto_seq)
        if not self._segs.segments or self._segs.segments[0].last_seq > upto_seq:
            self._trim_unsaved = True  # nothing to delete: saved later (module docstring)
            return 0
        if not self._try_save_state():
            return 0
        return self._segs.drop_through(self._marks.trimmed_upto)

    def mark_resynced(self, upto_seq: int) -> None:
        """D was brought to ``upto_seq`` by a resync snapshot: trim, and clear the overflow."""
        self.trim(upto_seq)

    @property
    def failing(self) -> bool:
        """The disk failed the last write (an outage, until a write succeeds)."""
        return self._failing

    @property
    def floor(self) -> int:
        """Every event with a seq above this is in the spool."""
        return self._marks.floor

    @property
    def last_seq(self) -> int | None:
        """The seq of the last record appended (None: none); memory only."""
        return self._segs.last_seq

    @property
    def held_upto(self) -> int:
        """The spool holds every event in ``(floor, held_upto]``."""
        return max(self._marks.floor, self._segs.last_seq or 0)

    @property
    def overflowed(self) -> bool:
        """Events D had not applied were lost, and D has not been resynced past them."""
        return self._marks.overflowed

    def needs_resync(self, resume_point: int) -> bool:
        """True when the spool cannot replay every event after D's ``resume_point``."""
        return resume_point < self._marks.floor

    # --- reading ------------------------------------------------------------------

    def read_after(self, seq: int, max_bytes: int = 1 << 20) -> list[Event]:
        """Events with a seq above ``seq`` (and the ack watermark), in order; may block.
        At least one if there is one, and no more once their records' bytes would
        pass ``max_bytes``.  :class:`SpoolCorruptError` if a record fails its CRC."""
        return self._segs.read_after(max(seq, self._marks.trimmed_upto), max_bytes)

    def lag(self, acked_seq: int) -> tuple[int, int | None]:
        """(records above ``acked_seq`` and the watermark, time_us of the first or None)."""
        return self._segs.count_after(max(acked_seq, self._marks.trimmed_upto))

    # --- statistics ---------------------------------------------------------------

    def statistics(self) -> SpoolStatistics:
        """A snapshot; touches only memory."""
        m, segs = self._marks, self._segs
        return SpoolStatistics(
            bytes=segs.bytes,
            segments=len(segs.segments),
            records=segs.records,
            first_seq=segs.segments[0].first_seq if segs.segments else None,
            last_seq=segs.last_seq,
            floor=m.floor,
            held_upto=self.held_upto,
            incarnation=m.incarnation,
            trimmed_upto=m.trimmed_upto,
            overflowed=self.overflowed,
            needs_resync=self.needs_resync(m.trimmed_upto),
            overflow_count=m.overflow_count,
            overflow_events=m.overflow_events,
            first_lost_seq=m.first_lost_seq if self.overflowed else None,
            lost_upto=m.lost_upto,
            appended=segs.appended,
            skipped_acked=self._skipped,
            write_errors=self._write_errors,
            fsyncs=segs.fsyncs,
            max_bytes=self.max_bytes,
            fsync=self.fsync.value,
        )
