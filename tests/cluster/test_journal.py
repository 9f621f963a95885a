"""The broker journal (cluster/journal.py): what is appended and committed is
recovered exactly; torn tails are cut, corruption is refused; checkpoints
bound the disk; the fsync policy is kept."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from cluster import state as st
from cluster.journal import Journal, JournalError, inspect_journal
from cluster.state import SiteState
from protocol import cluster as pc
from protocol import journal as pj
from tests.support.state import Member

QUEUE = "orders"
DURABLE = {pc.DURABLE_PROPERTY: True}  # the messages here are persistent (durable queue too)


class Site:
    """A node's state and its journal, fed the same commands."""

    def __init__(self, journal: Journal, state: SiteState | None = None) -> None:
        self.journal = journal
        self.state = st.new_state() if state is None else state

    def frame(self, commands: Sequence[pc.Command]) -> None:
        self.journal.append(self.state.cseq + 1, commands)
        st.apply_all(self.state, commands)

    def left(self, *members: Member) -> None:
        self.journal.append_members_left(members)
        st.members_left(self.state, members)

    def publish(self, n: int, size: int = 100, *, per_frame: int = 10) -> None:
        for start in range(0, n, per_frame):
            count = min(per_frame, n - start)
            self.frame(
                [
                    pc.Publish(
                        "", QUEUE, bytes([i % 251]) * size, f"m-{self.state.cseq}-{i}", DURABLE
                    )
                    for i in range(count)
                ]
            )

    def consume(self, n: int, session: int = 1 << 40) -> None:
        """``session`` takes and accepts the first ``n`` messages."""
        q = self.state.queues[QUEUE]
        positions = tuple(list(q.messages)[:n])
        self.frame([pc.Acquire(QUEUE, session, 0, n), pc.Accept(QUEUE, session, positions)])


def genesis(journal: Journal) -> Site:
    site = Site(journal)
    site.frame([pc.Genesis("site-p", 7), pc.QueueDeclare(QUEUE, {"durable": True})])
    site.frame([pc.SessionOpen(1 << 40)])
    return site


def recovered(directory: Path, **options: object) -> SiteState:
    with Journal.open(directory, **options) as journal:  # type: ignore[arg-type]
        result = journal.recover()
    assert result is not None
    assert result.cseq == result.state.cseq
    return result.state


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("journal-*.log"))


# --- recovery ------------------------------------------------------------------


def test_an_empty_journal_recovers_nothing(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "j") as journal:
        assert journal.recover() is None
        assert journal.commit() == 0
    assert (tmp_path / "j").is_dir()


