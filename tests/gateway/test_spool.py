"""The spool (gateway/spool.py, spoolfile.py): round trips, recovery, overflow, fsync
(the model-based test is tests/gateway/test_spool_model.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway import spool as sp
from gateway import spoolfile as sf
from gateway import spoolsegments
from gateway import spoolstate as ss
from gateway.spool import FsyncPolicy, Spool, SpoolCorruptError, SpoolError

Event = tuple[int, int, bytes, int]


def events(
    first: int, n: int, size: int = 40, step: int = 1, prev: int | None = None
) -> list[Event]:
    """``n`` events from ``first``, each following the one before (the first
    follows ``prev``, 0 by default: no gap whatever the spool holds)."""
    seqs = range(first, first + n * step, step)
    prevs = [prev or 0, *seqs[:-1]]
    return [(s, 1_000 + s, bytes([s % 251]) * size, p) for s, p in zip(seqs, prevs, strict=True)]


def read_all(spool: Spool, after: int = 0) -> list[Event]:
    return spool.read_after(after, 1 << 40)


def seg_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.seg"))


# --- format -------------------------------------------------------------------


def test_record_layout_matches_the_construct_definition() -> None:
    raw = sf.encode_record(7, 123456, b"hello", 3)
    head = sf.RecordHeader.parse(raw[: sf.HEADER_SIZE])
    assert (head.length, head.seq, head.prev_seq, head.time_us) == (5, 7, 3, 123456)
    assert head.crc == sf.record_crc(7, 3, 123456, b"hello")
    assert raw[sf.HEADER_SIZE :] == b"hello"
    assert sf.RecordHeader.build(head) == raw[: sf.HEADER_SIZE]


def test_segment_is_named_by_first_seq_and_starts_with_preamble(tmp_path: Path) -> None:
    with Spool.open(
        tmp_path, max_bytes=1 << 20, segment_bytes=4096, fsync="never", incarnation=77
    ) as s:
        s.append_many(events(1234, 3))
    (only,) = seg_files(tmp_path)
    assert only.name == "00000000000000001234.seg"
    data = only.read_bytes()
    pre = sf.Preamble.parse(data[: sf.PREAMBLE_SIZE])
    assert (pre.version, pre.incarnation) == (sf.VERSION, 77)
    assert data[sf.PREAMBLE_SIZE :].startswith(sf.encode_record(*events(1234, 1)[0]))


# --- round trips ---------------------------------------------------------------


def test_append_read_trim_reopen(tmp_path: Path) -> None:
    evs = events(1, 200, step=3)  # gaps between seqs
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=2048, fsync="never") as s:
        s.append_many(evs[:50])
        s.append_many(evs[50:])
        assert read_all(s) == evs
        assert read_all(s, 4) == evs[2:]  # 4 is between seqs 4 and 7
        assert s.read_after(evs[-1][0]) == []
        segs_before = s.statistics().segments
        assert segs_before > 5
        deleted = s.trim(evs[99][0])
        assert deleted > 0
        assert s.statistics().segments == segs_before - deleted
        assert read_all(s) == evs[100:]  # records under the watermark are skipped
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=2048, fsync="never") as s:
        assert read_all(s) == evs[100:]
        st_ = s.statistics()
        assert (st_.trimmed_upto, st_.last_seq) == (evs[99][0], evs[-1][0])
        s.append_many(events(1000, 5, prev=evs[-1][0]))
        assert read_all(s) == evs[100:] + events(1000, 5, prev=evs[-1][0])


def test_read_after_respects_byte_budget_but_returns_at_least_one(tmp_path: Path) -> None:
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 16, fsync="never") as s:
        s.append_many(events(1, 100, size=100))
        rec = sf.HEADER_SIZE + 100
        got = s.read_after(0, 10 * rec)
        assert [e[0] for e in got] == list(range(1, 11))
        assert len(s.read_after(0, 10 * rec - 1)) == 9
        assert len(s.read_after(0, 1)) == 1


def test_read_after_large_spool_uses_the_index(tmp_path: Path) -> None:
    # Many index entries per segment; reads from every position agree with a model.
    evs = events(1, 3000, size=200, step=2)
    with Spool.open(tmp_path, max_bytes=1 << 24, segment_bytes=1 << 20, fsync="never") as s:
        s.append_many(evs)
        assert any(len(seg.index_seqs) > 3 for seg in s._segs.segments)
        for k in range(0, 3000, 97):
            after = evs[k][0]
            assert s.read_after(after, 5000)[0] == evs[k + 1] if k + 1 < 3000 else True
            assert s.read_after(after - 1, 1)[0] == evs[k]


def test_order_is_enforced(tmp_path: Path) -> None:
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=4096, fsync="never") as s:
        s.append_many(events(10, 3))
        with pytest.raises(SpoolError, match="strictly increasing"):
            s.append_many([(13, 0, b"", 12), (13, 0, b"", 12)])
        assert read_all(s)[-1][0] == 13  # the good part of the batch was written
        with pytest.raises(SpoolError):
            s.append(5, 0, b"", 4)
        with pytest.raises(SpoolError, match="prev_seq"):
            s.append(20, 0, b"", 20)


def test_events_at_or_below_watermark_are_skipped(tmp_path: Path) -> None:
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=4096, fsync="never") as s:
        s.trim(100)
        s.append_many(events(95, 10))
        assert [e[0] for e in read_all(s)] == list(range(101, 105))
        assert s.statistics().skipped_acked == 6


def test_a_trim_that_deletes_nothing_writes_no_state_until_a_deletion_or_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The egress trims at every ack: rewriting spool.state each time cost it
    a fifth of its CPU (docs/performance.md)."""
    saves: list[int] = []
    real = ss.save_state

    def counting(directory: Path, marks: ss.Watermarks, sync: object) -> None:
        saves.append(marks.trimmed_upto)
        real(directory, marks, sync)  # type: ignore[arg-type]

    monkeypatch.setattr(ss, "save_state", counting)
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=4096, fsync="never") as s:
        s.append_many(events(1, 300))  # several segments of ~60 records
        saves.clear()
        for upto in range(1, 30):  # all in the head segment
            assert s.trim(upto) == 0
        assert saves == []
        assert s.read_after(0)[0][0] == 30
        assert s.trim(200) > 0  # whole segments go: the watermark is saved first
        assert saves == [200]
        s.trim(210)
    assert saves == [200, 210]  # at close
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=4096, fsync="never") as s:
        assert s.statistics().trimmed_upto == 210
        assert s.read_after(0)[0][0] == 211


