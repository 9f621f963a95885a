"""cluster.durability: a node's journal holds no body of a message that does
not survive a whole-site restart, in its segments or its checkpoints, and
what it recovers is, after the recovery's drop, the live state's durable part."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from cluster import state as st
from cluster.durability import JournalSettings, NodeJournal
from cluster.journal import Journal
from cluster.state.persistence import drop_transient, take_recovery
from protocol import cluster as pc
from tests.support.state import Member

CLIENT = Member(1, 10)
SID = st.session_id(1, 10, 1)
DURABLE = {pc.DURABLE_PROPERTY: True}


class StandInMember:
    """What NodeJournal reads of its SiteMember: the state, and ``post``."""

    def __init__(self) -> None:
        self.state = st.new_state()
        self.recovered: st.SiteState | None = None
        self.posted: list[pc.Command] = []
        self.delivered_frame = b""

    def post(self, cmd: pc.Command) -> None:
        self.posted.append(cmd)


def deliver(member: StandInMember, journal: NodeJournal, *commands: pc.Command) -> None:
    """One bus frame, applied then handed to the journal as the member does."""
    member.delivered_frame = pc.encode_frame(commands)
    for cmd in commands:
        st.apply(member.state, cmd, sender=CLIENT)
        journal.after_command(cmd)
    journal.after_frame()


def on_disk(directory: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file())


def test_the_journal_holds_no_transient_body_and_recovers_the_durable_state(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "journal"
    member = StandInMember()
    journal = NodeJournal(JournalSettings(str(directory)), member, 1)  # type: ignore[arg-type]
    deliver(member, journal, pc.Genesis("site-p", 7))  # the site is live: checkpoint
    deliver(
        member,
        journal,
        pc.QueueDeclare("keep", {"durable": True}),
        pc.QueueDeclare("temp"),
        pc.SessionOpen(SID),
    )
    deliver(
        member,
        journal,
        pc.Publish("", "keep", b"BODY-durable-on-durable", "1", DURABLE),
        pc.Publish("", "keep", b"BODY-transient-on-durable", "2"),
        pc.Publish("", "temp", b"BODY-durable-on-temp", "3", DURABLE),
    )
    deliver(member, journal, pc.Acquire("keep", SID, 0, 1))
    journal.journal.commit()
    held = on_disk(directory)
    assert b"BODY-durable-on-durable" in held
    assert b"BODY-transient-on-durable" not in held and b"BODY-durable-on-temp" not in held

    # A checkpoint of the live state (a restore makes one) leaves them out too.
    journal.after_restore()
    deliver(member, journal, pc.Publish("", "keep", b"BODY-later-transient", "4"))
    journal.journal.commit()
    held = on_disk(directory)
    assert b"BODY-durable-on-durable" in held
    for transient in (b"transient-on-durable", b"durable-on-temp", b"later-transient"):
        assert b"BODY-" + transient not in held
    journal.close()

    with Journal.open(directory) as reopened:
        got = reopened.recover()
    assert got is not None and got.cseq == member.state.cseq
    recovered = got.state
    drop_transient(recovered)
    drop_transient(member.state)
    assert st.digest(recovered) == st.digest(member.state)
    assert [m.body for m in recovered.queues["keep"].messages.values()] == [
        b"BODY-durable-on-durable"
    ]


def test_a_frame_journaled_unchanged_is_the_delivered_bytes_not_encoded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "journal"
    member = StandInMember()
    journal = NodeJournal(JournalSettings(str(directory)), member, 1)  # type: ignore[arg-type]
    deliver(member, journal, pc.Genesis("site-p", 7))
    deliver(member, journal, pc.QueueDeclare("keep", {"durable": True}), pc.SessionOpen(SID))
    encoded: list[Sequence[pc.Command]] = []
    append = journal.journal.append

    def spy(first_cseq: int, commands: Sequence[pc.Command]) -> None:
        encoded.append(commands)
        append(first_cseq, commands)

    monkeypatch.setattr(journal.journal, "append", spy)
    durable = pc.Publish("", "keep", b"BODY-durable", "1", DURABLE)
    deliver(member, journal, durable, pc.Durable(2, 3))
    kept = member.delivered_frame
    assert encoded == []  # every command unchanged: the delivered bytes
    deliver(member, journal, pc.Publish("", "keep", b"BODY-transient", "2"), durable)
    assert len(encoded) == 1 and encoded[0][0].body == b""  # a body elided: encoded again
    journal.journal.commit()
    held = on_disk(directory)
    assert kept in held and b"BODY-transient" not in held
    journal.close()

    with Journal.open(directory) as reopened:
        got = reopened.recover()
    assert got is not None and got.cseq == member.state.cseq
    assert [m.body for m in got.state.queues["keep"].messages.values()] == [
        b"BODY-durable",
        b"",
        b"BODY-durable",
    ]


def test_the_checkpoint_a_recovery_makes_keeps_the_recovery(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    member = StandInMember()
    journal = NodeJournal(JournalSettings(str(directory)), member, 1)  # type: ignore[arg-type]
    deliver(member, journal, pc.Genesis("site-p", 7), pc.QueueDeclare("temp"))
    # The site takes a journal's state at a whole-site recovery (the member's
    # _take_recovery_chunk), then the node checkpoints it.
    take_recovery(member.state)
    journal.after_restore()
    deliver(member, journal, pc.QueueDeclare("keep", {"durable": True}))
    journal.journal.commit()
    journal.close()
    with Journal.open(directory) as reopened:
        got = reopened.recover()
    assert got is not None
    assert got.state.recoveries == [st.Recovery(1, got.state.cseq - 1, True)]
    # The next recovery from this journal is the site's second.
    take_recovery(got.state)
    assert [r.count for r in got.state.recoveries] == [1, 2]


def test_a_rejoin_checkpoints_nothing_until_a_state_replaces_the_stale_one(tmp_path: Path) -> None:
    # Found by chaos seed 2025: a D broker that rejoined had its stale state
    # checkpointed by a commit's routine checkpoint, which started the journal
    # again; after the site started over, an append then broke the journal's
    # order ("journal append at cseq 112533 does not follow the last record")
    # and the broker exited.  A checkpoint of the empty state a start-over
    # waits in would have replaced this node's recovery candidate.
    directory = tmp_path / "journal"
    member = StandInMember()
    settings = JournalSettings(str(directory), checkpoint_bytes=1)
    journal = NodeJournal(settings, member, 1)  # type: ignore[arg-type]
    deliver(member, journal, pc.Genesis("site-p", 7), pc.QueueDeclare("keep", {"durable": True}))
    deliver(member, journal, pc.QueueDeclare("more", {"durable": True}))
    journal.journal.commit()
    assert journal.journal.needs_checkpoint
    journal.on_rejoin()
    member.state = st.new_state()  # a start-over waits for the site's recovery
    journal._after_commit(journal.journal.durable_cseq)  # the committer's routine
    journal.close()
    with Journal.open(directory) as reopened:
        got = reopened.recover()
    assert got is not None and got.state.incarnation == 7
    assert set(got.state.queues) == {"keep", "more"}


def test_a_late_recovery_report_at_a_live_site_is_journaled_like_any_command(
    tmp_path: Path,
) -> None:
    # A broker that joined while its site waited for its brokers reports what
    # it recovered; if the recovery finished first, the report reaches a live
    # site, which ignores it, yet it takes a cseq: a journal that skipped it
    # broke its order at the next append, and every broker of the site exited.
    directory = tmp_path / "journal"
    member = StandInMember()
    journal = NodeJournal(JournalSettings(str(directory)), member, 1)  # type: ignore[arg-type]
    deliver(member, journal, pc.Genesis("site-p", 7), pc.QueueDeclare("keep", {"durable": True}))
    deliver(member, journal, pc.Recovering("site-p", 2, 20, 3, 40, 7, 99))
    deliver(member, journal, pc.QueueDeclare("after", {"durable": True}))
    journal.journal.commit()
    journal.close()
    with Journal.open(directory) as reopened:
        got = reopened.recover()
    assert got is not None and got.cseq == member.state.cseq
    assert set(got.state.queues) == {"keep", "after"}