def test_committed_frames_recover_the_state_built_directly(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as journal:
        site = genesis(journal)
        site.publish(35)
        site.consume(12)
        # A second session holds three messages when its member leaves.
        other = (2 << 40) | (3 << 16)
        site.frame([pc.SessionOpen(other), pc.Acquire(QUEUE, other, 1, 3)])
        site.left(Member(2, 3))
        site.publish(4)
        assert journal.commit() == site.state.cseq
    with Journal.open(tmp_path) as journal:
        result = journal.recover()
        assert result is not None
        assert result.checkpoint_cseq == 0
        assert result.frames_replayed == 2 + 4 + 1 + 1 + 1 + 1
        assert st.digest(result.state) == st.digest(site.state)
        # Appending goes on where the journal ends.
        Site(journal, result.state).publish(1)
        assert journal.commit() == site.state.cseq + 1


def test_uncommitted_records_are_not_on_disk(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as journal:
        site = genesis(journal)
        assert journal.commit() == 3
        site.publish(5)
    assert recovered(tmp_path).cseq == 3


def test_a_journal_that_grew_checkpoints_once_its_interval_has_passed(tmp_path: Path) -> None:
    """A slow stream of small frames stays far under checkpoint_bytes, and a
    restart would replay every frame: the interval bounds that."""
    now = [1000.0]
    with Journal.open(tmp_path, checkpoint_interval_s=300, clock=lambda: now[0]) as journal:
        site = genesis(journal)
        journal.commit()
        now[0] += 299
        assert not journal.needs_checkpoint
        now[0] += 1
        assert journal.needs_checkpoint  # it grew (genesis) and 300 s passed
        journal.checkpoint(site.state)
        assert not journal.needs_checkpoint
        now[0] += 600
        assert not journal.needs_checkpoint, "nothing written since: nothing to replay"
        site.publish(1)
        journal.commit()
        assert journal.needs_checkpoint
    with Journal.open(tmp_path, checkpoint_interval_s=0, clock=lambda: now[0]) as journal:
        site = Site(journal, journal.recover().state)  # type: ignore[union-attr]
        site.publish(1)
        journal.commit()
        now[0] += 10**6
        assert not journal.needs_checkpoint, "0: on bytes only"


def test_many_records_across_checkpoints_recover_from_the_last(tmp_path: Path) -> None:
    with Journal.open(tmp_path, checkpoint_bytes=20_000) as journal:
        site = genesis(journal)
        checkpoints = 0
        for round_ in range(30):
            site.publish(20, size=200)
            site.consume(15)
            journal.commit()
            if journal.needs_checkpoint:
                journal.checkpoint(site.state)
                checkpoints += 1
            if round_ == 29:
                site.publish(7)
                journal.commit()
        stats = journal.statistics()
    assert checkpoints >= 5
    with Journal.open(tmp_path) as journal:
        result = journal.recover()
    assert result is not None
    assert result.checkpoint_cseq == stats.last_checkpoint_cseq > 0
    assert result.cseq == site.state.cseq
    assert 0 < result.frames_replayed < 30 * 3
    assert st.digest(result.state) == st.digest(site.state)


def test_a_checkpoint_with_no_segment_yet_recovers_at_its_cseq(tmp_path: Path) -> None:
    """A crash after the checkpoint's rename, before its segment was made."""
    with Journal.open(tmp_path) as journal:
        site = genesis(journal)
        site.publish(3)
        journal.commit()
        journal.checkpoint(site.state)
    for path in segments(tmp_path):
        path.unlink()
    with Journal.open(tmp_path) as journal:
        result = journal.recover()
        assert result is not None
        assert (result.cseq, result.frames_replayed) == (site.state.cseq, 0)
        journal.append(site.state.cseq + 1, [pc.Purge(QUEUE)])
        assert journal.commit() == site.state.cseq + 1


def test_a_checkpoint_of_a_state_from_peers_discards_the_history_after_it(
    tmp_path: Path,
) -> None:
    """A rejoin: the node's journal went further on a history its peers dropped."""
    with Journal.open(tmp_path) as journal:
        site = genesis(journal)
        site.publish(5)
        journal.commit()
        donor = st.restore(st.snapshot(site.state))
        site.publish(5)  # the minority's history
        journal.commit()
        journal.checkpoint(donor)
        Site(journal, donor).frame([pc.Purge(QUEUE)])
        journal.commit()
    state = recovered(tmp_path)
    assert state.cseq == donor.cseq
    assert st.digest(state) == st.digest(donor)


# --- order ---------------------------------------------------------------------


def test_an_append_that_does_not_follow_is_refused(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as journal:
        with pytest.raises(JournalError, match=r"must be cseq 1, not 5.*checkpoint"):
            journal.append(5, [pc.Purge(QUEUE)])
        journal.append(1, [pc.Genesis("site-p", 7), pc.Purge(QUEUE)])
        for wrong in (2, 4, 1):
            with pytest.raises(
                JournalError, match=rf"cseq {wrong} does not follow.*expected cseq 3"
            ):
                journal.append(wrong, [pc.Purge(QUEUE)])
        journal.commit()
    with Journal.open(tmp_path) as journal:
        with pytest.raises(JournalError, match="expected cseq 3"):
            journal.append(4, [pc.Purge(QUEUE)])
        journal.append(3, [pc.Purge(QUEUE)])


def test_a_directory_is_held_by_one_journal(tmp_path: Path) -> None:
    with Journal.open(tmp_path), pytest.raises(JournalError, match="in use by another process"):
        Journal.open(tmp_path)
    Journal.open(tmp_path).close()


def test_an_unknown_fsync_policy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(JournalError, match="'sometimes' is not one of never, batch"):
        Journal.open(tmp_path, fsync="sometimes")


# --- damage --------------------------------------------------------------------


def _journal_with_last_record(directory: Path) -> tuple[Site, str, int]:
    """A committed journal; (site, digest before the last record, its offset)."""
    with Journal.open(directory) as journal:
        site = genesis(journal)
        site.publish(6, size=30, per_frame=3)
        journal.commit()
        before = st.digest(site.state)
        offset = segments(directory)[-1].stat().st_size
        site.publish(2, size=30, per_frame=2)
        journal.commit()
    return site, before, offset


def test_a_torn_last_record_is_cut_at_every_byte(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    site, before, offset = _journal_with_last_record(tmp_path / "whole")
    whole = segments(tmp_path / "whole")[-1].read_bytes()
    assert len(whole) - offset > pj.RECORD_HEADER_SIZE
    caplog.set_level(logging.WARNING, "cluster.journal")
    for cut in range(offset, len(whole)):
        directory = tmp_path / f"cut-{cut}"
        directory.mkdir()
        (directory / segments(tmp_path / "whole")[-1].name).write_bytes(whole[:cut])
        caplog.clear()
        with Journal.open(directory) as journal:
            result = journal.recover()
            assert result is not None
            assert st.digest(result.state) == before, cut
            assert (directory / segments(directory)[-1].name).stat().st_size == offset
            assert journal.commit() == site.state.cseq - 2
        if cut > offset:
            assert f"truncated=torn-tail file={directory}" in caplog.text
            assert f"offset={offset}" in caplog.text


def test_a_last_record_with_zeros_instead_of_data_is_a_torn_tail(tmp_path: Path) -> None:
    _site, before, offset = _journal_with_last_record(tmp_path)
    path = segments(tmp_path)[-1]
    data = bytearray(path.read_bytes())
    data[offset:] = bytes(len(data) - offset)
    path.write_bytes(bytes(data))
    assert st.digest(recovered(tmp_path)) == before


def test_a_flipped_byte_before_the_last_record_is_refused_naming_file_and_offset(
    tmp_path: Path,
) -> None:
    with Journal.open(tmp_path) as journal:
        site = genesis(journal)
        site.publish(6, size=30, per_frame=3)
        journal.commit()
    path = segments(tmp_path)[-1]
    data = bytearray(path.read_bytes())
    # The records: walk them to find the third one's offset.
    offsets = []
    at = pj.SEGMENT_HEADER_SIZE
    while at < len(data):
        offsets.append(at)
        at = pj.next_record_untrusted(bytes(data), at).end
    victim = offsets[2]
    data[victim + pj.RECORD_HEADER_SIZE + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError) as caught:
        Journal.open(tmp_path)
    message = str(caught.value)
    assert f"{path}: byte offset {victim}: CRC mismatch" in message
    assert "drgate journal reseed --config" in message  # the one documented command
    assert f"moves {tmp_path} aside" in message
    assert "takes the state from its peers" in message
    assert (caught.value.path, caught.value.offset) == (path, victim)
    assert path.read_bytes() == bytes(data)  # nothing was cut


def test_an_impossible_length_is_refused(tmp_path: Path) -> None:
    _site, _before, offset = _journal_with_last_record(tmp_path)
    path = segments(tmp_path)[-1]
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = (0xFFFFFFFF).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError, match=f"byte offset {offset}: record length 4294967295"):
        Journal.open(tmp_path)


def _two_checkpoints(directory: Path, keep_previous: bool) -> tuple[Site, Path]:
    """A journal with checkpoints at two cseqs; with ``keep_previous``, the
    first checkpoint and its segment are put back (a crash before cleanup)."""
    with Journal.open(directory) as journal:
        site = genesis(journal)
        site.publish(4)
        journal.commit()
        journal.checkpoint(site.state)
        site.publish(4)
        journal.commit()
        saved = {p: p.read_bytes() for p in directory.iterdir() if p.name != "journal.lock"}
        journal.checkpoint(site.state)
        site.publish(3)
        journal.commit()
    if keep_previous:
        for path, data in saved.items():
            path.write_bytes(data)
    newest = sorted(directory.glob("checkpoint-*.snap"))[-1]
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0x01
    newest.write_bytes(bytes(data))
    return site, newest


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    site, newest = _two_checkpoints(tmp_path, keep_previous=True)
    with Journal.open(tmp_path) as journal:
        result = journal.recover()
    assert result is not None
    assert result.checkpoint_cseq < int(newest.name[11:31])
    assert st.digest(result.state) == st.digest(site.state)
    assert newest.with_name(newest.name + ".damaged").exists()
    assert st.digest(recovered(tmp_path)) == st.digest(site.state)


def test_a_damaged_checkpoint_without_the_segments_before_it_is_refused(tmp_path: Path) -> None:
    _site, newest = _two_checkpoints(tmp_path, keep_previous=False)
    with Journal.open(tmp_path) as journal, pytest.raises(JournalError) as caught:
        journal.recover()
    assert f"{newest}: byte offset 0: checkpoint is damaged" in str(caught.value)
    assert "drgate journal reseed --config" in str(caught.value)
    assert "takes the state from its peers" in str(caught.value)


def test_a_segment_that_follows_no_checkpoint_is_refused(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as journal:
        site = genesis(journal)
        journal.commit()
        journal.checkpoint(site.state)
        site.publish(2)
        journal.commit()
    for path in tmp_path.glob("checkpoint-*"):
        path.unlink()
    with pytest.raises(JournalError, match="segment starts at cseq 4, but no checkpoint covers"):
        Journal.open(tmp_path)


# --- disk ----------------------------------------------------------------------


def _disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.name != "journal.lock")


def test_checkpoints_keep_the_disk_under_twice_the_live_data(tmp_path: Path) -> None:
    live_messages, size = 400, 1000
    live = live_messages * size
    with Journal.open(tmp_path, checkpoint_bytes=live // 3) as journal:
        site = genesis(journal)
        for _cycle in range(8):
            for _ in range(live_messages // 50):
                site.publish(50, size=size, per_frame=50)
                journal.commit()
                if journal.needs_checkpoint:
                    journal.checkpoint(site.state)
            full = len(st.snapshot(site.state))
            assert _disk_bytes(tmp_path) == journal.statistics().bytes_on_disk
            assert _disk_bytes(tmp_path) < 2 * full
            for _ in range(live_messages // 50):
                site.consume(50)
                journal.commit()
                if journal.needs_checkpoint:
                    journal.checkpoint(site.state)
        assert journal.statistics().last_checkpoint_cseq > 0
        names = sorted(p.name for p in tmp_path.iterdir())
        assert len([n for n in names if n.startswith("checkpoint-")]) == 1
        assert len([n for n in names if n.startswith("journal-")]) == 1
    assert st.digest(recovered(tmp_path)) == st.digest(site.state)


# --- fsync ---------------------------------------------------------------------


def _count_syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real_fdatasync, real_fsync = os.fdatasync, os.fsync

    def fdatasync(fd: int) -> None:
        calls.append("fdatasync")
        real_fdatasync(fd)

    def fsync(fd: int) -> None:
        calls.append("fsync")
        real_fsync(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_fsync_never_writes_but_never_syncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_syncs(monkeypatch)
    with Journal.open(tmp_path, fsync="never") as journal:
        site = genesis(journal)
        for _ in range(5):
            site.publish(10)
            assert journal.commit() == site.state.cseq
        journal.checkpoint(site.state)
        site.publish(3)
        journal.commit()
        assert journal.statistics().fsync_seconds_total == 0
    assert calls == []
    assert st.digest(recovered(tmp_path, fsync="never")) == st.digest(site.state)


def test_fsync_batch_syncs_once_per_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Journal.open(tmp_path) as journal:
        site = genesis(journal)
        journal.commit()  # the first commit also makes the segment
        calls = _count_syncs(monkeypatch)
        for _ in range(5):
            site.publish(30, per_frame=10)
            journal.commit()
        assert journal.commit() == site.state.cseq  # nothing buffered: no sync
        stats = journal.statistics()
    assert calls == ["fdatasync"] * 5
    assert stats.commits == 6
    assert stats.fsync_seconds_total >= stats.fsync_last_seconds > 0


def test_a_failed_write_raises_keeps_the_records_and_the_next_commit_writes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Journal.open(tmp_path) as journal:
        site = genesis(journal)
        durable = journal.commit()
        site.publish(10)
        real_write = os.write

        def half_then_full(fd: int, data: bytes | memoryview) -> int:
            if len(data) > 100:
                real_write(fd, bytes(data)[:100])
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "write", half_then_full)
        with pytest.raises(JournalError, match=r"cannot write the journal.*No space left"):
            journal.commit()
        assert journal.statistics().durable_cseq == durable
        monkeypatch.setattr(os, "write", real_write)
        assert journal.commit() == site.state.cseq
    assert st.digest(recovered(tmp_path)) == st.digest(site.state)


def test_an_encoded_frame_is_journaled_as_it_is(tmp_path: Path) -> None:
    commands: list[pc.Command] = [pc.Genesis("site-p", 7), pc.QueueDeclare(QUEUE)]
    with Journal.open(tmp_path) as journal:
        with pytest.raises(JournalError, match="at least one command"):
            journal.append_frame(1, pc.encode_frame([]), 0)
        journal.append_frame(1, pc.encode_frame(commands), 2)
        with pytest.raises(JournalError, match="expected cseq 3"):
            journal.append_frame(2, pc.encode_frame(commands), 2)
        journal.commit()
    state = st.new_state()
    st.apply_all(state, commands)
    assert st.digest(recovered(tmp_path)) == st.digest(state)


def test_a_record_appended_while_a_commit_writes_goes_with_the_next_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node may commit from a worker thread while it appends."""
    with Journal.open(tmp_path) as journal:
        site = genesis(journal)
        journal.commit()
        site.publish(3, per_frame=3)
        before = site.state.cseq
        real_write = os.write

        def write_while_appending(fd: int, data: bytes | memoryview) -> int:
            monkeypatch.setattr(os, "write", real_write)
            site.publish(2, per_frame=2)  # the applier, meanwhile
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", write_while_appending)
        assert journal.commit() == before
        assert journal.commit() == site.state.cseq == before + 2
    assert st.digest(recovered(tmp_path)) == st.digest(site.state)


# --- inspecting (drgate journal check) ---------------------------------------------


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_inspecting_a_healthy_journal_says_what_it_holds_and_changes_nothing(
    tmp_path: Path,
) -> None:
    with Journal.open(tmp_path) as journal:
        site = genesis(journal)
        site.publish(4)
        journal.commit()
        journal.checkpoint(site.state)
        site.publish(3)
        journal.commit()
        ckpt = site.state.cseq - 3
        held = inspect_journal(tmp_path)
        assert held.in_use  # the node runs: its journal.lock is held
    before = _files(tmp_path)
    report = inspect_journal(tmp_path)
    assert not report.in_use
    assert (report.checkpoint_cseq, report.last_cseq) == (ckpt, site.state.cseq)
    assert report.bytes_on_disk == sum(len(v) for k, v in before.items() if k != "journal.lock")
    assert (report.torn_tail, report.damage) == (None, None)
    assert _files(tmp_path) == before


def test_inspecting_finds_a_torn_tail_without_cutting_it(tmp_path: Path) -> None:
    site, _before, offset = _journal_with_last_record(tmp_path)
    path = segments(tmp_path)[-1]
    torn = path.read_bytes()[:-7]
    path.write_bytes(torn)
    report = inspect_journal(tmp_path)
    assert report.damage is None
    assert report.torn_tail is not None
    assert (report.torn_tail.path, report.torn_tail.offset) == (path, offset)
    assert report.torn_tail.dropped_bytes == len(torn) - offset
    assert report.last_cseq == site.state.cseq - 2  # what an open keeps (a frame of 2)
    assert path.read_bytes() == torn


def test_inspecting_names_the_damage_a_start_would_refuse(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as journal:
        site = genesis(journal)
        site.publish(6, size=30, per_frame=3)
        journal.commit()
    path = segments(tmp_path)[-1]
    data = bytearray(path.read_bytes())
    data[pj.SEGMENT_HEADER_SIZE + pj.RECORD_HEADER_SIZE + 5] ^= 0x10
    path.write_bytes(bytes(data))
    report = inspect_journal(tmp_path)
    assert report.damage is not None
    assert (report.damage.path, report.damage.offset) == (path, pj.SEGMENT_HEADER_SIZE)
    assert "drgate journal reseed" in str(report.damage)
    assert path.read_bytes() == bytes(data)


def test_inspecting_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(JournalError, match="no journal directory"):
        inspect_journal(tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()