def test_the_live_tail_is_read_from_memory_as_the_disk_would_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The egress reads what was just appended: the events come from memory
    (each read of the file was an open, a read and a CRC check per record),
    with the byte budget counted as a read of the file counts it; a read
    that starts further back than the recent events goes to the file."""
    reads: list[int] = []
    real = sf.read_segment

    def recording(seg: sf.Segment, after: int, budget: int, out: list[Event], **kw: int) -> int:
        reads.append(after)
        return real(seg, after, budget, out, **kw)

    monkeypatch.setattr(sf, "read_segment", recording)
    monkeypatch.setattr(spoolsegments, "RECENT_BYTES", 100 * (sf.HEADER_SIZE + 100))
    evs = events(1, 400, size=100)
    asked = [(a, b) for a in (0, 299, 300, 301, 395, 399, 400) for b in (1, 250, 1000, 1 << 20)]
    with Spool.open(tmp_path, max_bytes=1 << 24, segment_bytes=1 << 22, fsync="never") as s:
        for first in range(0, 400, 4):
            s.append_many(evs[first : first + 4])
            reads.clear()
            assert s.read_after(first) == evs[first : first + 4]
            assert reads == []
        live = {(a, b): s.read_after(a, b) for a, b in asked}
        assert reads == [0, 0, 0, 0]  # from 0 only: the oldest records are no longer kept
    with Spool.open(tmp_path, max_bytes=1 << 24, segment_bytes=1 << 22, fsync="never") as s:
        assert {(a, b): s.read_after(a, b) for a, b in asked} == live


def test_a_read_of_the_live_tail_starts_at_the_record_it_wants(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of the active segment further back than the recent events:
    without the tail index each read walked up to an index interval (64 KiB)
    of records first."""
    monkeypatch.setattr(spoolsegments, "RECENT_BYTES", 0)
    starts: list[int | None] = []
    real = sf.read_segment

    def recording(seg: sf.Segment, after: int, budget: int, out: list[Event], **kw: int) -> int:
        starts.append(kw.get("start"))
        return real(seg, after, budget, out, **kw)

    monkeypatch.setattr(sf, "read_segment", recording)
    with Spool.open(tmp_path, max_bytes=1 << 24, segment_bytes=1 << 22, fsync="never") as s:
        evs = events(1, 3000, size=100)
        s.append_many(evs)
        record = sf.HEADER_SIZE + 100
        for after in (2998, 2000):
            starts.clear()
            assert s.read_after(after) == evs[after:]
            assert starts == [sf.PREAMBLE_SIZE + after * record]
        assert s.read_after(3000) == []
    with Spool.open(tmp_path, max_bytes=1 << 24, segment_bytes=1 << 22, fsync="never") as s:
        starts.clear()
        assert s.read_after(2998) == evs[2998:]  # reopened: no tail yet, the sparse index
        assert starts == [None]


