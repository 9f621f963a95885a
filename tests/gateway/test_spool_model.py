"""The spool (gateway/spool.py) against a model of its segment files.

Random appends (some on a full disk), trims, reads, reopens, rejoins,
whole-site recoveries and new incarnations.  The model keeps the segments
itself, from the documented rules only: a segment rolls when the next record
would take it past ``segment_bytes``; an overflow deletes the oldest whole
segments, never the one being written, until the spool fits ``max_bytes``
again, and raises the floor past the unacked events it held; a trim deletes
the segments wholly at or below the watermark.  What the spool holds, its
size and its floor are compared with that, never taken from the spool.

Only where a disk failed does the model look at the disk (which events the
failing writes let through, which segment files exist, whether the last one
is still open for appending): where a write stops is the disk's doing.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gateway import spoolfile as sf
from gateway import spoolstate as ss
from gateway.spool import Spool

Event = tuple[int, int, bytes, int]


def read_all(spool: Spool, after: int = 0) -> list[Event]:
    return spool.read_after(after, 1 << 40)


def record_bytes(event: Event) -> int:
    return sf.HEADER_SIZE + len(event[2])


def segment_bytes(segment: list[Event]) -> int:
    return sf.PREAMBLE_SIZE + sum(map(record_bytes, segment))


class SpoolMachine(RuleBasedStateMachine):
    """The model: ``segments`` (the events of each segment file, oldest first),
    whether the last one is open for appending, the watermark, bounds on the
    floor, and the losses that make the spool ``overflowed``."""

    MAX = 6000
    SEG = 1500

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="spool-model-"))
        self.incarnation = 9
        self.recoveries: list[int] = []  # the cseq each whole-site recovery continued from
        self.spool = self.open()
        self.next_seq = 1
        self.last = 0  # the seq of the last event produced (as the tap's prev_seq)
        self.forget(0)

    def forget(self, floor: int) -> None:
        """A new spool whose floor and watermark are ``floor``."""
        self.segments: list[list[Event]] = []
        self.tail_open = False
        self.appended: list[Event] = []  # every event written since
        self.trimmed = floor
        # The floor lies in [floor_lo, floor_hi]: equal while nothing failed.
        self.floor_lo = self.floor_hi = floor
        # Losses make the spool ``overflowed`` until D is acked past them.  An
        # overflow's is written down before its segments go; a failed write's
        # may not be (the disk failed), and a restart can forget it.
        self.lost_written = 0
        self.lost_in_memory = 0
        self.lost_any = 0

    def open(self, start_after: int | None = None) -> Spool:
        return Spool.open(
            self.dir,
            max_bytes=self.MAX,
            segment_bytes=self.SEG,
            fsync="never",
            incarnation=self.incarnation,
            start_after=start_after,
            recoveries=self.recoveries,
        )

    def teardown(self) -> None:
        self.spool.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- the model's rules ---------------------------------------------------------

    def lose(self, upto: int, *, written: bool) -> None:
        self.floor_lo, self.floor_hi = max(self.floor_lo, upto), max(self.floor_hi, upto)
        self.lost_any = max(self.lost_any, upto)
        if written:
            self.lost_written = max(self.lost_written, upto)
        else:
            self.lost_in_memory = max(self.lost_in_memory, upto)

    def take(self, event: Event) -> None:
        """A written event: into the open segment, or a new one if it would not fit."""
        if not self.tail_open or segment_bytes(self.segments[-1]) + record_bytes(event) > self.SEG:
            self.segments.append([])
            self.tail_open = True
        self.segments[-1].append(event)
        self.appended.append(event)
        while sum(map(segment_bytes, self.segments)) > self.MAX and len(self.segments) > 1:
            self.drop_head()

    def drop_head(self) -> None:
        dropped = self.segments.pop(0)
        if dropped[-1][0] > self.trimmed:  # unacked events went: D needs a resync
            self.lose(dropped[-1][0], written=True)
        self.tail_open = self.tail_open and bool(self.segments)

    def restarted(self) -> None:
        """The spool was closed and opened again: the last segment is open for
        appending; a loss whose state could not be written may be forgotten."""
        self.tail_open = bool(self.segments)
        self.lost_in_memory = 0

    def expected(self, after: int = 0) -> list[Event]:
        above = max(after, self.trimmed)
        return [e for segment in self.segments for e in segment if e[0] > above]

    def batch(self, sizes: list[int], gaps: list[int]) -> list[Event]:
        out = []
        for size, gap in zip(sizes, gaps, strict=False):
            out.append((self.next_seq, self.next_seq * 7, os.urandom(size), self.last))
            self.last = self.next_seq
            self.next_seq += gap
        return out

    # --- what the disk decided, where it failed -------------------------------------

    def observe_disk(self, written: list[Event]) -> None:
        """After a failed append: which segment files exist, and whether the
        last one is open; the model's events are laid out in them again."""
        firsts = sorted(int(p.stem) for p in self.dir.glob(f"*{sf.SEGMENT_SUFFIX}"))
        events = [e for segment in self.segments for e in segment] + written
        gone = [e for e in events if not firsts or e[0] < firsts[0]]
        if gone and gone[-1][0] > self.trimmed:  # an overflow before the failure
            self.lose(gone[-1][0], written=True)
        bounds = [*firsts[1:], None][: len(firsts)]
        self.segments = [
            [e for e in events if first <= e[0] and (bound is None or e[0] < bound)]
            for first, bound in zip(firsts, bounds, strict=True)
        ]
        self.appended += written
        last_path = str(self.dir / sf.segment_name(firsts[-1])) if firsts else None
        fds = os.listdir("/proc/self/fd")
        self.tail_open = last_path is not None and any(_target(fd) == last_path for fd in fds)

    # --- rules ------------------------------------------------------------------------

    @rule(
        sizes=st.lists(st.integers(0, 400), min_size=1, max_size=20),
        gaps=st.lists(st.integers(1, 5), min_size=20, max_size=20),
    )
    def append(self, sizes: list[int], gaps: list[int]) -> None:
        batch = self.batch(sizes, gaps)
        self.spool.append_many(batch)
        for event in batch:
            self.take(event)

    @rule(
        sizes=st.lists(st.integers(0, 400), min_size=1, max_size=10),
        gaps=st.lists(st.integers(1, 5), min_size=10, max_size=10),
        budget=st.integers(0, 600),
        state_fails=st.booleans(),
    )
    def append_on_a_full_disk(
        self, sizes: list[int], gaps: list[int], budget: int, state_fails: bool
    ) -> None:
        batch = self.batch(sizes, gaps)
        real = os.write
        left = [budget]

        def write(fd: int, data: bytes | memoryview) -> int:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if not (target.endswith(".seg") or (state_fails and ss.STATE_FILE in target)):
                return real(fd, data)
            if left[0] <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = real(fd, bytes(data[: left[0]]))
            left[0] -= n
            return n

        os.write = write  # type: ignore[assignment]
        try:
            self.spool.append_many(batch)
        finally:
            os.write = real
        held = {e[0] for e in read_all(self.spool)}
        written = [e for e in batch if e[0] in held]
        assert written == batch[: len(written)], "a failed write kept a later event"
        if len(written) == len(batch):
            for event in batch:  # the disk let everything through: as a plain append
                self.take(event)
            return
        self.observe_disk(written)
        # The batch is lost for D: the floor rises to its last seq.  The state
        # may not have been written: a restart can forget the loss (not the floor:
        # every restart here joins at or above it).
        self.lose(batch[-1][0], written=False)

    @precondition(lambda self: self.appended)
    @rule(data=st.data())
    def trim(self, data: st.DataObject) -> None:
        upto = data.draw(st.integers(0, self.last))  # D acks only what was produced
        self.spool.trim(upto)
        self.trimmed = max(self.trimmed, upto)
        self.floor_lo, self.floor_hi = max(self.floor_lo, upto), max(self.floor_hi, upto)
        while self.segments and self.segments[0][-1][0] <= self.trimmed:
            self.segments.pop(0)
        self.tail_open = self.tail_open and bool(self.segments)

    @rule(data=st.data(), budget=st.integers(1, 3000))
    def read(self, data: st.DataObject, budget: int) -> None:
        after = data.draw(st.integers(0, self.next_seq))
        got = self.spool.read_after(after, budget)
        want = self.expected(after)
        assert got == want[: len(got)]
        if want:
            assert got
            used = sum(map(record_bytes, got))
            assert len(got) == 1 or used <= budget
            if len(got) < len(want):
                assert used + record_bytes(want[len(got)]) > budget

    @rule()
    def reopen(self) -> None:
        """A restart: the sidecar joins again where the stream is.  (Without a
        join point, a failed write whose state could not be saved either and
        that no later record follows would be forgotten.)"""
        self.spool.close()
        self.spool = self.open(start_after=self.last)
        self.floor_lo = self.floor_hi = self.last  # every floor so far is at or below it
        self.restarted()

    @rule(gap=st.integers(0, 30))
    def rejoin(self, gap: int) -> None:
        """The sidecar was down while the stream went on; it joins again."""
        join = self.next_seq - 1 + gap
        self.spool.close()
        self.spool = self.open(start_after=join)
        self.last, self.next_seq = join, join + 1
        self.floor_lo = self.floor_hi = join
        self.restarted()

    @rule(data=st.data(), gap=st.integers(0, 30))
    def whole_site_recovery(self, data: st.DataObject, gap: int) -> None:
        """The whole site restarted and continued from a journal at a cseq
        between D's acks and the stream's end, then went on by ``gap`` while
        this sidecar was down."""
        cseq = data.draw(st.integers(self.trimmed, max(self.trimmed, self.last)))
        # At most what it holds (a floor it could not persist is forgotten).
        held = max([self.floor_hi, *(e[0] for e in self.appended[-1:])])
        join = cseq + gap
        asides = len(list(self.dir.glob(f"{ss.SET_ASIDE_PREFIX}*")))
        self.spool.close()
        self.recoveries.append(cseq)
        self.spool = self.open(start_after=join)
        assert self.spool.written_under == len(self.recoveries) - 1
        set_aside = len(list(self.dir.glob(f"{ss.SET_ASIDE_PREFIX}*"))) > asides
        if any(e[0] > cseq for segment in self.segments for e in segment):  # another history
            assert set_aside
        self.last, self.next_seq = join, join + 1
        if set_aside:
            assert held > cseq
            self.forget(join)
            return
        # What the spool lost above cseq is the other history's: the floor is
        # the join point, or a persisted one above it.
        self.floor_lo, self.floor_hi = join, max(self.floor_hi, join)
        self.restarted()

    @rule(gap=st.integers(0, 30))
    def new_incarnation(self, gap: int) -> None:
        """The whole site restarted as a new incarnation, numbering from ``gap``."""
        self.incarnation += 1
        self.recoveries = []
        self.spool.close()
        self.spool = self.open(start_after=gap)
        self.last, self.next_seq = gap, gap + 1
        self.forget(gap)

    # --- invariants ---------------------------------------------------------------

    @invariant()
    def contents_match(self) -> None:
        want = self.expected()
        assert read_all(self.spool) == want
        assert self.spool.lag(0) == (len(want), want[0][1] if want else None)

    @invariant()
    def honest(self) -> None:
        floor = self.spool.floor
        assert self.floor_lo <= floor <= self.floor_hi
        above = [e for e in self.appended if e[0] > floor]
        assert [e for e in read_all(self.spool) if e[0] > floor] == above
        assert all(self.spool.needs_resync(r) == (r < floor) for r in (0, floor - 1, floor))

    @invariant()
    def bounded(self) -> None:
        stats = self.spool.statistics()
        size = sum(map(segment_bytes, self.segments))
        assert (stats.bytes, stats.segments) == (size, len(self.segments))
        assert stats.bytes == sum(p.stat().st_size for p in self.dir.glob("*.seg"))
        assert stats.bytes <= self.MAX or stats.segments == 1
        if max(self.lost_written, self.lost_in_memory) > self.trimmed:
            assert stats.overflowed
        if stats.overflowed:
            assert self.lost_any > self.trimmed
        assert stats.needs_resync == (stats.floor > self.trimmed)


def _target(fd: str) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


TestSpoolModel = SpoolMachine.TestCase
TestSpoolModel.settings = settings(TestSpoolModel.settings, stateful_step_count=30)
