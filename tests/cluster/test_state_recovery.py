"""cluster.state: a site started with no member alive chooses the journal it
continues from (``Recovering``), the same way on every member."""

from __future__ import annotations

from cluster import state as st
from protocol import cluster as pc


def _report(node: int, cseq: int, *, expect: int = 3, incarnation: int = 7) -> pc.Recovering:
    return pc.Recovering("site-p", node, 100 + node, expect, cseq, incarnation, 1000 + node)


def test_the_most_advanced_journal_is_chosen_once_every_broker_reported() -> None:
    s = st.new_state()
    for node, cseq in ((2, 400), (1, 900)):
        st.apply(s, _report(node, cseq))
        assert s.recovery_winner is None  # two of three: wait (the third may be ahead)
    st.apply(s, _report(3, 900))
    assert s.recovery_winner == (1, 101)  # 900 twice: the lower node
    assert s.incarnation == 0  # the chosen state arrives as RecoveryChunks
    st.apply(s, _report(4, 5000))  # too late: the choice stands
    assert s.recovery_winner == (1, 101)
    # A member that joins now takes the same choice with the state.
    assert st.restore_untrusted(st.snapshot(s)).recovery_winner == (1, 101)


def test_no_journal_anywhere_starts_the_site_from_nothing() -> None:
    s = st.new_state()
    for node in (3, 1, 2):
        st.apply(s, _report(node, 0, incarnation=0))
    assert s.recovery_winner is None
    assert (s.cluster, s.incarnation) == ("site-p", 1001)  # the lowest broker's proposal
    st.apply(s, _report(1, 50))  # the site is live: ignored
    assert s.incarnation == 1001 and s.recovery_winner is None


def test_durable_keeps_the_highest_watermark() -> None:
    s = st.new_state()
    st.apply(s, pc.Durable(1, 40))
    st.apply(s, pc.Durable(2, 30))
    assert s.durable_cseq == 40


def test_a_forced_recovery_chooses_the_most_advanced_of_those_that_reported() -> None:
    s = st.new_state()
    for node, cseq in ((3, 400), (2, 900)):
        st.apply(s, _report(node, cseq))
    assert s.recovery_winner is None  # node 1 is gone for good: the site would wait forever
    st.apply(s, pc.ForceRecovery("site-p", 1_700_000_000_000_000))
    assert s.recovery_winner == (2, 102)
    assert s.incarnation == 0  # the chosen state arrives as RecoveryChunks
    st.apply(s, _report(1, 5000))  # back too late: the choice stands
    assert s.recovery_winner == (2, 102)
    assert st.restore_untrusted(st.snapshot(s)).recovery_winner == (2, 102)


def test_a_forced_recovery_of_empty_journals_starts_the_site_from_nothing() -> None:
    s = st.new_state()
    for node in (3, 2):
        st.apply(s, _report(node, 0, incarnation=0))
    st.apply(s, pc.ForceRecovery("site-p", 1))
    assert s.recovery_winner is None
    assert (s.cluster, s.incarnation) == ("site-p", 1002)  # the lowest reporter's proposal


def test_a_forced_recovery_without_reports_or_on_a_live_site_is_ignored() -> None:
    s = st.new_state()
    st.apply(s, pc.ForceRecovery("site-p", 1))  # nobody reported: nothing to choose from
    assert (s.recovery_winner, s.incarnation) == (None, 0)
    assert s.counters["ignored"] == 1
    st.apply(s, pc.Genesis("site-p", 42))
    st.apply(s, pc.ForceRecovery("site-p", 2))
    assert (s.recovery_winner, s.incarnation) == (None, 42)
    assert s.counters["ignored"] == 2


def test_a_choice_that_may_lose_history_is_flagged() -> None:
    """Forced before every broker reported, or with an empty journal among
    non-empty ones (a new or re-seeded disk): D may hold commands the chosen
    journal lacks, so the site must not reuse their cseqs as the same
    incarnation."""
    complete = st.new_state()
    for node, cseq in ((1, 900), (2, 900), (3, 400)):
        st.apply(complete, _report(node, cseq))
    assert complete.recovery_winner is not None
    assert not st.recovery_loses_history(complete)

    forced = st.new_state()
    for node, cseq in ((2, 900), (3, 400)):
        st.apply(forced, _report(node, cseq))
    assert not st.recovery_loses_history(forced)  # nothing chosen yet
    st.apply(forced, pc.ForceRecovery("site-p", 1))
    assert st.recovery_loses_history(forced)

    reseeded = st.new_state()
    for node, cseq in ((1, 0), (2, 900), (3, 900)):
        st.apply(reseeded, _report(node, cseq))
    assert reseeded.recovery_winner == (2, 102)
    assert st.recovery_loses_history(reseeded)