def test_second_open_of_same_directory_is_refused(tmp_path: Path) -> None:
    with (
        Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=4096),
        pytest.raises(SpoolError, match="in use by another process"),
    ):
        Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=4096)


def test_bad_bounds_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="twice"):
        Spool.open(tmp_path, max_bytes=4096, segment_bytes=4096)


# --- overflow and resync --------------------------------------------------------


def test_overflow_keeps_newest_and_reports_needs_resync(tmp_path: Path) -> None:
    max_bytes, seg_bytes = 8192, 2048
    with Spool.open(tmp_path, max_bytes=max_bytes, segment_bytes=seg_bytes, fsync="never") as s:
        evs = events(1, 400, size=60)
        for i in range(0, 400, 10):
            s.append_many(evs[i : i + 10])
            assert s.statistics().bytes <= max_bytes  # the bound holds at every step
            assert sum(p.stat().st_size for p in seg_files(tmp_path)) == s.statistics().bytes
        stats = s.statistics()
        assert stats.overflowed and stats.needs_resync
        assert stats.overflow_count > 0
        assert stats.first_lost_seq == 1
        # What must be kept, from the bound and the sizes alone: whole segments
        # of `per_segment` records, the newest ones that fit in max_bytes.
        record = sf.HEADER_SIZE + 60
        per_segment = (seg_bytes - sf.PREAMBLE_SIZE) // record
        last_segment = 400 % per_segment or per_segment
        room = max_bytes - (sf.PREAMBLE_SIZE + last_segment * record)
        full_segments = room // (sf.PREAMBLE_SIZE + per_segment * record)
        kept = read_all(s)
        assert kept == evs[-(last_segment + full_segments * per_segment) :]
        assert stats.lost_upto == kept[0][0] - 1 == 400 - len(kept)
        assert s.needs_resync(0)
        assert s.needs_resync(stats.lost_upto - 1)
        assert not s.needs_resync(stats.lost_upto)
        lost_upto = stats.lost_upto
    # the overflow survives a restart: D still needs a resync
    with Spool.open(tmp_path, max_bytes=max_bytes, segment_bytes=seg_bytes) as s:
        assert s.overflowed and s.needs_resync(lost_upto - 1)
        s.mark_resynced(lost_upto + 5)
        assert not s.overflowed
        assert not s.needs_resync(lost_upto + 5)
        assert s.statistics().overflow_count > 0  # the count stays for the metric


def test_bound_never_exceeded_by_more_than_one_segment_with_big_batches(tmp_path: Path) -> None:
    max_bytes, seg_bytes = 16384, 4096
    with Spool.open(tmp_path, max_bytes=max_bytes, segment_bytes=seg_bytes, fsync="never") as s:
        seq = 1
        for size in (10, 3000, 500, 4000, 7000, 100, 12000):
            batch = events(seq, 7, size=size, prev=seq - 1)
            seq += 7
            s.append_many(batch)
            assert s.statistics().bytes <= max_bytes + seg_bytes + sf.HEADER_SIZE + size
            assert read_all(s)[-1] == batch[-1]


def test_fresh_spool_floor(tmp_path: Path) -> None:
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=4096, start_after=500) as s:
        assert s.needs_resync(499)
        assert not s.needs_resync(500)
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=4096) as s:
        assert s.floor == 500  # the persisted floor is a promise across restarts


# --- provenance: the join point and the incarnation -------------------------------

OPEN = {"max_bytes": 1 << 20, "segment_bytes": 4096, "fsync": "never"}


def test_reopen_with_a_join_point_above_the_floor_raises_it(tmp_path: Path) -> None:
    # A standby down while the stream went from 50 to 80: D needs 46-80 from it.
    with Spool.open(tmp_path, **OPEN, incarnation=7, start_after=0) as s:
        s.append_many(events(1, 50))
        s.trim(40)
    with Spool.open(tmp_path, **OPEN, incarnation=7, start_after=80) as s:
        assert s.floor == 80
        assert s.needs_resync(45)  # 51-80 went by: a resync, not silence
        assert not s.needs_resync(80)
        s.append_many(events(81, 5, prev=80))
        assert [e[0] for e in s.read_after(80)] == list(range(81, 86))
    with Spool.open(tmp_path, **OPEN, incarnation=7) as s:
        assert s.floor == 80  # persisted
        assert s.needs_resync(45)


def test_a_spool_of_another_incarnation_is_set_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = tmp_path / "spool"
    with Spool.open(d, **OPEN, incarnation=1, start_after=994) as s:
        s.append_many(events(995, 6, prev=994))
        s.trim(999)  # 1000 unacked
    # The whole site restarted as incarnation 2: its stream starts again low.
    with Spool.open(d, **OPEN, incarnation=2, start_after=3) as s:
        s.append_many(events(4, 3, prev=3))  # neither skipped as acked nor refused
        assert [e[0] for e in read_all(s)] == [4, 5, 6]
        st_ = s.statistics()
        assert (st_.incarnation, st_.floor, st_.skipped_acked) == (2, 3, 0)
    (aside,) = d.glob("set-aside-1-*")
    assert str(aside) in caplog.text and "incarnation 1" in caplog.text
    assert sorted(p.name for p in aside.iterdir()) == ["00000000000000000995.seg", "spool.state"]
    with Spool.open(aside, **OPEN) as old:  # kept for inspection, readable
        assert [e[0] for e in read_all(old)] == [1000]
    with Spool.open(d, **OPEN, incarnation=2) as s:  # never replayed
        assert [e[0] for e in read_all(s)] == [4, 5, 6]


def test_a_spool_holding_events_above_the_join_point_is_set_aside(tmp_path: Path) -> None:
    # Same incarnation, but the site's stream is now behind what the spool
    # holds: those events are another history.
    with Spool.open(tmp_path, **OPEN, incarnation=5, start_after=0) as s:
        s.append_many(events(1, 20))
    with Spool.open(tmp_path, **OPEN, incarnation=5, start_after=10) as s:
        assert read_all(s) == [] and s.floor == 10
        s.append_many(events(11, 2, prev=10))
        assert [e[0] for e in read_all(s)] == [11, 12]
    assert len(list(tmp_path.glob("set-aside-5-*"))) == 1


def test_events_above_a_recovery_it_missed_are_set_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Spooled 1-10, never settled: the site restarted whole and continued
    # from a journal at cseq 6, then went on to 10 while this sidecar was
    # down.  Its 7-10 never happened in the site's history.
    with Spool.open(tmp_path, **OPEN, incarnation=5, start_after=0, recoveries=()) as s:
        s.append_many(events(1, 10))
        s.trim(3)
    with Spool.open(tmp_path, **OPEN, incarnation=5, start_after=10, recoveries=(6,)) as s:
        assert [e[0] for e in read_all(s)] == []
        assert (s.floor, s.written_under) == (10, 0)
        s.append_many(events(11, 2, prev=10))
        assert [e[0] for e in read_all(s)] == [11, 12]
    (aside,) = tmp_path.glob("set-aside-5-*")
    assert str(aside) in caplog.text
    assert "before whole-site recovery 1, which continued from cseq 6" in caplog.text
    with Spool.open(tmp_path, **OPEN, incarnation=5, recoveries=(6,)) as s:
        assert (s.written_under, [e[0] for e in read_all(s)]) == (1, [11, 12])


def test_a_spool_within_the_history_a_recovery_kept_is_kept(tmp_path: Path) -> None:
    with Spool.open(tmp_path, **OPEN, incarnation=5, start_after=0, recoveries=(2,)) as s:
        s.append_many(events(3, 4, prev=2))
    # Two recoveries since, the first from 8 (above what it holds), the
    # second from 20; the site is at 25.
    with Spool.open(tmp_path, **OPEN, incarnation=5, start_after=25, recoveries=(2, 8, 20)) as s:
        assert s.written_under == 1
        assert [e[0] for e in read_all(s)] == [3, 4, 5, 6]
    with Spool.open(tmp_path, **OPEN, incarnation=5, recoveries=(2, 8, 20, 30)) as s:
        assert s.written_under == 3  # recorded at the last open
        assert [e[0] for e in read_all(s)] == [3, 4, 5, 6]
    # The oldest recovery it missed decides: 5 and 6 are above 4.
    with Spool.open(tmp_path, **OPEN, incarnation=5, recoveries=(2, 8, 20, 30, 4)) as s:
        assert read_all(s) == []
    with Spool.open(tmp_path, **OPEN, incarnation=5, recoveries=(2,)) as s:
        assert s.written_under == 5  # the site knows fewer: another history
    assert len(list(tmp_path.glob("set-aside-5-*"))) == 2


def test_a_state_file_of_version_2_was_written_before_any_recovery(tmp_path: Path) -> None:
    with Spool.open(tmp_path, **OPEN, incarnation=5, start_after=0) as s:
        s.append_many(events(1, 4))
    state = json.loads((tmp_path / ss.STATE_FILE).read_text())
    del state["recovery"]
    (tmp_path / ss.STATE_FILE).write_text(json.dumps({**state, "version": 2}))
    with Spool.open(tmp_path, **OPEN, incarnation=5, recoveries=(4,)) as s:
        assert (s.written_under, [e[0] for e in read_all(s)]) == (0, [1, 2, 3, 4])


def test_a_spool_of_an_older_format_is_set_aside(tmp_path: Path) -> None:
    (tmp_path / ss.STATE_FILE).write_text('{"version": 1, "floor": 9, "trimmed_upto": 9}')
    (tmp_path / sf.segment_name(10)).write_bytes(b"DRGSPL\x01\x00" + b"\x00" * 40)
    with Spool.open(tmp_path, **OPEN, incarnation=3, start_after=2) as s:
        assert (s.floor, s.statistics().incarnation, read_all(s)) == (2, 3, [])
    (aside,) = tmp_path.glob("set-aside-unknown-*")
    assert {p.name for p in aside.iterdir()} == {ss.STATE_FILE, sf.segment_name(10)}


def test_segments_without_a_state_are_set_aside(tmp_path: Path) -> None:
    with Spool.open(tmp_path, **OPEN, incarnation=3) as s:
        s.append_many(events(1, 3))
    (tmp_path / ss.STATE_FILE).unlink()
    with Spool.open(tmp_path, **OPEN, incarnation=3, start_after=3) as s:
        assert read_all(s) == []
    assert len(list(tmp_path.glob("set-aside-*"))) == 1


def test_a_gap_in_the_appended_stream_raises_the_floor(tmp_path: Path) -> None:
    with Spool.open(tmp_path, **OPEN) as s:
        s.append_many(events(1, 5))
        s.append_many(events(20, 3, prev=12))  # 6-12 never reached the spool
        assert s.floor == 12 and s.needs_resync(11) and not s.needs_resync(12)
        assert s.statistics().held_upto == 22
    with Spool.open(tmp_path, **OPEN) as s:
        assert s.floor == 12


def test_lag_counts_unacked_records_from_the_index(tmp_path: Path) -> None:
    with Spool.open(tmp_path, max_bytes=1 << 24, segment_bytes=1 << 18, fsync="never") as s:
        assert s.lag(0) == (0, None)
        evs = events(1, 5000, size=100, step=2)
        s.append_many(evs)
        assert s.statistics().segments > 2
        for k in (0, 1, 777, 2600, 4998):
            assert s.lag(evs[k][0]) == (4999 - k, evs[k + 1][1])
            assert s.lag(evs[k][0] + 1) == s.lag(evs[k][0])  # between two seqs
            assert s.lag(evs[k][0] - 1) == (5000 - k, evs[k][1])
        s.trim(evs[3000][0])
        assert s.lag(0) == (1999, evs[3001][1])
        assert s.lag(evs[-1][0]) == (0, None)


# --- a failing disk ------------------------------------------------------------------


class FailingDisk:
    """Replaces ``os.write``: writes to segment files (and, with ``state``,
    to the state file) succeed for ``budget`` more bytes, then fail with
    ``error`` after writing what fits."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, error: int = errno.ENOSPC) -> None:
        self.real = os.write
        self.budget: int | None = None  # None: no limit
        self.state = False
        self.error = error
        monkeypatch.setattr(os, "write", self.write)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        target = os.readlink(f"/proc/self/fd/{fd}")
        limited = target.endswith(".seg") or (self.state and ss.STATE_FILE in target)
        if self.budget is None or not limited:
            return self.real(fd, data)
        if self.budget <= 0:
            raise OSError(self.error, os.strerror(self.error))
        n = self.real(fd, bytes(data[: self.budget]))
        self.budget -= n
        return n


def test_disk_full_raises_the_floor_and_never_lies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    disk = FailingDisk(monkeypatch)
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 16, fsync="batch") as s:
        s.append_many(events(1, 16))
        (seg,) = seg_files(tmp_path)
        size = seg.stat().st_size
        disk.budget = sf.HEADER_SIZE + 50  # a record and a half
        s.append_many(events(17, 24, prev=16))  # does not raise
        s.append_many(events(41, 5, prev=40))  # still full: lost as well, logged once
        st_ = s.statistics()
        assert (st_.last_seq, st_.floor, st_.write_errors) == (16, 45, 2)
        assert seg.stat().st_size == size == st_.bytes  # the partial record was cut off
        assert s.needs_resync(16) and not s.needs_resync(45)
        assert caplog.text.count("spool.write failed") == 1
        assert s.read_after(16) == []  # nothing of the failed batches, in memory either
        disk.budget = None  # space freed
        s.append_many(events(46, 3, prev=45))
        assert "spool.write recovered" in caplog.text
        assert [e[0] for e in s.read_after(45)] == [46, 47, 48]
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 16) as s:
        assert s.floor == 45  # persisted
        assert s.needs_resync(10)
        assert [e[0] for e in read_all(s)] == [*range(1, 17), 46, 47, 48]


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO, errno.EFBIG])
def test_a_failed_write_of_the_state_too_is_caught_up_by_the_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    disk = FailingDisk(monkeypatch, error=error)
    with Spool.open(tmp_path, max_bytes=8192, segment_bytes=1024, fsync="never") as s:
        s.append_many(events(1, 10))
        disk.budget, disk.state = 0, True
        s.append_many(events(11, 40, prev=10))  # rolls segments: none may stay empty
        assert s.floor == 50 and s.statistics().write_errors >= 1
        assert s.statistics().last_seq == 10
        disk.budget = None
        s.append_many(events(51, 2, prev=50))
    with Spool.open(tmp_path, max_bytes=8192, segment_bytes=1024) as s:
        assert s.floor == 50 and s.needs_resync(49)
        assert [e[0] for e in read_all(s)] == [*range(1, 11), 51, 52]


def test_a_file_size_limit_is_a_failed_write(tmp_path: Path) -> None:
    # The real thing: RLIMIT_FSIZE makes the kernel cut a write short, then fail it (EFBIG).
    script = f"""
import json, resource, signal
from gateway.spool import Spool
evs = lambda a, b, p: [(s, s, b"x" * 40, p if s == a else s - 1) for s in range(a, b + 1)]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
with Spool.open({str(tmp_path)!r}, max_bytes=1 << 20, segment_bytes=1 << 16) as s:
    s.append_many(evs(1, 16, 0))
    size = s.statistics().bytes
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 60, resource.RLIM_INFINITY))
    s.append_many(evs(17, 40, 16))
    first = s.statistics()
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
with Spool.open({str(tmp_path)!r}, max_bytes=1 << 20, segment_bytes=1 << 16) as s:
    print(json.dumps([first.last_seq, first.floor, first.write_errors, size,
                      s.statistics().last_seq, s.floor, s.needs_resync(10)]))
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        timeout=60,
    )
    last, floor, errors, size, last_after, floor_after, resync = json.loads(out.stdout)
    assert (last, floor, errors) == (16, 40, 1)
    assert (last_after, floor_after, resync) == (16, 40, True)
    assert (tmp_path / sf.segment_name(1)).stat().st_size == size


# --- recovery -------------------------------------------------------------------


def test_torn_tail_at_every_byte_of_the_last_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = tmp_path / "base"
    evs = events(1, 20, size=30)
    with Spool.open(base, max_bytes=1 << 20, segment_bytes=1 << 16, fsync="never") as s:
        s.append_many(evs)
    (seg,) = seg_files(base)
    full = seg.read_bytes()
    last_len = sf.HEADER_SIZE + 30
    start = len(full) - last_len
    for cut in range(start, len(full)):
        work = tmp_path / f"cut{cut}"
        shutil.copytree(base, work)
        (work / seg.name).write_bytes(full[:cut])
        caplog.clear()
        with Spool.open(work, max_bytes=1 << 20, segment_bytes=1 << 16, fsync="never") as s:
            assert read_all(s) == evs[:-1]
            assert s.statistics().last_seq == 19
            assert not s.overflowed
            s.append_many(events(20, 2, size=30, prev=19))  # the spool goes on after the cut
            assert read_all(s) == evs[:-1] + events(20, 2, size=30, prev=19)
        assert (work / seg.name).stat().st_size == len(full) + last_len
        if cut > start:
            assert "torn-tail" in caplog.text
        shutil.rmtree(work)


def test_zero_filled_tail_is_torn(tmp_path: Path) -> None:
    evs = events(1, 5)
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 16, fsync="never") as s:
        s.append_many(evs)
    (seg,) = seg_files(tmp_path)
    with open(seg, "ab") as f:
        f.write(b"\0" * 300)
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 16) as s:
        assert read_all(s) == evs


def test_corruption_in_the_middle_names_file_and_offset(tmp_path: Path) -> None:
    evs = events(1, 10, size=30)
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 16, fsync="never") as s:
        s.append_many(evs)
    (seg,) = seg_files(tmp_path)
    data = bytearray(seg.read_bytes())
    rec = sf.HEADER_SIZE + 30
    bad_offset = sf.PREAMBLE_SIZE + 3 * rec
    data[bad_offset + sf.HEADER_SIZE + 5] ^= 0xFF  # a payload byte of seq 4
    seg.write_bytes(bytes(data))
    with pytest.raises(SpoolCorruptError) as info:
        Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 16)
    assert info.value.path == seg
    assert info.value.offset == bad_offset
    assert str(seg) in str(info.value) and f"offset {bad_offset}" in str(info.value)
    assert "move" in str(info.value)  # the fix
    assert seg.read_bytes() == bytes(data)  # nothing was truncated


def test_corruption_found_on_read_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The live tail comes from memory (the bytes written): read from the file.
    monkeypatch.setattr(spoolsegments, "RECENT_BYTES", 0)
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 16, fsync="never") as s:
        s.append_many(events(1, 10))
        (seg,) = seg_files(tmp_path)
        with open(seg, "r+b") as f:
            f.seek(sf.PREAMBLE_SIZE + sf.HEADER_SIZE + 1)
            f.write(b"!")
        with pytest.raises(SpoolCorruptError, match="CRC mismatch reading seq 1"):
            read_all(s)


def test_torn_middle_segment_counts_as_loss(tmp_path: Path) -> None:
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1024, fsync="never") as s:
        s.append_many(events(1, 60, size=40))
    segs = seg_files(tmp_path)
    assert len(segs) >= 3
    data = segs[0].read_bytes()
    segs[0].write_bytes(data[:-10])
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1024) as s:
        next_first = int(segs[1].stem)
        assert s.overflowed
        assert s.needs_resync(next_first - 2)
        assert not s.needs_resync(next_first - 1)


def test_crash_leftovers_are_cleaned(tmp_path: Path) -> None:
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1024, fsync="never") as s:
        s.append_many(events(1, 5))
    (tmp_path / sf.segment_name(99)).write_bytes(b"DRG")  # crashed before the preamble
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1024) as s:
        assert [p.name for p in seg_files(tmp_path)] == [sf.segment_name(1)]
        s.append_many(events(99, 1, prev=5))
        assert read_all(s)[-1][0] == 99


# --- fsync policies --------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [(FsyncPolicy.NEVER, 0), (FsyncPolicy.BATCH, 3), (FsyncPolicy.ALWAYS, 30)],
)
def test_fsync_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: FsyncPolicy, expected: int
) -> None:
    calls: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(sp.os, "fdatasync", lambda fd: (calls.append(fd), real(fd))[1])
    with Spool.open(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 16, fsync=policy) as s:
        calls.clear()  # opening a new spool syncs its state file
        before = s.statistics().fsyncs
        for i in range(3):
            s.append_many(events(1 + 10 * i, 10, prev=10 * i))
        assert len(calls) == expected
        assert s.statistics().fsyncs - before == expected
        assert s.statistics().fsync == policy.value


def test_default_fsync_is_batch() -> None:
    assert sp.DEFAULT_FSYNC is FsyncPolicy.BATCH
